"""No request kills the engine, and a dead engine ends the server with a non-zero status.

One `qwen35-serve` on the embedded model (its CPU defaults, an API key) for the module:

- the fuzz test sends 320 random valid combinations of sampling and request parameters (seed, n,
  temperature, top_p / top_k / min_p, the three penalties, logprobs, stop strings, min_tokens,
  ignore_eos, response_format, tools with every tool_choice, streaming, thinking on and off, tiny
  max_tokens, and seeded long prompts that are prefilled in several chunks), four at a time, and
  checks that each is answered 200 and that `/health` stays 200 after each one;
- then the EngineCore process is killed, and the server process must exit with
  `serve.lifecycle.ENGINE_DEAD_STATUS` within seconds, so that a restart policy brings it back.

The SIGTERM bookkeeping of `serve.lifecycle` (an ordinary stop exits 0) is checked in-process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest
from servers import API_KEY, QWEN35_SERVED_NAME, start_qwen35_serve, vllm_available

from serve import lifecycle
from serve.embedded.corpus import CORPUS

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
FUZZ_REQUESTS = 320
CONCURRENCY = 4
MAX_N = 4
DEATH_EXIT_BUDGET_S = 20.0
WORDS = CORPUS.split()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}  # fmt: skip
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    proc = start_qwen35_serve("--max-n", str(MAX_N))
    yield proc
    proc.stop()


def fuzz_request(rng: random.Random, index: int) -> dict:
    """One random valid chat request."""
    long_prompt = rng.random() < 0.12
    words = rng.randint(900, 1150) if long_prompt else rng.choice([1, 3, 12, 40, 150])
    start = rng.randrange(len(WORDS) - words) if len(WORDS) > words else 0
    text = " ".join((WORDS * (1 + words // max(1, len(WORDS))))[start : start + words])
    body: dict = {"model": QWEN35_SERVED_NAME, "messages": [{"role": "user", "content": f"{index}: {text}"}],
                  "max_tokens": rng.choice([1, 1, 2, 3, 5, 8, 16])}  # fmt: skip
    if rng.random() < 0.3:
        body["messages"].insert(0, {"role": "system", "content": "Answer briefly."})
    if long_prompt or rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    greedy = rng.random() < 0.2
    body["temperature"] = 0.0 if greedy else rng.choice([0.1, 0.7, 1.0, 1.5])
    if not greedy and rng.random() < 0.5:
        body["n"] = rng.randint(1, MAX_N)
    if rng.random() < 0.4:
        body["top_p"] = rng.choice([0.1, 0.5, 0.9, 1.0])
    if rng.random() < 0.4:
        body["top_k"] = rng.choice([-1, 1, 5, 50])
    if rng.random() < 0.3:
        body["min_p"] = rng.choice([0.0, 0.05, 0.2])
    for name, values in (("presence_penalty", [-2.0, 0.0, 1.0, 2.0]), ("frequency_penalty", [-2.0, 0.5, 2.0]),
                         ("repetition_penalty", [0.5, 1.0, 1.3, 2.0])):  # fmt: skip
        if rng.random() < 0.25:
            body[name] = rng.choice(values)
    if rng.random() < 0.3:
        body["logprobs"] = True
        body["top_logprobs"] = rng.choice([0, 1, 5, 20])
    if rng.random() < 0.25:
        body["stop"] = rng.choice(["a", ["e", " the"], ["\n"], "</tool_call>"])
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    tools = rng.random() < 0.3
    if tools:
        body["tools"] = rng.sample([WEATHER, ADD], rng.randint(1, 2))
        body["tool_choice"] = rng.choice(["none", "auto", "required", "named"])
        if body["tool_choice"] == "named":
            body["tool_choice"] = {"type": "function", "function": {"name": body["tools"][0]["function"]["name"]}}
        if rng.random() < 0.3:
            body["parallel_tool_calls"] = False
    elif rng.random() < 0.15:
        body["response_format"] = rng.choice([{"type": "json_object"}, SCHEMA_FORMAT, {"type": "text"}])
    thinking = rng.random()
    if thinking < 0.2:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    elif thinking < 0.3:
        body["thinking"] = {"type": rng.choice(["enabled", "disabled"])}
    if rng.random() < 0.4:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


async def _send(client: httpx.AsyncClient, body: dict) -> tuple[int, str]:
    """(status, problem or '') of one request, streamed or not."""
    if not body.get("stream"):
        reply = await client.post("v1/chat/completions", json=body)
        if reply.status_code != 200:
            return reply.status_code, reply.text[:300]
        choices = reply.json()["choices"]
        return 200, "" if len(choices) == body.get("n", 1) else f"{len(choices)} choices"
    async with client.stream("POST", "v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            return reply.status_code, (await reply.aread()).decode(errors="replace")[:300]
        lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
    errors = [line for line in lines if line.startswith("data: {") and '"error"' in line[:20]]
    if errors or not lines or lines[-1] != "data: [DONE]":
        return 200, f"stream ended badly: {(errors or lines[-1:] or ['(nothing)'])[0][:300]}"
    return 200, ""


@needs_vllm
@pytest.mark.slow
def test_fuzzed_requests_never_hurt_the_engine(server):
    rng = random.Random(37)
    bodies = [fuzz_request(rng, i) for i in range(FUZZ_REQUESTS)]
    assert sum("seed" in b and len(b["messages"][-1]["content"].split()) > 900 for b in bodies) >= 20
    assert {json.dumps(b.get("tool_choice")) for b in bodies if "tools" in b} >= {'"none"', '"auto"', '"required"'}

    async def run() -> list[str]:
        problems: list[str] = []
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.root + "/", headers=headers, timeout=300) as client:
            queue = list(enumerate(bodies))

            async def worker() -> None:
                while queue and len(problems) < 5:
                    index, body = queue.pop(0)
                    status, problem = await _send(client, body)
                    health = (await client.get("health")).status_code
                    if status != 200 or problem or health != 200:
                        shown = json.dumps({k: v for k, v in body.items() if k != "messages"})
                        problems.append(f"request {index}: HTTP {status} {problem}; /health {health}; body {shown}")

            await asyncio.gather(*[worker() for _ in range(CONCURRENCY)])
        return problems

    problems = asyncio.run(run())
    assert not problems, "\n".join(problems) + "\n" + server.log_tail(30)


def _engine_core_pids(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline())]


@needs_vllm
@pytest.mark.slow
def test_a_dead_engine_ends_the_server_with_a_non_zero_status(server):
    assert httpx.get(server.root + "/health", timeout=30).status_code == 200
    engines = _engine_core_pids(server.process.pid)
    assert len(engines) == 1, engines
    killed = time.monotonic()
    os.kill(engines[0], signal.SIGKILL)
    status = server.process.wait(timeout=120)
    elapsed = time.monotonic() - killed
    assert status == lifecycle.ENGINE_DEAD_STATUS, f"exit status {status}\n{server.log_tail()}"
    assert elapsed < DEATH_EXIT_BUDGET_S, f"the server took {elapsed:.1f} s to exit"
    assert "the engine is dead" in server.log_path.read_text(errors="replace")


def test_stop_signals_are_recorded_and_passed_on():
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
    try:
        lifecycle._stopping.clear()
        lifecycle._record_stop_signals()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM], "the handler in place before still runs"
        assert lifecycle._stopping.is_set() and not lifecycle.engine_died()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        lifecycle._stopping.clear()
