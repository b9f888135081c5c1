"""Contract tests of the ``ixformer`` adapter (kernels_cuda.ixformer) against a STAND-IN built from ixformer's
publicly seen signatures (tests/ixformer_standin.py): which façade ops it routes, through which calls with which
arguments, and the results vs the fp64 reference. Contract-tested, not hardware-verified."""

from __future__ import annotations

from dataclasses import dataclass

import ixformer_standin as standin
import pytest
import torch
from helpers import assert_close

from kernels_cuda import ixformer as adapter
from qwen35 import backends
from qwen35 import reference as ref

TOL16 = 2e-3


@pytest.fixture
def ix(monkeypatch):
    monkeypatch.setattr(adapter, "_module", standin)
    standin.calls.clear()
    yield standin
    standin.calls.clear()


def _r(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_routed_ops_are_exactly_the_mapped_ones():
    mod = backends.load("ixformer")
    defined = {op for op in backends.OPS if backends.implementation(mod, op) is not None}
    assert defined == set(adapter.ROUTES) == {"rms_norm_zero_centered", "rms_norm_gated"}
    assert set(adapter.NEEDED) <= {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "matmul", "softmax",
                                   "flash_attn_func", "gemv"}


@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 2048), (0, 64)])
def test_zero_centred_norm_is_rms_norm_with_one_plus_w(ix, shape):
    x, w = _r(*shape).half(), _r(shape[-1], seed=1, scale=0.1).half()
    y = adapter.rms_norm_zero_centered(x, w, 1e-6)
    assert y.dtype == torch.float16 and y.shape == x.shape
    assert_close(y, ref.rms_norm_zero_centered(x.double(), w.double(), 1e-6), TOL16, "zero-centred norm")
    if x.numel():
        assert ix.calls == [("rms_norm", ("eps", "output"))]


def test_zero_centred_norm_with_residual(ix):
    x, r, w = _r(9, 256).half(), _r(9, 256, seed=2).half(), _r(256, seed=1, scale=0.1).half()
    y, s = adapter.rms_norm_zero_centered(x, w, 1e-6, residual=r)
    ry, rs = ref.rms_norm_zero_centered(x, w, 1e-6, residual=r)
    assert torch.equal(s, rs), "the carried residual is x + residual rounded to fp16, as the reference"
    assert_close(y, ref.rms_norm_zero_centered(rs.double(), w.double(), 1e-6), TOL16, "norm of the sum")
    assert [c[0] for c in ix.calls] == ["rms_norm"]


@pytest.mark.parametrize("shape", [(11, 4, 128), (5, 64)])
def test_gated_norm_is_rms_norm_then_silu_and_mul(ix, shape):
    x, z, w = _r(*shape).half(), _r(*shape, seed=3).half(), _r(shape[-1], seed=4).half()
    y = adapter.rms_norm_gated(x, z, w, 1e-6)
    assert y.shape == x.shape and y.dtype == torch.float16
    assert_close(y, ref.rms_norm_gated(x.double(), z.double(), w.double(), 1e-6), TOL16, "gated norm")
    assert ix.calls == [("rms_norm", ("eps", "output")), ("silu_and_mul", ("output",))]


def test_stand_in_refuses_what_the_real_library_does_not_take(ix):
    with pytest.raises(TypeError, match="float16 only"):
        standin.rms_norm(_r(3, 8), _r(8))


def test_non_fp16_goes_to_cuda_sm70(ix):
    """fp32 is not ixformer's: the adapter hands it to cuda_sm70's kernels (which, on this CPU, refuse a CPU
    tensor), and never calls the library."""
    with pytest.raises(ValueError, match="cuda_sm70 runs on CUDA tensors"):
        adapter.rms_norm_zero_centered(_r(3, 64), _r(64))
    with pytest.raises(ValueError, match="cuda_sm70 runs on CUDA tensors"):
        adapter.rms_norm_gated(_r(3, 64), _r(3, 64), _r(64))
    assert ix.calls == []


@dataclass(frozen=True)
class _Caps:
    vendor: str
    ixformer_version: str | None = None


def test_availability(ix):
    assert "Iluvatar" in adapter.availability(_Caps("nvidia"))
    assert "does not import" in adapter.availability(_Caps("iluvatar"))
    assert adapter.availability(_Caps("iluvatar", "0.0-standin")) is None


def test_missing_functions_are_named(monkeypatch):
    monkeypatch.setattr(adapter, "_module", None)
    monkeypatch.setattr(adapter, "_SUBMODULES", ("qwen35_no_such_ixformer",))
    assert "rms_norm" in adapter.availability(_Caps("iluvatar", "1.0"))
