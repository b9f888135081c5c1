"""Router: logits GEMM (fp32 out, split-K partials) and fused softmax -> top-k -> renormalise.

Top-k selects on the fp32 logits (softmax is monotone, so this is the order of the
probabilities without their rounding), ties to the lowest expert id: the picks are the largest
keys ``(order-preserving int32 of the logit) << 32 | (E_PAD - 1 - id)``, by one bitonic top-k
(``tl.topk``) for a one-row tile (one token; every route tile of up to 64 tokens), by TOP_K max reductions in
turn for tiles of several rows: the same picks either way (measured on the H200: the bitonic form
0.9-1.5 µs less per one-token block, 5-9 µs more on 16-row tiles; tuning/notes_moe.md). Weights are
``exp(l - max)`` of the picks over their sum (renormalise) or over the sum of all experts.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher
from kernels_triton._util import aligned16, cdiv, pow2
from kernels_triton.moe import pdl as _pdl

ROUTE_TILE = 4096  # elements of the [rows, E_PAD] logits tile one route program holds


@triton.jit
def _router_dots(x_ptr, w_ptr, gate_ptr, rows, cols, M, H, E, k_first, K_PER_SPLIT, WITH_GATE: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """(x[rows] . W[cols] ``[BLOCK_M, BLOCK_N]``, x[rows] . gate ``[BLOCK_M]``) over H[k_first : + K_PER_SPLIT].

    WITH_GATE adds a second, [BLOCK_K, 16] dot on the x tile already loaded: the gate vector in
    column 0, zeros elsewhere (16 is the narrowest tensor-core tile); without, the gate sums are 0.
    """
    row_ok, col_ok = rows < M, cols < E
    ks = k_first + tl.arange(0, BLOCK_K)
    gate_col = tl.arange(0, 16)
    acc = tl.zeros((rows.shape[0], cols.shape[0]), dtype=tl.float32)
    gate_acc = tl.zeros((rows.shape[0], 16), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        kk = ks + k0
        k_ok = kk < H
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * H + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols[None, :] * H + kk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if WITH_GATE:
            g = tl.load(gate_ptr + kk[:, None] + 0 * gate_col[None, :], mask=k_ok[:, None] & (gate_col == 0)[None, :],
                        other=0.0)
            if IEEE:
                gate_acc = tl.dot(a, g, gate_acc, input_precision="ieee")
            else:
                gate_acc = tl.dot(a, g, gate_acc)
    return acc, tl.sum(gate_acc, axis=1)  # columns 1.. of gate_acc are zeros


@triton.jit
def router_tile(x_ptr, w_ptr, gate_ptr, out_ptr, gate_out_ptr, pid_n, pid_m, pid_s, M, H, E, K_PER_SPLIT,
                 HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    """Store out[s, m, n] = x[m] . W[n] and gate_out[s, m] = x[m] . gate over split ``pid_s``'s slice of H for the
    ``(pid_m, pid_n)`` tile.

    The column-tile-0 programs also compute the gate logits, from the x tiles they load anyway (a
    branch outside the K loop: each variant of the loop stays branch-free for the pipeliner).
    """
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_first = pid_s * K_PER_SPLIT
    if HAS_GATE and pid_n == 0:
        acc, gate = _router_dots(x_ptr, w_ptr, gate_ptr, rows, cols, M, H, E, k_first, K_PER_SPLIT, True, BLOCK_K,
                                 IEEE)
        tl.store(gate_out_ptr + pid_s * M + rows, gate, mask=rows < M)
    else:
        acc, _ = _router_dots(x_ptr, w_ptr, gate_ptr, rows, cols, M, H, E, k_first, K_PER_SPLIT, False, BLOCK_K,
                              IEEE)
    out = out_ptr + pid_s * M * E + rows[:, None] * E + cols[None, :]
    tl.store(out, acc, mask=(rows < M)[:, None] & (cols < E)[None, :])


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, gate_out_ptr, M, H, E, K_PER_SPLIT,
                          HAS_GATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """The router's split-K partials, one :func:`router_tile` per program.

    Column tiles are the fastest grid axis: the programs sharing a tile of x run together and read
    it from L2 (x-major order re-read x from DRAM once per column tile: 4x at E = 512).
    """
    _pdl.enter(PDL)
    router_tile(x_ptr, w_ptr, gate_ptr, out_ptr, gate_out_ptr, tl.program_id(0), tl.program_id(1),
                 tl.program_id(2), M, H, E, K_PER_SPLIT, HAS_GATE, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)


@triton.jit
def top_k_rows(logits, cols, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """logits [R, E_PAD] fp32 (columns >= E ignored) -> (weights [R, K_PAD] fp32, ids [R, K_PAD] int32)."""
    E_PAD: tl.constexpr = logits.shape[1]
    real = cols[None, :] < E
    logits = tl.where(logits == 0.0, 0.0, logits)  # -0.0 -> +0.0: equal logits must tie
    bits = logits.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 order == float order
    packed = (order.to(tl.int64) << 32) | ((E_PAD - 1) - cols[None, :].to(tl.int64))
    packed = tl.where(real, packed, -(1 << 63))
    slot = tl.arange(0, K_PAD)[None, :]
    if logits.shape[0] == 1:
        # the K_PAD largest keys, largest first, in one bitonic top-k (every key is distinct: the id is in it)
        best = tl.topk(packed, K_PAD)
        ids = (E_PAD - 1) - (best & 0xFFFFFFFF).to(tl.int32)
        key = (best >> 32).to(tl.int32)
        value = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        top = tl.max(tl.where(slot == 0, value, float("-inf")), axis=1)  # the largest real logit
        picked = tl.where(slot < TOP_K, tl.exp(value - top[:, None]), 0.0)
    else:
        top = tl.max(tl.where(real, logits, float("-inf")), axis=1)
        ids = tl.zeros((logits.shape[0], K_PAD), dtype=tl.int32)
        picked = tl.zeros((logits.shape[0], K_PAD), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(packed, axis=1)
            idx = (E_PAD - 1) - (best & 0xFFFFFFFF).to(tl.int32)
            key = (best >> 32).to(tl.int32)
            value = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            ids = tl.where(slot == j, idx[:, None], ids)
            picked = tl.where(slot == j, tl.exp(value - top)[:, None], picked)
            packed = tl.where(cols[None, :] == idx[:, None], -(1 << 63), packed)
    if RENORMALIZE:
        denom = tl.sum(picked, axis=1)
    else:
        denom = tl.sum(tl.where(real, tl.exp(logits - top[:, None]), 0.0), axis=1)
    return picked / denom[:, None], ids


@triton.jit
def summed_logits(logits_ptr, rows, M, E, N_SPLITS: tl.constexpr, E_PAD: tl.constexpr):
    """The logits ``[rows, E_PAD]`` fp32 of ``rows``: the split-K partials ``[N_SPLITS, M, E]`` summed in split order
    (N_SPLITS constexpr: the partial loads are unrolled and all in flight at once). The loads skip L1 (``.cg``):
    the partials may come from other programs of the same launch (:mod:`kernels_triton.moe.decode`), which L1 does
    not see."""
    cols = tl.arange(0, E_PAD)
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :]
    mask = (rows < M)[:, None] & (cols < E)[None, :]
    logits = tl.zeros((rows.shape[0], E_PAD), dtype=tl.float32)
    for s in tl.static_range(N_SPLITS):
        logits += tl.load(ptrs + s * M * E, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return logits


@triton.jit
def shared_weight(gate_ptr, rows, M, N_SPLITS: tl.constexpr, HAS_GATE: tl.constexpr):
    """The shared expert's weight for ``rows``: sigmoid of the gate logit (its split partials ``[N_SPLITS, M]``
    summed in order), 1 without a gate."""
    gate = tl.zeros((rows.shape[0],), dtype=tl.float32)
    if HAS_GATE:
        for s in tl.static_range(N_SPLITS):
            gate += tl.load(gate_ptr + s * M + rows, mask=rows < M, other=0.0, cache_modifier=".cg")
        return tl.sigmoid(gate)
    return gate + 1.0


@triton.jit
def route_tile(logits_ptr, gate_ptr, weights_ptr, ids_ptr, rows, M, E, SHARED_ID, N_SPLITS: tl.constexpr,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                HAS_GATE: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Route the rows ``rows``: sum the split-K partials in order, pick top-k, store; append the shared slot.

    logits ``[N_SPLITS, M, E]``, gate logits ``[N_SPLITS, M]``; outputs ``[M, TOP_K + HAS_SHARED]``. The
    shared slot's id is SHARED_ID and its weight sigmoid(gate logit) (1 without a gate). N_SPLITS is a
    constexpr so the partial loads are unrolled and all in flight at once (a runtime loop waited on each).
    """
    n_out = TOP_K + HAS_SHARED
    cols = tl.arange(0, E_PAD)
    row_ok = rows < M
    weights, ids = top_k_rows(summed_logits(logits_ptr, rows, M, E, N_SPLITS, E_PAD), cols, E, TOP_K, K_PAD,
                               RENORMALIZE)
    slot = tl.arange(0, K_PAD)
    out = rows[:, None] * n_out + slot[None, :]
    out_mask = row_ok[:, None] & (slot < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)
    if HAS_SHARED:
        w_shared = shared_weight(gate_ptr, rows, M, N_SPLITS, HAS_GATE)
        tl.store(weights_ptr + rows * n_out + TOP_K, w_shared, mask=row_ok)
        tl.store(ids_ptr + rows * n_out + TOP_K, tl.zeros((rows.shape[0],), dtype=tl.int32) + SHARED_ID, mask=row_ok)


@triton.jit
def _route_kernel(logits_ptr, gate_ptr, weights_ptr, ids_ptr, M, E, SHARED_ID, N_SPLITS: tl.constexpr,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
                  RENORMALIZE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SHARED: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    route_tile(logits_ptr, gate_ptr, weights_ptr, ids_ptr, rows, M, E, SHARED_ID, N_SPLITS, TOP_K, K_PAD, E_PAD,
                RENORMALIZE, HAS_GATE, HAS_SHARED)


# launched through DirectLauncher: no per-call argument binding once compiled (see kernels_triton/_launch.py)
_launch_router_logits = DirectLauncher(_router_logits_kernel)
_launch_route = DirectLauncher(_route_kernel)


@functools.lru_cache(maxsize=1024)
def route_launch_params(M: int, E: int, top_k: int) -> dict:
    """Constexprs of a route tile: rows per tile sized so that [rows, E_PAD] stays within ROUTE_TILE elements.

    Fewer rows per tile until there are ~64 tiles, so small batches still route in parallel, and up to twice the
    elements (with 8 warps, :func:`route_warps`) at large M, where each program routes a chunk of several tiles in
    turn.
    """
    e_pad = pow2(E, 16)
    rows = max(1, min(32, 2 * ROUTE_TILE // e_pad, pow2(cdiv(M, 64))))
    return dict(TOP_K=top_k, K_PAD=pow2(top_k, 2), E_PAD=e_pad, ROWS=rows)


def route_warps(params: dict) -> int:
    """Small tiles: fewer warps, cheaper reductions; 8 warps beyond ROUTE_TILE elements."""
    elements = params["ROWS"] * params["E_PAD"]
    return 8 if elements > ROUTE_TILE else max(1, min(4, elements // 512))


def gate_logits(logits: torch.Tensor, n_splits: int) -> torch.Tensor:
    """The gate partials ``[n_splits, M]`` that :func:`router_logits` stores after ``logits`` (same allocation)."""
    M = logits.shape[-2]
    return torch.as_strided(logits, (n_splits, M), (M, 1), logits.storage_offset() + aligned16(logits.numel()))


def route(logits: torch.Tensor, top_k: int, renormalize: bool, *, n_splits: int = 1, n_experts: int | None = None,
          gate: bool = False, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits`` ``[n_splits, M, E]`` (or ``[M, E]``); see :func:`route_tile`.

    ``gate``: ``logits`` comes from :func:`router_logits` with a gate weight (the gate partials follow it).
    """
    M = logits.shape[-2]
    E = n_experts if n_experts is not None else logits.shape[-1]
    slots = top_k + int(shared)
    weights = torch.empty(M, slots, dtype=torch.float32, device=logits.device)
    ids = torch.empty(M, slots, dtype=torch.int32, device=logits.device)
    if M == 0:
        return weights, ids
    p = route_launch_params(M, E, top_k)
    _launch_route[(cdiv(M, p["ROWS"]),)](
        logits, gate_logits(logits, n_splits) if gate else logits, weights, ids, M, E, E, N_SPLITS=n_splits,
        RENORMALIZE=bool(renormalize), HAS_GATE=bool(gate), HAS_SHARED=bool(shared), num_warps=route_warps(p), **p)
    return weights, ids


@functools.lru_cache(maxsize=1024)
def router_launch(M: int, H: int, E: int) -> tuple[tuple[int, int, int], int, dict]:
    """(grid, K per split, constexprs + launch options) of the router GEMM for M tokens and E experts.

    Small M is a GEMV over the router weight: split H so that ~128 programs stream it (every split
    is one more partial the routing sums, so no more than that); ~256 for 512 experts at up to 16 tokens (a 4 MB
    router weight at 397B-A17B TP4 / TP8; measured: 1.0-1.2 µs less per block on the H200, while 256 experts gain
    nothing from more; tuning/notes_moe.md). Large M uses tensor-core tiles, split only while the tiles alone
    leave SMs idle.
    """
    if M <= 64:
        block_m, block_n, block_k, warps, stages = 16, 16 if M <= 16 else 32, 128, 4, 3
        target = 256 if M <= 16 and E >= 512 else 128
    elif M <= 4096:
        block_m, block_n, block_k, warps, stages, target = 64, 64, 64, 4, 4, 128
    else:
        block_m, block_n, block_k, warps, stages, target = 128, 128, 64, 8, 3, 132
    tiles = cdiv(M, block_m) * cdiv(E, block_n)
    n_splits = 1
    while tiles * n_splits < target and H // (n_splits * 2) >= block_k and n_splits < 16:
        n_splits *= 2
    k_per_split = cdiv(cdiv(H, n_splits), block_k) * block_k
    n_splits = cdiv(H, k_per_split)
    grid = (cdiv(E, block_n), cdiv(M, block_m), n_splits)
    return grid, k_per_split, dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                   num_stages=stages)


def router_partials(M: int, E: int, n_splits: int, gate: bool,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits ``[n_splits, M, E]``, gate partials ``[n_splits, M]`` -- the logits again without ``gate``): the
    router GEMM's outputs in one fp32 allocation (see :func:`router_logits`)."""
    n_logits = n_splits * M * E
    buffer = torch.empty(aligned16(n_logits) + (n_splits * M if gate else 0), dtype=torch.float32, device=device)
    out = buffer[:n_logits].view(n_splits, M, E)
    return out, gate_logits(out, n_splits) if gate else out


def router_logits(x: torch.Tensor, router_weight: torch.Tensor,
                  gate_weight: torch.Tensor | None, pdl: bool = False,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """fp32 split-K partials of the router logits ``[n_splits, M, E]``; returns (partials, n_splits).

    With ``gate_weight`` the same allocation continues with the gate logits' partials ``[n_splits, M]``
    (16-byte aligned; :func:`gate_logits` views them): the logits rows keep a stride of E (16-byte
    aligned when E % 4 == 0, so their loads vectorise) and the GEMM tiles only E columns. ``out``: (partials,
    gate partials) to write instead, laid out as :func:`router_partials` does (``n_splits`` from
    :func:`router_launch`).
    """
    M, H = x.shape
    E = router_weight.shape[0]
    grid, k_per_split, launch = router_launch(M, H, E)
    n_splits = grid[2]
    if out is None:
        out, gate_out = router_partials(M, E, n_splits, gate_weight is not None, x.device)
    else:
        out, gate_out = out
        if out.shape != (n_splits, M, E) or out.dtype != torch.float32:
            raise ValueError(f"router_logits: out must be fp32 [{n_splits}, {M}, {E}] (n_splits from router_launch), "
                             f"got {out.dtype} {list(out.shape)}")
    _launch_router_logits[grid](
        x, router_weight, gate_weight if gate_weight is not None else router_weight, out, gate_out, M, H, E,
        k_per_split, HAS_GATE=gate_weight is not None, IEEE=x.dtype == torch.float32, PDL=pdl, **launch,
        **_pdl.options(pdl))
    return out, n_splits
