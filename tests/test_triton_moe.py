"""Triton MoE (kernels_triton.moe) vs the reference: routing, alignment, grouped GEMMs, combine, shared expert.

Runs on CPU under TRITON_INTERPRET=1 (tiny shapes), or on CUDA when present. bf16 GEMMs are left
to the GPU tests: the interpreter's bf16 ``tl.dot`` returns garbage (~1e10), while its fp16 and
fp32 dots are right.
"""

from __future__ import annotations

import json
import logging
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import pytest  # noqa: E402
import triton  # noqa: E402
from helpers import assert_builds, assert_close, rel_err  # noqa: E402

from kernels_triton import _config  # noqa: E402
from kernels_triton import moe as tmoe  # noqa: E402
from kernels_triton._arrival import arrival_counter, block_counters  # noqa: E402
from kernels_triton.moe import align as talign  # noqa: E402
from kernels_triton.moe import config as tconfig  # noqa: E402
from qwen35 import ops  # noqa: E402
from qwen35 import reference as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative error budgets of expert outputs per (device, dtype). CPU (the interpreter, numpy fp32 dots): fp32 blocks
# measured within 2.4e-6 of the fp64 reference, fp16 ones within 4.3e-4 (their own rounding); GPU: the budgets the
# GPU suite runs these cases with.
TOL = {"cpu": {torch.float32: 1e-5, torch.float16: 2e-3},
       "cuda": {torch.float32: 2e-3, torch.float16: 4e-3}}[DEVICE]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN in never-stored padding rows


def _rnd(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _experts(gen, E, H, I, dtype):
    return _rnd(gen, E, 2 * I, H, scale=H**-0.5, dtype=dtype), _rnd(gen, E, H, I, scale=I**-0.5, dtype=dtype)


def _f64(*ts):
    return [None if t is None else t.double().cpu() for t in ts]


def _check_experts(x, w13, w2, weights, ids, emap=None, tol=None):
    out = tmoe.moe_experts(x, w13, w2, weights, ids, emap)
    assert out.dtype == x.dtype and out.shape == x.shape
    expect = ref.moe_experts(*_f64(x, w13, w2, weights), ids.cpu(), None if emap is None else emap.cpu())
    assert_close(out, expect, tol or TOL[x.dtype], "moe_experts")
    return out


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("E,k", [(8, 1), (40, 4), (300, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_reference(E, k, dtype, renormalize):
    gen = torch.Generator().manual_seed(E + k)
    logits = _rnd(gen, 21, E, scale=2.0, dtype=dtype)
    weights, ids = tmoe.moe_route(logits, k, renormalize)
    rw, rid = ref.moe_route(logits.cpu(), k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), rid)
    assert_close(weights, rw, 1e-6, "route weights")


def test_route_ties_go_to_the_lowest_id():
    logits = torch.zeros(3, 12, device=DEVICE)
    logits[1, [3, 7, 9]] = 1.0  # a three-way tie at the top, then eleven-way... at the bottom
    logits[2] = torch.tensor([0, 5, 5, 1, 5, 0, 0, 1, 1, 2, 2, 5], dtype=torch.float32)
    weights, ids = tmoe.moe_route(logits, 5)
    rw, rid = ref.moe_route(logits.cpu(), 5)
    assert ids[0].tolist() == [0, 1, 2, 3, 4]
    assert ids[1].tolist() == [3, 7, 9, 0, 1]
    assert ids[2].tolist() == [1, 2, 4, 11, 9]
    assert torch.equal(ids.cpu(), rid)
    assert_close(weights, rw, 1e-6, "tied weights")


@pytest.mark.parametrize("E,k", [(6, 5), (64, 8), (40, 16)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_one_row_tiles_equal_many_row_tiles(E, k, renormalize):
    """Tiles of one row (up to 64 tokens) pick by one bitonic top-k (``tl.topk``), tiles of several rows by TOP_K max
    reductions: the same ids, ties included (-0.0 and 0.0 tie as well), and the weights to rounding (their sums run
    in another order); both the reference's ids."""
    from kernels_triton.moe import routing

    gen = torch.Generator().manual_seed(E * k)
    logits = _rnd(gen, 1024, E, scale=2.0)
    logits[:, ::3] = logits[:, :1]  # ties in every row
    logits[1] = 0.0
    logits[2, ::2] = -0.0
    few = torch.cat([logits[:5], logits[1000:1010]])
    assert routing.route_launch_params(few.shape[0], E, k)["ROWS"] == 1
    assert routing.route_launch_params(1024, E, k)["ROWS"] > 1
    w_one, id_one = routing.route(few, k, renormalize)
    w_many, id_many = routing.route(logits, k, renormalize)
    rows = torch.cat([torch.arange(5), torch.arange(1000, 1010)]).to(DEVICE)
    assert torch.equal(id_one, id_many[rows])
    assert_close(w_one, w_many[rows], 1e-6, "one-row vs many-row tile weights")
    rw, rid = ref.moe_route(logits.cpu(), k, renormalize)
    assert torch.equal(id_many.cpu(), rid)
    rw_few, rid_few = ref.moe_route(few.cpu(), k, renormalize)
    assert torch.equal(id_one.cpu(), rid_few)
    assert_close(w_one, rw_few, 1e-6, "one-row tile weights vs reference")


# ----------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_alignment_groups_slots_by_expert(single, shared, monkeypatch):
    if not single:  # force the multi-chunk path on a small input: several chunks, scan tiles of 1 chunk
        for name, value in (("SINGLE_CHUNK_MAX", 32), ("MAX_CHUNKS", 2), ("SCAN_TILE", 16)):
            monkeypatch.setattr(talign, name, value)
    gen = torch.Generator().manual_seed(1)
    E, block_m = 10, 16
    ids = torch.randint(0, 13, (70, 3), generator=gen, dtype=torch.int32)  # 13 global experts
    emap = torch.tensor([0, -1, 1, 2, 3, -1, 4, 5, 6, 7, 8, -1, 9], dtype=torch.int32)
    local = emap[ids.long()]
    if shared:  # the shared expert's slot: global id 13 -> group E
        ids = torch.cat([ids, torch.full((70, 1), 13, dtype=torch.int32)], dim=1)
        local = torch.cat([local, torch.full((70, 1), E, dtype=torch.int32)], dim=1)
    al = talign.align(ids.to(DEVICE), n_local=E, block_m=block_m, expert_map=emap.to(DEVICE), shared=shared)
    local = local.flatten()
    assert torch.equal(al.slot_group.cpu(), local)
    n_blocks = 0
    for g in range(E + int(shared)):
        start, count = int(al.group_start[g]), int(al.group_count[g])
        want = torch.nonzero(local == g).flatten().int()
        assert count == want.numel() and (count == 0 or start == n_blocks * block_m)  # no slots: start unspecified
        assert torch.equal(al.sorted_slots[start:start + count].cpu(), want), f"group {g}: slots out of order"
        blocks = -(-count // block_m)
        assert (al.block_group[n_blocks:n_blocks + blocks].cpu() == g).all()
        n_blocks += blocks
    assert int(al.total_blocks) == n_blocks <= al.max_blocks


def _stable_sort_alignment(ids, n_local, block_m, emap=None, shared=False):
    """The alignment built in plain torch: each slot's group, then a stable sort by group (shared slots last)."""
    M, slots = ids.shape
    top_k = slots - int(shared)
    e_global = emap.shape[0] if emap is not None else n_local
    routed = ids[:, :top_k].long()
    valid = (routed >= 0) & (routed < e_global)
    local = emap.long()[routed.clamp(0, e_global - 1)] if emap is not None else routed
    groups = torch.full((M, slots), -1, dtype=torch.long)
    groups[:, :top_k] = torch.where(valid, local, -1)
    if shared:
        groups[:, top_k] = n_local
    groups = groups.flatten()
    G = n_local + int(shared)
    order = torch.sort(torch.where(groups >= 0, groups, G), stable=True).indices
    counts = torch.bincount(groups[groups >= 0], minlength=G)
    blocks = -(-counts // block_m)
    starts = (torch.cumsum(blocks, 0) - blocks) * block_m
    total = int(blocks.sum())
    rows = torch.full((max(total * block_m, 1),), -1, dtype=torch.long)  # -1: padding row (content unspecified)
    kept = order[: int(counts.sum())]
    rank = torch.arange(kept.numel()) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    rows[starts.repeat_interleave(counts) + rank] = kept
    return dict(slot_group=groups, group_count=counts, group_start=starts, total_blocks=total,
                block_group=torch.arange(G).repeat_interleave(blocks), sorted_rows=rows)


def _assert_same_alignment(al, want):
    assert torch.equal(al.slot_group.cpu().long(), want["slot_group"])
    assert torch.equal(al.group_count.cpu().long(), want["group_count"])
    used = want["group_count"] > 0  # a group without slots: its start is unspecified (0 from one program)
    assert torch.equal(al.group_start.cpu().long()[used], want["group_start"][used])
    total = int(al.total_blocks)
    assert total == want["total_blocks"] <= al.max_blocks
    assert torch.equal(al.block_group[:total].cpu().long(), want["block_group"])
    real = want["sorted_rows"] >= 0
    assert torch.equal(al.sorted_slots[: real.numel()].cpu().long()[real], want["sorted_rows"][real])


def _force_chunks(monkeypatch, chunk_slots):
    """Every input takes the two-launch path, in chunks of at most ``chunk_slots`` routed slots, <= 4 chunks when
    that fits (the last chunk is ragged unless M divides evenly), scan tiles of 1 chunk."""
    for name, value in (("SINGLE_CHUNK_MAX", 0), ("ALIGN_LAST_MAX_SLOTS", 0), ("CHUNK_SLOTS_MAX", chunk_slots),
                        ("MAX_CHUNKS", 4), ("SCAN_TILE", 16)):
        monkeypatch.setattr(talign, name, value)


_EMAP = torch.tensor([0, -1, 1, 2, -1, 3, 4, -1, 5], dtype=torch.int32)  # 9 global experts, 6 held here


@pytest.mark.parametrize("M", [1, 2, 3, 17, 130, 300])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_alignment_equals_a_stable_sort(M, chunked, mapped, monkeypatch):
    """align(ids, shared=True) gives exactly the stable sort's layout: default limits (one program; at M = 300
    without a map, 1200 routed slots, chunks of 16 tokens) or forced small chunks (ragged last)."""
    if chunked:
        _force_chunks(monkeypatch, 64)
    gen = torch.Generator().manual_seed(M)
    emap = _EMAP if mapped else None
    n_local, top_k = (6, 3) if mapped else (9, 4)
    ids = torch.randint(0, 9, (M, top_k), generator=gen, dtype=torch.int32)
    ids = torch.cat([ids, torch.full((M, 1), 9, dtype=torch.int32)], dim=1)  # the shared slot: global id 9
    al = talign.align(ids.to(DEVICE), n_local=n_local, block_m=16, shared=True,
                      expert_map=None if emap is None else emap.to(DEVICE))
    _assert_same_alignment(al, _stable_sort_alignment(ids, n_local, 16, emap, shared=True))


@pytest.mark.parametrize("M,block_m", [(1, 16), (5, 4), (12, 2), (40, 16), (300, 16)])
def test_one_program_alignment_runs(M, block_m):
    """The one-program alignment (slots placed by runs of the sorted keys) gives the stable sort's layout with
    groups of several blocks (skewed picks, small blocks), dropped slots and the shared group; a group without
    slots gets start and count 0."""
    gen = torch.Generator().manual_seed(100 + M)
    top_k = 3
    ids = torch.randint(0, 9, (M, top_k), generator=gen, dtype=torch.int32)
    ids[: M // 2, 0] = 2  # half the tokens' first pick on one expert: its group spans several blocks
    ids = torch.cat([ids, torch.full((M, 1), 9, dtype=torch.int32)], dim=1)  # the shared slot: global id 9
    al = talign.align(ids.to(DEVICE), n_local=6, block_m=block_m, shared=True, expert_map=_EMAP.to(DEVICE))
    want = _stable_sort_alignment(ids, 6, block_m, _EMAP, shared=True)
    _assert_same_alignment(al, want)
    empty = want["group_count"] == 0
    assert empty.any() or M > 1  # one token picks 3 of 6 local groups at most: some are empty
    assert (al.group_start.cpu()[empty] == 0).all() and (al.group_count.cpu()[empty] == 0).all()


@pytest.mark.parametrize("M,chunked", [(1, False), (2, False), (17, False), (85, False), (3, True), (17, True),
                                       (130, True)])
@pytest.mark.parametrize("gate", [False, True])
def test_route_and_align_equals_a_stable_sort(M, chunked, gate, monkeypatch):
    """moe_block's routing + alignment (decode-sized: one launch, the last routing program aligns; else route +
    count, scatter): the stable sort's layout of the ids it returns, and the shared slot weighted sigmoid(x . gate)
    (1 without a gate)."""
    from kernels_triton.moe import routing as trouting

    if chunked:
        _force_chunks(monkeypatch, 32)
    gen = torch.Generator().manual_seed(M + gate)
    E_global, H, top_k = 9, 32, 3
    x, router_w, gate_w = _rnd(gen, M, H), _rnd(gen, E_global, H), _rnd(gen, 1, H)
    logits, n_splits = trouting.router_logits(x, router_w, gate_w if gate else None)
    weights, ids, al = talign.route_and_align(logits, n_splits, top_k, True, n_experts=E_global, n_local=6,
                                              block_m=16, expert_map=_EMAP.to(DEVICE), gate=gate, shared=True)
    _, want_ids = ref.moe_route((x @ router_w.T).cpu(), top_k)
    assert torch.equal(ids[:, :top_k].cpu(), want_ids) and (ids[:, top_k] == E_global).all()
    want_shared = torch.sigmoid(x @ gate_w.T).flatten() if gate else torch.ones(M, device=DEVICE)
    assert_close(weights[:, top_k], want_shared, 1e-5, "shared weight")
    alone = trouting.route(logits, top_k, True, n_splits=n_splits, n_experts=E_global, gate=gate, shared=True)
    assert torch.equal(alone[0], weights) and torch.equal(alone[1], ids), "route alone differs from route_and_align"
    _assert_same_alignment(al, _stable_sort_alignment(ids.cpu(), 6, 16, _EMAP, shared=True))


# ----------------------------------------------------------------------------- experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 37])
def test_experts_match_reference(M, dtype):
    gen = torch.Generator().manual_seed(M)
    E, k, H, I = 8, 2, 64, 32
    w13, w2 = _experts(gen, E, H, I, dtype)
    weights, ids = ref.moe_route(torch.randn(M, E, generator=gen), k)
    _check_experts(_rnd(gen, M, H, dtype=dtype), w13, w2, weights.to(DEVICE), ids.to(DEVICE))


def test_experts_large_tiles_and_multi_chunk_alignment(monkeypatch):
    """M*k/E = 50 slots per expert: BLOCK_M 64 tensor-core tiles; alignment over several chunks."""
    monkeypatch.setattr(talign, "SINGLE_CHUNK_MAX", 128)
    monkeypatch.setattr(talign, "MAX_CHUNKS", 4)
    gen = torch.Generator().manual_seed(7)
    E, k, H, I, M = 8, 2, 64, 32, 200
    assert tconfig.configs(M, k, E, H, I, torch.float16, torch.device(DEVICE))[0].BLOCK_M >= 64
    w13, w2 = _experts(gen, E, H, I, torch.float16)
    weights, ids = ref.moe_route(torch.randn(M, E, generator=gen), k)
    _check_experts(_rnd(gen, M, H, dtype=torch.float16), w13, w2, weights.to(DEVICE), ids.to(DEVICE))


@pytest.mark.parametrize("shared", [False, True])
def test_block_wait_gives_the_same_bits_and_leaves_the_counters_zero(shared):
    """The down launch waiting block by block on counters the gate_up launch signals (PDL's finer wait) computes
    the same bits as the plain pair, and the combine leaves every counter zero for the next call (twice in a row).
    Under the interpreter the launches run one after the other, so this checks the counting and the reset, not the
    wait."""
    from kernels_triton.moe import experts as texperts

    gen = torch.Generator().manual_seed(11)
    E, k, H, I, M = 8, 2, 64, 48, 9  # I = 48: gate_up's column tiles do not divide it
    w13, w2 = _experts(gen, E, H, I, torch.float16)
    sw13, sw2 = _experts(gen, 1, H, I, torch.float16)
    x = _rnd(gen, M, H, dtype=torch.float16)
    weights, ids = ref.moe_route(torch.randn(M, E, generator=gen), k)
    slots = k + int(shared)
    if shared:
        weights = torch.cat([weights, torch.rand(M, 1, generator=gen)], 1)
        ids = torch.cat([ids, torch.zeros(M, 1, dtype=ids.dtype)], 1)
    weights, ids = weights.to(DEVICE).float().contiguous(), ids.to(DEVICE)
    up_cfg, down_cfg = tconfig.configs(M, k, E, H, I, torch.float16, torch.device(DEVICE))
    al = talign.align(ids, n_local=E, block_m=up_cfg.BLOCK_M, shared=shared)
    shared_args = (sw13[0], sw2[0]) if shared else (None, None)
    h = texperts.gate_up(x, w13, shared_args[0], al, slots, up_cfg)
    want = texperts.down(h, w2, shared_args[1], al, weights, down_cfg)
    done = block_counters(torch.device(DEVICE))
    assert done.numel() >= al.max_blocks and not done.any()
    for _ in range(2):
        h2 = texperts.gate_up(x, w13, shared_args[0], al, slots, up_cfg, done=done)
        assert done[:al.max_blocks].eq(triton.cdiv(I, up_cfg.BLOCK_N)).all(), "each block signalled by its tiles"
        got = texperts.down(h2, w2, shared_args[1], al, weights, down_cfg, done=done,
                            up_tiles=triton.cdiv(I, up_cfg.BLOCK_N))
        kept = al.slot_group >= 0
        assert torch.equal(got[kept], want[kept])
        out = texperts.combine(got, al, M, slots, done=done)
        assert not done.any(), "the combine launch leaves every counter zero"
        assert torch.equal(out, texperts.combine(want, al, M, slots))
    with pytest.raises(ValueError, match="up_tiles"):
        texperts.down(h, w2, shared_args[1], al, weights, down_cfg, done=done)
    with pytest.raises(ValueError, match="int32"):
        texperts.gate_up(x, w13, shared_args[0], al, slots, up_cfg, done=done[:1])


def test_block_counters_are_zeroed_when_a_launch_after_gate_up_fails(monkeypatch):
    """If the down or combine launch never happens after the gate_up launch signalled the block counters (an error
    in between), the counters are put back to zero: the next call's down programs must not see a stale count."""
    from kernels_triton.moe import experts as texperts
    from kernels_triton.moe import ops as tops

    gen = torch.Generator().manual_seed(13)
    E, k, H, I, M = 8, 2, 64, 32, 5
    w13, w2 = _experts(gen, E, H, I, torch.float16)
    x = _rnd(gen, M, H, dtype=torch.float16)
    weights, ids = ref.moe_route(torch.randn(M, E, generator=gen), k)
    weights, ids = weights.to(DEVICE).float().contiguous(), ids.to(DEVICE)
    cfgs = tconfig.configs(M, k, E, H, I, x.dtype, x.device)
    al = talign.align(ids, n_local=E, block_m=cfgs[0].BLOCK_M)
    monkeypatch.setattr(texperts, "block_wait_default", lambda pdl, al, m: True)

    def failing_down(*args, **kwargs):
        raise RuntimeError("down failed")

    monkeypatch.setattr(texperts, "down", failing_down)
    counters = block_counters(torch.device(DEVICE))
    with pytest.raises(RuntimeError, match="down failed"):
        tops._run_experts(x, w13, w2, weights, al, cfgs)
    assert not counters.any()


def test_skewed_routing_and_experts_with_zero_tokens():
    gen = torch.Generator().manual_seed(3)
    E, k, H, I, M = 8, 3, 64, 48, 40  # I = 48: BLOCK_N does not divide it (masked columns)
    w13, w2 = _experts(gen, E, H, I, torch.float16)
    x = _rnd(gen, M, H, dtype=torch.float16)
    weights = torch.softmax(torch.randn(M, k, generator=gen), -1).to(DEVICE)
    every_token_same = torch.tensor([[5, 2, 6]] * M, dtype=torch.int32, device=DEVICE)
    _check_experts(x, w13, w2, weights, every_token_same)
    only_three = torch.randint(0, 3, (M, 1), generator=gen).repeat(1, k)
    only_three = ((only_three + torch.arange(k)) % 3).to(DEVICE, torch.int64)  # distinct picks, int64 ids
    _check_experts(x, w13, w2, weights, only_three)


def test_expert_map_drops_non_local_experts():
    gen = torch.Generator().manual_seed(4)
    E_local, E_global, k, H, I, M = 4, 10, 3, 64, 32, 23
    w13, w2 = _experts(gen, E_local, H, I, torch.float16)
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[[1, 4, 5, 8]] = torch.arange(E_local, dtype=torch.int32)
    weights, ids = ref.moe_route(torch.randn(M, E_global, generator=gen), k)
    x = _rnd(gen, M, H, dtype=torch.float16)
    out = _check_experts(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE), emap.to(DEVICE))
    none_local = (emap[ids.long()] < 0).all(dim=1)
    assert none_local.any(), "test needs a token with no local expert"
    assert (out[none_local.to(DEVICE)] == 0).all()


def test_empty_batch():
    gen = torch.Generator().manual_seed(5)
    w13, w2 = _experts(gen, 4, 32, 16, torch.float32)
    x = torch.empty(0, 32, device=DEVICE)
    empty_ids = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    assert tmoe.moe_experts(x, w13, w2, torch.empty(0, 2, device=DEVICE), empty_ids).shape == (0, 32)


# ----------------------------------------------------------------------------- block


def _block_inputs(gen, M, dtype, *, E=8, H=64, I=32, Is=32, gate=True):
    w13, w2 = _experts(gen, E, H, I, dtype)
    return dict(x=_rnd(gen, M, H, dtype=dtype), router_weight=_rnd(gen, E, H, dtype=dtype), w13=w13, w2=w2,
                shared_w13=_rnd(gen, 2 * Is, H, scale=H**-0.5, dtype=dtype),
                shared_w2=_rnd(gen, H, Is, scale=Is**-0.5, dtype=dtype),
                shared_gate_weight=_rnd(gen, 1, H, dtype=dtype) if gate else None)


def _ref_block(kw, top_k, **extra):
    return ref.moe_block(**{k: (v.double().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
                         top_k=top_k, **extra)


@pytest.mark.parametrize("M,dtype,Is,gate,renormalize", [
    (1, torch.float16, 32, True, True),  # decode: shared expert fused as a ninth group
    (19, torch.float32, 32, False, False),  # fused shared expert without gate, no renormalisation
    (6, torch.float16, 48, True, True),  # shared width != expert width: torch shared expert
])
def test_block_matches_reference(M, dtype, Is, gate, renormalize):
    gen = torch.Generator().manual_seed(M + Is)
    kw = _block_inputs(gen, M, dtype, Is=Is, gate=gate)
    out = tmoe.moe_block(**kw, top_k=2, renormalize=renormalize)
    assert out.dtype == dtype
    assert_close(out, _ref_block(kw, 2, renormalize=renormalize), TOL[dtype], "moe_block")


@pytest.mark.parametrize("M", [9, 100])  # one launch (the last routing program aligns) and chunked routing
def test_block_with_expert_map(M):
    gen = torch.Generator().manual_seed(8)
    kw = _block_inputs(gen, M, torch.float16, E=3)
    kw["router_weight"] = _rnd(gen, 8, 64, dtype=torch.float16)  # 8 global experts, 3 held here
    emap = torch.tensor([-1, 0, -1, -1, 1, -1, 2, -1], dtype=torch.int32, device=DEVICE)
    out = tmoe.moe_block(**kw, top_k=3, expert_map=emap)
    assert_close(out, _ref_block(kw, 3, expert_map=emap.cpu()), TOL[torch.float16], "moe_block with expert_map")


@pytest.mark.parametrize("multi_chunk", [False, True])
def test_block_is_deterministic(multi_chunk, monkeypatch):
    if multi_chunk:  # 33 tokens x (2 picks + shared): routed in chunks of two 16-token tiles
        monkeypatch.setattr(talign, "ALIGN_LAST_MAX_SLOTS", 0)
        monkeypatch.setattr(talign, "MAX_CHUNKS", 2)
        monkeypatch.setattr(talign, "SCAN_TILE", 16)
    gen = torch.Generator().manual_seed(9)
    kw = _block_inputs(gen, 33, torch.float16)
    first = tmoe.moe_block(**kw, top_k=2)
    assert torch.equal(first, tmoe.moe_block(**kw, top_k=2)), "two runs differ"
    assert_close(first, _ref_block(kw, 2), TOL[torch.float16], "moe_block")


# ----------------------------------------------------------------------------- one token (kernels_triton.moe.decode)


def _one_token_calls(monkeypatch) -> list:
    from kernels_triton.moe import decode

    calls = []
    real = decode.moe_block_one_token

    def counted(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(decode, "moe_block_one_token", counted)
    return calls


@pytest.mark.parametrize("dtype,E,k,shared,gate,renormalize,mapped", [
    (torch.float16, 8, 2, True, True, True, False),
    (torch.float32, 8, 3, True, False, False, False),  # shared expert without a gate, no renormalisation
    (torch.float16, 40, 4, False, False, True, False),  # no shared expert; E not a power of two
    (torch.float32, 300, 16, True, True, True, False),  # many experts, k = 16
    (torch.float16, 8, 3, True, True, True, True),  # expert map: non-local picks dropped
])
def test_one_token_block_matches_reference(dtype, E, k, shared, gate, renormalize, mapped, monkeypatch):
    """Batch-1 decode (router GEMV whose last program routes the token, gate_up GEMV, down GEMV summing the slots)
    vs the fp64 reference; the same bits on a second call, and the arrival counter back at zero after each."""
    calls = _one_token_calls(monkeypatch)
    gen = torch.Generator().manual_seed(E + k)
    n_local = 3 if mapped else E
    kw = _block_inputs(gen, 1, dtype, E=n_local, gate=gate)
    kw["router_weight"] = _rnd(gen, E, 64, dtype=dtype)
    if not shared:
        kw.update(shared_w13=None, shared_w2=None, shared_gate_weight=None)
    extra = {}
    if mapped:  # 8 global experts, 3 held here; the token's picks fall on both sides
        extra["expert_map"] = torch.tensor([-1, 0, -1, -1, 1, -1, 2, -1], dtype=torch.int32, device=DEVICE)
    out = tmoe.moe_block(**kw, top_k=k, renormalize=renormalize, **extra)
    assert calls, "one token did not take the decode path"
    assert out.dtype == dtype and out.shape == (1, 64)
    want = _ref_block(kw, k, renormalize=renormalize, **{n: v.cpu() for n, v in extra.items()})
    assert_close(out, want, TOL[dtype], "moe_block, one token")
    counter = arrival_counter(torch.device(DEVICE))
    assert not counter.any(), "the last program did not reset the arrival counter"
    assert torch.equal(out, tmoe.moe_block(**kw, top_k=k, renormalize=renormalize, **extra)), "two runs differ"
    assert not counter.any()


def test_arrival_counter_per_thread():
    """One zeroed counter per device and thread (kernels_triton._arrival): the same tensor again in one thread,
    another in a second thread."""
    import threading

    dev = torch.device(DEVICE)
    mine = arrival_counter(dev)
    assert mine is arrival_counter(dev) and mine.dtype == torch.int32 and not mine.any()
    other = []
    thread = threading.Thread(target=lambda: other.append(arrival_counter(dev)))
    thread.start()
    thread.join()
    assert other[0] is not mine and not other[0].any()


def test_one_token_ties_and_switch(monkeypatch):
    """Equal router logits pick the lowest ids, as routing does; QWEN35_MOE_DECODE=0 takes the general pipeline
    (same picks, so the same output to rounding); any other value is refused by name."""
    from kernels_triton.moe import decode

    gen = torch.Generator().manual_seed(2)
    kw = _block_inputs(gen, 1, torch.float32, E=16)
    kw["router_weight"] = torch.zeros(16, 64, device=DEVICE)  # every logit 0: picks 0, 1, 2
    out = tmoe.moe_block(**kw, top_k=3)
    assert_close(out, _ref_block(kw, 3), TOL[torch.float32], "tied logits")
    monkeypatch.setenv(decode.ENV, "0")
    calls = _one_token_calls(monkeypatch)
    general = tmoe.moe_block(**kw, top_k=3)
    assert not calls
    assert rel_err(general, out.double()) < 1e-5
    monkeypatch.setenv(decode.ENV, "yes")
    with pytest.raises(ValueError, match="QWEN35_MOE_DECODE"):
        tmoe.moe_block(**kw, top_k=3)


def test_router_split_heuristic():
    """The router GEMV's split of H at small M: ~128 programs, ~256 for 512 experts at up to 16 tokens."""
    from kernels_triton.moe.routing import router_launch

    assert router_launch(1, 2048, 256)[0] == (16, 1, 8)  # 35B-A3B: 16 column tiles x 8 splits of 256
    assert router_launch(1, 4096, 512)[:2] == ((32, 1, 8), 512)  # 397B-A17B TP4/TP8: 32 x 8 splits of 512
    assert router_launch(16, 4096, 512)[0] == (32, 1, 8)
    assert router_launch(17, 4096, 512)[0] == (16, 2, 4)  # 17..64 tokens: wider column tiles, ~128 programs
    grid, k_per_split, _ = router_launch(1, 64, 512)  # H too short to split as far: every split >= BLOCK_K
    assert grid == (32, 1, 1) and k_per_split == 128


def test_one_token_config_heuristic():
    """Launch shapes: gate_up one column per program in 512-wide steps; down 8 columns in 64-wide steps, or up to H =
    2048 and I = 512 4 columns in one step loaded before the PDL wait; narrower where the model is."""
    from kernels_triton.moe.decode import decode_config

    c35 = decode_config(2048, 512)  # 35B-A3B: down loads its weights before the PDL wait, 4 columns per program
    assert (c35.UP_N, c35.UP_K, c35.UP_WARPS, c35.DOWN_N, c35.DOWN_WARPS, c35.DOWN_EARLY) == (1, 512, 2, 4, 8, True)
    tp8 = decode_config(4096, 128)  # 397B-A17B-TP8: the loop over I, 8 columns per program
    assert (tp8.DOWN_N, tp8.DOWN_K, tp8.DOWN_EARLY) == (8, 64, False)
    assert not decode_config(3072, 1024).DOWN_EARLY  # 122B-A10B
    assert decode_config(2048, 512, 9).DOWN_EARLY  # 8 routed + the shared expert: a 16 x 4 x 512 tile
    assert not decode_config(2048, 512, 17).DOWN_EARLY  # 16 routed + shared: twice that, the loop over I
    tiny = decode_config(64, 32)
    assert (tiny.UP_K, tiny.DOWN_N, tiny.DOWN_K, tiny.DOWN_EARLY) == (64, 4, 32, True)


# ----------------------------------------------------------------------------- configs and façade


def test_decode_sized_config_heuristic():
    """At up to 16 tokens (16-row blocks) gate_up takes 64-wide column tiles unless that leaves fewer than 64
    programs (then 32-wide ones), and down 128 x 256 tiles in two stages; from 17 tokens the earlier shapes."""
    G = tconfig.GemmConfig
    assert tconfig.heuristic("gate_up", 2, 8, 256, 1024, 2048) == G(16, 64, 128, 4, 4)  # 35B: 16 x 8 programs
    assert tconfig.heuristic("gate_up", 2, 10, 512, 256, 4096) == G(16, 32, 256, 4, 4)  # 397B-TP8: 20 x 2
    assert tconfig.heuristic("gate_up", 4, 10, 512, 256, 4096) == G(16, 64, 128, 4, 4)  # 40 x 2
    assert tconfig.heuristic("gate_up", 24, 8, 256, 1024, 2048) == G(16, 64, 128, 4, 4)
    assert tconfig.heuristic("down", 16, 8, 256, 2048, 512) == G(16, 128, 256, 4, 2)
    assert tconfig.heuristic("down", 16, 10, 512, 4096, 128) == G(16, 128, 128, 4, 2)  # BLOCK_K within I
    assert tconfig.heuristic("down", 17, 8, 256, 2048, 512) == G(16, 128, 64, 4, 5)


def test_config_heuristic_and_tuned_file(tmp_path, monkeypatch, caplog):
    dev = torch.device("cpu")
    tconfig.configs.cache_clear()
    _config.clear_cache()
    with caplog.at_level(logging.INFO, logger="qwen35.kernels_triton"):
        up, down = tconfig.configs(1, 8, 256, 2048, 512, torch.bfloat16, dev)
    assert up.BLOCK_M == down.BLOCK_M == 16
    assert up == tconfig.heuristic("gate_up", 1, 8, 256, 1024, 2048)
    assert sum("no tuned moe_gate_up config" in r.message for r in caplog.records) == 1
    key_up, key_down = tconfig.shape_key(256, 1024, 2048, torch.bfloat16), tconfig.shape_key(256, 2048, 512,
                                                                                           torch.bfloat16)
    entry = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5}
    (tmp_path / "cpu").mkdir()
    for op, key in ((tconfig.GATE_UP_OP, key_up), (tconfig.DOWN_OP, key_down)):
        doc = {"op": op, "entries": {key: {"1": dict(entry, BLOCK_M=16), "4096": entry}}}
        (tmp_path / "cpu" / f"{op}.json").write_text(json.dumps(doc))
    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    tconfig.configs.cache_clear()
    _config.clear_cache()
    try:
        up, down = tconfig.configs(3000, 8, 256, 2048, 512, torch.bfloat16, dev)
        assert up == tconfig.GemmConfig(64, 64, 128, 4, 5) == down
        assert tconfig.configs(2, 8, 256, 2048, 512, torch.bfloat16, dev)[1].BLOCK_M == 16
    finally:
        tconfig.configs.cache_clear()
        _config.clear_cache()


def test_tuned_entry_reaches_only_nearby_token_counts(monkeypatch):
    """An entry tuned at 1024 tokens serves 256..4096; at 16384 the heuristic decides (entries without M: always)."""
    dev = torch.device("cpu")
    entry = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5}
    tuned = tconfig.GemmConfig(64, 64, 128, 4, 5)
    tconfig.configs.cache_clear()
    try:
        monkeypatch.setattr(_config, "lookup", lambda *a, **k: dict(entry, M=1024))
        assert tconfig.configs(4096, 8, 256, 2048, 512, torch.bfloat16, dev)[0] == tuned
        far = tconfig.configs(16384, 8, 256, 2048, 512, torch.bfloat16, dev)[0]
        assert far == tconfig.heuristic("gate_up", 16384, 8, 256, 1024, 2048) != tuned
        monkeypatch.setattr(_config, "lookup", lambda *a, **k: dict(entry))
        tconfig.configs.cache_clear()
        assert tconfig.configs(16384, 8, 256, 2048, 512, torch.bfloat16, dev)[0] == tuned
    finally:
        tconfig.configs.cache_clear()


def test_facade_selects_and_self_tests_triton(fresh_probe, monkeypatch):
    monkeypatch.setenv("QWEN35_BACKEND", "triton")
    fresh_probe.reset()
    for op in ("moe_route", "moe_experts", "moe_block"):
        choice = fresh_probe.choose(op, DEVICE)
        assert choice.backend == "triton", choice.reason
        assert choice.selftest_rel_err is not None and choice.selftest_rel_err < 1e-2, choice.reason
    gen = torch.Generator().manual_seed(10)
    kw = _block_inputs(gen, 5, torch.float32)
    out = ops.moe_block(**kw, top_k=2)
    assert torch.equal(out, tmoe.moe_block(**kw, top_k=2))
    assert rel_err(out, _ref_block(kw, 2)) < TOL[torch.float32]


# ----------------------------------------------------------------------------- the GPU build, without a GPU

_SM90_BUILD = r'''
from helpers import build_sm90 as build
from kernels_triton.moe import align as A, decode as D, experts as X, routing as R

bf, f32 = "*bf16", "*fp32"
route = dict(N_SPLITS=4, TOP_K=10, K_PAD=16, E_PAD=512, RENORMALIZE=True, HAS_GATE=True, HAS_SHARED=True)
router = {"x_ptr": bf, "w_ptr": bf, "gate_ptr": bf, "out_ptr": f32, "gate_out_ptr": f32}
for bm, bn, bk, warps in ((16, 16, 128, 4), (128, 128, 64, 8)):  # GEMV-like decode tiles, tensor-core prefill tiles
    build(R._router_logits_kernel, router, dict(HAS_GATE=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=False), warps)
build(R._router_logits_kernel, router, dict(HAS_GATE=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, IEEE=False), 4, 4)
build(R._router_logits_kernel, dict(router, x_ptr=f32, w_ptr=f32, gate_ptr=f32),
      dict(HAS_GATE=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, IEEE=True), 4, 4)
logits = {"logits_ptr": f32, "gate_ptr": f32, "weights_ptr": f32}
build(R._route_kernel, logits, dict(route, ROWS=8))
build(A._route_align_kernel, logits, dict(route, ROWS=8, HAS_MAP=True, N_PAD=256, G_PAD=512, BLOCK_M=16))
build(A._count_kernel, logits, dict(route, ROUTE=True, ROWS=16, TILES=4, HAS_MAP=True, CHUNK_PAD=1024, G_PAD=512), 8)
build(A._count_kernel, {"logits_ptr": "*i32", "weights_ptr": "*i32"},
      dict(route, ROUTE=False, ROWS=16, TILES=4, HAS_MAP=False, CHUNK_PAD=1024, G_PAD=256))
build(A._align_single_kernel, {}, dict(TOP_K=8, HAS_MAP=False, HAS_SHARED=True, N_PAD=1024, G_PAD=256, BLOCK_M=16))
for top_k, chunk_pad in ((8, 512), (10, 1024)):
    build(A._scatter_kernel, {}, dict(TOP_K=top_k, HAS_SHARED=True, BLOCK_M=128, CHUNK_PAD=chunk_pad, G_PAD=512,
                                      TILE_C=32), 8)
no_pdl = dict(PDL=False, PREFETCH_LINES=0, LINE_ELEMS=64)
for bm, bn, bk, warps, stages, pdl in ((16, 32, 256, 4, 4, True), (128, 128, 64, 8, 3, False)):
    tiles = dict(HAS_SHARED=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, EVEN_N=True, IEEE=False,
                 SUB_LEVELS=X.sub_levels(bm), PDL=pdl)  # decode tiles also with programmatic dependent launch
    build(X._gate_up_kernel, {"x_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "h_ptr": bf}, tiles, warps, stages)
    build(X._down_kernel, {"h_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "weights_ptr": f32, "y_ptr": bf},
          dict(tiles, TILES_N=1, PREFETCH_LINES=8 if pdl else 0, LINE_ELEMS=64), warps, stages)
    if pdl:  # the down launch waiting block by block on counters the gate_up launch signals
        build(X._gate_up_kernel, {"x_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "h_ptr": bf},
              dict(tiles, SIGNAL=True), warps, stages)
        build(X._down_kernel, {"h_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "weights_ptr": f32, "y_ptr": bf},
              dict(tiles, TILES_N=1, PREFETCH_LINES=0, LINE_ELEMS=64, WAIT=True), warps, stages)
        build(X._combine_kernel, {"y_ptr": bf, "extra_ptr": bf, "out_ptr": bf},
              dict(SLOTS=8, HAS_EXTRA=False, BLOCK_H=1024, PDL=True, ZERO_DONE=True))
        # the default decode-sized shapes (kernels_triton.moe.config.heuristic)
        build(X._gate_up_kernel, {"x_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "h_ptr": bf},
              dict(tiles, BLOCK_N=64, BLOCK_K=128, SIGNAL=True), 4, 4)
        build(X._down_kernel, {"h_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "weights_ptr": f32, "y_ptr": bf},
              dict(tiles, BLOCK_N=128, BLOCK_K=256, TILES_N=1, PREFETCH_LINES=0, LINE_ELEMS=64, WAIT=True), 4, 2)
build(R._router_logits_kernel, router, dict(HAS_GATE=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, IEEE=False, PDL=True))
build(A._route_align_kernel, logits, dict(route, ROWS=8, HAS_MAP=False, N_PAD=16, G_PAD=512, BLOCK_M=16, PDL=True))
build(X._combine_kernel, {"y_ptr": bf, "extra_ptr": bf, "out_ptr": bf}, dict(SLOTS=11, HAS_EXTRA=False, BLOCK_H=1024,
                                                                            PDL=True))
down = {"h_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "weights_ptr": f32, "y_ptr": bf}
for bm, bn, bk, warps, stages, tiles_n in ((128, 256, 64, 8, 4, 4), (128, 256, 128, 8, 2, 16), (64, 128, 64, 4, 4, 8)):
    build(X._down_kernel, down, dict(HAS_SHARED=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, EVEN_N=True,
                                     IEEE=False, TILES_N=tiles_n, SUB_LEVELS=X.sub_levels(bm), **no_pdl), warps,
          stages)  # flat
for bm, bn, bk, warps, stages, tiles_n in ((128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 4, 4)):  # weight tiles by TMA
    tma = dict(HAS_SHARED=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, EVEN_N=True, IEEE=False,
               SUB_LEVELS=X.sub_levels(bm), TMA=True)
    build(X._gate_up_kernel, {"x_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "h_ptr": bf}, dict(tma, BLOCK_N=128),
          warps, stages)
    build(X._down_kernel, down, dict(tma, TILES_N=tiles_n, **no_pdl), warps, stages)
build(X._combine_kernel, {"y_ptr": bf, "extra_ptr": bf, "out_ptr": bf}, dict(SLOTS=11, HAS_EXTRA=True, BLOCK_H=1024))
for pdl in (True, False):  # one token (kernels_triton.moe.decode)
    build(D._decode_router_kernel, dict(router, gate_w_ptr=bf, gate_ptr=f32, logits_ptr=f32, weight_ptr=f32),
          dict(route, HAS_MAP=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, IEEE=False, PDL=pdl), 4)
    build(D._decode_gate_up_kernel, {"x_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "h_ptr": bf},
          dict(HAS_SHARED=True, BLOCK_N=1, BLOCK_K=512, PDL=pdl), 2)
    build(D._decode_down_kernel, {"h_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "weight_ptr": f32, "out_ptr": bf},
          dict(SLOTS=11, SLOTS_PAD=16, HAS_SHARED=True, BLOCK_N=8, BLOCK_K=64, PDL=pdl), 8)
    # down loading its weights before the PDL wait, behind a gate_up launch that lets it start at once
    build(D._decode_gate_up_kernel, {"x_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "h_ptr": bf},
          dict(HAS_SHARED=True, BLOCK_N=1, BLOCK_K=512, TRIGGER=True, PDL=False), 2)
    build(D._decode_down_early_kernel, {"h_ptr": bf, "w_ptr": bf, "shared_w_ptr": bf, "weight_ptr": f32,
                                        "out_ptr": bf}, dict(SLOTS=9, SLOTS_PAD=16, HAS_SHARED=True, BLOCK_N=4,
                                                             I_PAD=512, PDL=pdl), 8)
print("built")
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run these kernels for real")
def test_kernels_build_for_hopper():
    """Every kernel compiles to sm_90 code (Triton's bundled ptxas; no GPU needed), decode and prefill variants."""
    assert_builds(_SM90_BUILD)


def test_configs_fit_shared_memory_for_fp32():
    """An fp32 GEMM needs twice bf16's shared memory: the config loses stages (then BLOCK_K) until it fits.

    The case is the one an H200 rejected (gate_up 64x128x64, 4 stages, fp32: 245760 B > 232448 B).
    """
    from kernels_triton.moe import config as cfg_mod

    cfg = cfg_mod.GemmConfig(64, 128, 64, 4, 4)
    assert cfg_mod.shared_bytes("gate_up", cfg, 4) == 245760
    fitted = cfg_mod.fit_shared_memory("gate_up", cfg, 4, 232448)
    assert cfg_mod.shared_bytes("gate_up", fitted, 4) <= 232448
    assert (fitted.BLOCK_M, fitted.BLOCK_N, fitted.BLOCK_K, fitted.num_stages) == (64, 128, 64, 3)
    assert cfg_mod.fit_shared_memory("gate_up", cfg, 2, 232448) == cfg  # bf16 fits as tuned
    tiny = cfg_mod.fit_shared_memory("down", cfg, 4, 20000)
    assert cfg_mod.shared_bytes("down", tiny, 4) <= 20000 and tiny.BLOCK_M == 64


def test_alignment_buffers_are_16_byte_aligned_at_every_token_count():
    """Every part of the alignment outputs starts 16-byte aligned whatever the token count, so serving never
    meets a pointer-alignment specialisation that warm-up did not compile."""
    for n in (1, 2, 3, 7, 9, 18, 33, 1000):
        for G in (8, 257, 513):
            al = talign._outputs(n, G, 16, "cpu")
            parts = (al.sorted_slots, al.block_group, al.group_start, al.group_count, al.total_blocks, al.slot_group)
            assert all(t.data_ptr() % 16 == 0 for t in parts), (n, G)


def _assert_disjoint_and_aligned(parts: list) -> None:
    """Views of one buffer: each starts 16-byte aligned and none overlaps another."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parts)
    assert all(a % 16 == 0 for a, _ in spans)
    assert all(end <= start for (_, end), (start, _) in zip(spans[:-1], spans[1:], strict=True)), "parts overlap"


@pytest.mark.parametrize("M,top_k,shared,gate", [(1, 8, False, False), (5, 3, True, True), (40, 8, True, False),
                                                  (300, 10, False, True)])
def test_route_scratch_parts_are_disjoint_aligned_and_sized(M, top_k, shared, gate, monkeypatch):
    """moe_block's per-call buffers in one allocation (kernels_triton.moe.align.route_scratch): every part starts
    16-byte aligned, none overlaps another, each has its size; the chunk tables where routing takes the chunked
    launches, none where one launch aligns. Not kept off CUDA devices (kernels_triton._kept)."""
    from kernels_triton import _kept
    from kernels_triton.moe import routing as trouting

    E, n_splits, n_local, block_m = 24, 3, 20, 16
    sc = talign.route_scratch(M, E, n_splits, top_k, gate=gate, shared=shared, n_local=n_local, block_m=block_m,
                              device=torch.device("cpu"))
    slots = top_k + int(shared)
    al = sc.al
    parts = [sc.logits, sc.weights, sc.ids, al.sorted_slots, al.block_group, al.group_start, al.group_count,
             al.total_blocks, al.slot_group]
    parts += [sc.gate_part] if gate else []
    chunked = M * top_k > talign.ALIGN_LAST_MAX_SLOTS
    assert (sc.counts is not None) == chunked
    parts += list(sc.counts) if chunked else []
    assert sc.logits.shape == (n_splits, M, E) and sc.logits.dtype == torch.float32
    assert sc.weights.shape == (M, slots) and sc.weights.dtype == torch.float32 and sc.ids.shape == (M, slots)
    assert al.slot_group.numel() == M * slots and al.n_groups == n_local + int(shared)
    if gate:  # where router_logits and gate_logits expect the gate partials: right after the logits
        assert sc.gate_part.shape == (n_splits, M)
        assert sc.gate_part.data_ptr() == trouting.gate_logits(sc.logits, n_splits).data_ptr()
    else:
        assert sc.gate_part is sc.logits
    _assert_disjoint_and_aligned(parts)
    again = talign.route_scratch(M, E, n_splits, top_k, gate=gate, shared=shared, n_local=n_local, block_m=block_m,
                                 device=torch.device("cpu"))
    assert again.logits.data_ptr() != sc.logits.data_ptr(), "kept off a CUDA device"
    assert _kept.kept("x", 4, torch.int32, torch.device("cpu")) is None
    if not chunked:  # the layout follows the module's limits at the call (tests change them): chunk tables now
        monkeypatch.setattr(talign, "ALIGN_LAST_MAX_SLOTS", 0)
        forced = talign.route_scratch(M, E, n_splits, top_k, gate=gate, shared=shared, n_local=n_local,
                                      block_m=block_m, device=torch.device("cpu"))
        assert forced.counts is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gate,slots,I", [(False, 8, 512), (True, 9, 48), (True, 11, 7)])
def test_one_token_scratch_parts_are_disjoint_aligned_and_sized(dtype, gate, slots, I):
    """One token's per-call tensors in one allocation (kernels_triton.moe.decode.one_token_scratch): router and gate
    partials, groups, weights and h (in x's dtype, odd widths included), each 16-byte aligned, none overlapping."""
    from kernels_triton.moe import decode

    E, n_splits = 40, 4
    logits, gate_part, groups, weights, h = decode.one_token_scratch(E, n_splits, gate, slots, I, dtype,
                                                                     torch.device("cpu"))
    assert logits.shape == (n_splits, 1, E) and logits.dtype == torch.float32
    assert (gate_part.shape == (n_splits, 1)) if gate else gate_part is logits
    assert groups.shape == (slots,) and groups.dtype == torch.int32 and weights.dtype == torch.float32
    assert h.shape == (slots, I) and h.dtype == dtype and h.is_contiguous()
    parts = [logits, groups, weights, h] + ([gate_part] if gate else [])
    _assert_disjoint_and_aligned(parts)


def test_programmatic_dependent_launch_is_for_gpus_only(monkeypatch):
    """PDL (decode-sized batches by default, every size with QWEN35_MOE_PDL=1) is for CUDA devices of sm_90+ only;
    never on the CPU (the interpreter has no griddepcontrol), so these tests run the ordinary launches whatever the
    environment says."""
    from kernels_triton.moe import pdl

    for env, m in (("1", 2), ("1", 1), ("", 1)):
        monkeypatch.setenv(pdl.ENV, env)
        assert not pdl.enabled(torch.zeros(m, 8))
    assert pdl.options(True) == {"launch_pdl": True} and pdl.options(False) == {}
    assert pdl.prefetch_lines(512, 2) == (8, 64)  # a 1 KB bf16 row: eight 128-byte lines
    assert pdl.prefetch_lines(100, 4) == (4, 32)  # 400 bytes of fp32: four lines (the last one partly)
