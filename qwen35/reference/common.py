"""What the reference ops share: the dtype they compute in."""

from __future__ import annotations

import torch


def compute_dtype_for(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the reference never accumulates in less."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
