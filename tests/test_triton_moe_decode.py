"""Decode-sized MoE blocks in three launches (kernels_triton.moe.decode) vs the reference moe_block.

Runs on CPU under TRITON_INTERPRET=1 (fp16/fp32: the interpreter's bf16 dot is broken), or on CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import pytest  # noqa: E402
from helpers import assert_close, run_without_interpreter  # noqa: E402

from kernels_triton import moe as tmoe  # noqa: E402
from kernels_triton.moe import decode as tdecode  # noqa: E402
from qwen35 import reference as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-3, torch.float16: 4e-3}


def _rnd(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _inputs(M, dtype, *, E=8, H=64, I=48, shared=True, gate=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kw = dict(x=_rnd(gen, M, H, dtype=dtype), router_weight=_rnd(gen, E, H, dtype=dtype),
              w13=_rnd(gen, E, 2 * I, H, scale=H**-0.5, dtype=dtype), w2=_rnd(gen, E, H, I, scale=I**-0.5, dtype=dtype))
    if shared:
        kw.update(shared_w13=_rnd(gen, 2 * I, H, scale=H**-0.5, dtype=dtype),
                  shared_w2=_rnd(gen, H, I, scale=I**-0.5, dtype=dtype),
                  shared_gate_weight=_rnd(gen, 1, H, dtype=dtype) if gate else None)
    return kw


def _decode(kw, top_k, *, renormalize=True, expert_map=None, bi=16):
    return tdecode.moe_block_decode(
        kw["x"], kw["router_weight"], kw["w13"], kw["w2"], top_k, renormalize=renormalize,
        shared_w13=kw.get("shared_w13"), shared_w2=kw.get("shared_w2"), shared_gate_weight=kw.get("shared_gate_weight"),
        expert_map=expert_map, sm_count=1, bi=bi)


def _reference(kw, top_k, **extra):
    return ref.moe_block(**{k: (v.double().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
                         top_k=top_k, **extra)


@pytest.mark.parametrize("M,dtype,shared,gate,renormalize,bi", [
    (1, torch.float16, True, True, True, 16),
    (2, torch.float32, True, False, False, 32),  # shared expert without a gate, no renormalisation
    (1, torch.float32, False, False, True, 16),  # no shared expert; I = 48 leaves a ragged last block at BI = 32
    (2, torch.float16, False, False, True, 32),
])
def test_decode_block_matches_reference(M, dtype, shared, gate, renormalize, bi):
    kw = _inputs(M, dtype, shared=shared, gate=gate, seed=M + bi)
    out = _decode(kw, 3, renormalize=renormalize, bi=bi)
    assert out.dtype == dtype and out.shape == kw["x"].shape and torch.isfinite(out).all()
    assert_close(out, _reference(kw, 3, renormalize=renormalize), TOL[dtype], "decode moe_block")
    assert torch.equal(out, _decode(kw, 3, renormalize=renormalize, bi=bi)), "two runs differ"


def test_decode_block_with_expert_map():
    kw = _inputs(2, torch.float16, E=3, seed=7)
    kw["router_weight"] = _rnd(torch.Generator().manual_seed(8), 8, 64, dtype=torch.float16)  # 8 global, 3 here
    emap = torch.tensor([-1, 0, -1, -1, 1, -1, 2, -1], dtype=torch.int32, device=DEVICE)
    out = _decode(kw, 3, expert_map=emap)
    assert_close(out, _reference(kw, 3, expert_map=emap.cpu()), 4e-3, "decode moe_block with expert_map")


def test_decode_block_ragged_hidden():
    """H not a multiple of the GEMV's K block nor of the output block (masks on both loops)."""
    kw = _inputs(1, torch.float32, H=80, I=32, seed=9)
    out = _decode(kw, 2)
    assert_close(out, _reference(kw, 2), TOL[torch.float32], "decode moe_block, H = 80")


def test_moe_block_takes_the_decode_path(monkeypatch):
    """moe_block sends up to MAX_M tokens here, more through the general pipeline; both agree."""
    calls = []
    real = tdecode.moe_block_decode
    monkeypatch.setattr(tdecode, "moe_block_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    for M in (1, tdecode.MAX_M + 1):
        kw = _inputs(M, torch.float16, seed=M)
        out = tmoe.moe_block(**kw, top_k=3)
        assert_close(out, _reference(kw, 3), TOL[torch.float16], f"moe_block M={M}")
    assert len(calls) == 1


def test_block_i_rule():
    """The widest block that still gives about two programs per SM; 16 at the least."""
    assert tdecode.block_i(512, 9, 1, 132) == 16  # 35B-A3B with its shared expert: 288 programs (144 at 32)
    assert tdecode.block_i(128, 11, 1, 132) == 16  # 397B TP8: few columns per expert
    assert tdecode.block_i(1024, 9, 2, 132) == 64


_SM90_BUILD = r"""
from helpers import build_sm90
from kernels_triton.moe import decode as D

bf, f32 = "*bf16", "*fp32"
types = {"x_ptr": bf, "logits_ptr": f32, "gate_ptr": f32, "w13_ptr": bf, "w2_ptr": bf, "shared_w13_ptr": bf,
         "shared_w2_ptr": bf, "part_ptr": f32}
for bi, shared in ((32, True), (16, False), (64, True)):
    build_sm90(D._decode_experts_kernel, types, dict(N_SPLITS=8, TOP_K=8, K_PAD=8, E_PAD=256, RENORMALIZE=True,
               HAS_GATE=shared, HAS_SHARED=shared, HAS_MAP=not shared, BI=bi, BK=256, BH=128, IEEE=False), 4, 3)
build_sm90(D._decode_combine_kernel, {"part_ptr": f32, "out_ptr": bf}, dict(SLOTS=9, BH=512))
print("built")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs these kernels for real")
def test_decode_kernels_build_for_sm90():
    proc = run_without_interpreter(_SM90_BUILD)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-3000:]
