"""RMSNorms over the last dim: the GDN output norm ``norm(x) * w * silu(z)`` and the zero-centred
``norm(x) * (1 + w)`` with an optional fused residual add (``s = x + residual`` rounded to x's
dtype, normalised, and returned as the next residual).

One program normalises ``BM`` rows; rows up to ``ONE_PASS_MAX`` wide are held in registers,
wider ones take two passes over column blocks (sum of squares, then scale).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher
from kernels_triton._util import pow2

ONE_PASS_MAX = 8192



@triton.jit
def _load_input(x_ptr, res_ptr, s_ptr, offs, mask, RESIDUAL: tl.constexpr):
    """x (or x + residual, rounded to x's dtype and stored as the next residual) as fp32."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _scale_store(x, rstd, z_ptr, w_ptr, y_ptr, offs, c, mask, N, GATED: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    y = x * rstd[:, None] * w[None, :]
    if GATED:
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, z_ptr, res_ptr, w_ptr, y_ptr, s_ptr, M, N, eps,
    BM: tl.constexpr, BN: tl.constexpr, ONE_PASS: tl.constexpr,
    GATED: tl.constexpr, ZERO_CENTERED: tl.constexpr, RESIDUAL: tl.constexpr,
):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = r < M
    base = r.to(tl.int64)[:, None] * N
    if ONE_PASS:
        c = tl.arange(0, BN)
        mask = rmask[:, None] & (c < N)[None, :]
        x = _load_input(x_ptr, res_ptr, s_ptr, base + c[None, :], mask, RESIDUAL)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        _scale_store(x, rstd, z_ptr, w_ptr, y_ptr, base + c[None, :], c, mask, N, GATED, ZERO_CENTERED)
    else:
        sumsq = tl.zeros((BM,), dtype=tl.float32)
        for c0 in range(0, N, BN):
            c = c0 + tl.arange(0, BN)
            mask = rmask[:, None] & (c < N)[None, :]
            x = _load_input(x_ptr, res_ptr, s_ptr, base + c[None, :], mask, RESIDUAL)
            sumsq += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(sumsq / N + eps)
        src = s_ptr if RESIDUAL else x_ptr  # second pass reads the (rounded) sum back
        for c0 in range(0, N, BN):
            c = c0 + tl.arange(0, BN)
            mask = rmask[:, None] & (c < N)[None, :]
            x = tl.load(src + base + c[None, :], mask=mask, other=0.0).to(tl.float32)
            _scale_store(x, rstd, z_ptr, w_ptr, y_ptr, base + c[None, :], c, mask, N, GATED, ZERO_CENTERED)


_launch_norm = DirectLauncher(_rms_norm_kernel)
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1024)
def _plan(N: int) -> tuple[int, int, bool, dict]:
    """(BM rows per program, BN, one pass?, launch options) for rows of N: computed once per width."""
    one_pass = N <= ONE_PASS_MAX
    BN = pow2(N) if one_pass else 2048
    BM = max(1, min(64, 4096 // BN)) if one_pass else 1
    return BM, BN, one_pass, {"num_warps": 8 if BN * BM >= 4096 else 4}


def _launch(x, z, residual, weight, eps, gated: bool, zero_centered: bool):
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"triton norms take fp16, bf16 or fp32 activations, got {x.dtype}")
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else None
    if M == 0 or N == 0:
        if s is not None:
            s.copy_(x + residual)
        return y, s
    BM, BN, one_pass, options = _plan(N)
    _launch_norm((-(-M // BM),), (
        x, z, residual, weight, y, s, M, N, float(eps),
        BM, BN, one_pass, gated, zero_centered, residual is not None), options)
    return y, s


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.rms_norm_gated`."""
    return _launch(x, z, None, weight, eps, gated=True, zero_centered=False)[0]


def rms_norm_zero_centered(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`qwen35.ops.rms_norm_zero_centered`."""
    y, s = _launch(x, None, residual, weight, eps, gated=False, zero_centered=True)
    return (y, s) if residual is not None else y
