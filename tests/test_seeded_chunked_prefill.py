"""A seeded request whose prompt spans several prefill chunks: answered, reproducible, and the server survives.

vLLM samples (and discards) a token for a partly prefilled prompt and then rewinds a seeded request's
generator by offset, which the CPU generator cannot do; `qwen35.vllm_adapter` restores the generator's
state instead. Two real `qwen35-serve` servers on the embedded model, one with 64-token prefill chunks and
one that prefills the prompt in one step, must give the same tokens for the same seed.
"""

from __future__ import annotations

import httpx
import pytest
from servers import QWEN35_SERVED_NAME, start_qwen35_serve, vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

PROMPT = " ".join(f"word{i} and some more text about item {i}." for i in range(60))
SEEDS = (7, 1234)


def _sample(server, seed: int) -> list[str]:
    body = {"model": QWEN35_SERVED_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": seed,
            "logprobs": 1}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 200, f"{r.status_code}: {r.text}\n{server.log_tail()}"
    reply = r.json()
    assert reply["usage"]["prompt_tokens"] > 4 * 64, "the prompt must span several 64-token chunks"
    return reply["choices"][0]["logprobs"]["tokens"]


def _healthy(server) -> bool:
    return httpx.get(server.base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_seeded_prompt_over_several_prefill_chunks_is_reproducible_and_keeps_the_server_up():
    runs: dict[str, dict[int, list[str]]] = {}
    for name, chunk in (("chunked", "64"), ("whole", "4096")):
        server = start_qwen35_serve("--max-num-batched-tokens", chunk, "--no-enable-prefix-caching")
        try:
            runs[name] = {seed: _sample(server, seed) for seed in SEEDS}
            assert _healthy(server), server.log_tail()
            assert _sample(server, SEEDS[0]) == runs[name][SEEDS[0]], "the same seed gave other tokens"
            assert _healthy(server), server.log_tail()
        finally:
            server.stop()
    assert runs["chunked"] == runs["whole"], f"chunked prefill changed seeded tokens: {runs}"
    assert runs["chunked"][SEEDS[0]] != runs["chunked"][SEEDS[1]], "different seeds gave the same 12 tokens"
