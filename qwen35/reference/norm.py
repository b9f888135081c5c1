"""RMSNorm references: the GDN output norm (plain weight, SiLU gate) and the zero-centred norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen35.reference.common import compute_dtype_for


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """norm(x) * weight * silu(z) over the last dim, in fp32; output in x's dtype."""
    dt = compute_dtype_for(x)
    xf = x.to(dt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(dt) * F.silu(z.to(dt))).to(x.dtype)


def rms_norm_zero_centered(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x̂ * (1 + weight); with ``residual`` the sum x + residual (in x's dtype) is normalised and also returned."""
    if residual is not None:
        x = x + residual
    dt = compute_dtype_for(x)
    xf = x.to(dt)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.to(dt))).to(x.dtype)
    return (y, x) if residual is not None else y
