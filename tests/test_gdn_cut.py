"""The cut-and-correct path of the Triton GDN prefill (kernels_triton/gdn/cut.py) against the fp64 reference, on CPU
under TRITON_INTERPRET=1 (on a GPU the same cases run compiled).

A long sequence is cut into segments whose local states and transition products are computed in parallel, the
segments' starting states are corrected along each sequence, and the output pass scans the segments from them. Cases:
an initial state and several cuts (segments of 1, 2, 3 chunks, the last one partial), strong / normal / weak / zero
decay, varlen batches with empty and one-token sequences and a state pool (padded slot, has_initial_state False),
one sequence without cu_seqlens, fp32 and fp16, head dims that are not powers of two; the segment table; the forced
config's checks; the fallback when the batch's offsets are not on the host; the default plans never take the path.
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (also done by conftest)

import numpy as np
import pytest
import torch
from helpers import assert_close, cu_from_lens, gdn_inputs

import kernels_triton as kt
from kernels_triton.gdn import bench_api as gdn_bench
from kernels_triton.gdn import cut
from qwen35 import reference as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Budgets as tests/test_triton_gdn.py's (CPU: numpy fp32 dots; GPU: tf32x3 for fp32, tf32 for fp16), the correction
# adding one fp32 product per segment.
TOL = {"cpu": {torch.float32: 5e-6, torch.float16: 1e-3},
       "cuda": {torch.float32: 2e-5, torch.float16: 2e-3}}[DEV]


def _to64(d: dict) -> dict:
    return {k: (v.double().cpu() if isinstance(v, torch.Tensor) and v.is_floating_point() else
                (v.cpu() if isinstance(v, torch.Tensor) else v)) for k, v in d.items()}


def _inputs(lens, H, HV, K, V, dtype, decay, seed):
    raw = decay == "raw"
    d = gdn_inputs(sum(lens), H, HV, K, V, dtype=dtype, device=DEV, seed=seed, raw=raw,
                   decay="normal" if decay in ("raw", "zero") else decay)
    if decay == "zero":
        d["g"] = torch.zeros_like(d["g"])
    return d


def _scan(seg_chunks: int, V: int, bv: int = 16) -> dict:
    return {"BV": min(32, max(16, 1 << (V - 1).bit_length())), "num_warps": 4, "num_stages": 2, "CUT": seg_chunks,
            "CUT_BV": bv}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decay", ["normal", "strong", "weak", "zero"])
@pytest.mark.parametrize("seg_chunks", [1, 2, 3])
def test_one_sequence_with_an_initial_state(seg_chunks, decay, dtype):
    """One sequence of 7.5 chunks from an initial state, cut into segments of 1-3 chunks: output and final state as
    the fp64 reference's."""
    lens, H, HV, K, V = [470], 1, 2, 32, 32
    d = _inputs(lens, H, HV, K, V, dtype, decay, seed=3)
    cu = cu_from_lens(lens, DEV)
    h0 = (torch.randn(1, HV, K, V, generator=torch.Generator().manual_seed(4)) * 0.3).to(DEV)
    meta = kt.prepare_gdn_metadata(cu)
    o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm=True, metadata=meta, scan=_scan(seg_chunks, V))
    ro, rht = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), initial_state=h0.double().cpu(),
                                    output_final_state=True, use_qk_l2norm=True)
    assert meta.derived[("cut", seg_chunks)][1] == -(-8 // seg_chunks)  # the path ran: its segment table is kept
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert_close(o, ro, TOL[dtype], "output")
    assert_close(ht, rht, TOL[dtype], "final state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_pool_with_empty_sequences(dtype):
    """A varlen batch with empty and one-token sequences, raw gating, a state pool with a padded slot and
    has_initial_state False rows, grouped value heads and head dims that are not powers of two: output and pool as
    the reference's; slots no sequence names stay untouched, an empty sequence's slot keeps (or, without an initial
    state, zeroes) its state."""
    lens, H, HV, K, V = [200, 0, 1, 130, 0, 260], 2, 4, 24, 40
    N = len(lens)
    d = _inputs(lens, H, HV, K, V, dtype, "raw", seed=5)
    cu = cu_from_lens(lens, DEV)
    gen = torch.Generator().manual_seed(6)
    pool = (torch.randn(N + 3, HV, K, V, generator=gen) * 0.2).to(DEV)
    slots = torch.tensor([7, 1, -1, 0, 5, 3], dtype=torch.int32, device=DEV)
    flags = torch.tensor([True, False, True, False, True, True], device=DEV)
    ours, want = pool.clone(), pool.double().cpu()
    o, none = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots,
                                          has_initial_state=flags, use_qk_l2norm=True,
                                          metadata=kt.prepare_gdn_metadata(cu), scan=_scan(2, V, bv=32))
    ro, _ = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), state_pool=want, state_slots=slots.cpu(),
                                  has_initial_state=flags.cpu(), use_qk_l2norm=True)
    assert none is None
    assert_close(o, ro, TOL[dtype], "output")
    assert_close(ours, want, TOL[dtype], "pool")
    for s in (2, 4, 6):  # slots no sequence names
        assert torch.equal(ours[s], pool[s]), f"slot {s} changed"
    assert torch.equal(ours[1], torch.zeros_like(pool[1])), "an empty sequence without an initial state: zeros"
    assert torch.equal(ours[5], pool[5]), "an empty sequence from its slot's state keeps it"


def test_tensor_states_and_no_cu_seqlens():
    """Initial states as a tensor with the final states returned (empty sequences' finals are their initial states),
    and one sequence without cu_seqlens (its segment table kept per length)."""
    lens, H, HV, K, V = [0, 330, 1, 129], 1, 2, 32, 32
    d = _inputs(lens, H, HV, K, V, torch.float32, "strong", seed=7)
    cu = cu_from_lens(lens, DEV)
    h0 = (torch.randn(len(lens), HV, K, V, generator=torch.Generator().manual_seed(8)) * 0.3).to(DEV)
    o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm=True, metadata=kt.prepare_gdn_metadata(cu), scan=_scan(2, V))
    ro, rht = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), initial_state=h0.double().cpu(),
                                    output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "output")
    assert_close(ht, rht, TOL[torch.float32], "final state")
    assert torch.equal(ht[0], h0[0]), "an empty sequence's final state is its initial state"

    d = _inputs([300], H, HV, K, V, torch.float32, "normal", seed=9)
    o, ht = gdn_bench.gdn_chunk_prefill(**d, output_final_state=True, use_qk_l2norm=True, scan=_scan(2, V))
    ro, rht = ref.gdn_chunk_prefill(**_to64(d), output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "output (no cu_seqlens)")
    assert_close(ht, rht, TOL[torch.float32], "final state (no cu_seqlens)")


def test_nearly_parallel_keys_with_beta_near_one():
    """Strongly correlated keys with beta -> 1 and weak decay (the hard case of the inverse, and transition products
    close to projections): still the reference's numbers."""
    lens, H, HV, K, V = [400], 1, 2, 32, 32
    d = _inputs(lens, H, HV, K, V, torch.float32, "weak", seed=10)
    d["k"] = d["k"].abs() + 2.0
    d["beta"] = torch.full_like(d["beta"], 0.999)
    cu = cu_from_lens(lens, DEV)
    o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                        metadata=kt.prepare_gdn_metadata(cu), scan=_scan(2, V))
    ro, rht = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32] * 4, "output")
    assert_close(ht, rht, TOL[torch.float32] * 4, "final state")


def test_without_host_offsets_the_plans_other_scan_runs(monkeypatch):
    """Metadata built on the device (chunk indices) or none: the segments cannot be cut without a read-back, so the
    call takes the one-pass scan (no local pass launched) and gives the same numbers."""
    launched = []
    real = cut.launch_local
    monkeypatch.setattr(cut, "launch_local", lambda *a: (launched.append(a[0]), real(*a)))
    lens, H, HV, K, V = [150, 70], 1, 2, 32, 32
    d = _inputs(lens, H, HV, K, V, torch.float32, "normal", seed=11)
    cu = cu_from_lens(lens, DEV)
    ro, rht = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), output_final_state=True, use_qk_l2norm=True)
    idx = torch.tensor([[n, c] for n, L in enumerate(lens) for c in range(-(-L // 64))], device=DEV)
    for meta in (None, kt.prepare_gdn_metadata(cu, chunk_indices=idx)):
        o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                            metadata=meta, scan=_scan(1, V))
        assert_close(o, ro, TOL[torch.float32], "output")
        assert_close(ht, rht, TOL[torch.float32], "final state")
    assert launched == []
    gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                metadata=kt.prepare_gdn_metadata(cu), scan=_scan(1, V))
    assert len(launched) == 1


def test_segment_table():
    """Segments of whole chunks from each sequence's start, none for an empty sequence; token starts then the end,
    each segment's sequence, each sequence's first segment."""
    table, J = cut.segments([0, 130, 130, 300, 301], 1)
    starts = [0, 64, 128, 130, 194, 258, 300]
    assert J == len(starts)
    assert table.dtype == np.int32
    assert table[:J + 1].tolist() == [*starts, 301]
    assert table[J + 1:2 * J + 1].tolist() == [0, 0, 0, 2, 2, 2, 3]
    assert table[2 * J + 1:].tolist() == [0, 3, 3, 6, 7]
    table, J = cut.segments([0, 300], 2)
    assert (J, table.tolist()) == (3, [0, 128, 256, 300, 0, 0, 0, 0, 3])
    table, J = cut.segments([0, 0, 0], 4)
    assert (J, table.tolist()) == (0, [0, 0, 0, 0])
    with pytest.raises(ValueError, match="segments of 0 chunks"):
        cut.segments([0, 10], 0)


@pytest.mark.parametrize("bad,match", [
    ({"CUT": -1}, "CUT=-1"), ({"CUT": 2.0}, "CUT=2.0"), ({"CUT": 2, "CUT_BV": 8}, "CUT_BV=8"),
    ({"CUT": 2, "SPLIT": True}, "SPLIT"), ({"CUT": 2, "SCAN_T": True}, "SCAN_T"),
    ({"CUT": 2, "SEGMENTS": 2}, "SEGMENTS"), ({"CUT": 2, "GROUPS": 2}, "GROUPS")])
def test_bad_cut_configs_are_refused(bad, match):
    d = _inputs([70], 1, 2, 32, 32, torch.float32, "normal", seed=12)
    with pytest.raises(ValueError, match=match):
        gdn_bench.gdn_chunk_prefill(**d, scan={"BV": 16, "num_warps": 4, "num_stages": 2, **bad})


def test_head_dims_beyond_the_correction_tile_are_refused():
    d = _inputs([70], 1, 1, 192, 32, torch.float32, "normal", seed=13)
    with pytest.raises(ValueError, match="K=192"):
        gdn_bench.gdn_chunk_prefill(**d, scan=_scan(2, 32))


def test_default_plans_never_cut_and_the_suggested_config_is_accepted():
    """The path is a plan option only (no default plan takes it until a GPU run measured where it wins); the config
    the peer benchmark forces for it passes the plan's checks and names its segment length."""
    for N, HV, T in ((1, 8, 32768), (1, 12, 65536), (8, 48, 32768), (1, 2, 300)):
        assert gdn_bench.plan_for(torch.device("cpu"), torch.bfloat16, N, HV, 128, 128, T // N).cut == 0
    assert gdn_bench.suggested_segment_chunks(1, 8, 32768) == 16
    assert gdn_bench.suggested_segment_chunks(1, 8, 65536) == 16
    assert gdn_bench.suggested_segment_chunks(1, 8, 2048) == 4
    cfg = gdn_bench.cut_scan_config(torch.device("cpu"), torch.float32, 1, 2, 32, 32, 300, seg_chunks=2)
    assert cfg["CUT"] == 2 and cfg["CUT_BV"] == 32
    plan = gdn_bench.plan_for(torch.device("cpu"), torch.float32, 1, 2, 32, 32, 256).with_configs(
        torch.device("cpu"), torch.float32, None, cfg)
    assert (plan.cut, plan.cut_bv, plan.split, plan.scan.SCAN_T, plan.prepare.T_OUT) == (2, 32, False, False, False)
    d = _inputs([300], 1, 2, 32, 32, torch.float32, "normal", seed=14)
    o, _ = gdn_bench.gdn_chunk_prefill(**d, use_qk_l2norm=True, scan=cfg)
    ro, _ = ref.gdn_chunk_prefill(**_to64(d), use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], "output")


_HOPPER_BUILD = '''
from helpers import build_sm90
from kernels_triton.gdn import cut

act = {n: "*bf16" for n in ("k_ptr", "ws_ptr")}
act.update({n: "*fp32" for n in ("h0_ptr", "ht_ptr", "loc_ptr", "mt_ptr", "seg_h0_ptr")}, has_init_ptr="*i1")
for bv in cut.CUT_BVS:
    build_sm90(cut._cut_local_kernel, act, dict(K=128, V=128, BK=128, BV=bv, C=64, DOT_PREC="tf32", STATE_IN=False,
               POOL=True, HAS_INIT_FLAGS=True), **cut.LOCAL_OPTIONS, divisible=())
build_sm90(cut._cut_correct_kernel, act, dict(K=128, V=128, BK=128, BV=cut.CORRECT_BV, PREC="tf32x3", STATE_IN=False,
           STATE_OUT=False, POOL=True, HAS_INIT_FLAGS=True), **cut.CORRECT_OPTIONS, divisible=())
print("built")
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the cases above run these kernels compiled")
def test_cut_kernels_build_for_hopper():
    """The local pass (every column block the plan accepts) and the correction compile to sm_90 code with Triton's
    bundled ptxas at their launch options, bf16 workspace, K = V = 128 (no GPU needed; the interpreter checks the
    numbers)."""
    from helpers import assert_builds

    assert_builds(_HOPPER_BUILD)


@pytest.mark.gpu
@pytest.mark.parametrize("seg_chunks", [8, 16, 64])
def test_gpu_long_sequence_bf16_against_fp64(seg_chunks):
    """On a GPU, at a real size (397B-TP8 heads, one 32768-token sequence from a pool slot, bf16, K = V = 128): the
    cut path's output and final state within the GPU tests' bf16 budget of the fp64 reference, for several segment
    lengths; the config the peer benchmark forces for it."""
    T, H, HV, K = 32768, 2, 8, 128
    d = gdn_inputs(T, H, HV, K, K, dtype=torch.bfloat16, device=DEV, seed=15, raw=True)
    cu = cu_from_lens([T], DEV)
    pool = (torch.randn(2, HV, K, K, generator=torch.Generator().manual_seed(16)) * 0.1).to(DEV)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    cfg = gdn_bench.cut_scan_config(torch.device(DEV), torch.bfloat16, 1, HV, K, K, T, seg_chunks=seg_chunks)
    ours, want = pool.clone(), pool.double()
    o, _ = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots, use_qk_l2norm=True,
                                       metadata=kt.prepare_gdn_metadata(cu), scan=cfg)
    ro, _ = ref.gdn_chunk_prefill(**{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                                     for k, v in d.items()}, cu_seqlens=cu, state_pool=want, state_slots=slots,
                                  use_qk_l2norm=True)
    assert_close(o, ro, 1e-2, f"output, CUT={seg_chunks}, {cfg}")
    assert_close(ours[1], want[1], 1e-2, f"final state, CUT={seg_chunks}")
    assert torch.equal(ours[0], pool[0])
