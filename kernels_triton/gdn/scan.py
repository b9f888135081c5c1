"""Phase 2 of the chunked prefill: the sequential pass over each sequence's chunks, and the kernels built on it.

``_chunk_scan_kernel``: one program per (sequence, value head, V block), walking the chunks of its sequence in
order with its slice of the state ``S[:, v-block]`` in registers: ``V' = U - W S``, ``O = (Q exp(g)) S + Aqk V'``,
``S <- exp(g_C) S + (K exp(g_C - g))^T V'``. The state never leaves the chip between chunks, and the output is
produced in the same pass. Columns of S are independent, so splitting V into blocks keeps the GPU busy when there are
few heads (TP4/TP8) or one long sequence. ``SCAN_T``: ``V'`` is formed from the chunk's v rows and the prepare's
``T diag(beta)``; ``SPLIT``: the state path alone, leaving each chunk's starting state and ``V'`` to
``_chunk_output_kernel``, which computes every chunk's output in parallel.

``_chunk_single_kernel``: both phases in one launch for a batch whose sequences fit one chunk each (short prompts,
where the host's launch cost dominates).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton._launch import launch_args
from kernels_triton.gdn.common import load_tile, store_tile
from kernels_triton.gdn.prepare import prepare_chunk, program_chunk, workspace


@triton.jit
def _state_tile_io(ptr, S, hv, vb, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   STORE: tl.constexpr):
    """Load (``STORE`` False: fp32, ``S`` unused) or store ``S`` as the ``[BK, BV]`` tile of V block ``vb`` of value
    head ``hv`` in the ``[HV, K, V]`` state at ``ptr``; unmasked (vectorised) when the tile does not overhang."""
    kcols = tl.arange(0, BK)
    vcols = vb * BV + tl.arange(0, BV)
    ptrs = ptr + (hv * K + kcols[:, None]).to(tl.int64) * V + vcols[None, :]
    if (BK == K) & (V % BV == 0):
        if STORE:
            tl.store(ptrs, S.to(ptr.dtype.element_ty))
        else:
            S = tl.load(ptrs).to(tl.float32)
    else:
        smask = (kcols[:, None] < K) & (vcols[None, :] < V)
        if STORE:
            tl.store(ptrs, S.to(ptr.dtype.element_ty), mask=smask)
        else:
            S = tl.load(ptrs, mask=smask, other=0.0).to(tl.float32)
    return S


@triton.jit
def _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, vb, pool_slot_stride, HV, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STATE_IN: tl.constexpr, POOL: tl.constexpr,
                   HAS_INIT_FLAGS: tl.constexpr):
    """(state tile fp32, pool slot) of sequence ``n``: a per-sequence tensor, a pool slot (negative slot or
    has_initial_state False: zeros), or zeros; the slot is -1 without a pool."""
    S = tl.zeros((BK, BV), dtype=tl.float32)
    slot = tl.full((), -1, dtype=tl.int64)
    if POOL:
        slot = tl.load(slots_ptr + n).to(tl.int64)
        use_init = slot >= 0
        if HAS_INIT_FLAGS:
            use_init = use_init & (tl.load(has_init_ptr + n) != 0)
        if use_init:
            S = _state_tile_io(h0_ptr + slot * pool_slot_stride, S, hv, vb, K, V, BK, BV, False)
    elif STATE_IN:
        S = _state_tile_io(h0_ptr + n.to(tl.int64) * (HV * K * V), S, hv, vb, K, V, BK, BV, False)
    return S, slot


@triton.jit
def _final_state(ht_ptr, S, slot, n, hv, vb, pool_slot_stride, HV, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, STATE_OUT: tl.constexpr, POOL: tl.constexpr):
    """Write sequence ``n``'s final state tile: to its pool slot (none when the slot is negative) or tensor row."""
    if POOL:
        if slot >= 0:
            _state_tile_io(ht_ptr + slot * pool_slot_stride, S, hv, vb, K, V, BK, BV, True)
    elif STATE_OUT:
        _state_tile_io(ht_ptr + n.to(tl.int64) * (HV * K * V), S, hv, vb, K, V, BK, BV, True)


@triton.jit
def _scan_chunk(S, q_ptr, k_ptr, v_ptr, w_ptr, u_ptr, aqk_ptr, gcum_ptr, o_ptr, chunk_start, seq_end, hv, h, T, H, HV,
                vb, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                DOT_PREC: tl.constexpr, SPLIT: tl.constexpr = False, st_ptr=None, st_row=0,
                SCAN_T: tl.constexpr = False):
    """One chunk of phase 2 for V block ``vb`` of value head ``hv`` (key head ``h``; workspace parts as
    :func:`~kernels_triton.gdn.prepare.workspace` gives them, computed once by the caller): writes the chunk's output
    block, returns the state after it (``S``: the state before, fp32). ``SPLIT``: the state path alone; it leaves the
    chunk's starting state (workspace dtype, ``[HV, K, V]`` at row ``st_row`` of ``st_ptr``) and ``V'`` (over U's
    block) to ``_chunk_output_kernel``. ``SCAN_T``: the workspace holds ``T diag(beta)`` (the prepare's ``T_OUT``)
    instead of W and U, and ``V' = U - W S = (T diag(beta)) (V - diag(e^g / |k|) K S)`` is formed here from the
    chunk's v rows (with SPLIT, ``V'`` still goes to U's part: ``T diag(beta)`` then fits W's, ``K >= C``)."""
    ws_dtype = w_ptr.dtype.element_ty
    rows = tl.arange(0, C)
    tmask = rows < seq_end - chunk_start
    head_row = hv.to(tl.int64) * T + chunk_start  # this chunk's first row in the head-major workspace
    g = tl.load(gcum_ptr + head_row + rows, mask=tmask, other=0.0)
    g_last = tl.load(gcum_ptr + head_row + tl.minimum(C, seq_end - chunk_start) - 1)
    plane = HV.to(tl.int64) * T  # the row-scale planes of gcum (see the prepare kernel)
    k_scale = tl.load(gcum_ptr + 2 * plane + head_row + rows, mask=tmask, other=0.0)
    if not SPLIT:
        q_scale = tl.load(gcum_ptr + plane + head_row + rows, mask=tmask, other=0.0)
        q = load_tile(q_ptr + (chunk_start * H + h) * K, H * K, tmask, 0, K, BK).to(ws_dtype)
    k = load_tile(k_ptr + (chunk_start * H + h) * K, H * K, tmask, 0, K, BK).to(ws_dtype)
    if SCAN_T:
        tu = load_tile(w_ptr + head_row * C, C, tmask, 0, C, C)
        v = load_tile(v_ptr + (chunk_start * HV + hv) * V, HV * V, tmask, vb * BV, V, BV)
    else:
        w = load_tile(w_ptr + head_row * K, K, tmask, 0, K, BK)
        u = load_tile(u_ptr + head_row * V, V, tmask, vb * BV, V, BV).to(tl.float32)
    if not SPLIT:
        aqk = load_tile(aqk_ptr + head_row * C, C, tmask, 0, C, C)

    # q and k go into the dots as loaded; their norms, scale and decays are row scales of the results.
    Sd = S.to(ws_dtype)
    if SCAN_T:
        kS = tl.dot(k, Sd, input_precision=DOT_PREC) * (k_scale * tl.exp(g))[:, None]  # diag(e^g / |k|) K S
        v_new = tl.dot(tu, (v.to(tl.float32) - kS).to(ws_dtype), input_precision=DOT_PREC)
    else:
        v_new = u - tl.dot(w, Sd, input_precision=DOT_PREC)
    if SPLIT:
        _state_tile_io(st_ptr + st_row * (HV * K * V), S, hv, vb, K, V, BK, BV, True)
        store_tile(u_ptr + head_row * V, V, tmask, vb * BV, V, BV, v_new)
    else:
        o = tl.dot(q, Sd, input_precision=DOT_PREC) * q_scale[:, None]
        o = tl.dot(aqk, v_new.to(ws_dtype), acc=o, input_precision=DOT_PREC)
        store_tile(o_ptr + (chunk_start * HV + hv) * V, HV * V, tmask, vb * BV, V, BV, o)
    v_scaled = (v_new * (k_scale * tl.exp(g_last - g))[:, None]).to(ws_dtype)
    return S * tl.exp(g_last) + tl.dot(tl.trans(k), v_scaled, input_precision=DOT_PREC)


@triton.jit
def _sequence_bounds(cu_ptr, n, T, VARLEN: tl.constexpr):
    """(first token, end token) of sequence ``n``, int64: from ``cu_seqlens`` or the whole batch."""
    if VARLEN:
        start = tl.load(cu_ptr + n).to(tl.int64)
        end = tl.load(cu_ptr + n + 1).to(tl.int64)
    else:
        start = tl.zeros((), dtype=tl.int64)
        end = start + T
    return start, end


@triton.jit(do_not_specialize=["T", "H", "HV", "NH", "chunk_lo", "chunk_hi", "nh_base"])
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, ws_ptr, o_ptr, st_ptr,
    cu_ptr, h0_ptr, ht_ptr, slots_ptr, has_init_ptr, carry_ptr,
    T, pool_slot_stride, chunk_lo, chunk_hi, nh_base,
    H, HV, NH,
    VARLEN: tl.constexpr, STATE_IN: tl.constexpr, STATE_OUT: tl.constexpr, POOL: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, SPLIT: tl.constexpr, PART: tl.constexpr, CARRY_IN: tl.constexpr,
    CARRY_OUT: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
    SCAN_T: tl.constexpr,
):
    # SPLIT: the state path alone, the output left to _chunk_output_kernel; chunk states go to st_ptr [chunks, HV, K,
    # V] in the chunk table's order (sequences in order, ceil(len / C) chunks each).
    # PART (one sequence scanned in parts, see launch.scan_in_parts): only chunks chunk_lo .. chunk_hi - 1 of the
    # sequence; CARRY_IN / CARRY_OUT: the state before / after them is the fp32 [HV, K, V] tensor at carry_ptr instead
    # of the initial / final state.
    # nh_base: the launch's first (sequence, head) pair (a batch scanned in groups of sequences); NH: its end.
    # SCAN_T: V' formed from v and T diag(beta) (see _scan_chunk; the prepare ran with T_OUT).
    vb = tl.program_id(0)
    nh = nh_base + tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)  # (sequence, head) pairs: see grid_rows
    if nh >= NH:
        return
    n = nh // HV
    hv = nh % HV
    seq_start, seq_end = _sequence_bounds(cu_ptr, n, T, VARLEN)
    h = hv // (HV // H)
    w_ptr, u_ptr, aqk_ptr, gcum_ptr = workspace(ws_ptr, T, HV, K, V, C)
    if CARRY_IN:
        S = _state_tile_io(carry_ptr, None, hv, vb, K, V, BK, BV, False)
        slot = tl.full((), -1, dtype=tl.int64)
        if POOL:
            slot = tl.load(slots_ptr + n).to(tl.int64)
    else:
        S, slot = _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV,
                                 STATE_IN, POOL, HAS_INIT_FLAGS)
    row = tl.zeros((), dtype=tl.int64)  # SPLIT: the chunk's row in the chunk table
    if SPLIT & VARLEN:
        for m in range(0, n):
            row += (tl.load(cu_ptr + m + 1) - tl.load(cu_ptr + m) + C - 1) // C
    first, stop = seq_start, seq_end
    if PART:
        row += chunk_lo
        first = seq_start + chunk_lo.to(tl.int64) * C
        stop = tl.minimum(seq_end, seq_start + chunk_hi.to(tl.int64) * C)
    for chunk_start in range(first, stop, C):
        S = _scan_chunk(S, q_ptr, k_ptr, v_ptr, w_ptr, u_ptr, aqk_ptr, gcum_ptr, o_ptr, chunk_start, seq_end, hv, h, T,
                        H, HV, vb, K, V, BK, BV, C, DOT_PREC, SPLIT, st_ptr, row, SCAN_T)
        row += 1
    if CARRY_OUT:
        _state_tile_io(carry_ptr, S, hv, vb, K, V, BK, BV, True)
    else:
        _final_state(ht_ptr, S, slot, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV, STATE_OUT, POOL)


@triton.jit(do_not_specialize=["T", "H", "HV", "chunk_base"])
def _chunk_output_kernel(
    q_ptr, ws_ptr, st_ptr, o_ptr, bounds_ptr,
    T, H, HV, chunk_base,
    VARLEN: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The output of a ``SPLIT`` scan, all chunks in parallel: ``O = (Q e^g) S_c + Aqk V'`` for V block
    ``program_id(1)`` of (chunk, value head) ``program_id(0)``, from the chunk's starting state ``S_c`` and ``V'``
    the scan left (the same operands, rounded the same way, as the one-pass scan's output dots). ``chunk_base``: the
    first chunk of this launch (segments)."""
    pid = tl.program_id(0) + chunk_base * HV
    vb = tl.program_id(1)
    chunk, hv, start, end = program_chunk(pid, HV, bounds_ptr, T, C, VARLEN)
    if end > start:
        ws_dtype = ws_ptr.dtype.element_ty
        h = hv // (HV // H)
        _, u_ptr, aqk_ptr, gcum_ptr = workspace(ws_ptr, T, HV, K, V, C)
        rows = tl.arange(0, C)
        tmask = rows < end - start
        head_row = hv.to(tl.int64) * T + start
        q_scale = tl.load(gcum_ptr + HV.to(tl.int64) * T + head_row + rows, mask=tmask, other=0.0)
        q = load_tile(q_ptr + (start.to(tl.int64) * H + h) * K, H * K, tmask, 0, K, BK).to(ws_dtype)
        aqk = load_tile(aqk_ptr + head_row * C, C, tmask, 0, C, C)
        v_new = load_tile(u_ptr + head_row * V, V, tmask, vb * BV, V, BV)
        Sd = _state_tile_io(st_ptr + chunk.to(tl.int64) * (HV * K * V), None, hv, vb, K, V, BK, BV, False)
        o = tl.dot(q, Sd.to(ws_dtype), input_precision=DOT_PREC) * q_scale[:, None]
        o = tl.dot(aqk, v_new, acc=o, input_precision=DOT_PREC)
        store_tile(o_ptr + (start.to(tl.int64) * HV + hv) * V, HV * V, tmask, vb * BV, V, BV, o)


@triton.jit(do_not_specialize=["T", "H", "HV", "gate_stride", "ws_copy"])
def _chunk_single_kernel(
    q_ptr, k_ptr, v_ptr,
    g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    ws_ptr, o_ptr,
    cu_ptr, h0_ptr, ht_ptr, slots_ptr, has_init_ptr,
    T, scale, pool_slot_stride, ws_copy,
    H, HV, gate_stride,
    VARLEN: tl.constexpr, RAW_GATING: tl.constexpr, USE_L2: tl.constexpr, STATE_IN: tl.constexpr,
    STATE_OUT: tl.constexpr, POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BKC: tl.constexpr, BVC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, DOT_PREC: tl.constexpr, DIAG_ROWS: tl.constexpr, BLOCK_INV: tl.constexpr, SCALE_K: tl.constexpr,
):
    """Both phases in one launch for a batch whose sequences fit one chunk each (T <= C; the host checks): one
    program per (sequence, value head, V block) prepares the chunk (U in its own V block only) into its own copy of
    the workspace (``ws_copy`` elements apart), then scans its V block. The V blocks' programs repeat the prepare
    side by side instead of waiting for one another: at one chunk, latency is what counts."""
    nh = tl.program_id(0)
    vb = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    start, end = _sequence_bounds(cu_ptr, n, T, VARLEN)
    ws_ptr += vb * ws_copy
    if end > start:
        prepare_chunk(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, ws_ptr, start, end,
                      hv, vb * BV, tl.minimum(vb * BV + BV, V), T, scale, H, HV, gate_stride, K, V, BKC, BVC, C,
                      RAW_GATING, USE_L2, DOT_PREC, DIAG_ROWS, BLOCK_INV, SCALE_K)
    tl.debug_barrier()  # the workspace rows the program's threads wrote are read back by the others below
    h = hv // (HV // H)
    w_ptr, u_ptr, aqk_ptr, gcum_ptr = workspace(ws_ptr, T, HV, K, V, C)
    S, slot = _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV,
                             STATE_IN, POOL, HAS_INIT_FLAGS)
    if end > start:
        S = _scan_chunk(S, q_ptr, k_ptr, v_ptr, w_ptr, u_ptr, aqk_ptr, gcum_ptr, o_ptr, start, end, hv, h, T, H, HV,
                        vb, K, V, BK, BV, C, DOT_PREC)
    _final_state(ht_ptr, S, slot, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV, STATE_OUT, POOL)


# The launches' arguments by name, in the kernels' order; the plan-dependent tail (from K on) is built once per plan.
ScanArgs, ScanConsts = launch_args("Scan", _chunk_scan_kernel, "K")
OutputArgs, OutputConsts = launch_args("Output", _chunk_output_kernel, "K")
SingleArgs, SingleConsts = launch_args("Single", _chunk_single_kernel, "K")
