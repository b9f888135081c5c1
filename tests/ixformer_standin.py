"""STAND-IN for Iluvatar CoreX's ``ixformer`` (not the real library): the seven publicly seen function signatures,
fp16 only, computed with plain torch, for the contract tests of :mod:`kernels_cuda.ixformer` on machines without
CoreX. It records every call in :data:`calls` so the tests can check which functions the adapter uses and how.
What the real functions compute beyond their names and signatures is an assumption of this stand-in: RMSNorm over
the last dim with fp32 statistics, ``silu_and_mul`` gating the first half by the second, as in vLLM's kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IS_STANDIN = True
calls: list[tuple[str, tuple[str, ...]]] = []  # (function, names of the keyword arguments given)


def _record(name: str, **kw) -> None:
    calls.append((name, tuple(sorted(k for k, v in kw.items() if v is not None))))


def _fp16(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float16:
            raise TypeError(f"ixformer stand-in {name}: float16 only, got {t.dtype}")


def _into(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    if out is None:
        return y
    if out.shape != y.shape or out.dtype != y.dtype:
        raise ValueError(f"output is {tuple(out.shape)} {out.dtype}; expected {tuple(y.shape)} {y.dtype}")
    return out.copy_(y)


def rms_norm(input, weight, output=None, eps=1e-6):  # noqa: A002, ANN001, ANN201
    _record("rms_norm", output=output, eps=eps)
    _fp16("rms_norm", input, weight)
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return _into(output, y.half())


def fused_add_rms_norm(input, residual, weight, eps, scale):  # noqa: A002, ANN001, ANN201
    _record("fused_add_rms_norm")
    _fp16("fused_add_rms_norm", input, residual, weight)
    residual.add_(input)
    input.copy_(rms_norm(residual, weight, eps=eps) * scale)


def silu_and_mul(input, output=None):  # noqa: A002, ANN001, ANN201
    _record("silu_and_mul", output=output)
    _fp16("silu_and_mul", input)
    d = input.shape[-1] // 2
    x = input.float()
    return _into(output, (F.silu(x[..., :d]) * x[..., d:]).half())


def matmul(input, other, out=None, transa=False, transb=False, alpha=1.0, beta=0.0):  # noqa: A002, ANN001, ANN201
    _record("matmul", out=out)
    _fp16("matmul", input, other)
    a = input.float().transpose(-1, -2) if transa else input.float()
    b = other.float().transpose(-1, -2) if transb else other.float()
    y = alpha * (a @ b)
    if out is not None and beta:
        y = y + beta * out.float()
    return _into(out, y.half())


def softmax(input, dim):  # noqa: A002, ANN001, ANN201
    _record("softmax")
    _fp16("softmax", input)
    return torch.softmax(input.float(), dim).half()


def flash_attn_func(q, k, v, dropout_p, softmax_scale, causal):  # noqa: ANN001, ANN201
    _record("flash_attn_func")
    _fp16("flash_attn_func", q, k, v)
    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, L, H, D] -> [B, H, L, D]
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale).transpose(1, 2).half()


def gemv(x, A):  # noqa: ANN001, ANN201
    _record("gemv")
    _fp16("gemv", x, A)
    return (A.float() @ x.float()).half()
