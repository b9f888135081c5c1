"""The model a ``qwen35-tune`` run tunes for: a preset, an HF ``config.json`` or a checkpoint directory, sharded over a
tensor-parallel size into the per-rank shapes the tuned kernels see.

Presets hold the published Qwen3.5 sizes (the fields the tuned kernels read, plus what the config reader requires):
GDN key / value heads and head dims, hidden size, experts, picks and expert width. Under tensor parallelism each rank
holds ``1/tp`` of the GDN heads, of the attention heads and of every expert's intermediate width (all experts on
every rank); key-value heads are replicated where there are fewer than ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qwen35.config import Qwen35Config

TPS = (1, 2, 4, 8)


class BadInput(ValueError):
    """A command-line value that cannot be used; the message is one line naming it and what is accepted."""


def _preset(arch: str, layers: int, hidden: int, heads: int, kv: int, gdn_v_heads: int, **mlp: int) -> dict:
    return dict(architectures=[arch], vocab_size=248320, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=256, rope_theta=10_000_000.0,
                partial_rotary_factor=0.25, linear_num_key_heads=16, linear_num_value_heads=gdn_v_heads,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, **mlp)


PRESETS: dict[str, dict] = {
    "27b": _preset("Qwen3_5ForCausalLM", 64, 5120, 24, 4, 48, intermediate_size=17408),
    "35b-a3b": _preset("Qwen3_5MoeForCausalLM", 40, 2048, 16, 2, 32, num_experts=256, num_experts_per_tok=8,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "122b-a10b": _preset("Qwen3_5MoeForCausalLM", 48, 3072, 32, 2, 64, num_experts=256, num_experts_per_tok=8,
                         moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    "397b-a17b": _preset("Qwen3_5MoeForCausalLM", 60, 4096, 32, 2, 64, num_experts=512, num_experts_per_tok=10,
                         moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
}
# The tensor-parallel sizes each preset is usually served at (the H200 configs that ship are tuned there).
USUAL_TP: dict[str, tuple[int, ...]] = {"27b": (1, 4), "35b-a3b": (1,), "122b-a10b": (4,), "397b-a17b": (8,)}


@dataclass(frozen=True)
class RankShapes:
    """What one tensor-parallel rank's tuned kernels see."""

    model: str
    tp: int
    hidden: int
    gdn_key_heads: int  # H of the GDN kernels
    gdn_value_heads: int  # HV
    key_dim: int  # K
    value_dim: int  # V
    experts: int = 0  # E (every expert on every rank); 0: a dense model
    top_k: int = 0
    expert_width: int = 0  # I on this rank

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def load_model(spec: str) -> tuple[str, Qwen35Config]:
    """(a name for reports, the config) of a preset name, a ``config.json`` path or a checkpoint directory."""
    key = spec.lower()
    if key in PRESETS:
        return key, Qwen35Config.from_dict(PRESETS[key])
    path = Path(spec)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        if path.is_dir():
            raise BadInput(f"--model {spec}: the directory has no config.json")
        raise BadInput(f"--model {spec!r}: not a preset ({', '.join(PRESETS)}), a config.json or a checkpoint "
                       "directory")
    try:
        raw = json.loads(file.read_text())
        cfg = Qwen35Config.from_dict(raw)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        why = " ".join(str(e).split())[:200]
        raise BadInput(f"--model {file}: malformed config.json ({type(e).__name__}: {why}); expected a Qwen3.5 HF "
                       "config") from None
    name = file.parent.name if file.name == "config.json" else file.stem
    return name or str(file), cfg


def shard(name: str, cfg: Qwen35Config, tp: int) -> RankShapes:
    """The per-rank shapes at tensor-parallel size ``tp``; BadInput when ``tp`` is not accepted or does not divide
    the heads or the expert width."""
    if tp not in TPS:
        raise BadInput(f"--tp {tp}: accepted {', '.join(map(str, TPS))}")
    try:
        cfg.check_tensor_parallel(tp)
    except ValueError as e:
        ok = [str(t) for t in TPS if _divides(cfg, t)]
        raise BadInput(f"--tp {tp} on model {name}: {e}; accepted for it: {', '.join(ok) or 'none'}") from None
    moe = dict(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
               expert_width=cfg.moe_intermediate_size // tp) if cfg.is_moe else {}
    return RankShapes(model=name, tp=tp, hidden=cfg.hidden_size, gdn_key_heads=cfg.linear_num_key_heads // tp,
                      gdn_value_heads=cfg.linear_num_value_heads // tp, key_dim=cfg.linear_key_head_dim,
                      value_dim=cfg.linear_value_head_dim, **moe)


def _divides(cfg: Qwen35Config, tp: int) -> bool:
    try:
        cfg.check_tensor_parallel(tp)
    except ValueError:
        return False
    return True
