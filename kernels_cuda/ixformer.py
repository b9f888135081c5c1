"""``ixformer`` backend: the façade ops that map onto Iluvatar CoreX's ixformer calls; the rest is left to the next
backend of the probe's Iluvatar policy (``cuda_sm70``).

Contract-tested against a stand-in built from the publicly seen signatures, not hardware-verified. The calls
used, all fp16 only:

- ``ixformer.rms_norm(input, weight, output=None, eps=1e-6)``
- ``ixformer.silu_and_mul(input, output=None)``: ``silu(input[..., :d]) * input[..., d:]``

Mapping (:data:`ROUTES`):

- ``rms_norm_zero_centered(x, w, eps)`` -> ``rms_norm(x, 1 + w)`` (the weight ``1 + w`` formed in fp32, rounded to
  fp16); with ``residual``: ``s = x + residual`` in fp16 (the façade's rounding), then ``rms_norm(s, 1 + w)``.
  ``fused_add_rms_norm(input, residual, weight, eps, scale)`` is not used: its in-place semantics and its
  ``scale`` argument are not publicly documented.
- ``rms_norm_gated(x, z, w, eps)`` -> ``silu_and_mul(cat([z, rms_norm(x, w)], -1))``.

:data:`DTYPES` is fp16 alone, so the probe passes over this backend for other dtypes and takes ``cuda_sm70``; a
direct call with inputs that are not fp16 goes to ``cuda_sm70``'s implementation of the same op. The other publicly
seen calls (``matmul``, ``softmax``, ``flash_attn_func``, ``gemv``, ``fused_add_rms_norm``) cover no other façade op
whole: the API has no MoE, top-k, GDN or conv op, and ``flash_attn_func`` takes dense batches, not per-slot KV
caches with per-row lengths. Those ops are not defined here, so the probe takes them from ``cuda_sm70``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

ROUTES: dict[str, tuple[str, ...]] = {
    "rms_norm_zero_centered": ("rms_norm",),
    "rms_norm_gated": ("rms_norm", "silu_and_mul"),
}
DTYPES = (torch.float16,)  # activation dtypes the adapter computes in (ixformer's calls are fp16 only)
NEEDED = tuple(sorted({f for calls in ROUTES.values() for f in calls}))
_SUBMODULES = ("ixformer.inference.functions", "ixformer.functions", "ixformer")

_module: ModuleType | None = None  # the resolved ixformer functions module (tests set a stand-in here)


def functions() -> ModuleType:
    """The module holding ixformer's functions (the first of :data:`_SUBMODULES` that has them all)."""
    global _module
    if _module is None:
        for name in _SUBMODULES:
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - try the next location
                continue
            if all(hasattr(mod, f) for f in NEEDED):
                _module = mod
                break
        else:
            raise ImportError(f"no ixformer module with {', '.join(NEEDED)} (looked in {', '.join(_SUBMODULES)})")
    return _module


def availability(caps) -> str | None:  # noqa: ANN001 - qwen35.probe.DeviceCaps
    if caps.vendor != "iluvatar":
        return "ixformer is Iluvatar CoreX only"
    if caps.ixformer_version is None:
        return "ixformer does not import"
    try:
        functions()
    except ImportError as e:
        return str(e)
    return None


def _fallback():  # noqa: ANN202
    from kernels_cuda import sm70

    return sm70


def _rms_norm(x: torch.Tensor, weight16: torch.Tensor, eps: float) -> torch.Tensor:
    """ixformer.rms_norm over the last dim of ``x`` (fp16), into a new tensor of x's shape."""
    ix = functions()
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = torch.empty_like(x2)
    if x2.shape[0]:
        ix.rms_norm(x2, weight16, output=y, eps=float(eps))
    return y.view(x.shape)


def rms_norm_zero_centered(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`qwen35.ops.rms_norm_zero_centered` through ``ixformer.rms_norm`` with the weight ``1 + w``."""
    if x.dtype != torch.float16:
        return _fallback().rms_norm_zero_centered(x, weight, eps, residual)
    s = x + residual if residual is not None else x
    y = _rms_norm(s, (1.0 + weight.float()).half(), eps)
    return (y, s) if residual is not None else y


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """:func:`qwen35.ops.rms_norm_gated` as ``silu_and_mul([z | rms_norm(x, w)])``."""
    if x.dtype != torch.float16:
        return _fallback().rms_norm_gated(x, z, weight, eps)
    normed = _rms_norm(x, weight.half(), eps)
    n = x.shape[-1]
    both = torch.cat([z.half().reshape(-1, n), normed.reshape(-1, n)], dim=-1)
    y = torch.empty(both.shape[0], n, dtype=torch.float16, device=x.device)
    if both.shape[0]:
        functions().silu_and_mul(both, output=y)
    return y.view(x.shape)
