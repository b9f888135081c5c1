"""Triton GDN / conv1d / norm kernels on a CUDA GPU at real sizes (skipped without CUDA).

Ground truth is the reference op run in fp64 on the same GPU (the chunked algorithm, so T=65536
stays fast). Budgets (relative error, whole tensor): fp32 1e-3, fp16 4e-3, bf16 1e-2; any
non-finite value fails; pool slots not named by the call must be bit-identical afterwards.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, capture_graph, cu_from_lens

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    import kernels_triton as kt
    from kernels_triton.gdn import bench_api as gdn_bench
    from kernels_triton.gdn import launch, plan
    from qwen35 import reference as ref

DEV = "cuda"
TOL = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 1e-2}


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


def _f64(d: dict) -> dict:
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}


def _gdn_inputs(T, H, HV, K, V, dtype, *, seed=0, raw=True, decay="normal", lead=()):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    d = dict(q=_rand(gen, *lead, T, H, K, dtype=dtype), k=_rand(gen, *lead, T, H, K, dtype=dtype),
             v=_rand(gen, *lead, T, HV, V, dtype=dtype))
    if raw:
        d.update(a=_rand(gen, *lead, T, HV, dtype=dtype), b=_rand(gen, *lead, T, HV, dtype=dtype),
                 A_log=_rand(gen, HV, scale=0.5), dt_bias=_rand(gen, HV, scale=0.5))
    else:
        lo, hi = {"weak": (0.0, 0.02), "strong": (2.0, 8.0)}[decay]
        g = -(lo + (hi - lo) * torch.rand(*lead, T, HV, generator=gen, device=DEV))
        d.update(g=g, beta=torch.rand(*lead, T, HV, generator=gen, device=DEV).to(dtype))
    return d


def _check_untouched(after: torch.Tensor, before: torch.Tensor, named: torch.Tensor) -> None:
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[named[named >= 0].long()] = False
    assert torch.equal(after[keep], before[keep]), "pool slots not named by the call changed"


def test_prefill_long_sequence_65536_tp8():
    T, H, HV, K, V = 65536, 2, 8, 128, 128
    d = _gdn_inputs(T, H, HV, K, V, torch.bfloat16)
    pool = _rand(torch.Generator(device=DEV).manual_seed(1), 3, HV, K, V, scale=0.1)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    ours = pool.clone()
    o, _ = kt.gdn_chunk_prefill(**d, state_pool=ours, state_slots=slots, use_qk_l2norm=True)
    ref_pool = pool.double()
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), state_pool=ref_pool, state_slots=slots, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.bfloat16], "output T=65536")
    assert_close(ours, ref_pool, TOL[torch.bfloat16], "final state T=65536")
    _check_untouched(ours, pool, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_64_ragged_sequences_pool(dtype):
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 4097, (64,), generator=gen).tolist()
    lens[3], lens[10] = 1, 4096
    H, HV, K, V = 4, 12, 128, 128
    d = _gdn_inputs(sum(lens), H, HV, K, V, dtype, seed=2)
    cu = cu_from_lens(lens, DEV)
    pool = _rand(torch.Generator(device=DEV).manual_seed(3), 80, HV, K, V, scale=0.1)
    slots = torch.randperm(80, generator=gen)[:64].to(torch.int32)
    slots[::7] = -1
    slots = slots.to(DEV)
    has_init = (torch.arange(64) % 3 != 0).to(DEV)
    ours = pool.clone()
    meta = kt.prepare_gdn_metadata(cu)
    o, _ = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots, has_initial_state=has_init,
                                use_qk_l2norm=True, metadata=meta)
    ref_pool = pool.double()
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, state_pool=ref_pool, state_slots=slots,
                                  has_initial_state=has_init, use_qk_l2norm=True)
    assert o.dtype == dtype
    assert_close(o, ro, TOL[dtype], f"output {dtype}")
    assert_close(ours, ref_pool, TOL[dtype], f"pool {dtype}")
    _check_untouched(ours, pool, slots)


@pytest.mark.parametrize("decay", ["weak", "strong"])
def test_prefill_decay_extremes_initial_state(decay):
    lens, H, HV, K, V = [8192, 3000, 1], 16, 32, 128, 128
    d = _gdn_inputs(sum(lens), H, HV, K, V, torch.float32, raw=False, decay=decay, seed=7)
    cu = cu_from_lens(lens, DEV)
    h0 = _rand(torch.Generator(device=DEV).manual_seed(8), len(lens), HV, K, V, scale=0.1)
    o, ht = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    ro, rht = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, initial_state=h0.double(), output_final_state=True,
                                    use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.float32], f"output, {decay} decay")
    assert_close(ht, rht, TOL[torch.float32], f"final state, {decay} decay")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prefill_one_sequence_of_32_value_heads(dtype):
    """The 35B-A3B GDN shape (16 / 32 heads, one 8192-token sequence): 32 (sequence, head) pairs, where the scan
    takes 32-wide V blocks on an H200-sized GPU (kernels_triton.gdn.plan.scan_config); output and pool slot vs
    the fp64 reference."""
    _pool_prefill_vs_reference([8192], 16, 32, dtype, [2], [True], seed=23)


def _pool_prefill_vs_reference(lens, H, HV, dtype, slots, has, seed, K=128, V=128, scan=None):
    """Prefill ``lens`` into pool ``slots`` (-1: padding) with ``has_initial_state`` flags: output and pool vs the
    fp64 reference, slots not named untouched."""
    d = _gdn_inputs(sum(lens), H, HV, K, V, dtype, seed=seed)
    cu = cu_from_lens(lens, DEV)
    pool = _rand(torch.Generator(device=DEV).manual_seed(seed + 1), max(slots) + 2, HV, K, V, scale=0.1)
    slots = torch.tensor(slots, dtype=torch.int32, device=DEV)
    has = torch.tensor(has, device=DEV)
    ours = pool.clone()
    o, _ = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots, has_initial_state=has,
                                       use_qk_l2norm=True, scan=scan, metadata=kt.prepare_gdn_metadata(cu))
    ref_pool = pool.double()
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, state_pool=ref_pool, state_slots=slots,
                                  has_initial_state=has, use_qk_l2norm=True)
    assert_close(o, ro, TOL[dtype], f"output {dtype}")
    assert_close(ours, ref_pool, TOL[dtype], f"pool {dtype}")
    _check_untouched(ours, pool, slots)


@pytest.mark.parametrize("scan_t", [False, True], ids=["w_u", "scan_t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[8269], [3000, 0, 1, 5000, 77]], ids=["one", "ragged"])
def test_prefill_split_output(dtype, lens, scan_t):
    """A forced SPLIT scan config (the scan leaves chunk states and V', a parallel launch computes the output) at the
    397B-TP8 head counts, with W and U or (SCAN_T) T diag(beta) from the prepare: output and pool vs the fp64
    reference, padded slots untouched, chunk rows of several sequences."""
    N = len(lens)
    _pool_prefill_vs_reference(lens, 2, 8, dtype, [N + 1 - i if i != 1 else -1 for i in range(N)],
                               [i % 2 == 0 for i in range(N)], seed=41,
                               scan={"BV": 16, "num_warps": 4, "num_stages": 3, "SPLIT": True, "SCAN_T": scan_t})


def _same_bits_in_parts(d, cu, pool, slots, base, parted, dtype, meta=None):  # noqa: ANN001
    """Prefill into pool ``slots`` with the scan config ``parted`` (parts on three streams): the output and pool bits of
    ``base`` (one launch), eagerly and replayed from a CUDA graph (the side streams fork from and join the capture),
    three calls back to back each; and the fp64 reference's values."""

    def call(p, cfg):  # noqa: ANN001, ANN202
        return gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=p, state_slots=slots, use_qk_l2norm=True,
                                           scan=cfg, metadata=meta)[0]

    want_pool = pool.clone()
    want = [call(want_pool, base) for _ in range(3)]
    got_pool = pool.clone()
    got = [call(got_pool, parted) for _ in range(3)]
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "output in parts differs (eager)"
    assert torch.equal(got_pool, want_pool), "pool in parts differs (eager)"

    graph_pool = pool.clone()
    graph, captured = capture_graph(lambda: [call(graph_pool, parted) for _ in range(3)],
                                    lambda: call(graph_pool.clone(), parted))
    graph_pool.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(captured, want, strict=True)), "graph replay output differs"
    assert torch.equal(graph_pool, want_pool), "graph replay pool differs"

    ref_pool = pool.double()
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, state_pool=ref_pool, state_slots=slots,
                                  use_qk_l2norm=True)
    assert_close(got[0], ro, TOL[dtype], f"output {dtype}")


@pytest.mark.parametrize("scan_t", [False, True], ids=["w_u", "scan_t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seg_prepare", [False, True], ids=["prepare_whole", "prepare_in_parts"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "one_pass"])
def test_prefill_in_segments_same_bits_eager_and_graph(dtype, seg_prepare, split, scan_t):
    """A forced SEGMENTS scan config: one sequence's scan in parts on a high-priority stream, each part's output (split
    scans) and prepare (SEG_PREPARE) beside the scan of the part before / after on two other streams. The same output
    and pool bits as one part, eager and replayed from a CUDA graph (the side streams fork from and join the
    capture), three calls back to back; and the fp64 reference's values."""
    T, H, HV, K, V = 5000, 2, 8, 128, 128
    d = _gdn_inputs(T, H, HV, K, V, dtype, seed=51)
    cu = cu_from_lens([T], DEV)
    pool = _rand(torch.Generator(device=DEV).manual_seed(52), 3, HV, K, V, scale=0.1)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    # The one-pass scan's fp32 workspace (fp16, fp32 inputs) does not fit 3 stages (OutOfResources on the H200).
    stages = 3 if split or dtype == torch.bfloat16 else 2
    base = {"BV": 16, "num_warps": 4, "num_stages": stages, "SPLIT": split, "SCAN_T": scan_t}
    seg = dict(base, SEGMENTS=4, SEG_PREPARE=seg_prepare)

    _same_bits_in_parts(d, cu, pool, slots, base, seg, dtype)


@pytest.mark.parametrize("scan_t", [False, True], ids=["w_u", "scan_t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("groups", [2, 3])
def test_prefill_in_sequence_groups_same_bits_eager_and_graph(dtype, groups, scan_t):
    """A forced GROUPS scan config: a batch's one-pass scans in groups of whole sequences on a high-priority stream,
    each group's prepare beside the scan of the group before. The same output and pool bits as one launch, eager and
    replayed from a CUDA graph, three calls back to back (empty, one-token and ragged sequences, a padded slot); and
    the fp64 reference's values."""
    lens = [3000, 0, 1, 2500, 4096, 700, 64, 1500]
    N, H, HV, K, V = len(lens), 2, 32, 128, 128
    d = _gdn_inputs(sum(lens), H, HV, K, V, dtype, seed=71)
    cu = cu_from_lens(lens, DEV)
    meta = kt.prepare_gdn_metadata(cu)
    pool = _rand(torch.Generator(device=DEV).manual_seed(72), N + 2, HV, K, V, scale=0.1)
    slots = torch.tensor([3, 0, 9, -1, 1, 2, 5, 4], dtype=torch.int32, device=DEV)
    # (the fp32 workspace of fp16 / fp32 inputs: 16-wide V blocks in 2 stages, as in the segments test)
    base = {"BV": 32, "num_warps": 4, "num_stages": 3} if dtype == torch.bfloat16 else {"BV": 16, "num_warps": 4,
                                                                                       "num_stages": 2}
    base["SCAN_T"] = scan_t
    grouped = dict(base, GROUPS=groups, SEG_PREPARE=True)

    _same_bits_in_parts(d, cu, pool, slots, base, grouped, dtype, meta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("HV", [8, 32], ids=["split", "one_pass"])
def test_prefill_default_segments_one_long_sequence(dtype, HV):
    """The default config for one sequence of >= 16384 tokens runs the scan in parts (split scan at <= 16 pairs,
    one-pass scan from 32 pairs on): output and pool slot vs the fp64 reference, other slots untouched."""
    cfg = plan.scan_config(torch.device(DEV), 1, HV, 128, 128, 16384, dtype)
    assert cfg.get("SEGMENTS", 1) == 2 and cfg.get("SPLIT", False) == (HV == 8), cfg
    _pool_prefill_vs_reference([20000], 4, HV, dtype, [2], [True], seed=61)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_default_groups_several_long_sequences(dtype):
    """The default config for several sequences of >= 8192 tokens at 32 value heads scans them in two groups of
    sequences: output and pool slots vs the fp64 reference, other slots untouched."""
    cfg = plan.scan_config(torch.device(DEV), 3, 32, 128, 128, 8192, dtype)
    assert cfg.get("GROUPS", 1) == 2 and cfg["SEG_PREPARE"], cfg
    _pool_prefill_vs_reference([9000, 8192, 8500], 4, 32, dtype, [2, -1, 0], [True, True, False], seed=81)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_split_output_small_head_dims(dtype):
    """SPLIT with head dims under 128 (32-wide output blocks: the tile class Triton 3.6 built wrong in one stage)."""
    _pool_prefill_vs_reference([300, 0, 129], 2, 4, dtype, [3, -1, 0], [True, False, True], seed=43, K=32, V=32,
                               scan={"BV": 16, "num_warps": 4, "num_stages": 3, "SPLIT": True})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[64], [1], [17, 0, 30, 17]], ids=["64", "1", "ragged"])
def test_prefill_short_batch_one_launch(dtype, lens):
    """Batches of at most 64 tokens run both phases in one launch (scan._chunk_single_kernel): output and pool vs
    the fp64 reference at the 27B-TP4 head counts, padded slots and has_initial_state flags included."""
    N = len(lens)
    _pool_prefill_vs_reference(lens, 4, 12, dtype, [N + 1 - i if i != 1 else -1 for i in range(N)],
                               [i % 2 == 0 for i in range(N)], seed=31)


def test_prefill_short_batch_workspace_kept_per_stream():
    """The single-launch path keeps one workspace per stream (launch._single_workspace): the same buffer for two calls
    on a stream, another on another stream; two batches of different lengths back to back on one stream, and the
    first again from a captured graph (a workspace of its own), give the bits of the calls alone."""
    dev = torch.device("cuda")
    first = launch._single_workspace(1000, torch.float32, dev)
    assert launch._single_workspace(500, torch.float32, dev).data_ptr() == first.data_ptr()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert launch._single_workspace(1000, torch.float32, dev).data_ptr() != first.data_ptr()
    d = _gdn_inputs(64, 4, 12, 128, 128, torch.bfloat16, seed=5)
    e = _gdn_inputs(40, 4, 12, 128, 128, torch.bfloat16, seed=6)
    for x in (d, e):
        x["h0"] = torch.randn(1, 12, 128, 128, device=DEV) * 0.1

    def call(x):  # noqa: ANN001, ANN202
        return kt.gdn_chunk_prefill(x["q"], x["k"], x["v"], a=x["a"], b=x["b"], A_log=x["A_log"],
                                    dt_bias=x["dt_bias"], initial_state=x["h0"], output_final_state=True,
                                    use_qk_l2norm=True)

    alone = []
    for x in (d, e):
        alone.append(call(x))
        torch.cuda.synchronize()
    both = [call(d), call(e)]
    for got, want in zip(both, alone, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph, captured = capture_graph(lambda: call(d), lambda: call(d))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], alone[0][0]) and torch.equal(captured[1], alone[0][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dims", [(32, 32), (64, 64), (16, 48), (16, 16), (16, 64)], ids=["32", "64", "16x48", "16",
                                                                                      "16x64"])
@pytest.mark.parametrize("lens", [[100, 37], [40, 0, 20], [300, 200]], ids=["two_launches", "one_launch", "longer"])
def test_prefill_small_head_dims(dtype, dims, lens):
    """Head dims under 128 (the tiny test models' 32): narrower prepare tiles (one pipeline stage) and scan
    blocks than any Qwen3.5 size, the class of tiles Triton 3.6 built wrong in the bf16 scan (session 7) and, at 16
    columns, in the bf16 prepare (session 9: an illegal address or errors of 0.01-1.1; bf16 now takes the fp32
    workspace under 32 columns, plan.workspace_dtype)."""
    K, V = dims
    _pool_prefill_vs_reference(lens, 2, 4, dtype, [3, -1, 0][:len(lens)], [True, False, True][:len(lens)], seed=33,
                               K=K, V=V)


@pytest.mark.parametrize("scan_t", [False, True], ids=["w_u", "scan_t"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("bv", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_scan_configs(dtype, bv, stages, scan_t):
    """Every scan config the op accepts, with W and U or (SCAN_T) T diag(beta) from the prepare, gives the
    reference's output (Triton 3.6 built bf16 scans in one stage with V blocks under 64 wrong on an H200; the op
    refuses those, checked here too). A config the device's shared memory cannot hold is skipped."""
    import triton

    lens, H, HV, K, V = [300, 1, 64, 129], 2, 8, 128, 128
    d = _gdn_inputs(sum(lens), H, HV, K, V, dtype, seed=29)
    cu = cu_from_lens(lens, DEV)
    h0 = _rand(torch.Generator(device=DEV).manual_seed(30), len(lens), HV, K, V, scale=0.1)
    cfg = {"BV": bv, "num_warps": 4, "num_stages": stages, "SCAN_T": scan_t}
    if dtype == torch.bfloat16 and stages == 1 and bv < 64:
        with pytest.raises(ValueError, match="num_stages >= 2"):
            gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True, scan=cfg)
        return
    try:
        o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm=True, scan=cfg)
    except triton.runtime.errors.OutOfResources as e:
        pytest.skip(f"does not fit this GPU: {e}")
    ro, rht = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, initial_state=h0.double(), output_final_state=True,
                                    use_qk_l2norm=True)
    assert_close(o, ro, TOL[dtype], f"output {cfg}")
    assert_close(ht, rht, TOL[dtype], f"final state {cfg}")


PREPARE_VARIANTS = {  # the prepare kernel's forms a forced config can take (see kernels_triton.gdn.plan)
    "default": {},
    "substitution_uncapped": {"maxnreg": None},
    "diag_rows_16": {"DIAG_ROWS": 16, "BLOCK_INV": 0, "SCALE_K": False},
    "diag_rows_8": {"DIAG_ROWS": 8},
    "diag_rows_4": {"DIAG_ROWS": 4},
    "columns_32": {"BKC": 32, "BVC": 32},
    "blocked_merges_16": {"BLOCK_INV": 1},
    "blocked_merges_16_scale_k": {"BLOCK_INV": 1, "SCALE_K": True},
    "full_merges": {"BLOCK_INV": 0, "SCALE_K": False},
}
HARD_OK = tuple(PREPARE_VARIANTS)  # every form is fp32-exact on the diagonal (no cancelling products)


@pytest.mark.parametrize("keys", ["positive", "hard"])
@pytest.mark.parametrize("variant", list(PREPARE_VARIANTS))
def test_prefill_prepare_variants_correlated_keys(variant, keys):
    """Prepare variants with all-positive keys (as after the conv's SiLU: strongly correlated, the hard case
    for the inverse) and weak decay; "hard": keys |z| + 1 (mean cosine ~0.9), beta in [0.95, 1], no decay."""
    if keys == "hard" and variant not in HARD_OK:
        pytest.skip("only the fp32-accurate diagonal inverses are held to the hard keys")
    lens, H, HV, K, V = ([1024, 77] if keys == "hard" else [8192, 777]), 4, 12, 128, 128
    d = _gdn_inputs(sum(lens), H, HV, K, V, torch.bfloat16, raw=False, decay="weak", seed=19)
    if keys == "hard":
        d["k"] = d["k"].abs() + 1.0
        gen = torch.Generator(device=DEV).manual_seed(20)
        d["beta"] = (0.95 + 0.05 * torch.rand(d["beta"].shape, device=DEV, generator=gen)).to(d["beta"].dtype)
        d["g"] = torch.zeros_like(d["g"])
    else:
        d["k"] = d["k"].abs() + 0.5
    cu = cu_from_lens(lens, DEV)
    cfg = {"num_warps": 4, "num_stages": 1, "maxnreg": 168, **PREPARE_VARIANTS[variant]}  # None: no cap
    o, ht = gdn_bench.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                        prepare=cfg)
    ro, rht = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, TOL[torch.bfloat16], "output")
    assert_close(ht, rht, TOL[torch.bfloat16], "final state")


def test_prefill_direct_launch_matches_jit_launch():
    """Calls after the first launch the compiled kernels directly (bit-identical to the first). Unaligned
    views: q / k are realigned by the op (the scan's pipelined copies misread them), other inputs make
    another specialisation that goes through the JIT; both agree with the aligned call."""
    T, H, HV, K, V = 700, 4, 12, 128, 128
    d = _gdn_inputs(T, H, HV, K, V, torch.bfloat16, seed=21)
    first, _ = kt.gdn_chunk_prefill(**d, use_qk_l2norm=True)
    again, _ = kt.gdn_chunk_prefill(**d, use_qk_l2norm=True)
    assert torch.equal(first, again)
    for name in ("q", "k", "a"):
        x = d[name]
        shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=DEV)[1:].view(x.shape)
        shifted.copy_(x)
        moved, _ = kt.gdn_chunk_prefill(**dict(d, **{name: shifted}), use_qk_l2norm=True)
        assert_close(moved, first, 1e-4, f"{name} shifted by one element")


def test_continuation_across_calls_then_decode():
    """One 10004-token sequence fed as prefill 3000 + 1 + 6999 then a 4-token decode step == one pass."""
    T, H, HV, K, V = 10004, 4, 12, 128, 128
    d = _gdn_inputs(T, H, HV, K, V, torch.bfloat16, seed=9)
    pool = torch.zeros(4, HV, K, V, device=DEV)
    slot = torch.tensor([2], dtype=torch.int32, device=DEV)
    outs, pos = [], 0
    for n in (3000, 1, 6999):
        part = {k: (v[pos:pos + n] if v.dim() > 1 else v) for k, v in d.items()}
        outs.append(kt.gdn_chunk_prefill(**part, state_pool=pool, state_slots=slot, use_qk_l2norm=True)[0])
        pos += n
    step = {k: (v[pos:][None] if v.dim() > 1 else v) for k, v in d.items()}
    outs.append(kt.gdn_recurrent_step(**step, state_pool=pool, state_slots=slot, use_qk_l2norm=True)[0])
    ro, rht = ref.gdn_chunk_prefill(**_f64(d), output_final_state=True, use_qk_l2norm=True)
    assert_close(torch.cat(outs), ro, TOL[torch.bfloat16], "continued output")
    assert_close(pool[2], rht[0], TOL[torch.bfloat16], "continued state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
def test_decode_step_pool(dtype, T):
    B, H, HV, K, V = 256, 16, 48, 128, 128
    d = _gdn_inputs(T, H, HV, K, V, dtype, seed=11, lead=(B,))
    pool = _rand(torch.Generator(device=DEV).manual_seed(12), 300, HV, K, V, scale=0.1)
    slots = torch.randperm(300, generator=torch.Generator().manual_seed(13))[:B].to(torch.int32)
    slots[5::9] = -1
    slots = slots.to(DEV)
    ours = pool.clone()
    o = kt.gdn_recurrent_step(**d, state_pool=ours, state_slots=slots, use_qk_l2norm=True)
    ref_pool = pool.double()
    ro = ref.gdn_recurrent_step(**_f64(d), state_pool=ref_pool, state_slots=slots, use_qk_l2norm=True)
    assert_close(o, ro, TOL[dtype], f"decode output {dtype}")
    assert_close(ours, ref_pool, TOL[dtype], f"decode pool {dtype}")
    assert torch.all(o[slots < 0] == 0)
    _check_untouched(ours, pool, slots)


@pytest.mark.parametrize("B,T", [(1, 1), (8, 2), (128, 1), (512, 1)])
def test_decode_step_pdl_gives_the_same_bits(B, T):
    """The step launched with programmatic dependent launch (each launch starting while the one before finishes)
    against without: the same output and pool bits over six steps back to back on the same slots (each reads the
    states the one before wrote: a read before they are complete would show), eagerly and replayed from a CUDA
    graph of the six steps."""
    from kernels_triton.gdn import recurrent

    H, HV, K, V = 4, 12, 128, 128
    steps = [_gdn_inputs(T, H, HV, K, V, torch.bfloat16, seed=40 + i, lead=(B,)) for i in range(6)]
    pool0 = _rand(torch.Generator(device=DEV).manual_seed(50), B + 3, HV, K, V, scale=0.1)
    slots = torch.arange(B, dtype=torch.int32, device=DEV).flip(0) + 2
    slots[B // 2] = -1

    def run(pool: torch.Tensor, pdl: bool) -> list[torch.Tensor]:
        return [gdn_bench.gdn_recurrent_step(**d, state_pool=pool, state_slots=slots, use_qk_l2norm=True,
                                             config={"PDL": pdl}) for d in steps]

    assert recurrent._use_pdl(pool0.device, {"PDL": True}) == (torch.cuda.get_device_capability()[0] >= 9)
    want_pool = pool0.clone()
    want = run(want_pool, False)
    for _ in range(2):
        pool = pool0.clone()
        got = run(pool, True)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "PDL changed the output"
        assert torch.equal(pool, want_pool), "PDL changed the pool"
    pool = pool0.clone()
    graph, captured = capture_graph(lambda: run(pool, True), lambda: run(pool, True))
    for _ in range(2):
        pool.copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(g, w) for g, w in zip(captured, want, strict=True)), "graph replay differs"
        assert torch.equal(pool, want_pool), "graph replay changed the pool differently"


def test_decode_and_conv_update_capture_in_cuda_graph():
    B, H, HV, K, V, D, W = 32, 4, 12, 128, 128, 3072, 4
    gen = torch.Generator(device=DEV).manual_seed(14)
    d = _gdn_inputs(1, H, HV, K, V, torch.bfloat16, seed=15, lead=(B,))
    x, cw = _rand(gen, B, D, dtype=torch.bfloat16), _rand(gen, D, W, dtype=torch.bfloat16, scale=0.5)
    state = _rand(gen, 40, HV, K, V, scale=0.1)
    conv = _rand(gen, 40, D, W - 1, dtype=torch.bfloat16)
    slots = torch.arange(B, dtype=torch.int32, device=DEV)
    slots[1] = -1
    state0, conv0 = state.clone(), conv.clone()

    def step():
        return (kt.gdn_recurrent_step(**d, state_pool=state, state_slots=slots, use_qk_l2norm=True),
                kt.causal_conv1d_update(x, cw, None, conv_pool=conv, conv_slots=slots))

    eager = step()
    eager_state, eager_conv = state.clone(), conv.clone()
    state.copy_(state0)
    conv.copy_(conv0)
    graph, captured = capture_graph(step, step)
    state.copy_(state0)
    conv.copy_(conv0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert torch.equal(state, eager_state) and torch.equal(conv, eager_conv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_varlen_pool_real_width(dtype):
    gen = torch.Generator().manual_seed(16)
    lens = torch.randint(1, 1025, (64,), generator=gen).tolist()
    lens[0], lens[1], lens[2] = 1, 2, 0
    D, W = 10240, 4
    g = torch.Generator(device=DEV).manual_seed(17)
    x, w, b = _rand(g, sum(lens), D, dtype=dtype), _rand(g, D, W, dtype=dtype, scale=0.5), _rand(g, D, dtype=dtype)
    cu = cu_from_lens(lens, DEV)
    pool = _rand(g, 70, D, W - 1, dtype=dtype)
    slots = torch.randperm(70, generator=gen)[:64].to(torch.int32)
    slots[::5] = -1
    slots = slots.to(DEV)
    has_init = (torch.arange(64) % 4 != 1).to(DEV)
    ours = pool.clone()
    y = kt.causal_conv1d_prefill(x, w, b, cu_seqlens=cu, conv_pool=ours, conv_slots=slots, has_initial_state=has_init)
    ref_pool = pool.double()
    ry = ref.causal_conv1d_prefill(x.double(), w.double(), b.double(), cu_seqlens=cu, conv_pool=ref_pool,
                                   conv_slots=slots, has_initial_state=has_init)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert_close(y, ry, tol, "conv output")
    assert_close(ours, ref_pool, tol, "conv pool")
    _check_untouched(ours, pool, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_real_sizes(dtype):
    g = torch.Generator(device=DEV).manual_seed(18)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    x, z, w = _rand(g, 4096, 48, 128, dtype=dtype), _rand(g, 4096, 48, 128, dtype=dtype), _rand(g, 128)
    assert_close(kt.rms_norm_gated(x, z, w), ref.rms_norm_gated(x.double(), z.double(), w.double()), tol, "gated")
    x, r, w = _rand(g, 4096, 5120, dtype=dtype), _rand(g, 4096, 5120, dtype=dtype), _rand(g, 5120, scale=0.1)
    y, s = kt.rms_norm_zero_centered(x, w.to(dtype), 1e-6, r)
    assert torch.equal(s, x + r)
    assert_close(y, ref.rms_norm_zero_centered(s.double(), w.to(dtype).double()), tol, "zero-centred + residual")


def test_probe_picks_triton_for_gdn_conv_norm_ops(fresh_probe):
    """On an sm80+ NVIDIA GPU the policy puts triton first; each op must compile and pass its self-test."""
    for op in ("gdn_chunk_prefill", "gdn_recurrent_step", "causal_conv1d_prefill", "causal_conv1d_update",
               "rms_norm_gated", "rms_norm_zero_centered"):
        choice = fresh_probe.choose(op, DEV)
        assert choice.backend == "triton", f"{op}: {choice.reason}"
