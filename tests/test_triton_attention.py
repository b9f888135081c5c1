"""Decode attention over per-slot KV caches: reference vs a naive loop, Triton vs the fp64 reference.

CPU: Triton in the interpreter (fp32, fp16; the interpreter's bf16 dots are not usable) on small
caches with forced split plans. GPU (``gpu`` marker): Qwen3.5 shapes in bf16/fp16/fp32 and a
CUDA-graph replay over growing lengths.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close

from qwen35 import ops, reference

GPU = torch.cuda.is_available()


def _case(B, H, KV, L, D, S, lengths, slots, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return dict(q=rnd(B, H, D), k_cache=rnd(S, KV, L, D), v_cache=rnd(S, KV, L, D),
                slots=torch.tensor(slots, dtype=torch.int32, device=device),
                lengths=torch.tensor(lengths, dtype=torch.int32, device=device), scale=D**-0.5)


def _naive(d: dict) -> torch.Tensor:
    q, kc, vc = d["q"].double(), d["k_cache"].double(), d["v_cache"].double()
    B, H, D = q.shape
    G = H // kc.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        s, n = int(d["slots"][b]), int(d["lengths"][b])
        if s < 0 or n == 0:
            continue
        for h in range(H):
            keys, values = kc[s, h // G, :n], vc[s, h // G, :n]
            p = torch.softmax(keys @ q[b, h] * d["scale"], dim=0)
            out[b, h] = p @ values
    return out


def _fp64(d: dict) -> dict:
    return {k: (v.cpu().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else
                v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def test_reference_matches_naive_loop():
    d = _fp64(_case(4, 6, 2, 40, 32, 5, lengths=[40, 1, 0, 17], slots=[3, 0, 4, -1]))
    got = reference.attention_decode(**d)
    assert_close(got, _naive(d), 1e-12, "reference")
    assert torch.equal(got[2], torch.zeros_like(got[2])) and torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("H,KV,D", [(4, 4, 32), (6, 2, 64), (16, 2, 96)])
@pytest.mark.parametrize("plan", [{"BN": 16, "n_splits": 1}, {"BN": 16, "n_splits": 3}, {"BN": 16, "n_splits": 64}])
def test_triton_matches_reference(dtype, tol, H, KV, D, plan):
    from kernels_triton.attention import attention_decode

    L = 50
    d = _case(5, H, KV, L, D, 6, lengths=[50, 1, 0, 33, 17], slots=[5, 2, 1, 0, -1], dtype=dtype)
    got = attention_decode(**d, config=plan)
    want = reference.attention_decode(**_fp64(d))
    assert torch.isfinite(got).all()
    assert_close(got.double(), want, tol, f"triton {dtype} {plan}")
    assert torch.equal(got[2], torch.zeros_like(got[2])), "a row with no keys gives zeros"
    assert torch.equal(got[4], torch.zeros_like(got[4])), "a padded row gives zeros"


def _offset_view(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view that starts one element (2 bytes at fp16) past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def test_triton_unaligned_inputs(caplog):
    """q and the caches as views at a 2-byte offset are read right (q realigned, caches copied with a warning)."""
    _check_unaligned(caplog, "cuda" if GPU else "cpu")


@pytest.mark.gpu
def test_triton_unaligned_inputs_gpu(caplog):
    """As above, in the GPU suite (which runs only gpu-marked tests): the H200 is where misreads were seen."""
    _check_unaligned(caplog, "cuda")


def _check_unaligned(caplog, device: str) -> None:
    from kernels_triton import attention
    from kernels_triton.attention import attention_decode

    attention._warn_unaligned_cache.cache_clear()
    d = _case(3, 4, 2, 40, 32, 4, lengths=[40, 7, 0], slots=[3, 0, 1], dtype=torch.float16, device=device)
    want = attention_decode(**d, config={"BN": 16, "n_splits": 3})
    shifted = dict(d, q=_offset_view(d["q"]), k_cache=_offset_view(d["k_cache"]), v_cache=_offset_view(d["v_cache"]))
    assert shifted["q"].data_ptr() % 16 and shifted["k_cache"].data_ptr() % 16
    with caplog.at_level("WARNING", logger="qwen35.kernels_triton"):
        got = attention_decode(**shifted, config={"BN": 16, "n_splits": 3})
    assert torch.equal(got, want)
    assert any("not 16-byte aligned" in r.message for r in caplog.records)


def test_split_plan_covers_the_cache():
    from kernels_triton.attention import split_plan

    for rows, L, BN, sms in [(2, 8256, 64, 132), (128, 8256, 64, 132), (1, 1, 64, 132), (3, 100, 16, 1)]:
        per, n = split_plan(rows, L, BN, sms)
        blocks = -(-L // BN)
        assert per * n >= blocks and per * (n - 1) < blocks, (rows, L, per, n)


def test_facade_uses_probe_and_rejects_bad_inputs(fresh_probe):
    d = _case(2, 4, 2, 8, 16, 3, lengths=[8, 3], slots=[0, 2])
    out = ops.attention_decode(**d)
    assert_close(out.double(), reference.attention_decode(**_fp64(d)), 1e-5)
    bad = [
        (dict(q=d["q"][..., :8].contiguous()), "k_cache has shape"),
        (dict(q=d["q"][:, :3].contiguous()), "multiple of KV"),
        (dict(q=d["q"].half()), "dtype"),
        (dict(lengths=torch.tensor([9, 1], dtype=torch.int32)), "lengths holds 9"),
        (dict(lengths=torch.tensor([-1, 1], dtype=torch.int32)), "lengths holds -1"),
        (dict(slots=torch.tensor([3, 0], dtype=torch.int32)), "slots holds slot 3"),
        (dict(slots=torch.tensor([0, 1, 2], dtype=torch.int32)), "slots has shape"),
        (dict(lengths=torch.tensor([1.0, 2.0])), "lengths has dtype"),
        (dict(scale=None), "scale"),
        (dict(scale=-1.0), "scale"),
    ]
    for change, match in bad:
        kv_before = d["k_cache"].clone()
        with pytest.raises(ValueError, match=match):
            ops.attention_decode(**{**d, **change})
        assert torch.equal(d["k_cache"], kv_before)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 4e-3), (torch.float32, 1e-4)])
@pytest.mark.parametrize("B", [1, 3, 64])
def test_gpu_qwen35_shapes(dtype, tol, B):
    from kernels_triton.attention import attention_decode

    L, S = 4160, max(B, 4)
    gen = torch.Generator().manual_seed(B)
    lengths = torch.randint(1, L + 1, (B,), generator=gen).tolist()
    lengths[0] = L
    slots = torch.randperm(S, generator=gen)[:B].tolist()
    d = _case(B, 16, 2, L, 256, S, lengths=lengths, slots=slots, dtype=dtype, device="cuda", seed=B)
    got = attention_decode(**d)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert_close(got.double().cpu(), reference.attention_decode(**_fp64(d)), tol, f"B={B} {dtype}")


@pytest.mark.gpu
def test_gpu_graph_replay_follows_growing_lengths():
    from kernels_triton.attention import attention_decode

    d = _case(2, 16, 2, 1024, 256, 2, lengths=[1, 700], slots=[1, 0], dtype=torch.bfloat16, device="cuda")
    attention_decode(**d)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_decode(**d)
    for step in range(3):
        d["lengths"].copy_(torch.tensor([1 + 300 * step, 700 + step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out.double().cpu(), reference.attention_decode(**_fp64(d)), 1e-2, f"replay {step}")
