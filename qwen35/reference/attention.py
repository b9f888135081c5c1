"""Reference decode attention over per-slot KV caches (the standalone host's layout)."""

from __future__ import annotations

import torch


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
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
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
