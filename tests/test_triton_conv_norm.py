"""Triton causal conv1d (varlen prefill with conv pool, decode update) and RMSNorms vs the fp64 reference,
on CPU under TRITON_INTERPRET=1, plus the façade forced to ``triton``."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (also done by conftest)

import pytest
import torch
from helpers import assert_close, cu_from_lens

import kernels_triton as kt
from qwen35 import ops
from qwen35 import reference as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 1e-3}


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEV, dtype=dtype)


def _cpu64(t):
    return None if t is None else (t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu())


# ----------------------------------------------------------------------------- conv1d


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("W,bias,activation", [(4, True, "silu"), (2, False, None), (1, True, "silu")])
def test_conv_prefill_varlen_pool(W, bias, activation, dtype):
    gen = torch.Generator().manual_seed(W)
    lens, D = [3, 0, 1, 9, 40, 2], 48
    N, T = len(lens), sum(lens)
    x = _rand(gen, T, D, dtype=dtype)
    w = _rand(gen, D, W, dtype=dtype, scale=0.5)
    b = _rand(gen, D, dtype=dtype) if bias else None
    cu = cu_from_lens(lens, DEV)
    pool = _rand(gen, N + 2, D, W - 1, dtype=dtype)
    slots = torch.tensor([1, 6, -1, 0, 3, 4], dtype=torch.int32, device=DEV)
    has_init = torch.tensor([True, True, True, False, True, True], device=DEV)
    ours_pool, ref_pool = pool.clone(), _cpu64(pool)
    y = kt.causal_conv1d_prefill(x, w, b, cu_seqlens=cu, conv_pool=ours_pool, conv_slots=slots,
                                 has_initial_state=has_init, activation=activation)
    ry = ref.causal_conv1d_prefill(_cpu64(x), _cpu64(w), _cpu64(b), cu_seqlens=cu.cpu(), conv_pool=ref_pool,
                                   conv_slots=slots.cpu(), has_initial_state=has_init.cpu(), activation=activation)
    assert y.dtype == dtype
    assert_close(y, ry, TOL[dtype], "conv output")
    if W > 1:
        assert_close(ours_pool, ref_pool, TOL[dtype], "conv pool")
    for s in (2, 5):
        assert torch.equal(ours_pool[s], pool[s]), f"slot {s} was not named but changed"


def test_conv_prefill_without_pool_and_single_sequence():
    gen = torch.Generator().manual_seed(7)
    x, w = _rand(gen, 37, 40), _rand(gen, 40, 4, scale=0.5)
    for cu in (None, cu_from_lens([10, 27], DEV)):
        y = kt.causal_conv1d_prefill(x, w, None, cu_seqlens=cu)
        ry = ref.causal_conv1d_prefill(_cpu64(x), _cpu64(w), None, cu_seqlens=None if cu is None else cu.cpu())
        assert_close(y, ry, TOL[torch.float32], "conv output")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_update_pool(dtype):
    gen = torch.Generator().manual_seed(11)
    B, D, W = 4, 40, 4
    x, w, b = _rand(gen, B, D, dtype=dtype), _rand(gen, D, W, dtype=dtype, scale=0.5), _rand(gen, D, dtype=dtype)
    pool = _rand(gen, 6, D, W - 1, dtype=dtype)
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=DEV)
    ours_pool, ref_pool = pool.clone(), _cpu64(pool)
    y = kt.causal_conv1d_update(x, w, b, conv_pool=ours_pool, conv_slots=slots)
    ry = ref.causal_conv1d_update(_cpu64(x), _cpu64(w), _cpu64(b), conv_pool=ref_pool, conv_slots=slots.cpu())
    assert_close(y, ry, TOL[dtype], "conv update output")
    assert_close(ours_pool, ref_pool, TOL[dtype], "conv pool")
    assert torch.all(y[1] == 0)
    for s in (1, 2, 4):
        assert torch.equal(ours_pool[s], pool[s]), f"slot {s} was not named but changed"


def test_conv_rejects_wide_window():
    with pytest.raises(ValueError, match="W <= 8"):
        kt.causal_conv1d_prefill(torch.zeros(2, 4, device=DEV), torch.zeros(4, 9, device=DEV))


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 4, 64), (5, 100), (3, 9000)])
def test_rms_norm_gated(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    x, z = _rand(gen, *shape, dtype=dtype), _rand(gen, *shape, dtype=dtype)
    w = _rand(gen, shape[-1], dtype=torch.float32)
    y = kt.rms_norm_gated(x, z, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, ref.rms_norm_gated(_cpu64(x), _cpu64(z), _cpu64(w), 1e-6), TOL[dtype], "gated norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(9, 96), (2, 3, 130), (2, 10000)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_zero_centered(shape, residual, dtype):
    gen = torch.Generator().manual_seed(2)
    x = _rand(gen, *shape, dtype=dtype)
    w = _rand(gen, shape[-1], dtype=dtype, scale=0.1)
    r = _rand(gen, *shape, dtype=dtype) if residual else None
    out = kt.rms_norm_zero_centered(x, w, 1e-6, r)
    # The reference adds in x's dtype (the rounding is part of the contract): feed it the rounded sum.
    s_ref = (x + r) if residual else x
    ry = ref.rms_norm_zero_centered(_cpu64(s_ref), _cpu64(w), 1e-6)
    if residual:
        y, s = out
        assert torch.equal(s, x + r), "the returned residual must be x + residual in x's dtype"
    else:
        y = out
    assert y.dtype == dtype
    assert_close(y, ry, TOL[dtype], "zero-centred norm")


# ----------------------------------------------------------------------------- façade


def test_facade_forced_triton_conv_and_norms(fresh_probe, monkeypatch):
    monkeypatch.setenv("QWEN35_BACKEND", "triton")
    fresh_probe.reset()
    for op in ("causal_conv1d_prefill", "causal_conv1d_update", "rms_norm_gated", "rms_norm_zero_centered"):
        choice = fresh_probe.choose(op, DEV)
        assert choice.backend == "triton", choice.reason
        assert choice.selftest_rel_err is not None and choice.selftest_rel_err < 1e-5, choice.reason
    gen = torch.Generator().manual_seed(3)
    x, w = _rand(gen, 12, 32), _rand(gen, 32, 4, scale=0.5)
    cu = cu_from_lens([5, 7], DEV)
    y = ops.causal_conv1d_prefill(x, w, cu_seqlens=cu)
    assert_close(y, ref.causal_conv1d_prefill(_cpu64(x), _cpu64(w), cu_seqlens=cu.cpu()), 1e-6, "façade conv")
    nw = _rand(gen, 32)
    assert_close(ops.rms_norm_zero_centered(x, nw), ref.rms_norm_zero_centered(_cpu64(x), _cpu64(nw)), 1e-6,
                 "façade norm")
