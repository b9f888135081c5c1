"""EXPERIMENT (session 15, not wired into moe_block): the MoE block for one token in ONE persistent launch.

Measured on the H200 against the three-launch decode path (:mod:`kernels_triton.moe.decode`) and found no faster
(35B-A3B 24.1 vs 23.6 µs, 397B-A17B-TP8 20.0 vs 18.2; tuning/results/moe_one_launch_s15_nvidia_h200.json,
tuning/notes_moe.md session 15). Kept in the history for its per-phase timings and its grid-wide wait; removed in
the next commit.

One cooperative launch (every program resident: ``launch_cooperative_grid``; ``PER_SM`` programs per
multiprocessor) runs three phases with two grid-wide waits between them:

1. **router**: each program computes ``R`` router logits (GEMV rows; the shared expert's gate logit is row E).
   Programs whose slot is the shared expert's load their first gate_up tiles before waiting (no routing needed).
2. **route + gate_up**: every program reads the logits back and routes the token itself
   (:func:`kernels_triton.moe.routing._top_k_rows`: the routing's picks and weights; each pick through the expert
   map; the shared expert as slot ``TOP_K``); then it streams its share of one slot's gate_up column tiles
   (``UP_C`` gate rows and their up rows, all of H), three tiles in rotation so two tiles' loads are in flight
   during a tile's math; ``AHEAD`` also asks L2 for the next three.
3. **down + combine**: the first two down tiles (every slot's ``DOWN_N`` rows of W2) load after the program's
   arrival at the second wait and before its departure (they need the picks, not ``h``); each output column is one
   program's fixed-order fp32 sum of ``weight_j * h_j W2_j^T``.

The grid-wide wait: one int32 (arrivals in the low 16 bits, a generation above) of the thread's arrival counter
buffer (:mod:`kernels_triton._arrival`, word 2); a program arrives with a release atomic add, the last arrival takes
the count back to 0 and moves the generation in one more, and each program departs once an acquire load sees the
generation move. Under the CPU interpreter (programs run one after another) the kernel runs as three launches
(``PHASE`` 1, 2, 3) instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton._arrival import arrival_counter
from kernels_triton._config import device_facts
from kernels_triton._launch import DirectLauncher
from kernels_triton.moe.experts import _expert_weights
from kernels_triton.moe.routing import _top_k_rows, cdiv, pow2


@dataclass(frozen=True)
class OneLaunchConfig:
    """``TILE``: elements of one weight tile (a gate_up tile is ``UP_C x H_PAD`` gate rows plus as many up rows, a
    down tile ``SLOTS_PAD x DOWN_N x I_PAD``); ``WARPS`` per program; ``PROGRAMS``: the grid (``PER_SM`` per
    multiprocessor when 0); ``AHEAD``: L2 prefetch ahead of the tile rotation; ``SLOTS_MIN``: the slot axis' padding."""

    TILE: int = 8192
    WARPS: int = 8
    PROGRAMS: int = 0  # 0: PER_SM per multiprocessor
    PER_SM: int = 1
    AHEAD: bool = False
    SLOTS_MIN: int = 16


@triton.jit
def _grid_arrive(sync_ptr, n_programs):
    """This program's arrival at a grid-wide wait, after its stores (returns the word as it found it, for
    :func:`_grid_depart`). One int32: arrivals in the low 16 bits, the generation above; the last to arrive takes
    the count back to 0 and moves the generation in one atomic."""
    tl.debug_barrier()  # every thread of this program has stored its part
    old = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    if (old & 0xFFFF) == n_programs - 1:
        tl.atomic_add(sync_ptr, 65536 - n_programs, sem="release", scope="gpu")
    return old


@triton.jit
def _grid_depart(sync_ptr, old):
    """Wait until every program has arrived (the generation moved past the one ``old`` saw); their stores are
    visible from here (acquire loads)."""
    seen = old
    while ((seen ^ old) & ~0xFFFF) == 0:
        seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [sync_ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _up_tile_load(w_ptr, shared_w_ptr, group, c0, valid, H, I, E_LOCAL, HAS_SHARED: tl.constexpr,
                  UP_C: tl.constexpr, H_PAD: tl.constexpr):
    """Gate and up rows ``c0 .. c0 + UP_C`` of ``group``'s W13 (zeros, nothing read, where not ``valid`` or the slot
    is dropped)."""
    base = _expert_weights(w_ptr, shared_w_ptr, tl.maximum(group, 0), 2 * I * H, E_LOCAL, HAS_SHARED)
    cols = c0 + tl.arange(0, UP_C)
    ks = tl.arange(0, H_PAD)
    mask = (valid & (group >= 0)) & (cols < I)[:, None] & (ks < H)[None, :]
    ptrs = base + cols[:, None] * H + ks[None, :]
    return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + I * H, mask=mask, other=0.0)


@triton.jit
def _prefetch_l2(ptrs, ok):
    """Ask L2 for the 128-byte lines at ``ptrs`` where ``ok`` (no registers held, nothing waits for them)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _up_tile_prefetch(w_ptr, shared_w_ptr, group, c0, valid, H, I, E_LOCAL, HAS_SHARED: tl.constexpr,
                      UP_C: tl.constexpr, H_LINES: tl.constexpr, LINE: tl.constexpr):
    """L2 prefetch of the gate_up tile :func:`_up_tile_load` would load."""
    base = _expert_weights(w_ptr, shared_w_ptr, tl.maximum(group, 0), 2 * I * H, E_LOCAL, HAS_SHARED)
    j = tl.arange(0, 2 * UP_C)
    col = c0 + j % UP_C
    rows = tl.where(j < UP_C, col, col + I)  # UP_C gate rows, then their up rows
    ks = tl.arange(0, H_LINES) * LINE
    ok = (valid & (group >= 0)) & (col < I)[:, None] & (ks < H)[None, :]
    _prefetch_l2(base + rows[:, None] * H + ks[None, :], ok)


@triton.jit
def _down_tile_prefetch(bases, kept, n0, valid, H, I, DOWN_N: tl.constexpr, I_LINES: tl.constexpr,
                        LINE: tl.constexpr):
    """L2 prefetch of the down tile :func:`_down_tile_load` would load."""
    cols = n0 + tl.arange(0, DOWN_N)
    ks = tl.arange(0, I_LINES) * LINE
    ok = (valid & kept[:, None, None]) & (cols < H)[None, :, None] & (ks < I)[None, None, :]
    _prefetch_l2(bases[:, None, None] + cols[None, :, None] * I + ks[None, None, :], ok)


@triton.jit
def _up_tile_store(g, u, x_row, h_row, c0, valid, I, UP_C: tl.constexpr):
    """``h`` columns ``c0 ..`` from a loaded gate_up tile: ``silu(x . g) * (x . u)`` (nothing stored where not
    ``valid``)."""
    gate = tl.sum(g.to(tl.float32) * x_row[None, :], axis=1)
    up = tl.sum(u.to(tl.float32) * x_row[None, :], axis=1)
    cols = c0 + tl.arange(0, UP_C)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_row + cols, act.to(h_row.dtype.element_ty), mask=(cols < I) & valid)


@triton.jit
def _down_bases(w_ptr, shared_w_ptr, groups, H, I, E_LOCAL, HAS_SHARED: tl.constexpr):
    base = w_ptr + tl.maximum(groups, 0).to(tl.int64) * H * I
    if HAS_SHARED:
        base = tl.where(groups == E_LOCAL, shared_w_ptr + 0 * groups, base)
    return base


@triton.jit
def _down_tile_load(bases, kept, n0, valid, H, I, DOWN_N: tl.constexpr, I_PAD: tl.constexpr):
    """W2 rows ``n0 .. n0 + DOWN_N`` of every kept slot: ``[SLOTS_PAD, DOWN_N, I_PAD]``."""
    cols = n0 + tl.arange(0, DOWN_N)
    ks = tl.arange(0, I_PAD)
    mask = (valid & kept[:, None, None]) & (cols < H)[None, :, None] & (ks < I)[None, None, :]
    return tl.load(bases[:, None, None] + cols[None, :, None] * I + ks[None, None, :], mask=mask, other=0.0)


@triton.jit
def _down_tile_store(w, h, kept, weights, out_ptr, n0, H, DOWN_N: tl.constexpr):
    """Output columns ``n0 ..`` from a loaded down tile: the slots' ``weight_j * h_j W2_j^T`` summed (fixed tree)."""
    per_slot = tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)
    total = tl.sum(tl.where(kept[:, None], per_slot * weights[:, None], 0.0), axis=0)
    cols = n0 + tl.arange(0, DOWN_N)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _stamp(stamp_ptr, j: tl.constexpr, STAMPS: tl.constexpr):
    """With STAMPS: the GPU's global timer (ns) into ``stamp_ptr[program, j]`` (where each phase of each program
    ends; for timing the phases apart)."""
    if STAMPS:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(stamp_ptr + tl.program_id(0) * 8 + j, now)


@triton.jit
def _slot_share(pid, n_prog, order, SLOTS: tl.constexpr):
    """(first column tile, stride) of this program's share of slot ``order``'s gate_up tiles: with at least as many
    programs as slots each program serves the slot ``pid % SLOTS`` beside the other programs of that slot, else
    every slot ``pid, pid + n_prog, ..`` alone."""
    if n_prog >= SLOTS:
        return pid // SLOTS, (n_prog - 1 - order) // SLOTS + 1
    return 0, 1


@triton.jit
def _one_token_kernel(x_ptr, router_ptr, gate_w_ptr, w13_ptr, shared_w13_ptr, w2_ptr, shared_w2_ptr, map_ptr,
                      logits_ptr, h_ptr, out_ptr, sync_ptr, stamp_ptr, H, I, E, E_LOCAL,
                      TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                      HAS_GATE: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr,
                      R: tl.constexpr, RK: tl.constexpr, UP_C: tl.constexpr, H_PAD: tl.constexpr,
                      DOWN_N: tl.constexpr, I_PAD: tl.constexpr, PHASE: tl.constexpr, AHEAD: tl.constexpr = False,
                      H_LINES: tl.constexpr = 1, I_LINES: tl.constexpr = 1, LINE: tl.constexpr = 64,
                      STAMPS: tl.constexpr = False):
    """The whole block (``PHASE`` 0, grid-wide waits between the phases) or one phase of it (1, 2, 3: the
    interpreter's three launches). Module docstring."""
    _stamp(stamp_ptr, 6, STAMPS)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    TPS = tl.cdiv(I, UP_C)  # gate_up column tiles per slot

    # ---- phase 1: router logits (row E: the shared expert's gate) -----------------------------------------------
    if PHASE == 0 or PHASE == 1:
        rows = pid * R + tl.arange(0, R)
        rows_ok = rows < E + HAS_GATE
        row_ptrs = tl.where(rows < E, router_ptr + rows.to(tl.int64) * H, gate_w_ptr + 0 * rows)
        acc = tl.zeros((R, RK), dtype=tl.float32)
        for k0 in range(0, H, RK):
            ks = k0 + tl.arange(0, RK)
            xk = tl.load(x_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
            wk = tl.load(row_ptrs[:, None] + ks[None, :], mask=rows_ok[:, None] & (ks < H)[None, :], other=0.0)
            acc += wk.to(tl.float32) * xk[None, :]
        tl.store(logits_ptr + rows, tl.sum(acc, axis=1), mask=rows_ok)
    if PHASE == 0:
        arrived = _grid_arrive(sync_ptr + 2, n_prog)

    ks_h = tl.arange(0, H_PAD)
    x_row = tl.load(x_ptr + ks_h, mask=ks_h < H, other=0.0).to(tl.float32)
    slot_ids = tl.arange(0, SLOTS_PAD)
    if PHASE == 0 or PHASE == 2:
        # this program's slot (the shared expert's first: no routing needed, so its first tiles load before the wait)
        order = pid % SLOTS
        c_first, c_step = _slot_share(pid, n_prog, order, SLOTS)
        early = order < 0  # (a tensor either way)
        if HAS_SHARED:
            early = order == 0
        g_a, u_a = _up_tile_load(w13_ptr, shared_w13_ptr, E_LOCAL, c_first * UP_C, early & (c_first < TPS), H, I,
                                 E_LOCAL, HAS_SHARED, UP_C, H_PAD)
        g_b, u_b = _up_tile_load(w13_ptr, shared_w13_ptr, E_LOCAL, (c_first + c_step) * UP_C,
                                 early & (c_first + c_step < TPS), H, I, E_LOCAL, HAS_SHARED, UP_C, H_PAD)
    _stamp(stamp_ptr, 0, STAMPS)
    if PHASE == 0:
        _grid_depart(sync_ptr + 2, arrived)
    _stamp(stamp_ptr, 1, STAMPS)

    # ---- every program routes the token -----------------------------------------------------------------------
    if PHASE != 1:
        cols_e = tl.arange(0, E_PAD)
        logits = tl.load(logits_ptr + cols_e, mask=cols_e < E, other=0.0, cache_modifier=".cg")
        picked, ids = _top_k_rows(logits[None, :], cols_e, E, TOP_K, SLOTS_PAD, RENORMALIZE)
        weights = tl.sum(picked, axis=0)
        ids = tl.sum(ids, axis=0)
        routed = slot_ids < TOP_K
        if HAS_MAP:
            groups = tl.load(map_ptr + ids, mask=routed, other=-1)
        else:
            groups = ids
        groups = tl.where(routed, groups, -1)
        if HAS_SHARED:
            shared_w = 1.0
            if HAS_GATE:
                shared_w = tl.sigmoid(tl.load(logits_ptr + E, cache_modifier=".cg"))
            groups = tl.where(slot_ids == TOP_K, E_LOCAL, groups)
            weights = tl.where(slot_ids == TOP_K, shared_w, weights)
        kept = groups >= 0
    _stamp(stamp_ptr, 2, STAMPS)

    # ---- phase 2: gate_up, this program's column tiles of its slot(s); three tiles in rotation, so two tiles' loads
    # are in flight during a tile's math
    if PHASE == 0 or PHASE == 2:
        for o in range(order, SLOTS, n_prog):
            if HAS_SHARED:
                slot = tl.where(o == 0, TOP_K, o - 1)
            else:
                slot = o
            group = tl.sum(tl.where(slot_ids == slot, groups, 0), axis=0)
            live = group >= 0
            h_row = h_ptr + slot * I
            c_first, c_step = _slot_share(pid, n_prog, o, SLOTS)
            if not (early & (o == order)):
                g_a, u_a = _up_tile_load(w13_ptr, shared_w13_ptr, group, c_first * UP_C, live & (c_first < TPS), H, I,
                                         E_LOCAL, HAS_SHARED, UP_C, H_PAD)
                g_b, u_b = _up_tile_load(w13_ptr, shared_w13_ptr, group, (c_first + c_step) * UP_C,
                                         live & (c_first + c_step < TPS), H, I, E_LOCAL, HAS_SHARED, UP_C, H_PAD)
            for c in range(c_first, TPS, 3 * c_step):
                c_b = c + c_step
                c_c = c + 2 * c_step
                if AHEAD:  # the next iteration's three tiles into L2
                    for j in tl.static_range(3):
                        c_p = c_c + (3 + j) * c_step
                        _up_tile_prefetch(w13_ptr, shared_w13_ptr, group, c_p * UP_C, live & (c_p < TPS), H, I,
                                          E_LOCAL, HAS_SHARED, UP_C, H_LINES, LINE)
                g_c, u_c = _up_tile_load(w13_ptr, shared_w13_ptr, group, c_c * UP_C, live & (c_c < TPS), H, I,
                                         E_LOCAL, HAS_SHARED, UP_C, H_PAD)
                _up_tile_store(g_a, u_a, x_row, h_row, c * UP_C, live, I, UP_C)
                g_a, u_a = _up_tile_load(w13_ptr, shared_w13_ptr, group, (c_c + c_step) * UP_C,
                                         live & (c_c + c_step < TPS), H, I, E_LOCAL, HAS_SHARED, UP_C, H_PAD)
                _up_tile_store(g_b, u_b, x_row, h_row, c_b * UP_C, live & (c_b < TPS), I, UP_C)
                g_b, u_b = _up_tile_load(w13_ptr, shared_w13_ptr, group, (c_c + 2 * c_step) * UP_C,
                                         live & (c_c + 2 * c_step < TPS), H, I, E_LOCAL, HAS_SHARED, UP_C, H_PAD)
                _up_tile_store(g_c, u_c, x_row, h_row, c_c * UP_C, live & (c_c < TPS), I, UP_C)
    if PHASE == 0:
        arrived = _grid_arrive(sync_ptr + 2, n_prog)
    _stamp(stamp_ptr, 3, STAMPS)

    # ---- phase 3: down + combine over output columns; the first two tiles' loads go out before the wait (they need
    # the picks, not h) but after the arrival (whose release would otherwise wait for them)
    if PHASE == 0 or PHASE == 3:
        bases = _down_bases(w2_ptr, shared_w2_ptr, groups, H, I, E_LOCAL, HAS_SHARED)
        n_down = tl.cdiv(H, DOWN_N)
        w_a = _down_tile_load(bases, kept, pid * DOWN_N, pid < n_down, H, I, DOWN_N, I_PAD)
        w_b = _down_tile_load(bases, kept, (pid + n_prog) * DOWN_N, pid + n_prog < n_down, H, I, DOWN_N, I_PAD)
    if PHASE == 0:
        _grid_depart(sync_ptr + 2, arrived)
    _stamp(stamp_ptr, 4, STAMPS)
    if PHASE == 0 or PHASE == 3:
        ks_i = tl.arange(0, I_PAD)
        h = tl.load(h_ptr + slot_ids[:, None] * I + ks_i[None, :], mask=kept[:, None] & (ks_i < I)[None, :],
                    other=0.0, cache_modifier=".cg").to(tl.float32)
        for t in range(pid, n_down, 3 * n_prog):
            t_c = t + 2 * n_prog
            if AHEAD:
                for j in tl.static_range(3):
                    t_p = t_c + (3 + j) * n_prog
                    _down_tile_prefetch(bases, kept, t_p * DOWN_N, t_p < n_down, H, I, DOWN_N, I_LINES, LINE)
            w_c = _down_tile_load(bases, kept, t_c * DOWN_N, t_c < n_down, H, I, DOWN_N, I_PAD)
            _down_tile_store(w_a, h, kept, weights, out_ptr, t * DOWN_N, H, DOWN_N)
            w_a = _down_tile_load(bases, kept, (t + 3 * n_prog) * DOWN_N, t + 3 * n_prog < n_down, H, I, DOWN_N,
                                  I_PAD)
            _down_tile_store(w_b, h, kept, weights, out_ptr, (t + n_prog) * DOWN_N, H, DOWN_N)
            w_b = _down_tile_load(bases, kept, (t + 4 * n_prog) * DOWN_N, t + 4 * n_prog < n_down, H, I, DOWN_N,
                                  I_PAD)
            _down_tile_store(w_c, h, kept, weights, out_ptr, t_c * DOWN_N, H, DOWN_N)
    _stamp(stamp_ptr, 5, STAMPS)


# launched through DirectLauncher: no per-call argument binding once compiled (see kernels_triton/_launch.py)
_launch = DirectLauncher(_one_token_kernel)


@functools.lru_cache(maxsize=256)
def _shape(E: int, H: int, I: int, top_k: int, shared: bool, gate: bool, programs: int, tile: int,
           elem_bytes: int, slots_min: int = 16) -> dict:
    """Constexprs of one launch shape."""
    slots_pad = pow2(top_k + int(shared), slots_min)
    h_pad, i_pad = pow2(H, 16), pow2(I, 16)
    r = pow2(cdiv(E + int(gate), programs))
    return dict(SLOTS_PAD=slots_pad, E_PAD=pow2(E, 16), R=r, RK=max(16, min(h_pad, tile // r)),
                UP_C=max(1, min(pow2(I), tile // h_pad)), H_PAD=h_pad, DOWN_N=max(1, tile // (slots_pad * i_pad)),
                I_PAD=i_pad)


def moe_block_one_launch(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         top_k: int, renormalize: bool, shared_w13: torch.Tensor | None,
                         shared_w2: torch.Tensor | None, shared_gate_weight: torch.Tensor | None,
                         expert_map: torch.Tensor | None, cfg: OneLaunchConfig | None = None,
                         stamps: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`kernels_triton.moe.ops.moe_block` for ``x`` ``[1, H]`` in one launch (module docstring), the shared
    expert (if any) as wide as the routed ones (the caller checks). ``stamps``: int64 ``[programs, 8]`` to receive
    each program's phase end times (GPU global timer, ns: router, first wait, routing, gate_up, second wait, down;
    its start at 6)."""
    cfg = cfg or OneLaunchConfig()
    (E_local, H, I), E = w2.shape, router_weight.shape[0]
    shared = shared_w13 is not None
    gate = shared and shared_gate_weight is not None
    interpret = _launch.interpret
    programs = cfg.PROGRAMS or device_facts(x.device)[1] * cfg.PER_SM
    if interpret and not cfg.PROGRAMS:
        programs = 3
    shape = _shape(E, H, I, top_k, shared, gate, programs, cfg.TILE, x.element_size(), cfg.SLOTS_MIN)
    logits = torch.empty(E + 1, dtype=torch.float32, device=x.device)
    h = torch.empty(top_k + int(shared), I, dtype=x.dtype, device=x.device)
    out = torch.empty(1, H, dtype=x.dtype, device=x.device)
    args = (x, router_weight, shared_gate_weight if gate else router_weight, w13, shared_w13 if shared else w13, w2,
            shared_w2 if shared else w2, expert_map if expert_map is not None else logits, logits, h, out,
            arrival_counter(x.device), stamps if stamps is not None else logits, H, I, E, E_local)
    consts = dict(TOP_K=top_k, RENORMALIZE=bool(renormalize), HAS_GATE=gate, HAS_MAP=expert_map is not None,
                  HAS_SHARED=shared, STAMPS=stamps is not None, **shape,
                  AHEAD=cfg.AHEAD and not interpret, H_LINES=pow2(cdiv(H, 128 // x.element_size())),
                  I_LINES=pow2(cdiv(I, 128 // x.element_size())), LINE=128 // x.element_size())
    if interpret:
        for phase in (1, 2, 3):
            _launch[(programs,)](*args, **consts, PHASE=phase)
    else:
        _launch[(programs,)](*args, **consts, PHASE=0, num_warps=cfg.WARPS, num_stages=1,
                             launch_cooperative_grid=True)
    return out
