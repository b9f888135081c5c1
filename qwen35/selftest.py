"""Tiny numerical self-tests: a candidate backend's op on its case from the op table, against the reference.

The probe runs a backend's op on the op's case (:mod:`qwen35.cases`) on the probed device and compares it,
by relative error, with the reference computed in fp64 on the CPU; the op's row in :mod:`qwen35.optable`
holds the tolerance per compute dtype.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from qwen35 import optable


def tolerance(op: str, dtype: torch.dtype) -> float:
    """The self-test's rel-err budget for ``op`` computed in ``dtype``."""
    return optable.get(op).tolerance[dtype]


def _flatten(result, kwargs: dict, mutated: list[str]) -> list[torch.Tensor]:
    outs = list(result) if isinstance(result, tuple) else [result]
    return [t for t in outs if isinstance(t, torch.Tensor)] + [kwargs[m] for m in mutated]


def _to_cpu64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double() if value.is_floating_point() else value.detach().cpu()
    return value


def relative_error(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    """The largest ``||out - ref|| / ||ref||`` over the outputs, each output (result or updated pool) on its own:
    pooled together, a large pool would hide a wrong small output.

    inf when a shape differs, any output is non-finite, or an integer output (ids) differs at all.
    """
    worst = 0.0
    for o, r in zip(outs, refs, strict=True):
        o = o.detach().cpu()
        if o.shape != r.shape:
            return math.inf
        if not o.is_floating_point():
            if not torch.equal(o.long(), r.long()):
                return math.inf
            continue
        o = o.double()
        if not torch.isfinite(o).all():
            return math.inf
        num = float((o - r.double()).pow(2).sum())
        den = float(r.double().pow(2).sum())
        worst = max(worst, math.sqrt(num / max(den, 1e-300)))
    return worst


def check(op: str, fn: Callable, device: torch.device, dtype: torch.dtype, seed: int = 0) -> float:
    """Run ``fn`` (a backend's ``op``) on the op's tiny case; return its rel err vs fp64 reference."""
    with _fp32_default():
        return _check(op, fn, device, dtype, seed)


@contextlib.contextmanager
def _fp32_default():
    """fp32 as torch's default dtype for the duration (the default a model's forward runs under): vLLM builds the
    model, and so runs the probe, under the model's dtype as the default, where a case's dtype-less draws (rotary
    angles) would be bf16 and fail the op's input checks, and a backend's dtype-less scratch would be bf16 too."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _check(op: str, fn: Callable, device: torch.device, dtype: torch.dtype, seed: int) -> float:
    row = optable.get(op)
    # The case's random draws (a CPU generator) and the fp64 reference run on the CPU whatever default device the
    # caller has set: vLLM's engine builds the model (and so runs the probe) under a CUDA default device.
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(seed)
        case = row.case(device, dtype, gen)
        ref_kwargs = {k: _to_cpu64(v) for k, v in case.kwargs.items()}
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs.items()}
    result = fn(**kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with torch.device("cpu"):
        ref_result = row.reference(**ref_kwargs)
    return relative_error(_flatten(result, kwargs, case.mutated), _flatten(ref_result, ref_kwargs, case.mutated))
