"""Token alignment: group token-slots by expert into blocks of BLOCK_M rows, on the device, no host sync.

A *slot* is one (token, pick) pair, numbered ``token * slots + j``. Each slot belongs to a *group*:
its local expert (through ``expert_map``; -1 = held elsewhere, dropped), or, for the shared-expert
slot that :func:`kernels_triton.moe.routing.route` appends, group ``E_local``. The result lists the
slots of group 0, then group 1, ..., each group padded to a multiple of BLOCK_M, in slot order
within a group (a counting sort: deterministic, and stable).

Three launches over chunks of CHUNK slots (one fused launch when a single chunk holds them all):
count (per-chunk histograms), scan (group totals, padded starts, where each chunk's slots of each
group begin), scatter (sort the chunk's (group, slot) keys, place each at its base plus its rank).
Block ``b`` belongs to group ``block_group[b]``; blocks ``>= total_blocks`` are unused; row ``r``
of group ``g`` is a real slot when ``r - group_start[g] < group_count[g]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SINGLE_CHUNK_MAX = 1024  # slots handled by one fused program
MAX_CHUNKS = 32
SCAN_TILE = 8192  # elements of the [chunks, G_PAD] tile the scan holds
_NO_KEY = tl.constexpr(0x7FFFFFFF)  # sorts after every real (group, index) key


@dataclass
class Alignment:
    """Device tensors describing the grouped slots (all int32) and the static sizes used to launch on them."""

    sorted_slots: torch.Tensor  # [max_blocks * block_m]
    block_group: torch.Tensor  # [max_blocks]
    group_start: torch.Tensor  # [G]
    group_count: torch.Tensor  # [G]
    total_blocks: torch.Tensor  # [1]
    slot_group: torch.Tensor  # [n]: group of each slot, -1 if dropped
    block_m: int
    max_blocks: int
    n_groups: int


@triton.jit
def _slot_groups(ids_ptr, map_ptr, offs, in_range, E_GLOBAL, E_LOCAL, HAS_MAP: tl.constexpr,
                 HAS_SHARED: tl.constexpr):
    """Group of each slot: local expert id, E_LOCAL for the shared slot (id == E_GLOBAL), -1 if dropped."""
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    routed = in_range & (ids >= 0) & (ids < E_GLOBAL)
    if HAS_MAP:
        group = tl.load(map_ptr + ids, mask=routed, other=-1).to(tl.int32)
    else:
        group = tl.where(routed, ids, -1)
    if HAS_SHARED:
        group = tl.where(in_range & (ids == E_GLOBAL), E_LOCAL, group)
    return group


@triton.jit
def _scatter_chunk(group, chunk, base_ptr, sorted_ptr, block_group_ptr, G, CHUNK: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """Place one chunk's slots: sort (group, index) keys; the p-th key goes to base[chunk, group] + p."""
    p = tl.arange(0, CHUNK)
    keys = tl.sort(tl.where(group >= 0, group * CHUNK + p, _NO_KEY))
    real = keys != _NO_KEY
    g = keys // CHUNK
    pos = p + tl.load(base_ptr + chunk * G + g, mask=real, other=0)
    tl.store(sorted_ptr + pos, chunk * CHUNK + keys % CHUNK, mask=real)
    tl.store(block_group_ptr + pos // BLOCK_M, g, mask=real)  # every row of a block writes the same value


@triton.jit
def _align_count_kernel(ids_ptr, map_ptr, slot_group_ptr, counts_ptr, n, G, E_GLOBAL, E_LOCAL,
                        HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr, CHUNK: tl.constexpr,
                        G_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < n
    group = _slot_groups(ids_ptr, map_ptr, offs, in_range, E_GLOBAL, E_LOCAL, HAS_MAP, HAS_SHARED)
    tl.store(slot_group_ptr + offs, group, mask=in_range)
    hist = tl.histogram(tl.maximum(group, 0), G_PAD, mask=group >= 0)
    gs = tl.arange(0, G_PAD)
    tl.store(counts_ptr + chunk * G + gs, hist, mask=gs < G)


@triton.jit
def _align_scan_kernel(counts_ptr, base_ptr, group_start_ptr, group_count_ptr, total_blocks_ptr, n_chunks, G,
                       BLOCK_M: tl.constexpr, G_PAD: tl.constexpr, TILE_C: tl.constexpr):
    gs = tl.arange(0, G_PAD)
    g_ok = gs < G
    totals = tl.zeros((G_PAD,), dtype=tl.int32)
    for c0 in range(0, n_chunks, TILE_C):
        cs = c0 + tl.arange(0, TILE_C)
        m = (cs < n_chunks)[:, None] & g_ok[None, :]
        totals += tl.sum(tl.load(counts_ptr + cs[:, None] * G + gs[None, :], mask=m, other=0), axis=0)
    n_blocks = (totals + BLOCK_M - 1) // BLOCK_M
    start = (tl.cumsum(n_blocks, 0) - n_blocks) * BLOCK_M
    tl.store(group_start_ptr + gs, start, mask=g_ok)
    tl.store(group_count_ptr + gs, totals, mask=g_ok)
    tl.store(total_blocks_ptr, tl.sum(n_blocks, 0))
    earlier = tl.zeros((G_PAD,), dtype=tl.int32)  # slots of each group in the chunks already scanned
    for c0 in range(0, n_chunks, TILE_C):
        cs = c0 + tl.arange(0, TILE_C)
        m = (cs < n_chunks)[:, None] & g_ok[None, :]
        tile = tl.load(counts_ptr + cs[:, None] * G + gs[None, :], mask=m, other=0)
        before = tl.cumsum(tile, 0) - tile + earlier[None, :]  # same group, earlier chunks
        lower = tl.cumsum(tile, 1) - tile  # same chunk, lower groups: they sort first in the chunk
        tl.store(base_ptr + cs[:, None] * G + gs[None, :], start[None, :] + before - lower, mask=m)
        earlier += tl.sum(tile, axis=0)


@triton.jit
def _align_scatter_kernel(slot_group_ptr, base_ptr, sorted_ptr, block_group_ptr, n, G, CHUNK: tl.constexpr,
                          BLOCK_M: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    group = tl.load(slot_group_ptr + offs, mask=offs < n, other=-1)
    _scatter_chunk(group, chunk, base_ptr, sorted_ptr, block_group_ptr, G, CHUNK, BLOCK_M)


@triton.jit
def _align_single_kernel(ids_ptr, map_ptr, slot_group_ptr, base_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                         group_count_ptr, total_blocks_ptr, n, G, E_GLOBAL, E_LOCAL, HAS_MAP: tl.constexpr,
                         HAS_SHARED: tl.constexpr, CHUNK: tl.constexpr, G_PAD: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """All three steps in one program when one chunk holds every slot (decode)."""
    offs = tl.arange(0, CHUNK)
    in_range = offs < n
    group = _slot_groups(ids_ptr, map_ptr, offs, in_range, E_GLOBAL, E_LOCAL, HAS_MAP, HAS_SHARED)
    tl.store(slot_group_ptr + offs, group, mask=in_range)
    gs = tl.arange(0, G_PAD)
    g_ok = gs < G
    totals = tl.histogram(tl.maximum(group, 0), G_PAD, mask=group >= 0)
    n_blocks = (totals + BLOCK_M - 1) // BLOCK_M
    start = (tl.cumsum(n_blocks, 0) - n_blocks) * BLOCK_M
    tl.store(group_start_ptr + gs, start, mask=g_ok)
    tl.store(group_count_ptr + gs, totals, mask=g_ok)
    tl.store(total_blocks_ptr, tl.sum(n_blocks, 0))
    tl.store(base_ptr + gs, start - (tl.cumsum(totals, 0) - totals), mask=g_ok)
    tl.debug_barrier()  # the bases go through global memory: the scatter reads them at data-dependent groups
    _scatter_chunk(group, 0, base_ptr, sorted_ptr, block_group_ptr, G, CHUNK, BLOCK_M)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def max_blocks_for(n: int, n_groups: int, block_m: int) -> int:
    """Upper bound on sum_g ceil(count_g / block_m) over any routing of n slots: the launch size."""
    return max(1, min(n, triton.cdiv(n, block_m) + n_groups))


def align(ids: torch.Tensor, *, n_local: int, block_m: int, expert_map: torch.Tensor | None = None,
          shared: bool = False) -> Alignment:
    """Group the slots of ``ids`` ``[M, slots]`` (global ids; E_global = shared id) by local expert."""
    dev = ids.device
    n = ids.numel()
    e_global = expert_map.shape[0] if expert_map is not None else n_local
    G = n_local + int(shared)
    g_pad = _pow2(G)
    max_blocks = max_blocks_for(n, G, block_m)
    i32 = dict(dtype=torch.int32, device=dev)
    sorted_slots = torch.empty(max_blocks * block_m, **i32)
    block_group = torch.empty(max_blocks, **i32)
    meta = torch.empty(2 * G + 1, **i32)
    group_start, group_count, total_blocks = meta[:G], meta[G:2 * G], meta[2 * G:]
    slot_group = torch.empty(max(n, 1), **i32)
    map_arg = expert_map if expert_map is not None else ids
    common = dict(HAS_MAP=expert_map is not None, HAS_SHARED=bool(shared))
    if n <= SINGLE_CHUNK_MAX:
        chunk = _pow2(n)
        base = torch.empty(G, **i32)
        _align_single_kernel[(1,)](
            ids, map_arg, slot_group, base, sorted_slots, block_group, group_start, group_count, total_blocks,
            n, G, e_global, n_local, CHUNK=chunk, G_PAD=g_pad, BLOCK_M=block_m, num_warps=4, **common)
    else:
        chunk = min(8192, max(SINGLE_CHUNK_MAX, triton.next_power_of_2(triton.cdiv(n, MAX_CHUNKS))))
        n_chunks = triton.cdiv(n, chunk)
        counts = torch.empty(n_chunks, G, **i32)
        base = torch.empty(n_chunks, G, **i32)
        _align_count_kernel[(n_chunks,)](ids, map_arg, slot_group, counts, n, G, e_global, n_local, CHUNK=chunk,
                                         G_PAD=g_pad, num_warps=8, **common)
        _align_scan_kernel[(1,)](counts, base, group_start, group_count, total_blocks, n_chunks, G,
                                 BLOCK_M=block_m, G_PAD=g_pad, TILE_C=max(1, SCAN_TILE // g_pad), num_warps=8)
        _align_scatter_kernel[(n_chunks,)](slot_group, base, sorted_slots, block_group, n, G, CHUNK=chunk,
                                           BLOCK_M=block_m, num_warps=8)
    return Alignment(sorted_slots, block_group, group_start, group_count, total_blocks, slot_group, block_m,
                     max_blocks, G)
