"""The op façade: every numerical op of a Qwen3.5 layer, validated, then run on the probed backend.

Conventions (written once here; every backend follows them)
-------------------------------------------------------------
Tokens are flattened: a batch of N sequences is one ``[T, ...]`` tensor plus ``cu_seqlens``
(int32/int64 offsets ``[N+1]``, ``cu_seqlens[0] = 0``, non-decreasing, ``cu_seqlens[N] = T``;
``None`` means one sequence of length T). Sequences of length 0 are allowed.

GDN heads: ``H`` key heads of dim ``K`` (q, k), ``HV`` value heads of dim ``V`` (v, outputs),
``HV`` a multiple of ``H``; value head ``j`` reads key head ``j // (HV // H)``.

Gating, per token and value head: ``g`` is the log-decay (fp32, <= 0) and ``beta`` the write
strength in (0, 1) (post-sigmoid). Either pass ``g`` and ``beta``, or pass the raw projections
``a``, ``b`` ``[T, HV]`` with ``A_log``, ``dt_bias`` ``[HV]`` and the op computes
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` in fp32. The gating tensors may be
views into a wider buffer (e.g. columns of one projection output) as long as each row's HV values are
adjacent; q, k and v are contiguous.

Recurrent state: ``S`` per sequence is ``[HV, K, V]`` fp32, updated per token as
``S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q`` (q, k optionally L2-normalised,
q scaled by ``scale``, default ``K**-0.5``). States live either in plain tensors
``[N, HV, K, V]`` or in a **state pool** ``[num_slots, HV, K, V]`` fp32 addressed by slot
indices (int32/int64); a negative slot is padding: that sequence starts from zeros and its state
is not written (prefill), or the row is skipped and its output is zero (decode). Pools (state and
conv) need each slot's block contiguous but may have a larger slot stride: a strided view into a
bigger buffer (vLLM packs a block's conv and recurrent state into one page) is used in place.

Conv state: the depthwise causal conv over ``D`` channels with window ``W`` keeps the last
``W - 1`` inputs per sequence in a **conv pool** ``[num_slots, D, W - 1]`` (oldest column
first), in the activation dtype. Conv weights are ``[D, W]`` (HF's ``conv1d.weight[:, 0, :]``).

MoE weights are stacked as in HF checkpoints: ``w13`` ``[E, 2I, H]`` (gate rows then up rows),
``w2`` ``[E, H, I]``; router weight ``[E, H]``; shared expert ``shared_w13`` ``[2Is, H]``,
``shared_w2`` ``[H, Is]``, its gate ``shared_gate_weight`` ``[1, H]``. Routing is softmax over
experts in fp32 -> top-k (ties to the lowest id) -> renormalise; weights fp32, ids int32.
``expert_map`` ``[E]`` (int32) maps global to local expert ids, -1 for experts not held here.

Decode attention (the standalone host's full-attention layers): KV caches per slot
``[num_slots, KV, L, D]`` (``L`` positions per slot), one query per row ``q [B, H, D]`` with
``H`` a multiple of ``KV`` (query head ``j`` reads kv head ``j // (H // KV)``); row ``b`` attends
to keys ``0 .. lengths[b] - 1`` of slot ``slots[b]``. A negative slot is padding (zero output).

Dtypes: activations fp16, bf16, fp32 (fp64 accepted everywhere and always computed by the
reference: it is how tests get ground truth). Outputs come back in the activation dtype;
accumulation is fp32 or better in every backend.

Every op raises ``ValueError`` before touching any buffer when an input is off, naming the
value and what is accepted. Checks that read tensor values (cu_seqlens, slots) synchronise the
device; they are skipped while a CUDA graph is captured, when ``QWEN35_CHECK_VALUES=0``, and for
accelerator tensors inside :func:`host_built_inputs` (the model hosts run their forward in it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qwen35 import _checks as chk
from qwen35 import backends, probe
from qwen35 import reference as _reference

__all__ = [
    "gdn_chunk_prefill",
    "gdn_recurrent_step",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "rms_norm_gated",
    "rms_norm_zero_centered",
    "moe_route",
    "moe_experts",
    "moe_block",
    "attention_decode",
    "qk_norm_rope",
    "sigmoid_gate_mul",
    "prepare_gdn_metadata",
    "gdn_chunk_table",
    "host_built_inputs",
    "MAX_SPEC_TOKENS",
]

host_built_inputs = chk.host_built_inputs
MAX_SPEC_TOKENS = 8  # tokens per sequence the decode step accepts (1 + speculative)
ACTIVATIONS = (None, "silu")


def _impl(op: str, x: torch.Tensor):
    if x.dtype == torch.float64:
        return getattr(_reference, op)
    return probe.implementation(op, x.device)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over whole prompts (chunked form), varlen.

    q, k ``[T, H, K]``; v ``[T, HV, V]``; gating as in the module docstring.
    Initial states: ``initial_state`` ``[N, HV, K, V]`` fp32, **or** ``state_pool`` with
    ``state_slots`` ``[N]`` (and optionally ``has_initial_state`` ``[N]`` bool: where False the
    sequence starts from zeros whatever the slot holds). With a pool, every sequence's final
    state is written back to its slot in place and the second result is ``None``; otherwise the
    final states ``[N, HV, K, V]`` fp32 are returned when ``output_final_state``.
    ``metadata``: optional per-batch data from the chosen backend's ``prepare_gdn_metadata``
    (computed once per batch, shared by all layers); ``None`` is always accepted.
    ``out``: optional ``[T, HV, V]`` contiguous tensor of q's dtype, not overlapping any input, that receives
    ``o`` (a caller's buffer: no copy of the result); it is then the first result.
    Returns ``(o [T, HV, V] in q's dtype, final_state or None)``.
    """
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
    return _impl("gdn_chunk_prefill", q)(
        q, k, v, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
        initial_state=initial_state, state_pool=state_pool, state_slots=state_slots,
        has_initial_state=has_initial_state, output_final_state=output_final_state, scale=scale,
        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, metadata=metadata, out=out)


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
) -> torch.Tensor:
    """Decode: 1 <= T <= 8 new tokens for each of B sequences, recurrent form, state pool in place.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; gating ``[B, T, HV]``; ``state_slots`` ``[B]``
    (negative = padding row: state untouched, output zero). Returns o ``[B, T, HV, V]``: ``out`` when given
    (contiguous, q's dtype, not overlapping any input).
    """
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
    return _impl("gdn_recurrent_step", q)(
        q, k, v, state_pool=state_pool, state_slots=state_slots, g=g, beta=beta, a=a, b=b,
        A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, out=out)


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
) -> torch.Tensor:
    """Depthwise causal conv over whole prompts, varlen. x ``[T, D]`` -> ``[T, D]``.

    ``planes`` (1 to 3 widths summing to D): x's memory holds planes ``[T, planes[p]]`` back to back (channels
    in order; GDN's q | k | v) instead of rows of D channels; the output has the same layout.

    With ``conv_pool`` + ``conv_slots`` ``[N]``, each sequence's window starts from its slot's
    history (zeros where ``has_initial_state`` is False or the slot is negative) and the last
    ``W - 1`` inputs (history included, for sequences shorter than that) are written back.
    """
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
    fn = _impl("causal_conv1d_prefill", x)
    kw = dict(cu_seqlens=cu_seqlens, conv_slots=conv_slots, has_initial_state=has_initial_state, activation=activation)
    if planes is None:
        return fn(x, weight, bias, conv_pool=conv_pool, **kw)
    return _by_planes(fn, chk.planes("planes", planes, D), x, weight, bias, conv_pool, kw)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_pool: torch.Tensor,
    conv_slots: torch.Tensor,
    activation: str | None = "silu",
    planes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Decode: one new token per row. x ``[B, D]``; pool updated in place; negative slots skipped (zero output).
    ``planes`` as in :func:`causal_conv1d_prefill` (planes of B rows)."""
    chk.tensor("x", x, ndim=2)
    D, W = _conv_common(x, weight, bias, activation)
    _conv_pool(conv_pool, x, D, W)
    chk.tensor("conv_slots", conv_slots, device=x.device, dtypes=chk.INDEX_DTYPES)
    chk.slots("conv_slots", conv_slots, x.shape[0], conv_pool.shape[0], "conv_pool")
    fn = _impl("causal_conv1d_update", x)
    kw = dict(conv_slots=conv_slots, activation=activation)
    if planes is None:
        return fn(x, weight, bias, conv_pool=conv_pool, **kw)
    return _by_planes(fn, chk.planes("planes", planes, D), x, weight, bias, conv_pool, kw)


_TAKES_PLANES: dict[object, bool] = {}


def _by_planes(fn, planes: tuple[int, ...], x, weight, bias, conv_pool, kw: dict) -> torch.Tensor:
    """A conv op over a plane-layout x: in one call where the backend takes ``planes``, else plane by plane."""
    takes = _TAKES_PLANES.get(fn)
    if takes is None:
        import inspect

        takes = _TAKES_PLANES[fn] = "planes" in inspect.signature(fn).parameters
    if takes:
        return fn(x, weight, bias, conv_pool=conv_pool, planes=planes, **kw)
    rows = x.shape[0]
    flat, y = x.view(-1), torch.empty_like(x)
    at = ch = 0
    for n in planes:
        if n:
            part = slice(ch, ch + n)
            y.view(-1)[at:at + rows * n].view(rows, n).copy_(fn(
                flat[at:at + rows * n].view(rows, n), weight[part], None if bias is None else bias[part],
                conv_pool=None if conv_pool is None else conv_pool[:, part], **kw))
        at, ch = at + rows * n, ch + n
    return y


# ----------------------------------------------------------------------------- norms


def _eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and 0 < eps < 1):
        raise ValueError(f"eps={eps!r} must be a float in (0, 1)")


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GDN output norm over the last dim: ``x / rms(x) * weight * silu(z)``; shape and dtype of x."""
    chk.tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dim")
    chk.tensor("z", z, device=x.device)
    if z.shape != x.shape:
        raise ValueError(f"z has shape {list(z.shape)} but x has {list(x.shape)}; they must match")
    chk.tensor("weight", weight, ndim=1, device=x.device)
    chk.shape("weight", weight, [x.shape[-1]])
    _eps(eps)
    return _impl("rms_norm_gated", x)(x, z, weight, eps)


def rms_norm_zero_centered(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm over the last dim: ``x / rms(x) * (1 + weight)``.

    With ``residual``: ``s = x + residual`` (in x's dtype) is normalised and ``(norm(s), s)`` is
    returned, so the caller carries ``s`` as the next residual.
    """
    chk.tensor("x", x)
    chk.tensor("weight", weight, ndim=1, device=x.device)
    chk.shape("weight", weight, [x.shape[-1]])
    if residual is not None:
        chk.tensor("residual", residual, device=x.device)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual is {list(residual.shape)} {residual.dtype}; it must match x "
                             f"({list(x.shape)} {x.dtype})")
    _eps(eps)
    return _impl("rms_norm_zero_centered", x)(x, weight, eps, residual)


# ----------------------------------------------------------------------------- MoE

MAX_EXPERTS, MAX_TOP_K = 1024, 16


def _top_k(top_k: int, E: int) -> None:
    chk.positive_int("top_k", top_k, maximum=min(E, MAX_TOP_K))


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (fp32) -> top-k (ties to the lowest id) -> renormalise.

    router_logits ``[M, E]``. Returns (weights fp32 ``[M, k]``, ids int32 ``[M, k]``).
    """
    chk.tensor("router_logits", router_logits, ndim=2)
    chk.positive_int("number of experts", router_logits.shape[1], maximum=MAX_EXPERTS)
    _top_k(top_k, router_logits.shape[1])
    return _impl("moe_route", router_logits)(router_logits, top_k, renormalize)


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
) -> torch.Tensor:
    """Routed expert MLPs and the weighted top-k sum. x ``[M, H]`` -> ``[M, H]`` in x's dtype.

    ``topk_ids`` hold global expert ids; with ``expert_map`` ids mapping to -1 contribute nothing
    (another rank holds them), so the caller all-reduces across expert-parallel ranks.
    """
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
    return _impl("moe_experts", x)(x, w13, w2, topk_weights, topk_ids, expert_map)


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
) -> torch.Tensor:
    """A whole MoE block in one call: router -> routing -> experts -> + sigmoid-gated shared expert.

    x ``[M, H]`` -> ``[M, H]``. Under tensor parallelism pass this rank's expert / shared-expert
    slices (I split); the router and gate are replicated; the caller all-reduces the result.
    """
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
    return _impl("moe_block", x)(
        x, router_weight, w13, w2, top_k, renormalize=renormalize, shared_w13=shared_w13,
        shared_w2=shared_w2, shared_gate_weight=shared_gate_weight, expert_map=expert_map)


# ----------------------------------------------------------------------------- attention


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode query per row over its slot's cached keys; returns ``[B, H, D]`` in q's dtype.

    q ``[B, H, D]``; k_cache, v_cache ``[num_slots, KV, L, D]`` (same dtype as q); slots, lengths
    ``[B]`` int32/int64 with ``0 <= lengths[b] <= L`` (the keys row b sees, its own included).
    Shapes alone fix the work launched, so the op can be captured in a CUDA graph and replayed
    as lengths grow.
    """
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
    return _impl("attention_decode", q)(q, k_cache, v_cache, slots=slots, lengths=lengths, scale=scale)


def _heads_view(name: str, x: torch.Tensor, dev=None) -> None:  # noqa: ANN001
    chk.tensor(name, x, ndim=3, device=dev, contiguous=False)
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} has strides {list(x.stride())}; its last dim (head_dim) must be contiguous")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention layer's q/k preparation: every head of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` normalised
    (zero-centred RMSNorm, ``q_weight`` / ``k_weight`` ``[D]``), then its first ``R = 2 * cos.shape[-1]`` dims
    rotated NeoX-style (halves ``x1 = y[:R/2]``, ``x2 = y[R/2:R]`` -> ``x1 c - x2 s``, ``x2 c + x1 s``; the other
    dims pass), all in fp32. cos, sin ``[T, R/2]`` fp32. q and k may be strided views (last dim contiguous,
    e.g. column slices of the QKV projection); returns new contiguous (q, k) in their dtype.
    """
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
    return _impl("qk_norm_rope", q)(q, k, q_weight, k_weight, cos, sin, eps)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output gate: ``x * sigmoid(gate)`` in fp32, both ``[T, H, D]`` (strided views allowed, last dim
    contiguous), returned contiguous in x's dtype."""
    _heads_view("x", x)
    _heads_view("gate", gate, x.device)
    _activation_dtype(("x", x), ("gate", gate))
    chk.shape("gate", gate, list(x.shape))
    return _impl("sigmoid_gate_mul", x)(x, gate)


def gdn_chunk_table(offsets: Sequence[int], device: torch.device | str) -> np.ndarray | None:
    """The host half of :func:`prepare_gdn_metadata`, for a host that sends its own per-step data to the device.

    Returns the int32 array that the backend ``gdn_chunk_prefill`` uses on ``device`` wants on the device for a
    batch of sequences at ``offsets`` (the values of ``cu_seqlens``), or ``None`` when that backend takes no
    table. Copy it to the device with the step's other data (one transfer instead of one per table) and pass
    the device copy as ``prepare_gdn_metadata(cu_seqlens, offsets=offsets, table=...)``.
    """
    if isinstance(offsets, torch.Tensor) or not len(offsets):
        raise ValueError(f"offsets must be a non-empty list of host ints (the values of cu_seqlens), got {offsets!r}")
    device = torch.device(device)
    choice = probe.choose("gdn_chunk_prefill", device)
    build = getattr(backends.load(choice.backend), "gdn_chunk_table", None)
    if not callable(build):
        return None
    return build(chk.host_offsets("offsets", offsets, len(offsets)))


def prepare_gdn_metadata(cu_seqlens: torch.Tensor, chunk_size: int = 64, *,
                         offsets: Sequence[int] | None = None, table: torch.Tensor | None = None,
                         chunk_indices: torch.Tensor | None = None) -> object | None:
    """Per-batch data for :func:`gdn_chunk_prefill` (e.g. chunk indices), computed once per batch.

    Asks the backend that ``gdn_chunk_prefill`` uses on ``cu_seqlens``' device; ``None`` when that
    backend needs none. Pass the result as ``metadata=`` to every GDN layer of the batch so the
    op itself does no host synchronisation. ``offsets``: the values of ``cu_seqlens`` when the caller
    has them on the host (a host that built the batch does), so the backend need not read them back
    from the device, which waits for all work queued before. ``table``: the device copy of
    :func:`gdn_chunk_table` of ``offsets`` (needs ``offsets``): the backend then copies nothing.
    ``chunk_indices``: ``[n, 2]`` int (sequence, chunk within it) pairs of ``chunk_size``-token chunks on the
    device, as FLA's ``prepare_chunk_indices`` (and vLLM's GDN metadata) hold them: the backend derives its
    data from them on the device, with no read-back and no host offsets.
    """
    chk.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=chk.INDEX_DTYPES)
    chk.positive_int("chunk_size", chunk_size, maximum=256)
    if offsets is not None:
        offsets = chk.host_offsets("offsets", offsets, cu_seqlens.shape[0])
    if table is not None:
        if offsets is None:
            raise ValueError("table needs offsets: the values of cu_seqlens it was built from")
        chk.tensor("table", table, device=cu_seqlens.device, dtypes=(torch.int32,))
    if chunk_indices is not None:
        if offsets is not None or table is not None:
            raise ValueError("pass chunk_indices alone, or offsets (with an optional table), not both")
        chk.tensor("chunk_indices", chunk_indices, ndim=2, device=cu_seqlens.device, dtypes=chk.INDEX_DTYPES)
        chk.shape("chunk_indices", chunk_indices, [None, 2])
    choice = probe.choose("gdn_chunk_prefill", cu_seqlens.device)
    prepare = getattr(backends.load(choice.backend), "prepare_gdn_metadata", None)
    if not callable(prepare):
        return None
    if chunk_indices is not None:
        return prepare(cu_seqlens, chunk_size, chunk_indices=chunk_indices)
    if offsets is None:
        return prepare(cu_seqlens, chunk_size)
    return prepare(cu_seqlens, chunk_size, offsets=offsets, table=table)
