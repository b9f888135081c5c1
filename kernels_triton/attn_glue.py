"""The full-attention layer's elementwise work around the attention kernel, fused.

``qk_norm_rope``: every query and key head is normalised (zero-centred RMSNorm, its own weight for q and
for k) and its first ``2 * cos.shape[-1]`` dims rotated NeoX-style, in fp32, from strided q / k views of the
QKV projection straight into contiguous outputs: one launch instead of two copies, two norms and ~20
elementwise kernels of fp32 rotary math. ``sigmoid_gate_mul``: ``x * sigmoid(gate)`` in fp32 from strided
inputs, one pass instead of a strided sigmoid and a multiply.

One program handles one token and ``BH`` heads (a ``[BH, pow2(D)]`` tile). The rotation partner of
dim ``d`` (``d + half`` in the first half, ``d - half`` in the second) is loaded by a second, cached, gather
of the same row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher
from kernels_triton._util import pow2

MAX_HEADS_PER_PROGRAM = 16


@triton.jit
def _norm_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, t, hb, H, stride_t, stride_h, eps,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr):
    h = hb * BH + tl.arange(0, BH)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    mask = (h < H)[:, None] & dmask[None, :]
    row = x_ptr + t * stride_t + h.to(tl.int64)[:, None] * stride_h
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = 1.0 + tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    if HALF > 0:
        first = d < HALF
        rot = d < 2 * HALF
        partner = tl.where(first, d + HALF, tl.where(rot, d - HALF, d))
        xp = tl.load(row + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        wp = 1.0 + tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
        yp = xp * rstd[:, None] * wp[None, :]
        j = tl.where(first, d, d - HALF)
        c = tl.load(cos_ptr + t * HALF + j, mask=rot, other=1.0)
        s = tl.load(sin_ptr + t * HALF + j, mask=rot, other=0.0)
        s = tl.where(first, -s, s)  # first half: y c - y' s; second half: y c + y' s
        y = tl.where(rot[None, :], y * c[None, :] + yp * s[None, :], y)
    out = y_ptr + (t * H + h.to(tl.int64)[:, None]) * D + d[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, HQ, HK, q_st, q_sh, k_st,
                         k_sh, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    q_blocks = tl.cdiv(HQ, BH)
    if hb < q_blocks:
        _norm_rope_tile(q_ptr, qw_ptr, cos_ptr, sin_ptr, qo_ptr, t, hb, HQ, q_st, q_sh, eps, D, BLOCK_D, HALF, BH)
    else:
        _norm_rope_tile(k_ptr, kw_ptr, cos_ptr, sin_ptr, ko_ptr, t, hb - q_blocks, HK, k_st, k_sh, eps, D, BLOCK_D,
                        HALF, BH)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, y_ptr, H, x_st, x_sh, g_st, g_sh, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) * BH + tl.arange(0, BH)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (h < H)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + t * x_st + h[:, None] * x_sh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * g_st + h[:, None] * g_sh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x / (1.0 + tl.exp(-g))
    tl.store(y_ptr + (t * H + h[:, None]) * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


_launch_qk = DirectLauncher(_qk_norm_rope_kernel)
_launch_gate = DirectLauncher(_sigmoid_gate_kernel)


def _heads_per_program(H: int, block_d: int) -> int:
    return max(1, min(pow2(H), MAX_HEADS_PER_PROGRAM, 4096 // block_d))


def _warps(bh: int, block_d: int) -> int:
    return 4 if bh * block_d >= 2048 else 1


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`qwen35.ops.qk_norm_rope`."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    qo = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(T, HK, D, dtype=k.dtype, device=k.device)
    if T == 0:
        return qo, ko
    block_d = pow2(D)
    bh = _heads_per_program(max(HQ, HK), block_d)
    grid = (T, -(-HQ // bh) + -(-HK // bh))
    _launch_qk(grid, (q, k, q_weight, k_weight, cos, sin, qo, ko, HQ, HK, q.stride(0), q.stride(1), k.stride(0),
                      k.stride(1), float(eps), D, block_d, cos.shape[-1], bh),
               {"num_warps": _warps(bh, block_d)})
    return qo, ko


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.sigmoid_gate_mul`."""
    T, H, D = x.shape
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    block_d = pow2(D)
    bh = _heads_per_program(H, block_d)
    _launch_gate((T, -(-H // bh)), (x, gate, y, H, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), D,
                                    block_d, bh), {"num_warps": _warps(bh, block_d)})
    return y
