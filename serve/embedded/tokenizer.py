"""Deterministic byte-level BPE tokenizer for the embedded tiny model.

Trained with the `tokenizers` library on the text in `serve.embedded.corpus` (no downloads). Learned
tokens take ids `0 .. N-1`; the Qwen control tokens follow in a fixed order, the way the real Qwen
vocabulary puts them after the merges. Two kinds of added tokens:

- *control* tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, vision/FIM markers) are special:
  decoding with `skip_special_tokens=True` drops them;
- *markup* tokens (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`,
  `</tool_response>`) are atomic but not special, so they survive decoding: the reasoning and tool
  parsers of the server read them from the generated text.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from serve.embedded.corpus import CORPUS

LEARNED_VOCAB_SIZE = 1024
"""Upper bound on byte alphabet (256) plus merges; the small corpus stops short of it (794 learned)."""

CONTROL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Split text into word-like pieces before byte-level BPE: letters with one leading non-letter,
# single digits (numbers never merge across digits), punctuation runs, newlines, other whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def _corpus_lines() -> list[str]:
    # One training "document" per paragraph keeps the input order (and the merges) fixed.
    return [block for block in CORPUS.split("\n\n") if block.strip()]


def train_tokenizer(vocab_size: int = LEARNED_VOCAB_SIZE) -> Tokenizer:
    """Train the embedded tokenizer; the same input always gives the same vocabulary and merges."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} must exceed the 256-byte alphabet")
    tokenizer = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer, length=None)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
    """`tokenizer_config.json` for transformers' fast tokenizer over `tokenizer.json`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        # Listed so `all_special_tokens` holds every control token: vLLM's reasoning/tool parsers
        # decode with skip_special_tokens off and drop exactly these from the reply text.
        "additional_special_tokens": [t for t in CONTROL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }


def write_tokenizer_files(directory: Path, model_max_length: int) -> Tokenizer:
    """Write `tokenizer.json` and `tokenizer_config.json` into `directory`; return the tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"), pretty=False)
    config = tokenizer_config(model_max_length)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer
