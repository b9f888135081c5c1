"""Decode-sized MoE blocks (a token or two): routing, both expert GEMMs and the router weight in one kernel.

The general pipeline (:mod:`.ops`) runs five launches per block: router GEMM, route + align, gate_up,
down, combine. At one token each is a small, latency-bound launch (H200, 35B-A3B: 2.4 + 4.0 + 11.6 +
5.1 + 1.8 us for a 12 us weight floor). Here, after the router GEMM:

- ``_decode_experts_kernel``: one program per (slot, block of BI intermediate columns). It routes its
  token itself: the router's split-K partials summed in the route kernel's order, then the same top-k
  (:func:`.routing._top_k_rows`), so it picks the same experts with the same weights. Then the BI rows
  of its expert's gate and up projections (GEMV over H), ``h = silu(g) * u`` rounded to the activation
  dtype (as the general path stores h), times the matching BI columns of W2: an fp32 partial of the
  slot's output row, scaled by the router weight. Every weight byte is read once, by one program; no
  alignment is needed because each program knows its expert.
- ``_decode_combine_kernel``: each token's output is the sum of its partials in a fixed order (slot,
  then block), in fp32: deterministic, no atomics.

The shared expert (intermediate size equal to the routed experts', every Qwen3.5 MoE) is slot ``top_k``
with weight sigmoid(gate logit); slots whose expert ``expert_map`` drops (-1) contribute zeros.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher
from kernels_triton.moe.experts import _expert_weights
from kernels_triton.moe.routing import _top_k_rows, cdiv, gate_logits, pow2, router_logits

MAX_M = 2  # tokens up to which moe_block takes this path (H200: see tuning/notes_moe.md, session 3)


@triton.jit
def _decode_experts_kernel(x_ptr, logits_ptr, gate_ptr, map_ptr, w13_ptr, w2_ptr, shared_w13_ptr, shared_w2_ptr,
                           part_ptr, M, H, I, E, E_LOCAL, NB, N_SPLITS: tl.constexpr, TOP_K: tl.constexpr,
                           K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                           HAS_GATE: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_MAP: tl.constexpr,
                           BI: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, IEEE: tl.constexpr):
    s = tl.program_id(0)  # slot = token * SLOTS + pick
    b = tl.program_id(1)  # block of BI intermediate columns
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    t = s // SLOTS
    j = s % SLOTS
    hcols = tl.arange(0, BH)
    out_row = part_ptr + (s.to(tl.int64) * NB + b) * H

    # routing of token t (the route kernel's arithmetic, one row)
    cols = tl.arange(0, E_PAD)
    logits = tl.zeros((1, E_PAD), dtype=tl.float32)
    for sp in tl.static_range(N_SPLITS):
        logits += tl.load(logits_ptr + (sp * M + t) * E + cols[None, :], mask=(cols < E)[None, :], other=0.0)
    weights, ids = _top_k_rows(logits, cols, E, TOP_K, K_PAD, RENORMALIZE)
    pick = tl.arange(0, K_PAD)[None, :] == j
    weight = tl.sum(tl.where(pick, weights, 0.0))
    expert = tl.sum(tl.where(pick, ids, 0))
    if HAS_MAP:
        group = tl.load(map_ptr + expert).to(tl.int32)
    else:
        group = expert
    if HAS_SHARED:
        if j == TOP_K:
            group = E_LOCAL
            if HAS_GATE:
                gate = 0.0
                for sp in tl.static_range(N_SPLITS):
                    gate += tl.load(gate_ptr + sp * M + t)
                weight = tl.sigmoid(gate)
            else:
                weight = 1.0
    if group < 0:  # an expert held elsewhere: this slot adds nothing
        for h0 in range(0, H, BH):
            tl.store(out_row + h0 + hcols, tl.zeros((BH,), dtype=tl.float32), mask=(h0 + hcols) < H)
        return

    # h for intermediate columns b*BI .. : silu(x . Wg) * (x . Wu), a GEMV padded to 16 rows (row 0 real)
    w13 = _expert_weights(w13_ptr, shared_w13_ptr, group, 2 * I * H, E_LOCAL, HAS_SHARED)
    w2 = _expert_weights(w2_ptr, shared_w2_ptr, group, H * I, E_LOCAL, HAS_SHARED)
    rows16 = tl.arange(0, 16)
    ks = tl.arange(0, BK)
    icols = b * BI + tl.arange(0, BI)
    i_ok = icols < I
    x_ptrs = x_ptr + t.to(tl.int64) * H + ks[None, :] + 0 * rows16[:, None]
    g_ptrs = w13 + icols[None, :] * H + ks[:, None]  # [BK, BI] view of the gate rows
    acc_g = tl.zeros((16, BI), dtype=tl.float32)
    acc_u = tl.zeros((16, BI), dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_ok = (k0 + ks) < H
        a = tl.load(x_ptrs + k0, mask=(rows16 == 0)[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & i_ok[None, :]
        wg = tl.load(g_ptrs + k0, mask=wmask, other=0.0)
        wu = tl.load(g_ptrs + I * H + k0, mask=wmask, other=0.0)  # the up rows follow the gate rows
        if IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    h = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(x_ptr.dtype.element_ty)  # rows 1.. are 0

    # the slot's output row, partial over these BI columns: h . W2[:, b*BI ..]^T, times the router weight
    w2_ptrs = w2 + hcols[None, :] * I + icols[:, None]  # [BI, BH] view of W2's columns icols
    for h0 in range(0, H, BH):
        h_ok = (h0 + hcols) < H
        w2t = tl.load(w2_ptrs + h0 * I, mask=i_ok[:, None] & h_ok[None, :], other=0.0)
        if IEEE:
            y = tl.dot(h, w2t, input_precision="ieee")
        else:
            y = tl.dot(h, w2t)
        tl.store(out_row + h0 + hcols, tl.sum(y, axis=0) * weight, mask=h_ok)  # column sums = row 0


@triton.jit
def _decode_combine_kernel(part_ptr, out_ptr, H, NB, SLOTS: tl.constexpr, BH: tl.constexpr):
    """out[t] = sum over slots j, then blocks b, of part[t * SLOTS + j, b] (fp32, fixed order)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    first = t.to(tl.int64) * SLOTS * NB
    for r in range(0, SLOTS * NB):
        acc += tl.load(part_ptr + (first + r) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


_launch_experts = DirectLauncher(_decode_experts_kernel)
_launch_combine = DirectLauncher(_decode_combine_kernel)


@functools.lru_cache(maxsize=256)
def block_i(I: int, slots: int, M: int, sm_count: int) -> int:
    """Intermediate columns per program: the widest of 64 / 32 / 16 that still gives ~2 programs per SM
    (each program streams 3 * BI * H weight elements; fewer, longer programs leave SMs idle)."""
    for bi in (64, 32):
        if M * slots * cdiv(I, bi) >= 2 * sm_count:
            return bi
    return 16


def moe_block_decode(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                     *, renormalize: bool, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None,
                     shared_gate_weight: torch.Tensor | None, expert_map: torch.Tensor | None,
                     sm_count: int, bi: int | None = None) -> torch.Tensor:
    """:func:`kernels_triton.moe.ops.moe_block` for a few tokens in three launches (router, experts, combine).

    The shared expert, when given, must have the routed experts' intermediate size (the caller checks).
    ``bi`` overrides :func:`block_i` (benchmarks).
    """
    (M, H), (E, I) = x.shape, (w13.shape[0], w2.shape[2])
    n_experts = router_weight.shape[0]
    shared = shared_w13 is not None
    slots = top_k + int(shared)
    logits, n_splits = router_logits(x, router_weight, shared_gate_weight if shared else None)
    has_gate = shared and shared_gate_weight is not None
    gates = gate_logits(logits, n_splits) if has_gate else logits
    bi = bi or block_i(I, slots, M, sm_count)
    nb = cdiv(I, bi)
    part = torch.empty(M * slots * nb, H, dtype=torch.float32, device=x.device)
    _launch_experts[(M * slots, nb)](
        x, logits, gates, expert_map if expert_map is not None else logits, w13, w2,
        shared_w13 if shared else w13, shared_w2 if shared else w2, part, M, H, I, n_experts, E, nb,
        N_SPLITS=n_splits, TOP_K=top_k, K_PAD=pow2(top_k, 2), E_PAD=pow2(n_experts, 16),
        RENORMALIZE=bool(renormalize), HAS_GATE=has_gate, HAS_SHARED=shared, HAS_MAP=expert_map is not None,
        BI=bi, BK=min(256, pow2(H, 16)), BH=min(128, pow2(H, 16)), IEEE=x.dtype == torch.float32,
        num_warps=4, num_stages=3)
    out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    bh = min(512, pow2(H, 16))
    _launch_combine[(M, cdiv(H, bh))](part, out, H, nb, SLOTS=slots, BH=bh, num_warps=4)
    return out
