"""Our plugin under vLLM on a GPU, at reduced size: agreement with vLLM's native Qwen3.5-MoE class and with HF's
fp32 model, CUDA graphs against eager, and (on a machine with 2+ GPUs) tensor parallel 2 against TP 1. Agreement
only, never speed (tuning/gpu_vllm.py measures that).

Three real ``vllm serve`` processes share the GPU: ``ours`` with full CUDA graphs for uniform decode batches,
``ours`` with ``--enforce-eager`` and ``native`` with ``--enforce-eager``, all with the same engine arguments
(:data:`ARGS`, the comparison's compilation arguments :data:`tuning.gpu_vllm.COMPILE` ``["none"]``) on one
random-weight checkpoint (:data:`tuning.vllm_ckpt.REDUCED`: every kind of layer of Qwen3.5-35B-A3B at a quarter
of its width, 4 layers). Every server runs with ``QWEN35_REQUIRE_ACCELERATED=1`` and NVLink multicast off
(:data:`tuning.vllm_serving.SERVER_ENV`): our plugin refuses to start when an op would run on the reference
backend, and a server that does not start fails the test with its diagnosis (first traceback, chosen backends,
log tail). Needs vLLM 0.26 on the machine (``scripts/vllm_gpu_install.sh``).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS, NEW_TOKENS = 16, 32
NEAR_TIE = 0.25  # nats: a first divergence where both engines' gaps are below this is a bf16 near-tie
ARGS = ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "32", "--max-num-batched-tokens", "4096",
        "--enable-prefix-caching", "--language-model-only", "--gdn-prefill-backend", "triton",
        "--kv-cache-memory-bytes", str(4 << 30), "--gpu-memory-utilization", "0.2", "--seed", "0",
        "-cc.mode=none", "-cc.cudagraph_mode=FULL_DECODE_ONLY"]


def _serve(specs: dict[str, tuple[str, list[str]]], ckpt, prompts, logs) -> dict:
    """Start every server of ``specs`` ({name: (engine, extra args)}), fail with their diagnosis when one does not
    come up, and return each one's teacher-forced and greedy answers and its log."""
    from tuning import vllm_serving as vs

    servers = {name: vs.start_server(name, engine, str(ckpt), ARGS + extra, logs)
               for name, (engine, extra) in specs.items()}
    try:
        failed = vs.wait_ready(list(servers.values()), deadline=time.perf_counter() + 420, raise_on_failure=False)
        if failed:
            pytest.fail(f"servers did not start: {sorted(failed)}\n{vs.diagnosis(list(servers.values()))}")
        out = {name: {"tf": vs.teacher_forced(s, prompts), "greedy": vs.greedy(s, prompts, NEW_TOKENS)}
               for name, s in servers.items()}
        for name, s in servers.items():
            out[name]["log"] = s.log_path.read_text(errors="replace")
    finally:
        for s in servers.values():
            s.stop()
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tuning.vllm_ckpt import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("gpu_vllm") / "ckpt", layers=4, reduced=True)


@pytest.fixture(scope="module")
def prompts():
    from tuning.gpu_vllm import agreement_prompts

    return [p[: 64 + 12 * i] for i, p in enumerate(agreement_prompts(seed=1)[:PROMPTS])]


@pytest.fixture(scope="module")
def results(ckpt, prompts, tmp_path_factory):
    pytest.importorskip("vllm")
    from tuning.vllm_ckpt import hf_logprobs

    specs = {"ours_graphs": ("ours", []), "ours_eager": ("ours", ["--enforce-eager"]),
             "native_eager": ("native", ["--enforce-eager"])}
    out = _serve(specs, ckpt, prompts, tmp_path_factory.mktemp("logs"))
    out["hf"] = hf_logprobs(ckpt, prompts)
    return out


def _lps(rows: list[dict]) -> list[list[float]]:
    return [r["logprobs"] for r in rows]


def _accelerated(log: str, name: str) -> None:
    """Our plugin logged its backend table and no op of it is on the reference."""
    from tuning.vllm_serving import backend_table, reference_ops

    tables = backend_table(log)
    assert tables, f"{name}: no qwen35 backend table in the log"
    assert not reference_ops(tables), f"{name}: ops on the reference backend: {reference_ops(tables)}"


def test_ours_agrees_with_native_and_hf_fp32_and_graphs_give_the_eager_outputs(results):
    """One test (the three servers start once, also under pytest-xdist): each check names itself on failure."""
    from tuning.vllm_serving import greedy_agreement, logprob_diff, top1_agreement

    for name in ("ours_graphs", "ours_eager"):
        _accelerated(results[name]["log"], name)

    # every log-prob is finite (logprob_diff raises on NaN / Inf)
    ours_hf = logprob_diff(_lps(results["ours_eager"]["tf"]), results["hf"], "ours vs HF fp32")
    native_hf = logprob_diff(_lps(results["native_eager"]["tf"]), results["hf"], "native vs HF fp32")
    logprob_diff(_lps(results["ours_graphs"]["tf"]), results["hf"], "ours (graphs) vs HF fp32")

    # ours is as close to HF's fp32 model as native: bf16 rounding, not a different model
    assert ours_hf["mean_abs"] <= 1.5 * native_hf["mean_abs"] + 2e-3, ("vs HF fp32", ours_hf, native_hf)
    assert ours_hf["max_abs"] <= max(2.0 * native_hf["max_abs"], 0.05), ("vs HF fp32", ours_hf, native_hf)
    assert ours_hf["mean_abs"] < 0.05, ("vs HF fp32", ours_hf)

    # ours agrees with native: log-probs, top-1 tokens, and greedy sequences part only at bf16 near-ties
    ours, native = results["ours_eager"], results["native_eager"]
    d = logprob_diff(_lps(ours["tf"]), _lps(native["tf"]), "ours vs native")
    assert d["mean_abs"] < 0.05 and d["max_abs"] < 0.5, ("ours vs native", d)
    assert top1_agreement(ours["tf"], native["tf"]) >= 0.95, "ours vs native: top-1 tokens"
    g = greedy_agreement(ours["greedy"], native["greedy"], NEAR_TIE)
    assert g["clear_divergences"] == 0, ("ours vs native greedy", g)

    # CUDA graphs: the graphs server captured, and its outputs are the eager server's up to near-ties
    assert "Graph capturing finished" in results["ours_graphs"]["log"], "the graphs server captured no CUDA graph"
    assert "Graph capturing finished" not in results["ours_eager"]["log"], "the eager server captured graphs"
    g = greedy_agreement(results["ours_graphs"]["greedy"], results["ours_eager"]["greedy"], NEAR_TIE)
    assert g["clear_divergences"] == 0, ("graphs vs eager greedy", g)
    d = logprob_diff(_lps(results["ours_graphs"]["tf"]), _lps(results["ours_eager"]["tf"]), "graphs vs eager")
    assert d["max_abs"] < 0.1, ("graphs vs eager prefill log-probs (eager in both)", d)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_agrees_with_tp1_and_with_native(results, ckpt, prompts, tmp_path_factory):
    """Ours at TP 2 with CUDA graphs (NCCL all-reduce and vLLM's custom all-reduce inside the captured decode) and
    native at TP 2, on the checkpoint the TP 1 servers above served: log-probs within the bf16 budget of TP 1 and of
    each other, and greedy tokens that part only at near-ties."""
    from tuning.gpu_vllm import BF16_BUDGET
    from tuning.vllm_serving import backend_table, greedy_agreement, logprob_diff

    tp2 = ["--tensor-parallel-size", "2"]
    out = _serve({"ours_tp2": ("ours", tp2), "native_tp2": ("native", tp2 + ["--enforce-eager"])}, ckpt, prompts,
                 tmp_path_factory.mktemp("logs_tp2"))
    _accelerated(out["ours_tp2"]["log"], "ours_tp2")
    ranks = sorted(backend_table(out["ours_tp2"]["log"]))
    assert len(ranks) == 2, f"ours at TP 2: expected a backend table from each rank's GPU, got {ranks}"
    assert "Graph capturing finished" in out["ours_tp2"]["log"], "ours at TP 2 captured no CUDA graph"
    for a, b, what in ((out["ours_tp2"], results["ours_graphs"], "ours TP 2 vs TP 1"),
                       (out["native_tp2"], results["native_eager"], "native TP 2 vs TP 1"),
                       (out["ours_tp2"], out["native_tp2"], "ours vs native at TP 2")):
        d = logprob_diff(_lps(a["tf"]), _lps(b["tf"]), what)
        assert d["mean_abs"] <= BF16_BUDGET["mean_abs"] and d["max_abs"] <= BF16_BUDGET["max_abs"], (what, d)
        g = greedy_agreement(a["greedy"], b["greedy"], NEAR_TIE)
        assert g["clear_divergences"] == 0, (what, g)
