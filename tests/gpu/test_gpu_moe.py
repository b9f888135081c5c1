"""Triton MoE on a CUDA device vs the fp32 reference: model-sized expert counts, decode to prefill M.

fp16 rel <= 4e-3, bf16 rel <= 1e-2; skewed routing, experts with no tokens, the -1 expert map,
bit-identical reruns, and a CUDA-graph capture of moe_block (no host synchronisation inside).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from helpers import capture_graph, rel_err

from qwen35 import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float16: 4e-3, torch.bfloat16: 1e-2}
MS = [1, 2, 3, 17, 64, 255, 1024, 4097, 16384]
# (E, k, H, I): the routed shape of 35B-A3B, and 397B-A17B's expert count at a reduced width
SHAPES = {"E256k8": (256, 8, 2048, 512), "E512k10": (512, 10, 1024, 256)}
_WEIGHTS: dict = {}


def _weights(shape: str, dtype: torch.dtype, shared: bool = True) -> dict:
    key = (shape, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # keep one set on the device at a time
        E, _, H, I = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(E)

        def rnd(*s, scale=1.0):
            return (torch.randn(*s, generator=gen, device="cuda") * scale).to(dtype)

        _WEIGHTS[key] = dict(router_weight=rnd(E, H, scale=H**-0.5 * 4), w13=rnd(E, 2 * I, H, scale=H**-0.5),
                             w2=rnd(E, H, I, scale=I**-0.5), shared_w13=rnd(2 * I, H, scale=H**-0.5),
                             shared_w2=rnd(H, I, scale=I**-0.5), shared_gate_weight=rnd(1, H, scale=H**-0.5))
    return _WEIGHTS[key]


def _x(M: int, H: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed + M)
    return torch.randn(M, H, generator=gen, device="cuda").to(dtype)


def _f32(d: dict) -> dict:
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("M", MS)
def test_block_matches_fp32_reference(M, shape, dtype):
    from kernels_triton import moe

    E, k, H, _ = SHAPES[shape]
    w = _weights(shape, dtype)
    x = _x(M, H, dtype)
    out = moe.moe_block(x, top_k=k, **w)
    expect = ref.moe_block(x.float(), top_k=k, **_f32(w))
    err = rel_err(out, expect)
    assert err <= TOL[dtype], f"M={M} {shape} {dtype}: rel err {err:.3e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("M", [1, 1024, 4097])
def test_block_fp32_fits_shared_memory(M):
    """fp32 needs twice bf16's shared memory: the tuned bf16 tiles are cut down to fit (an H200 once rejected one)."""
    from kernels_triton import moe

    E, k, H, _ = SHAPES["E256k8"]
    w = _weights("E256k8", torch.float32)
    x = _x(M, H, torch.float32)
    # the reference's routing for both (a near-tie decided differently would swamp the comparison)
    weights, ids = ref.moe_route(x @ w["router_weight"].T, k)
    out = moe.moe_experts(x, w["w13"], w["w2"], weights, ids)
    err = rel_err(out, ref.moe_experts(x, w["w13"], w["w2"], weights, ids))
    assert err <= 1e-4, f"M={M} fp32: rel err {err:.3e}"


@pytest.mark.parametrize("M", [3, 1024, 16384])
def test_experts_skewed_zero_token_and_expert_map(M):
    from kernels_triton import moe

    E, k, H, I = SHAPES["E256k8"]
    dtype = torch.bfloat16
    w = _weights("E256k8", dtype)
    x = _x(M, H, dtype, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(M)
    weights = torch.softmax(torch.randn(M, k, generator=gen, device="cuda"), -1)
    cases = {
        "all tokens on the same 8 experts": (torch.arange(k, device="cuda", dtype=torch.int32) * 31).repeat(M, 1),
        "only 16 experts get tokens": torch.stack(
            [torch.randperm(16, generator=gen, device="cuda")[:k] for _ in range(min(M, 64))]).repeat(
            -(-M // 64), 1)[:M].int(),
    }
    emap = torch.full((2 * E,), -1, dtype=torch.int32, device="cuda")  # 512 global experts, every other one here
    emap[1::2] = torch.arange(E, dtype=torch.int32, device="cuda")
    for name, ids in cases.items():
        out = moe.moe_experts(x, w["w13"], w["w2"], weights, ids)
        expect = ref.moe_experts(x.float(), w["w13"].float(), w["w2"].float(), weights, ids)
        assert rel_err(out, expect) <= TOL[dtype], name
    ids = torch.stack([torch.randperm(2 * E, generator=gen, device="cuda")[:k] for _ in range(min(M, 64))])
    ids = ids.repeat(-(-M // 64), 1)[:M].int()
    out = moe.moe_experts(x, w["w13"], w["w2"], weights, ids, emap)
    expect = ref.moe_experts(x.float(), w["w13"].float(), w["w2"].float(), weights, ids, emap)
    assert rel_err(out, expect) <= TOL[dtype], "expert_map"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_token_decode_path(shape, monkeypatch):
    """One token's three launches (kernels_triton.moe.decode): vs the fp32 reference and the general pipeline
    (QWEN35_MOE_DECODE=0), bf16 and fp32; PDL changes no bit, another launch shape only the rounding; the expert map
    drops the picks held elsewhere; reruns are bit-identical."""
    from kernels_triton import moe
    from kernels_triton.moe import decode, pdl

    E, k, H, I = SHAPES[shape]
    for dtype, tol in ((torch.bfloat16, TOL[torch.bfloat16]), (torch.float32, 1e-4)):
        w = _weights(shape, dtype)
        for seed in range(3):
            x = _x(1, H, dtype, seed=20 + seed)
            out = moe.moe_block(x, top_k=k, **w)
            expect = ref.moe_block(x.float(), top_k=k, **_f32(w))
            assert rel_err(out, expect) <= tol, f"{dtype} seed {seed}: {rel_err(out, expect):.3e}"
            assert torch.equal(out, moe.moe_block(x, top_k=k, **w)), "rerun differs"
            monkeypatch.setenv(decode.ENV, "0")
            general = moe.moe_block(x, top_k=k, **w)
            monkeypatch.delenv(decode.ENV)
            assert rel_err(out, general.float()) <= tol, "decode path vs general pipeline"
    x = _x(1, H, torch.bfloat16, seed=30)
    w = _weights(shape, torch.bfloat16)
    args = (x, w["router_weight"], w["w13"], w["w2"], k, True, w["shared_w13"], w["shared_w2"],
            w["shared_gate_weight"], None)
    want = decode.moe_block_one_token(*args, pdl=False)
    assert torch.equal(decode.moe_block_one_token(*args, pdl=pdl.enabled(x)), want), "PDL changed bits"
    wide = decode.DecodeConfig(UP_N=4, UP_K=256, UP_WARPS=4, DOWN_N=16, DOWN_K=32, DOWN_WARPS=4)
    assert rel_err(decode.moe_block_one_token(*args, cfg=wide), want.float()) <= 2e-3, "another launch shape"
    # the down launch loading its weights before its PDL wait (DOWN_EARLY): the loop kernel's values; the same bits
    # one call at a time, back to back, and replayed from a CUDA graph
    base = decode.decode_config(H, I)
    for early in (dataclasses.replace(base, DOWN_EARLY=True, DOWN_N=4), dataclasses.replace(base, DOWN_EARLY=True)):
        loop = dataclasses.replace(early, DOWN_EARLY=False)
        xs = [_x(1, H, torch.bfloat16, seed=60 + s) for s in range(16)]
        alone = []
        for xi in xs:
            alone.append(decode.moe_block_one_token(xi, *args[1:], cfg=early))
            torch.cuda.synchronize()
            assert rel_err(alone[-1], decode.moe_block_one_token(xi, *args[1:], cfg=loop).float()) <= 2e-3
        together = [decode.moe_block_one_token(xi, *args[1:], cfg=early) for xi in xs]
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), "back to back differs"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = [decode.moe_block_one_token(xi, *args[1:], cfg=early) for xi in xs]
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(alone, captured, strict=True)), "graph replay differs"
    gen = torch.Generator(device="cuda").manual_seed(E)
    router = torch.randn(2 * E, H, generator=gen, device="cuda").to(torch.bfloat16) * H**-0.5 * 4
    emap = torch.full((2 * E,), -1, dtype=torch.int32, device="cuda")  # 2E global experts, every other one here
    emap[1::2] = torch.arange(E, dtype=torch.int32, device="cuda")
    wm = dict(w, router_weight=router)
    for seed in range(3):
        x = _x(1, H, torch.bfloat16, seed=40 + seed)
        out = moe.moe_block(x, top_k=k, expert_map=emap, **wm)
        expect = ref.moe_block(x.float(), top_k=k, expert_map=emap, **_f32(wm))
        assert rel_err(out, expect) <= TOL[torch.bfloat16], f"expert map, seed {seed}"


@pytest.mark.parametrize("M", [5, 4097])
def test_block_is_bit_identical_across_runs(M):
    from kernels_triton import moe

    E, k, H, _ = SHAPES["E512k10"]
    w = _weights("E512k10", torch.bfloat16)
    x = _x(M, H, torch.bfloat16, seed=2)
    first = moe.moe_block(x, top_k=k, **w)
    for _ in range(3):
        assert torch.equal(first, moe.moe_block(x, top_k=k, **w))


@pytest.mark.parametrize("M,counter_in_capture", [(1, False), (1, True), (64, False)])
def test_block_captures_in_a_cuda_graph(M, counter_in_capture):
    """A captured block replays the eager block's bits, replays interleaved with eager calls included (both use the
    device's arrival counter: kernels_triton._arrival). ``counter_in_capture``: the counter is first asked for inside
    the capture, so the graph gets its own, zeroed by a node of the graph."""
    from kernels_triton import _arrival, moe

    E, k, H, _ = SHAPES["E256k8"]
    w = _weights("E256k8", torch.bfloat16)
    x = _x(M, H, torch.bfloat16, seed=3)
    eager = moe.moe_block(x, top_k=k, **w)
    kept = dict(_arrival.counters())

    def warm() -> None:
        moe.moe_block(x, top_k=k, **w)
        if counter_in_capture:
            _arrival.counters().clear()

    try:
        graph, captured = capture_graph(lambda: moe.moe_block(x, top_k=k, **w), warm)
        if counter_in_capture:
            assert not _arrival.counters(), "a counter zeroed inside a capture was kept for eager calls"
    finally:
        _arrival.counters().update(kept)
    for seed in range(4, 8):
        x.copy_(_x(M, H, torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, moe.moe_block(x, top_k=k, **w)) and not torch.equal(captured, eager), seed


@pytest.mark.parametrize("M", [1, 17, 1024])
def test_direct_launch_matches_the_binder_path(M):
    """Launches that skip Triton's argument binding (a cache hit) give the same bits as ordinary launches."""
    from kernels_triton import bench_api, moe
    from kernels_triton.moe import decode, experts

    E, k, H, _ = SHAPES["E512k10"]
    w = _weights("E512k10", torch.bfloat16)
    x = _x(M, H, torch.bfloat16, seed=5)
    moe.moe_block(x, top_k=k, **w)  # compiles and records the kernels
    launcher = decode._launch_gate_up if M == 1 else experts._launch_gate_up  # one token: kernels_triton.moe.decode
    hits = launcher.hits
    direct = moe.moe_block(x, top_k=k, **w)
    assert launcher.hits > hits, "the second call did not take the direct path"
    with bench_api.jit_launches():
        assert torch.equal(direct, moe.moe_block(x, top_k=k, **w))
    # the same tokens at an address 2 bytes past alignment: its own kernels (not the aligned ones), same result
    unaligned = torch.empty(M * H + 1, dtype=x.dtype, device=x.device)[1:].view(M, H).copy_(x)
    for _ in range(2):  # the second call is a direct hit on the unaligned kernels
        assert rel_err(moe.moe_block(unaligned, top_k=k, **w), direct.float()) <= 1e-3


def test_facade_picks_triton_on_the_gpu(fresh_probe):
    choice = fresh_probe.choose("moe_block", "cuda")
    assert choice.backend == "triton", choice.reason


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("M", [1, 3, 16, 64, 1024])
def test_programmatic_dependent_launch_gives_the_same_bits(M, shape, monkeypatch):
    """QWEN35_MOE_PDL=1 (each launch starting while the one before finishes; at one token the down GEMM prefetching
    its weights first; the default where routing and alignment are one launch) against 0: the bits of the ordinary
    launches, eagerly over several inputs back to back (a read of a result before it is complete would show) and
    replayed from a CUDA graph."""
    from kernels_triton import moe
    from kernels_triton.moe import pdl

    E, k, H, _ = SHAPES[shape]
    w = _weights(shape, torch.bfloat16)
    xs = [_x(M, H, torch.bfloat16, seed=10 + i) for i in range(4)]
    monkeypatch.setenv(pdl.ENV, "0")
    want = [moe.moe_block(x, top_k=k, **w) for x in xs]
    monkeypatch.delenv(pdl.ENV)  # the default: PDL where routing and alignment are one launch (M * k <= 256)
    assert all(torch.equal(moe.moe_block(x, top_k=k, **w), e) for x, e in zip(xs, want, strict=True))
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.enabled(xs[0]) == (torch.cuda.get_device_capability()[0] >= 9)
    for _ in range(3):
        got = [moe.moe_block(x, top_k=k, **w) for x in xs]
        assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True)), "PDL changed the output"
    x = xs[0].clone()
    graph, captured = capture_graph(lambda: moe.moe_block(x, top_k=k, **w), lambda: moe.moe_block(x, top_k=k, **w))
    for i in (1, 2, 3, 0):
        x.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, want[i]), f"graph replay {i} differs"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("M,pdl_env", [(2, ""), (16, ""), (32, ""), (1024, "1")])
def test_block_wait_gives_the_same_bits(M, pdl_env, shape, monkeypatch):
    """The down launch waiting block by block on counters the gate_up launch signals (the default with PDL up to
    experts.BLOCK_WAIT_MAX_TOKENS tokens, here at every size) against waiting for the whole gate_up launch (the rule's
    reach set to 0): the same bits over 16 inputs back to back (a read of an ``h`` tile before its block is complete
    would show), with and without the shared expert, and from a CUDA graph replayed; every counter zero
    afterwards."""
    from kernels_triton import moe
    from kernels_triton._arrival import block_counters
    from kernels_triton.moe import experts, pdl

    E, k, H, _ = SHAPES[shape]
    w = _weights(shape, torch.bfloat16)
    xs = [_x(M, H, torch.bfloat16, seed=60 + i) for i in range(16)]
    monkeypatch.setenv(pdl.ENV, pdl_env)
    monkeypatch.setattr(experts, "BLOCK_WAIT_MAX_TOKENS", 0)
    want = [moe.moe_block(x, top_k=k, **w) for x in xs]
    no_shared = dict(w, shared_w13=None, shared_w2=None, shared_gate_weight=None)
    want_routed = [moe.moe_block(x, top_k=k, **no_shared) for x in xs[:4]]
    monkeypatch.setattr(experts, "BLOCK_WAIT_MAX_TOKENS", 1 << 30)
    for _ in range(2):
        got = [moe.moe_block(x, top_k=k, **w) for x in xs]
        assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True)), "block wait changed the output"
        got = [moe.moe_block(x, top_k=k, **no_shared) for x in xs[:4]]
        assert all(torch.equal(g, e) for g, e in zip(got, want_routed, strict=True)), "changed the routed output"
    x = xs[0].clone()
    graph, captured = capture_graph(lambda: moe.moe_block(x, top_k=k, **w), lambda: moe.moe_block(x, top_k=k, **w))
    for i in (3, 1, 2, 0, 5):
        x.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, want[i]), f"graph replay {i} differs"
    assert not block_counters(x.device).any(), "a counter was left non-zero"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kept_route_scratch_gives_the_bits_of_new_buffers(shape, monkeypatch):
    """moe_block keeps its router partials, routing results and alignment in one buffer per thread, device and
    stream (kernels_triton.moe.align.route_scratch; one token: decode.one_token_scratch, h too): calls of several
    sizes queued back to back on one stream, and calls on a second stream, give the bits of calls that allocate
    afresh; one layout's views are made once; a capture takes its own buffers (test_block_captures_in_a_cuda_graph
    replays beside eager calls)."""
    from kernels_triton import _kept, moe
    from kernels_triton.moe import align

    E, k, H, _ = SHAPES[shape]
    w = _weights(shape, torch.bfloat16)
    # one token (decode.one_token_scratch), one-launch and chunked routing
    xs = [_x(M, H, torch.bfloat16, seed=11) for M in (3, 1, 40, 1024, 3, 1, 17)]
    kept = [moe.moe_block(x, top_k=k, **w) for x in xs]  # no synchronisation between them
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [moe.moe_block(x, top_k=k, **w) for x in reversed(xs)]
    torch.cuda.current_stream().wait_stream(side)
    args = (40, E, 2, k)
    opts = dict(gate=True, shared=True, n_local=E, block_m=16, device=torch.device("cuda"))
    assert align.route_scratch(*args, **opts) is align.route_scratch(*args, **opts), "views made again"
    on_main = align.route_scratch(*args, **opts).logits.data_ptr()
    with torch.cuda.stream(side):
        assert align.route_scratch(*args, **opts).logits.data_ptr() != on_main, "two streams share a buffer"
    other: list[int] = []  # another thread on the same (default) stream: a buffer of its own
    worker = threading.Thread(target=lambda: other.append(align.route_scratch(*args, **opts).logits.data_ptr()))
    worker.start()
    worker.join()
    assert other and other[0] != on_main, "two threads share a buffer"
    monkeypatch.setattr(_kept, "kept", lambda *args: None)  # every call allocates (both scratch layouts)
    fresh = [moe.moe_block(x, top_k=k, **w) for x in xs]
    for i, (a, b, c) in enumerate(zip(kept, fresh, reversed(on_side), strict=True)):
        assert torch.equal(a, b) and torch.equal(c, b), (i, xs[i].shape[0])
