"""`qwen35-bench`: request-set generator, statistics, and replays against vLLM's OpenAI server."""

from __future__ import annotations

import json
import math

import pytest
from servers import API_KEY, SERVED_NAME, shared_vllm_server, vllm_available

from serve.accept.client import Endpoint
from serve.bench.__main__ import main as bench_main
from serve.bench.generate import (
    MixConfig,
    estimate_prompt_tokens,
    fit_requests,
    generate_requests,
    read_requests,
    write_requests,
)
from serve.bench.replay import (
    SCORE_WEIGHTS,
    ReplayConfig,
    RequestRecord,
    format_summary,
    percentile,
    replay,
    summarize,
)

# Small enough for the test server's 1024-token context with our 1.7-tokens-per-word tokenizer.
SMALL_MIX = dict(
    system_prompts=3, system_words=30, prompt_words_median=20, prompt_words_max=60, turn_words_median=12,
    max_prior_turns=2, output_tokens_median=16, output_tokens_max=32, sigma=0.6, max_tools=2, temperature=0.7,
)  # fmt: skip
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


# -- generator -----------------------------------------------------------------------------------


def test_generator_is_deterministic_and_round_trips(tmp_path):
    config = MixConfig(num_requests=40, seed=3)
    first, second = generate_requests(config), generate_requests(config)
    assert first == second
    assert generate_requests(MixConfig(num_requests=40, seed=4)) != first
    write_requests(tmp_path / "set.jsonl", first)
    assert read_requests(tmp_path / "set.jsonl") == first


def test_generator_mix_has_the_promised_shape():
    config = MixConfig(num_requests=400, seed=1)
    requests = generate_requests(config)
    systems = [r["messages"][0]["content"] for r in requests]
    assert all(r["messages"][0]["role"] == "system" for r in requests)
    assert len(set(systems)) == config.system_prompts
    counts = sorted((systems.count(s) for s in set(systems)), reverse=True)
    assert counts[0] > 2 * counts[-1], "shared prefixes are Zipf-like: one is much hotter"
    with_tools = [r for r in requests if "tools" in r]
    assert 0.1 < len(with_tools) / len(requests) < 0.3
    assert any(m.get("tool_calls") for r in with_tools for m in r["messages"])
    assert any(m["role"] == "tool" for r in with_tools for m in r["messages"])
    multi = [r for r in requests if any(m["role"] == "assistant" and m.get("content") for m in r["messages"])]
    assert 0.2 < len(multi) / len(requests) < 0.4
    for r in requests:
        assert r["messages"][-1]["role"] == "user"
        assert 1 <= r["max_tokens"] <= config.output_tokens_max
        assert len(r["messages"][-1]["content"].split()) <= config.prompt_words_max
    words = sorted(len(r["messages"][-1]["content"].split()) for r in requests)
    median, p99 = words[len(words) // 2], words[int(0.99 * len(words))]
    assert 0.7 * config.prompt_words_median < median < 1.4 * config.prompt_words_median
    assert p99 > 4 * median, "prompt lengths are long-tailed"


def test_generator_rejects_bad_configs():
    with pytest.raises(ValueError, match="tool_share"):
        MixConfig(tool_share=1.5)
    with pytest.raises(ValueError, match="max_tools"):
        MixConfig(max_tools=9)
    with pytest.raises(ValueError, match="medians"):
        MixConfig(prompt_words_median=100, prompt_words_max=50)


def test_read_requests_reports_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": []}\n\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: expected a JSON object with a 'messages' list"):
        read_requests(path)


# -- statistics ----------------------------------------------------------------------------------


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert math.isclose(percentile(list(range(101)), 90), 90.0)


def test_summary_totals_score_and_errors():
    records = [
        RequestRecord(0, start=0.0, end=2.0, ttft=0.5, itl=[0.1, 0.2], prompt_tokens=100, completion_tokens=10,
                      cached_tokens=64, usage_reported=True),
        RequestRecord(1, start=0.5, end=4.0, ttft=1.0, itl=[0.3], prompt_tokens=50, completion_tokens=30,
                      cached_tokens=0, usage_reported=True),
        RequestRecord(2, start=1.0, end=1.5, error="HTTP 400: too long", status=400),
    ]  # fmt: skip
    summary = summarize(records, wall=4.0)
    assert summary["seconds"] == 4.0
    assert summary["totals"] == {"prompt_tokens": 150, "completion_tokens": 40, "cached_tokens": 64}
    assert summary["tps"] == {"output": 10.0, "input": 37.5, "cache": 16.0}
    assert math.isclose(summary["score"], 0.83 * 10.0 + 0.14 * 37.5 + 0.03 * 16.0)
    assert SCORE_WEIGHTS == {"output": 0.83, "input": 0.14, "cache": 0.03}
    assert summary["succeeded"] == 2 and summary["failed"] == 0 and summary["errors"] == {}
    assert summary["refused"] == 1 and summary["refusals"] == {"HTTP 400": 1}, "a 4xx is a refusal, not a failure"
    assert summary["latency_seconds"]["itl"]["count"] == 3
    assert math.isclose(summary["latency_seconds"]["ttft"]["mean"], 0.75)
    assert math.isclose(summary["latency_seconds"]["tpot"]["p50"], ((2.0 - 0.5) / 9 + (3.5 - 1.0) / 29) / 2)


def test_failures_and_refusals_are_told_apart():
    records = [
        RequestRecord(0, start=0.0, end=1.0, ttft=0.1, completion_tokens=3, usage_reported=True, status=200),
        RequestRecord(1, start=0.0, end=1.0, error="HTTP 413: too big", status=413),
        RequestRecord(2, start=0.0, end=1.0, error="HTTP 503: overloaded", status=503),
        RequestRecord(3, start=0.0, end=1.0, error="ReadTimeout: timed out"),
        RequestRecord(4, start=0.0, end=1.0, error='stream error: {"message": "engine"}', status=200),
    ]
    summary = summarize(records, wall=1.0)
    assert (summary["succeeded"], summary["refused"], summary["failed"]) == (1, 1, 3)
    assert summary["errors"] == {"HTTP 503": 1, "ReadTimeout": 1, "stream error": 1}
    assert summary["first_refusals"] == ["HTTP 413: too big"]
    printed = format_summary(summary, ReplayConfig("http://x/v1", "m"))
    assert "1 ok, 1 refused (4xx), 3 failed" in printed and "refusals     {'HTTP 413': 1}" in printed


def test_fitting_keeps_prompt_and_output_inside_the_context():
    requests = generate_requests(MixConfig(num_requests=120, seed=5))
    fitted, report = fit_requests(requests, 1024)
    assert not report.exact and report.shortened > 10 and report.capped > 10
    for original, body in zip(requests, fitted, strict=True):
        assert body["max_tokens"] <= 1024 // 4 and estimate_prompt_tokens(body) + body["max_tokens"] <= 1024
        assert [m["role"] for m in body["messages"]] == [m["role"] for m in original["messages"]]
    assert generate_requests(MixConfig(num_requests=120, seed=5)) == requests, "the originals are not changed"
    assert fit_requests(requests, 1024) == (fitted, report), "fitting is deterministic"
    def chars(body: dict) -> int:  # a stand-in tokenizer: a token per three characters of text
        return 50 + sum(len(m["content"]) for m in body["messages"] if isinstance(m.get("content"), str)) // 3

    counted, exact = fit_requests(requests[:20], 1024, count_tokens=chars)
    assert exact.exact and all(chars(b) + b["max_tokens"] <= 1024 for b in counted)
    with pytest.raises(ValueError, match=r"request 0 cannot fit max_model_len=64"):
        fit_requests(requests[:1], 64)
    with pytest.raises(ValueError, match="max_model_len=4 is too small"):
        fit_requests(requests[:1], 4)


def test_generate_without_a_target_says_how_to_give_one(tmp_path, capsys):
    out = tmp_path / "set.jsonl"
    assert bench_main(["generate", "--out", str(out), "--num", "5", "--base-url", "http://127.0.0.1:9/v1"]) == 2
    assert "start the server, or pass --max-model-len N (0: do not fit)" in capsys.readouterr().err
    assert bench_main(["generate", "--out", str(out), "--num", "5", "--max-model-len", "512"]) == 0
    assert "fitted to max_model_len 512 of --max-model-len (estimated" in capsys.readouterr().out
    assert all(estimate_prompt_tokens(b) + b["max_tokens"] <= 512 for b in read_requests(out))
    assert bench_main(["generate", "--out", str(out), "--num", "5", "--max-model-len", "0"]) == 0
    assert "fitted" not in capsys.readouterr().out


def test_replay_config_validation():
    with pytest.raises(ValueError, match="exactly one"):
        ReplayConfig("http://x/v1", "m", concurrency=None, rate=None)
    with pytest.raises(ValueError, match="exactly one"):
        ReplayConfig("http://x/v1", "m", concurrency=2, rate=1.0)
    with pytest.raises(ValueError, match="duration"):
        ReplayConfig("http://x/v1", "m", duration=0)


# -- against vLLM --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    return shared_vllm_server()


@pytest.fixture(scope="module")
def request_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "requests.jsonl"
    write_requests(path, generate_requests(MixConfig(num_requests=50, seed=0, **SMALL_MIX)))
    return path


@needs_vllm
@pytest.mark.slow
def test_replay_50_requests_at_concurrency_8(server, request_file, tmp_path, capsys):
    out = tmp_path / "replay.json"
    code = bench_main(["replay", "--base-url", server.base_url, "--api-key", API_KEY, "--requests", str(request_file),
                       "--concurrency", "8", "--json", str(out), "--no-progress"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "score        0.83*" in printed and "TTFT" in printed
    report = json.loads(out.read_text())
    summary, requests = report["summary"], report["requests"]
    assert summary["succeeded"] == 50 and summary["failed"] == 0, summary["first_errors"]
    assert summary["usage_reported"]
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert summary["totals"][key] == sum(r[key] for r in requests)
    window = max(r["end"] for r in requests) - min(r["start"] for r in requests)
    assert math.isclose(summary["seconds"], window)
    assert math.isclose(summary["tps"]["output"], summary["totals"]["completion_tokens"] / window)
    assert math.isclose(summary["score"], sum(SCORE_WEIGHTS[k] * summary["tps"][k] for k in SCORE_WEIGHTS))
    assert f"{summary['score']:.1f}" in printed
    assert summary["totals"]["cached_tokens"] > 0, "shared system prompts should hit the prefix cache"

    # Per-request usage against the set and against the server's own non-streamed count.
    bodies = read_requests(request_file)
    endpoint = Endpoint(server.base_url, api_key=API_KEY)
    try:
        for r in requests:
            assert r["ttft"] is not None and r["ttft"] <= r["latency"]
            assert 1 <= r["completion_tokens"] <= bodies[r["index"]]["max_tokens"]
            assert r["cached_tokens"] <= r["prompt_tokens"]
        for r in requests[::5]:
            body = {**bodies[r["index"]], "model": SERVED_NAME, "max_tokens": 1}
            reply = endpoint.post("chat/completions", body)
            assert reply.status == 200 and reply.body["usage"]["prompt_tokens"] == r["prompt_tokens"]
    finally:
        endpoint.close()


@needs_vllm
@pytest.mark.slow
def test_open_loop_duration_and_errors_are_accounted(server, request_file):
    bodies = read_requests(request_file)[:10]
    bodies.append({"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4})
    config = ReplayConfig(server.base_url, SERVED_NAME, api_key=API_KEY, concurrency=None, rate=40.0, seed=1)
    records, wall = replay(bodies, config)
    summary = summarize(records, wall)
    assert summary["requests"] == 11 and summary["failed"] == 0 and summary["refused"] == 1
    assert summary["refusals"] == {"HTTP 400": 1} and summary["errors"] == {}
    assert summary["totals"]["completion_tokens"] == sum(r.completion_tokens for r in records if r.ok)

    timed = ReplayConfig(server.base_url, SERVED_NAME, api_key=API_KEY, concurrency=4, duration=1.0)
    records, wall = replay(bodies[:3], timed)
    assert len(records) > 3, "the set is cycled until the duration ends"
    assert all(r.ok for r in records)
    assert {r.index for r in records} == {0, 1, 2}
    assert max(r.start for r in records) - min(r.start for r in records) < 1.0 + 0.5


@needs_vllm
@pytest.mark.slow
def test_generated_sets_fit_the_servers_context_and_replay_without_refusals(server, tmp_path, capsys):
    """`generate` with the defaults (long prompts, long outputs) against a 1024-token server: the
    server's own /tokenize counts every prompt, and the replay has no refusal."""
    out = tmp_path / "fitted.jsonl"
    code = bench_main(["generate", "--out", str(out), "--num", "24", "--seed", "3", "--base-url", server.base_url,
                       "--api-key", API_KEY])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "fitted to max_model_len 1024 of tiny-qwen3" in printed and "counted by the server" in printed
    bodies = read_requests(out)
    endpoint = Endpoint(server.base_url, api_key=API_KEY)
    try:
        for body in bodies:
            reply = endpoint.post("chat/completions", {**body, "model": SERVED_NAME, "max_tokens": 1})
            assert reply.status == 200, reply.text[:200]
            assert reply.body["usage"]["prompt_tokens"] + body["max_tokens"] <= 1024
    finally:
        endpoint.close()
    config = ReplayConfig(server.base_url, SERVED_NAME, api_key=API_KEY, concurrency=8, token_ids=True)
    records, wall = replay([{**b, "max_tokens": min(b["max_tokens"], 8)} for b in bodies], config)
    summary = summarize(records, wall)
    assert summary["refused"] == 0 and summary["failed"] == 0, summary["first_refusals"] + summary["first_errors"]
    assert all(r.streamed_tokens == r.completion_tokens for r in records), "--token-ids: every token counted"
    assert all(len(r.itl) == r.completion_tokens - 1 for r in records if r.completion_tokens), "a gap per token"
