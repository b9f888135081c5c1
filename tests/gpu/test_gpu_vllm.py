"""Our plugin under vLLM on a GPU, at reduced size: agreement with vLLM's native Qwen3.5-MoE class and with HF's
fp32 model, and CUDA graphs against eager. Agreement only, never speed (tuning/gpu_vllm.py measures that).

Three real ``vllm serve`` processes share the GPU: ``ours`` with vLLM's default cudagraph mode (full graphs for
uniform decode batches), ``ours`` with ``--enforce-eager`` and ``native`` with ``--enforce-eager``, all on one
random-weight checkpoint (:data:`tuning.vllm_ckpt.REDUCED`: every kind of layer of Qwen3.5-35B-A3B at a
quarter of its width, 4 layers). Needs vLLM 0.26 on the machine (``scripts/vllm_gpu_install.sh``).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS, NEW_TOKENS = 16, 32
NEAR_TIE = 0.25  # nats: a first divergence where both engines' gaps are below this is a bf16 near-tie
ARGS = ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "32", "--max-num-batched-tokens", "4096",
        "--enable-prefix-caching", "--language-model-only", "--gdn-prefill-backend", "triton",
        "--kv-cache-memory-bytes", str(4 << 30), "--gpu-memory-utilization", "0.2", "--seed", "0"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("vllm")
    from tuning import vllm_serving as vs
    from tuning.gpu_vllm import agreement_prompts
    from tuning.vllm_ckpt import hf_logprobs, write_checkpoint

    work = tmp_path_factory.mktemp("gpu_vllm")
    ckpt = write_checkpoint(work / "ckpt", layers=4, reduced=True)
    prompts = [p[: 64 + 12 * i] for i, p in enumerate(agreement_prompts(seed=1)[:PROMPTS])]
    specs = {"ours_graphs": ("ours", []), "ours_eager": ("ours", ["--enforce-eager"]),
             "native_eager": ("native", ["--enforce-eager"])}
    servers = {name: vs.start_server(name, engine, str(ckpt), ARGS + extra, work / "logs")
               for name, (engine, extra) in specs.items()}
    try:
        vs.wait_ready(list(servers.values()), deadline=time.perf_counter() + 420)
        out = {name: {"tf": vs.teacher_forced(s, prompts), "greedy": vs.greedy(s, prompts, NEW_TOKENS)}
               for name, s in servers.items()}
        out["logs"] = {name: s.log_path.read_text(errors="replace") for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    out["hf"] = hf_logprobs(ckpt, prompts)
    return out


def _lps(rows: list[dict]) -> list[list[float]]:
    return [r["logprobs"] for r in rows]


def test_every_log_prob_is_finite(results):
    for name in ("ours_graphs", "ours_eager", "native_eager"):
        for row in _lps(results[name]["tf"]):
            assert all(math.isfinite(v) for v in row), name
    assert all(math.isfinite(v) for row in results["hf"] for v in row)


def test_ours_is_as_close_to_hf_fp32_as_native(results):
    from tuning.vllm_serving import logprob_diff

    ours = logprob_diff(_lps(results["ours_eager"]["tf"]), results["hf"], "ours vs HF fp32")
    native = logprob_diff(_lps(results["native_eager"]["tf"]), results["hf"], "native vs HF fp32")
    assert ours["mean_abs"] <= 1.5 * native["mean_abs"] + 2e-3, (ours, native)
    assert ours["max_abs"] <= max(2.0 * native["max_abs"], 0.05), (ours, native)
    assert ours["mean_abs"] < 0.05, ours  # bf16 against fp32: rounding, not a different model


def test_ours_agrees_with_native(results):
    from tuning.vllm_serving import greedy_agreement, logprob_diff, top1_agreement

    ours, native = results["ours_eager"], results["native_eager"]
    d = logprob_diff(_lps(ours["tf"]), _lps(native["tf"]), "ours vs native")
    assert d["mean_abs"] < 0.05 and d["max_abs"] < 0.5, d
    assert top1_agreement(ours["tf"], native["tf"]) >= 0.95
    g = greedy_agreement(ours["greedy"], native["greedy"], NEAR_TIE)
    # sequences may part at a near-tie of bf16 logits (a random model has many), never at a clear preference
    assert g["clear_divergences"] == 0, g


def test_cuda_graphs_give_the_eager_outputs(results):
    from tuning.vllm_serving import greedy_agreement, logprob_diff

    log = results["logs"]["ours_graphs"]
    assert "Graph capturing finished" in log, "the graphs server captured no CUDA graph"
    assert "Graph capturing finished" not in results["logs"]["ours_eager"]
    g = greedy_agreement(results["ours_graphs"]["greedy"], results["ours_eager"]["greedy"], NEAR_TIE)
    assert g["clear_divergences"] == 0, g
    d = logprob_diff(_lps(results["ours_graphs"]["tf"]), _lps(results["ours_eager"]["tf"]), "graphs vs eager")
    assert d["max_abs"] < 0.1, d  # prefills run eagerly in both
