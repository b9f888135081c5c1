"""Qwen3.5 configuration, read from an HF ``config.json`` (dense and MoE).

The multimodal checkpoints (``*ForConditionalGeneration``) nest the decoder's fields under
``text_config`` and describe their vision tower in ``vision_config`` (read into
:attr:`Qwen35Config.vision`, with the image token ids); the text-only ones (``*ForCausalLM``) keep
the decoder's fields at the top level and have no tower. Both read into the same
:class:`Qwen35Config`. Only what the model needs is kept; every field is checked once here so the
model code can trust it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

from qwen35.mrope import DEFAULT_MROPE_SECTION
from qwen35.vision import VisionConfig

# architecture name -> (is MoE, text fields nested under "text_config" / weights under "model.language_model.")
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "Qwen3_5ForCausalLM": (False, False),
    "Qwen3_5MoeForCausalLM": (True, False),
    "Qwen3_5ForConditionalGeneration": (False, True),
    "Qwen3_5MoeForConditionalGeneration": (True, True),
}
LAYER_TYPES = ("linear_attention", "full_attention")


class UnknownArchitectureError(ValueError):
    """The checkpoint names an architecture this package does not implement."""


@dataclass(frozen=True)
class Qwen35Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP: dense (intermediate_size) or MoE (num_experts > 0)
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    eos_token_id: tuple[int, ...] = field(default=())
    # multi-axis rotary: rotary frequencies per (time, row, column) position axis, interleaved (qwen35.mrope)
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    # the vision tower and image token ids (ConditionalGeneration checkpoints); None: text only
    vision: VisionConfig | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def nested_text(self) -> bool:
        """Whether the decoder's weights live under ``model.language_model.`` (ConditionalGeneration)."""
        return ARCHITECTURES[self.architecture][1]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v concatenated."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @classmethod
    def from_dict(cls, raw: dict) -> Qwen35Config:
        archs = raw.get("architectures") or []
        if not archs:
            raise UnknownArchitectureError(
                "config.json names no architecture ('architectures' is missing or empty); "
                f"supported: {', '.join(ARCHITECTURES)}")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise UnknownArchitectureError(
                f"unknown architecture {arch!r} in config.json; supported: {', '.join(ARCHITECTURES)}")
        is_moe, nested = ARCHITECTURES[arch]
        text = raw.get("text_config") if nested else raw
        if nested and not isinstance(text, dict):
            raise ValueError(f"{arch} config.json must hold the decoder's fields under 'text_config'")
        cfg = cls._from_text(arch, is_moe, text, top=raw)
        vision = VisionConfig.from_dict(raw) if nested else None
        return replace(cfg, vision=vision) if vision is not None else cfg

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Qwen35Config:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {path}")
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_hf(cls, hf_config: object) -> Qwen35Config:
        """From a transformers ``PretrainedConfig`` (what vLLM hands a model)."""
        return cls.from_dict(hf_config.to_dict())

    @classmethod
    def _from_text(cls, arch: str, is_moe: bool, t: dict, top: dict) -> Qwen35Config:
        def need(key: str):
            if key not in t or t[key] is None:
                raise ValueError(f"{arch} config.json lacks {key!r}")
            return t[key]

        if t.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={t['hidden_act']!r}; Qwen3.5 uses 'silu' only")
        if t.get("attention_bias", False):
            raise ValueError("attention_bias=true is not supported (Qwen3.5 has no attention bias)")
        if not t.get("attn_output_gate", True):
            raise ValueError("attn_output_gate=false is not supported (Qwen3.5 gates its attention output)")
        n_layers = int(need("num_hidden_layers"))
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = int(t.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers or any(lt not in LAYER_TYPES for lt in layer_types):
            raise ValueError(f"layer_types must list {n_layers} entries from {LAYER_TYPES}, got {list(layer_types)}")
        rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default', with optional mrope sections)")
        theta = rope.get("rope_theta", t.get("rope_theta"))
        if theta is None:
            raise ValueError(f"{arch} config.json gives no rope_theta (in rope_parameters or at the top level)")
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        section = rope.get("mrope_section", DEFAULT_MROPE_SECTION)
        if (not isinstance(section, (list, tuple)) or len(section) != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)):
            raise ValueError(f"rope_parameters.mrope_section={section!r}: expected three non-negative integers "
                             "(rotary frequencies for the time, row and column positions)")
        eos = top.get("eos_token_id", t.get("eos_token_id"))
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        common = dict(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(t.get("head_dim") or need("hidden_size") // need("num_attention_heads")),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(need("linear_conv_kernel_dim")),
            eos_token_id=eos,
            mrope_section=tuple(section),
        )
        if is_moe:
            cfg = cls(**common, num_experts=int(need("num_experts")),
                      num_experts_per_tok=int(need("num_experts_per_tok")),
                      moe_intermediate_size=int(need("moe_intermediate_size")),
                      shared_expert_intermediate_size=int(t.get("shared_expert_intermediate_size") or 0),
                      norm_topk_prob=bool(t.get("norm_topk_prob", True)))
        else:
            cfg = cls(**common, intermediate_size=int(need("intermediate_size")))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Shape facts the model relies on; ValueError naming the offending fields."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dim head_dim*partial_rotary_factor = {self.head_dim}*{self.partial_rotary_factor}"
                             " must be an even number in (0, head_dim]")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}")
        if not self.is_moe and self.intermediate_size <= 0:
            raise ValueError("a dense Qwen3.5 config needs intermediate_size > 0")

    def check_tensor_parallel(self, tp_size: int) -> None:
        """ValueError unless every sharded dimension divides by ``tp_size``."""
        splits = {
            "num_attention_heads": self.num_attention_heads,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
        }
        if self.is_moe:
            splits["moe_intermediate_size"] = self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                splits["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        else:
            splits["intermediate_size"] = self.intermediate_size
        bad = [f"{k}={v}" for k, v in splits.items() if v % tp_size]
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            bad.append(f"num_key_value_heads={kv} (neither divides nor is divided by tp)")
        if bad:
            raise ValueError(f"tensor parallel size {tp_size} does not divide: {', '.join(bad)}")
