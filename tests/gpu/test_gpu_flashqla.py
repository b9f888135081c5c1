"""The ``flashqla`` backend on a GPU with FlashQLA installed (skipped without CUDA, without ``flash_qla``, or on a
device FlashQLA does not build for): the wrapper around the real kernel against the fp64 reference on varlen batches
with empty sequences and state pools, a long sequence its context-parallel plan cuts, the probe-time self-test and
warm-up (their cost printed), routing by a crossover table, and no compilation inside a request after the warm-up.

    PYTHONPATH=/tmp/site:. python -m pytest -q -s tests/gpu/test_gpu_flashqla.py
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import assert_close, cu_from_lens

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3}  # rel err, whole tensor (as tests/gpu/test_gpu_gdn.py)


def _flashqla():  # noqa: ANN202 - the backend module, or a skip naming why FlashQLA cannot run here
    from kernels_cuda import flashqla

    cap = torch.cuda.get_device_capability()
    if cap not in flashqla.SUPPORTED_CAPABILITIES:
        pytest.skip(f"FlashQLA does not build for sm{cap[0]}{cap[1]}")
    try:
        flashqla.kernel()
    except Exception as e:  # noqa: BLE001 - the optional extra is absent or broken: nothing to test
        pytest.skip(f"flash_qla does not import: {type(e).__name__}: {e}")
    return flashqla


def _inputs(lens, H, HV, dtype, seed):  # noqa: ANN001, ANN202
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, K = sum(lens), 128

    def rnd(*shape, scale=1.0, dt=None):  # noqa: ANN002, ANN202
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dt or dtype)

    return dict(q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, HV, K), a=rnd(T, HV), b=rnd(T, HV),
                A_log=rnd(HV, scale=0.5, dt=torch.float32), dt_bias=rnd(HV, scale=0.5, dt=torch.float32))


def _f64(d: dict) -> dict:
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wrapper_against_fp64_with_empty_sequences_and_a_pool(dtype):
    from qwen35 import reference as ref

    fq = _flashqla()
    lens = [0, 300, 0, 1, 4096, 129, 0]
    N, H, HV, K = len(lens), 2, 8, 128
    d = _inputs(lens, H, HV, dtype, seed=1)
    cu = cu_from_lens(lens, DEV)
    pool = torch.randn(N + 3, HV, K, K, device=DEV) * 0.1
    slots = torch.tensor([9, 4, 0, -1, 2, 7, 5], dtype=torch.int32, device=DEV)
    flags = torch.tensor([True, True, False, True, False, True, True], device=DEV)
    ours, want = pool.clone(), pool.double()
    meta = fq.prepare_gdn_metadata(cu)
    o, none = fq.flashqla_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots, has_initial_state=flags,
                                  use_qk_l2norm=True, metadata=meta)
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, state_pool=want, state_slots=slots,
                                  has_initial_state=flags, use_qk_l2norm=True)
    assert none is None and o.dtype == dtype
    assert_close(o, ro, TOL[dtype], "output")
    assert_close(ours, want, TOL[dtype], "pool")
    for s in (1, 3, 6, 8):
        assert torch.equal(ours[s], pool[s]), f"slot {s}, named by no sequence, changed"
    assert torch.equal(ours[0], torch.zeros_like(pool[0])), "an empty sequence from zeros zeroes its slot"
    assert torch.equal(ours[9], pool[9]) and torch.equal(ours[5], pool[5]), "an empty sequence keeps its slot"
    # tensor states in, final states out (an empty sequence's final state is its initial state)
    h0 = torch.randn(N, HV, K, K, device=DEV) * 0.1
    o, ht = fq.flashqla_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                                metadata=meta)
    ro, rht = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, initial_state=h0.double(), output_final_state=True,
                                    use_qk_l2norm=True)
    assert_close(o, ro, TOL[dtype], "output (tensor states)")
    assert_close(ht, rht, TOL[dtype], "final states")
    assert torch.equal(ht[0], h0[0]) and torch.equal(ht[2], h0[2])


def test_a_long_sequence_cut_by_flashqlas_plan():
    """One 32768-token sequence at 8 value heads (FlashQLA's context-parallel plan cuts it on an H200) from a pool
    slot: output and final state against the fp64 reference."""
    from qwen35 import reference as ref

    fq = _flashqla()
    lens, H, HV, K = [32768], 2, 8, 128
    d = _inputs(lens, H, HV, torch.bfloat16, seed=2)
    cu = cu_from_lens(lens, DEV)
    pool = torch.randn(2, HV, K, K, device=DEV) * 0.1
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    ours, want = pool.clone(), pool.double()
    o, _ = fq.flashqla_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots, use_qk_l2norm=True)
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, state_pool=want, state_slots=slots, use_qk_l2norm=True)
    lay = fq.batch_layout(None, cu, sum(lens), torch.device(DEV))
    print(f"\nFlashQLA cuts 1x32768 at HV=8: {getattr(fq.kernel().context(lay.cu_kept, HV), 'is_intra', None)}")
    assert_close(o, ro, TOL[torch.bfloat16], "output")
    assert_close(ours[1], want[1], TOL[torch.bfloat16], "final state")
    assert torch.equal(ours[0], pool[0])


def test_probe_self_test_warm_up_and_routing(tmp_path, monkeypatch, fresh_probe):
    """With a crossover table that gives 1x32768 and 8x4096 batches of H=2 / HV=8 to FlashQLA: the probe chooses the
    backend after its self-test and warm-up (their cost printed); such batches run on FlashQLA, within the reference's
    budget, their first call after the warm-up compiling nothing (well under the 10 s a TileLang compile takes); a
    batch near no bucket and an fp32 batch run on triton."""
    from kernels_triton.bench_api import clear_config_cache
    from qwen35 import reference as ref

    fq = _flashqla()
    name = torch.cuda.get_device_name()
    from kernels_triton._config import device_slug

    (tmp_path / device_slug(name)).mkdir()
    (tmp_path / device_slug(name) / f"{fq.TABLE_OP}.json").write_text(json.dumps({"device": name, "entries": {
        "H=2,HV=8,dtype=bfloat16,seqs=1": {"32768": {"pick": "flashqla"}},
        "H=2,HV=8,dtype=bfloat16,seqs=8": {"4096": {"pick": "flashqla"}}}}))
    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    clear_config_cache()
    fq.reset()
    t0 = time.perf_counter()
    choice = fresh_probe.choose("gdn_chunk_prefill", DEV)
    probe_s = time.perf_counter() - t0
    print(f"\nprobe with FlashQLA self-test and warm-up: {probe_s:.1f} s; warm-up by heads: {fq.WARMUP}")
    assert choice.backend == "flashqla", choice.reason
    for lens in ([20000], [50000], [3000] * 8, [5000] * 7 + [0]):
        d = _inputs(lens, 2, 8, torch.bfloat16, seed=3)
        cu = cu_from_lens(lens, DEV)
        pool = torch.randn(len(lens), 8, 128, 128, device=DEV) * 0.1
        slots = torch.arange(len(lens), dtype=torch.int32, device=DEV)
        ours, want = pool.clone(), pool.double()
        before = fq.CALLS["flashqla"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, _ = fq.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots, use_qk_l2norm=True,
                                    metadata=fq.prepare_gdn_metadata(cu))
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        print(f"{len(lens)}x{max(lens)}: first call {first_s * 1e3:.1f} ms on {fq.route(o.device, o.dtype, 2, 8, 128, 128, len(lens), sum(lens))}")  # noqa: E501
        assert fq.CALLS["flashqla"] == before + 1, f"{lens} did not run on FlashQLA"
        assert first_s < 2.0, f"{lens}: first call took {first_s:.1f} s (a compilation inside a request?)"
        ro, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, state_pool=want, state_slots=slots,
                                      use_qk_l2norm=True)
        assert_close(o, ro, TOL[torch.bfloat16], f"output {len(lens)}x{max(lens)}")
        assert_close(ours, want, TOL[torch.bfloat16], f"pool {len(lens)}x{max(lens)}")
    dev = torch.device(DEV)
    assert fq.route(dev, torch.bfloat16, 2, 8, 128, 128, 1, 2048)[0] == "triton"
    assert fq.route(dev, torch.float32, 2, 8, 128, 128, 1, 32768) == (
        "triton", "FlashQLA takes bf16 or fp16 activations, got float32")
    assert fq.route(dev, torch.bfloat16, 4, 12, 128, 128, 1, 32768)[0] == "triton"
    fq.reset()
    clear_config_cache()
