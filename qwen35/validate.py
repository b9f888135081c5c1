"""Input validation of the façade's ops: one function per op, with the op's name and signature.

Each raises ``ValueError`` naming the offending value and what is accepted, before any buffer is touched,
and returns None. :mod:`qwen35.ops` runs it before dispatching to the chosen backend; its signature is the
op's signature (the op table, :mod:`qwen35.optable`, pairs it with the op's reference, self-test and doc).
Generic checks (one tensor, a shape, offsets, slots) live in :mod:`qwen35._checks`; the helpers here are
shared by the ops of one family.
"""

from __future__ import annotations

import torch

from qwen35 import _checks as chk

MAX_SPEC_TOKENS = 8  # tokens per sequence the decode step accepts (1 + speculative)
ACTIVATIONS = (None, "silu")


def _activation_dtype(*named: tuple[str, torch.Tensor]) -> None:
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match")


def _gating(T_shape: list[int], HV: int, device, g, beta, a, b, A_log, dt_bias) -> None:
    """Either (g, beta) or (a, b, A_log, dt_bias), with matching shapes."""
    precomputed = g is not None or beta is not None
    raw = any(x is not None for x in (a, b, A_log, dt_bias))
    if precomputed == raw:
        raise ValueError("pass gating either as (g, beta) or as (a, b, A_log, dt_bias), exactly one of the two")
    if precomputed:
        if g is None or beta is None:
            raise ValueError("g and beta must be given together")
        chk.tensor("g", g, device=device, dtypes=(torch.float32, torch.float64), contiguous=False)
        chk.shape("g", g, [*T_shape, HV])
        chk.tensor("beta", beta, device=device, contiguous=False)
        chk.shape("beta", beta, [*T_shape, HV])
        _unit_head_stride(("g", g), ("beta", beta))
    else:
        for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
            if t is None:
                raise ValueError(f"{name} is missing; raw gating needs a, b, A_log and dt_bias")
            chk.tensor(name, t, device=device, contiguous=name in ("A_log", "dt_bias"))
        chk.shape("a", a, [*T_shape, HV])
        chk.shape("b", b, [*T_shape, HV])
        _unit_head_stride(("a", a), ("b", b))
        chk.shape("A_log", A_log, [HV])
        chk.shape("dt_bias", dt_bias, [HV])


def _unit_head_stride(*named: tuple[str, torch.Tensor]) -> None:
    """Gating tensors may be views into a wider buffer (the model's b | a projection columns), but each row's
    HV values must be adjacent."""
    for name, t in named:
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have its head values adjacent (stride 1 on the last dim); got shape "
                             f"{tuple(t.shape)} stride {t.stride()}")


def _out(out: torch.Tensor | None, shape: list[int], like: torch.Tensor) -> None:
    """An optional output buffer: contiguous, ``shape``, the dtype and device of ``like``."""
    if out is not None:
        chk.tensor("out", out, device=like.device, dtypes=(like.dtype,))
        chk.shape("out", out, shape)


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"k has shape {list(k.shape)} but q has {list(q.shape)}; they must match")
    if v.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"v has shape {list(v.shape)}; its leading dims must match q's {list(q.shape[:-2])}")
    if H < 1 or K < 1 or V < 1:
        raise ValueError(f"head counts and dims must be >= 1 (H={H}, K={K}, HV={HV}, V={V})")
    chk.divisible("HV (v heads)", HV, "H (q/k heads)", H)
    return H, K, HV, V


def _scale(scale: float | None) -> None:
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive float or None (meaning K**-0.5)")


def _state_pool(name: str, pool: torch.Tensor, device, HV: int, K: int, V: int) -> None:
    chk.slot_pool(name, pool, ndim=4, device=device, dtypes=(torch.float32, torch.float64))
    chk.shape(name, pool, [None, HV, K, V])


# ----------------------------------------------------------------------------- GDN


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    state_pool: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    metadata: object | None = None,
    out: torch.Tensor | None = None,
) -> None:
    chk.tensor("q", q, ndim=3)
    dev = q.device
    chk.tensor("k", k, ndim=3, device=dev)
    chk.tensor("v", v, ndim=3, device=dev)
    _activation_dtype(("q", q), ("k", k), ("v", v))
    _, K, HV, V = _heads(q, k, v)
    T = q.shape[0]
    _gating([T], HV, dev, g, beta, a, b, A_log, dt_bias)
    _scale(scale)
    chk.positive_int("chunk_size", chunk_size, maximum=256)
    N = 1
    if cu_seqlens is not None:
        chk.tensor("cu_seqlens", cu_seqlens, device=dev, dtypes=chk.INDEX_DTYPES)
        N = chk.cu_seqlens("cu_seqlens", cu_seqlens, T)
    if initial_state is not None and state_pool is not None:
        raise ValueError("pass initial_state or state_pool, not both")
    if initial_state is not None:
        chk.tensor("initial_state", initial_state, ndim=4, device=dev, dtypes=(torch.float32, torch.float64))
        chk.shape("initial_state", initial_state, [N, HV, K, V])
    if state_pool is not None:
        _state_pool("state_pool", state_pool, dev, HV, K, V)
        if state_slots is None:
            raise ValueError("state_pool needs state_slots [N] naming each sequence's slot")
        chk.tensor("state_slots", state_slots, device=dev, dtypes=chk.INDEX_DTYPES)
        chk.slots("state_slots", state_slots, N, state_pool.shape[0], "state_pool")
        if has_initial_state is not None:
            chk.tensor("has_initial_state", has_initial_state, ndim=1, device=dev, dtypes=(torch.bool,))
            chk.shape("has_initial_state", has_initial_state, [N])
    elif state_slots is not None or has_initial_state is not None:
        raise ValueError("state_slots / has_initial_state are only meaningful with state_pool")
    _out(out, [T, HV, V], q)


def gdn_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,
) -> None:
    chk.tensor("q", q, ndim=4)
    dev = q.device
    chk.tensor("k", k, ndim=4, device=dev)
    chk.tensor("v", v, ndim=4, device=dev)
    _activation_dtype(("q", q), ("k", k), ("v", v))
    _, K, HV, V = _heads(q, k, v)
    B, T = q.shape[0], q.shape[1]
    if not 1 <= T <= MAX_SPEC_TOKENS:
        raise ValueError(f"decode takes 1..{MAX_SPEC_TOKENS} tokens per sequence, got T={T} (q shape {list(q.shape)})")
    _gating([B, T], HV, dev, g, beta, a, b, A_log, dt_bias)
    _scale(scale)
    _state_pool("state_pool", state_pool, dev, HV, K, V)
    chk.tensor("state_slots", state_slots, device=dev, dtypes=chk.INDEX_DTYPES)
    chk.slots("state_slots", state_slots, B, state_pool.shape[0], "state_pool")
    _out(out, [B, T, HV, V], q)


# ----------------------------------------------------------------------------- conv1d


def _conv_common(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation) -> tuple[int, int]:
    dev = x.device
    chk.tensor("weight", weight, ndim=2, device=dev)
    D, W = weight.shape
    if x.shape[-1] != D:
        raise ValueError(f"x has {x.shape[-1]} channels but weight has {D} ([D, W] = {list(weight.shape)})")
    chk.positive_int("conv width W", W, maximum=8)
    if bias is not None:
        chk.tensor("bias", bias, ndim=1, device=dev)
        chk.shape("bias", bias, [D])
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; accepted: None, 'silu'")
    return D, W


def _conv_pool(pool: torch.Tensor, x: torch.Tensor, D: int, W: int) -> None:
    chk.slot_pool("conv_pool", pool, ndim=3, device=x.device, dtypes=chk.FLOAT_DTYPES)
    chk.shape("conv_pool", pool, [None, D, W - 1])
    if pool.dtype != x.dtype:
        raise ValueError(f"conv_pool has dtype {pool.dtype} but x has {x.dtype}; the history is kept in x's dtype")


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    conv_pool: torch.Tensor | None = None,
    conv_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    planes: tuple[int, ...] | None = None,
) -> None:
    chk.tensor("x", x, ndim=2)
    D, W = _conv_common(x, weight, bias, activation)
    dev = x.device
    N = 1
    if cu_seqlens is not None:
        chk.tensor("cu_seqlens", cu_seqlens, device=dev, dtypes=chk.INDEX_DTYPES)
        N = chk.cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0])
    if conv_pool is not None:
        _conv_pool(conv_pool, x, D, W)
        if conv_slots is None:
            raise ValueError("conv_pool needs conv_slots [N] naming each sequence's slot")
        chk.tensor("conv_slots", conv_slots, device=dev, dtypes=chk.INDEX_DTYPES)
        chk.slots("conv_slots", conv_slots, N, conv_pool.shape[0], "conv_pool")
        if has_initial_state is not None:
            chk.tensor("has_initial_state", has_initial_state, ndim=1, device=dev, dtypes=(torch.bool,))
            chk.shape("has_initial_state", has_initial_state, [N])
    elif conv_slots is not None or has_initial_state is not None:
        raise ValueError("conv_slots / has_initial_state are only meaningful with conv_pool")
    if planes is not None:
        chk.planes("planes", planes, D)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_pool: torch.Tensor,
    conv_slots: torch.Tensor,
    activation: str | None = "silu",
    planes: tuple[int, ...] | None = None,
) -> None:
    chk.tensor("x", x, ndim=2)
    D, W = _conv_common(x, weight, bias, activation)
    _conv_pool(conv_pool, x, D, W)
    chk.tensor("conv_slots", conv_slots, device=x.device, dtypes=chk.INDEX_DTYPES)
    chk.slots("conv_slots", conv_slots, x.shape[0], conv_pool.shape[0], "conv_pool")
    if planes is not None:
        chk.planes("planes", planes, D)


# ----------------------------------------------------------------------------- norms


def _eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and 0 < eps < 1):
        raise ValueError(f"eps={eps!r} must be a float in (0, 1)")


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    chk.tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    chk.tensor("z", z, device=x.device)
    if z.shape != x.shape:
        raise ValueError(f"z has shape {list(z.shape)} but x has {list(x.shape)}; they must match")
    chk.tensor("weight", weight, ndim=1, device=x.device)
    chk.shape("weight", weight, [x.shape[-1]])
    _eps(eps)


def rms_norm_zero_centered(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> None:
    chk.tensor("x", x)
    chk.tensor("weight", weight, ndim=1, device=x.device)
    chk.shape("weight", weight, [x.shape[-1]])
    if residual is not None:
        chk.tensor("residual", residual, device=x.device)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual is {list(residual.shape)} {residual.dtype}; it must match x "
                             f"({list(x.shape)} {x.dtype})")
    _eps(eps)


# ----------------------------------------------------------------------------- MoE

MAX_EXPERTS, MAX_TOP_K = 1024, 16


def _top_k(top_k: int, E: int) -> None:
    chk.positive_int("top_k", top_k, maximum=min(E, MAX_TOP_K))


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> None:
    chk.tensor("router_logits", router_logits, ndim=2)
    chk.positive_int("number of experts", router_logits.shape[1], maximum=MAX_EXPERTS)
    _top_k(top_k, router_logits.shape[1])


def _expert_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int]:
    dev = x.device
    chk.tensor("w13", w13, ndim=3, device=dev)
    chk.tensor("w2", w2, ndim=3, device=dev)
    E, two_i, H = w13.shape
    if H != x.shape[1]:
        raise ValueError(f"w13 {list(w13.shape)} expects hidden size {H} but x has {x.shape[1]}")
    if two_i % 2:
        raise ValueError(f"w13 {list(w13.shape)}: dim 1 must be 2*I (gate rows then up rows), got odd {two_i}")
    chk.shape("w2", w2, [E, H, two_i // 2])
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"expert weights ({w13.dtype}, {w2.dtype}) must have x's dtype {x.dtype}")
    return E, two_i // 2


def _expert_map(expert_map: torch.Tensor | None, E_global: int, E_local: int, dev) -> None:
    if expert_map is None:
        if E_global != E_local:
            raise ValueError(f"routing names {E_global} experts but w13 holds {E_local}; pass expert_map")
        return
    chk.tensor("expert_map", expert_map, ndim=1, device=dev, dtypes=chk.INDEX_DTYPES)
    chk.shape("expert_map", expert_map, [E_global])
    if chk.value_checks_enabled(expert_map) and expert_map.numel():
        lo, hi = int(expert_map.min()), int(expert_map.max())
        if lo < -1 or hi >= E_local:
            raise ValueError(f"expert_map values must be in -1..{E_local - 1} (local experts), got {lo}..{hi}")


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> None:
    chk.tensor("x", x, ndim=2)
    E, _ = _expert_weights(x, w13, w2)
    chk.tensor("topk_weights", topk_weights, ndim=2, device=x.device, dtypes=(torch.float32, torch.float64))
    chk.tensor("topk_ids", topk_ids, ndim=2, device=x.device, dtypes=chk.INDEX_DTYPES)
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_weights {list(topk_weights.shape)} and topk_ids {list(topk_ids.shape)} must both be "
                         f"[M={x.shape[0]}, k]")
    E_global = expert_map.shape[0] if expert_map is not None else E
    _expert_map(expert_map, E_global, E, x.device)
    if chk.value_checks_enabled(topk_ids) and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E_global:
            raise ValueError(f"topk_ids must be in 0..{E_global - 1}, got {lo}..{hi}")


def moe_block(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> None:
    chk.tensor("x", x, ndim=2)
    E, _ = _expert_weights(x, w13, w2)
    chk.tensor("router_weight", router_weight, ndim=2, device=x.device)
    E_global = router_weight.shape[0]
    chk.shape("router_weight", router_weight, [E_global, x.shape[1]])
    chk.positive_int("number of experts", E_global, maximum=MAX_EXPERTS)
    _top_k(top_k, E_global)
    _expert_map(expert_map, E_global, E, x.device)
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13 and shared_w2 must be given together")
    if shared_w13 is not None:
        chk.tensor("shared_w13", shared_w13, ndim=2, device=x.device)
        chk.tensor("shared_w2", shared_w2, ndim=2, device=x.device)
        two_is = shared_w13.shape[0]
        if two_is % 2:
            raise ValueError(f"shared_w13 {list(shared_w13.shape)}: dim 0 must be 2*Is, got odd {two_is}")
        chk.shape("shared_w13", shared_w13, [two_is, x.shape[1]])
        chk.shape("shared_w2", shared_w2, [x.shape[1], two_is // 2])
    if shared_gate_weight is not None:
        if shared_w13 is None:
            raise ValueError("shared_gate_weight given without a shared expert (shared_w13, shared_w2)")
        chk.tensor("shared_gate_weight", shared_gate_weight, ndim=2, device=x.device)
        chk.shape("shared_gate_weight", shared_gate_weight, [1, x.shape[1]])


# ----------------------------------------------------------------------------- attention


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> None:
    chk.tensor("q", q, ndim=3)
    dev = q.device
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        chk.tensor(name, c, ndim=4, device=dev)
    _activation_dtype(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    B, H, D = q.shape
    S, KV, L = k_cache.shape[:3]
    chk.shape("k_cache", k_cache, [None, None, None, D])
    chk.shape("v_cache", v_cache, list(k_cache.shape))
    if KV < 1 or D < 1:
        raise ValueError(f"k_cache has shape {list(k_cache.shape)}; kv heads and head dim must be >= 1")
    chk.divisible("H (query heads)", H, "KV (kv heads of the cache)", KV)
    _scale(scale)
    if scale is None:
        raise ValueError("scale is required for attention_decode (e.g. head_dim ** -0.5)")
    for name, t in (("slots", slots), ("lengths", lengths)):
        chk.tensor(name, t, ndim=1, device=dev, dtypes=chk.INDEX_DTYPES)
        chk.shape(name, t, [B])
    if chk.value_checks_enabled(slots) and B:
        hi = int(slots.max())
        if hi >= S:
            raise ValueError(f"slots holds slot {hi}, but the caches have {S} slots (valid 0..{S - 1}, "
                             "negative = padding)")
        lo, top = int(lengths.min()), int(lengths.max())
        if lo < 0 or top > L:
            bad = lo if lo < 0 else top
            raise ValueError(f"lengths holds {bad}; each row attends to 0..{L} keys (the caches hold L={L})")


def _heads_view(name: str, x: torch.Tensor, dev=None) -> None:  # noqa: ANN001
    chk.tensor(name, x, ndim=3, device=dev, contiguous=False)
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} has strides {list(x.stride())}; its last dim (head_dim) must be contiguous")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6) -> None:
    _heads_view("q", q)
    dev = q.device
    _heads_view("k", k, dev)
    _activation_dtype(("q", q), ("k", k))
    T, _, D = q.shape
    chk.shape("k", k, [T, None, D])
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        chk.tensor(name, w, ndim=1, device=dev)
        chk.shape(name, w, [D])
    for name, t in (("cos", cos), ("sin", sin)):
        chk.tensor(name, t, ndim=2, device=dev, dtypes=(torch.float32, torch.float64))
        chk.shape(name, t, [T, None])
    chk.shape("sin", sin, list(cos.shape))
    if 2 * cos.shape[1] > D:
        raise ValueError(f"cos has {cos.shape[1]} columns: rotating {2 * cos.shape[1]} dims needs head_dim >= "
                         f"that, got {D}")
    _eps(eps)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    _heads_view("x", x)
    _heads_view("gate", gate, x.device)
    _activation_dtype(("x", x), ("gate", gate))
    chk.shape("gate", gate, list(x.shape))
