"""Deterministic tiny random Qwen3.5 checkpoints (dense and MoE) in the HF on-disk layout.

For tests and benchmarks: ``config.json`` plus safetensors shards with HF's tensor names, the
``*ForCausalLM`` layout (``model.*``) or the ``*ForConditionalGeneration`` layout
(``model.language_model.*``, a whole one-block vision tower under ``model.visual.*``, an
``mtp.*`` tensor every loader skips, and a ``preprocessor_config.json`` whose pixel bounds keep
images at 4 to 16 tokens); MoE experts fused (transformers 5) or per expert (hub checkpoints). No
tokenizer: drive the model with token ids. Sizes respect what vLLM's CPU build needs
(attention head_dim 64, GDN K == V).

    python -m qwen35.tiny OUT_DIR [--moe] [--conditional] [--per-expert]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

import torch

TINY_TEXT = dict(
    vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
    hidden_act="silu", rope_theta=10000.0, partial_rotary_factor=0.25,
)
TINY_DENSE = dict(intermediate_size=256)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
TINY_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16, spatial_merge_size=2,
                   temporal_patch_size=2, in_channels=3, num_position_embeddings=64)
# one merged token covers 32 x 32 pixels: images resize to between 64 x 64 (4 tokens) and 128 x 128 (16 tokens)
TINY_PIXELS = dict(min_pixels=64 * 64, max_pixels=128 * 128)


@dataclass
class TinySpec:
    moe: bool = False
    conditional: bool = False  # *ForConditionalGeneration layout (text under model.language_model.)
    per_expert: bool = False  # MoE experts stored one tensor per expert (hub layout)
    shards: int = 2
    seed: int = 0
    dtype: torch.dtype = torch.float32
    overrides: dict = field(default_factory=dict)  # text-config fields to change

    @property
    def architecture(self) -> str:
        return f"Qwen3_5{'Moe' if self.moe else ''}For{'ConditionalGeneration' if self.conditional else 'CausalLM'}"


def text_config(spec: TinySpec) -> dict:
    """The decoder's HF config fields (what ``text_config`` holds, or the top level for CausalLM)."""
    t = {**TINY_TEXT, **(TINY_MOE if spec.moe else TINY_DENSE), **spec.overrides}
    n = t["num_hidden_layers"]
    t["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    rope = {"rope_type": "default", "rope_theta": t.pop("rope_theta"),
            "partial_rotary_factor": t.pop("partial_rotary_factor")}
    if spec.conditional:
        rope.update(mrope_section=[11, 11, 10], mrope_interleaved=True)
    t["rope_parameters"] = rope
    t["model_type"] = "qwen3_5_moe_text" if spec.moe else "qwen3_5_text"
    t.update(attn_output_gate=True, tie_word_embeddings=False, bos_token_id=None, eos_token_id=t["vocab_size"] - 1,
             pad_token_id=None, dtype=str(spec.dtype).replace("torch.", ""))
    return t


def config_json(spec: TinySpec) -> dict:
    text = text_config(spec)
    if not spec.conditional:
        return {"architectures": [spec.architecture], **text}
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"],
                  model_type="qwen3_5_moe_vision" if spec.moe else "qwen3_5_vision")
    return {"architectures": [spec.architecture], "model_type": "qwen3_5_moe" if spec.moe else "qwen3_5",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
            "image_token_id": 1000, "video_token_id": 1001, "vision_start_token_id": 1002,
            "vision_end_token_id": 1003, "dtype": text["dtype"]}


def preprocessor_json(spec: TinySpec) -> dict:
    """``preprocessor_config.json`` of a ConditionalGeneration checkpoint (HF's Qwen2-VL processor fields)."""
    v = TINY_VISION
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": v["patch_size"],
            "temporal_patch_size": v["temporal_patch_size"], "merge_size": v["spatial_merge_size"],
            "size": {"shortest_edge": TINY_PIXELS["min_pixels"], "longest_edge": TINY_PIXELS["max_pixels"]},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "resample": 3}


def text_tensors(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Decoder tensors under HF's names (relative to the text prefix), seeded and reproducible."""
    t = text_config(spec)
    g = torch.Generator().manual_seed(spec.seed)

    def rnd(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std + mean).to(spec.dtype)

    H, V = t["hidden_size"], t["vocab_size"]
    out = {"embed_tokens.weight": rnd(V, H, std=1.0), "norm.weight": rnd(H, std=0.1)}
    HK, HV, K, Vd = (t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
                     t["linear_value_head_dim"])
    NH, KV, D = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    for i, lt in enumerate(t["layer_types"]):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = rnd(H, std=0.1)
        out[p + "post_attention_layernorm.weight"] = rnd(H, std=0.1)
        if lt == "linear_attention":
            la = p + "linear_attn."
            conv = 2 * HK * K + HV * Vd
            out[la + "in_proj_qkv.weight"] = rnd(conv, H, std=0.1)
            out[la + "in_proj_z.weight"] = rnd(HV * Vd, H, std=0.1)
            out[la + "in_proj_b.weight"] = rnd(HV, H, std=0.1)
            out[la + "in_proj_a.weight"] = rnd(HV, H, std=0.1)
            out[la + "conv1d.weight"] = rnd(conv, 1, t["linear_conv_kernel_dim"], std=0.3)
            out[la + "A_log"] = torch.empty(HV).uniform_(1.0, 16.0, generator=g).log().to(spec.dtype)
            out[la + "dt_bias"] = rnd(HV, std=0.5, mean=1.0)
            out[la + "norm.weight"] = rnd(Vd, std=0.1, mean=1.0)
            out[la + "out_proj.weight"] = rnd(H, HV * Vd, std=0.05)
        else:
            sa = p + "self_attn."
            out[sa + "q_proj.weight"] = rnd(NH * 2 * D, H, std=0.1)
            out[sa + "k_proj.weight"] = rnd(KV * D, H, std=0.1)
            out[sa + "v_proj.weight"] = rnd(KV * D, H, std=0.1)
            out[sa + "q_norm.weight"] = rnd(D, std=0.1)
            out[sa + "k_norm.weight"] = rnd(D, std=0.1)
            out[sa + "o_proj.weight"] = rnd(H, NH * D, std=0.05)
        mp = p + "mlp."
        if spec.moe:
            E, I, Is = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
            out[mp + "gate.weight"] = rnd(E, H, std=0.5)
            gate_up, down = rnd(E, 2 * I, H, std=0.1), rnd(E, H, I, std=0.1)
            if spec.per_expert:
                for e in range(E):
                    out[mp + f"experts.{e}.gate_proj.weight"] = gate_up[e, :I].clone()
                    out[mp + f"experts.{e}.up_proj.weight"] = gate_up[e, I:].clone()
                    out[mp + f"experts.{e}.down_proj.weight"] = down[e].clone()
            else:
                out[mp + "experts.gate_up_proj"], out[mp + "experts.down_proj"] = gate_up, down
            out[mp + "shared_expert.gate_proj.weight"] = rnd(Is, H, std=0.1)
            out[mp + "shared_expert.up_proj.weight"] = rnd(Is, H, std=0.1)
            out[mp + "shared_expert.down_proj.weight"] = rnd(H, Is, std=0.1)
            out[mp + "shared_expert_gate.weight"] = rnd(1, H, std=0.5)
        else:
            I = t["intermediate_size"]
            out[mp + "gate_proj.weight"] = rnd(I, H, std=0.1)
            out[mp + "up_proj.weight"] = rnd(I, H, std=0.1)
            out[mp + "down_proj.weight"] = rnd(H, I, std=0.1)
    out["lm_head.weight"] = rnd(V, H, std=0.5)
    return out


def checkpoint_tensors(spec: TinySpec) -> dict[str, torch.Tensor]:
    """All tensors under their on-disk names for the spec's layout."""
    prefix = "model.language_model." if spec.conditional else "model."
    tensors = {(k if k == "lm_head.weight" else prefix + k): v for k, v in text_tensors(spec).items()}
    if spec.conditional:  # the vision tower, and an MTP tensor as real checkpoints hold (skipped by us)
        from qwen35.vision import VisionConfig
        from qwen35.vision_checkpoint import random_vision_tensors

        cfg = VisionConfig.from_dict(config_json(spec))
        tensors.update(random_vision_tensors(cfg, seed=spec.seed + 1, dtype=spec.dtype))
        g = torch.Generator().manual_seed(spec.seed + 1)
        tensors["mtp.fc.weight"] = torch.randn(8, 8, generator=g).to(spec.dtype)
    return tensors


def write_checkpoint(path: str | os.PathLike, spec: TinySpec | None = None,
                     tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write config.json and safetensors shards (with an index when sharded); returns the path."""
    from safetensors.torch import save_file

    spec = spec or TinySpec()
    tensors = checkpoint_tensors(spec) if tensors is None else tensors
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_json(spec), f, indent=1)
    if spec.conditional:
        with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
            json.dump(preprocessor_json(spec), f, indent=1)
    names = sorted(tensors)
    n = max(1, min(spec.shards, len(names)))
    groups = [names[i::n] for i in range(n)]
    if n == 1:
        save_file({k: tensors[k].contiguous() for k in names}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
        return str(path)
    weight_map = {}
    for j, group in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in group}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen35.tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--conditional", action="store_true", help="*ForConditionalGeneration layout")
    ap.add_argument("--per-expert", action="store_true", help="MoE experts stored per expert (hub layout)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    spec = TinySpec(moe=args.moe, conditional=args.conditional, per_expert=args.per_expert, seed=args.seed)
    print(write_checkpoint(args.out, spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
