"""kernels_cuda.sm70's host side on the CPU: availability per device, the dtype policy (bf16 refused by name, side
inputs converted), the gating layout handed to the kernels, the prefill's windows; the module's op set against the
façade's signatures. The kernels themselves run in tests/gpu/test_gpu_cuda_sm70.py."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from kernels_cuda import sm70
from qwen35 import backends, probe
from qwen35 import reference as ref

OPS = ("gdn_chunk_prefill", "gdn_recurrent_step", "causal_conv1d_prefill", "causal_conv1d_update", "rms_norm_gated",
       "rms_norm_zero_centered", "moe_route", "moe_experts", "moe_block")


def test_op_set_and_signatures_match_the_reference():
    mod = backends.load("cuda_sm70")
    defined = {op for op in backends.OPS if backends.implementation(mod, op) is not None}
    assert defined == set(OPS)
    for op in OPS:
        assert inspect.signature(getattr(sm70, op)) == inspect.signature(getattr(ref, op)), op


CAPS = probe.DeviceCaps(device="cuda:0", vendor="nvidia", name="Tesla V100", capability=(7, 0), nvcc="/x/nvcc",
                        ninja="/x/ninja")


def test_availability():
    """Device facts only: the toolchain is the build's business (a missing nvcc or ninja is a failed build, which
    the probe reports with a WARNING: tests/test_probe.py)."""
    assert sm70.availability(CAPS) is None
    assert sm70.availability(replace(CAPS, capability=(9, 0))) is None  # forced on newer GPUs (PTX of SM70 code)
    assert "CUDA device" in sm70.availability(probe.DeviceCaps(device="cpu", vendor="cpu", name="x"))
    assert "compute capability 6.1 < 7.0" in sm70.availability(replace(CAPS, capability=(6, 1)))
    assert sm70.availability(replace(CAPS, nvcc=None, ninja=None)) is None
    assert sm70.availability(replace(CAPS, vendor="iluvatar", nvcc=None, corex_clang="/usr/local/corex/bin/clang++")) \
        is None


def test_prepare_without_a_compiler_is_a_build_error(monkeypatch, tmp_path):
    """prepare() (what the probe calls before a self-test) looks for the compiler before it needs a CUDA runtime:
    on this CPU host a missing compiler is a CudaBuildError naming it, not a CUDA initialisation error."""
    from kernels_cuda import build

    missing = str(tmp_path / "no" / "nvcc")
    monkeypatch.setenv("QWEN35_CUDA_COMPILER", missing)
    with pytest.raises(build.CudaBuildError, match=f"{missing}.*does not exist"):
        sm70.prepare(torch.device("cuda", 0))


def test_dtypes_declare_fp16_and_fp32():
    assert sm70.DTYPES == (torch.float16, torch.float32)
    assert torch.bfloat16 not in sm70.DTYPES


@pytest.mark.parametrize("call", [
    lambda x: sm70.rms_norm_zero_centered(x, torch.zeros(8)),
    lambda x: sm70.rms_norm_gated(x, x, torch.ones(8)),
    lambda x: sm70.causal_conv1d_update(x, torch.ones(8, 4), conv_pool=torch.zeros(1, 8, 3, dtype=x.dtype),
                                        conv_slots=torch.zeros(4, dtype=torch.int32)),
    lambda x: sm70.moe_experts(x, torch.zeros(2, 16, 8, dtype=x.dtype), torch.zeros(2, 8, 8, dtype=x.dtype),
                               torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int32)),
    lambda x: sm70.moe_block(x, torch.zeros(2, 8), torch.zeros(2, 16, 8, dtype=x.dtype),
                             torch.zeros(2, 8, 8, dtype=x.dtype), 1),
])
def test_bf16_is_refused_naming_the_backend(call):
    with pytest.raises(ValueError, match=r"cuda_sm70 computes in float16 or float32.*bfloat16.*dtype=float16"):
        call(torch.zeros(4, 8, dtype=torch.bfloat16))


def test_gdn_bf16_refused_and_cpu_tensors_named():
    q = torch.zeros(5, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cuda_sm70 computes in float16 or float32"):
        sm70.gdn_chunk_prefill(q, q, q, g=torch.zeros(5, 1), beta=torch.zeros(5, 1))
    with pytest.raises(ValueError, match="cuda_sm70 runs on CUDA tensors; got a tensor on cpu"):
        sm70.rms_norm_zero_centered(torch.zeros(2, 8), torch.zeros(8))


def test_side_inputs_become_fp16_or_fp32():
    assert sm70._side(None) is None
    h = torch.zeros(3, dtype=torch.float16)
    assert sm70._side(h) is h
    assert sm70._side(torch.zeros(3, dtype=torch.bfloat16)).dtype == torch.float32
    assert sm70._side(torch.zeros(3, dtype=torch.float64)).dtype == torch.float32


def test_gating_rows_keep_views_and_share_one_stride():
    T, HV = 6, 4
    ba = torch.randn(T, 2 * HV, dtype=torch.float16)  # the model's b | a projection columns
    b, a = ba[:, :HV], ba[:, HV:]
    g, beta, a2, b2, stride = sm70._gate_rows(None, None, a, b)
    assert g is None and beta is None and stride == 2 * HV
    assert a2.data_ptr() == a.data_ptr() and b2.data_ptr() == b.data_ptr()
    # mixed dtypes: both fp32, contiguous
    _, _, a3, b3, stride = sm70._gate_rows(None, None, a, b.float())
    assert a3.dtype == b3.dtype == torch.float32 and stride == HV and a3.is_contiguous()
    # precomputed: g fp32 (fp64 converted), beta of another layout -> both contiguous
    gg = torch.randn(T, 2 * HV, dtype=torch.float64)[:, :HV]
    g4, beta4, _, _, stride = sm70._gate_rows(gg, torch.rand(T, HV, dtype=torch.bfloat16), None, None)
    assert g4.dtype == torch.float32 and beta4.dtype == torch.float32 and stride == HV
    assert torch.equal(g4, gg.float())
    # decode rows [B, T, HV]
    gd = torch.randn(3, 2, HV)
    *_, stride = sm70._gate_rows(gd, torch.rand(3, 2, HV), None, None)
    assert stride == HV


def test_windows_cover_every_chunk_row_once():
    assert sm70._windows(0, 5) == [(0, 0)]
    assert sm70._windows(5, 5) == [(0, 5)]
    assert sm70._windows(11, 4) == [(0, 4), (4, 8), (8, 11)]
    rows = [r for lo, hi in sm70._windows(1000, 37) for r in range(lo, hi)]
    assert rows == list(range(1000))


def test_head_dims_over_128_are_refused():
    with pytest.raises(ValueError, match="K, V <= 128; got K=256"):
        sm70._head_dims(256, 128)
