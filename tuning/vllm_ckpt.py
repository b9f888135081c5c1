"""Random-weight Qwen3.5 checkpoints for serving comparisons, made on the device, and an HF fp32 reference.

:func:`write_checkpoint` writes a complete ``Qwen3_5MoeForConditionalGeneration`` checkpoint (for the dense 27B
shape ``Qwen3_5ForConditionalGeneration``) that both vLLM's native Qwen3.5 classes and our plugin serve:
``config.json`` from transformers' own ``Qwen3_5MoeConfig`` / ``Qwen3_5Config`` (the text fields of a published
size, :data:`SHAPES`, Qwen3.5-35B-A3B width by default, with ``layers`` decoder layers; the default vision config
projecting to that width, whose tower is never built: serve with ``--language-model-only`` — the checkpoint holds
no tower weights), the hub's on-disk layout (``model.language_model.*``, MoE experts stored one tensor per
expert), random bf16 weights drawn on the GPU from a fixed seed, and a tokenizer: the embedded model's byte-level
BPE and chat template (:mod:`serve.embedded`) with its vocabulary filled up to the model's ``vocab_size`` by
unreachable filler tokens, so every id the model can sample decodes.

Weights are drawn so that the numbers behave like a trained model's where it matters for comparing engines:
matrices N(0, 0.02), zero-centred norm weights near 0, the GDN output norm near 1, decay parameters in their
usual ranges, and a router and LM head at N(0, 0.1): peaked routing and next-token distributions (logit standard
deviation ~4.5), so that bf16 rounding flips few top-k choices and few greedy tokens.

:func:`hf_logprobs` gives the fp32 reference: transformers' ``Qwen3_5MoeForCausalLM`` (``Qwen3_5ForCausalLM``)
built from the same config in fp32 on the GPU, the checkpoint's tensors loaded into it, and the teacher-forced
log-probability of every prompt token after the first.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from tuning.bench_model import WIDTH
from tuning.tune_model import PRESETS

ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
DENSE_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
SHAPES = tuple(PRESETS)  # 27b (dense), 35b-a3b, 122b-a10b, 397b-a17b: the published sizes qwen35-tune knows
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}
MAX_POSITION = 32768
# a reduced shape for the GPU test: the same kinds of layers, small enough to start three servers in a minute
REDUCED = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=8,
               linear_num_value_heads=16, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
               shared_expert_intermediate_size=256, vocab_size=32768)
REDUCED_DENSE = {**{k: v for k, v in REDUCED.items() if k not in MOE_FIELDS}, "intermediate_size": 2048}
PREFIX = "model.language_model."


def shape_fields(shape: str) -> dict:
    """The text fields of a published size (:data:`SHAPES`) over :data:`tuning.bench_model.WIDTH`'s common ones
    (norm epsilon, activation, ...): the MoE fields for the MoE sizes, ``intermediate_size`` for the dense 27B."""
    if shape not in PRESETS:
        raise ValueError(f"shape={shape!r}; accepted: {', '.join(SHAPES)}")
    preset = PRESETS[shape]
    fields = {k: v for k, v in WIDTH.items() if k not in MOE_FIELDS}
    fields.update({k: preset[k] for k in SHAPE_FIELDS})
    if "num_experts" in preset:
        fields.update({k: preset[k] for k in MOE_FIELDS})
    else:
        fields["intermediate_size"] = preset["intermediate_size"]
    return fields


def is_dense(fields: dict) -> bool:
    return "num_experts" not in fields


def text_fields(layers: int, reduced: bool = False, overrides: dict | None = None, shape: str = "35b-a3b") -> dict:
    """The decoder's HF config fields: ``shape``'s width (or :data:`REDUCED` / :data:`REDUCED_DENSE`, then
    ``overrides``), ``layers`` layers, every 4th one full attention."""
    if layers < 1:
        raise ValueError(f"layers={layers} must be >= 1")
    base = shape_fields(shape)
    fields = {**base, **((REDUCED_DENSE if is_dense(base) else REDUCED) if reduced else {}), **(overrides or {})}
    fields.update(num_hidden_layers=layers, max_position_embeddings=MAX_POSITION, rope_parameters=dict(ROPE),
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    return fields


def padded_tokenizer(vocab_size: int):
    """The embedded tokenizer (:func:`serve.embedded.tokenizer.train_tokenizer`) with filler tokens at every id it
    leaves free below ``vocab_size``: each decodes to a distinct lower-case string, and no merge produces one."""
    from tokenizers import Tokenizer

    from serve.embedded.tokenizer import train_tokenizer

    raw = json.loads(train_tokenizer().to_str())
    vocab = raw["model"]["vocab"]
    for added in raw["added_tokens"]:  # in the model's vocabulary too, so that they keep their ids
        vocab[added["content"]] = added["id"]
    used = set(vocab.values())
    if max(used) >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {max(used) + 1} ids")
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i in range(vocab_size):
        if i not in used:
            name, n = "", i
            while True:
                name, n = letters[n % 26] + name, n // 26
                if not n:
                    break
            vocab["zq" + name] = i
    tokenizer = Tokenizer.from_str(json.dumps(raw))
    moved = [t["content"] for t in raw["added_tokens"] if tokenizer.token_to_id(t["content"]) != t["id"]]
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size or moved:
        raise RuntimeError(f"padded tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} ids (expected "
                           f"{vocab_size}); added tokens that moved: {moved}")
    return tokenizer


def learned_token_range() -> int:
    """Ids below this are tokens the BPE learned (prompts drawn from them look like real text to every engine)."""
    from serve.embedded.tokenizer import train_tokenizer

    return train_tokenizer().get_vocab_size(with_added_tokens=False)


def _digest(fields: dict, seed: int) -> str:
    src = Path(__file__).read_bytes()
    return hashlib.sha256(json.dumps([fields, seed], sort_keys=True).encode() + src).hexdigest()[:12]


def _tensors(fields: dict, seed: int, device: str) -> dict[str, torch.Tensor]:
    """Every decoder tensor under its on-disk name, bf16, drawn on ``device`` from ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16

    def normal(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return torch.empty(*shape, device=device, dtype=torch.float32).normal_(mean, std, generator=g).to(bf16)

    f = fields
    H, V = f["hidden_size"], f["vocab_size"]
    HK, HV, K, Vd = f["linear_num_key_heads"], f["linear_num_value_heads"], f["linear_key_head_dim"], \
        f["linear_value_head_dim"]
    NH, KV, D = f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"]
    out = {PREFIX + "embed_tokens.weight": normal(V, H), PREFIX + "norm.weight": normal(H),
           "lm_head.weight": normal(V, H, std=0.1)}
    for i, kind in enumerate(f["layer_types"]):
        p = f"{PREFIX}layers.{i}."
        out[p + "input_layernorm.weight"] = normal(H)
        out[p + "post_attention_layernorm.weight"] = normal(H)
        if kind == "linear_attention":
            la, conv = p + "linear_attn.", 2 * HK * K + HV * Vd
            out[la + "in_proj_qkv.weight"] = normal(conv, H)
            out[la + "in_proj_z.weight"] = normal(HV * Vd, H)
            out[la + "in_proj_b.weight"] = normal(HV, H)
            out[la + "in_proj_a.weight"] = normal(HV, H)
            out[la + "conv1d.weight"] = normal(conv, 1, f["linear_conv_kernel_dim"], std=0.1)
            a = torch.empty(HV, device=device).uniform_(1.0, 16.0, generator=g)
            out[la + "A_log"] = a.log().to(bf16)
            out[la + "dt_bias"] = normal(HV, std=0.1, mean=1.0)
            out[la + "norm.weight"] = normal(Vd, mean=1.0)
            out[la + "out_proj.weight"] = normal(H, HV * Vd)
        else:
            sa = p + "self_attn."
            out[sa + "q_proj.weight"] = normal(NH * 2 * D, H)
            out[sa + "k_proj.weight"] = normal(KV * D, H)
            out[sa + "v_proj.weight"] = normal(KV * D, H)
            out[sa + "o_proj.weight"] = normal(H, NH * D)
            out[sa + "q_norm.weight"] = normal(D)
            out[sa + "k_norm.weight"] = normal(D)
        mp = p + "mlp."
        if is_dense(f):
            out[mp + "gate_proj.weight"] = normal(f["intermediate_size"], H)
            out[mp + "up_proj.weight"] = normal(f["intermediate_size"], H)
            out[mp + "down_proj.weight"] = normal(H, f["intermediate_size"])
            continue
        E, I, Is = f["num_experts"], f["moe_intermediate_size"], f["shared_expert_intermediate_size"]
        out[mp + "gate.weight"] = normal(E, H, std=0.1)
        for e in range(E):
            out[mp + f"experts.{e}.gate_proj.weight"] = normal(I, H)
            out[mp + f"experts.{e}.up_proj.weight"] = normal(I, H)
            out[mp + f"experts.{e}.down_proj.weight"] = normal(H, I)
        out[mp + "shared_expert.gate_proj.weight"] = normal(Is, H)
        out[mp + "shared_expert.up_proj.weight"] = normal(Is, H)
        out[mp + "shared_expert.down_proj.weight"] = normal(H, Is)
        out[mp + "shared_expert_gate.weight"] = normal(1, H)
    return out


def write_checkpoint(root: str | os.PathLike, layers: int = 8, seed: int = 0, reduced: bool = False,
                     device: str = "cuda", shard_bytes: int = 4 << 30, overrides: dict | None = None,
                     shape: str = "35b-a3b") -> Path:
    """The checkpoint directory under ``root`` for these arguments, written first if it is not complete."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from serve.embedded.checkpoint import TEMPLATE_PATH
    from serve.embedded.tokenizer import CONTROL_TOKENS, EOS_TOKEN, PAD_TOKEN, tokenizer_config

    fields = text_fields(layers, reduced, overrides, shape)
    path = Path(root) / f"qwen35-{shape}-{layers}l{'-reduced' if reduced else ''}-{_digest(fields, seed)}"
    if (path / "DONE").is_file():
        return path
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = padded_tokenizer(fields["vocab_size"])
    ids = {t: tokenizer.token_to_id(t) for t in CONTROL_TOKENS}
    fields = dict(fields, eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN], bos_token_id=None)
    # the default tower (never built: --language-model-only), projecting to this decoder's width as the hub's does
    config_class = Qwen3_5Config if is_dense(fields) else Qwen3_5MoeConfig
    config = config_class(text_config=fields, vision_config={"out_hidden_size": fields["hidden_size"]},
                          tie_word_embeddings=False)
    config.architectures = [DENSE_ARCHITECTURE if is_dense(fields) else ARCHITECTURE]
    config.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"), pretty=False)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(MAX_POSITION), indent=2) + "\n")
    (path / "chat_template.jinja").write_text(TEMPLATE_PATH.read_text())
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]], "pad_token_id": ids[PAD_TOKEN]}, indent=2) + "\n")
    tensors = _tensors(fields, seed, device)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards, current, size = [], [], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    weight_map = {}
    for j, names in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        # popped as they are written: the device holds no copy once the checkpoint is on disk
        save_file({k: tensors.pop(k).contiguous().cpu() for k in names}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if device != "cpu":
        torch.cuda.empty_cache()
    (path / "DONE").write_text(f"{total} bytes in {len(shards)} shards, {time.perf_counter() - t0:.1f} s\n")
    return path


def _hf_state(path: Path, fields: dict, device: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under transformers' ``Qwen3_5MoeForCausalLM`` names (experts fused per layer)."""
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    raw: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(path / fname), framework="pt", device=device) as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                raw[k] = f.get_tensor(k)
    state = {}
    for name, t in raw.items():
        if ".mlp.experts." in name:
            continue
        state["model." + name[len(PREFIX):] if name.startswith(PREFIX) else name] = t
    if is_dense(fields):
        return state
    E = fields["num_experts"]
    for i in range(fields["num_hidden_layers"]):
        p = f"{PREFIX}layers.{i}.mlp.experts."
        gate_up = torch.stack([torch.cat([raw[f"{p}{e}.gate_proj.weight"], raw[f"{p}{e}.up_proj.weight"]])
                               for e in range(E)])
        down = torch.stack([raw[f"{p}{e}.down_proj.weight"] for e in range(E)])
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
        state[f"model.layers.{i}.mlp.experts.down_proj"] = down
    return state


@torch.no_grad()
def hf_logprobs(path: str | os.PathLike, prompts: list[list[int]], device: str = "cuda") -> list[list[float]]:
    """Teacher-forced fp32 log-probabilities of ``prompt[1:]`` for each prompt, from transformers'
    ``Qwen3_5MoeForCausalLM`` (``Qwen3_5ForCausalLM`` for a dense checkpoint) with the checkpoint's weights (one
    prompt per forward: no padding)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    path = Path(path)
    fields = json.loads((path / "config.json").read_text())["text_config"]
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device(device):
            # the experts' plain loop: grouped GEMMs are bf16 kernels
            if is_dense(fields):
                model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields)).eval()
            else:
                model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields, experts_implementation="eager")).eval()
    finally:
        torch.set_default_dtype(default)
    state = {k: v.float() for k, v in _hf_state(path, fields, device).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"HF reference: missing {missing[:5]}, unexpected {unexpected[:5]}")
    del state
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(lp.tolist())
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return out
