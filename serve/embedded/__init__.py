"""The embedded default model's parts: a byte-level BPE tokenizer trained on our own corpus, our
Qwen3.5 chat template, and a deterministic tiny checkpoint writer cached on disk."""
