"""``cuda_sm70`` backend: CUDA C++ kernels restricted to SM70 features (fp16 + fp32 accumulate).

No op is implemented yet, so the probe passes over this backend with the reason below.
"""

from __future__ import annotations


def availability(caps) -> str | None:  # noqa: ANN001 - qwen35.probe.DeviceCaps
    if caps.vendor == "cpu":
        return "needs a CUDA device"
    if caps.nvcc is None and caps.corex_clang is None:
        return "no CUDA toolchain (nvcc or CoreX clang) for the JIT build"
    if caps.ninja is None:
        return "ninja not found (needed for the JIT build)"
    return None
