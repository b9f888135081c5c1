"""Pieces the chunked prefill and the decode step share: head-dim limits, the gating inputs' row layout, the
launch grid over (sequence, head) pairs, and the Triton helpers for gating and masked tiles."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._util import cdiv

MAX_HEAD_DIM = 256  # K and V beyond this would not fit the per-program tiles
MAX_GRID_Y = 65535  # CUDA's limit on grid dimensions y and z


def check_head_dims(K: int, V: int) -> None:
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"triton GDN kernels take head dims K, V <= {MAX_HEAD_DIM}; got K={K}, V={V}")


def grid_rows(rows: int) -> tuple[int, int]:
    """(y, z) grid sizes covering ``rows`` programs, y <= MAX_GRID_Y; the kernel's row is
    ``program_id(1) + program_id(2) * num_programs(1)`` and rows past the end return at once."""
    z = cdiv(rows, MAX_GRID_Y)
    return cdiv(rows, z), z


def gate_rows(g: torch.Tensor | None, beta: torch.Tensor | None, a: torch.Tensor | None,
              b: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``(g, beta, a, b, row stride)``: the given gating pair (a, b, else g, beta), ``[..., HV]``, as rows of HV
    values a common stride apart. Views into a wider projection output (the model's b | a columns) keep their
    memory; a pair whose rows cannot be addressed that way is copied."""
    x, y = (a, b) if a is not None else (g, beta)
    HV = x.shape[-1]
    if x.is_contiguous() and y.is_contiguous():  # the common case first: host time matters at short prompts
        stride = HV
    else:
        try:
            xs, ys = x.view(-1, HV), y.view(-1, HV)
        except RuntimeError:  # leading dims not flattenable without a copy
            xs = ys = None
        if (xs is not None and xs.stride(0) == ys.stride(0) and (HV <= 1 or xs.stride(1) == ys.stride(1) == 1)
                and xs.shape[0] > 0):
            stride = xs.stride(0)
        else:
            x, y, stride = x.contiguous(), y.contiguous(), HV
    return (g, beta, x, y, stride) if a is not None else (x, y, a, b, stride)


@triton.jit
def gating(t, tmask, hv, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, gate_stride,
            RAW_GATING: tl.constexpr):
    """(g, beta) fp32 for token rows ``t`` of value head ``hv``; zero on masked rows. The gating inputs (a, b or
    g, beta) have rows ``gate_stride`` apart (see :func:`gate_rows`)."""
    if RAW_GATING:
        x = tl.load(a_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
        x = x + tl.load(dt_bias_ptr + hv).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
        g = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32)) * softplus
        braw = tl.load(b_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-braw))
    else:
        g = tl.load(g_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
    return tl.where(tmask, g, 0.0), tl.where(tmask, beta, 0.0)


@triton.jit
def tile_mask(rmask, cols, D: tl.constexpr, EVEN: tl.constexpr):
    """Row mask, and the column mask only when the tile overhangs: a mask that is constant along the
    columns keeps loads and stores vectorised (and their address registers few)."""
    if EVEN:
        return rmask[:, None]
    else:
        return rmask[:, None] & (cols[None, :] < D)


@triton.jit
def load_tile(base, row_stride, rmask, c0, D: tl.constexpr, BD: tl.constexpr):
    """Columns ``c0 .. c0 + BD`` (of ``D``) of the rows at ``base + r * row_stride``, 0 outside ``rmask``.

    The row offset is a scalar in ``base``; per-element offsets stay small 32-bit numbers, which keeps
    address registers few (64-bit per-element offsets cost ~30 registers per tile here)."""
    rows = tl.arange(0, rmask.shape[0])
    cols = c0 + tl.arange(0, BD)
    return tl.load(base + rows[:, None] * row_stride + cols[None, :], mask=tile_mask(rmask, cols, D, D % BD == 0),
                   other=0.0)


@triton.jit
def store_tile(base, row_stride, rmask, c0, D: tl.constexpr, BD: tl.constexpr, x):
    """Store ``x`` ``[rows, BD]`` at columns ``c0 ..`` of the rows at ``base + r * row_stride`` (see load_tile)."""
    rows = tl.arange(0, rmask.shape[0])
    cols = c0 + tl.arange(0, BD)
    tl.store(base + rows[:, None] * row_stride + cols[None, :], x.to(base.dtype.element_ty),
             mask=tile_mask(rmask, cols, D, D % BD == 0))

