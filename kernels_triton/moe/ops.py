"""The MoE ops of :mod:`qwen35.ops` on Triton: route, align, grouped GEMMs, combine.

Pipeline (every step on the device, no host synchronisation, so a fixed-M call is CUDA-graph
capturable): router GEMM (fp32 logits, split-K at small M) -> softmax/top-k/renormalise ->
alignment by expert -> gate_up GEMM with SiLU-mul epilogue -> down GEMM scaled by the router
weight, one output row per (token, pick) -> fixed-order sum over the picks.

One token (batch-1 decode) takes three smaller launches instead (:mod:`.decode`): the router GEMV whose last
program routes the token, a gate_up GEMV, and a down GEMV that also sums the slots. Other decode-sized batches route
and align in one launch (:func:`.align.route_and_align`).

Shared expert: when its intermediate size equals the routed experts' (every Qwen3.5 MoE size,
also under TP), it rides the same pipeline as one extra group that every token picks, with its
sigmoid gate as the pick's weight: no separate launches. Otherwise it runs as plain torch
matmuls and is added in the combine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_triton._arrival import block_counters
from kernels_triton._util import cdiv
from kernels_triton.moe import align as _align
from kernels_triton.moe import config as _config
from kernels_triton.moe import decode as _decode
from kernels_triton.moe import experts as _experts
from kernels_triton.moe import pdl as _pdl
from kernels_triton.moe import routing as _routing


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (fp32) -> top-k (ties to the lowest id) -> renormalise; (weights fp32, ids int32) ``[M, k]``."""
    return _routing.route(router_logits, top_k, renormalize)


def _run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 al: _align.Alignment, cfgs: tuple[_config.GemmConfig, _config.GemmConfig],
                 shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                 extra: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """gate_up -> down -> combine over aligned picks (the shared expert is the last pick when ``shared``)."""
    shared_w13, shared_w2 = shared if shared is not None else (None, None)
    done = block_counters(x.device) if _experts.block_wait_default(pdl, al, x.shape[0]) else None
    try:
        h = _experts.gate_up(x, w13, shared_w13, al, weights.shape[1], cfgs[0], pdl=pdl, done=done)
        y = _experts.down(h, w2, shared_w2, al, weights, cfgs[1], pdl=pdl, done=done,
                          up_tiles=cdiv(w2.shape[2], cfgs[0].BLOCK_N))
        return _experts.combine(y, al, x.shape[0], weights.shape[1], extra, pdl=pdl, done=done)
    except BaseException:
        if done is not None:  # a launch that ran signalled them and the combine did not run: the next call starts
            done.zero_()  # from zero (stream order puts this after whatever was launched)
        raise


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed expert MLPs and their weighted top-k sum; ``[M, H]`` in x's dtype."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    (M, H), (E, I), top_k = x.shape, (w13.shape[0], w2.shape[2]), topk_ids.shape[1]
    cfgs = _config.configs(M, top_k, E, H, I, x.dtype, x.device)
    al = _align.align(topk_ids, n_local=E, block_m=cfgs[0].BLOCK_M, expert_map=expert_map)
    return _run_experts(x, w13, w2, topk_weights.float().contiguous(), al, cfgs)


def _torch_shared_expert(x, shared_w13, shared_w2, gate_weight):  # noqa: ANN001, ANN202
    gate, up = F.linear(x, shared_w13).chunk(2, dim=-1)
    out = F.linear(F.silu(gate) * up, shared_w2)
    if gate_weight is not None:
        out = torch.sigmoid(F.linear(x, gate_weight).float()).to(x.dtype) * out
    return out


def moe_block(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router -> routing -> experts (+ sigmoid-gated shared expert) in one call; ``[M, H]`` in x's dtype."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    (M, H), (E, I) = x.shape, (w13.shape[0], w2.shape[2])
    fused_shared = shared_w13 is not None and shared_w13.shape[0] == w13.shape[1]
    if M == 1 and (shared_w13 is None or fused_shared) and _decode.enabled():
        return _decode.moe_block_one_token(x, router_weight, w13, w2, top_k, renormalize, shared_w13, shared_w2,
                                           shared_gate_weight, expert_map,
                                           pdl=_pdl.forced() is True and _pdl.enabled(x))
    gate = shared_gate_weight if fused_shared else None
    cfgs = _config.configs(M, top_k, E, H, I, x.dtype, x.device)
    extra = None
    if shared_w13 is not None and not fused_shared:
        extra = _torch_shared_expert(x, shared_w13, shared_w2, shared_gate_weight)
    # each launch starts while the one before finishes: where routing and alignment are one launch
    # (kernels_triton/moe/pdl.py)
    pdl = _pdl.enabled(x, M * top_k <= _align.ALIGN_LAST_MAX_SLOTS)
    # the router partials, routing results and alignment: one kept buffer, no allocation or view per call
    n_experts = router_weight.shape[0]
    scratch = _align.route_scratch(M, n_experts, _routing.router_launch(M, H, n_experts)[0][2], top_k,
                                   gate=gate is not None, shared=fused_shared, n_local=E, block_m=cfgs[0].BLOCK_M,
                                   device=x.device)
    logits, n_splits = _routing.router_logits(x, router_weight, gate, pdl=pdl, out=(scratch.logits, scratch.gate_part))
    weights, _, al = _align.route_and_align(
        logits, n_splits, top_k, renormalize, n_experts=n_experts, n_local=E, block_m=cfgs[0].BLOCK_M,
        expert_map=expert_map, gate=gate is not None, shared=fused_shared, pdl=pdl, scratch=scratch)
    return _run_experts(x, w13, w2, weights, al, cfgs, (shared_w13, shared_w2) if fused_shared else None, extra,
                        pdl=pdl)
