"""Gated DeltaNet reference: the numerical ground truth for every backend.

Two cores compute the same function on one sequence:

- :func:`recurrent_delta_rule` walks token by token (the definition);
- :func:`chunked_delta_rule` uses the WY/UT chunk form (the algorithm kernels implement).

Both take already-normalised inputs in the compute dtype (fp32, or fp64 when the caller
passes fp64) with heads expanded (q/k repeated to the value heads).  The op functions
(:func:`gdn_chunk_prefill`, :func:`gdn_recurrent_step`) add what the façade promises on top:
varlen batches, grouped value heads, gating from raw projections, L2 norm, state pools.
Layouts are documented once, in :mod:`qwen35.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen35.reference.common import compute_dtype_for

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gating_from_raw(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (log-decay, <= 0) and beta = sigmoid(b)."""
    g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
    beta = torch.sigmoid(b.to(dtype))
    return g, beta


def recurrent_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token.

    q, k: [T, HV, K] (normalised and scaled); v: [T, HV, V]; g, beta: [T, HV]; state: [HV, K, V].
    Returns (o [T, HV, V], final state [HV, K, V]); nothing is modified in place.
    """
    S = state.clone()
    out = v.new_zeros(v.shape)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", S, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", S, q[t])
    return out, S


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`recurrent_delta_rule`, computed chunk by chunk.

    Within a chunk only chunk-local cumulative decays appear, and only as differences
    g_i - g_j with i >= j (<= 0), so no exp() can overflow whatever the sequence length.
    """
    T = q.shape[0]
    S = state.clone()
    out = v.new_zeros(v.shape)
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        # Heads first: [HV, L, *].
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))
        gc = g[start:end].transpose(0, 1).cumsum(-1)  # chunk-local cumulative log-decay
        bc = beta[start:end].transpose(0, 1)
        L = end - start
        diff = gc[:, :, None] - gc[:, None, :]  # g_i - g_j
        lower_incl = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        gamma = diff.masked_fill(~lower_incl, float("-inf")).exp()  # exp(g_i - g_j), i >= j, else 0
        # UT transform: (I + strict_lower(diag(beta) K K^T * Gamma)) T = I.
        A = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * gamma).tril(-1)
        system = A + torch.eye(L, dtype=A.dtype, device=A.device)
        W = torch.linalg.solve_triangular(system, bc[:, :, None] * kc * gc.exp()[:, :, None], upper=False,
                                          unitriangular=True)
        U = torch.linalg.solve_triangular(system, bc[:, :, None] * vc, upper=False, unitriangular=True)
        v_new = U - W @ S  # [HV, L, V]
        o = (qc * gc.exp()[:, :, None]) @ S + ((qc @ kc.transpose(-1, -2)) * gamma) @ v_new
        out[start:end] = o.transpose(0, 1)
        g_last = gc[:, -1]
        S = S * g_last.exp()[:, None, None] + (kc * (g_last[:, None] - gc).exp()[:, :, None]).transpose(-1, -2) @ v_new
    return out, S


def _prepare_heads(
    q: torch.Tensor, k: torch.Tensor, HV: int, scale: float, use_qk_l2norm: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    group = HV // q.shape[-2]
    if group > 1:  # value head j reads key head j // group
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q * scale, k


def _resolve_gating(g, beta, a, b, A_log, dt_bias, dtype):
    if g is not None:
        return g.to(dtype), beta.to(dtype)
    return gating_from_raw(a, b, A_log, dt_bias, dtype)


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
    """Reference for :func:`qwen35.ops.gdn_chunk_prefill` (same signature and semantics)."""
    o, final = _chunk_prefill(q, k, v, g, beta, a, b, A_log, dt_bias, cu_seqlens, initial_state, state_pool,
                              state_slots, has_initial_state, output_final_state, scale, use_qk_l2norm, chunk_size)
    return _into(out, o), final


def _into(out: torch.Tensor | None, o: torch.Tensor) -> torch.Tensor:
    """``o`` copied into the caller's ``out`` buffer when one is given."""
    return o if out is None else out.copy_(o)


def _chunk_prefill(q, k, v, g, beta, a, b, A_log, dt_bias, cu_seqlens, initial_state, state_pool,  # noqa: ANN001, ANN202
                   state_slots, has_initial_state, output_final_state, scale, use_qk_l2norm, chunk_size):
    T, _, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    dtype = compute_dtype_for(q, k, v, initial_state)
    scale = K**-0.5 if scale is None else scale
    qe, ke = _prepare_heads(q, k, HV, scale, use_qk_l2norm, dtype)
    gg, bb = _resolve_gating(g, beta, a, b, A_log, dt_bias, dtype)
    vv = v.to(dtype)
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    N = len(bounds) - 1
    slots = state_slots.tolist() if state_slots is not None else None
    has_init = has_initial_state.tolist() if has_initial_state is not None else [True] * N
    out = torch.zeros(T, HV, V, dtype=dtype, device=q.device)
    finals = []
    for n in range(N):
        s, e = bounds[n], bounds[n + 1]
        S0 = torch.zeros(HV, K, V, dtype=dtype, device=q.device)
        if initial_state is not None:
            S0 = initial_state[n].to(dtype)
        elif state_pool is not None and slots[n] >= 0 and has_init[n]:
            S0 = state_pool[slots[n]].to(dtype)
        o, S = chunked_delta_rule(qe[s:e], ke[s:e], vv[s:e], gg[s:e], bb[s:e], S0, chunk_size)
        out[s:e] = o
        finals.append(S)
    if state_pool is not None:
        for n in range(N):
            if slots[n] >= 0:
                state_pool[slots[n]] = finals[n].to(state_pool.dtype)
        return out.to(q.dtype), None
    if not output_final_state:
        return out.to(q.dtype), None
    final = torch.stack(finals) if finals else torch.zeros(0, HV, K, V, device=q.device)
    return out.to(q.dtype), final.to(dtype)


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
    """Reference for :func:`qwen35.ops.gdn_recurrent_step` (same signature and semantics)."""
    return _into(out, _recurrent_step(q, k, v, state_pool, state_slots, g, beta, a, b, A_log, dt_bias, scale,
                                      use_qk_l2norm))


def _recurrent_step(q, k, v, state_pool, state_slots, g, beta, a, b, A_log, dt_bias, scale,  # noqa: ANN001, ANN202
                    use_qk_l2norm):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = compute_dtype_for(q, k, v)
    scale = K**-0.5 if scale is None else scale
    qe, ke = _prepare_heads(q, k, HV, scale, use_qk_l2norm, dtype)
    gg, bb = _resolve_gating(g, beta, a, b, A_log, dt_bias, dtype)
    out = torch.zeros(B, T, HV, V, dtype=dtype, device=q.device)
    for n, slot in enumerate(state_slots.tolist()):
        if slot < 0:  # padding row: state untouched, output zero
            continue
        o, S = recurrent_delta_rule(qe[n], ke[n], v[n].to(dtype), gg[n], bb[n], state_pool[slot].to(dtype))
        out[n] = o
        state_pool[slot] = S.to(state_pool.dtype)
    return out.to(q.dtype)
