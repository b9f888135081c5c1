"""MoE reference: softmax -> top-k -> renormalise routing, expert MLPs, weighted combine, gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen35.reference.common import compute_dtype_for


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights fp32 [M, k] (fp64 for fp64 logits), ids int32 [M, k]); ties go to the lowest id."""
    dt = compute_dtype_for(router_logits)
    probs = torch.softmax(router_logits.to(dt), dim=-1)
    # A stable descending sort keeps equal probabilities in id order, so ties resolve to the lowest id.
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = values[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def _mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weight_j * expert_{id_j}(x), computed in fp32 (fp64 if x is fp64); output in x's dtype."""
    dt = compute_dtype_for(x)
    M, H = x.shape
    out = torch.zeros(M, H, dtype=dt, device=x.device)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]  # global id -> local id, -1 where the expert lives elsewhere
    xf = x.to(dt)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        rows, cols = (ids == e).nonzero(as_tuple=True)
        y = _mlp(xf[rows], w13[e].to(dt), w2[e].to(dt))
        out.index_add_(0, rows, y * topk_weights[rows, cols].to(dt)[:, None])
    return out.to(x.dtype)


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
    """Reference for :func:`qwen35.ops.moe_block`: router, routed experts and the gated shared expert."""
    dt = compute_dtype_for(x)
    logits = x.to(dt) @ router_weight.to(dt).t()
    weights, ids = moe_route(logits, top_k, renormalize)
    out = moe_experts(x.to(dt), w13, w2, weights, ids, expert_map)
    if shared_w13 is not None:
        shared = _mlp(x.to(dt), shared_w13.to(dt), shared_w2.to(dt))
        if shared_gate_weight is not None:
            shared = torch.sigmoid(x.to(dt) @ shared_gate_weight.to(dt).t()) * shared
        out = out + shared
    return out.to(x.dtype)
