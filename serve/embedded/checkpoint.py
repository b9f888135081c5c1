"""Deterministic tiny checkpoints for tests and the embedded default model.

`ensure_checkpoint()` returns a directory holding a complete Hugging Face style checkpoint:
`config.json`, `model.safetensors` (random weights from a fixed seed), `generation_config.json`,
`tokenizer.json` + `tokenizer_config.json` (the embedded byte-level BPE), `chat_template.jinja`
(our Qwen3.5 chat format) and whatever extra files the architecture needs (`preprocessor_config.json`
for one that takes images). It is built once and cached on disk under a directory named by a hash
of everything that determines its bytes, so a changed writer, tokenizer or template gets a fresh
directory and an unchanged one is reused.

The architecture is pluggable: an `ArchitectureWriter` says how to write `config.json`, the weights
and any extra files for one architecture. Registered here, all from `qwen35.tiny`'s dense hybrid
except the baseline:

- `Qwen3_5ForConditionalGeneration` (the default, what `qwen35-serve` serves with no model given):
  the decoder plus a one-block vision tower whose merger maps into the decoder's width, its image
  token ids the embedded tokenizer's `<|image_pad|>`, `<|vision_start|>` and `<|vision_end|>`, and
  a `preprocessor_config.json` that resizes images to between 64 x 64 and 256 x 256 pixels (4 to
  64 image tokens; up to 113 for an extreme aspect ratio), so images cost little on a CPU;
- `Qwen3_5ForCausalLM`: the same decoder, text only;
- `Qwen3ForCausalLM` (built into vLLM; a baseline for testing vLLM without our plugin).

Others can be added with `register_architecture()` or named as `"package.module:ATTRIBUTE"`,
imported on first use.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.embedded.tokenizer import CONTROL_TOKENS, EOS_TOKEN, PAD_TOKEN, tokenizer_config, train_tokenizer

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
DEFAULT_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
# the embedded vision model's image bounds: one image token covers 32 x 32 pixels
EMBEDDED_MIN_PIXELS = 64 * 64
EMBEDDED_MAX_PIXELS = 256 * 256
DEFAULT_MAX_POSITION = 4096
CACHE_ENV = "QWEN35_CACHE_DIR"


@dataclass(frozen=True)
class ArchitectureWriter:
    """How to write one architecture's `config.json`, weights and extra files.

    `config(vocab_size, max_position, special_ids)` returns the config dict (without `architectures`,
    which is filled in from `architecture`); `weights(config, seed)` returns the named tensors, and
    must be a pure function of its arguments; `files(config)`, when given, returns further files by
    name (their text is part of the cache key). Bump `version` whenever a function's output
    changes, so cached checkpoints are rebuilt.
    """

    architecture: str
    version: str
    config: Callable[[int, int, dict[str, int]], dict]
    weights: Callable[[dict, int], dict[str, torch.Tensor]]
    files: Callable[[dict], dict[str, str]] | None = None


_WRITERS: dict[str, ArchitectureWriter] = {}


def register_architecture(writer: ArchitectureWriter) -> None:
    """Make `writer` available under `writer.architecture` (replacing an earlier one)."""
    _WRITERS[writer.architecture] = writer


def get_writer(architecture: str) -> ArchitectureWriter:
    """A registered writer by architecture name, or one imported from `"module:attribute"`."""
    if architecture in _WRITERS:
        return _WRITERS[architecture]
    if ":" in architecture:
        module_name, _, attribute = architecture.partition(":")
        writer = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(writer, ArchitectureWriter):
            raise ValueError(f"{architecture!r} is a {type(writer).__name__}, not an ArchitectureWriter")
        return writer
    raise ValueError(f"unknown architecture {architecture!r}; registered: {sorted(_WRITERS)} (or 'module:attribute')")


# ---------------------------------------------------------------------------------------------
# Qwen3ForCausalLM: 2 layers, hidden 128, two 64-wide query heads over one KV head (vLLM's CPU
# attention rejects head_dim 32), float32: with bf16 logits a random model meets exact ties at the top,
# which makes greedy and top_k=1 legitimately disagree. The output head is not tied to the embedding: a tied random
# model mostly repeats its last input token, an untied one writes varied text.


def _qwen3_config(vocab_size: int, max_position: int, special_ids: dict[str, int]) -> dict:
    return {
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": special_ids[PAD_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
        "dtype": "float32",
    }


def _qwen3_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_width = config["num_attention_heads"] * head_dim
    kv_width = config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors.update(
            {
                prefix + "input_layernorm.weight": torch.ones(hidden),
                prefix + "self_attn.q_proj.weight": normal(q_width, hidden),
                prefix + "self_attn.k_proj.weight": normal(kv_width, hidden),
                prefix + "self_attn.v_proj.weight": normal(kv_width, hidden),
                prefix + "self_attn.o_proj.weight": normal(hidden, q_width),
                prefix + "self_attn.q_norm.weight": torch.ones(head_dim),
                prefix + "self_attn.k_norm.weight": torch.ones(head_dim),
                prefix + "post_attention_layernorm.weight": torch.ones(hidden),
                prefix + "mlp.gate_proj.weight": normal(inter, hidden),
                prefix + "mlp.up_proj.weight": normal(inter, hidden),
                prefix + "mlp.down_proj.weight": normal(hidden, inter),
            }
        )
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return {name: t.contiguous() for name, t in tensors.items()}


register_architecture(ArchitectureWriter("Qwen3ForCausalLM", "3", _qwen3_config, _qwen3_weights))


# ---------------------------------------------------------------------------------------------
# Qwen3_5ForCausalLM: qwen35.tiny's dense hybrid (3 GDN layers + 1 gated-attention layer), with the
# embedded tokenizer's vocabulary and special ids. Served through our vLLM plugin, not built into
# vLLM. qwen35.tiny is imported on first use; its source is part of the cache key.


def _qwen35_spec(vocab_size: int, max_position: int, seed: int = 0):
    from qwen35.tiny import TinySpec

    return TinySpec(moe=False, seed=seed, overrides={"vocab_size": vocab_size, "max_position_embeddings": max_position})


def _qwen35_config(vocab_size: int, max_position: int, special_ids: dict[str, int]) -> dict:
    from qwen35.tiny import config_json

    config = config_json(_qwen35_spec(vocab_size, max_position))
    del config["architectures"]
    config.update(
        bos_token_id=special_ids[PAD_TOKEN], eos_token_id=special_ids[EOS_TOKEN], pad_token_id=special_ids[PAD_TOKEN]
    )
    return config


def _qwen35_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    from qwen35.tiny import checkpoint_tensors

    return checkpoint_tensors(_qwen35_spec(config["vocab_size"], config["max_position_embeddings"], seed))


def _source_digest(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "missing"
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:12]


register_architecture(
    ArchitectureWriter("Qwen3_5ForCausalLM", "1-" + _source_digest("qwen35.tiny"), _qwen35_config, _qwen35_weights)
)


# ---------------------------------------------------------------------------------------------
# Qwen3_5ForConditionalGeneration: the same decoder under model.language_model.*, qwen35.tiny's one-block vision
# tower under model.visual.* (random, seeded), the image token ids of the embedded tokenizer. qwen35.tiny's and
# qwen35.vision_checkpoint's sources are part of the cache key.


def _qwen35_vl_spec(vocab_size: int, max_position: int, seed: int = 0):
    from qwen35.tiny import TinySpec

    return TinySpec(
        moe=False,
        conditional=True,
        seed=seed,
        overrides={"vocab_size": vocab_size, "max_position_embeddings": max_position},
    )


def _qwen35_vl_config(vocab_size: int, max_position: int, special_ids: dict[str, int]) -> dict:
    from qwen35.tiny import config_json

    config = config_json(_qwen35_vl_spec(vocab_size, max_position))
    del config["architectures"]
    ids = dict(
        bos_token_id=special_ids[PAD_TOKEN], eos_token_id=special_ids[EOS_TOKEN], pad_token_id=special_ids[PAD_TOKEN]
    )
    config["text_config"].update(ids)
    config.update(
        ids,
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
    )
    return config


def _qwen35_vl_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    from qwen35.tiny import checkpoint_tensors

    text = config["text_config"]
    tensors = checkpoint_tensors(_qwen35_vl_spec(text["vocab_size"], text["max_position_embeddings"], seed))
    return {name: t for name, t in tensors.items() if not name.startswith("mtp.")}  # no MTP head to skip


def _qwen35_vl_files(config: dict) -> dict[str, str]:
    from qwen35.tiny import preprocessor_json

    text = config["text_config"]
    processor = preprocessor_json(_qwen35_vl_spec(text["vocab_size"], text["max_position_embeddings"]))
    processor["size"] = {"shortest_edge": EMBEDDED_MIN_PIXELS, "longest_edge": EMBEDDED_MAX_PIXELS}
    return {"preprocessor_config.json": json.dumps(processor, indent=2, sort_keys=True) + "\n"}


register_architecture(
    ArchitectureWriter(
        "Qwen3_5ForConditionalGeneration",
        "1-" + _source_digest("qwen35.tiny") + "-" + _source_digest("qwen35.vision_checkpoint"),
        _qwen35_vl_config,
        _qwen35_vl_weights,
        _qwen35_vl_files,
    )
)


# ---------------------------------------------------------------------------------------------


def _padded(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def _generation_config(special_ids: dict[str, int]) -> dict:
    # Only token ids: sampling defaults here would silently change what requests without them mean.
    return {
        "bos_token_id": special_ids[PAD_TOKEN],
        "eos_token_id": [special_ids[EOS_TOKEN], special_ids[PAD_TOKEN]],
        "pad_token_id": special_ids[PAD_TOKEN],
    }


def _plan(architecture: str, max_position: int, seed: int) -> tuple[ArchitectureWriter, dict[str, str], str]:
    """Everything that determines the checkpoint's bytes (except weights), and its cache key."""
    writer = get_writer(architecture)
    tokenizer = train_tokenizer()
    special_ids = {token: tokenizer.token_to_id(token) for token in CONTROL_TOKENS}
    config = {"architectures": [writer.architecture]}
    config.update(writer.config(_padded(tokenizer.get_vocab_size()), max_position, special_ids))
    files = {
        "config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
        "generation_config.json": json.dumps(_generation_config(special_ids), indent=2) + "\n",
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config(max_position), indent=2) + "\n",
        "chat_template.jinja": TEMPLATE_PATH.read_text(),
    }
    if writer.files is not None:
        files.update(writer.files(config))
    digest = hashlib.sha256(f"{writer.architecture}|{writer.version}|seed={seed}".encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return writer, files, digest.hexdigest()[:16]


def write_checkpoint(
    directory: Path, architecture: str = DEFAULT_ARCHITECTURE, max_position: int = DEFAULT_MAX_POSITION, seed: int = 0
) -> Path:
    """Write the checkpoint into `directory` (created; existing files are overwritten)."""
    from safetensors.torch import save_file

    writer, files, _ = _plan(architecture, max_position, seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    config = json.loads(files["config.json"])
    save_file(writer.weights(config, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def default_cache_root() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "qwen35")
    return Path(root) / "embedded"


def ensure_checkpoint(
    architecture: str = DEFAULT_ARCHITECTURE,
    cache_root: Path | None = None,
    max_position: int = DEFAULT_MAX_POSITION,
    seed: int = 0,
) -> Path:
    """Path of the cached checkpoint for these arguments, building it first if it is missing."""
    writer, _, key = _plan(architecture, max_position, seed)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / f"{writer.architecture}-{key}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent or interrupted build never leaves a half
    # checkpoint under the final name.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_checkpoint(staging, architecture, max_position, seed)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
