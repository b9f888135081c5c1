"""Triton GDN kernels (chunked prefill, decode step) vs the fp64 reference, on CPU under TRITON_INTERPRET=1.

Small shapes, but every path: ragged varlen batches with length 0 and 1 sequences and several
chunks, grouped value heads, initial states from tensors / pool slots (padding, has_initial_state
False), final states returned or written back, raw and precomputed gating, L2 norm on and off,
head dims that are not powers of two, fp32 and fp16, continuation prefill -> decode, and the
façade forced to ``triton`` (probe self-test included).
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (also done by conftest)

import pytest
import torch
from helpers import assert_close, cu_from_lens, gdn_inputs

import kernels_triton as kt
from kernels_triton.gdn import bench_api as gdn_bench
from kernels_triton.gdn import common, launch, plan
from qwen35 import ops
from qwen35 import reference as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Relative error budgets per (device, input dtype). CPU (the interpreter, numpy fp32 dots): fp32 outputs measured
# within 8.4e-7 of the fp64 reference, fp16 ones within 2.1e-4 (their own rounding); GPU: tf32x3 dots for fp32,
# tf32 for fp16, held to the budgets the GPU suite runs these cases with.
TOL = {"cpu": {torch.float32: 5e-6, torch.float16: 1e-3},
       "cuda": {torch.float32: 2e-5, torch.float16: 2e-3}}[DEV]


def _to64(d: dict) -> dict:
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}


def _inputs(lens, H, HV, K, V, dtype, *, raw=True, decay="normal", seed=0, l2=True):
    d = gdn_inputs(sum(lens), H, HV, K, V, dtype=dtype, device=DEV, seed=seed, raw=raw, decay=decay)
    if not l2:  # without the in-kernel norm, feed unit-norm keys so the recurrence stays bounded
        d["k"] = torch.nn.functional.normalize(d["k"].float(), dim=-1).to(dtype)
        d["q"] = torch.nn.functional.normalize(d["q"].float(), dim=-1).to(dtype)
    return d


PREFILL_CASES = {
    # name: (lens, H, HV, K, V)
    "ragged_grouped": ([5, 70, 0, 1, 130], 2, 4, 32, 32),
    "one_chunk_edges": ([64, 1, 65, 0], 1, 2, 16, 64),
    "odd_head_dims": ([33, 80], 2, 2, 24, 40),
    # every sequence within one chunk: both phases in one launch (scan._chunk_single_kernel)
    "one_launch": ([30, 0, 20, 14], 2, 4, 32, 32),
    "one_launch_one_token": ([1], 1, 2, 16, 64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_pool_slots(case, dtype):
    lens, H, HV, K, V = PREFILL_CASES[case]
    N = len(lens)
    d = _inputs(lens, H, HV, K, V, dtype)
    cu = cu_from_lens(lens, DEV)
    gen = torch.Generator().manual_seed(1)
    pool = (torch.randn(N + 3, HV, K, V, generator=gen) * 0.1).to(DEV)
    slots = torch.tensor([N + 2 - i if i % 3 != 1 else -1 for i in range(N)], dtype=torch.int32, device=DEV)
    has_init = torch.tensor([i % 2 == 0 for i in range(N)], device=DEV)
    ours_pool, ref_pool = pool.clone(), pool.double().cpu()
    o, none = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours_pool, state_slots=slots,
                                   has_initial_state=has_init, use_qk_l2norm=True)
    ro, _ = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(), state_pool=ref_pool,
                                  state_slots=slots.cpu(), has_initial_state=has_init.cpu(), use_qk_l2norm=True)
    assert none is None
    assert o.dtype == dtype
    assert_close(o, ro, TOL[dtype], "output")
    assert_close(ours_pool, ref_pool, TOL[dtype], "pool")
    named = set(slots[slots >= 0].tolist())
    for s in range(pool.shape[0]):
        if s not in named:
            assert torch.equal(ours_pool[s], pool[s]), f"slot {s} was not named but changed"


@pytest.mark.parametrize("decay", ["weak", "strong"])
def test_prefill_initial_state_tensor_and_final(decay):
    lens, H, HV, K, V = [70, 0, 130, 1], 2, 4, 32, 16
    d = _inputs(lens, H, HV, K, V, torch.float32, raw=False, decay=decay, l2=False)
    cu = cu_from_lens(lens, DEV)
    h0 = (torch.randn(len(lens), HV, K, V, generator=torch.Generator().manual_seed(2)) * 0.1).to(DEV)
    o, ht = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    ro, rht = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(),
                                    initial_state=h0.double().cpu(), output_final_state=True)
    assert_close(o, ro, TOL[torch.float32], "output")
    assert_close(ht, rht, TOL[torch.float32], "final state")
    assert ht.dtype == torch.float32


@pytest.mark.parametrize("variant", [{"DIAG_ROWS": 8}, {"DIAG_ROWS": 4}, {"DIAG_ROWS": 4, "BLOCK_INV": 1},
                                     {"DIAG_ROWS": 8, "BLOCK_INV": 1}, {"DIAG_ROWS": 16, "BLOCK_INV": 1},
                                     {"DIAG_ROWS": 4, "BLOCK_INV": 1, "SCALE_K": True},
                                     {"DIAG_ROWS": 4, "BLOCK_INV": 0, "SCALE_K": True}])
def test_prefill_diagonal_inverse_variants(variant):
    """The forms of the diagonal inverse (substitution on 16-, 8- or 4-row blocks, the merges on the full tile or
    on the diagonal blocks, W from T diag(beta)) agree with the reference, also for strongly correlated keys
    (all-positive, as after the conv's SiLU) and weak decay."""
    lens, H, HV, K, V = [130, 7], 1, 2, 32, 32
    d = _inputs(lens, H, HV, K, V, torch.float32, raw=False, decay="weak")
    d["k"] = d["k"].abs() + 0.5
    cu = cu_from_lens(lens, DEV)
    cfg = {"num_warps": 4, "num_stages": 1, **variant}
    o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                        prepare=cfg)
    ro, rht = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(),
                                    output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "output")
    assert_close(ht, rht, TOL[torch.float32], "final state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens,varlen", [([5, 70, 0, 1, 130], True), ([200], True), ([150], False)],
                         ids=["ragged", "one_seq", "no_cu_seqlens"])
def test_split_output_matches_the_one_pass_scan(lens, varlen, dtype):
    """A forced SPLIT scan config (the scan walks the state path alone and leaves chunk states and V'; a second
    launch computes every chunk's output in parallel): the pool bits of the one-pass scan (the same state code), its
    output to rounding, and the reference's values; ragged batches with empty and one-token sequences, chunk-table
    rows of several sequences, padding slots, no cu_seqlens.

    The output launch forms each chunk's output in wider V blocks than the scan does, so its dots may sum in
    another order: on some CPUs (an AVX-512 EPYC, numpy 2.3.5) the numpy matmuls behind the interpreter's dots
    differ in the last bit of ~10 % of the fp32 outputs (1.5e-8 at most)."""
    H, HV, K, V = 2, 4, 32, 32
    N = len(lens)
    d = _inputs(lens, H, HV, K, V, dtype, seed=9)
    cu = cu_from_lens(lens, DEV) if varlen else None
    pool = (torch.randn(N + 2, HV, K, V, generator=torch.Generator().manual_seed(10)) * 0.1).to(DEV)
    slots = torch.tensor([N + 1 - i if i % 3 != 1 else -1 for i in range(N)], dtype=torch.int32, device=DEV)
    got = {}
    for split in (False, True):
        p = pool.clone()
        cfg = {"BV": 16, "num_warps": 4, "num_stages": 2, "SPLIT": split}
        if varlen:
            o, _ = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=p, state_slots=slots, use_qk_l2norm=True,
                                        scan=cfg)
        else:
            o, ht = gdn_bench.gdn_chunk_prefill(**d, initial_state=pool[:1], output_final_state=True,
                                                use_qk_l2norm=True, scan=cfg)
            p[0] = ht[0]
        got[split] = o, p
    assert_close(got[True][0], got[False][0], 1e-6 if dtype == torch.float32 else 2e-5, "output vs one-pass scan")
    assert torch.equal(got[True][1], got[False][1]), "states differ from the one-pass scan's"
    d64 = _to64({k: v.cpu() for k, v in d.items()})
    if varlen:
        ref_pool = pool.double().cpu()
        ro, _ = ref.gdn_chunk_prefill(**d64, cu_seqlens=cu.cpu(), state_pool=ref_pool, state_slots=slots.cpu(),
                                      use_qk_l2norm=True)
    else:
        ref_pool = pool.double().cpu()
        ro, rht = ref.gdn_chunk_prefill(**d64, initial_state=ref_pool[:1], output_final_state=True,
                                        use_qk_l2norm=True)
        ref_pool[0] = rht[0]
    assert_close(got[True][0], ro, TOL[dtype], "output")
    assert_close(got[True][1], ref_pool, TOL[dtype], "states")
    with pytest.raises(ValueError, match="SPLIT"):
        gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, scan={"BV": 16, "num_warps": 4, "num_stages": 2,
                                                              "SPLIT": 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [False, True], ids=["one_pass", "split"])
def test_scan_t_gives_the_reference(split, dtype):
    """A forced SCAN_T scan config (the prepare leaves T diag(beta) instead of W and U; the scan forms V' from the v
    rows): the reference's output and states for the one-pass and the split scan, in one part and in segments; ragged
    batches with empty and one-token sequences, a padded pool slot. The default takes it where it fits (one-pass
    scans; K + V >= CHUNK), and a config where it does not fit is refused before any launch."""
    lens, H, HV, K, V = [5, 70, 0, 1, 130], 1, 2, 64, 16
    N = len(lens)
    d = _inputs(lens, H, HV, K, V, dtype, seed=31)
    cu = cu_from_lens(lens, DEV)
    pool = (torch.randn(N + 2, HV, K, V, generator=torch.Generator().manual_seed(32)) * 0.1).to(DEV)
    slots = torch.tensor([N + 1 - i if i % 3 != 1 else -1 for i in range(N)], dtype=torch.int32, device=DEV)
    ref_pool = pool.double().cpu()
    ro, _ = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(), state_pool=ref_pool,
                                  state_slots=slots.cpu(), use_qk_l2norm=True)
    base = {"BV": 16, "num_warps": 4, "num_stages": 2, "SPLIT": split, "SCAN_T": True}
    for cfg in (base, dict(base, SEGMENTS=3, SEG_PREPARE=True)):
        p = pool.clone()
        o, _ = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=p, state_slots=slots, use_qk_l2norm=True,
                                    scan=cfg, metadata=kt.prepare_gdn_metadata(cu))
        assert_close(o, ro, TOL[dtype], f"output, {cfg}")
        assert_close(p, ref_pool, TOL[dtype], f"pool, {cfg}")
        for s in set(range(N + 2)) - set(slots.tolist()):
            assert torch.equal(p[s], pool[s]), f"slot {s} was not named but changed"
    dev = torch.device("cpu")
    assert plan.plan_for(dev, dtype, 1, 2, 32, 32, 1024).scan.SCAN_T  # K + V = CHUNK: fits
    assert not plan.plan_for(dev, dtype, 1, 2, 16, 32, 1024).scan.SCAN_T
    with pytest.raises(ValueError, match="SCAN_T=True with K=16, V=32"):
        gdn_bench.gdn_chunk_prefill(**_inputs([100], 1, 2, 16, 32, dtype), scan=dict(base, SPLIT=False))
    with pytest.raises(ValueError, match="SCAN_T=True with K=32, V=32, SPLIT=True"):
        gdn_bench.gdn_chunk_prefill(**_inputs([100], 1, 2, 32, 32, dtype), scan=dict(base, SPLIT=True))
    with pytest.raises(ValueError, match="SCAN_T=1"):
        gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, scan=dict(base, SCAN_T=1))


@pytest.mark.parametrize("state,split", [(s, True) for s in ("pool", "pool_no_init", "padded_slot", "tensor", "none",
                                                              "no_cu_seqlens")] + [("pool", False), ("tensor", False)])
def test_scan_in_segments_gives_the_same_bits(state, split):
    """A forced SEGMENTS scan config (one sequence's scan in parts, the state carried between them in fp32; on a GPU the
    parts' launches overlap on three streams) and SEG_PREPARE (the prepare in parts too), for the split and the
    one-pass scan: the same output and state bits as one part, for every way a call's state comes in and goes out,
    with parts of one chunk and more parts asked for than the sequence has chunks."""
    H, HV, K, V, T = 1, 2, 32, 32, 300  # 5 chunks, the last one partial
    d = _inputs([T], H, HV, K, V, torch.float32, seed=21)
    cu = None if state == "no_cu_seqlens" else cu_from_lens([T], DEV)
    pool = (torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(22)) * 0.1).to(DEV)
    slots = torch.tensor([-1 if state == "padded_slot" else 2], dtype=torch.int32, device=DEV)
    flags = torch.tensor([state != "pool_no_init"], device=DEV)
    base = {"BV": 16, "num_warps": 4, "num_stages": 2, "SPLIT": split}

    def run(cfg):  # noqa: ANN001, ANN202
        p = pool.clone()
        if state in ("pool", "pool_no_init", "padded_slot"):
            o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=p, state_slots=slots,
                                                has_initial_state=flags, use_qk_l2norm=True, scan=cfg)
        else:
            h0 = None if state == "none" else pool[:1]
            o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm=True, scan=cfg)
        return o, p if ht is None else ht

    want = run(base)
    for n, seg_prepare in ((2, False), (3, True), (5, False), (9, True)):
        got = run(dict(base, SEGMENTS=n, SEG_PREPARE=seg_prepare))
        assert torch.equal(got[0], want[0]), f"output, {n} segments, SEG_PREPARE={seg_prepare}"
        assert torch.equal(got[1], want[1]), f"states, {n} segments, SEG_PREPARE={seg_prepare}"
    if state == "padded_slot":
        assert torch.equal(want[1], pool), "a padded slot's call wrote to the pool"
    for bad, match in (({"SEGMENTS": 0}, "SEGMENTS=0"), ({"SEGMENTS": 2.0}, "SEGMENTS=2.0"),
                       ({"SEG_PREPARE": 1}, "SEG_PREPARE=1")):
        with pytest.raises(ValueError, match=match):
            run(dict(base, **bad))


def test_segments_apply_to_one_sequence_only(monkeypatch):
    """A batch of several sequences runs its split scan in one part whatever SEGMENTS says (its parts would need
    per-sequence chunk ranges): one scan launch."""
    launched = []
    real = launch.launch_scan
    monkeypatch.setattr(launch, "launch_scan", lambda *a: (launched.append((a[1].chunk_lo, a[1].chunk_hi)), real(*a)))
    d = _inputs([150, 150], 1, 2, 32, 32, torch.float32, seed=23)
    cu = cu_from_lens([150, 150], DEV)
    gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, scan={"BV": 16, "num_warps": 4, "num_stages": 2, "SPLIT": True,
                                                          "SEGMENTS": 3})
    assert launched == [(0, 0)]
    launched.clear()
    d = _inputs([300], 1, 2, 32, 32, torch.float32, seed=23)
    gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu_from_lens([300], DEV), scan={
        "BV": 16, "num_warps": 4, "num_stages": 2, "SPLIT": True, "SEGMENTS": 3})
    assert launched == [(0, 2), (2, 4), (4, 5)]
    launched.clear()  # the one-pass scan's parts shrink by ONE_PASS_SEGMENT_RATIO (by its V block; 0.6 at others)
    monkeypatch.setattr(plan, "ONE_PASS_SEGMENT_RATIO", {32: 1.0})
    gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu_from_lens([300], DEV), scan={
        "BV": 16, "num_warps": 4, "num_stages": 2, "SEGMENTS": 3, "SEG_PREPARE": True})
    assert launched == [(0, 3), (3, 4), (4, 5)]
    launched.clear()
    gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu_from_lens([300], DEV), scan={
        "BV": 32, "num_warps": 4, "num_stages": 2, "SEGMENTS": 3, "SEG_PREPARE": True})
    assert launched == [(0, 2), (2, 3), (3, 5)]


@pytest.mark.parametrize("state", ["pool", "tensor", "none"])
def test_scan_in_sequence_groups_gives_the_same_bits(state, monkeypatch):
    """A forced GROUPS scan config (a batch's one-pass scans in groups of whole sequences, each group's prepare beside
    the scan of the group before; on a GPU on three streams): the same output and state bits as one launch each, with
    empty and one-token sequences, a padded pool slot, more groups asked for than fit; metadata without the host's
    sequence offsets (built from chunk indices on the device) runs in one group."""
    lens = [70, 0, 130, 1, 65, 200, 3]
    N, H, HV, K, V = len(lens), 1, 2, 32, 32
    d = _inputs(lens, H, HV, K, V, torch.float32, seed=31)
    cu = cu_from_lens(lens, DEV)
    pool = (torch.randn(N + 2, HV, K, V, generator=torch.Generator().manual_seed(32)) * 0.1).to(DEV)
    slots = torch.tensor([4, 0, -1, 2, 1, 3, 6], dtype=torch.int32, device=DEV)
    base = {"BV": 16, "num_warps": 4, "num_stages": 2}

    def run(cfg, meta):  # noqa: ANN001, ANN202
        p = pool.clone()
        if state == "pool":
            o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=p, state_slots=slots, use_qk_l2norm=True,
                                         scan=cfg, metadata=meta)
        else:
            o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=None if state == "none" else pool[:N],
                                         output_final_state=True, use_qk_l2norm=True, scan=cfg, metadata=meta)
        return o, p if ht is None else ht

    meta = kt.prepare_gdn_metadata(cu)
    assert meta.chunk_offsets == gdn_bench.chunk_offsets([0, *torch.tensor(lens).cumsum(0).tolist()])
    want = run(base, meta)
    launched = []
    real = launch.launch_scan
    monkeypatch.setattr(launch, "launch_scan", lambda *a: (launched.append((a[1].nh_base, a[1].NH)), real(*a)))
    for groups, seg_prepare in ((2, True), (3, False), (5, True), (9, True)):
        launched.clear()
        got = run(dict(base, GROUPS=groups, SEG_PREPARE=seg_prepare), meta)
        assert torch.equal(got[0], want[0]), f"output, {groups} groups"
        assert torch.equal(got[1], want[1]), f"states, {groups} groups"
        seq = [lo // HV for lo, _ in launched] + [launched[-1][1] // HV]
        assert seq == gdn_bench.sequence_groups(meta.chunk_offsets, groups)
        assert 2 <= len(launched) <= groups
    launched.clear()
    idx = torch.tensor([[n, c] for n, L in enumerate(lens) for c in range(-(-L // 64))], device=DEV)
    got = run(dict(base, GROUPS=3, SEG_PREPARE=True), kt.prepare_gdn_metadata(cu, chunk_indices=idx))
    assert launched == [(0, N * HV)] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="GROUPS=0"):
        run(dict(base, GROUPS=0), meta)


def test_sequence_groups():
    """Groups of whole sequences near segment_cuts' chunk bounds, each holding at least one chunk, in order."""
    from kernels_triton.gdn.bench_api import chunk_offsets, segment_cuts, sequence_groups

    offs = chunk_offsets([0, 4096 * 1, 4096 * 2, 4096 * 3, 4096 * 4])  # four 64-chunk sequences
    assert offs == (0, 64, 128, 192, 256)
    assert sequence_groups(offs, 2, ratio=1.0) == [0, 2, 4]
    assert sequence_groups(offs, 2, ratio=0.6) == [0, 3, 4]  # chunk bound 160, as far from 128 as from 192: the later
    assert sequence_groups(offs, 3, ratio=1.0) == [0, 1, 3, 4]  # bounds 85 and 171: nearest 64 and 192
    assert sequence_groups((0, 0, 5, 5), 4) == [0, 3]  # one sequence holds every chunk: one group
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        lens = torch.randint(0, 300, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        offs = chunk_offsets([0, *torch.tensor(lens).cumsum(0).tolist()])
        for groups in (1, 2, 3, 6):
            for ratio in (None, 0.6):
                cuts = sequence_groups(offs, groups, ratio)
                assert cuts[0] == 0 and cuts[-1] == len(lens) and len(cuts) - 1 <= max(1, groups)
                assert all(offs[a] < offs[b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)) or offs[-1] == 0
    assert segment_cuts(256, 2, ratio=0.6)[1] == 160


def test_segment_cuts():
    """Segments cover the sequence's chunks in order, none empty; the last is half as long as the others (its output
    has no scan part beside it), other ratios on request; or (the one-pass scan's) each part a fixed ratio of the
    one before."""
    from kernels_triton.gdn.bench_api import ONE_PASS_SEGMENT_RATIO, segment_cuts

    assert segment_cuts(512, 4) == [0, 146, 293, 439, 512]
    assert segment_cuts(512, 2) == [0, 341, 512]
    assert segment_cuts(512, 4, (1.0, 1.5, 0.75)) == [0, 108, 269, 431, 512]
    assert segment_cuts(512, 4, ratio=0.6) == [0, 235, 376, 461, 512]  # 1 : 0.6 : 0.36 : 0.216
    assert segment_cuts(512, 3, ratio=1.0) == [0, 171, 341, 512]
    assert all(0 < r <= 1 for r in ONE_PASS_SEGMENT_RATIO.values())
    for n in range(1, 40):
        for parts in range(1, 9):
            for ratio in (None, 0.3, *ONE_PASS_SEGMENT_RATIO.values()):
                cuts = segment_cuts(n, parts, ratio=ratio)
                assert cuts[0] == 0 and cuts[-1] == n, (n, parts, ratio)
                assert all(a < b for a, b in zip(cuts[:-1], cuts[1:], strict=True)), (n, parts, ratio)
                assert len(cuts) - 1 <= parts


@pytest.mark.parametrize("K,V,H,HV", [(96, 96, 1, 3), (64, 64, 2, 4), (128, 128, 1, 1)])
def test_prefill_column_blocks_and_groups(K, V, H, HV):
    """Head dims that take the 64-column block loops of the prepare kernel once, twice with a ragged
    last block, or twice exactly; 1, 2 and 3 value heads per key head; 0/1-length sequences; a pool
    with padding slots."""
    lens = [0, 1, 70, 65]
    d = _inputs(lens, H, HV, K, V, torch.float32, seed=5)
    cu = cu_from_lens(lens, DEV)
    pool = (torch.randn(6, HV, K, V, generator=torch.Generator().manual_seed(6)) * 0.1).to(DEV)
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device=DEV)
    ours_pool, ref_pool = pool.clone(), pool.double().cpu()
    o, _ = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours_pool, state_slots=slots, use_qk_l2norm=True)
    ro, _ = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(), state_pool=ref_pool,
                                  state_slots=slots.cpu(), use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "output")
    assert_close(ours_pool, ref_pool, TOL[torch.float32], "pool")
    for s in (1, 3, 5):
        assert torch.equal(ours_pool[s], pool[s]), f"slot {s} was not named but changed"


def test_short_batches_take_one_launch(monkeypatch):
    """Up to CHUNK tokens in all: one launch (prepare and scan in one program per sequence, head and 64-wide V
    block, each with its own workspace copy), the same results as the two-launch path within fp32 rounding; from
    CHUNK + 1 tokens on, the two launches. bf16 with V < 64 keeps two launches (its one-stage scan tile would be of
    the miscompiled class)."""
    def two(**kw):
        return gdn_bench.gdn_chunk_prefill(**kw, prepare={})  # a forced config: the two-launch path

    for lens, raw, K, V in (([40], False, 64, 64), ([64], True, 32, 128), ([5, 0, 59], True, 64, 64)):
        d = _inputs(lens, 2, 4, K, V, torch.float32, raw=raw)
        gen = torch.Generator().manual_seed(5)
        h0 = (torch.randn(len(lens), 4, K, V, generator=gen) * 0.1).to(DEV)
        kw = dict(d, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
        if len(lens) > 1:
            kw["cu_seqlens"] = cu_from_lens(lens, DEV)
        want_o, want_h = two(**kw)
        calls = []
        monkeypatch.setattr(launch, "launch_scan", lambda *a, calls=calls: calls.append("scan"))
        monkeypatch.setattr(launch, "launch_prepare", lambda *a, calls=calls: calls.append("prepare"))
        got_o, got_h = kt.gdn_chunk_prefill(**kw)
        monkeypatch.undo()
        assert calls == [], calls
        assert_close(got_o, want_o, 1e-5, f"output {lens}")
        assert_close(got_h, want_h, 1e-5, f"final state {lens}")
        ro, rh = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in kw.items() if isinstance(v, torch.Tensor)}),
                                       output_final_state=True, use_qk_l2norm=True)
        assert_close(got_o, ro, TOL[torch.float32], f"output vs reference {lens}")
        assert_close(got_h, rh, TOL[torch.float32], f"final state vs reference {lens}")

    launched = []
    monkeypatch.setattr(launch, "launch_single", lambda *a: launched.append("single"))
    monkeypatch.setattr(launch, "launch_prepare", lambda *a: launched.append("prepare"))
    monkeypatch.setattr(launch, "launch_scan", lambda *a: launched.append("scan"))
    kt.gdn_chunk_prefill(**_inputs([65], 1, 1, 16, 16, torch.float32))
    kt.gdn_chunk_prefill(**_inputs([30], 1, 1, 16, 32, torch.bfloat16))
    kt.gdn_chunk_prefill(**_inputs([30], 1, 1, 16, 64, torch.bfloat16))
    assert launched == ["prepare", "scan", "prepare", "scan", "single"]


def test_prefill_single_sequence_no_state_and_metadata():
    """cu_seqlens=None; and with cu_seqlens the result is the same with or without prepared metadata."""
    T, H, HV, K, V = 150, 2, 2, 32, 32
    d = _inputs([T], H, HV, K, V, torch.float32)
    o, ht = kt.gdn_chunk_prefill(**d, output_final_state=True, use_qk_l2norm=True)
    ro, rht = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), output_final_state=True,
                                    use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "output")
    assert_close(ht, rht, TOL[torch.float32], "final state")
    o_none, _ = kt.gdn_chunk_prefill(**d, use_qk_l2norm=True)
    assert torch.equal(o_none, o)
    o_split, _ = gdn_bench.gdn_chunk_prefill(**d, use_qk_l2norm=True, scan={"BV": 16, "num_warps": 4, "num_stages": 1})
    assert_close(o_split, ro, TOL[torch.float32], "output with the scan in two V blocks")

    cu = cu_from_lens([T], DEV)
    meta = kt.prepare_gdn_metadata(cu, 64)
    o_meta, _ = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, use_qk_l2norm=True, metadata=meta)
    o_dev, _ = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, use_qk_l2norm=True)
    assert torch.equal(o_meta, o) and torch.equal(o_dev, o)
    with pytest.raises(ValueError, match="another cu_seqlens"):
        kt.gdn_chunk_prefill(**d, cu_seqlens=cu.clone(), metadata=meta)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_outputs_written_into_a_callers_buffer(impl):
    """``out=``: prefill rows and decode rows land in slices of one buffer, as the model's GDN layer passes them;
    the rest of the buffer is not touched and the values equal those of a call without ``out``."""
    mod = kt if impl == "triton" else ref
    lens, H, HV, K, V = [70, 0, 5], 2, 4, 32, 32
    T = sum(lens)
    d = _inputs(lens, H, HV, K, V, torch.float32)
    cu = cu_from_lens(lens, DEV)
    pool = (torch.randn(4, HV, K, V, generator=torch.Generator().manual_seed(2)) * 0.1).to(DEV)
    slots = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEV)
    buf = torch.full((T + 3, HV, V), 7.0, device=DEV)
    expected, _ = mod.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=pool.clone(), state_slots=slots,
                                        use_qk_l2norm=True)
    o, none = mod.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=pool.clone(), state_slots=slots,
                                    use_qk_l2norm=True, out=buf[1:T + 1])
    assert none is None and o.data_ptr() == buf[1].data_ptr()
    assert torch.equal(buf[1:T + 1], expected)
    assert torch.all(buf[0] == 7) and torch.all(buf[T + 1:] == 7), "rows outside out were written"

    step = gdn_inputs(1, H, HV, K, V, dtype=torch.float32, device=DEV, raw=True, batch=(2,), seed=5)
    want = mod.gdn_recurrent_step(**step, state_pool=pool.clone(), state_slots=slots[:2], use_qk_l2norm=True)
    got = mod.gdn_recurrent_step(**step, state_pool=pool.clone(), state_slots=slots[:2], use_qk_l2norm=True,
                                 out=buf[T + 1:T + 3, None])
    assert got.data_ptr() == buf[T + 1].data_ptr() and torch.equal(buf[T + 1:T + 3], want[:, 0])


def test_gating_views_of_a_wider_buffer():
    """a and b as column views of one projection output (rows wider than HV, as the model passes them) give the
    results of contiguous copies, in prefill and decode; a head dim that is not unit-stride is refused."""
    lens, H, HV, K, V = [70, 5], 2, 4, 32, 32
    T = sum(lens)
    d = _inputs(lens, H, HV, K, V, torch.float32)
    cu = cu_from_lens(lens, DEV)
    wide = torch.randn(T, 2 * HV + 3, device=DEV)
    wide[:, HV + 1:2 * HV + 1], wide[:, 1:HV + 1] = d["a"], d["b"]
    a, b = wide[:, HV + 1:2 * HV + 1], wide[:, 1:HV + 1]
    assert not a.is_contiguous()
    assert common.gate_rows(None, None, a, b)[4] == 2 * HV + 3  # read in place, not copied
    pool = (torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(2)) * 0.1).to(DEV)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    shared = dict(cu_seqlens=cu, state_slots=slots, use_qk_l2norm=True)
    want, _ = kt.gdn_chunk_prefill(**d, state_pool=pool.clone(), **shared)
    got, _ = kt.gdn_chunk_prefill(**{**d, "a": a, "b": b}, state_pool=pool.clone(), **shared)
    assert torch.equal(got, want)
    rows = torch.tensor([3, 71], device=DEV)  # one token of each sequence, as [B, 1, HV] views
    step = dict(q=d["q"][rows, None], k=d["k"][rows, None], v=d["v"][rows, None], A_log=d["A_log"],
                dt_bias=d["dt_bias"], state_slots=slots, use_qk_l2norm=True)
    want = kt.gdn_recurrent_step(**step, a=d["a"][rows, None], b=d["b"][rows, None], state_pool=pool.clone())
    wide_rows = wide[rows]
    got = kt.gdn_recurrent_step(**step, a=wide_rows[:, None, HV + 1:2 * HV + 1], b=wide_rows[:, None, 1:HV + 1],
                                state_pool=pool.clone())
    assert torch.equal(got, want)
    ops.gdn_chunk_prefill(**{**d, "a": a, "b": b}, state_pool=pool.clone(), **shared)  # the façade accepts views
    with pytest.raises(ValueError, match="head values adjacent"):
        ops.gdn_chunk_prefill(**{**d, "a": wide[:, 0:2 * HV:2]}, state_pool=pool.clone(), **shared)


def test_prefill_chunk_table_host_and_device_agree():
    from kernels_triton.gdn.metadata import chunk_bounds_on_device

    cu = torch.tensor([0, 5, 5, 134, 135], dtype=torch.int32)
    expected = [[0, 5], [5, 69], [69, 133], [133, 134], [134, 135]]
    meta = kt.prepare_gdn_metadata(cu, 64)
    assert meta.num_chunks == 5 and meta.chunk_bounds.tolist() == expected
    table, rows = chunk_bounds_on_device(cu, 135)
    assert rows >= 5 and table[:5].tolist() == expected
    assert all(s == e for s, e in table[5:].tolist()), "rows past the last chunk must be empty"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("stream", [False, True])  # streaming cache hints on the state: same results
def test_decode_step_pool(dtype, T, stream):
    B, H, HV, K, V = 4, 2, 4, 32, 32
    d = gdn_inputs(T, H, HV, K, V, dtype=dtype, device=DEV, raw=(T == 1), batch=(B,), seed=3)
    pool = (torch.randn(6, HV, K, V, generator=torch.Generator().manual_seed(4)) * 0.1).to(DEV)
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device=DEV)
    ours_pool, ref_pool = pool.clone(), pool.double().cpu()
    cfg = {"BV": 16, "num_warps": 1, "STREAM": True} if stream else None
    o = gdn_bench.gdn_recurrent_step(**d, state_pool=ours_pool, state_slots=slots, use_qk_l2norm=True, config=cfg)
    ro = ref.gdn_recurrent_step(**_to64({k: v.cpu() for k, v in d.items()}), state_pool=ref_pool,
                                state_slots=slots.cpu(), use_qk_l2norm=True)
    assert_close(o, ro, TOL[dtype], "output")
    assert_close(ours_pool, ref_pool, TOL[dtype], "pool")
    assert torch.all(o[1] == 0), "padding row must have zero output"
    for s in (1, 3, 4):
        assert torch.equal(ours_pool[s], pool[s]), f"slot {s} was not named but changed"


def test_decode_step_pdl_choice(monkeypatch):
    """Programmatic dependent launch: only on a CUDA device of sm_90+ (the interpreter has no griddepcontrol),
    whatever a config or QWEN35_GDN_PDL asks; a partial forced config ({"PDL": ...}) keeps the heuristic's blocks
    (the same result as none); a QWEN35_GDN_PDL other than 1 / 0 / unset is refused by name."""
    from kernels_triton import _pdl
    from kernels_triton.gdn import recurrent

    cpu = torch.device("cpu")
    for env in ("1", "0", ""):
        monkeypatch.setenv(recurrent.PDL_ENV, env)
        assert not recurrent._use_pdl(cpu, {"PDL": True}) and not recurrent._use_pdl(cpu, {})
    monkeypatch.setattr(_pdl, "device_facts", lambda device: ("some GPU", 132, (9, 0)))
    cuda = torch.device("cuda", 0)
    assert recurrent._use_pdl(cuda, {"PDL": False}) is False and recurrent._use_pdl(cuda, {"PDL": True})
    monkeypatch.delenv(recurrent.PDL_ENV)
    assert recurrent._use_pdl(cuda, {})  # the default on sm_90+
    monkeypatch.setenv(recurrent.PDL_ENV, "0")
    assert not recurrent._use_pdl(cuda, {})
    monkeypatch.setenv(recurrent.PDL_ENV, "1")
    assert recurrent._use_pdl(cuda, {})
    monkeypatch.setenv(recurrent.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="QWEN35_GDN_PDL='yes'"):
        recurrent._use_pdl(cuda, {})
    monkeypatch.setattr(_pdl, "device_facts", lambda device: ("older GPU", 80, (8, 0)))
    monkeypatch.setenv(recurrent.PDL_ENV, "1")
    assert not recurrent._use_pdl(cuda, {"PDL": True})
    monkeypatch.delenv(recurrent.PDL_ENV)

    B, H, HV, K, V = 3, 2, 4, 16, 16
    d = gdn_inputs(1, H, HV, K, V, device=DEV, raw=True, batch=(B,), seed=8)
    pool = (torch.randn(4, HV, K, V, generator=torch.Generator().manual_seed(9)) * 0.1).to(DEV)
    slots = torch.tensor([3, -1, 1], dtype=torch.int32, device=DEV)
    outs = []
    for cfg in (None, {"PDL": False}):
        p = pool.clone()
        outs.append((gdn_bench.gdn_recurrent_step(**d, state_pool=p, state_slots=slots, config=cfg), p))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_rows_beyond_one_grid_dimension(monkeypatch):
    """(sequence, head) pairs spill into grid z past CUDA's 65535 limit on y (B x HV reaches it at B = 1024 with
    64 value heads); forced here with a limit of 5, prefill and decode still match the reference."""
    monkeypatch.setattr(common, "MAX_GRID_Y", 5)
    assert common.grid_rows(12) == (4, 3) and common.grid_rows(5) == (5, 1) and common.grid_rows(11) == (4, 3)
    lens, H, HV, K, V = [5, 70, 3], 2, 4, 16, 16  # 12 pairs over 3 z-slices of 4
    d = _inputs(lens, H, HV, K, V, torch.float32)
    cu = cu_from_lens(lens, DEV)
    o, ht = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True)
    ro, rht = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(),
                                    output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "prefill output")
    assert_close(ht, rht, TOL[torch.float32], "final state")
    B = 3  # 12 pairs again
    dd = gdn_inputs(1, H, HV, K, V, device=DEV, raw=True, batch=(B,), seed=5)
    pool = (torch.randn(4, HV, K, V, generator=torch.Generator().manual_seed(6)) * 0.1).to(DEV)
    slots = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEV)
    ours, theirs = pool.clone(), pool.double().cpu()
    od = kt.gdn_recurrent_step(**dd, state_pool=ours, state_slots=slots, use_qk_l2norm=True)
    rd = ref.gdn_recurrent_step(**_to64({k: v.cpu() for k, v in dd.items()}), state_pool=theirs,
                                state_slots=slots.cpu(), use_qk_l2norm=True)
    assert_close(od, rd, TOL[torch.float32], "decode output")
    assert_close(ours, theirs, TOL[torch.float32], "decode pool")
    assert torch.equal(ours[2], pool[2])


def test_metadata_of_a_rewritten_cu_seqlens_is_not_trusted():
    """A persistent cu_seqlens buffer rewritten for the next batch after its chunk table was prepared: the op
    rebuilds the table instead of reading chunks the prepare phase never wrote."""
    lens_old, lens_new, H, HV, K, V = [70, 30], [10, 90], 2, 2, 16, 16
    d = _inputs(lens_new, H, HV, K, V, torch.float32)
    cu = cu_from_lens(lens_old, DEV)
    meta = kt.prepare_gdn_metadata(cu)
    cu.copy_(cu_from_lens(lens_new, DEV))
    o, _ = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, metadata=meta, use_qk_l2norm=True)
    ro, _ = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(),
                                  use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "output")


def test_metadata_of_an_inference_tensor_is_used():
    """Under ``torch.inference_mode`` (how vLLM runs the model) ``cu_seqlens`` has no version counter: every way of
    preparing the metadata works and the op uses the prepared table."""
    lens, H, HV, K, V = [70, 0, 1, 30], 2, 2, 16, 16
    d = _inputs(lens, H, HV, K, V, torch.float32)
    ro, _ = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}),
                                  cu_seqlens=cu_from_lens(lens, "cpu"), use_qk_l2norm=True)
    offsets = [0, 70, 70, 71, 101]
    chunk_indices = torch.tensor([[0, 0], [0, 1], [2, 0], [3, 0]], dtype=torch.int32, device=DEV)
    with torch.inference_mode():
        cu = cu_from_lens(lens, DEV)
        assert cu.is_inference()
        for kw in ({}, dict(offsets=offsets), dict(chunk_indices=chunk_indices)):
            meta = kt.prepare_gdn_metadata(cu, **kw)
            o, _ = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, metadata=meta, use_qk_l2norm=True)
            assert_close(o, ro, TOL[torch.float32], f"output, metadata from {sorted(kw) or 'cu_seqlens'}")


def test_continuation_prefill_then_decode():
    """Prefill the first part into a pool slot, decode the rest token by token: same as one prefill."""
    T0, T1, H, HV, K, V = 70, 3, 1, 2, 16, 16
    d = _inputs([T0 + T1], H, HV, K, V, torch.float32)
    pool = torch.zeros(2, HV, K, V, device=DEV)
    slot = torch.tensor([1], dtype=torch.int32, device=DEV)
    head = {k: (v[:T0] if v.dim() and v.shape[0] == T0 + T1 else v) for k, v in d.items()}
    o0, _ = kt.gdn_chunk_prefill(**head, state_pool=pool, state_slots=slot, use_qk_l2norm=True)
    outs = [o0]
    for t in range(T0, T0 + T1):
        step = {k: (v[t:t + 1][None] if v.dim() and v.shape[0] == T0 + T1 else v) for k, v in d.items()}
        outs.append(kt.gdn_recurrent_step(**step, state_pool=pool, state_slots=slot, use_qk_l2norm=True)[0])
    ro, rht = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), output_final_state=True,
                                    use_qk_l2norm=True)
    assert_close(torch.cat(outs), ro, TOL[torch.float32], "continued output")
    assert_close(pool[1], rht[0], TOL[torch.float32], "state after continuation")


def test_unsupported_head_dim_raises_before_launch():
    d = gdn_inputs(4, 1, 1, 512, 16, device=DEV)
    with pytest.raises(ValueError, match="head dims"):
        kt.gdn_chunk_prefill(**d)
    d = gdn_inputs(1, 1, 1, 16, 512, device=DEV, batch=(1,))
    with pytest.raises(ValueError, match="head dims"):
        kt.gdn_recurrent_step(**d, state_pool=torch.zeros(1, 1, 16, 512, device=DEV),
                              state_slots=torch.zeros(1, dtype=torch.int32, device=DEV))


def test_facade_forced_triton_selftests_and_runs(fresh_probe, monkeypatch):
    monkeypatch.setenv("QWEN35_BACKEND", "triton")
    fresh_probe.reset()
    for op in ("gdn_chunk_prefill", "gdn_recurrent_step"):
        choice = fresh_probe.choose(op, DEV)
        assert choice.backend == "triton", choice.reason
        budget = 1e-4 if DEV == "cpu" else 1e-2  # the self-test runs fp32 on CPU, bf16 on a GPU
        assert choice.selftest_rel_err is not None and choice.selftest_rel_err < budget, choice.reason
    lens = [3, 66]
    d = _inputs(lens, 2, 4, 16, 16, torch.float32)
    cu = cu_from_lens(lens, DEV)
    meta = ops.prepare_gdn_metadata(cu)
    assert isinstance(meta, kt.gdn.GdnChunkMetadata)
    from_host = ops.prepare_gdn_metadata(cu, offsets=[0, 3, 69])  # the host's copy: no read-back, same table
    assert from_host.num_chunks == meta.num_chunks and torch.equal(from_host.chunk_bounds, meta.chunk_bounds)
    table = torch.from_numpy(ops.gdn_chunk_table([0, 3, 69], DEV)).to(DEV)  # sent by the caller: no copy here
    sent = ops.prepare_gdn_metadata(cu, offsets=[0, 3, 69], table=table)
    assert sent.chunk_bounds is table and sent.num_chunks == meta.num_chunks
    assert torch.equal(sent.chunk_bounds, meta.chunk_bounds)
    empty = ops.prepare_gdn_metadata(cu_from_lens([0, 0], DEV), offsets=[0, 0, 0],
                                     table=torch.from_numpy(ops.gdn_chunk_table([0, 0, 0], DEV)).to(DEV))
    assert empty.num_chunks == 0
    for bad, msg in (((table, None), "table needs offsets"), ((table[:1], [0, 3, 69]), "must be a contiguous int32"),
                     ((table.long(), [0, 3, 69]), "table has dtype int64")):
        with pytest.raises(ValueError, match=msg):
            ops.prepare_gdn_metadata(cu, offsets=bad[1], table=bad[0])
    with pytest.raises(ValueError, match="non-empty list"):
        ops.gdn_chunk_table([], DEV)
    # FLA's (sequence, chunk) indices, as vLLM's GDN metadata carries them: the table is derived on the device
    fla = torch.tensor([[0, 0], [1, 0], [1, 1]], dtype=torch.int32, device=DEV)
    from_fla = ops.prepare_gdn_metadata(cu, 64, chunk_indices=fla)
    assert from_fla.num_chunks == meta.num_chunks and torch.equal(from_fla.chunk_bounds, meta.chunk_bounds)
    none = ops.prepare_gdn_metadata(cu_from_lens([0, 0], DEV), 64, chunk_indices=fla[:0])
    assert none.num_chunks == 0
    for kw, msg in ((dict(chunk_size=32), "32-token chunks"), (dict(offsets=[0, 3, 69]), "chunk_indices alone"),
                    (dict(chunk_indices=fla[:, :1].contiguous()), "chunk_indices has shape")):
        with pytest.raises(ValueError, match=msg):
            ops.prepare_gdn_metadata(cu, **{"chunk_indices": fla, **kw})
    for bad, msg in (([0, 3], "holds 2 offsets"), ([1, 3, 69], "must start at 0"), ([0, 5, 3], "non-decreasing"),
                     (cu, "not a tensor"), ([0, 3.0, 69], "must hold ints")):
        with pytest.raises(ValueError, match=msg):
            ops.prepare_gdn_metadata(cu, offsets=bad)
    o, ht = ops.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True, metadata=meta)
    ro, rht = ref.gdn_chunk_prefill(**_to64({k: v.cpu() for k, v in d.items()}), cu_seqlens=cu.cpu(),
                                    output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "façade output")
    assert_close(ht, rht, TOL[torch.float32], "façade final state")


@pytest.mark.parametrize("smem,dtype,K,stages", [
    (232448, torch.bfloat16, 128, 3), (232448, torch.float16, 128, 2), (232448, torch.float32, 128, 2),
    (166912, torch.bfloat16, 128, 2), (166912, torch.float32, 128, 1), (232448, torch.bfloat16, 256, 1),
])
def test_scan_stages_fit_shared_memory(monkeypatch, smem, dtype, K, stages):
    """The scan's pipeline depth fits the device's shared memory (H200: 227 KB, A100: 163 KB) for the
    workspace dtype: 3 bf16 stages take 206 KB at K = V = 128, 3 fp32-workspace stages 329 KB."""
    monkeypatch.setattr(plan, "device_facts", lambda device: ("test-gpu", 132, (9, 0)))
    monkeypatch.setattr(plan, "shared_memory_per_block", lambda device: smem)
    plan.scan_config.cache_clear()
    try:
        cfg = plan.scan_config(torch.device("cuda", 0), 2, 48, K, 128, 32768, dtype)  # two sequences: two groups
        one = plan.scan_config(torch.device("cuda", 0), 1, 48, K, 128, 32768, dtype)  # one: in four parts
    finally:
        plan.scan_config.cache_clear()
    base = {"BV": 64, "num_warps": 4, "num_stages": stages}
    assert cfg == dict(base, GROUPS=2, SEG_PREPARE=True)
    assert one == dict(base, SEGMENTS=4, SEG_PREPARE=True)


def test_scan_groups_several_long_sequences(monkeypatch):
    """The one-pass scan of several sequences of >= 8192 tokens at >= 32 value heads runs in two groups of
    sequences (tuning/notes_gdn.md); fewer value heads, shorter sequences or one sequence do not."""
    monkeypatch.setattr(plan, "device_facts", lambda device: ("test-gpu", 132, (9, 0)))
    monkeypatch.setattr(plan, "shared_memory_per_block", lambda device: 232448)
    plan.scan_config.cache_clear()
    plan.plan_for.cache_clear()
    dev = torch.device("cuda", 0)
    try:
        for N, HV, per_seq, groups in ((8, 48, 8192, 2), (2, 32, 16384, 2), (4, 32, 8192, 2), (8, 48, 4096, 1),
                                       (8, 12, 8192, 1), (8, 8, 8192, 1), (64, 48, 512, 1), (1, 48, 8192, 1)):
            cfg = plan.scan_config(dev, N, HV, 128, 128, per_seq, torch.bfloat16)
            assert cfg.get("GROUPS", 1) == groups and cfg.get("SEG_PREPARE", False) == (groups > 1), (N, HV, cfg)
        got = plan.plan_for(dev, torch.bfloat16, 4, 48, 128, 128, 8192)
        assert got.groups == 2 and got.seg_prepare and not got.split and "GROUPS" not in got.scan_options
    finally:
        plan.scan_config.cache_clear()
        plan.plan_for.cache_clear()


@pytest.mark.parametrize("pairs,sms,bv", [(8, 132, 16), (12, 132, 16), (16, 132, 16), (31, 132, 32), (32, 132, 32),
                                          (33, 132, 64), (48, 132, 64), (256, 132, 64), (32, 108, 64),
                                          (24, 80, 64)])
def test_scan_v_blocks_follow_the_sm_count(monkeypatch, pairs, sms, bv):
    """(sequence, head) pairs -> V block of the scan: 16 up to 16 pairs (the split scan); above, 64-wide blocks once
    they make at least half as many programs as there are SMs, else 32 (32 pairs on 132 SMs take 32-wide blocks)."""
    monkeypatch.setattr(plan, "device_facts", lambda device: ("test-gpu", sms, (9, 0)))
    monkeypatch.setattr(plan, "shared_memory_per_block", lambda device: 232448)
    plan.scan_config.cache_clear()
    try:
        cfg = plan.scan_config(torch.device("cuda", 0), 1, pairs, 128, 128, 8192, torch.bfloat16)
    finally:
        plan.scan_config.cache_clear()
    assert cfg["BV"] == bv


@pytest.mark.parametrize("smem,stages", [(232448, {torch.bfloat16: 4, torch.float16: 3, torch.float32: 3}),
                                         (166912, {torch.bfloat16: 4, torch.float16: 3, torch.float32: 2}),
                                         (101376, {torch.bfloat16: 2, torch.float16: 1, torch.float32: 1})])
def test_scan_splits_off_the_output_at_few_pairs(monkeypatch, smem, stages):
    """Up to 16 (sequence, head) pairs, sequences of >= 1024 tokens and V >= 64: the split scan (state path alone,
    output in a parallel launch), BV 16, as many stages as the device's shared memory holds (sm_90
    builds: bf16 108 / 143 KB at 3 / 4 stages, fp16 144 KB at 3, fp32 214 KB at 3); otherwise the one-pass scan.
    One sequence of >= 16384 tokens also in parts (a part per 8192 tokens, at most 6)."""
    monkeypatch.setattr(plan, "device_facts", lambda device: ("test-gpu", 132, (9, 0)))
    monkeypatch.setattr(plan, "shared_memory_per_block", lambda device: smem)
    plan.scan_config.cache_clear()
    dev = torch.device("cuda", 0)
    try:
        for dtype, st in stages.items():
            for N, HV in ((1, 8), (1, 12), (2, 8), (4, 4)):
                cfg = plan.scan_config(dev, N, HV, 128, 128, 32768, dtype)
                parts = 4 if N == 1 else 1
                assert cfg == {"BV": 16, "num_warps": 4, "num_stages": st, "SPLIT": True, "SEGMENTS": parts,
                               "SEG_PREPARE": parts > 1}, (dtype, N, HV)
            for per_seq, parts in ((1024, 1), (8192, 1), (16384, 2), (65536, 6), (1 << 20, 6)):
                assert plan.scan_config(dev, 1, 8, 128, 128, per_seq, dtype)["SEGMENTS"] == parts, per_seq
            for args in ((1, 32, 128, 128, 32768), (3, 8, 128, 128, 8192), (1, 8, 128, 128, 512),
                         (1, 8, 128, 32, 8192)):
                assert "SPLIT" not in plan.scan_config(dev, *args, dtype), (dtype, args)
        got = plan.plan_for(dev, torch.bfloat16, 1, 8, 128, 128, 32768)
        assert got.split and got.scan.BV == 16 and "SPLIT" not in got.scan_options
        assert got.segments == 4 and got.seg_prepare and "SEGMENTS" not in got.scan_options
    finally:
        plan.scan_config.cache_clear()
        plan.plan_for.cache_clear()


@pytest.mark.parametrize("smem", [101376, 166912, 232448])
@pytest.mark.parametrize("pairs", [1, 8, 32, 48, 256])
@pytest.mark.parametrize("V", [32, 128])
def test_scan_heuristic_avoids_the_miscompiled_configs(monkeypatch, smem, pairs, V):
    """bf16 scans in one pipeline stage with V blocks under 64 are built wrong by Triton 3.6 on an H200 (wrong
    output at BV 32, an illegal shared-memory address at BV 16): no device size makes the heuristic
    pick one. Small-shared-memory GPUs (one stage) take 64-wide blocks instead."""
    monkeypatch.setattr(plan, "device_facts", lambda device: ("test-gpu", 132, (9, 0)))
    monkeypatch.setattr(plan, "shared_memory_per_block", lambda device: smem)
    plan.scan_config.cache_clear()
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            cfg = plan.scan_config(torch.device("cuda", 0), 1, pairs, 128, V, 8192, dtype)
            assert not plan.miscompiled_scan(dtype, cfg["BV"], cfg["num_stages"]), (dtype, cfg)
            if dtype == torch.bfloat16 and smem < 145_000 and V >= 64 and pairs > 16:
                assert cfg == {"BV": 64, "num_warps": 4, "num_stages": 1}
    finally:
        plan.scan_config.cache_clear()


def test_launch_configs_triton_builds_wrong_are_refused():
    """A forced scan config in the miscompiled class, prepare stages other than 1 (two stages gave wrong output on
    an H200), and config keys or values outside the accepted ones raise before anything is launched, naming them."""
    base = plan.plan_for(torch.device("cpu"), torch.bfloat16, 1, 4, 128, 128, 1024)
    for bv in (16, 32):
        with pytest.raises(ValueError, match="num_stages >= 2 or BV >= 64"):
            base.with_configs(torch.device("cuda"), torch.bfloat16, None, {"BV": bv, "num_warps": 4, "num_stages": 1})
    ok = base.with_configs(torch.device("cuda"), torch.bfloat16, None, {"BV": 64, "num_warps": 4, "num_stages": 1})
    assert ok.scan.BV == 64 and ok.scan_options == {"num_warps": 4, "num_stages": 1}
    base.with_configs(torch.device("cuda"), torch.float16, None, {"BV": 16, "num_warps": 4, "num_stages": 1})
    d = _inputs([20], 1, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="num_stages=2"):
        gdn_bench.gdn_chunk_prefill(**d, prepare={"num_warps": 4, "num_stages": 2})
    with pytest.raises(ValueError, match="BKC=8"):
        gdn_bench.gdn_chunk_prefill(**d, prepare={"num_warps": 4, "num_stages": 1, "BKC": 8})
    with pytest.raises(ValueError, match=r"prepare config keys \['STOP'\]: accepted DIAG_ROWS"):
        gdn_bench.gdn_chunk_prefill(**d, prepare={"STOP": 1})
    with pytest.raises(ValueError, match=r"scan config keys \['SPLITS'\]"):
        gdn_bench.gdn_chunk_prefill(**d, scan={"BV": 16, "SPLITS": True})
    with pytest.raises(ValueError, match="BV is required"):
        gdn_bench.gdn_chunk_prefill(**d, scan={"num_warps": 4})


def test_prepare_column_blocks_give_the_same_result():
    """The prepare kernel's q/k/v column blocks (BKC, BVC: a benchmark knob) change only the order of sums."""
    d = _inputs([150, 0, 70], 2, 4, 64, 64, torch.float32)
    cu = cu_from_lens([150, 0, 70], DEV)
    want, _ = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, use_qk_l2norm=True)
    got, _ = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, use_qk_l2norm=True, prepare={"BKC": 32, "BVC": 16})
    assert_close(got, want, 1e-5, "32 / 16-column blocks")


# ----------------------------------------------------------------------------- the Hopper build, on a CPU

_HOPPER_BUILD = r'''
from helpers import build_sm90
from kernels_triton import conv1d, norms
from kernels_triton.gdn import prepare, recurrent, scan

def sm90(kernel, consts, dtypes, warps=4, stages=2):
    build_sm90(kernel, dtypes, consts, warps, stages, divisible=("D",))

act = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "o_ptr", "ws_ptr", "x_ptr", "y_ptr",
                            "z_ptr", "w_ptr", "bias_ptr", "res_ptr", "s_ptr", "pool_ptr")}
act.update({n: "*fp32" for n in ("A_log_ptr", "dt_bias_ptr", "gcum_ptr", "h0_ptr", "ht_ptr")}, has_init_ptr="*i1")
dims = dict(K=128, V=128, C=64)
for diag_rows, block_inv, scale_k, t_out in ((16, 0, False, False), (4, 0, False, False), (4, 1, True, False),
                                          (4, 1, True, True)):
    sm90(prepare._chunk_prepare_kernel, dict(dims, BKC=64, BVC=64, VARLEN=True, RAW_GATING=True, USE_L2=True,
                                             DOT_PREC="tf32", DIAG_ROWS=diag_rows, BLOCK_INV=block_inv,
                                             SCALE_K=scale_k, T_OUT=t_out, g_ptr=None, beta_ptr=None), act, stages=1)
for bv, stages, split, part, scan_t in ((64, 3, False, False, False), (16, 3, False, False, False),
                                        (16, 4, True, False, False), (16, 4, True, True, False),
                                        (64, 3, False, True, True), (32, 3, False, False, True),
                                        (16, 4, True, True, True)):
    sm90(scan._chunk_scan_kernel, dict(dims, BK=128, BV=bv, VARLEN=True, STATE_IN=True, STATE_OUT=True, POOL=True,
                                       HAS_INIT_FLAGS=True, DOT_PREC="tf32", SPLIT=split, PART=part,
                                       CARRY_IN=part, CARRY_OUT=part, SCAN_T=scan_t),
         dict(act, st_ptr="*bf16", carry_ptr="*fp32"), stages=stages)
sm90(scan._chunk_output_kernel, dict(dims, BK=128, BV=64, VARLEN=True, DOT_PREC="tf32"), dict(act, st_ptr="*bf16"),
     stages=1)
sm90(scan._chunk_single_kernel, dict(dims, BKC=64, BVC=64, BK=128, BV=64, VARLEN=True, RAW_GATING=True, USE_L2=True,
                                     STATE_IN=True, STATE_OUT=True, POOL=True, HAS_INIT_FLAGS=True, DOT_PREC="tf32",
                                     DIAG_ROWS=4, BLOCK_INV=1, SCALE_K=True, g_ptr=None, beta_ptr=None), act, stages=1)
fp16 = dict(act, q_ptr="*fp16", k_ptr="*fp16", o_ptr="*fp16", ws_ptr="*fp32")
sm90(scan._chunk_scan_kernel, dict(dims, BK=128, BV=32, VARLEN=False, STATE_IN=False, STATE_OUT=True, POOL=False,
                                   HAS_INIT_FLAGS=False, DOT_PREC="tf32", SPLIT=False, PART=False, CARRY_IN=False,
                                   CARRY_OUT=False, SCAN_T=False, carry_ptr=None, cu_ptr=None, h0_ptr=None,
                                   slots_ptr=None, has_init_ptr=None, st_ptr=None), fp16)
for stream in (False, True):
    sm90(recurrent._recurrent_step_kernel, dict(T=2, K=128, V=128, BK=128, BV=64, RAW_GATING=True, USE_L2=True,
                                                g_ptr=None, beta_ptr=None, STREAM=stream),
         dict(act, pool_ptr="*fp32"), warps=4)
sm90(conv1d._conv_prefill_kernel, dict(W=4, BT=16, BD=128, SEARCH_STEPS=6, VARLEN=True, SKIP_HEADS=True,
                                       HAS_BIAS=True, SILU=True), act)
sm90(conv1d._conv_head_kernel, dict(W=4, BD=128, BH=4, VARLEN=True, HAS_INIT_FLAGS=True, HAS_BIAS=True, SILU=True),
     act)
sm90(conv1d._conv_update_kernel, dict(W=4, BD=256, BW=4, HAS_BIAS=True, SILU=True), act)
sm90(norms._rms_norm_kernel, dict(BM=32, BN=128, ONE_PASS=True, GATED=True, ZERO_CENTERED=False, RESIDUAL=False,
                                  res_ptr=None, s_ptr=None), act, warps=8)
sm90(norms._rms_norm_kernel, dict(BM=1, BN=2048, ONE_PASS=False, GATED=False, ZERO_CENTERED=True, RESIDUAL=True,
                                  z_ptr=None), act, warps=8)
print("built")
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run these kernels for real")
def test_kernels_build_for_hopper():
    """GDN, conv and norm kernels compile to sm_90 code with Triton's bundled ptxas, no GPU needed
    (the interpreter checks numbers; this checks layouts, dot shapes and register allocation)."""
    from helpers import assert_builds

    assert_builds(_HOPPER_BUILD)


def test_bf16_workspace_only_from_32_columns():
    """bf16 prepare tiles of 16 columns are built wrong by Triton 3.6 (seen on the H200): bf16 with a head dim under
    32 takes the fp32 workspace and tf32 dots, as fp16 does; every Qwen3.5 size (128) and the tiny models (32) keep
    bf16."""
    cpu = torch.device("cpu")
    assert plan.workspace_dtype(torch.bfloat16, cpu, 128, 128) == (torch.bfloat16, "tf32")
    assert plan.workspace_dtype(torch.bfloat16, cpu, 32, 32) == (torch.bfloat16, "tf32")
    for K, V in ((16, 48), (32, 16), (16, 16)):
        assert plan.workspace_dtype(torch.bfloat16, cpu, K, V) == (torch.float32, "tf32"), (K, V)
    assert plan.workspace_dtype(torch.float16, cpu, 16, 16) == (torch.float32, "tf32")


def test_diagonal_rows_outside_the_accepted_set_are_refused():
    d = _inputs([20], 1, 1, 16, 16, torch.float32)
    for bad in (2, 32):
        with pytest.raises(ValueError, match=f"DIAG_ROWS={bad}: accepted 4, 8 or 16"):
            gdn_bench.gdn_chunk_prefill(**d, prepare={"num_warps": 4, "num_stages": 1, "DIAG_ROWS": bad})
    with pytest.raises(ValueError, match="BLOCK_INV=2: accepted 0"):
        gdn_bench.gdn_chunk_prefill(**d, prepare={"num_warps": 4, "num_stages": 1, "BLOCK_INV": 2})


def test_default_diagonal_inverse_by_device_and_dtype(monkeypatch):
    """bf16 and fp16 on sm80+ invert 4-row diagonal blocks, merge up to 16 rows on the blocks and form W from
    T diag(beta); fp32 and pre-sm80 devices keep 16-row blocks and full-tile merges (see plan.prepare_config)."""
    for cc, rows in (((9, 0), {torch.bfloat16: 4, torch.float16: 4, torch.float32: 16}),
                     ((7, 0), {torch.bfloat16: 16, torch.float16: 16, torch.float32: 16})):
        monkeypatch.setattr(plan, "device_facts", lambda device, cc=cc: ("some GPU", 80, cc))
        plan.prepare_config.cache_clear()
        for dtype, diag_rows in rows.items():
            flags, _ = plan.prepare_config(torch.device("cuda"), dtype)
            assert flags["DIAG_ROWS"] == diag_rows, (cc, dtype)  # 4-row blocks only where the merges are tf32
            four = diag_rows == 4  # measured with 4-row blocks
            assert flags["BLOCK_INV"] == (1 if four else 0) and flags["SCALE_K"] == four, (cc, dtype)
    plan.prepare_config.cache_clear()


def test_tuned_entries_give_only_launch_fields(tmp_path, monkeypatch):
    """A tuned file's entry may record what was measured next to its config; only the config reaches the launch."""
    import json

    from kernels_triton import _config
    slug = _config.device_slug("NVIDIA H200")
    (tmp_path / slug).mkdir()
    entry = {"BV": 32, "num_warps": 4, "num_stages": 2, "kernel_ms": 1.23}
    (tmp_path / slug / "gdn_chunk_scan.json").write_text(json.dumps(
        {"entries": {"HV=48,V=128,dtype=bfloat16": {"8192": entry}}}))
    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(plan, "device_facts", lambda device: ("NVIDIA H200", 132, (9, 0)))
    _config.clear_cache()  # also forgets the choices made from the files (plan.scan_config's cache)
    try:
        got = plan.scan_config(torch.device("cuda"), 1, 48, 128, 128, 8192, torch.bfloat16)
    finally:
        _config.clear_cache()
    assert got == {"BV": 32, "num_warps": 4, "num_stages": 2}


def test_decode_step_config_heuristic(monkeypatch):
    """Heuristic decode blocks by (row, head) pairs; streaming hints only with the large blocks (H200 sweeps)."""
    from kernels_triton.gdn import recurrent

    monkeypatch.setattr(recurrent, "device_facts", lambda device: ("some GPU", 132, (9, 0)))
    recurrent.step_config.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert recurrent.step_config(cuda, 1, 48, 128) == {"BV": 16, "num_warps": 1}
        assert recurrent.step_config(cuda, 32, 8, 128) == {"BV": 32, "num_warps": 1}
        assert recurrent.step_config(cuda, 128, 8, 128) == {"BV": 64, "num_warps": 4, "STREAM": True}
    finally:
        recurrent.step_config.cache_clear()
