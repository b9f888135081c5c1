"""Backend registry: a small record per implementation of the op set.

A backend is a module that defines some or all of the ops of the op table (:mod:`qwen35.optable`), each as
a function with the op's name and the signature of its reference, and a function
``availability(caps) -> str | None`` that returns ``None`` when it can run on the probed device, else the
reason it cannot. Ops a backend does not define fall back to the next backend in the policy (see
:mod:`qwen35.probe`). Two optional module attributes:

- ``DTYPES``: the activation dtypes the backend computes in (absent: any); the probe passes over it for calls
  in other dtypes.
- ``prepare(device)``: work the backend needs before its first use on a device (``cuda_sm70``: its JIT build);
  the probe runs it once per device before the first self-test, and an exception rules the backend out there
  with a WARNING.
Backend modules are imported only when the probe considers them, so importing :mod:`qwen35` pulls in
nothing beyond torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from qwen35 import optable

OPS: tuple[str, ...] = optable.NAMES  # the op names, in the table's order


@dataclass(frozen=True)
class Backend:
    name: str
    module: str
    summary: str


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Add (or replace) a backend record."""
    _REGISTRY[backend.name] = backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def load(name: str) -> ModuleType:
    """Import a backend's module (ImportError propagates with its own message)."""
    return importlib.import_module(get(name).module)


def implementation(module: ModuleType, op: str) -> Callable | None:
    fn = getattr(module, op, None)
    return fn if callable(fn) else None


for _b in (
    Backend("reference", "qwen35.reference", "plain PyTorch, fp32 accumulation (fp64 for fp64 inputs)"),
    Backend("triton", "kernels_triton", "Triton kernels (NVIDIA sm70+, Iluvatar; CPU only under TRITON_INTERPRET=1)"),
    Backend("cuda_sm70", "kernels_cuda.sm70", "CUDA C++: fp16/fp32 (bf16 refused), JIT-built, SM70 features only"),
    Backend("ixformer", "kernels_cuda.ixformer", "Iluvatar CoreX ixformer adapter: the norms, fp16 only "
            "(contract-tested, not hardware-verified)"),
    Backend("flashqla", "kernels_cuda.flashqla", "FlashQLA GDN prefill (sm90/sm100, bf16/fp16, K = V = 128; extra "
            "[flashqla]) for the batches a measured crossover table gives it, triton for the rest"),
):
    register(_b)
