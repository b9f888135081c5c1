"""Token alignment: group token-slots by expert into blocks of BLOCK_M rows, on the device, no host sync.

A *slot* is one (token, pick) pair, numbered ``token * SLOTS + j`` with SLOTS = TOP_K (+ 1 for the
shared expert). Each routed slot (``j < TOP_K``) belongs to a *group*: its local expert (through
``expert_map``; -1 = held elsewhere, dropped). The shared-expert slot that
:func:`kernels_triton.moe.routing.route` appends (``j = TOP_K``) belongs to group ``E_local``. The
result lists the slots of group 0, then group 1, ..., each group padded to a multiple of BLOCK_M, in
slot order within a group (a stable counting sort: the layout itself is deterministic).

Block ``b`` belongs to group ``block_group[b]``; blocks ``>= total_blocks`` are unused; row ``r``
of group ``g`` is a real slot when ``0 <= r - group_start[g] < group_count[g]`` (a group without slots has
count 0 and a start of no meaning: 0 from one program, the next group's from the chunked path).

Only the routed slots are counted and sorted (TOP_K per token: power-of-two sorts; the chunked path's
histograms have pow2(E_local) bins). The shared group needs neither: every token has exactly one shared slot, so
it is the last group, count M, its row ``t`` holding slot ``t * SLOTS + TOP_K``; the programs that
own a token write its row there once the routed groups' total is known.

Two ways to get there:

- up to SINGLE_CHUNK_MAX routed slots (decode), one program: a sort of the (group, slot) keys, each
  group's count and each key's row in its group from the runs of equal groups, the groups' starts from
  a scan of their block counts in key order (:func:`_align_single`). For
  ``moe_block`` (up to ALIGN_LAST_MAX_SLOTS) that program is the last of the routing programs to finish
  (:func:`route_and_align`): one launch routes and aligns.
- beyond, two launches over chunks of whole tokens (each a few route tiles, at most
  CHUNK_SLOTS_MAX routed slots, at most ~MAX_CHUNKS chunks): count (for ``moe_block`` it routes the
  chunk's tokens first, then stores the chunk's histogram), and scatter: each program sums every
  chunk's histogram itself (group totals -> padded starts, earlier chunks -> its offset in each
  group), then sorts its chunk's keys like the single program. The redundant sums cost
  ``n_chunks^2 * E_local`` L2 reads in all (~67 MB at 256 chunks x 256 groups) but save the launches
  of a separate scan, and on a host with slow launches a launch costs more than that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton._arrival import arrival_counter, last_to_arrive
from kernels_triton._kept import kept_views
from kernels_triton._launch import DirectLauncher
from kernels_triton._util import aligned16, aligned_parts, cdiv, pow2
from kernels_triton.moe import pdl as _pdl
from kernels_triton.moe.routing import gate_logits, route_launch_params, route_tile, route_warps

SINGLE_CHUNK_MAX = 1024  # routed slots handled by one fused program
ALIGN_LAST_MAX_SLOTS = 256  # up to this many routed slots moe_block routes spread over programs and the last of them
# aligns alone (:func:`_route_align_kernel`); beyond, the two chunked launches
MAX_CHUNKS = 256  # the multi-chunk path grows its chunks beyond this many
CHUNK_SLOTS_MAX = 1024  # ... but keeps each chunk's routed slots within one sort of this size
SCAN_TILE = 16384  # elements of the [chunks, groups] tiles each scatter program sums
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
def _routed_slot(q, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    """Slot number of routed slot ``q`` (token ``q // TOP_K``, pick ``q % TOP_K``) in rows of SLOTS slots."""
    slot = q
    if SLOTS != TOP_K:
        slot = (q // TOP_K) * SLOTS + q % TOP_K
    return slot


@triton.jit
def _slot_groups(ids_ptr, map_ptr, slots, in_range, E_GLOBAL, HAS_MAP: tl.constexpr):
    """Group of each routed slot: its local expert id, -1 if dropped (held elsewhere or out of range)."""
    ids = tl.load(ids_ptr + slots, mask=in_range, other=-1, cache_modifier=".cg").to(tl.int32)  # maybe stored by
    # other programs of this launch (:func:`_route_align_kernel`): past L1
    routed = in_range & (ids >= 0) & (ids < E_GLOBAL)
    if HAS_MAP:
        group = tl.load(map_ptr + ids, mask=routed, other=-1).to(tl.int32)
    else:
        group = tl.where(routed, ids, -1)
    return group


@triton.jit
def _run_count(g1, c1, g2, c2):
    """Scan operator over sorted keys: slots counted within each run of equal groups (associative on runs)."""
    return g2, c2 + tl.where(g1 == g2, c1, 0)


@triton.jit
def _store_shared_size(group_start_ptr, group_count_ptr, total_blocks_ptr, routed_blocks, M, E_LOCAL,
                       HAS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr):
    """The shared group's start and count (last: count M, after every routed block) and total_blocks."""
    blocks = routed_blocks
    if HAS_SHARED:
        tl.store(group_start_ptr + E_LOCAL, blocks * BLOCK_M)
        tl.store(group_count_ptr + E_LOCAL, M)
        blocks += (M + BLOCK_M - 1) // BLOCK_M
    tl.store(total_blocks_ptr, blocks)


@triton.jit
def _store_group_sizes(group_start_ptr, group_count_ptr, total_blocks_ptr, start, totals, n_blocks, M, E_LOCAL,
                       HAS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr):
    """group_start / group_count of the routed groups ([G_PAD] vectors), the shared group's (last: count M,
    after every routed block), and total_blocks."""
    gs = tl.arange(0, start.shape[0])
    tl.store(group_start_ptr + gs, start, mask=gs < E_LOCAL)
    tl.store(group_count_ptr + gs, totals, mask=gs < E_LOCAL)
    _store_shared_size(group_start_ptr, group_count_ptr, total_blocks_ptr, tl.sum(n_blocks, 0), M, E_LOCAL,
                       HAS_SHARED, BLOCK_M)


@triton.jit
def _place_shared(slot_group_ptr, sorted_ptr, block_group_ptr, tokens, token_ok, shared_start, E_LOCAL,
                  TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The shared group's rows for ``tokens``: row shared_start + t holds slot t * SLOTS + TOP_K (group E_LOCAL)."""
    slot = tokens * SLOTS + TOP_K
    pos = shared_start + tokens
    group = tl.zeros_like(tokens) + E_LOCAL
    tl.store(slot_group_ptr + slot, group, mask=token_ok)
    tl.store(sorted_ptr + pos, slot, mask=token_ok)
    tl.store(block_group_ptr + pos // BLOCK_M, group, mask=token_ok)  # every row of a block writes the same value


@triton.jit
def _align_single(ids_ptr, map_ptr, slot_group_ptr, sorted_ptr, block_group_ptr, group_start_ptr, group_count_ptr,
                  total_blocks_ptr, M, E_GLOBAL, E_LOCAL, TOP_K: tl.constexpr, HAS_MAP: tl.constexpr,
                  HAS_SHARED: tl.constexpr, N_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Align the slots of all M tokens (M * TOP_K <= N_PAD routed ones, M <= N_PAD) in this one program.

    Sorted, the (group, slot) keys of each group form a contiguous run: a key's place in its run counted from the
    front and from the back gives the run's length (the group's count) and the slot's row in the group, and the
    runs' block counts summed in key order give each group's start. Nothing is sized by the groups but two stores
    of zeros (a group without slots: start and count 0): no histogram or scan over all groups (measured on the
    H200, the route + align launch: 4.82 µs at 512 groups and 2 tokens against 5.80 with a histogram and two scans;
    tuning/notes_moe.md)."""
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    q = tl.arange(0, N_PAD)
    in_range = q < M * TOP_K
    slot = _routed_slot(q, TOP_K, SLOTS)
    group = _slot_groups(ids_ptr, map_ptr, slot, in_range, E_GLOBAL, HAS_MAP)
    tl.store(slot_group_ptr + slot, group, mask=in_range)
    keys = tl.sort(tl.where(group >= 0, group * N_PAD + q, _NO_KEY))
    real = keys != _NO_KEY
    g = keys // N_PAD
    ones = tl.full((N_PAD,), 1, tl.int32)
    _, ahead = tl.associative_scan((g, ones), 0, _run_count)  # 1 for a run's first key
    _, behind = tl.associative_scan((g, ones), 0, _run_count, reverse=True)  # 1 for its last
    count = ahead + behind - 1
    blocks = (count + BLOCK_M - 1) // BLOCK_M
    first = real & (ahead == 1)
    lead_blocks = tl.where(first, blocks, 0)  # each group's blocks, on its first key
    through = tl.cumsum(lead_blocks, 0)  # blocks of the groups up to and including the key's
    start = (through - blocks) * BLOCK_M
    pos = start + ahead - 1
    tl.store(sorted_ptr + pos, _routed_slot(keys % N_PAD, TOP_K, SLOTS), mask=real)
    tl.store(block_group_ptr + pos // BLOCK_M, g, mask=real)  # every row of a block writes the same value
    gs = tl.arange(0, G_PAD)
    tl.store(group_start_ptr + gs, tl.zeros_like(gs), mask=gs < E_LOCAL)
    tl.store(group_count_ptr + gs, tl.zeros_like(gs), mask=gs < E_LOCAL)
    tl.debug_barrier()  # the zeros first: each group with slots overwrites its own (stores of other threads)
    tl.store(group_start_ptr + g, start, mask=first)
    tl.store(group_count_ptr + g, count, mask=first)
    routed_blocks = tl.sum(lead_blocks, 0)
    _store_shared_size(group_start_ptr, group_count_ptr, total_blocks_ptr, routed_blocks, M, E_LOCAL, HAS_SHARED,
                       BLOCK_M)
    if HAS_SHARED:
        _place_shared(slot_group_ptr, sorted_ptr, block_group_ptr, q, q < M, routed_blocks * BLOCK_M,
                      E_LOCAL, TOP_K, SLOTS, BLOCK_M)


@triton.jit
def _align_single_kernel(ids_ptr, map_ptr, slot_group_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                         group_count_ptr, total_blocks_ptr, M, E_GLOBAL, E_LOCAL, TOP_K: tl.constexpr,
                         HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr, N_PAD: tl.constexpr, G_PAD: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    _align_single(ids_ptr, map_ptr, slot_group_ptr, sorted_ptr, block_group_ptr, group_start_ptr, group_count_ptr,
                  total_blocks_ptr, M, E_GLOBAL, E_LOCAL, TOP_K, HAS_MAP, HAS_SHARED, N_PAD, G_PAD, BLOCK_M)


@triton.jit
def _route_align_kernel(logits_ptr, gate_ptr, weights_ptr, ids_ptr, map_ptr, slot_group_ptr, sorted_ptr,
                        block_group_ptr, group_start_ptr, group_count_ptr, total_blocks_ptr, count_ptr, M, E_GLOBAL,
                        E_LOCAL, N_SPLITS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                        E_PAD: tl.constexpr, ROWS: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_GATE: tl.constexpr,
                        HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr, N_PAD: tl.constexpr,
                        G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
    """Decode-sized batches: each program routes ROWS tokens, and the last to finish (:mod:`kernels_triton._arrival`)
    aligns every slot alone (one launch instead of route + count and scatter)."""
    _pdl.enter(PDL)
    route_tile(logits_ptr, gate_ptr, weights_ptr, ids_ptr, tl.program_id(0) * ROWS + tl.arange(0, ROWS), M,
                E_GLOBAL, E_GLOBAL, N_SPLITS, TOP_K, K_PAD, E_PAD, RENORMALIZE, HAS_GATE, HAS_SHARED)
    if last_to_arrive(count_ptr, tl.num_programs(0)):
        _align_single(ids_ptr, map_ptr, slot_group_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                      group_count_ptr, total_blocks_ptr, M, E_GLOBAL, E_LOCAL, TOP_K, HAS_MAP, HAS_SHARED, N_PAD,
                      G_PAD, BLOCK_M)


@triton.jit
def _count_kernel(logits_ptr, gate_ptr, weights_ptr, ids_ptr, map_ptr, slot_group_ptr, counts_ptr, M, E_GLOBAL,
                  E_LOCAL, ROUTE: tl.constexpr, N_SPLITS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, RENORMALIZE: tl.constexpr,
                  HAS_GATE: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr,
                  CHUNK_PAD: tl.constexpr, G_PAD: tl.constexpr):
    """One chunk of ROWS * TILES tokens: (route them,) group their routed slots, store the chunk's histogram.

    With ROUTE the ids come from the logits (as :func:`route_tile`); without, ``ids_ptr`` holds
    them (``[M, TOP_K + HAS_SHARED]``). The histogram table is ``[chunks, E_LOCAL]``.
    """
    chunk = tl.program_id(0)
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    first = chunk * (ROWS * TILES)
    if ROUTE:
        for t in range(TILES):
            route_tile(logits_ptr, gate_ptr, weights_ptr, ids_ptr, first + t * ROWS + tl.arange(0, ROWS), M,
                        E_GLOBAL, E_GLOBAL, N_SPLITS, TOP_K, K_PAD, E_PAD, RENORMALIZE, HAS_GATE, HAS_SHARED)
        tl.debug_barrier()  # the ids just stored are read back by other threads of this program
    q = tl.arange(0, CHUNK_PAD)
    in_range = (q < ROWS * TILES * TOP_K) & (first * TOP_K + q < M * TOP_K)
    slot = first * SLOTS + _routed_slot(q, TOP_K, SLOTS)
    group = _slot_groups(ids_ptr, map_ptr, slot, in_range, E_GLOBAL, HAS_MAP)
    tl.store(slot_group_ptr + slot, group, mask=in_range)
    gs = tl.arange(0, G_PAD)
    hist = tl.histogram(tl.maximum(group, 0), G_PAD, mask=group >= 0)
    tl.store(counts_ptr + chunk * E_LOCAL + gs, hist, mask=gs < E_LOCAL)


@triton.jit
def _scatter_kernel(slot_group_ptr, counts_ptr, base_ptr, sorted_ptr, block_group_ptr, group_start_ptr,
                    group_count_ptr, total_blocks_ptr, M, n_chunks, E_LOCAL, CHUNK_TOKENS, TOP_K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_PAD: tl.constexpr, G_PAD: tl.constexpr,
                    TILE_C: tl.constexpr):
    """Place one chunk's slots: its own scan of the chunk histograms, a sort of the chunk's routed keys, then
    its tokens' rows of the shared group.

    Every program sums the histograms of all chunks (group totals -> padded starts) and of the
    chunks before it (its offset inside each group); no separate scan launch. Slot at sorted
    position q of group g goes to start_g + before_g + q - lower_g (lower_g: the chunk's slots of
    lower groups).
    """
    chunk = tl.program_id(0)
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    gs = tl.arange(0, G_PAD)
    g_ok = gs < E_LOCAL
    totals = tl.zeros((G_PAD,), dtype=tl.int32)
    before = tl.zeros((G_PAD,), dtype=tl.int32)
    for c0 in range(0, n_chunks, TILE_C):
        cs = c0 + tl.arange(0, TILE_C)
        tile = tl.load(counts_ptr + cs[:, None] * E_LOCAL + gs[None, :],
                       mask=(cs < n_chunks)[:, None] & g_ok[None, :], other=0)
        totals += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((cs < chunk)[:, None], tile, 0), axis=0)
    n_blocks = (totals + BLOCK_M - 1) // BLOCK_M
    start = (tl.cumsum(n_blocks, 0) - n_blocks) * BLOCK_M
    if chunk == 0:
        _store_group_sizes(group_start_ptr, group_count_ptr, total_blocks_ptr, start, totals, n_blocks, M, E_LOCAL,
                           HAS_SHARED, BLOCK_M)
    own = tl.load(counts_ptr + chunk * E_LOCAL + gs, mask=g_ok, other=0)
    tl.store(base_ptr + chunk * E_LOCAL + gs, start + before - (tl.cumsum(own, 0) - own), mask=g_ok)
    tl.debug_barrier()  # base is read back per key by other threads
    first = chunk * CHUNK_TOKENS
    q = tl.arange(0, CHUNK_PAD)
    in_range = (q < CHUNK_TOKENS * TOP_K) & (first * TOP_K + q < M * TOP_K)
    group = tl.load(slot_group_ptr + first * SLOTS + _routed_slot(q, TOP_K, SLOTS), mask=in_range, other=-1)
    keys = tl.sort(tl.where(group >= 0, group * CHUNK_PAD + q, _NO_KEY))
    real = keys != _NO_KEY
    g = keys // CHUNK_PAD
    pos = q + tl.load(base_ptr + chunk * E_LOCAL + g, mask=real, other=0)
    tl.store(sorted_ptr + pos, first * SLOTS + _routed_slot(keys % CHUNK_PAD, TOP_K, SLOTS), mask=real)
    tl.store(block_group_ptr + pos // BLOCK_M, g, mask=real)  # every row of a block writes the same value
    if HAS_SHARED:
        _place_shared(slot_group_ptr, sorted_ptr, block_group_ptr, first + q, (q < CHUNK_TOKENS) & (first + q < M),
                      tl.sum(n_blocks, 0) * BLOCK_M, E_LOCAL, TOP_K, SLOTS, BLOCK_M)


# launched through DirectLauncher: no per-call argument binding once compiled (see kernels_triton/_launch.py)
_launch_align_single = DirectLauncher(_align_single_kernel)
_launch_route_align = DirectLauncher(_route_align_kernel)
_launch_count = DirectLauncher(_count_kernel)
_launch_scatter = DirectLauncher(_scatter_kernel)


def max_blocks_for(n: int, n_groups: int, block_m: int) -> int:
    """Upper bound on sum_g ceil(count_g / block_m) over any routing of n slots: the launch size."""
    return max(1, min(n, cdiv(n, block_m) + n_groups))


def _alignment_sizes(n: int, G: int, block_m: int) -> tuple[int, ...]:
    """Elements of the Alignment's int32 tensors, in field order."""
    max_blocks = max_blocks_for(n, G, block_m)
    return max_blocks * block_m, max_blocks, G, G, 1, max(n, 1)


def _alignment_in(ints: torch.Tensor, offset: int, n: int, G: int, block_m: int) -> Alignment:
    """The Alignment of n slots over G groups as views of ``ints`` from ``offset`` (each part 16-byte aligned)."""
    sizes = _alignment_sizes(n, G, block_m)
    starts = aligned_parts(sizes)[1]
    return Alignment(*(ints[offset + s:offset + s + k] for s, k in zip(starts, sizes, strict=True)),
                     block_m=block_m, max_blocks=sizes[1], n_groups=G)


def _outputs(n: int, G: int, block_m: int, dev) -> Alignment:  # noqa: ANN001
    ints = torch.empty(aligned_parts(_alignment_sizes(n, G, block_m))[0], dtype=torch.int32, device=dev)
    return _alignment_in(ints, 0, n, G, block_m)


@functools.lru_cache(maxsize=1024)
def chunking(M: int, top_k: int, rows: int, max_chunks: int, chunk_slots_max: int) -> tuple[int, int]:
    """(route tiles of ``rows`` tokens per chunk, chunks) for the multi-chunk path.

    Chunks grow with M so that there are at most ~max_chunks of them (each scatter program reads
    every chunk's histogram), and keep within chunk_slots_max routed slots (one program sorts a chunk).
    """
    tiles = 1
    while cdiv(M, rows * tiles) > max_chunks and rows * tiles * 2 * top_k <= chunk_slots_max:
        tiles *= 2
    return tiles, cdiv(M, rows * tiles)


def _chunk_rows(top_k: int, route: dict | None) -> int:
    """Tokens per chunk tile: the route tile's rows when the count launch routes, else up to 16."""
    return route["ROWS"] if route is not None else max(1, min(16, CHUNK_SLOTS_MAX // max(top_k, 1)))


def _align_chunks(al: Alignment, M: int, top_k: int, shared: bool, *, route: dict | None,
                  logits: torch.Tensor | None, gate: torch.Tensor | None, weights: torch.Tensor | None,
                  ids: torch.Tensor, expert_map: torch.Tensor | None, e_global: int, n_local: int,
                  counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Two launches over chunks of tokens: (route +) count, then scatter with its own scan. ``counts``: the two
    ``[n_chunks * n_local]`` int32 tables they pass on (allocated here when not given)."""
    rows = _chunk_rows(top_k, route)
    tiles, n_chunks = chunking(M, top_k, rows, MAX_CHUNKS, CHUNK_SLOTS_MAX)
    chunk_tokens = rows * tiles
    chunk_pad, g_pad = pow2(chunk_tokens * top_k, 16), pow2(n_local, 16)
    if counts is None:
        both = torch.empty(2, aligned16(n_chunks * n_local), dtype=torch.int32, device=ids.device)
        counts = both[0], both[1]
    routed = route is not None
    if not routed:
        route = dict(N_SPLITS=1, TOP_K=top_k, K_PAD=pow2(top_k, 2), E_PAD=16, ROWS=rows, RENORMALIZE=False,
                     HAS_GATE=False, HAS_SHARED=shared)
        logits = weights = ids
    _launch_count[(n_chunks,)](
        logits, gate if gate is not None else logits, weights, ids, expert_map if expert_map is not None else ids,
        al.slot_group, counts[0], M, e_global, n_local, ROUTE=routed, TILES=tiles, HAS_MAP=expert_map is not None,
        CHUNK_PAD=chunk_pad, G_PAD=g_pad, num_warps=max(4, route_warps(route)) if routed else 4, **route)
    _launch_scatter[(n_chunks,)](
        al.slot_group, counts[0], counts[1], al.sorted_slots, al.block_group, al.group_start, al.group_count,
        al.total_blocks, M, n_chunks, n_local, chunk_tokens, TOP_K=top_k, HAS_SHARED=shared, BLOCK_M=al.block_m,
        CHUNK_PAD=chunk_pad, G_PAD=g_pad, TILE_C=max(1, SCAN_TILE // g_pad),
        num_warps=8 if chunk_pad * g_pad > (1 << 16) else 4)


def align(ids: torch.Tensor, *, n_local: int, block_m: int, expert_map: torch.Tensor | None = None,
          shared: bool = False) -> Alignment:
    """Group the slots of ``ids`` ``[M, slots]`` (global expert ids) by local expert.

    ``shared``: the last column is the shared expert's slot (its id is not read; group ``n_local``).
    """
    dev = ids.device
    M, slots = ids.shape
    top_k = slots - int(shared)
    e_global = expert_map.shape[0] if expert_map is not None else n_local
    al = _outputs(M * slots, n_local + int(shared), block_m, dev)
    if M * top_k <= SINGLE_CHUNK_MAX:
        _launch_align_single[(1,)](
            ids, expert_map if expert_map is not None else ids, al.slot_group, al.sorted_slots, al.block_group,
            al.group_start, al.group_count, al.total_blocks, M, e_global, n_local, TOP_K=top_k,
            HAS_MAP=expert_map is not None, HAS_SHARED=bool(shared), N_PAD=pow2(M * top_k, 16), G_PAD=pow2(n_local, 16),
            BLOCK_M=block_m, num_warps=4)
        return al
    _align_chunks(al, M, top_k, bool(shared), route=None, logits=None, gate=None, weights=None, ids=ids,
                  expert_map=expert_map, e_global=e_global, n_local=n_local)
    return al


@dataclass
class RouteScratch:
    """The per-call tensors of :func:`route_and_align` and the router GEMM before it (all fp32 / int32).

    :func:`route_scratch` lays them out in one buffer that ``moe_block`` keeps between calls (per thread, device and
    stream: :mod:`kernels_triton._kept`), so a call neither allocates nor views them again; each holds its values
    until the next call on the same stream."""

    logits: torch.Tensor  # [n_splits, M, E] router partials (routing.router_logits(out=...))
    gate_part: torch.Tensor  # [n_splits, M] gate partials, 16-byte aligned after ``logits``; ``logits`` without gate
    weights: torch.Tensor  # [M, slots] fp32
    ids: torch.Tensor  # [M, slots] int32
    al: Alignment
    counts: tuple[torch.Tensor, torch.Tensor] | None  # the chunked path's two [n_chunks * n_local] tables


KEEP_MAX_BYTES = 32 << 20  # route_scratch keeps layouts up to this size (the router partials of 16384 tokens x 512
# experts, 32 MB, are not kept: a call of that size is GPU-bound by ~2 ms anyway)


@functools.lru_cache(maxsize=1024)
def _scratch_layout(M: int, E: int, n_splits: int, top_k: int, gate: bool, shared: bool, n_local: int, block_m: int,
                    limits: tuple[int, int, int]) -> tuple[int, tuple[int, ...]]:
    """(int32 elements in all, start of each part) of :class:`RouteScratch`: logits, gate partials, weights, ids,
    the alignment, then (chunked path) the chunk tables. Every part starts 16-byte aligned. ``limits``: the
    module's (ALIGN_LAST_MAX_SLOTS, MAX_CHUNKS, CHUNK_SLOTS_MAX) the layout is for (tests change them)."""
    align_last_max, max_chunks, chunk_slots_max = limits
    slots = top_k + int(shared)
    n = M * slots
    parts = [n_splits * M * E, n_splits * M if gate else 0, n, n,
             aligned_parts(_alignment_sizes(n, n_local + int(shared), block_m))[0]]
    if M * top_k > align_last_max:
        route = route_launch_params(M, E, top_k)
        _, n_chunks = chunking(M, top_k, _chunk_rows(top_k, route), max_chunks, chunk_slots_max)
        parts += [n_chunks * n_local, n_chunks * n_local]
    return aligned_parts(parts)


def route_scratch(M: int, E: int, n_splits: int, top_k: int, *, gate: bool, shared: bool, n_local: int,
                  block_m: int, device: torch.device, keep: bool = True) -> RouteScratch:
    """The :class:`RouteScratch` of one ``moe_block`` call (router of E experts in ``n_splits`` partials, M tokens,
    top_k picks (+ the shared expert), n_local local experts, BLOCK_M-row blocks). ``keep``: from this thread's
    kept buffer for the device and stream (views made once per layout) where :func:`kernels_triton._kept.kept`
    allows and the layout is at most KEEP_MAX_BYTES; else a new allocation."""
    layout = (M, E, n_splits, top_k, gate, shared, n_local, block_m, (ALIGN_LAST_MAX_SLOTS, MAX_CHUNKS,
                                                                       CHUNK_SLOTS_MAX))
    total, starts = _scratch_layout(*layout)

    def build(ints: torch.Tensor) -> RouteScratch:
        floats = ints.view(torch.float32)
        slots = top_k + int(shared)
        n = M * slots
        logits = floats[starts[0]:starts[0] + n_splits * M * E].view(n_splits, M, E)
        gate_part = floats[starts[1]:starts[1] + n_splits * M].view(n_splits, M) if gate else logits
        weights = floats[starts[2]:starts[2] + n].view(M, slots)
        ids = ints[starts[3]:starts[3] + n].view(M, slots)
        al = _alignment_in(ints, starts[4], n, n_local + int(shared), block_m)
        if len(starts) == 5:
            return RouteScratch(logits, gate_part, weights, ids, al, None)
        c = starts[6] - starts[5]  # n_chunks * n_local, rounded up to the 16-byte alignment
        counts = ints[starts[5]:starts[6]], ints[starts[6]:starts[6] + c]
        return RouteScratch(logits, gate_part, weights, ids, al, counts)

    return kept_views("moe_route", total, torch.int32, device, layout, build, keep and total * 4 <= KEEP_MAX_BYTES)


def route_and_align(logits: torch.Tensor, n_splits: int, top_k: int, renormalize: bool, *, n_experts: int,
                    n_local: int, block_m: int, expert_map: torch.Tensor | None, gate: bool,
                    shared: bool, pdl: bool = False,
                    scratch: RouteScratch | None = None) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """Routing of ``logits`` (see :func:`kernels_triton.moe.routing.route`) and the alignment of its picks.

    ``logits``: from :func:`kernels_triton.moe.routing.router_logits` (with ``gate``, the gate partials
    follow it). Decode-sized batches do both in one launch (routing spread over programs, the last of them
    aligns); larger ones in two launches (route + count, scatter). ``pdl``: the one-launch form with programmatic
    dependent launch (:mod:`kernels_triton.moe.pdl`). ``scratch``: where the results go (:func:`route_scratch` for
    the same sizes, whose ``logits`` these are); new tensors when not given.
    """
    M = logits.shape[-2]
    slots = top_k + int(shared)
    dev = logits.device
    if scratch is None:
        weights = torch.empty(M, slots, dtype=torch.float32, device=dev)
        ids = torch.empty(M, slots, dtype=torch.int32, device=dev)
        al = _outputs(M * slots, n_local + int(shared), block_m, dev)
        gate_part = gate_logits(logits, n_splits) if gate else logits
        counts = None
    else:
        weights, ids, al, gate_part = scratch.weights, scratch.ids, scratch.al, scratch.gate_part
        counts = scratch.counts
    align_last = M * top_k <= ALIGN_LAST_MAX_SLOTS
    route = dict(route_launch_params(M, n_experts, top_k), N_SPLITS=n_splits, RENORMALIZE=bool(renormalize),
                 HAS_GATE=bool(gate), HAS_SHARED=bool(shared))
    if not align_last:
        _align_chunks(al, M, top_k, bool(shared), route=route, logits=logits, gate=gate_part, weights=weights,
                      ids=ids, expert_map=expert_map, e_global=n_experts, n_local=n_local, counts=counts)
        return weights, ids, al
    _launch_route_align[(cdiv(M, route["ROWS"]),)](
        logits, gate_part, weights, ids, expert_map if expert_map is not None else ids, al.slot_group, al.sorted_slots,
        al.block_group, al.group_start, al.group_count, al.total_blocks, arrival_counter(dev), M,
        n_experts, n_local, HAS_MAP=expert_map is not None, N_PAD=pow2(M * top_k, 16), G_PAD=pow2(n_local, 16),
        BLOCK_M=block_m, num_warps=max(4, route_warps(route)), PDL=pdl, **route, **_pdl.options(pdl))
    return weights, ids, al
