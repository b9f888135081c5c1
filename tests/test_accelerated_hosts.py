"""Model hosts choose every op's backend at load and never serve on the reference on an accelerator unnoticed.

- :func:`qwen35.model.facade_ops` is exactly the set of façade ops a forward calls (recorded on real standalone
  runs of the tiny dense and MoE checkpoints), each with a first tensor in the model's dtype: what the hosts hand
  :func:`qwen35.probe.choose_at_load`.
- After load, a forward makes no new choice: with a graph capture emulated (the probe's
  ``is_current_stream_capturing``), generation still runs, where a lazy choice would raise.
- On an accelerator (device facts of an H200 whose Triton cannot run, so every op falls to the reference) the
  host logs one ERROR naming the ops and the reasons; with ``QWEN35_REQUIRE_ACCELERATED=1`` it refuses to start.
- Inside a real vLLM engine (CPU build, bf16), forced Triton backends pass their self-tests in vLLM's model
  construction context (its default device, the model dtype as torch's default) and serve.
"""

from __future__ import annotations

import logging

import pytest
import torch

from qwen35.config import Qwen35Config
from qwen35.model import facade_ops
from qwen35.tiny import TinySpec, write_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
H200 = dict(vendor="nvidia", name="NVIDIA H200", capability=(9, 0), bf16=True, triton_runs=False,
            triton_note="trivial kernel failed: emulated")


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(path, TinySpec(moe=request.param == "moe", seed=3))
    return path


def _standalone(path, dtype=torch.float32):
    from qwen35.standalone import Qwen35Standalone

    return Qwen35Standalone.from_pretrained(path, dtype=dtype, max_seqs=len(PROMPTS), max_len=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_facade_ops_are_the_ops_a_forward_calls_in_the_model_dtype(fresh_probe, monkeypatch, tiny, dtype):
    asked: set[tuple[str, torch.dtype | None]] = set()
    real = fresh_probe.implementation

    def recording(op, device, dtype=None):
        asked.add((op, dtype))
        return real(op, device, dtype)

    monkeypatch.setattr(fresh_probe, "implementation", recording)
    m = _standalone(tiny, dtype)
    out = m.generate(PROMPTS, 3)  # prefills, then decode steps
    assert [len(o) for o in out] == [3, 3]
    cfg = Qwen35Config.from_dir(tiny)
    expected = set(facade_ops(cfg)) | {"attention_decode"}  # the standalone host's decode attention
    assert {op for op, _ in asked} == expected
    assert {dt for _, dt in asked} == {dtype}, asked
    assert ("moe_block" in expected) == cfg.is_moe


def test_no_choice_after_load_so_a_capture_finds_them_all(fresh_probe, monkeypatch, tiny):
    """bf16: not the CPU's default compute dtype, so the start-up report's choices do not cover it."""
    m = _standalone(tiny, torch.bfloat16)
    chosen = set(fresh_probe._CHOICES)
    monkeypatch.setattr(fresh_probe, "is_current_stream_capturing", lambda: True)  # any new choice raises now
    out = m.generate(PROMPTS, 3)
    assert [len(o) for o in out] == [3, 3]
    assert set(fresh_probe._CHOICES) == chosen


def _emulate_accelerator(probe, monkeypatch, key: str) -> None:
    """The probe sees an H200 at ``key`` whose Triton cannot run: every op's policy ends at the reference."""
    caps = probe.DeviceCaps(device=key, **H200)
    monkeypatch.setitem(probe._CAPS, key, caps)


def test_reference_on_an_accelerator_is_an_error_naming_ops_and_reasons(fresh_probe, monkeypatch, caplog):
    _emulate_accelerator(fresh_probe, monkeypatch, "cuda:0")
    cfg_ops = ("rms_norm_zero_centered", "causal_conv1d_update", "moe_block")
    log = logging.getLogger("qwen35.test_host")
    with caplog.at_level(logging.ERROR, logger="qwen35.test_host"):
        choices = fresh_probe.choose_at_load("cuda:0", torch.bfloat16, cfg_ops, log, who="qwen35 (test host)")
    assert {c.backend for c in choices} == {"reference"}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    msg = errors[0]
    assert msg.startswith("qwen35 (test host): 3 op(s) the model calls would run on the reference backend on "
                          "cuda:0 (NVIDIA H200, bf16)")
    for op in cfg_ops:
        assert f"{op}: policy nvidia-sm80+" in msg
    assert "triton cannot run here (trivial kernel failed: emulated)" in msg
    assert "set QWEN35_REQUIRE_ACCELERATED=1 to refuse to start instead" in msg

    monkeypatch.setenv("QWEN35_REQUIRE_ACCELERATED", "1")
    with pytest.raises(RuntimeError, match=r"3 op\(s\) the model calls would run on the reference backend on "
                                           r"cuda:0 .*QWEN35_REQUIRE_ACCELERATED=1 refuses to serve this way"):
        fresh_probe.choose_at_load("cuda:0", torch.bfloat16, cfg_ops, log)
    monkeypatch.setenv("QWEN35_REQUIRE_ACCELERATED", "yes")
    with pytest.raises(ValueError, match="QWEN35_REQUIRE_ACCELERATED='yes' is not accepted; use one of 0, 1"):
        fresh_probe.choose_at_load("cuda:0", torch.bfloat16, cfg_ops, log)


def test_reference_on_the_cpu_is_no_error(fresh_probe, monkeypatch, caplog):
    monkeypatch.setenv("QWEN35_REQUIRE_ACCELERATED", "1")
    with caplog.at_level(logging.ERROR):
        choices = fresh_probe.choose_at_load("cpu", torch.float32, ("moe_block",), logging.getLogger("t"))
    assert {(c.op, c.backend) for c in choices} == {("moe_block", "reference")}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_standalone_host_on_an_accelerator_refuses_the_reference_when_required(fresh_probe, monkeypatch, tiny,
                                                                                caplog):
    """The host's own start-up runs the check: the probe sees this process's CPU as an H200 whose Triton cannot
    run (the host still computes on the CPU, where the reference works)."""
    _emulate_accelerator(fresh_probe, monkeypatch, "cpu")
    monkeypatch.setenv("QWEN35_REQUIRE_ACCELERATED", "1")
    with pytest.raises(RuntimeError, match=r"qwen35 \(standalone host\): \d+ op\(s\) the model calls would run on "
                                           r"the reference backend on cpu \(NVIDIA H200, fp32\).*attention_decode: "):
        _standalone(tiny)
    monkeypatch.delenv("QWEN35_REQUIRE_ACCELERATED")
    with caplog.at_level(logging.ERROR, logger="qwen35.standalone"):
        m = _standalone(tiny)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "qwen35 (standalone host)" in errors[0], errors
    assert len(m.generate(PROMPTS[:1], 2)[0]) == 2  # it still serves, loudly


@pytest.mark.slow
def test_vllm_engine_self_tests_triton_in_its_model_context_and_serves_with_it(tmp_path):
    """vLLM builds the model (and so runs the probe) under its own default device and the model's dtype as torch's
    default: a real ``vllm serve`` of the CPU build, bf16, with Triton forced (in its interpreter) for every op whose
    kernels the interpreter computes in bf16 (its bf16 ``tl.dot`` is off, so the GDN prefill and the MoE stay on the
    reference): every forced self-test passes there (a forced backend that fails raises and the server does not
    start), the log's table names Triton, and the server answers."""
    pytest.importorskip("vllm")
    import math
    import time

    from tuning import vllm_serving as vs
    from tuning.vllm_ckpt import write_checkpoint

    width = {"vocab_size": 4096, "hidden_size": 256, "num_attention_heads": 4, "linear_num_key_heads": 4,
             "linear_num_value_heads": 8, "num_experts": 8, "moe_intermediate_size": 64,
             "shared_expert_intermediate_size": 64}
    ckpt = write_checkpoint(tmp_path / "ckpt", layers=2, device="cpu", overrides=width)
    args = ["--dtype", "bfloat16", "--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
            "--enforce-eager", "--gpu-memory-utilization", "0.3", "--language-model-only"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "TRITON_INTERPRET": "1", "QWEN35_BACKEND": "triton",
           "QWEN35_BACKEND_GDN_CHUNK_PREFILL": "reference", "QWEN35_BACKEND_MOE_BLOCK": "reference"}
    server = vs.start_server("ours_triton", "ours", str(ckpt), args, tmp_path / "logs", env_extra=env)
    try:
        failed = vs.wait_ready([server], deadline=time.perf_counter() + 600, raise_on_failure=False)
        assert not failed, vs.diagnosis([server])
        tables = vs.backend_table(server.log_path.read_text())
        chosen = {op: r["backend"] for op, r in tables["cpu"].items()}
        for op in ("rms_norm_zero_centered", "causal_conv1d_update", "gdn_recurrent_step", "rms_norm_gated",
                   "qk_norm_rope", "sigmoid_gate_mul"):
            assert chosen[op] == "triton", chosen
        out = vs.greedy(server, [[5, 17, 300, 41, 9]], 4)[0]
        assert len(out["tokens"]) == 4 and all(math.isfinite(v) for t in out["top"] for v in t.values())
    finally:
        server.stop()
