"""The ``flashqla`` backend (kernels_cuda/flashqla.py) without FlashQLA: its wrapper's state-pool, slot, empty-sequence
and gating logic around a stand-in for FlashQLA's kernel, its crossover-table lookup, its routing, and the probe
skipping it with the reason.

The stand-in (:func:`flashqla_stand_in_computed_by_reference`) is not FlashQLA: it takes FlashQLA's arguments, refuses
what FlashQLA refuses (fp32, zero-length sequences in ``cu_seqlens``, initial states that are not one fp32 row per
sequence it is given) and computes the result with our fp64 reference. What is tested is what the wrapper does before
and after the kernel; tests/gpu/test_gpu_flashqla.py runs the real kernel against fp64.
"""

from __future__ import annotations

import importlib.util
import json
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (also done by conftest)

import pytest
import torch
from helpers import assert_close, cu_from_lens, gdn_inputs

import kernels_triton as kt
from kernels_cuda import flashqla
from kernels_triton.bench_api import clear_config_cache
from kernels_triton.gdn import GdnChunkMetadata
from qwen35 import backends
from qwen35 import reference as ref
from qwen35.probe import DeviceCaps

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HV, K = 1, 2, 128


class StandIn:
    """A stand-in for FlashQLA's entry points, computed by our reference; counts its calls and context builds."""

    def __init__(self) -> None:
        self.calls, self.contexts = 0, []

    def context(self, cu_seqlens: torch.Tensor, HV: int) -> object:
        ctx = ("stand-in context", cu_seqlens.tolist(), HV)
        self.contexts.append(ctx)
        return ctx

    def kernel(self) -> flashqla.Kernel:
        return flashqla.Kernel(self.flashqla_stand_in_computed_by_reference, self.context, "stand-in")

    def flashqla_stand_in_computed_by_reference(self, q, k, v, g, beta, *, scale, initial_state, output_final_state,  # noqa: ANN001, ANN201
                                                use_qk_l2norm_in_kernel, cu_seqlens, cp_context):
        self.calls += 1
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("FlashQLA only supports bfloat16 and float16.")
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if q.shape[0] != 1 or min(lens) <= 0:
            raise ValueError(f"stand-in: B must be 1 and no sequence empty, got {lens}")
        assert initial_state.dtype == torch.float32 and initial_state.shape[0] == len(lens), initial_state.shape
        assert g.dtype == beta.dtype == torch.float32 and output_final_state
        assert cp_context == ("stand-in context", cu_seqlens.tolist(), v.shape[2]), "the batch's context"
        o, final = ref.gdn_chunk_prefill(q[0].double(), k[0].double(), v[0].double(), g=g[0].double(),
                                         beta=beta[0].double(), cu_seqlens=cu_seqlens,
                                         initial_state=initial_state.double(), output_final_state=True, scale=scale,
                                         use_qk_l2norm=use_qk_l2norm_in_kernel)
        return o[None].to(q.dtype), final.float()


def _to64(d: dict) -> dict:
    return {k: (v.double().cpu() if isinstance(v, torch.Tensor) and v.is_floating_point() else
                (v.cpu() if isinstance(v, torch.Tensor) else v)) for k, v in d.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("raw", [True, False], ids=["raw_gating", "g_beta"])
def test_pool_slots_and_empty_sequences(dtype, raw):
    """Empty sequences first, in the middle and last, a one-token sequence, a padded slot, has_initial_state False
    rows: output and pool as the reference's for the whole batch; the kernel sees no empty sequence; slots no sequence
    names stay untouched; an empty sequence's slot keeps its state, or is zeroed where it starts from zeros."""
    lens = [0, 70, 0, 1, 130, 0]
    N = len(lens)
    d = gdn_inputs(sum(lens), H, HV, K, K, dtype=dtype, device=DEV, seed=1, raw=raw)
    cu = cu_from_lens(lens, DEV)
    pool = (torch.randn(N + 3, HV, K, K, generator=torch.Generator().manual_seed(2)) * 0.1).to(DEV)
    slots = torch.tensor([4, 0, 7, -1, 2, 8], dtype=torch.int32, device=DEV)
    flags = torch.tensor([False, True, True, True, False, True], device=DEV)
    ours, want = pool.clone(), pool.double().cpu()
    stand_in = StandIn()
    o, none = flashqla.flashqla_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots,
                                        has_initial_state=flags, use_qk_l2norm=True, kernel_fn=stand_in.kernel())
    ro, _ = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), state_pool=want, state_slots=slots.cpu(),
                                  has_initial_state=flags.cpu(), use_qk_l2norm=True)
    assert none is None and o.dtype == dtype and stand_in.calls == 1
    assert_close(o, ro, 1e-2, "output")
    assert_close(ours, want, 1e-6, "pool")
    for s in (1, 3, 5, 6):
        assert torch.equal(ours[s], pool[s]), f"slot {s}, named by no sequence, changed"
    assert torch.equal(ours[4], torch.zeros_like(pool[4])), "empty sequence from zeros: its slot is zeroed"
    assert torch.equal(ours[7], pool[7]) and torch.equal(ours[8], pool[8]), "empty sequence: its slot keeps its state"


def test_tensor_states_no_states_out_buffer_and_no_cu_seqlens():
    """Initial states as a tensor with the final states returned (an empty sequence's is its initial state), no
    states at all, the output written into a caller's buffer, one sequence without cu_seqlens."""
    lens = [65, 0, 3]
    d = gdn_inputs(sum(lens), H, HV, K, K, dtype=torch.bfloat16, device=DEV, seed=3)
    cu = cu_from_lens(lens, DEV)
    h0 = (torch.randn(len(lens), HV, K, K, generator=torch.Generator().manual_seed(4)) * 0.1).to(DEV)
    stand_in = StandIn()
    buf = torch.empty(sum(lens), HV, K, dtype=torch.bfloat16, device=DEV)
    o, ht = flashqla.flashqla_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm=True, out=buf, kernel_fn=stand_in.kernel())
    ro, rht = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), initial_state=h0.double().cpu(),
                                    output_final_state=True, use_qk_l2norm=True)
    assert o is buf
    assert_close(o, ro, 1e-2, "output")
    assert_close(ht, rht, 1e-6, "final states")
    assert torch.equal(ht[1], h0[1])
    o, ht = flashqla.flashqla_prefill(**d, cu_seqlens=cu, use_qk_l2norm=True, kernel_fn=stand_in.kernel())
    ro, _ = ref.gdn_chunk_prefill(**_to64(d), cu_seqlens=cu.cpu(), use_qk_l2norm=True)
    assert ht is None
    assert_close(o, ro, 1e-2, "output without states")
    d = gdn_inputs(100, H, HV, K, K, dtype=torch.float16, device=DEV, seed=5)
    o, ht = flashqla.flashqla_prefill(**d, output_final_state=True, use_qk_l2norm=True, kernel_fn=stand_in.kernel())
    ro, rht = ref.gdn_chunk_prefill(**_to64(d), output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, 1e-2, "output (no cu_seqlens)")
    assert_close(ht, rht, 1e-6, "final state (no cu_seqlens)")


def test_a_batch_of_empty_sequences_never_reaches_the_kernel():
    d = gdn_inputs(0, H, HV, K, K, dtype=torch.bfloat16, device=DEV, seed=6)
    cu = cu_from_lens([0, 0, 0], DEV)
    pool = torch.ones(3, HV, K, K, device=DEV)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
    flags = torch.tensor([False, True, True], device=DEV)
    stand_in = StandIn()
    o, _ = flashqla.flashqla_prefill(**d, cu_seqlens=cu, state_pool=pool, state_slots=slots, has_initial_state=flags,
                                     kernel_fn=stand_in.kernel())
    assert o.shape == (0, HV, K) and stand_in.calls == 0
    assert torch.equal(pool[2], torch.zeros_like(pool[2])) and torch.equal(pool[0], torch.ones_like(pool[0]))


def test_per_batch_pieces_are_built_once_for_every_layer():
    """The batch's layout and FlashQLA's context (per value-head count) are built at the batch's first call and kept
    with its metadata; a rewritten cu_seqlens gets new ones."""
    lens = [64, 0, 100]
    d = gdn_inputs(sum(lens), H, HV, K, K, dtype=torch.bfloat16, device=DEV, seed=7)
    cu = cu_from_lens(lens, DEV)
    meta = flashqla.prepare_gdn_metadata(cu)
    assert meta.offsets == (0, 64, 64, 164) and isinstance(meta, GdnChunkMetadata)
    stand_in = StandIn()
    for _ in range(3):  # three layers of one batch
        flashqla.flashqla_prefill(**d, cu_seqlens=cu, metadata=meta, kernel_fn=stand_in.kernel())
    assert stand_in.calls == 3 and len(stand_in.contexts) == 1
    assert stand_in.contexts[0][1] == [0, 64, 164]
    cu[1] = 32  # the buffer reused by another batch: the kept pieces no longer apply
    cu[2] = 32
    flashqla.flashqla_prefill(**d, cu_seqlens=cu, metadata=meta, kernel_fn=stand_in.kernel())
    assert len(stand_in.contexts) == 2 and stand_in.contexts[1][1] == [0, 32, 164]


def test_what_flashqla_cannot_take_is_refused_with_the_reason():
    d = gdn_inputs(10, H, HV, K, K, dtype=torch.float32, device=DEV, seed=8)
    with pytest.raises(ValueError, match="bf16 or fp16 activations, got float32"):
        flashqla.flashqla_prefill(**d, kernel_fn=StandIn().kernel())
    d = gdn_inputs(10, H, HV, 64, 64, dtype=torch.bfloat16, device=DEV, seed=8)
    with pytest.raises(ValueError, match="K = V = 128, got K=64, V=64"):
        flashqla.flashqla_prefill(**d, kernel_fn=StandIn().kernel())
    assert flashqla.route(torch.device("cpu"), torch.bfloat16, H, HV, K, K, 1, 10) == ("triton", "not a CUDA device")


def test_the_backend_hands_other_batches_to_triton():
    """Where the route is triton (here: a CPU device; on a GPU fp32, other head dims, or the table's pick), the op is
    the triton backend's, with this backend's metadata (the triton backend's)."""
    lens = [70, 0, 5]
    d = gdn_inputs(sum(lens), 2, 4, 32, 32, dtype=torch.float32, device=DEV, seed=9, raw=True)
    cu = cu_from_lens(lens, DEV)
    meta = flashqla.prepare_gdn_metadata(cu)
    before = flashqla.CALLS["triton"]
    o, ht = flashqla.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                       metadata=meta)
    ro, rht = kt.gdn_chunk_prefill(**d, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                   metadata=kt.prepare_gdn_metadata(cu))
    assert flashqla.CALLS["triton"] == before + 1
    assert torch.equal(o, ro) and torch.equal(ht, rht)


@pytest.mark.slow
def test_prepare_runs_the_self_test_and_the_warm_up(tmp_path, monkeypatch):
    """The probe's build hook around the stand-in: the self-test (its fp64 recurrence the ground truth) passes a
    kernel that computes the right thing, then every table bucket and launch-grid class runs once and the heads
    count as warmed; a kernel that gets the states wrong fails it, naming the error and the dtype."""
    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / f"{flashqla.TABLE_OP}.json").write_text(json.dumps({"entries": {
        "H=1,HV=2,dtype=bfloat16,seqs=2": {"100": {"pick": "flashqla"}}}}))
    clear_config_cache()
    flashqla.reset()
    cpu = torch.device("cpu")
    stand_in = StandIn()
    monkeypatch.setattr(flashqla, "kernel", stand_in.kernel)
    flashqla.prepare(cpu)
    assert stand_in.calls == 1 + 9  # the self-test; L2 off once, seven grid classes, one bucket
    assert ("cpu", 1, 2, torch.bfloat16) in flashqla._WARMED and flashqla.WARMUP[("cpu", 1, 2, "bfloat16")] > 0

    class Wrong(StandIn):
        def flashqla_stand_in_computed_by_reference(self, *args, **kw):  # noqa: ANN002, ANN003, ANN201
            o, final = super().flashqla_stand_in_computed_by_reference(*args, **kw)
            return o, final * 0.9

    monkeypatch.setattr(flashqla, "kernel", Wrong().kernel)
    with pytest.raises(RuntimeError, match=r"self-test failed on cpu: rel err .* \(bfloat16\)"):
        flashqla.prepare(cpu)
    flashqla.reset()
    clear_config_cache()


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """A crossover table for a device named "Test GPU" in a fresh config directory."""
    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    (tmp_path / "test_gpu").mkdir()
    entries = {
        "H=2,HV=8,dtype=bfloat16,seqs=1": {"8192": {"pick": "triton"}, "32768": {"pick": "flashqla", "triton_ms": 0.64,
                                                                                  "flashqla_ms": 0.26}},
        "H=16,HV=48,dtype=bfloat16,seqs=8": {"4096": {"pick": "flashqla"}},
        "H=16,HV=48,dtype=float16,seqs=8": {"4096": {"pick": "triton"}},
        "not a key": {"64": {"pick": "flashqla"}},
    }
    (tmp_path / "test_gpu" / f"{flashqla.TABLE_OP}.json").write_text(json.dumps(
        {"device": "Test GPU", "op": flashqla.TABLE_OP, "entries": entries}))
    clear_config_cache()
    yield tmp_path
    clear_config_cache()


def test_crossover_table_lookup(table_dir):
    """The nearest bucket of the batch's shape key within a factor of two of its tokens per sequence decides; a
    batch near no bucket, a shape key or dtype the table lacks: no pick (the backend runs triton)."""
    pick = flashqla.table_pick
    assert flashqla.shape_key(2, 8, torch.bfloat16, 1) == "H=2,HV=8,dtype=bfloat16,seqs=1"
    assert flashqla.shape_key(2, 8, torch.bfloat16, 6) == "H=2,HV=8,dtype=bfloat16,seqs=8"
    assert flashqla.shape_key(2, 8, torch.bfloat16, 5) == "H=2,HV=8,dtype=bfloat16,seqs=4"
    assert pick("Test GPU", 2, 8, torch.bfloat16, 1, 32768) == "flashqla"
    assert pick("Test GPU", 2, 8, torch.bfloat16, 1, 65536) == "flashqla"  # a factor of two away
    assert pick("Test GPU", 2, 8, torch.bfloat16, 1, 140000) is None  # beyond it
    assert pick("Test GPU", 2, 8, torch.bfloat16, 1, 12000) == "triton"
    assert pick("Test GPU", 2, 8, torch.bfloat16, 1, 1000) is None
    assert pick("Test GPU", 2, 8, torch.bfloat16, 2, 32768) is None  # seqs=2: no entry
    assert pick("Test GPU", 16, 48, torch.float16, 8, 4096) == "triton"
    assert pick("Other GPU", 2, 8, torch.bfloat16, 1, 32768) is None
    heads = flashqla.table_heads("Test GPU")
    assert heads == {(2, 8, torch.bfloat16): [(1, 32768)], (16, 48, torch.bfloat16): [(8, 4096)]}


def _caps(vendor: str, capability: tuple[int, int] | None) -> DeviceCaps:
    return DeviceCaps(device="cpu", vendor=vendor, name="NVIDIA H200 (stand-in caps)", capability=capability,
                      bf16=True, triton_runs=True)


def test_availability_says_why_not(fresh_probe):
    """CPU, an sm80 GPU, and (FlashQLA not installed here) an sm90 GPU: each verdict names its reason; the probe
    passes it on and falls back along its policy."""
    flashqla.reset()
    assert "NVIDIA GPUs only" in flashqla.availability(_caps("cpu", None))
    assert "sm90 / sm100 (this device: sm80)" in flashqla.availability(_caps("nvidia", (8, 0)))
    assert fresh_probe.POLICY["nvidia-sm80+"][0] == "flashqla"
    assert backends.get("flashqla").module == "kernels_cuda.flashqla"
    if importlib.util.find_spec("flash_qla") is None:
        fn, note, *_ = fresh_probe._try("flashqla", "gdn_chunk_prefill", _caps("nvidia", (9, 0)), torch.bfloat16)
        assert fn is None and note.startswith("cannot run here (flash_qla does not import") and "[flashqla]" in note
    fn, note, *_ = fresh_probe._try("flashqla", "moe_block", _caps("cpu", None), torch.bfloat16)
    assert fn is None and "NVIDIA GPUs only" in note
    assert fresh_probe.selftest_dtype(torch.float32, flashqla.DTYPES) == (None, "computes bf16/fp16, not fp32")


def test_probe_skips_flashqla_with_the_reason(fresh_probe, monkeypatch):
    monkeypatch.setitem(fresh_probe.POLICY, "cpu", ("flashqla", "reference"))
    choice = fresh_probe.choose("gdn_chunk_prefill", "cpu")
    assert choice.backend == "reference"
    assert choice.rejected == [("flashqla", "cannot run here (FlashQLA runs on NVIDIA GPUs only (this device: cpu))")]
