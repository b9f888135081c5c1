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


def _varlen_pool_case(gen, lens: list[int], D: int, W: int, dtype, bias: bool = True):
    """x, w, b, cu, pool, slots, has_init for sequences of ``lens`` (slot -1 on the third: padding; the fourth
    starts without history; pool slots 2 and 5 named by nobody)."""
    T = sum(lens)
    x, w = _rand(gen, T, D, dtype=dtype), _rand(gen, D, W, dtype=dtype, scale=0.5)
    b = _rand(gen, D, dtype=dtype) if bias else None
    pool = _rand(gen, len(lens) + 2, D, W - 1, dtype=dtype)
    slots = torch.tensor([1, 6, -1, 0, 3, 4], dtype=torch.int32, device=DEV)
    has_init = torch.tensor([True, True, True, False, True, True], device=DEV)
    return x, w, b, cu_from_lens(lens, DEV), pool, slots, has_init


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("W,bias,activation", [(4, True, "silu"), (2, False, None), (1, True, "silu")])
def test_conv_prefill_varlen_pool(W, bias, activation, dtype):
    gen = torch.Generator().manual_seed(W)
    x, w, b, cu, pool, slots, has_init = _varlen_pool_case(gen, [3, 0, 1, 9, 40, 2], 48, W, dtype, bias)
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


# ----------------------------------------------------------------------------- conv1d, plane layout


def _planes_ref(op, x, widths, T, w, b, pool, **kw):
    """The reference on each plane of a flat plane-layout buffer, with that plane's channels of w, b and pool."""
    outs, at, ch = [], 0, 0
    for n in (n for n in widths if n):  # an empty plane holds nothing (and the reference takes no 0 channels)
        plane = _cpu64(x.reshape(-1)[at:at + T * n].view(T, n))
        outs.append(op(plane, _cpu64(w)[ch:ch + n], None if b is None else _cpu64(b)[ch:ch + n],
                       conv_pool=pool[:, ch:ch + n], **kw).reshape(-1))
        at, ch = at + T * n, ch + n
    return torch.cat(outs)


PLANE_CASES = [((24, 24, 40), 4), ((130, 20, 60), 4), ((16, 0, 48), 3), ((40, 24), 2), ((56,), 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("widths,W", PLANE_CASES)
def test_conv_prefill_planes(widths, W, dtype):
    """One launch over q | k | v planes equals the reference run plane by plane (varlen, lengths 0 and 1,
    padding slot, sequences with and without history, channel blocks that do not divide the planes)."""
    gen = torch.Generator().manual_seed(sum(widths) + W)
    lens = [3, 0, 1, 9, 21, 2]
    T = sum(lens)
    # x's memory is read as planes [T, widths[p]] back to back
    x, w, b, cu, pool, slots, has_init = _varlen_pool_case(gen, lens, sum(widths), W, dtype)
    ours_pool, ref_pool = pool.clone(), _cpu64(pool)
    y = kt.causal_conv1d_prefill(x, w, b, cu_seqlens=cu, conv_pool=ours_pool, conv_slots=slots,
                                 has_initial_state=has_init, planes=widths)
    ry = _planes_ref(ref.causal_conv1d_prefill, x, widths, T, w, b, ref_pool, cu_seqlens=cu.cpu(),
                     conv_slots=slots.cpu(), has_initial_state=has_init.cpu())
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y.reshape(-1), ry, TOL[dtype], "conv output (planes)")
    assert_close(ours_pool, ref_pool, TOL[dtype], "conv pool (planes)")
    for s in (2, 5):
        assert torch.equal(ours_pool[s], pool[s]), f"slot {s} was not named but changed"


def test_conv_prefill_planes_single_sequence_without_pool():
    gen = torch.Generator().manual_seed(5)
    widths, T = (32, 32, 64), 19
    x, w = _rand(gen, T, sum(widths)), _rand(gen, sum(widths), 4, scale=0.5)
    y = kt.causal_conv1d_prefill(x, w, planes=widths)
    outs, at, ch = [], 0, 0
    for n in widths:
        plane = _cpu64(x.reshape(-1)[at:at + T * n].view(T, n))
        outs.append(ref.causal_conv1d_prefill(plane, _cpu64(w)[ch:ch + n]).reshape(-1))
        at, ch = at + T * n, ch + n
    assert_close(y.reshape(-1), torch.cat(outs), TOL[torch.float32], "conv output (planes, no pool)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("widths,W", PLANE_CASES)
def test_conv_update_planes(widths, W, dtype):
    gen = torch.Generator().manual_seed(sum(widths) * W)
    B, D = 4, sum(widths)
    x, w, b = _rand(gen, B, D, dtype=dtype), _rand(gen, D, W, dtype=dtype, scale=0.5), _rand(gen, D, dtype=dtype)
    pool = _rand(gen, 6, D, W - 1, dtype=dtype)
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=DEV)
    ours_pool, ref_pool = pool.clone(), _cpu64(pool)
    y = kt.causal_conv1d_update(x, w, b, conv_pool=ours_pool, conv_slots=slots, planes=widths)
    ry = _planes_ref(ref.causal_conv1d_update, x, widths, B, w, b, ref_pool, conv_slots=slots.cpu())
    assert_close(y.reshape(-1), ry, TOL[dtype], "conv update output (planes)")
    assert_close(ours_pool, ref_pool, TOL[dtype], "conv pool (planes)")
    for s in (1, 2, 4):
        assert torch.equal(ours_pool[s], pool[s]), f"slot {s} was not named but changed"


def test_plane_widths_check_for_the_facade():
    from qwen35 import _checks as chk

    assert chk.planes("planes", [2, 2, 4], 8) == (2, 2, 4)
    for bad in ((4, 3), (2, 2, 2, 2), (10, -2), (4.0, 4), (True, 7), "8", None):
        with pytest.raises(ValueError, match="planes="):
            chk.planes("planes", bad, 8)


def test_conv_planes_must_cover_the_channels():
    x, w = torch.zeros(3, 8, device=DEV), torch.zeros(8, 4, device=DEV)
    for bad in ((4, 3), (2, 2, 2, 2), (10, -2)):
        with pytest.raises(ValueError, match="planes"):
            kt.causal_conv1d_prefill(x, w, planes=bad)
    with pytest.raises(ValueError, match="planes"):
        kt.causal_conv1d_update(x, w, conv_pool=torch.zeros(2, 8, 3, device=DEV),
                                conv_slots=torch.zeros(3, dtype=torch.int32, device=DEV), planes=(9,))


_PLANES_BUILD = r'''
import re
from helpers import build_sm90
from kernels_triton import conv1d

def sm90(kernel, consts, divisible):
    """The global loads and stores of the kernel's sm_90 PTX."""
    act = {n: "*bf16" for n in ("x_ptr", "y_ptr", "w_ptr", "bias_ptr", "pool_ptr")}
    act.update(has_init_ptr="*i1")
    ptx = build_sm90(kernel, act, consts, 4, 2, divisible=divisible).asm["ptx"]
    return sorted(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))

pre = dict(W=4, BT=16, BD=128, SEARCH_STEPS=6, VARLEN=True, SKIP_HEADS=True, HAS_BIAS=True, SILU=True)
head = dict(W=4, BD=128, BH=4, VARLEN=True, HAS_INIT_FLAGS=True, HAS_BIAS=True, SILU=True)
upd = dict(W=4, BD=256, BW=4, HAS_BIAS=True, SILU=True)
for rows, planes, consts in ((conv1d._conv_prefill_kernel, conv1d._conv_prefill_planes_kernel, pre),
                             (conv1d._conv_head_kernel, conv1d._conv_head_planes_kernel, head),
                             (conv1d._conv_update_kernel, conv1d._conv_update_planes_kernel, upd)):
    a, b = sm90(rows, consts, ("D",)), sm90(planes, consts, ("D", "P1", "P2"))
    assert a == b, (rows.fn.__name__, a, b)
print("built")
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run these kernels for real")
def test_plane_kernels_build_for_hopper_with_the_row_kernels_memory_accesses():
    """The plane-layout conv kernels compile for sm_90 with the same global loads and stores (vector widths
    included) as the row-layout ones, when the plane bounds are 16-divisible as in the model."""
    from helpers import assert_builds

    assert_builds(_PLANES_BUILD)


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
        budget = 1e-5 if DEV == "cpu" else 2.5e-2  # the self-test runs fp32 on CPU, bf16 on a GPU
        assert choice.selftest_rel_err is not None and choice.selftest_rel_err < budget, choice.reason
    gen = torch.Generator().manual_seed(3)
    x, w = _rand(gen, 12, 32), _rand(gen, 32, 4, scale=0.5)
    cu = cu_from_lens([5, 7], DEV)
    y = ops.causal_conv1d_prefill(x, w, cu_seqlens=cu)
    assert_close(y, ref.causal_conv1d_prefill(_cpu64(x), _cpu64(w), cu_seqlens=cu.cpu()), 1e-6, "façade conv")
    nw = _rand(gen, 32)
    assert_close(ops.rms_norm_zero_centered(x, nw), ref.rms_norm_zero_centered(_cpu64(x), _cpu64(nw)), 1e-6,
                 "façade norm")
