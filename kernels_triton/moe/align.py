"""Token alignment: group token-slots by expert into blocks of BLOCK_M rows, on the device, no host sync.

A *slot* is one (token, pick) pair, numbered ``token * slots + j``. Each slot belongs to a *group*:
its local expert (through ``expert_map``; -1 = held elsewhere, dropped), or, for the shared-expert
slot that :func:`kernels_triton.moe.routing.route` appends, group ``E_local``. The result lists the
slots of group 0, then group 1, ..., each group padded to a multiple of BLOCK_M, in slot order
within a group (a stable counting sort: the layout itself is deterministic).

Block ``b`` belongs to group ``block_group[b]``; blocks ``>= total_blocks`` are unused; row ``r``
of group ``g`` is a real slot when ``r - group_start[g] < group_count[g]``.

Two ways to get there:

- up to SINGLE_CHUNK_MAX slots (decode), one program: histogram, padded starts, a sort of the
  (group, slot) keys, each key placed at its group's base plus its sorted position. For
  ``moe_block`` the same program first routes the tokens (:func:`route_and_align`).
- beyond, four launches over chunks of CHUNK slots: count (per-chunk histograms), a scan down
  each group's column (slots of that group in earlier chunks), a scan over groups (padded
  starts), and scatter, where a slot's rank among its chunk's slots of the same group comes from
  comparing the chunk with itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton.moe.routing import _route_tile, route, route_launch_params

SINGLE_CHUNK_MAX = 1024  # slots handled by one fused program
FUSED_ROUTE_MAX_M = 16  # tokens whose routing runs in the same program as their alignment
CHUNK = 128  # slots per program in the multi-launch path (the scatter holds a [CHUNK, CHUNK] compare)
SCAN_GROUPS = 32  # group columns per scan program
SCAN_TILE = 8192  # elements of the [chunks, groups] tiles the scans hold
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
def _align_single(ids_ptr, map_ptr, slot_group_ptr, base_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                  group_count_ptr, total_blocks_ptr, n, G, E_GLOBAL, E_LOCAL, HAS_MAP: tl.constexpr,
                  HAS_SHARED: tl.constexpr, N_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Align all n <= N_PAD slots in this one program."""
    p = tl.arange(0, N_PAD)
    in_range = p < n
    group = _slot_groups(ids_ptr, map_ptr, p, in_range, E_GLOBAL, E_LOCAL, HAS_MAP, HAS_SHARED)
    tl.store(slot_group_ptr + p, group, mask=in_range)
    gs = tl.arange(0, G_PAD)
    g_ok = gs < G
    totals = tl.histogram(tl.maximum(group, 0), G_PAD, mask=group >= 0)
    n_blocks = (totals + BLOCK_M - 1) // BLOCK_M
    start = (tl.cumsum(n_blocks, 0) - n_blocks) * BLOCK_M
    tl.store(group_start_ptr + gs, start, mask=g_ok)
    tl.store(group_count_ptr + gs, totals, mask=g_ok)
    tl.store(total_blocks_ptr, tl.sum(n_blocks, 0))
    # sorted, the keys of group g occupy positions [lower_g, lower_g + count_g): slot at position q goes to
    # start_g + q - lower_g. base_g = start_g - lower_g goes through global memory so it can be read per key.
    tl.store(base_ptr + gs, start - (tl.cumsum(totals, 0) - totals), mask=g_ok)
    tl.debug_barrier()
    keys = tl.sort(tl.where(group >= 0, group * N_PAD + p, _NO_KEY))
    real = keys != _NO_KEY
    g = keys // N_PAD
    pos = p + tl.load(base_ptr + g, mask=real, other=0)
    tl.store(sorted_ptr + pos, keys % N_PAD, mask=real)
    tl.store(block_group_ptr + pos // BLOCK_M, g, mask=real)  # every row of a block writes the same value


@triton.jit
def _align_single_kernel(ids_ptr, map_ptr, slot_group_ptr, base_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                         group_count_ptr, total_blocks_ptr, n, G, E_GLOBAL, E_LOCAL, HAS_MAP: tl.constexpr,
                         HAS_SHARED: tl.constexpr, N_PAD: tl.constexpr, G_PAD: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    _align_single(ids_ptr, map_ptr, slot_group_ptr, base_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                  group_count_ptr, total_blocks_ptr, n, G, E_GLOBAL, E_LOCAL, HAS_MAP, HAS_SHARED, N_PAD, G_PAD,
                  BLOCK_M)


@triton.jit
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, map_ptr, slot_group_ptr, base_ptr, sorted_ptr,
                        block_group_ptr, group_start_ptr, group_count_ptr, total_blocks_ptr, M, n_splits, G,
                        E_GLOBAL, E_LOCAL, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        ROWS: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_GATE: tl.constexpr,
                        HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr, N_PAD: tl.constexpr,
                        G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Decode: route the M tokens, then align their slots, in one program (one launch fewer)."""
    for r0 in range(0, M, ROWS):
        _route_tile(logits_ptr, weights_ptr, ids_ptr, r0 + tl.arange(0, ROWS), M, E_GLOBAL, n_splits, E_GLOBAL,
                    TOP_K, K_PAD, E_PAD, RENORMALIZE, HAS_GATE, HAS_SHARED)
    tl.debug_barrier()  # the ids just stored are read back by other threads of this program
    _align_single(ids_ptr, map_ptr, slot_group_ptr, base_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                  group_count_ptr, total_blocks_ptr, M * (TOP_K + HAS_SHARED), G, E_GLOBAL, E_LOCAL, HAS_MAP,
                  HAS_SHARED, N_PAD, G_PAD, BLOCK_M)


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
def _align_scan_chunks_kernel(counts_ptr, before_ptr, group_count_ptr, n_chunks, G, BLOCK_G: tl.constexpr,
                              TILE_C: tl.constexpr):
    """Down each group's column: slots of that group in earlier chunks (exclusive prefix), and its total."""
    gs = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = gs < G
    earlier = tl.zeros((BLOCK_G,), dtype=tl.int32)
    for c0 in range(0, n_chunks, TILE_C):
        cs = c0 + tl.arange(0, TILE_C)
        m = (cs < n_chunks)[:, None] & g_ok[None, :]
        tile = tl.load(counts_ptr + cs[:, None] * G + gs[None, :], mask=m, other=0)
        tl.store(before_ptr + cs[:, None] * G + gs[None, :], tl.cumsum(tile, 0) - tile + earlier[None, :], mask=m)
        earlier += tl.sum(tile, axis=0)
    tl.store(group_count_ptr + gs, earlier, mask=g_ok)


@triton.jit
def _align_scan_groups_kernel(group_count_ptr, group_start_ptr, total_blocks_ptr, G, BLOCK_M: tl.constexpr,
                              G_PAD: tl.constexpr):
    gs = tl.arange(0, G_PAD)
    totals = tl.load(group_count_ptr + gs, mask=gs < G, other=0)
    n_blocks = (totals + BLOCK_M - 1) // BLOCK_M
    tl.store(group_start_ptr + gs, (tl.cumsum(n_blocks, 0) - n_blocks) * BLOCK_M, mask=gs < G)
    tl.store(total_blocks_ptr, tl.sum(n_blocks, 0))


@triton.jit
def _align_scatter_kernel(slot_group_ptr, before_ptr, group_start_ptr, sorted_ptr, block_group_ptr, n, G,
                          CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    chunk = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + i
    group = tl.load(slot_group_ptr + offs, mask=offs < n, other=-1)
    same_earlier = (group[:, None] == group[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(same_earlier.to(tl.int32), axis=1)  # earlier slots of this chunk in the same group
    real = group >= 0
    g = tl.maximum(group, 0)
    pos = tl.load(group_start_ptr + g, mask=real, other=0) + tl.load(before_ptr + chunk * G + g, mask=real,
                                                                      other=0) + rank
    tl.store(sorted_ptr + pos, offs, mask=real)
    tl.store(block_group_ptr + pos // BLOCK_M, g, mask=real)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def max_blocks_for(n: int, n_groups: int, block_m: int) -> int:
    """Upper bound on sum_g ceil(count_g / block_m) over any routing of n slots: the launch size."""
    return max(1, min(n, triton.cdiv(n, block_m) + n_groups))


def _outputs(n: int, G: int, block_m: int, dev) -> Alignment:  # noqa: ANN001
    max_blocks = max_blocks_for(n, G, block_m)
    ints = torch.empty(max_blocks * (block_m + 1) + 2 * G + 1 + max(n, 1), dtype=torch.int32, device=dev)
    parts = torch.split(ints, [max_blocks * block_m, max_blocks, G, G, 1, max(n, 1)])
    return Alignment(*parts, block_m=block_m, max_blocks=max_blocks, n_groups=G)


def align(ids: torch.Tensor, *, n_local: int, block_m: int, expert_map: torch.Tensor | None = None,
          shared: bool = False) -> Alignment:
    """Group the slots of ``ids`` ``[M, slots]`` (global ids; E_global = shared id) by local expert."""
    dev = ids.device
    n = ids.numel()
    e_global = expert_map.shape[0] if expert_map is not None else n_local
    G = n_local + int(shared)
    al = _outputs(n, G, block_m, dev)
    map_arg = expert_map if expert_map is not None else ids
    common = dict(HAS_MAP=expert_map is not None, HAS_SHARED=bool(shared))
    if n <= SINGLE_CHUNK_MAX:
        base = torch.empty(G, dtype=torch.int32, device=dev)
        _align_single_kernel[(1,)](
            ids, map_arg, al.slot_group, base, al.sorted_slots, al.block_group, al.group_start, al.group_count,
            al.total_blocks, n, G, e_global, n_local, N_PAD=_pow2(n), G_PAD=_pow2(G), BLOCK_M=block_m, num_warps=4,
            **common)
        return al
    n_chunks = triton.cdiv(n, CHUNK)
    counts = torch.empty(2, n_chunks, G, dtype=torch.int32, device=dev)
    _align_count_kernel[(n_chunks,)](ids, map_arg, al.slot_group, counts[0], n, G, e_global, n_local, CHUNK=CHUNK,
                                     G_PAD=_pow2(G), num_warps=4, **common)
    _align_scan_chunks_kernel[(triton.cdiv(G, SCAN_GROUPS),)](
        counts[0], counts[1], al.group_count, n_chunks, G, BLOCK_G=SCAN_GROUPS, TILE_C=SCAN_TILE // SCAN_GROUPS,
        num_warps=4)
    _align_scan_groups_kernel[(1,)](al.group_count, al.group_start, al.total_blocks, G, BLOCK_M=block_m,
                                    G_PAD=_pow2(G), num_warps=4)
    _align_scatter_kernel[(n_chunks,)](al.slot_group, counts[1], al.group_start, al.sorted_slots, al.block_group, n,
                                       G, CHUNK=CHUNK, BLOCK_M=block_m, num_warps=8)
    return al


def route_and_align(logits: torch.Tensor, n_splits: int, top_k: int, renormalize: bool, *, n_experts: int,
                    n_local: int, block_m: int, expert_map: torch.Tensor | None, gate: bool,
                    shared: bool) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """Routing of ``logits`` (see :func:`kernels_triton.moe.routing.route`) and the alignment of its picks.

    Decode-sized batches do both in one launch.
    """
    M = logits.shape[-2]
    slots = top_k + int(shared)
    n = M * slots
    if M > FUSED_ROUTE_MAX_M or n > SINGLE_CHUNK_MAX:
        weights, ids = route(logits, top_k, renormalize, n_splits=n_splits, n_experts=n_experts, gate=gate,
                             shared=shared)
        return weights, ids, align(ids, n_local=n_local, block_m=block_m, expert_map=expert_map, shared=shared)
    dev = logits.device
    G = n_local + int(shared)
    weights = torch.empty(M, slots, dtype=torch.float32, device=dev)
    ids = torch.empty(M, slots, dtype=torch.int32, device=dev)
    al = _outputs(n, G, block_m, dev)
    base = torch.empty(G, dtype=torch.int32, device=dev)
    _route_align_kernel[(1,)](
        logits, weights, ids, expert_map if expert_map is not None else ids, al.slot_group, base, al.sorted_slots,
        al.block_group, al.group_start, al.group_count, al.total_blocks, M, n_splits, G, n_experts, n_local,
        RENORMALIZE=bool(renormalize), HAS_GATE=bool(gate), HAS_MAP=expert_map is not None, HAS_SHARED=bool(shared),
        N_PAD=_pow2(n), G_PAD=_pow2(G), BLOCK_M=block_m, num_warps=4, **route_launch_params(M, n_experts, top_k))
    return weights, ids, al
