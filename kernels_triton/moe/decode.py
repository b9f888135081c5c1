"""The MoE block for one token (batch-1 decode) in three launches: router GEMV -> gate_up -> down.

At one token the block is a weight stream (35B-A3B: 8 experts + the shared one, 57 MB, ~13 µs at the H200's copy
rate); the general pipeline adds two dependent stages around it, a route + align program (4 µs on the H200: a
sort, a histogram and scans over every expert for nine slots) and a combine (1.7 µs), and runs each expert as a
16-row tensor-core tile holding one real row. Here:

- **gate_up** (grid ``slots x column tiles``): every program routes the token itself from the router's split-K
  partials (softmax -> top-k -> renormalise, :func:`kernels_triton.moe.routing._top_k_rows`: the same picks and
  weights as :func:`kernels_triton.moe.routing.route`; 1 KB per split read from L2), takes its pick ``j`` (the
  shared expert is pick ``TOP_K``, weight ``sigmoid(gate logit)``), maps it through the expert map (-1: held
  elsewhere, the program stops) and computes its ``BLOCK_N`` columns of ``silu(x Wg^T) * (x Wu^T)`` as a GEMV
  (fp32 products, one reduction at the end). The column-tile-0 programs store the pick's group and weight for
  the down launch. With ``PREFETCH`` each program first asks for its share of its pick's ``W2`` rows in L2, so the
  down launch reads them from L2 and the weight stream does not stop between the launches.
- **down** (grid ``column tiles of H``): each program sums ``weight_j * (h_j W2[e_j]^T)`` over the slots in slot
  order in fp32 (the combine, fused: no per-slot rows) and stores its columns of the output.

Deterministic (no atomics, fixed orders). The output differs from the general pipeline's in the last bits (the
GEMV's summation order; no rounding of each slot's row to the activation dtype before the sum).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher, aligned16
from kernels_triton._pdl import env_choice as _env_choice
from kernels_triton.moe import pdl as _pdl
from kernels_triton.moe.experts import _expert_weights
from kernels_triton.moe.routing import _top_k_rows, cdiv, gate_logits, pow2, router_logits

ENV = "QWEN35_MOE_DECODE"  # "0": one token takes the general pipeline too (comparisons, a way around this path)


def enabled() -> bool:
    """Whether one token takes this path (``QWEN35_MOE_DECODE`` unset or ``1``; ``0`` turns it off)."""
    return _env_choice(ENV) is not False


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the two expert launches: gate_up ``UP_N`` columns (of gate and of up) x ``UP_K`` steps,
    down ``DOWN_N`` output columns x ``DOWN_K`` steps; warps of each."""

    UP_N: int
    UP_K: int
    UP_WARPS: int
    DOWN_N: int
    DOWN_K: int
    DOWN_WARPS: int
    PREFETCH: bool = True


@functools.lru_cache(maxsize=256)
def decode_config(slots: int, H: int, I: int, n_sm: int) -> DecodeConfig:
    """Heuristic: gate_up column tiles narrow enough that ``slots x tiles`` is about two programs per SM (4 to 32
    columns), down tiles for at least half a program per SM (8 to 64 columns); 256-element K steps (the row's width
    when narrower); 4 warps."""
    up_n = 32
    while up_n > 4 and slots * cdiv(I, up_n) < 2 * n_sm:
        up_n //= 2
    down_n = 64
    while down_n > 8 and 2 * cdiv(H, down_n) < n_sm:
        down_n //= 2
    return DecodeConfig(UP_N=min(up_n, pow2(I)), UP_K=min(256, pow2(H, 16)), UP_WARPS=4, DOWN_N=min(down_n, pow2(H)),
                        DOWN_K=min(256, pow2(I, 16)), DOWN_WARPS=4)


@triton.jit
def _pick(logits_ptr, gate_ptr, map_ptr, j, E_GLOBAL, E_LOCAL, N_SPLITS: tl.constexpr, TOP_K: tl.constexpr,
          K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_GATE: tl.constexpr,
          HAS_MAP: tl.constexpr, HAS_SHARED: tl.constexpr):
    """(group, weight) of the token's slot ``j``: routed picks ``j < TOP_K`` (group = local expert or -1), the
    shared expert at ``j == TOP_K`` (group E_LOCAL). Split-K partials are summed in split order, as in routing."""
    cols = tl.arange(0, E_PAD)
    logits = tl.zeros((1, E_PAD), dtype=tl.float32)
    for s in tl.static_range(N_SPLITS):
        logits += tl.load(logits_ptr + s * E_GLOBAL + cols[None, :], mask=(cols < E_GLOBAL)[None, :], other=0.0)
    weights, ids = _top_k_rows(logits, cols, E_GLOBAL, TOP_K, K_PAD, RENORMALIZE)
    slot = tl.arange(0, K_PAD)[None, :]
    expert = tl.sum(tl.sum(tl.where(slot == j, ids, 0), axis=1), axis=0)
    weight = tl.sum(tl.sum(tl.where(slot == j, weights, 0.0), axis=1), axis=0)
    if HAS_MAP:
        group = tl.load(map_ptr + expert)
    else:
        group = expert
    if HAS_SHARED:
        if j == TOP_K:
            group = E_LOCAL
            if HAS_GATE:
                gate = tl.load(gate_ptr)
                for s in tl.static_range(1, N_SPLITS):
                    gate += tl.load(gate_ptr + s)
                weight = tl.sigmoid(gate)
            else:
                weight = 1.0
    return group, weight


@triton.jit
def _decode_gate_up_kernel(x_ptr, logits_ptr, gate_ptr, map_ptr, w_ptr, shared_w_ptr, w2_ptr, shared_w2_ptr, h_ptr,
                           group_ptr, weight_ptr, H, I, E_GLOBAL, E_LOCAL, N_SPLITS: tl.constexpr,
                           TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                           RENORMALIZE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_MAP: tl.constexpr,
                           HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PREFETCH_ROWS: tl.constexpr = 0, LINES: tl.constexpr = 1, LINE_ELEMS: tl.constexpr = 64,
                           PDL: tl.constexpr = False):
    """Slot ``program_id(0)``'s ``h`` columns ``program_id(1) * BLOCK_N ..``: route, then a GEMV over H."""
    _pdl.enter(PDL)
    j = tl.program_id(0)
    tile = tl.program_id(1)
    group, weight = _pick(logits_ptr, gate_ptr, map_ptr, j, E_GLOBAL, E_LOCAL, N_SPLITS, TOP_K, K_PAD, E_PAD,
                          RENORMALIZE, HAS_GATE, HAS_MAP, HAS_SHARED)
    if tile == 0:
        tl.store(group_ptr + j, group)
        tl.store(weight_ptr + j, weight)
    if group < 0:
        return
    if PREFETCH_ROWS > 0:  # this program's share of the pick's W2 rows, into L2 for the down launch
        w2 = _expert_weights(w2_ptr, shared_w2_ptr, group, H * I, E_LOCAL, HAS_SHARED)
        _pdl.prefetch_rows_l2(w2, tile * PREFETCH_ROWS, H, I, PREFETCH_ROWS, LINES, LINE_ELEMS)
    w = _expert_weights(w_ptr, shared_w_ptr, group, 2 * I * H, E_LOCAL, HAS_SHARED)
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
def _decode_down_kernel(h_ptr, w_ptr, shared_w_ptr, group_ptr, weight_ptr, out_ptr, H, I, E_LOCAL,
                        SLOTS: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Output columns ``program_id(0) * BLOCK_N ..``: sum over slots j (in order) of weight_j * h_j W2[e_j]^T."""
    _pdl.enter(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        group = tl.load(group_ptr + j)
        kept = group >= 0
        w = _expert_weights(w_ptr, shared_w_ptr, tl.maximum(group, 0), H * I, E_LOCAL, HAS_SHARED)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = (ks + k0 < I) & kept
            hk = tl.load(h_ptr + j * I + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            wt = tl.load(w + cols[:, None] * I + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += wt.to(tl.float32) * hk[None, :]
        total += tl.where(kept, tl.sum(acc, axis=1) * tl.load(weight_ptr + j), 0.0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


# launched through DirectLauncher: no per-call argument binding once compiled (see kernels_triton/_launch.py)
_launch_gate_up = DirectLauncher(_decode_gate_up_kernel)
_launch_down = DirectLauncher(_decode_down_kernel)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def moe_block_one_token(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        top_k: int, renormalize: bool, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None,
                        shared_gate_weight: torch.Tensor | None, expert_map: torch.Tensor | None,
                        cfg: DecodeConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """:func:`kernels_triton.moe.ops.moe_block` for ``x`` ``[1, H]``, the shared expert (if any) as wide as the
    routed ones (the caller checks). ``cfg``: launch shape (default :func:`decode_config`)."""
    H, (E, I) = x.shape[1], (w13.shape[0], w2.shape[2])
    n_experts = router_weight.shape[0]
    shared = shared_w13 is not None
    slots = top_k + int(shared)
    cfg = cfg or decode_config(slots, H, I, _sm_count(x.device))
    logits, n_splits = router_logits(x, router_weight, shared_gate_weight if shared else None, pdl=pdl)
    ints = torch.empty(2 * aligned16(slots), dtype=torch.int32, device=x.device)
    groups, weights = ints[:slots], ints[aligned16(slots):aligned16(slots) + slots].view(torch.float32)
    h = torch.empty(slots, I, dtype=x.dtype, device=x.device)
    up_tiles = cdiv(I, cfg.UP_N)
    # L2 prefetch by inline PTX: CUDA builds only (not the interpreter, not HIP)
    rows = pow2(cdiv(H, up_tiles)) if cfg.PREFETCH and x.is_cuda and torch.version.hip is None else 0
    lines, line_elems = _pdl.prefetch_lines(I, w2.element_size())
    has_gate = shared and shared_gate_weight is not None
    _launch_gate_up[(slots, up_tiles)](
        x, logits, gate_logits(logits, n_splits) if has_gate else logits,
        expert_map if expert_map is not None else groups, w13, shared_w13 if shared else w13, w2,
        shared_w2 if shared else w2, h, groups, weights, H, I, n_experts, E, N_SPLITS=n_splits, TOP_K=top_k,
        K_PAD=pow2(top_k, 2), E_PAD=pow2(n_experts, 16), RENORMALIZE=bool(renormalize),
        HAS_GATE=has_gate, HAS_MAP=expert_map is not None, HAS_SHARED=shared,
        BLOCK_N=cfg.UP_N, BLOCK_K=cfg.UP_K, PREFETCH_ROWS=rows, LINES=lines, LINE_ELEMS=line_elems, PDL=pdl,
        num_warps=cfg.UP_WARPS, **_pdl.options(pdl))
    out = torch.empty_like(x)
    _launch_down[(cdiv(H, cfg.DOWN_N),)](
        h, w2, shared_w2 if shared else w2, groups, weights, out, H, I, E, SLOTS=slots, HAS_SHARED=shared,
        BLOCK_N=cfg.DOWN_N, BLOCK_K=cfg.DOWN_K, PDL=pdl, num_warps=cfg.DOWN_WARPS, **_pdl.options(pdl))
    return out
