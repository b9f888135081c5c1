"""The cut-and-correct path of the chunked prefill: a long sequence's state path in parallel pieces.

The state after a span of chunks is affine in the state before it. Per chunk (one value head),
``V' = U - W S`` and ``S <- exp(g_C) S + K~^T V'`` with ``K~ = diag(exp(g_C - g) / |k|) K``, so
``S <- M S + K~^T U`` with ``M = exp(g_C) I - K~^T W`` (``K x K``). Over a segment of chunks,
``S_out = P S_in + L`` where ``P`` is the product of the segments' ``M`` and ``L`` the state the segment reaches from
zero. The path:

1. the prepare (:mod:`.prepare`, W and U form) of every chunk, all in parallel, as always;
2. ``_cut_local_kernel``: every segment of every sequence at once, one program per (segment, value head, column
   block) over the augmented state ``[L | P]`` (``K x (V + K)``): ``L`` from zero (a sequence's first segment from
   its real initial state, so that its ``L`` is the real state after it), ``P`` from the identity (the same update
   with ``U = 0``; a first segment needs no ``P``);
3. ``_cut_correct_kernel``: per (sequence, value head, V block), the chain over the sequence's segments
   ``S_{j+1} = P_j S_j + L_j`` (one fp32 ``[K, K] x [K, BV]`` product per segment), which writes each segment's
   starting state and the sequence's final state (pool slot or tensor row, as the scan does);
4. the one-pass scan (:mod:`.scan`) over the segments as sequences, from their corrected starting states: the output.

The sequential part shrinks from the sequence's chunks to one segment's chunks twice plus one short product per
segment. Numerics as in the rest of the prefill: chunk-local cumulative decays, exp only of ``g_C - g_i <= 0`` and
``g_C <= 0``, the states, ``P`` and every accumulation in fp32 (``P``'s entries stay bounded: each ``M`` is a
decayed product of ``I - beta k k^T`` factors); the correction's product runs fp32-accurate (three tf32 passes on
sm80+). Chosen only by a plan option (``CUT`` in a forced scan config, :meth:`~.plan.Plan.with_configs`); no default
plan takes it until a GPU run has measured where it wins (tuning/notes_gdn.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kernels_triton._config import device_facts
from kernels_triton._launch import DirectLauncher, launch_args
from kernels_triton._util import cdiv, pow2
from kernels_triton.gdn.common import grid_rows, load_tile
from kernels_triton.gdn.metadata import CHUNK, GdnChunkMetadata, tensor_version
from kernels_triton.gdn.prepare import workspace
from kernels_triton.gdn.scan import _final_state, _initial_state, _state_tile_io

MAX_CUT_HEAD_DIM = 128  # the correction holds a [K, K] fp32 tile of P per program
CUT_BVS = (16, 32, 64)  # the local pass' column blocks
LOCAL_OPTIONS = {"num_warps": 4, "num_stages": 2}
CORRECT_BV = 32
CORRECT_OPTIONS = {"num_warps": 8, "num_stages": 1}


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _state_step(S, k_ptr, w_ptr, u_ptr, gcum_ptr, chunk_start, seq_end, hv, h, T, H, HV, vb, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
                HAS_U: tl.constexpr):
    """The state after chunk ``[chunk_start, ..)`` of value head ``hv`` from ``S`` (fp32 ``[BK, BV]``): the scan's
    state path (:func:`~kernels_triton.gdn.scan._scan_chunk`) from the W / U workspace, ``U``'s columns of V block
    ``vb`` where ``HAS_U``, else ``U = 0`` (the columns of a transition product)."""
    ws_dtype = w_ptr.dtype.element_ty
    rows = tl.arange(0, C)
    tmask = rows < seq_end - chunk_start
    head_row = hv.to(tl.int64) * T + chunk_start
    g = tl.load(gcum_ptr + head_row + rows, mask=tmask, other=0.0)
    g_last = tl.load(gcum_ptr + head_row + tl.minimum(C, seq_end - chunk_start) - 1)
    k_scale = tl.load(gcum_ptr + 2 * HV.to(tl.int64) * T + head_row + rows, mask=tmask, other=0.0)
    k = load_tile(k_ptr + (chunk_start * H + h) * K, H * K, tmask, 0, K, BK).to(ws_dtype)
    w = load_tile(w_ptr + head_row * K, K, tmask, 0, K, BK)
    v_new = -tl.dot(w, S.to(ws_dtype), input_precision=DOT_PREC)
    if HAS_U:
        v_new += load_tile(u_ptr + head_row * V, V, tmask, vb * BV, V, BV).to(tl.float32)
    v_scaled = (v_new * (k_scale * tl.exp(g_last - g))[:, None]).to(ws_dtype)
    return S * tl.exp(g_last) + tl.dot(tl.trans(k), v_scaled, input_precision=DOT_PREC)


@triton.jit
def _segment(seg_ptr, j, J):
    """(first token, end token, sequence, whether it is the sequence's first segment) of segment ``j`` from the
    segment table (:func:`segment_table`: token starts ``[J + 1]``, sequence of each ``[J]``, first segment of each
    sequence ``[N + 1]``)."""
    start = tl.load(seg_ptr + j).to(tl.int64)
    end = tl.load(seg_ptr + j + 1).to(tl.int64)
    n = tl.load(seg_ptr + J + 1 + j)
    first = tl.load(seg_ptr + 2 * J + 1 + n) == j
    return start, end, n, first


@triton.jit(do_not_specialize=["T", "J", "H", "HV", "NJ"])
def _cut_local_kernel(
    k_ptr, ws_ptr, seg_ptr, h0_ptr, slots_ptr, has_init_ptr, loc_ptr, mt_ptr,
    T, pool_slot_stride, J, H, HV, NJ,
    STATE_IN: tl.constexpr, POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Column blocks 0 .. cdiv(V, BV) - 1: L's V block (from zero, or a first segment's real initial state) into
    # loc_ptr [J, HV, K, V]; the blocks after them: P's columns (from the identity; none for a first segment) into
    # mt_ptr [J, HV, K, K]. Rows: (segment, value head) pairs, value heads fastest.
    cb = tl.program_id(0)
    row = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    if row >= NJ:
        return
    j = row // HV
    hv = row % HV
    h = hv // (HV // H)
    start, end, n, first = _segment(seg_ptr, j, J)
    w_ptr, u_ptr, aqk_ptr, gcum_ptr = workspace(ws_ptr, T, HV, K, V, C)  # (Aqk is the output pass')
    NVB: tl.constexpr = (V + BV - 1) // BV
    if cb < NVB:
        S = tl.zeros((BK, BV), dtype=tl.float32)
        if first:
            S, slot = _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, cb, pool_slot_stride, HV, K, V, BK, BV,
                                  STATE_IN, POOL, HAS_INIT_FLAGS)
        for chunk_start in range(start, end, C):
            S = _state_step(S, k_ptr, w_ptr, u_ptr, gcum_ptr, chunk_start, end, hv, h, T, H, HV, cb, K, V, BK, BV, C,
                            DOT_PREC, True)
        _state_tile_io(loc_ptr + j.to(tl.int64) * (HV * K * V), S, hv, cb, K, V, BK, BV, True)
    elif first == 0:
        pb = cb - NVB
        kr = tl.arange(0, BK)
        kc = pb * BV + tl.arange(0, BV)
        P = tl.where(kr[:, None] == kc[None, :], 1.0, 0.0)
        for chunk_start in range(start, end, C):
            P = _state_step(P, k_ptr, w_ptr, u_ptr, gcum_ptr, chunk_start, end, hv, h, T, H, HV, pb, K, V, BK, BV, C,
                            DOT_PREC, False)
        _state_tile_io(mt_ptr + j.to(tl.int64) * (HV * K * K), P, hv, pb, K, K, BK, BV, True)


@triton.jit(do_not_specialize=["J", "HV", "NH"])
def _cut_correct_kernel(
    loc_ptr, mt_ptr, seg_ptr, h0_ptr, ht_ptr, slots_ptr, has_init_ptr, seg_h0_ptr,
    pool_slot_stride, J, HV, NH,
    STATE_IN: tl.constexpr, STATE_OUT: tl.constexpr, POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (sequence, value head, V block): the chain S_{j+1} = P_j S_j + L_j over the sequence's
    # segments, each segment's starting state to seg_h0_ptr [J, HV, K, V], the final state where the scan puts it.
    vb = tl.program_id(0)
    nh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    if nh >= NH:
        return
    n = nh // HV
    hv = nh % HV
    S, slot = _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV,
                             STATE_IN, POOL, HAS_INIT_FLAGS)
    lo = tl.load(seg_ptr + 2 * J + 1 + n)
    hi = tl.load(seg_ptr + 2 * J + 2 + n)
    kr = tl.arange(0, BK)
    pmask = (kr[:, None] < K) & (kr[None, :] < K)
    for j in range(lo, hi):
        row = tl.zeros((), dtype=tl.int64) + j  # 64-bit offsets (j is a plain int in the interpreter)
        _state_tile_io(seg_h0_ptr + row * (HV * K * V), S, hv, vb, K, V, BK, BV, True)
        L = _state_tile_io(loc_ptr + row * (HV * K * V), None, hv, vb, K, V, BK, BV, False)
        if j == lo:  # the local pass ran the first segment from the real initial state
            S = L
        else:
            p_base = mt_ptr + (row * HV + hv) * (K * K)
            P = tl.load(p_base + kr[:, None] * K + kr[None, :], mask=pmask, other=0.0)
            S = tl.dot(P, S, input_precision=PREC) + L
    _final_state(ht_ptr, S, slot, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV, STATE_OUT, POOL)


LocalArgs, LocalConsts = launch_args("CutLocal", _cut_local_kernel, "K")
CorrectArgs, CorrectConsts = launch_args("CutCorrect", _cut_correct_kernel, "K")
launch_local = DirectLauncher(_cut_local_kernel)
launch_correct = DirectLauncher(_cut_correct_kernel)


# ----------------------------------------------------------------------------- segments


def segments(offsets: Sequence[int], seg_chunks: int) -> tuple[np.ndarray, int]:
    """(segment table, J): the sequences at ``offsets`` (cu_seqlens' values) cut into segments of ``seg_chunks``
    chunks from each sequence's start (the last one shorter; none for an empty sequence). The table is one int32
    array: each segment's first token then the batch's end (``[J + 1]``, in token order: the cu_seqlens of the
    segments as sequences), each segment's sequence ``[J]``, each sequence's first segment then J ``[N + 1]``."""
    if seg_chunks < 1:
        raise ValueError(f"segments of {seg_chunks} chunks: accepted >= 1")
    span = seg_chunks * CHUNK
    starts, owner, first = [], [], [0]
    for n, (s, e) in enumerate(itertools.pairwise(offsets)):
        for t in range(s, e, span):
            starts.append(t)
            owner.append(n)
        first.append(len(starts))
    J = len(starts)
    return np.asarray([*starts, offsets[-1], *owner, *first], dtype=np.int32), J


_DENSE: dict[tuple, tuple[torch.Tensor, int]] = {}  # tables of single-sequence calls (no cu_seqlens)


def _on_device(table: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(table)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def segment_table(metadata: object | None, cu_seqlens: torch.Tensor | None, T: int, seg_chunks: int,
                  device: torch.device) -> tuple[torch.Tensor, int] | None:
    """(segment table on ``device``, J) of this call (:func:`segments`), built once per batch and kept with its
    metadata (one sequence without ``cu_seqlens``: kept per length); None where the batch's offsets are not known
    on the host (metadata built on the device, or none): the call then takes the plan's other scan."""
    if cu_seqlens is None:
        key = (T, seg_chunks, device)
        found = _DENSE.get(key)
        if found is None:
            if len(_DENSE) >= 64:
                _DENSE.clear()
            table, J = segments((0, T), seg_chunks)
            found = _DENSE[key] = (_on_device(table, device), J)
        return found
    if (not isinstance(metadata, GdnChunkMetadata) or metadata.offsets is None
            or metadata.version != tensor_version(cu_seqlens)
            or metadata.cu_seqlens.data_ptr() != cu_seqlens.data_ptr()):
        return None
    key = ("cut", seg_chunks)
    found = metadata.derived.get(key)
    if found is None:
        table, J = segments(metadata.offsets, seg_chunks)
        found = metadata.derived[key] = (_on_device(table, device), J)
    return found


def suggested_segment_chunks(N: int, HV: int, T: int) -> int:
    """Chunks per segment where the cut path would be tried first: the local pass and the output pass each walk
    one segment, the correction one product per segment, so with ``n`` chunks per sequence the sequential part is
    about ``2 s + n / s`` chunk steps, least at ``s = sqrt(n / 2)``; a power of two, at least 4. (A starting point
    for the GPU run's rows, not a measured rule.)"""
    n = max(1, T // max(N, 1) // CHUNK)
    return max(4, 1 << round(math.log2(max(1.0, math.sqrt(n / 2)))))


def check_cut(scan: dict, K: int, V: int) -> tuple[int, int]:
    """(chunks per segment, local pass V block) of a forced scan config (``CUT``, ``CUT_BV``), checked: ``CUT`` is
    0 (off) or a segment length in chunks; it takes the whole scan, so ``SPLIT``, ``SCAN_T``, ``SEGMENTS`` and
    ``GROUPS`` stay off; head dims up to :data:`MAX_CUT_HEAD_DIM`."""
    cut, cut_bv = scan.get("CUT", 0), scan.get("CUT_BV", 32)
    if type(cut) is not int or cut < 0:
        raise ValueError(f"scan config CUT={cut!r}: accepted 0 (off) or chunks per segment (an integer >= 1)")
    if cut_bv not in CUT_BVS:
        raise ValueError(f"scan config CUT_BV={cut_bv!r}: accepted {', '.join(map(str, CUT_BVS))}")
    if cut:
        others = {k: scan[k] for k in ("SPLIT", "SCAN_T") if scan.get(k)}
        others.update({k: scan[k] for k in ("SEGMENTS", "GROUPS") if scan.get(k, 1) != 1})
        if others:
            raise ValueError(f"scan config CUT={cut} with {others}: the cut path is the whole scan (its output pass is "
                             "the one-pass scan on the W / U workspace); leave SPLIT, SCAN_T, SEGMENTS and GROUPS off")
        if max(K, V) > MAX_CUT_HEAD_DIM:
            raise ValueError(f"scan config CUT={cut} with K={K}, V={V}: the cut path takes head dims <= "
                             f"{MAX_CUT_HEAD_DIM}")
    return cut, cut_bv


def cut_scan_config(device: torch.device, dtype: torch.dtype, N: int, HV: int, K: int, V: int, T: int,
                    seg_chunks: int | None = None, cut_bv: int = 32) -> dict:
    """A forced scan config (:meth:`~.plan.Plan.with_configs`) that takes the cut path: ``CUT`` (default
    :func:`suggested_segment_chunks`), ``CUT_BV``, and the output pass' V block and stages, the one-pass scan's rule
    for the segments as sequences (:func:`~.plan.scan_config`; 32-wide two-stage blocks where that rule would split
    the scan)."""
    from kernels_triton.gdn.plan import avoid_miscompiled_scan, scan_config

    seg = suggested_segment_chunks(N, HV, T) if seg_chunks is None else seg_chunks
    J = max(1, N * cdiv(max(T // max(N, 1), 1), seg * CHUNK))
    per_seg = max(1, min(T // max(N, 1), seg * CHUNK))
    base = scan_config(device, J, HV, K, V, 1 << per_seg.bit_length() - 1, dtype)
    if base.get("SPLIT"):
        base = {"BV": min(32, pow2(V, 16)), "num_warps": 4, "num_stages": 2}
    cfg = {k: v for k, v in base.items() if k in ("BV", "num_warps", "num_stages", "maxnreg")}
    if device.type == "cuda":
        cfg = avoid_miscompiled_scan(cfg, dtype, V)
    return {**cfg, "CUT": seg, "CUT_BV": cut_bv}


# ----------------------------------------------------------------------------- the call


def correction_precision(device: torch.device) -> str:
    """The correction's dot precision: fp32-accurate (three tf32 passes on sm80+, else plain fp32)."""
    return "tf32x3" if device_facts(device)[2] >= (8, 0) else "ieee"


def run(plan, table: torch.Tensor, J: int, scan_args: tuple, N: int, HV: int) -> None:  # noqa: ANN001 - plan.Plan
    """Steps 2-4 of the path (module docstring) after the caller launched the prepare of every chunk (W / U form):
    ``scan_args`` are the call's one-pass scan arguments (:data:`~.scan.ScanArgs`: inputs, workspace, output, state
    I/O); the local pass and the correction read and write the states those name, the output pass scans the
    segments from their corrected states."""
    from kernels_triton.gdn.launch import launch_scan

    K, V, C = plan.scan.K, plan.scan.V, plan.scan.C
    BK, bv = plan.scan.BK, plan.cut_bv
    dev = scan_args.q_ptr.device
    a = scan_args
    buf = torch.empty(J * HV * K * (2 * V + K), dtype=torch.float32, device=dev)
    loc = buf[:J * HV * K * V]
    seg_h0 = buf[J * HV * K * V:2 * J * HV * K * V]
    mt = buf[2 * J * HV * K * V:]
    cols = cdiv(V, bv) + cdiv(K, bv)
    launch_local((cols, *grid_rows(J * HV)), tuple.__new__(LocalArgs, (
        a.k_ptr, a.ws_ptr, table, a.h0_ptr, a.slots_ptr, a.has_init_ptr, loc, mt, a.T, a.pool_slot_stride, J, a.H, HV,
        J * HV, a.STATE_IN, a.POOL, a.HAS_INIT_FLAGS, K, V, BK, bv, C, plan.scan.DOT_PREC)), LOCAL_OPTIONS)
    cbv = min(CORRECT_BV, pow2(V, 16))
    launch_correct((cdiv(V, cbv), *grid_rows(N * HV)), tuple.__new__(CorrectArgs, (
        loc, mt, table, a.h0_ptr, a.ht_ptr, a.slots_ptr, a.has_init_ptr, seg_h0, a.pool_slot_stride, J, HV, N * HV,
        a.STATE_IN, a.STATE_OUT, a.POOL, a.HAS_INIT_FLAGS, K, V, BK, cbv, correction_precision(dev))),
        CORRECT_OPTIONS)
    out_args = a._replace(cu_ptr=table, h0_ptr=seg_h0, ht_ptr=None, slots_ptr=None, has_init_ptr=None, NH=J * HV,
                          VARLEN=True, STATE_IN=True, STATE_OUT=False, POOL=False, HAS_INIT_FLAGS=False, SPLIT=False,
                          PART=False, CARRY_IN=False, CARRY_OUT=False)
    launch_scan(plan.scan_grid(J, HV), out_args, plan.scan_options)
