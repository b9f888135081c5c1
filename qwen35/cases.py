"""Self-test cases: one tiny input per op, as a function with the op's name ``(device, dtype, generator) -> Case``.

The probe runs a candidate backend's op on its case and compares it, by relative error, with the reference
computed in fp64 on the CPU (:mod:`qwen35.selftest`). The cases are small but cover the paths that break
first: ragged varlen spanning several chunks, grouped value heads, a state pool with a padded slot, fused
gating and L2 norm, strided views where the model passes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qwen35.reference.moe import moe_route as _reference_route


@dataclass
class Case:
    """An op's arguments, by name (tensors on the probed device, activations in the compute dtype), and the
    ones it updates in place, which the self-test compares too."""

    kwargs: dict
    mutated: list[str] = field(default_factory=list)  # kwargs the op updates in place (pools)


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def gdn_chunk_prefill(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    H, HV, K, V = 2, 4, 64, 64
    lens = [5, 70, 1]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pool = _rand(gen, 5, HV, K, V, dtype=torch.float32, device=device, scale=0.1)
    return Case(
        dict(
            q=_rand(gen, T, H, K, dtype=dtype, device=device),
            k=_rand(gen, T, H, K, dtype=dtype, device=device),
            v=_rand(gen, T, HV, V, dtype=dtype, device=device),
            a=_rand(gen, T, HV, dtype=dtype, device=device),
            b=_rand(gen, T, HV, dtype=dtype, device=device),
            A_log=_rand(gen, HV, dtype=torch.float32, device=device, scale=0.5),
            dt_bias=_rand(gen, HV, dtype=torch.float32, device=device, scale=0.5),
            cu_seqlens=cu,
            state_pool=pool,
            state_slots=torch.tensor([3, 0, -1], dtype=torch.int32, device=device),
            has_initial_state=torch.tensor([True, False, True], device=device),
            use_qk_l2norm=True,
        ),
        mutated=["state_pool"],
    )


def gdn_recurrent_step(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    B, T, H, HV, K, V = 3, 2, 2, 4, 64, 64
    return Case(
        dict(
            q=_rand(gen, B, T, H, K, dtype=dtype, device=device),
            k=_rand(gen, B, T, H, K, dtype=dtype, device=device),
            v=_rand(gen, B, T, HV, V, dtype=dtype, device=device),
            a=_rand(gen, B, T, HV, dtype=dtype, device=device),
            b=_rand(gen, B, T, HV, dtype=dtype, device=device),
            A_log=_rand(gen, HV, dtype=torch.float32, device=device, scale=0.5),
            dt_bias=_rand(gen, HV, dtype=torch.float32, device=device, scale=0.5),
            state_pool=_rand(gen, 4, HV, K, V, dtype=torch.float32, device=device, scale=0.1),
            state_slots=torch.tensor([2, -1, 0], dtype=torch.int32, device=device),
            use_qk_l2norm=True,
        ),
        mutated=["state_pool"],
    )


def causal_conv1d_prefill(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    D, W, lens = 48, 4, [2, 9, 1]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return Case(
        dict(
            x=_rand(gen, T, D, dtype=dtype, device=device),
            weight=_rand(gen, D, W, dtype=dtype, device=device, scale=0.5),
            bias=_rand(gen, D, dtype=dtype, device=device),
            cu_seqlens=cu,
            conv_pool=_rand(gen, 4, D, W - 1, dtype=dtype, device=device),
            conv_slots=torch.tensor([1, 3, -1], dtype=torch.int32, device=device),
            has_initial_state=torch.tensor([True, False, True], device=device),
            activation="silu",
        ),
        mutated=["conv_pool"],
    )


def causal_conv1d_update(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    B, D, W = 3, 48, 4
    return Case(
        dict(
            x=_rand(gen, B, D, dtype=dtype, device=device),
            weight=_rand(gen, D, W, dtype=dtype, device=device, scale=0.5),
            bias=None,
            conv_pool=_rand(gen, 4, D, W - 1, dtype=dtype, device=device),
            conv_slots=torch.tensor([3, -1, 0], dtype=torch.int32, device=device),
            activation="silu",
        ),
        mutated=["conv_pool"],
    )


def rms_norm_gated(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    x, z = (_rand(gen, 7, 4, 64, dtype=dtype, device=device) for _ in range(2))
    return Case(dict(x=x, z=z, weight=_rand(gen, 64, dtype=dtype, device=device), eps=1e-6))


def rms_norm_zero_centered(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    x, residual = (_rand(gen, 7, 96, dtype=dtype, device=device) for _ in range(2))
    weight = _rand(gen, 96, dtype=dtype, device=device, scale=0.1)
    return Case(dict(x=x, weight=weight, eps=1e-6, residual=residual))


def _moe_tensors(device, dtype, gen, E=8, H=64, I=32):
    return dict(
        w13=_rand(gen, E, 2 * I, H, dtype=dtype, device=device, scale=H**-0.5),
        w2=_rand(gen, E, H, I, dtype=dtype, device=device, scale=I**-0.5),
    )


def moe_route(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    return Case(dict(router_logits=_rand(gen, 9, 16, dtype=dtype, device=device), top_k=4, renormalize=True))


def moe_experts(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    M, E, k = 9, 8, 2
    logits = torch.randn(M, E, generator=gen)
    weights, ids = _reference_route(logits, k)
    return Case(dict(x=_rand(gen, M, 64, dtype=dtype, device=device), **_moe_tensors(device, dtype, gen),
                     topk_weights=weights.to(device), topk_ids=ids.to(device), expert_map=None))


def moe_block(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    H, Is = 64, 32
    return Case(dict(
        x=_rand(gen, 9, H, dtype=dtype, device=device),
        router_weight=_rand(gen, 8, H, dtype=dtype, device=device),
        **_moe_tensors(device, dtype, gen),
        top_k=2,
        renormalize=True,
        shared_w13=_rand(gen, 2 * Is, H, dtype=dtype, device=device, scale=H**-0.5),
        shared_w2=_rand(gen, H, Is, dtype=dtype, device=device, scale=Is**-0.5),
        shared_gate_weight=_rand(gen, 1, H, dtype=dtype, device=device),
        expert_map=None,
    ))


def attention_decode(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    S, KV, L, D, H = 4, 2, 80, 64, 6
    return Case(dict(
        q=_rand(gen, 3, H, D, dtype=dtype, device=device),
        k_cache=_rand(gen, S, KV, L, D, dtype=dtype, device=device),
        v_cache=_rand(gen, S, KV, L, D, dtype=dtype, device=device),
        slots=torch.tensor([2, -1, 0], dtype=torch.int32, device=device),
        lengths=torch.tensor([77, 5, 1], dtype=torch.int32, device=device),
        scale=D**-0.5,
    ))


def qk_norm_rope(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    T, HQ, HK, D, half = 5, 6, 2, 64, 16  # q and k: column slices of one projection (strided, as in the model)
    proj = _rand(gen, T, (2 * HQ + 2 * HK) * D, dtype=dtype, device=device)
    q = proj[:, :2 * HQ * D].view(T, HQ, 2 * D)[..., :D]
    k = proj[:, 2 * HQ * D:(2 * HQ + HK) * D].view(T, HK, D)
    angles = torch.rand(T, half, generator=gen) * 6.0
    return Case(dict(q=q, k=k, q_weight=_rand(gen, D, dtype=dtype, device=device, scale=0.1),
                     k_weight=_rand(gen, D, dtype=dtype, device=device, scale=0.1),
                     cos=angles.cos().to(device), sin=angles.sin().to(device), eps=1e-6))


def sigmoid_gate_mul(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    T, H, D = 5, 3, 64
    gate = _rand(gen, T, H, 2 * D, dtype=dtype, device=device)[..., D:]
    return Case(dict(x=_rand(gen, T, H, D, dtype=dtype, device=device), gate=gate))
