"""Our plugin under vLLM on a GPU, at reduced size: agreement with vLLM's native Qwen3.5-MoE class and with HF's
fp32 model, and CUDA graphs against eager. Agreement only, never speed (tuning/gpu_vllm.py measures that).

Three real ``vllm serve`` processes share the GPU: ``ours`` with vLLM's default cudagraph mode (full graphs for
uniform decode batches), ``ours`` with ``--enforce-eager`` and ``native`` with ``--enforce-eager``, all on one
random-weight checkpoint (:data:`tuning.vllm_ckpt.REDUCED`: every kind of layer of Qwen3.5-35B-A3B at a
quarter of its width, 4 layers). Needs vLLM 0.26 on the machine (``scripts/vllm_gpu_install.sh``).
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


def test_ours_agrees_with_native_and_hf_fp32_and_graphs_give_the_eager_outputs(results):
    """One test (the three servers start once, also under pytest-xdist): each check names itself on failure."""
    from tuning.vllm_serving import greedy_agreement, logprob_diff, top1_agreement

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
    assert "Graph capturing finished" in results["logs"]["ours_graphs"], "the graphs server captured no CUDA graph"
    assert "Graph capturing finished" not in results["logs"]["ours_eager"], "the eager server captured graphs"
    g = greedy_agreement(results["ours_graphs"]["greedy"], results["ours_eager"]["greedy"], NEAR_TIE)
    assert g["clear_divergences"] == 0, ("graphs vs eager greedy", g)
    d = logprob_diff(_lps(results["ours_graphs"]["tf"]), _lps(results["ours_eager"]["tf"]), "graphs vs eager")
    assert d["max_abs"] < 0.1, ("graphs vs eager prefill log-probs (eager in both)", d)
