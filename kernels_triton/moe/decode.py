"""The MoE block for one token (batch-1 decode): router GEMV + route -> gate_up GEMV -> down GEMV + combine.

At one token the block is a weight stream (35B-A3B: 8 experts + the shared one, 57 MB, ~14 µs at the H200's copy
rate). The general pipeline runs it as five launches: router, route + align (one program: a histogram, scans
and a sort over every expert, for nine slots), gate_up and down as 16-row tensor-core tiles holding one real row,
and a combine. Here three:

- **router + route**: the router's split-K GEMV tiles (as the general router), and the last of its programs to
  finish (:mod:`kernels_triton._arrival`) routes the token: softmax -> top-k -> renormalise from the partials
  (:func:`kernels_triton.moe.routing.top_k_rows`: the same picks and weights as routing, ties to the lowest id),
  each pick's local expert through the expert map (-1: held elsewhere), the shared expert as the last slot with
  weight ``sigmoid(gate logit)``. No alignment: each slot is its own group (top-k ids are distinct).
- **gate_up** (grid ``slots x column tiles``): ``h_j = silu(x Wg_j^T) * (x Wu_j^T)`` for ``UP_N`` columns per
  program as a GEMV (fp32 products summed along H, one reduction at the end), ``h`` in the activation dtype.
- **down** (grid ``column tiles of H``): each program loads every slot's W2 tile at once and sums
  ``weight_j * (h_j W2_j^T)`` over the slots in fp32 (the combine, fused; a fixed-order tree) and stores its columns
  of the output. Where :func:`decode_config` says so (35B-A3B's shape), each program loads its W2 tile (all of I)
  before waiting for the gate_up launch (PDL; the gate_up programs let it start at once): the slots' experts are
  known from the router launch, so the down weights stream beside the gate_up's and only ``h`` is read after the
  wait.

Deterministic (fixed orders; the one atomic only elects the program that routes). The output differs from the
general pipeline's in the last bits (the GEMV's summation order; no rounding of each slot's row to the activation
dtype before the sum). Programmatic dependent launch on every launch only when ``QWEN35_MOE_PDL=1`` asks for it
(measured: these launches 1-7 µs slower with it on the H200, tuning/notes_moe.md); the early down launch above is
the exception.
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
from kernels_triton._util import aligned_parts, cdiv, pow2
from kernels_triton.moe import pdl as _pdl
from kernels_triton.moe.experts import expert_weights
from kernels_triton.moe.routing import (
    router_launch,
    router_tile,
    shared_weight,
    summed_logits,
    top_k_rows,
)
from qwen35 import knobs as qwen35_knobs

ENV = "QWEN35_MOE_DECODE"  # "0": one token takes the general pipeline too (a way around this path)


def enabled() -> bool:
    """Whether one token takes this path (``QWEN35_MOE_DECODE`` unset or ``1``; ``0`` turns it off)."""
    return qwen35_knobs.on(ENV) is not False


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the two expert launches: gate_up ``UP_N`` columns (of gate and of up) x ``UP_K``-wide steps
    over H, down ``DOWN_N`` output columns x ``DOWN_K``-wide steps over I; warps of each.

    ``DOWN_EARLY``: each down program loads its whole ``[slots, DOWN_N, I]`` W2 tile in one step (``DOWN_K``
    unused) and, with PDL (sm_90+ unless ``QWEN35_MOE_PDL=0``), before waiting for the gate_up launch, whose programs
    let it start at once: the down weights stream beside the gate_up's."""

    UP_N: int
    UP_K: int
    UP_WARPS: int
    DOWN_N: int
    DOWN_K: int
    DOWN_WARPS: int
    DOWN_EARLY: bool = False


EARLY_TILE_MAX = 32768  # elements of one early down program's W2 tile (35B-A3B with the shared expert: 16 x 4 x 512)


@functools.lru_cache(maxsize=256)
def decode_config(H: int, I: int, slots: int | None = None) -> DecodeConfig:
    """The launch shape for hidden size H, expert width I and ``slots`` (routed + shared, when known).

    gate_up: one column (one gate row and one up row) per program in 512-wide steps with 2 warps -- thousands of
    small programs, so every SM streams about the same number of rows (measured on the H200: 4 columns per program
    30.3 against 28.4 µs at 35B-A3B). down: 8 columns per program in 64-wide steps over every slot at once, 8 warps.
    Narrower where H or I is. Up to H = 2048 and I = 512 (35B-A3B), down loads its weights before the PDL wait
    (``DOWN_EARLY``, 4 columns per program; measured: 23 against 25.1 µs at 35B-A3B, a wash or slower at the other
    shapes; tuning/notes_moe.md), but not where one program's tile would pass ``EARLY_TILE_MAX`` elements (more
    picks than were measured; the loop over I keeps registers bounded)."""
    early = H <= 2048 and I <= 512 and (slots is None or pow2(slots) * min(4, pow2(H)) * pow2(I, 16) <= EARLY_TILE_MAX)
    return DecodeConfig(UP_N=1, UP_K=min(512, pow2(H, 16)), UP_WARPS=2, DOWN_N=min(4 if early else 8, pow2(H)),
                        DOWN_K=min(64, pow2(I, 16)), DOWN_WARPS=8, DOWN_EARLY=early)


@triton.jit
def _route_one_token(logits_ptr, gate_ptr, map_ptr, group_ptr, weight_ptr, E_GLOBAL, E_LOCAL,
                     N_SPLITS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                     RENORMALIZE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_MAP: tl.constexpr,
                     HAS_SHARED: tl.constexpr):
    """Every slot's (group, weight) for the gate_up and down launches, from the router's split-K partials."""
    row = tl.arange(0, 1)
    weights, ids = top_k_rows(summed_logits(logits_ptr, row, 1, E_GLOBAL, N_SPLITS, E_PAD), tl.arange(0, E_PAD),
                               E_GLOBAL, TOP_K, K_PAD, RENORMALIZE)
    slot = tl.arange(0, K_PAD)[None, :]
    routed = slot < TOP_K
    if HAS_MAP:
        groups = tl.load(map_ptr + ids, mask=routed, other=-1)
    else:
        groups = ids
    tl.store(group_ptr + slot, groups, mask=routed)
    tl.store(weight_ptr + slot, weights, mask=routed)
    if HAS_SHARED:
        tl.store(group_ptr + TOP_K + row, E_LOCAL + 0 * row)
        tl.store(weight_ptr + TOP_K + row, shared_weight(gate_ptr, row, 1, N_SPLITS, HAS_GATE))


@triton.jit
def _decode_router_kernel(x_ptr, w_ptr, gate_w_ptr, logits_ptr, gate_ptr, count_ptr, map_ptr, group_ptr, weight_ptr,
                          H, E_GLOBAL, E_LOCAL, K_PER_SPLIT, N_SPLITS: tl.constexpr, TOP_K: tl.constexpr,
                          K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                          HAS_GATE: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Router GEMV tile ``(program_id(0), program_id(2))`` (the general router's split-K partials); the last
    program to finish routes the token (:func:`_route_one_token`)."""
    _pdl.enter(PDL)
    router_tile(x_ptr, w_ptr, gate_w_ptr, logits_ptr, gate_ptr, tl.program_id(0), 0, tl.program_id(2), 1, H,
                 E_GLOBAL, K_PER_SPLIT, HAS_GATE, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    if last_to_arrive(count_ptr, tl.num_programs(0) * tl.num_programs(2)):
        _route_one_token(logits_ptr, gate_ptr, map_ptr, group_ptr, weight_ptr, E_GLOBAL, E_LOCAL, N_SPLITS, TOP_K,
                         K_PAD, E_PAD, RENORMALIZE, HAS_GATE, HAS_MAP, HAS_SHARED)


@triton.jit
def _decode_gate_up_kernel(x_ptr, w_ptr, shared_w_ptr, h_ptr, group_ptr, H, I, E_LOCAL,
                           HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           TRIGGER: tl.constexpr = False, PDL: tl.constexpr = False):
    """Slot ``program_id(0)``'s ``h`` columns ``program_id(1) * BLOCK_N ..`` (group from the router launch): a GEMV
    over H. ``TRIGGER``: let the down launch start now (its PDL wait still waits for this whole launch)."""
    _pdl.enter(PDL)
    _pdl.let_next_start(TRIGGER)
    j = tl.program_id(0)
    tile = tl.program_id(1)
    group = tl.load(group_ptr + j)
    if group < 0:
        return
    w = expert_weights(w_ptr, shared_w_ptr, group, 2 * I * H, E_LOCAL, HAS_SHARED)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w + cols[:, None] * H + ks[None, :]
    u_ptrs = g_ptrs + I * H
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks + k0 < H
        xk = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = col_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
        acc_u += tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32) * xk
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    g = tl.sum(acc_g, axis=1)
    act = g / (1.0 + tl.exp(-g)) * tl.sum(acc_u, axis=1)
    tl.store(h_ptr + j * I + cols, act.to(h_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _slot_weights(w_ptr, shared_w_ptr, group_ptr, H, I, E_LOCAL, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr,
                  HAS_SHARED: tl.constexpr, CACHE: tl.constexpr):
    """(slot ids ``[SLOTS_PAD]``, whether each is kept, the base of each slot's W2 ``[H, I]``) from the router
    launch's groups (dropped and padding slots: not kept). ``CACHE``: the groups' load cache modifier."""
    slot = tl.arange(0, SLOTS_PAD)
    group = tl.load(group_ptr + slot, mask=slot < SLOTS, other=-1, cache_modifier=CACHE)
    kept = group >= 0
    base = w_ptr + tl.maximum(group, 0).to(tl.int64) * H * I
    if HAS_SHARED:
        base = tl.where(group == E_LOCAL, shared_w_ptr + 0 * group, base)
    return slot, kept, base


@triton.jit
def _store_weighted_sum(acc, weight_ptr, out_ptr, slot, kept, cols, H, CACHE: tl.constexpr):
    """Store ``sum_j weight_j * acc[j]`` over the kept slots (a fixed-order fp32 tree) to ``out[cols]``."""
    weight = tl.load(weight_ptr + slot, mask=kept, other=0.0, cache_modifier=CACHE)
    total = tl.sum(tl.where(kept[:, None], acc * weight[:, None], 0.0), axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _decode_down_kernel(h_ptr, w_ptr, shared_w_ptr, group_ptr, weight_ptr, out_ptr, H, I, E_LOCAL,
                        SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Output columns ``program_id(0) * BLOCK_N ..``: the sum over slots of ``weight_j * h_j W2[e_j]^T``. Every slot's
    tile comes in one load per K step (``[SLOTS_PAD, BLOCK_N, BLOCK_K]``: many bytes in flight per program; measured:
    a loop over the slots 1.0-3.2 µs slower on the H200), the slots' weighted sum is a fixed-order tree in fp32."""
    _pdl.enter(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot, kept, base = _slot_weights(w_ptr, shared_w_ptr, group_ptr, H, I, E_LOCAL, SLOTS, SLOTS_PAD, HAS_SHARED, "")
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < H
    acc = tl.zeros((SLOTS_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = ks + k0 < I
        hk = tl.load(h_ptr + slot[:, None] * I + (k0 + ks)[None, :], mask=kept[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(base[:, None, None] + cols[None, :, None] * I + (k0 + ks)[None, None, :],
                     mask=kept[:, None, None] & col_ok[None, :, None] & k_ok[None, None, :], other=0.0)
        acc += tl.sum(wt.to(tl.float32) * hk.to(tl.float32)[:, None, :], axis=2)
    _store_weighted_sum(acc, weight_ptr, out_ptr, slot, kept, cols, H, "")


@triton.jit
def _decode_down_early_kernel(h_ptr, w_ptr, shared_w_ptr, group_ptr, weight_ptr, out_ptr, H, I, E_LOCAL,
                              SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, HAS_SHARED: tl.constexpr,
                              BLOCK_N: tl.constexpr, I_PAD: tl.constexpr, PDL: tl.constexpr = False):
    """As :func:`_decode_down_kernel` in one step over all of I, the W2 tile loaded before the PDL wait: the groups
    come from the router launch, two launches back and complete once any program of this launch runs (each gate_up
    program lets this launch start only after its own wait, or without PDL after the router launch ended)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot, kept, base = _slot_weights(w_ptr, shared_w_ptr, group_ptr, H, I, E_LOCAL, SLOTS, SLOTS_PAD, HAS_SHARED,
                                     ".cg")
    ks = tl.arange(0, I_PAD)
    k_ok = ks < I
    wt = tl.load(base[:, None, None] + cols[None, :, None] * I + ks[None, None, :],
                 mask=kept[:, None, None] & (cols < H)[None, :, None] & k_ok[None, None, :], other=0.0)
    _pdl.enter(PDL)
    hk = tl.load(h_ptr + slot[:, None] * I + ks[None, :], mask=kept[:, None] & k_ok[None, :], other=0.0,
                 cache_modifier=".cg")
    acc = tl.sum(wt.to(tl.float32) * hk.to(tl.float32)[:, None, :], axis=2)
    _store_weighted_sum(acc, weight_ptr, out_ptr, slot, kept, cols, H, ".cg")


# launched through DirectLauncher: no per-call argument binding once compiled (see kernels_triton/_launch.py)
_launch_router = DirectLauncher(_decode_router_kernel)
_launch_gate_up = DirectLauncher(_decode_gate_up_kernel)
_launch_down = DirectLauncher(_decode_down_kernel)
_launch_down_early = DirectLauncher(_decode_down_early_kernel)


@functools.lru_cache(maxsize=256)
def _one_token_layout(E: int, n_splits: int, gate: bool, slots: int, h_numel: int,
                      h_bytes: int) -> tuple[int, tuple[int, ...]]:
    """(int32 elements in all, start of each part) of one token's scratch: router partials, gate partials, groups,
    weights, then ``h`` (``h_numel`` elements of ``h_bytes`` bytes); every part 16-byte aligned."""
    return aligned_parts([n_splits * E, n_splits if gate else 0, slots, slots, -(-h_numel * h_bytes // 4)])


def one_token_scratch(E: int, n_splits: int, gate: bool, slots: int, I: int, h_dtype: torch.dtype,
                      device: torch.device, keep: bool = True) -> tuple[torch.Tensor, ...]:
    """(router partials ``[n_splits, 1, E]`` fp32, gate partials ``[n_splits, 1]`` (the partials again without a
    gate), groups ``[slots]`` int32, weights ``[slots]`` fp32, h ``[slots, I]``) of one token's block: views of one
    buffer kept per thread, device and stream (:mod:`kernels_triton._kept`; made once per layout), or of a new one
    (``keep=False``, a graph capture, off CUDA). What this saves is host time (two allocations and six views a call;
    measured: ~25 µs on the H200's host): it matters to eager decode."""
    layout = (E, n_splits, gate, slots, slots * I, h_dtype.itemsize)
    total, starts = _one_token_layout(*layout)

    def build(ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        floats = ints.view(torch.float32)
        logits = floats[starts[0]:starts[0] + n_splits * E].view(n_splits, 1, E)
        gate_part = floats[starts[1]:starts[1] + n_splits].view(n_splits, 1) if gate else logits
        groups = ints[starts[2]:starts[2] + slots]
        weights = floats[starts[3]:starts[3] + slots]
        h = ints[starts[4]:].view(h_dtype)[:slots * I].view(slots, I)
        return logits, gate_part, groups, weights, h

    return kept_views("moe_one_token", total, torch.int32, device, (*layout, h_dtype), build, keep)


def route_one(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool, *, n_local: int,
              expert_map: torch.Tensor | None, gate_weight: torch.Tensor | None, shared: bool,
              pdl: bool = False, scratch: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups int32, weights fp32) ``[slots]`` of the token ``x`` ``[1, H]``: the router GEMV (the general
    router's tiles and split-K partials, :func:`kernels_triton.moe.routing.router_launch`) whose last program
    routes the token (:mod:`kernels_triton._arrival`). ``gate_weight``: the shared expert's gate (its partials ride
    the router's). ``scratch``: :func:`one_token_scratch` for these sizes (new tensors when not given)."""
    H, E = x.shape[1], router_weight.shape[0]
    grid, k_per_split, launch = router_launch(1, H, E)
    n_splits = grid[2]
    slots = top_k + int(shared)
    if scratch is None:
        scratch = one_token_scratch(E, n_splits, gate_weight is not None, slots, 0, x.dtype, x.device, keep=False)
    logits, gate_part, groups, weights = scratch[:4]
    _launch_router[grid](
        x, router_weight, gate_weight if gate_weight is not None else router_weight, logits, gate_part,
        arrival_counter(x.device), expert_map if expert_map is not None else groups, groups, weights, H, E, n_local,
        k_per_split, N_SPLITS=n_splits, TOP_K=top_k, K_PAD=pow2(top_k, 2), E_PAD=pow2(E, 16),
        RENORMALIZE=bool(renormalize), HAS_GATE=gate_weight is not None, HAS_MAP=expert_map is not None,
        HAS_SHARED=shared, IEEE=x.dtype == torch.float32, PDL=pdl, **launch, **_pdl.options(pdl))
    return groups, weights


def gate_up_one(x: torch.Tensor, w13: torch.Tensor, shared_w13: torch.Tensor | None, groups: torch.Tensor,
                cfg: DecodeConfig, pdl: bool = False, trigger: bool = False,
                h: torch.Tensor | None = None) -> torch.Tensor:
    """``h`` ``[slots, I]`` in x's dtype (dropped slots' rows unwritten; written into ``h`` when given).
    ``trigger``: each program lets the next launch (with PDL) start at once."""
    H, (E, I), slots = x.shape[1], (w13.shape[0], w13.shape[1] // 2), groups.shape[0]
    if h is None:
        h = torch.empty(slots, I, dtype=x.dtype, device=x.device)
    _launch_gate_up[(slots, cdiv(I, cfg.UP_N))](
        x, w13, shared_w13 if shared_w13 is not None else w13, h, groups, H, I, E,
        HAS_SHARED=shared_w13 is not None, BLOCK_N=cfg.UP_N, BLOCK_K=cfg.UP_K, TRIGGER=trigger and not pdl, PDL=pdl,
        num_warps=cfg.UP_WARPS, **_pdl.options(pdl))
    return h


def down_one(h: torch.Tensor, w2: torch.Tensor, shared_w2: torch.Tensor | None, groups: torch.Tensor,
             weights: torch.Tensor, cfg: DecodeConfig, pdl: bool = False) -> torch.Tensor:
    """``[1, H]`` in h's dtype: the slots' down projections weighted and summed (fixed order)."""
    (E, H, I), slots = w2.shape, groups.shape[0]
    out = torch.empty(1, H, dtype=h.dtype, device=h.device)
    if cfg.DOWN_EARLY:
        _launch_down_early[(cdiv(H, cfg.DOWN_N),)](
            h, w2, shared_w2 if shared_w2 is not None else w2, groups, weights, out, H, I, E, SLOTS=slots,
            SLOTS_PAD=pow2(slots), HAS_SHARED=shared_w2 is not None, BLOCK_N=cfg.DOWN_N, I_PAD=pow2(I, 16),
            PDL=pdl, num_warps=cfg.DOWN_WARPS, **_pdl.options(pdl))
        return out
    _launch_down[(cdiv(H, cfg.DOWN_N),)](
        h, w2, shared_w2 if shared_w2 is not None else w2, groups, weights, out, H, I, E, SLOTS=slots,
        SLOTS_PAD=pow2(slots), HAS_SHARED=shared_w2 is not None, BLOCK_N=cfg.DOWN_N, BLOCK_K=cfg.DOWN_K,
        PDL=pdl, num_warps=cfg.DOWN_WARPS, **_pdl.options(pdl))
    return out


def moe_block_one_token(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        top_k: int, renormalize: bool, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None,
                        shared_gate_weight: torch.Tensor | None, expert_map: torch.Tensor | None,
                        cfg: DecodeConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """:func:`kernels_triton.moe.ops.moe_block` for ``x`` ``[1, H]``, the shared expert (if any) as wide as the
    routed ones (the caller checks). ``cfg``: launch shape (default :func:`decode_config`)."""
    shared = shared_w13 is not None
    slots, (E, H), I = top_k + int(shared), router_weight.shape, w2.shape[2]
    cfg = cfg or decode_config(H, I, slots)
    gate = shared_gate_weight if shared else None
    # the block's per-call tensors but its output: one kept buffer, no allocation or view per call
    scratch = one_token_scratch(E, router_launch(1, H, E)[0][2], gate is not None, slots, I, x.dtype, x.device)
    groups, weights = route_one(x, router_weight, top_k, renormalize, n_local=w13.shape[0], expert_map=expert_map,
                                gate_weight=gate, shared=shared, pdl=pdl, scratch=scratch)
    early = cfg.DOWN_EARLY and _pdl.enabled(x)  # sm_90+, unless QWEN35_MOE_PDL=0
    h = gate_up_one(x, w13, shared_w13, groups, cfg, pdl, trigger=early, h=scratch[4])
    return down_one(h, w2, shared_w2, groups, weights, cfg, pdl or early)
