"""Phase 1 of the chunked prefill: every piece of a chunk that does not need the running state.

One program per (chunk, value head), all chunks in parallel: gating from raw a/b (or g/beta), the chunk-local
cumulative decay, the L2 norms of q/k, ``A = strict_lower(beta K K^T * Gamma)``, ``T = (I + A)^-1``
(:mod:`.inverse`), ``W = T beta K exp(g)``, ``U = T beta V`` and the masked intra-chunk scores
``Aqk = (Q K^T * Gamma)`` on and below the diagonal, written to a head-major workspace (:func:`workspace`).
With ``T_OUT`` the program stops after the inverse and writes ``T diag(beta)`` where W and U would go; the scan then
forms ``V'`` itself (``SCAN_T``, :mod:`.scan`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton._launch import launch_args
from kernels_triton.gdn.common import gating, load_tile, store_tile
from kernels_triton.gdn.inverse import blocked_lower_inverse, unit_lower_inverse


@triton.jit
def workspace(ws_ptr, T, HV, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """The one workspace allocation: W ``[HV, T, K]``, U ``[HV, T, V]``, Aqk ``[HV, T, C]`` back to back in
    the workspace dtype, then (from a 16-byte aligned offset) three fp32 ``[HV, T]`` rows per token: the
    cumulative log-decay g, the q row scale ``scale e^g / |q|`` and the k row scale ``1 / |k|``. With ``SCAN_T`` the
    W part's start holds ``T diag(beta)`` ``[HV, T, C]`` instead (and U's part is unused, or holds the split scan's
    ``V'``)."""
    head_major = HV.to(tl.int64) * T
    rows_end = head_major * ((K + V + C + 7) // 8 * 8)
    gcum_ptr = (ws_ptr + rows_end).to(tl.pointer_type(tl.float32), bitcast=True)
    return ws_ptr, ws_ptr + head_major * K, ws_ptr + head_major * (K + V), gcum_ptr


@triton.jit
def prepare_chunk(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, ws_ptr, start, end, hv,
                  u_lo, u_hi, T, scale, H, HV, gate_stride, K: tl.constexpr, V: tl.constexpr, BKC: tl.constexpr,
                  BVC: tl.constexpr, C: tl.constexpr, RAW_GATING: tl.constexpr, USE_L2: tl.constexpr,
                  DOT_PREC: tl.constexpr, DIAG_ROWS: tl.constexpr, BLOCK_INV: tl.constexpr, SCALE_K: tl.constexpr,
                  T_OUT: tl.constexpr = False):
    """Phase 1 for the non-empty chunk ``[start, end)`` (at most C tokens) of value head ``hv``: its workspace rows
    (W, U, Aqk, g and the row scales; see :func:`workspace`), U only in columns ``u_lo .. u_hi``. ``T_OUT``: the
    ``[C, C]`` rows of ``T diag(beta)`` instead of W and U (row stride C from the W part's start). ``BLOCK_INV``: the
    inverse by :func:`~kernels_triton.gdn.inverse.blocked_lower_inverse` (else ``unit_lower_inverse``) on
    ``DIAG_ROWS``-row diagonal blocks; ``SCALE_K``: ``W = (T diag(beta)) (diag(e^g / |k|) K)``, one T operand for the
    W and U products. One body on purpose: split into helpers for the scores and the W / U phase, the kernel
    spills more and measured 2-3 % slower on the H200 (tuning/notes_gdn.md)."""
    h = hv // (HV // H)
    rows = tl.arange(0, C)
    t = (start + rows).to(tl.int64)
    tmask = rows < end - start
    ws_dtype = ws_ptr.dtype.element_ty  # workspace and dot-operand dtype
    w_ptr, u_ptr, aqk_ptr, gcum_ptr = workspace(ws_ptr, T, HV, K, V, C)
    head_row = hv.to(tl.int64) * T + start  # this chunk's first row in the head-major workspace
    q_base = q_ptr + (start.to(tl.int64) * H + h) * K
    k_base = k_ptr + (start.to(tl.int64) * H + h) * K
    v_base = v_ptr + (start.to(tl.int64) * HV + hv) * V

    # Raw K K^T, Q K^T and row sums of squares, K in column blocks: a small live set.
    kk = tl.zeros((C, C), dtype=tl.float32)
    qk = tl.zeros((C, C), dtype=tl.float32)
    ssk = tl.zeros((C,), dtype=tl.float32)
    ssq = tl.zeros((C,), dtype=tl.float32)
    for c0 in tl.range(0, K, BKC):
        k = load_tile(k_base, H * K, tmask, c0, K, BKC).to(ws_dtype)
        q = load_tile(q_base, H * K, tmask, c0, K, BKC).to(ws_dtype)
        kk = tl.dot(k, tl.trans(k), acc=kk, input_precision=DOT_PREC)
        qk = tl.dot(q, tl.trans(k), acc=qk, input_precision=DOT_PREC)
        if USE_L2:
            kf = k.to(tl.float32)
            qf = q.to(tl.float32)
            ssk += tl.sum(kf * kf, axis=1)
            ssq += tl.sum(qf * qf, axis=1)
    if USE_L2:
        rk = tl.rsqrt(ssk + 1e-6)
        rq = tl.rsqrt(ssq + 1e-6) * scale
    else:
        rk = tl.full((C,), 1.0, dtype=tl.float32)
        rq = tl.full((C,), scale, dtype=tl.float32)

    g, beta = gating(t, tmask, hv, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, gate_stride, RAW_GATING)
    g = tl.cumsum(g, axis=0)  # chunk-local cumulative log-decay
    # Row scales for the scan (it then feeds q and k to its dots untouched): g, |q|^-1 scale e^g, |k|^-1.
    tl.store(gcum_ptr + head_row + rows, g, mask=tmask)
    plane = HV.to(tl.int64) * T  # the three fp32 row-scale planes of gcum, each [HV, T]
    tl.store(gcum_ptr + plane + head_row + rows, rq * tl.exp(g), mask=tmask)
    tl.store(gcum_ptr + 2 * plane + head_row + rows, rk, mask=tmask)

    i = rows[:, None]
    j = rows[None, :]
    gamma = tl.exp(tl.where(i >= j, g[:, None] - g[None, :], float("-inf")))  # exp(g_i - g_j), i >= j
    store_tile(aqk_ptr + head_row * C, C, tmask, 0, C, C, qk * (rq[:, None] * rk[None, :]) * gamma)
    A = tl.where(i > j, kk * ((beta * rk)[:, None] * rk[None, :]) * gamma, 0.0)
    if BLOCK_INV:
        Tinv = blocked_lower_inverse(A, C, DOT_PREC, DIAG_ROWS)
    else:
        Tinv = unit_lower_inverse(A, C, DOT_PREC, DIAG_ROWS)

    # W = T diag(beta exp(g) / |k|) K and U = T diag(beta) V, in column blocks (k, v re-read from L1/L2).
    # SCALE_K: W = (T diag(beta)) (diag(exp(g) / |k|) K), one T operand for both products.
    tu = (Tinv * beta[None, :]).to(ws_dtype)
    if T_OUT:
        store_tile(w_ptr + head_row * C, C, tmask, 0, C, C, tu)
    elif SCALE_K:
        ks = tl.exp(g) * rk
        for c0 in tl.range(0, K, BKC):
            k = (load_tile(k_base, H * K, tmask, c0, K, BKC).to(tl.float32) * ks[:, None]).to(ws_dtype)
            store_tile(w_ptr + head_row * K, K, tmask, c0, K, BKC, tl.dot(tu, k, input_precision=DOT_PREC))
    else:
        tw = (Tinv * (beta * tl.exp(g) * rk)[None, :]).to(ws_dtype)
        for c0 in tl.range(0, K, BKC):
            k = load_tile(k_base, H * K, tmask, c0, K, BKC).to(ws_dtype)
            store_tile(w_ptr + head_row * K, K, tmask, c0, K, BKC, tl.dot(tw, k, input_precision=DOT_PREC))
    if not T_OUT:
        for c0 in tl.range(u_lo, u_hi, BVC):
            v = load_tile(v_base, HV * V, tmask, c0, V, BVC).to(ws_dtype)
            store_tile(u_ptr + head_row * V, V, tmask, c0, V, BVC, tl.dot(tu, v, input_precision=DOT_PREC))


@triton.jit
def program_chunk(pid, HV, bounds_ptr, T, C: tl.constexpr, VARLEN: tl.constexpr):
    """(chunk, value head, first token, end token) of a program of a grid over (chunk, value head) pairs, value heads
    fastest: chunks from the batch's chunk table, or the C-token chunks of one sequence."""
    chunk = pid // HV
    hv = pid % HV
    if VARLEN:
        start = tl.load(bounds_ptr + 2 * chunk)
        end = tl.load(bounds_ptr + 2 * chunk + 1)
    else:
        start = chunk * C
        end = tl.minimum(start + C, T)
    return chunk, hv, start, end


@triton.jit(do_not_specialize=["T", "H", "HV", "gate_stride", "chunk_base"])  # one compile for every length, head count
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr,
    g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    bounds_ptr,
    ws_ptr,
    T, scale, chunk_base,
    H, HV, gate_stride,
    VARLEN: tl.constexpr, RAW_GATING: tl.constexpr, USE_L2: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BKC: tl.constexpr, BVC: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
    DIAG_ROWS: tl.constexpr, BLOCK_INV: tl.constexpr, SCALE_K: tl.constexpr, T_OUT: tl.constexpr,
):
    # Value heads vary fastest: the HV / H programs of one key head and chunk run side by side and
    # share their q / k rows through L2.
    # chunk_base: the first chunk of this launch (a sequence prepared in parts, see launch.scan_in_parts).
    pid = tl.program_id(0) + chunk_base * HV
    chunk, hv, start, end = program_chunk(pid, HV, bounds_ptr, T, C, VARLEN)
    if end > start:
        prepare_chunk(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, ws_ptr, start, end,
                      hv, 0, V, T, scale, H, HV, gate_stride, K, V, BKC, BVC, C, RAW_GATING, USE_L2, DOT_PREC,
                      DIAG_ROWS, BLOCK_INV, SCALE_K, T_OUT)


# The launch's arguments by name, in the kernel's order; the plan-dependent tail (from K on) is built once per plan.
PrepareArgs, PrepareConsts = launch_args("Prepare", _chunk_prepare_kernel, "K")
