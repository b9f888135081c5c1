"""The GPU comparison's CPU-side pieces: agreement arithmetic, the padded tokenizer, the request sets, the table.

(The comparison itself needs vLLM 0.26 on a GPU: tests/gpu/test_gpu_vllm.py and tuning/gpu_vllm.py.)
"""

from __future__ import annotations

import json
import math
import time

import pytest

from tuning import vllm_serving as vs
from tuning.gpu_vllm import table


def _greedy(tokens: list[int], tops: list[dict[int, float]]) -> dict:
    return {"tokens": tokens, "top": tops}


def test_greedy_agreement_counts_matches_prefix_and_divergence_gaps():
    same = _greedy([1, 2, 3, 4], [{1: -0.1, 9: -3.0}, {2: -0.2, 9: -2.0}, {3: -0.1, 9: -4.0}, {4: -0.5, 9: -1.0}])
    # b parts from a at step 2 on a near-tie (3 vs 7: 0.05 apart for a, 0.04 for b), then matches again at step 3
    a = _greedy([5, 6, 3, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {3: -0.70, 7: -0.75}, {8: -1, 0: -2}])
    b = _greedy([5, 6, 7, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {7: -0.70, 3: -0.74}, {8: -1, 0: -2}])
    g = vs.greedy_agreement([same, a], [same, b], near_tie=0.15)
    assert g["token_match_rate"] == pytest.approx(7 / 8)
    assert g["prefix_match_rate"] == pytest.approx((4 + 2) / 8)
    assert g["divergences"] == 1 and g["clear_divergences"] == 0
    assert g["max_divergence_gap"] == pytest.approx(0.05)
    # a clear divergence: b's token is far below a's choice as a saw it
    b_clear = _greedy([5, 6, 7, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {7: -0.1, 3: -2.0}, {8: -1, 0: -2}])
    g = vs.greedy_agreement([a], [b_clear], near_tie=0.15)
    assert g["clear_divergences"] == 1 and g["max_divergence_gap"] == pytest.approx(1.9)
    # the other engine's token not among this engine's two likeliest: an infinite gap, a clear divergence
    b_far = _greedy([5, 6, 7, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {7: -0.1, 11: -2.0}, {8: -1, 0: -2}])
    g = vs.greedy_agreement([a], [b_far])
    assert g["clear_divergences"] == 1 and math.isinf(g["max_divergence_gap"])


def test_logprob_diff_and_top1_agreement():
    d = vs.logprob_diff([[-1.0, -2.0], [-3.0]], [[-1.1, -2.0], [-2.5]], "t")
    assert d["positions"] == 3
    assert d["mean_abs"] == pytest.approx(0.2) and d["max_abs"] == pytest.approx(0.5)
    agree = vs.top1_agreement([{"top1": [1, 2]}, {"top1": [3]}], [{"top1": [1, 5]}, {"top1": [3]}])
    assert agree == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="t: 3 vs 2 positions"):
        vs.logprob_diff([[-1.0, -2.0], [-3.0]], [[-1.0], [-3.0]], "t")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            vs.logprob_diff([[-1.0, bad]], [[-1.0, -2.0]], "t")


def test_engine_env_switches_the_plugin_and_rejects_unknown_engines():
    assert vs.engine_env("ours")["VLLM_PLUGINS"] == "qwen35"
    assert vs.engine_env("native")["VLLM_PLUGINS"] == ""
    assert vs.engine_env("native")["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    with pytest.raises(ValueError, match="engine='vllm'; accepted: ours, native"):
        vs.engine_env("vllm")


def test_replay_metrics_in_ms_and_score():
    dist = {"p50": 0.010, "p99": 0.030}
    summary = {"tps": {"output": 100.0, "input": 1000.0, "cache": 10.0}, "score": 0.83 * 100 + 0.14 * 1000 + 0.03 * 10,
               "failed": 0, "seconds": 2.0, "latency_seconds": {"ttft": dist, "itl": dist, "tpot": {"p50": None}}}
    m = vs.replay_metrics(summary)
    assert m["score"] == pytest.approx(223.3) and m["itl_p99_ms"] == pytest.approx(30.0)
    assert math.isnan(m["tpot_p99_ms"])


def test_padded_tokenizer_decodes_every_id_and_keeps_control_ids():
    from serve.embedded.tokenizer import CONTROL_TOKENS, MARKUP_TOKENS, train_tokenizer
    from tuning.vllm_ckpt import padded_tokenizer

    base = train_tokenizer()
    tok = padded_tokenizer(4096)
    assert tok.get_vocab_size(with_added_tokens=True) == 4096
    for t in CONTROL_TOKENS + MARKUP_TOKENS:
        assert tok.token_to_id(t) == base.token_to_id(t), t
    assert all(tok.id_to_token(i) is not None for i in range(4096))
    text = "<|im_start|>user\nhow are the tools today<|im_end|>"
    assert tok.encode(text).ids == base.encode(text).ids  # filler tokens are never produced
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the tokenizer's 820 ids"):
        padded_tokenizer(100)


def test_request_sets_have_the_asked_lengths(tmp_path):
    from tokenizers import Tokenizer

    from tuning.gpu_vllm import request_sets
    from tuning.vllm_ckpt import padded_tokenizer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    padded_tokenizer(4096).save(str(ckpt / "tokenizer.json"))
    sets = request_sets(ckpt, tmp_path, quick=True)
    assert set(sets) == {"prefill", "decode", "decode_c1", "mixed"}
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prefill = [json.loads(line) for line in sets["prefill"][0].read_text().splitlines()]
    lengths = [len(tok.encode(b["messages"][0]["content"]).ids) for b in prefill]
    assert min(lengths) >= 2048 - 2 and max(lengths) <= 16384 + 2, lengths
    assert {b["max_tokens"] for b in prefill} == {64}
    decode = [json.loads(line) for line in sets["decode"][0].read_text().splitlines()]
    assert all(abs(len(tok.encode(b["messages"][0]["content"]).ids) - 256) <= 2 for b in decode)
    assert sets["decode"][1] == 64 and sets["decode_c1"][1] == 1
    (tmp_path / "again").mkdir()
    again = request_sets(ckpt, tmp_path / "again", quick=True)
    assert again["prefill"][0].read_text() == sets["prefill"][0].read_text()  # fixed seeds: the same set


def test_table_puts_engines_side_by_side():
    rows = [{"device": "d", "engine": "ours", "mix": "decode", "metric": "score", "value": 120.0},
            {"device": "d", "engine": "native", "mix": "decode", "metric": "score", "value": 100.0},
            {"device": "d", "engine": "ours", "mix": "agree", "metric": "tf_top1_agreement", "value": 0.99}]
    lines = table(rows).splitlines()
    assert lines[1].split()[:4] == ["decode", "score", "120", "100"] and lines[1].split()[-1] == "1.200"
    assert lines[2].split()[:3] == ["agree", "tf_top1_agreement", "0.99"]


# ----------------------------------------------------------------------------- reading server logs

# A failed start as vLLM 0.26 logs it on the GPU machine: the engine core's probe table, then its traceback (each line
# prefixed by process, level, time and place), then the API server's own traceback.
FAILED_LOG = """\
(APIServer pid=897) INFO 12-04 17:21:06 [api_utils.py:273] non-default args: {'model': '/tmp/w/ckpt'}
(EngineCore pid=1014) qwen35: backend triton rejected for causal_conv1d_update on cuda:0: self-test raised \
RuntimeError: boom
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] qwen35 backends on cuda:
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] device   cuda:0  vendor=nvidia  name='NVIDIA H200'  cc=9.0
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] switches none set
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] dtype    the device's default (bfloat16)
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109]
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] op                       backend    reason
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] ------------------------ ---------- ------------------------
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] causal_conv1d_update     reference  policy nvidia-sm80+: \
triton > reference; triton self-test raised RuntimeError: boom
(EngineCore pid=1014) INFO 12-04 17:21:55 [model.py:109] moe_block                triton     policy nvidia-sm80+: \
flashqla > triton > reference; self-test rel err 0.0017 <= 0.02 (bfloat16)
(EngineCore pid=1014) INFO 12-04 17:21:55 [cuda.py:482] Using FLASH_ATTN attention backend
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330] EngineCore failed to start.
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330] Traceback (most recent call last):
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330]   File "/tmp/site/vllm/v1/engine/core.py", line 1299, in run
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330]     engine_core = EngineCoreProc(*args)
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330]                   ^^^^^^^^^^^^^^^^^^^^^
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330]   File "/work/qwen35/reference/conv.py", line 70, in update
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330]     for n, slot in enumerate(conv_slots.tolist()):
(EngineCore pid=1014) ERROR 12-04 17:22:10 [core.py:1330] RuntimeError: Cannot copy between CPU and CUDA tensors \
during CUDA graph capture
(APIServer pid=897) Traceback (most recent call last):
(APIServer pid=897)   File "/tmp/site/vllm/v1/engine/utils.py", line 1272, in wait_for_engine_startup
(APIServer pid=897) RuntimeError: Engine core initialization failed. See root cause above.
"""


def test_backend_table_and_first_traceback_from_a_failed_start():
    tables = vs.backend_table(FAILED_LOG)
    assert tables == {"cuda:0": {
        "causal_conv1d_update": {"backend": "reference", "reason": "policy nvidia-sm80+: triton > reference; triton "
                                 "self-test raised RuntimeError: boom"},
        "moe_block": {"backend": "triton", "reason": "policy nvidia-sm80+: flashqla > triton > reference; self-test "
                      "rel err 0.0017 <= 0.02 (bfloat16)"}}}
    assert vs.reference_ops(tables) == {"cuda:0": ["causal_conv1d_update"]}
    tb = vs.first_traceback(FAILED_LOG)
    lines = tb.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture"
    assert "    for n, slot in enumerate(conv_slots.tolist()):" in lines  # the frame, prefixes taken off
    assert "Engine core initialization failed" not in tb  # the API server's traceback comes second
    assert vs.first_traceback("INFO all fine\n") is None
    assert vs.backend_table("no table here\n") == {}


def test_backend_tables_of_tensor_parallel_workers_stay_apart():
    def table_lines(proc: str, dev: str, backend: str) -> str:
        pre = f"({proc}) INFO 12-04 17:21:55 [model.py:109] "
        return "".join(pre + ln + "\n" for ln in ["qwen35 backends on cuda:", f"device   {dev}  vendor=nvidia", "",
                                                   "op   backend reason", "-" * 24 + " " + "-" * 10,
                                                   f"rms_norm_gated           {backend}  why"])
    # two workers' reports interleaved line by line, as they reach the log
    a = table_lines("Worker_TP0 pid=1", "cuda:0", "triton").splitlines()
    b = table_lines("Worker_TP1 pid=2", "cuda:1", "reference").splitlines()
    text = "\n".join(x for pair in zip(a, b, strict=True) for x in pair) + "\n"
    tables = vs.backend_table(text)
    assert tables == {"cuda:0": {"rms_norm_gated": {"backend": "triton", "reason": "why"}},
                      "cuda:1": {"rms_norm_gated": {"backend": "reference", "reason": "why"}}}
    assert vs.reference_ops(tables) == {"cuda:1": ["rms_norm_gated"]}


def test_every_server_gets_nvlink_multicast_off_and_the_accelerated_requirement():
    for engine in vs.ENGINES:
        env = vs.engine_env(engine)
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["QWEN35_REQUIRE_ACCELERATED"] == "1"
        assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"


def test_scaling_and_bf16_budget_rows(tmp_path, monkeypatch):
    from tuning import gpu_vllm

    monkeypatch.setattr(gpu_vllm, "WORK", tmp_path)
    ckpt = tmp_path / "qwen35-35b-a3b-8l-abc"
    tp1 = [{"device": "d", "tp": 1, "engine": "ours", "mix": "decode", "metric": "score", "value": 100.0},
           {"device": "d", "tp": 1, "engine": "native", "mix": "decode", "metric": "output_tps", "value": 50.0}]
    gpu_vllm.saved_path(ckpt, 1, "rows").write_text(json.dumps(tp1))
    run = gpu_vllm.Run(tmp_path / "out", 60, "d", tp=2)
    run.add("ours", "decode", "score", 150.0)
    run.add("native", "decode", "output_tps", 120.0)
    gpu_vllm.scaling_rows(run, ckpt)
    eff = {(r["engine"], r["metric"]): r["value"] for r in run.rows if r["metric"].startswith("tp_scaling")}
    assert eff == {("ours", "tp_scaling_efficiency_score"): pytest.approx(0.75),
                   ("native", "tp_scaling_efficiency_output_tps"): pytest.approx(1.2)}
    assert all(r["tp"] == 2 for r in run.rows)
    tf = [{"logprobs": [-1.0, -2.0], "top1": [3, 4]}]
    gpu_vllm.agreement_rows(run, "agree_tp2_vs_tp1", None, None, tf, [{"logprobs": [-1.01, -2.6], "top1": [3, 4]}],
                            engine="native")
    got = {r["metric"]: r["value"] for r in run.rows if r["mix"] == "agree_tp2_vs_tp1"}
    assert got["tf_logprob_max_abs"] == pytest.approx(0.6) and got["tf_within_bf16_budget"] == 0.0
    assert {r["engine"] for r in run.rows if r["mix"] == "agree_tp2_vs_tp1"} == {"native"}


TINY_WIDTH = {"vocab_size": 4096, "hidden_size": 256, "num_attention_heads": 4, "linear_num_key_heads": 4,
              "linear_num_value_heads": 8, "num_experts": 8, "moe_intermediate_size": 64,
              "shared_expert_intermediate_size": 64}


@pytest.mark.slow
def test_real_server_logs_stream_and_failed_start_on_the_cpu_build(tmp_path):
    """The comparison's server plumbing against real ``vllm serve`` processes of the CPU build: our plugin's server
    starts with the GPU machines' environment (QWEN35_REQUIRE_ACCELERATED=1 changes nothing on a CPU), its log's
    backend table is read, streamed greedy answers equal the plain ones, and a server that cannot start is
    reported with its first traceback in the mirrored diagnosis file."""
    pytest.importorskip("vllm")
    from tuning.vllm_ckpt import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", layers=2, device="cpu", overrides=TINY_WIDTH)
    args = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.3",
            "--language-model-only"]
    (tmp_path / "out").mkdir()
    mirror = vs.LogMirror(tmp_path / "out" / "server_logs.txt", every=3600)  # written only when told here
    ok = vs.start_server("ours_cpu", "ours", str(ckpt), args, tmp_path / "logs",
                         env_extra={"VLLM_CPU_KVCACHE_SPACE": "1"})
    bad = vs.start_server("ours_bad", "ours", str(tmp_path / "no-such-checkpoint"), args, tmp_path / "logs",
                          env_extra={"VLLM_CPU_KVCACHE_SPACE": "1"})
    mirror.add([ok, bad])
    try:
        failed = vs.wait_ready([ok, bad], deadline=time.perf_counter() + 300, raise_on_failure=False)
        assert set(failed) == {"ours_bad"} and ok.ready_s is not None and bad.failed, failed
        mirror.write()
        text = (tmp_path / "out" / "server_logs.txt").read_text()
        assert "===== ours_cpu [up in" in text and "===== ours_bad [FAILED: ours_bad exited with" in text
        assert "first traceback:\nTraceback (most recent call last):" in text
        tables = vs.backend_table(ok.log_path.read_text())
        assert set(tables) == {"cpu"} and tables["cpu"]["moe_block"]["backend"] == "reference"
        prompts = [[5, 17, 300, 41, 9, 77], [100, 200, 300]]
        plain = vs.greedy(ok, prompts, 8)
        streamed = vs.stream_greedy(ok, prompts, 8)
        assert [r["tokens"] for r in streamed] == [r["tokens"] for r in plain]
        for r in streamed:
            assert len(r["top"]) == 8 and all(len(t) == vs.TOP_K for t in r["top"])
            assert 0 < r["ttft_s"] <= r["seconds"] and r["itl_max_s"] >= r["itl_p50_s"] >= 0
            assert all(math.isfinite(v) for t in r["top"] for v in t.values())
    finally:
        ok.stop()
        bad.stop()
        mirror.close()


@pytest.mark.parametrize("shape", ["27b", "35b-a3b"])
def test_checkpoints_of_dense_and_moe_shapes_match_hf_fp32_in_our_model(tmp_path, shape):
    """The comparison's checkpoints (dense 27B layout, MoE layout with one tensor per expert) at a tiny width: our
    model with their weights gives HF's fp32 teacher-forced log-probs."""
    import dataclasses

    import torch

    from qwen35.checkpoint import iter_safetensors, load_weights
    from qwen35.config import Qwen35Config
    from qwen35.standalone import Qwen35Standalone
    from tuning.vllm_ckpt import hf_logprobs, shape_fields, write_checkpoint

    width = {k: v for k, v in TINY_WIDTH.items() if k in shape_fields(shape) or k in ("vocab_size",)}
    if shape == "27b":
        width["intermediate_size"] = 512
    path = write_checkpoint(tmp_path, layers=4, device="cpu", shape=shape, overrides=width)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [("Qwen3_5ForConditionalGeneration" if shape == "27b"
                                        else "Qwen3_5MoeForConditionalGeneration")]
    prompt = [5, 17, 300, 41, 9, 77, 1000, 3, 8, 12]
    ref = torch.tensor(hf_logprobs(path, [prompt], device="cpu")[0], dtype=torch.float64)
    cfg = dataclasses.replace(Qwen35Config.from_dir(path), vision=None)  # the checkpoint holds no tower
    assert cfg.is_moe == (shape != "27b")
    m = Qwen35Standalone(cfg, dtype=torch.float32, max_seqs=1, max_len=64)
    with torch.no_grad():
        load_weights(m.model, iter_safetensors(path))
    logits = m.step(m.allocate(1), [prompt], all_logits=True).double()
    ours = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="shape='70b'; accepted: 27b, 35b-a3b, 122b-a10b, 397b-a17b"):
        shape_fields("70b")


@pytest.mark.parametrize("argv, message", [
    (["--skip", "agree,warmup"], "--skip ['warmup']: accepted agree, longctx, throughput, eager, hf"),
    (["--tp", "0"], "--tp 0: accepted 1.."),
    (["--shape", "70b"], "argument --shape: invalid choice: '70b'"),
    (["--overrides", "{not json"], "argument --overrides: invalid loads value"),
])
def test_comparison_rejects_bad_arguments_naming_them(tmp_path, capsys, argv, message):
    from tuning import gpu_vllm

    with pytest.raises(SystemExit) as e:
        gpu_vllm.main(["--out", str(tmp_path), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
