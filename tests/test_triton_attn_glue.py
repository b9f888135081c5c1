"""The attention layer's fused q/k norm + rotary and output gate (Triton) vs the fp64 reference, from strided
views as the model passes them; on CPU under TRITON_INTERPRET=1, on CUDA when present (GPU suite, part
``kernels``). Also: the façade's checks, and the model's formula (norm, then rotate the first dims)."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (also done by conftest)

import pytest
import torch
from helpers import assert_close

import kernels_triton as kt
from qwen35 import ops
from qwen35 import reference as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _case(gen, T: int, HQ: int, HK: int, D: int, half: int, dtype):
    """q, gate, k as strided views of one projection row [q0 g0 q1 g1 ... | k | v], as the model lays them out."""
    proj = (torch.randn(T, 2 * HQ * D + 2 * HK * D, generator=gen) * 2.0).to(DEV, dtype)
    qg = proj[:, :2 * HQ * D].view(T, HQ, 2 * D)
    q, gate = qg.chunk(2, dim=-1)
    k = proj[:, 2 * HQ * D:(2 * HQ + HK) * D].view(T, HK, D)
    angles = torch.rand(T, half, generator=gen) * 50.0
    w = [(torch.randn(D, generator=gen) * 0.2).to(DEV, dtype) for _ in range(2)]
    return q, k, gate, w, angles.cos().to(DEV), angles.sin().to(DEV)


def _cpu64(t):
    return t.detach().cpu().double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,HQ,HK,D,half", [(1, 4, 2, 64, 16), (7, 16, 2, 256, 32), (5, 3, 1, 80, 20),
                                             (3, 2, 2, 32, 0), (0, 4, 2, 64, 16)])
def test_qk_norm_rope(dtype, T, HQ, HK, D, half):
    """Partial rotary (and none, half = 0), a non-power-of-two head dim, one token and none."""
    gen = torch.Generator().manual_seed(T * 100 + D)
    q, k, _, (qw, kw), cos, sin = _case(gen, T, HQ, HK, D, half, dtype)
    assert T < 2 or not (q.is_contiguous() or k.is_contiguous())
    qo, ko = kt.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    assert qo.shape == (T, HQ, D) and ko.shape == (T, HK, D) and qo.is_contiguous() and qo.dtype == dtype
    rq, rk = ref.qk_norm_rope(_cpu64(q), _cpu64(k), _cpu64(qw), _cpu64(kw), _cpu64(cos), _cpu64(sin), 1e-6)
    if T:
        assert_close(qo, rq, TOL[dtype], "q")
        assert_close(ko, rk, TOL[dtype], "k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 4, 64), (6, 16, 256), (3, 5, 48), (0, 2, 64)])
def test_sigmoid_gate_mul(dtype, T, H, D):
    gen = torch.Generator().manual_seed(T + H + D)
    _, _, gate, _, _, _ = _case(gen, T, H, 1, D, 0, dtype)
    x = (torch.randn(T, H, D, generator=gen)).to(DEV, dtype)
    y = kt.sigmoid_gate_mul(x, gate)
    assert y.shape == (T, H, D) and y.is_contiguous() and y.dtype == dtype
    if T:
        assert_close(y, ref.sigmoid_gate_mul(_cpu64(x), _cpu64(gate)), TOL[dtype], "gated")


def test_reference_is_norm_then_rotate():
    """The reference op equals the zero-centred norm followed by a NeoX rotation of the first dims."""
    gen = torch.Generator().manual_seed(1)
    T, H, D, half = 4, 3, 32, 8
    x, w = torch.randn(T, H, D, generator=gen, dtype=torch.float64), torch.randn(D, generator=gen).double()
    ang = torch.rand(T, half, generator=gen).double() * 9
    y = ref.rms_norm_zero_centered(x, w, 1e-6)
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    want = y.clone()
    want[..., :half] = y[..., :half] * c - y[..., half:2 * half] * s
    want[..., half:2 * half] = y[..., half:2 * half] * c + y[..., :half] * s
    got, _ = ref.qk_norm_rope(x, x, w, w, ang.cos(), ang.sin(), 1e-6)
    assert_close(got, want, 1e-12, "reference")


def test_facade_checks():
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    w, cos = torch.randn(64), torch.randn(3, 16)
    with pytest.raises(ValueError, match=r"k has shape \[3, 2, 32\]; expected \[3, \*, 64\]"):
        ops.qk_norm_rope(q, torch.randn(3, 2, 32), w, w, cos, cos)
    with pytest.raises(ValueError, match="needs head_dim >= that, got 64"):
        ops.qk_norm_rope(q, k, w, w, torch.randn(3, 40), torch.randn(3, 40))
    with pytest.raises(ValueError, match="head_dim\\) must be contiguous"):
        ops.qk_norm_rope(q.transpose(1, 2).contiguous().transpose(1, 2), k, w, w, cos, cos)
    with pytest.raises(ValueError, match="cos has dtype bfloat16"):
        ops.qk_norm_rope(q, k, w, w, cos.bfloat16(), cos)
    with pytest.raises(ValueError, match=r"gate has shape \[3, 2, 64\]; expected \[3, 4, 64\]"):
        ops.sigmoid_gate_mul(q, k)
    with pytest.raises(ValueError, match="gate has dtype"):
        ops.sigmoid_gate_mul(q, q.half())


_SM90_BUILD = r'''
from helpers import build_sm90 as build
from kernels_triton import attn_glue as G

bf, f32 = "*bf16", "*fp32"
build(G._qk_norm_rope_kernel, {"q_ptr": bf, "k_ptr": bf, "qw_ptr": bf, "kw_ptr": bf, "cos_ptr": f32, "sin_ptr": f32,
                               "qo_ptr": bf, "ko_ptr": bf, "eps": "fp32"}, dict(D=256, BLOCK_D=256, HALF=32, BH=16), 4)
build(G._sigmoid_gate_kernel, {"x_ptr": bf, "g_ptr": bf, "y_ptr": bf}, dict(D=256, BLOCK_D=256, BH=16), 4)
print("built")
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above run the kernels for real")
def test_kernels_build_for_hopper():
    """Both kernels compile to sm_90 code (Triton's bundled ptxas; no GPU needed)."""
    from helpers import assert_builds

    assert_builds(_SM90_BUILD)
