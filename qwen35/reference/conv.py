"""Depthwise causal conv1d reference (varlen prefill with per-slot history, and the one-token update)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen35.reference.common import compute_dtype_for


def _conv_window(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    """window: [D, W-1+L] inputs (history first); returns [L, D] in the window's dtype."""
    y = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0]  # [D, L], no padding
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(0, 1)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    conv_pool: torch.Tensor | None = None,
    conv_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Reference for :func:`qwen35.ops.causal_conv1d_prefill`."""
    T, D = x.shape
    W = weight.shape[1]
    dtype = compute_dtype_for(x)
    w = weight.to(dtype)
    bs = bias.to(dtype) if bias is not None else None
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    N = len(bounds) - 1
    slots = conv_slots.tolist() if conv_slots is not None else [-1] * N
    has_init = has_initial_state.tolist() if has_initial_state is not None else [True] * N
    y = torch.empty(T, D, dtype=dtype, device=x.device)
    for n in range(N):
        s, e = bounds[n], bounds[n + 1]
        hist = torch.zeros(D, W - 1, dtype=dtype, device=x.device)
        if conv_pool is not None and slots[n] >= 0 and has_init[n]:
            hist = conv_pool[slots[n]].to(dtype)
        window = torch.cat([hist, x[s:e].to(dtype).transpose(0, 1)], dim=1)  # [D, W-1+L]
        if e > s:
            y[s:e] = _conv_window(window, w, bs, activation)
        if conv_pool is not None and slots[n] >= 0 and W > 1:
            conv_pool[slots[n]] = window[:, -(W - 1):].to(conv_pool.dtype)
    return y.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_pool: torch.Tensor,
    conv_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Reference for :func:`qwen35.ops.causal_conv1d_update`: one token per row, pool updated in place."""
    B, D = x.shape
    W = weight.shape[1]
    dtype = compute_dtype_for(x)
    w = weight.to(dtype)
    bs = bias.to(dtype) if bias is not None else None
    y = torch.zeros(B, D, dtype=dtype, device=x.device)
    for n, slot in enumerate(conv_slots.tolist()):
        if slot < 0:  # padding row: pool untouched, output zero
            continue
        window = torch.cat([conv_pool[slot].to(dtype), x[n].to(dtype)[:, None]], dim=1)
        y[n] = _conv_window(window, w, bs, activation)[0]
        if W > 1:
            conv_pool[slot] = window[:, 1:].to(conv_pool.dtype)
    return y.to(x.dtype)
