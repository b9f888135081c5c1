"""Reference decode attention over per-slot KV caches (the standalone host's layout)."""

from __future__ import annotations

import torch

from qwen35.reference.common import compute_dtype_for


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row over keys ``0 .. lengths[b] - 1`` of slot ``slots[b]``: see ``qwen35.ops.attention_decode``."""
    B, H, D = q.shape
    KV, L = k_cache.shape[1], k_cache.shape[2]
    acc = compute_dtype_for(q)
    live = slots >= 0
    idx = torch.where(live, slots, torch.zeros_like(slots)).long()
    n = torch.where(live, lengths.long(), torch.zeros_like(lengths, dtype=torch.long))
    keys = k_cache[idx].to(acc)  # [B, KV, L, D]
    values = v_cache[idx].to(acc)
    qg = q.to(acc).view(B, KV, H // KV, D)
    scores = torch.einsum("bkgd,bkld->bkgl", qg, keys) * scale
    valid = torch.arange(L, device=q.device)[None, :] < n[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # a row with no keys gives zeros
    return torch.einsum("bkgl,bkld->bkgd", p, values).reshape(B, H, D).to(q.dtype)


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    acc = compute_dtype_for(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.to(acc))
    half = cos.shape[-1]
    c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]
    y1, y2 = y[..., :half], y[..., half:2 * half]
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s, y[..., 2 * half:]], dim=-1).to(x.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head zero-centred RMSNorm, then NeoX rotary on the first ``2 * cos.shape[-1]`` dims: see
    ``qwen35.ops.qk_norm_rope``."""
    return _norm_rope(q, q_weight, cos, sin, eps), _norm_rope(k, k_weight, cos, sin, eps)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` in fp32 (fp64 for fp64 inputs), contiguous, in x's dtype."""
    acc = compute_dtype_for(x)
    return (x.to(acc) * torch.sigmoid(gate.to(acc))).to(x.dtype).contiguous()
