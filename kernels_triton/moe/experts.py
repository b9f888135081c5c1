"""Grouped expert GEMMs over aligned blocks, and the deterministic top-k combine.

gate_up: ``h[r] = silu(x[tok(r)] @ Wg[e]^T) * (x[tok(r)] @ Wu[e]^T)`` for each aligned row ``r``
(one program computes a BLOCK_M x BLOCK_N tile of both halves, so the SiLU-mul is its epilogue);
``h`` is kept in aligned (sorted) row order so the down GEMM reads it contiguously.
down: ``y[slot(r)] = weight[slot(r)] * (h[r] @ W2[e]^T)``, one row per (token, pick), in the
activation dtype. combine: ``out[t] = sum_j y[t, j]`` in fp32, j in a fixed order, plus an optional
extra term (a shared expert computed elsewhere). No float atomics anywhere: the same input gives
bit-identical output.

Weights: ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``; group ``E`` (when
HAS_SHARED) uses ``shared_w13 [2I, H]`` / ``shared_w2 [H, I]``. Pointer offsets that can pass
2**31 elements are int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from kernels_triton._arrival import BLOCK_COUNTERS, signal, wait_for
from kernels_triton._launch import DirectLauncher, ensure_scratch_allocator
from kernels_triton._util import cdiv, pow2
from kernels_triton.moe import pdl as _pdl
from kernels_triton.moe.align import Alignment
from kernels_triton.moe.config import GemmConfig


@triton.jit
def _block_group(block, block_group_ptr, group_start_ptr, group_count_ptr, BLOCK_M: tl.constexpr):
    """(group, first aligned row of the group, real slots in the group, real rows in this block) of one block."""
    group = tl.load(block_group_ptr + block)
    start = tl.load(group_start_ptr + group)
    count = tl.load(group_count_ptr + group)
    return group, start, count, tl.minimum(count - (block * BLOCK_M - start), BLOCK_M)


@triton.jit
def _tile_rows(row0, start, count, sorted_ptr, BM: tl.constexpr):
    """(aligned row indices, which rows are real slots, slot ids) of the BM rows from ``row0``."""
    rows = row0 + tl.arange(0, BM)
    real = rows - start < count
    slots = tl.load(sorted_ptr + rows, mask=real, other=0)  # padding rows read slot 0: valid memory, never stored
    return rows, real, slots


@triton.jit
def expert_weights(w_ptr, shared_w_ptr, group, expert_numel, E_LOCAL, HAS_SHARED: tl.constexpr):
    """Base pointer of group's weights: expert ``group`` of the stack, or the shared expert (group E_LOCAL)."""
    base = w_ptr + group.to(tl.int64) * expert_numel
    if HAS_SHARED:
        if group == E_LOCAL:
            base = shared_w_ptr
    return base


@triton.jit
def _gate_up_tile(x_ptr, w_base, sorted_ptr, h_ptr, row0, start, count, tile_n, H, I, SLOTS, BM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                  IEEE: tl.constexpr, TMA: tl.constexpr):
    """One BM x BLOCK_N tile of h (both halves, SiLU-mul epilogue) for the aligned rows from ``row0``."""
    rows, real, slots = _tile_rows(row0, start, count, sorted_ptr, BM)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (slots // SLOTS).to(tl.int64)[:, None] * H + ks[None, :]  # gather the tokens' rows
    g_ptrs = w_base + cols[None, :] * H + ks[:, None]  # [BLOCK_K, BLOCK_N] view of the gate rows
    u_ptrs = g_ptrs + I * H  # the up rows follow the gate rows
    acc_g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    if TMA:  # weight tiles by the tensor-memory accelerator (sm_90+; needs EVEN_N: a ragged gate tile would reach
        # into the up rows): K-contiguous [BLOCK_N, BLOCK_K] tiles, zero-filled past H; the x rows stay a gather
        w_desc = tl.make_tensor_descriptor(w_base, shape=[2 * I, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K])
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(ks + k0 < H)[None, :], other=0.0)
            bg = w_desc.load([tile_n * BLOCK_N, k0])
            bu = w_desc.load([I + tile_n * BLOCK_N, k0])
            acc_g = tl.dot(a, bg.T, acc_g)
            acc_u = tl.dot(a, bu.T, acc_u)
            a_ptrs += BLOCK_K
    else:
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K and EVEN_N:
                a = tl.load(a_ptrs)
                bg = tl.load(g_ptrs)
                bu = tl.load(u_ptrs)
            else:
                k_ok = (ks + k0) < H
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                bg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:  # fp32 inputs: full fp32 products, not tf32
                acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, bg, acc_g)
                acc_u = tl.dot(a, bu, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(h_ptrs, act.to(h_ptr.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, shared_w_ptr, sorted_ptr, block_group_ptr, group_start_ptr, group_count_ptr,
                    total_blocks_ptr, h_ptr, done_ptr, H, I, SLOTS, E_LOCAL, HAS_SHARED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr, SUB_LEVELS: tl.constexpr = 0,
                    TMA: tl.constexpr = False, PDL: tl.constexpr = False, SIGNAL: tl.constexpr = False):
    """One aligned block times one column tile. With SUB_LEVELS, a group's last block holding at most
    BLOCK_M / 2 (/ 4 with two levels) real rows runs a tile of that height: its padding rows cost no MMA work.
    SIGNAL: every program then signals its block's counter ``done_ptr[block]`` (unused blocks too), for a down
    launch that waits block by block (:func:`down`)."""
    _pdl.enter(PDL)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(I, BLOCK_N)
    block, tile_n = pid // n_tiles, pid % n_tiles
    if block >= tl.load(total_blocks_ptr):
        if SIGNAL:
            signal(done_ptr + block)
        return
    group, start, count, n_real = _block_group(block, block_group_ptr, group_start_ptr, group_count_ptr, BLOCK_M)
    w_base = expert_weights(w_ptr, shared_w_ptr, group, 2 * I * H, E_LOCAL, HAS_SHARED)
    row0 = block * BLOCK_M
    if SUB_LEVELS >= 2:
        if n_real <= BLOCK_M // 4:
            _gate_up_tile(x_ptr, w_base, sorted_ptr, h_ptr, row0, start, count, tile_n, H, I, SLOTS, BLOCK_M // 4,
                          BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, TMA)
            if SIGNAL:
                signal(done_ptr + block)
            return
    if SUB_LEVELS >= 1:
        if n_real <= BLOCK_M // 2:
            _gate_up_tile(x_ptr, w_base, sorted_ptr, h_ptr, row0, start, count, tile_n, H, I, SLOTS, BLOCK_M // 2,
                          BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, TMA)
            if SIGNAL:
                signal(done_ptr + block)
            return
    _gate_up_tile(x_ptr, w_base, sorted_ptr, h_ptr, row0, start, count, tile_n, H, I, SLOTS, BLOCK_M,
                  BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, TMA)
    if SIGNAL:
        signal(done_ptr + block)


@triton.jit
def _down_step(a_ptrs, b_ptrs, acc, k0, ks, I, col_ok, EVEN: tl.constexpr, IEEE: tl.constexpr,
               CG: tl.constexpr = False):
    """One K step of the down GEMM: ``acc += h[rows, k0:k0+BK] @ W2[cols, k0:k0+BK]^T`` (masked unless EVEN;
    CG: h past L1, as a launch still running stored it)."""
    if EVEN:
        a = tl.load(a_ptrs, cache_modifier=".cg" if CG else "")
        b = tl.load(b_ptrs)
    else:
        k_ok = (ks + k0) < I
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0, cache_modifier=".cg" if CG else "")
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    if IEEE:  # fp32 inputs: full fp32 products, not tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _down_step_tma(a_ptrs, w_desc, acc, n0, k0, ks, I, EVEN_K: tl.constexpr, CG: tl.constexpr = False):
    """:func:`_down_step` with the weight tile from a tensor descriptor (bf16 / fp16 only)."""
    if EVEN_K:
        a = tl.load(a_ptrs, cache_modifier=".cg" if CG else "")
    else:
        a = tl.load(a_ptrs, mask=(ks + k0 < I)[None, :], other=0.0, cache_modifier=".cg" if CG else "")
    return tl.dot(a, w_desc.load([n0, k0]).T, acc)


@triton.jit
def _down_store(acc, weight, y_rows, real, cols, H):
    """Epilogue of one down tile: the router weight applied, the real rows' columns below H stored."""
    out = acc * weight[:, None]
    tl.store(y_rows + cols[None, :], out.to(y_rows.dtype.element_ty), mask=real[:, None] & (cols < H)[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, shared_w_ptr, sorted_ptr, block_group_ptr, group_start_ptr, group_count_ptr,
                 total_blocks_ptr, weights_ptr, y_ptr, done_ptr, UP_TILES, H, I, E_LOCAL, HAS_SHARED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr, TILES_N: tl.constexpr = 1,
                 SUB_LEVELS: tl.constexpr = 0, TMA: tl.constexpr = False, PDL: tl.constexpr = False,
                 PREFETCH_LINES: tl.constexpr = 0, LINE_ELEMS: tl.constexpr = 64, WAIT: tl.constexpr = False):
    """One aligned block times TILES_N column tiles of its expert's W2 (SUB_LEVELS: as in the gate_up kernel).

    TILES_N > 1 runs the tiles' K loops as one flat loop (the epilogue of a tile inside it), so the
    pipelined loads of the next tile start while the current one finishes, and the block's index loads
    are paid once: at large M the down GEMM's K (= I) is short (2-8 steps of BLOCK_K), so a tile's
    pipeline fill, index loads and epilogue are a large part of its time.

    PREFETCH_LINES (with PDL): before waiting for the gate_up launch, the program's weight rows go into L2 (the
    alignment that names its expert is finished by then; kernels_triton.moe.pdl).

    WAIT: instead of waiting for the whole gate_up launch (PDL), a program waits for the UP_TILES gate_up programs
    of its own block (``done_ptr[block]``, see :func:`down`), so blocks whose ``h`` is ready run while the gate_up
    launch's last programs still stream their weights.
    """
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(H, BLOCK_N)
    n_groups = tl.cdiv(n_tiles, TILES_N)
    block, tile_n = pid // n_groups, (pid % n_groups) * TILES_N
    if PREFETCH_LINES > 0:
        if block < tl.load(total_blocks_ptr):
            w_next = expert_weights(w_ptr, shared_w_ptr, tl.load(block_group_ptr + block), H * I, E_LOCAL,
                                     HAS_SHARED)
            _pdl.prefetch_rows_l2(w_next, tile_n * BLOCK_N, H, I, BLOCK_N * TILES_N, PREFETCH_LINES, LINE_ELEMS)
    if WAIT:
        _pdl.let_next_start(PDL)
        wait_for(done_ptr + block, UP_TILES)
    else:
        _pdl.enter(PDL)
    if block >= tl.load(total_blocks_ptr):
        return
    group, start, count, n_real = _block_group(block, block_group_ptr, group_start_ptr, group_count_ptr, BLOCK_M)
    w_base = expert_weights(w_ptr, shared_w_ptr, group, H * I, E_LOCAL, HAS_SHARED)
    row0 = block * BLOCK_M
    if SUB_LEVELS >= 2:
        if n_real <= BLOCK_M // 4:
            _down_tiles(h_ptr, w_base, sorted_ptr, weights_ptr, y_ptr, row0, start, count, tile_n, n_tiles, H, I,
                        BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, TILES_N, TMA, WAIT)
            return
    if SUB_LEVELS >= 1:
        if n_real <= BLOCK_M // 2:
            _down_tiles(h_ptr, w_base, sorted_ptr, weights_ptr, y_ptr, row0, start, count, tile_n, n_tiles, H, I,
                        BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, TILES_N, TMA, WAIT)
            return
    _down_tiles(h_ptr, w_base, sorted_ptr, weights_ptr, y_ptr, row0, start, count, tile_n, n_tiles, H, I,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, TILES_N, TMA, WAIT)


@triton.jit
def _down_tiles(h_ptr, w_base, sorted_ptr, weights_ptr, y_ptr, row0, start, count, tile0, n_tiles, H, I,
                BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                EVEN_N: tl.constexpr, IEEE: tl.constexpr, TILES_N: tl.constexpr, TMA: tl.constexpr,
                CG: tl.constexpr = False):
    """Column tiles ``tile0 ..`` (at most TILES_N) of the BM aligned rows from ``row0`` (TMA: weight tiles by the
    tensor-memory accelerator, K-contiguous ``[BLOCK_N, BLOCK_K]``, zero-filled past H and I).

    One tile: a plain K loop. Several: one loop over (tile, K step) pairs; a tile's result is scaled and stored
    at its last K step. Same K order per tile as the one-tile loop: same bits."""
    rows, real, slots = _tile_rows(row0, start, count, sorted_ptr, BM)
    ks = tl.arange(0, BLOCK_K)
    a_rows = h_ptr + rows.to(tl.int64)[:, None] * I
    y_rows = y_ptr + slots.to(tl.int64)[:, None] * H
    weight = tl.load(weights_ptr + slots, mask=real, other=0.0)
    if TILES_N == 1:
        cols = tile0 * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        a_ptrs = a_rows + ks[None, :]
        b_ptrs = w_base + cols[None, :] * I + ks[:, None]
        acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        if TMA:
            w_desc = tl.make_tensor_descriptor(w_base, shape=[H, I], strides=[I, 1], block_shape=[BLOCK_N, BLOCK_K])
            for k0 in range(0, I, BLOCK_K):
                acc = _down_step_tma(a_ptrs, w_desc, acc, tile0 * BLOCK_N, k0, ks, I, EVEN_K, CG)
                a_ptrs += BLOCK_K
        else:
            for k0 in range(0, I, BLOCK_K):
                acc = _down_step(a_ptrs, b_ptrs, acc, k0, ks, I, col_ok, EVEN_K and EVEN_N, IEEE, CG)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        _down_store(acc, weight, y_rows, real, cols, H)
    else:
        n_k = tl.cdiv(I, BLOCK_K)
        steps = tl.minimum(n_tiles - tile0, TILES_N) * n_k
        acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        if TMA:
            w_desc = tl.make_tensor_descriptor(w_base, shape=[H, I], strides=[I, 1], block_shape=[BLOCK_N, BLOCK_K])
            for it in range(0, steps):
                t = it // n_k
                k0 = (it - t * n_k) * BLOCK_K
                acc = _down_step_tma(a_rows + (k0 + ks)[None, :], w_desc, acc, (tile0 + t) * BLOCK_N, k0, ks, I,
                                     EVEN_K, CG)
                if k0 + BLOCK_K >= I:  # this tile's last K step: epilogue, then start the next tile from zero
                    _down_store(acc, weight, y_rows, real, (tile0 + t) * BLOCK_N + tl.arange(0, BLOCK_N), H)
                    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        else:
            for it in range(0, steps):
                t = it // n_k
                k0 = (it - t * n_k) * BLOCK_K
                cols = (tile0 + t) * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = _down_step(a_rows + (k0 + ks)[None, :], w_base + cols[None, :] * I + (k0 + ks)[:, None], acc,
                                 k0, ks, I, cols < H, EVEN_K and EVEN_N, IEEE, CG)
                if k0 + BLOCK_K >= I:
                    _down_store(acc, weight, y_rows, real, cols, H)
                    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)


@triton.jit
def _combine_kernel(y_ptr, slot_group_ptr, extra_ptr, out_ptr, done_ptr, N_DONE, H, SLOTS: tl.constexpr,
                    HAS_EXTRA: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
                    ZERO_DONE: tl.constexpr = False):
    """out[t] = sum_j y[t * SLOTS + j] (dropped slots skipped), j ascending, in fp32; + extra[t].

    ZERO_DONE: the first program puts the N_DONE block counters the expert launches used back to zero (both have
    finished: this launch waits for the down launch, which waited for the gate_up launch's every block)."""
    _pdl.enter(PDL)
    if ZERO_DONE:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            for b0 in range(0, N_DONE, BLOCK_H):
                bs = b0 + tl.arange(0, BLOCK_H)
                tl.store(done_ptr + bs, tl.zeros_like(bs), mask=bs < N_DONE)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        kept = tl.load(slot_group_ptr + token * SLOTS + j) >= 0
        acc += tl.load(y_ptr + (token * SLOTS + j) * H + cols, mask=col_ok & kept, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + token * H + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# launched through DirectLauncher: no per-call argument binding once compiled (see kernels_triton/_launch.py)
_launch_gate_up = DirectLauncher(_gate_up_kernel)
_launch_down = DirectLauncher(_down_kernel)
_launch_combine = DirectLauncher(_combine_kernel)


def sub_levels(block_m: int) -> int:
    """How many times a block may halve its tile when it holds few real rows (128-row blocks: 64 and 32 rows).

    Each expert's group of token-slots is padded to a multiple of BLOCK_M, and its last block is often mostly padding
    (35B at 2048-8192 tokens: ~64-256 slots per expert, spread by a few tens). A block with at most BLOCK_M / 2 (/ 4)
    real rows runs a tile of that height instead: the same weight tiles are read, a half (a quarter) of the MMA work
    is done (measured on the H200: gate_up + down 652 against 724 µs at 35B M=4096; 64-row blocks lost with a 32-row
    level, so they keep one tile height; tuning/notes_moe.md). The expert GEMMs take ``sub=`` to override this.
    """
    return 2 if block_m >= 128 else 0


TMA_DOWN_MIN_ROWS = 256  # token-slots per group from which the down GEMM takes it by default (see tma_default)


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_possible(which: str, x: torch.Tensor, cfg: GemmConfig, H: int, I: int) -> bool:
    """Whether ``which`` ('gate_up' / 'down') can read its weight tiles through tensor descriptors: a CUDA device of
    compute capability 9.0+, bf16 / fp16, rows of 16-byte multiples and (gate_up) column tiles that divide I."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if x.device.type != "cuda":  # Triton's interpreter emulates descriptors (the CPU tests run this path)
        return x.device.type == "cpu" and bool(knobs.runtime.interpret)
    if _capability(x.device.index)[0] < 9:
        return False
    row = H if which == "gate_up" else I
    return row % 8 == 0 and (which != "gate_up" or I % cfg.BLOCK_N == 0)


def tma_default(which: str, x: torch.Tensor, cfg: GemmConfig, H: int, I: int, rows_per_group: float) -> bool:
    """Whether ``which`` reads its weight tiles through tensor descriptors when the caller does not say: only the
    down GEMM, from TMA_DOWN_MIN_ROWS token-slots per group on (measured on the H200, same bits: down 662 against 721 µs
    at 35B M=16384; fewer slots per group lost or tied, and gate_up moved -5..+3 %; tuning/notes_moe.md). The
    interpreter takes the path only when asked (tests)."""
    return (which == "down" and x.is_cuda and rows_per_group >= TMA_DOWN_MIN_ROWS
            and tma_possible(which, x, cfg, H, I))


def _use_tma(which: str, tma: bool | None, x: torch.Tensor, cfg: GemmConfig, H: int, I: int,
             rows_per_group: float) -> bool:
    if tma is None:
        tma = tma_default(which, x, cfg, H, I, rows_per_group)
    elif tma and not tma_possible(which, x, cfg, H, I):
        raise ValueError(f"{which}: tensor-descriptor weight tiles need a CUDA device of compute capability 9.0+, "
                         f"bf16/fp16 and 16-byte rows (got {x.device}, {x.dtype}, H={H}, I={I}, "
                         f"BLOCK_N={cfg.BLOCK_N})")
    if tma:
        ensure_scratch_allocator()
    return tma


def gate_up(x: torch.Tensor, w13: torch.Tensor, shared_w13: torch.Tensor | None, al: Alignment, slots: int,
            cfg: GemmConfig, sub: int | None = None, tma: bool | None = None, pdl: bool = False,
            done: torch.Tensor | None = None) -> torch.Tensor:
    """``h`` ``[max_blocks * BLOCK_M, I]`` in aligned row order (padding rows unwritten).

    ``sub``: tile-halving levels for a group's last block (default :func:`sub_levels`). ``tma``: weight tiles
    through tensor descriptors (default :func:`tma_default`); the same bits either way up to the MMA order.
    ``done``: block counters (``kernels_triton._arrival.block_counters``) each program signals when its tile of
    ``h`` is stored; the :func:`down` launch that follows must then wait on them, and the :func:`combine` after it
    zero them."""
    H, I = x.shape[1], w13.shape[1] // 2
    tma = _use_tma("gate_up", tma, x, cfg, H, I, x.shape[0] * slots / al.n_groups)
    h = torch.empty(al.max_blocks * al.block_m, I, dtype=x.dtype, device=x.device)
    grid = (al.max_blocks * cdiv(I, cfg.BLOCK_N),)
    _check_counters(done, al)
    _launch_gate_up[grid](
        x, w13, shared_w13 if shared_w13 is not None else w13, al.sorted_slots, al.block_group, al.group_start,
        al.group_count, al.total_blocks, h, done if done is not None else al.total_blocks, H, I, slots, w13.shape[0],
        HAS_SHARED=shared_w13 is not None,
        BLOCK_M=al.block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, EVEN_K=H % cfg.BLOCK_K == 0,
        EVEN_N=I % cfg.BLOCK_N == 0, IEEE=x.dtype == torch.float32,
        SUB_LEVELS=sub_levels(al.block_m) if sub is None else sub, TMA=tma, PDL=pdl, SIGNAL=done is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl.options(pdl))
    return h


def down_tiles_per_program(cfg: GemmConfig, H: int, I: int) -> int:
    """Column tiles one down program runs in a flat loop (see :func:`_down_kernel`): about 32 K steps per program
    with 64- and 128-row blocks; one tile with 16-row blocks (decode streams weights: it wants many programs).
    Measured on the H200, the down GEMM alone against one tile per program: 397B-TP8 M=4096 268 against 421 µs, 35B
    M=16384 609 against 688; one loss, 35B M=1024 153 against 145 (tuning/notes_moe.md).
    """
    if cfg.BLOCK_M < 64:
        return 1
    return max(1, min(cdiv(H, cfg.BLOCK_N), 32 // cdiv(I, cfg.BLOCK_K)))


def down(h: torch.Tensor, w2: torch.Tensor, shared_w2: torch.Tensor | None, al: Alignment, weights: torch.Tensor,
         cfg: GemmConfig, tiles_n: int | None = None, sub: int | None = None, tma: bool | None = None,
         pdl: bool = False, prefetch: bool | None = None, done: torch.Tensor | None = None,
         up_tiles: int = 0) -> torch.Tensor:
    """``y`` ``[M * slots, H]``: each kept slot's expert output times its router weight (dropped rows unwritten).

    ``tiles_n``: column tiles per program (default :func:`down_tiles_per_program`); any value gives the same bits.
    ``sub``, ``tma``, ``pdl``: as in :func:`gate_up`. ``prefetch`` (with ``pdl``): the weight rows into L2 before
    the wait; by default at one token only (kernels_triton/moe/pdl.py). ``done``: the counters the gate_up launch
    just before signalled (``gate_up(done=...)``, ``up_tiles`` = its column tiles per block): each program waits for
    its own block's gate_up programs instead of the whole launch (:func:`block_wait_default`).
    """
    H, I = w2.shape[1], w2.shape[2]
    tma = _use_tma("down", tma, h, cfg, H, I, weights.numel() / al.n_groups)
    y = torch.empty(weights.numel(), H, dtype=h.dtype, device=h.device)
    n_tiles = cdiv(H, cfg.BLOCK_N)
    tiles_n = max(1, min(tiles_n or down_tiles_per_program(cfg, H, I), n_tiles))
    grid = (al.max_blocks * cdiv(n_tiles, tiles_n),)
    lines, line_elems = _pdl.prefetch_lines(I, w2.element_size())
    if prefetch is None:
        prefetch = pdl and weights.shape[0] == 1
    _check_counters(done, al)
    if done is not None and up_tiles < 1:
        raise ValueError(f"down: with done counters, up_tiles (the gate_up launch's column tiles per block) must be "
                         f">= 1, got {up_tiles}")
    _launch_down[grid](
        h, w2, shared_w2 if shared_w2 is not None else w2, al.sorted_slots, al.block_group, al.group_start,
        al.group_count, al.total_blocks, weights, y, done if done is not None else al.total_blocks, up_tiles, H, I,
        w2.shape[0], HAS_SHARED=shared_w2 is not None,
        BLOCK_M=al.block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, EVEN_K=I % cfg.BLOCK_K == 0,
        EVEN_N=H % cfg.BLOCK_N == 0, IEEE=h.dtype == torch.float32, TILES_N=tiles_n,
        SUB_LEVELS=sub_levels(al.block_m) if sub is None else sub, TMA=tma, PDL=pdl,
        PREFETCH_LINES=lines if pdl and prefetch else 0, LINE_ELEMS=line_elems, WAIT=done is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl.options(pdl))
    return y


BLOCK_WAIT_MAX_TOKENS = 16  # the down launch waits block by block up to this many tokens (see block_wait_default)


def block_wait_default(pdl: bool, al: Alignment, M: int) -> bool:
    """Whether the down launch for M tokens waits block by block (``done`` counters the gate_up launch signals)
    rather than for the whole gate_up launch.

    Only with PDL, where the down launch's programs start while the gate_up launch's last ones run (without it the
    whole launch has finished anyway): each down program then starts as soon as the gate_up programs of its own
    block have stored ``h``, and fills the SMs the gate_up launch's last wave leaves idle. Up to
    BLOCK_WAIT_MAX_TOKENS tokens (measured on the H200 by graph replay: 35B-A3B M=16 161.9 against 166.2 µs; at M=32
    255.0 against 252.6, more and shorter down programs each paying its wait's round trip; tuning/notes_moe.md).
    """
    return pdl and al.max_blocks <= BLOCK_COUNTERS and M <= BLOCK_WAIT_MAX_TOKENS


def _check_counters(done: torch.Tensor | None, al: Alignment) -> None:
    if done is not None and (done.dtype != torch.int32 or done.numel() < al.max_blocks):
        raise ValueError(f"done counters: need int32 with at least {al.max_blocks} entries (one per block), got "
                         f"{done.dtype} with {done.numel()}")


def combine(y: torch.Tensor, al: Alignment, M: int, slots: int, extra: torch.Tensor | None = None,
            pdl: bool = False, done: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, H]`` in y's dtype: the fixed-order sum of each token's slots (+ ``extra``). ``done``: the block counters
    the gate_up and down launches before it used, put back to zero."""
    H = y.shape[1]
    out = torch.empty(M, H, dtype=y.dtype, device=y.device)
    block_h = min(1024, pow2(H))
    _check_counters(done, al)
    _launch_combine[(M, cdiv(H, block_h))](
        y, al.slot_group, extra if extra is not None else y, out, done if done is not None else al.total_blocks,
        al.max_blocks, H, SLOTS=slots, HAS_EXTRA=extra is not None, BLOCK_H=block_h, PDL=pdl,
        ZERO_DONE=done is not None, num_warps=4, **_pdl.options(pdl))
    return out
