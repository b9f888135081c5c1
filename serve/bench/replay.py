"""Replay chat requests against an OpenAI endpoint and measure throughput and latency.

Every request is streamed with `stream_options.include_usage`, so token counts come from the
server's own usage (prompt, completion and — when the server reports
`usage.prompt_tokens_details.cached_tokens` — cached prompt tokens). Two load shapes:

- closed loop (`concurrency=N`): N workers, each sends its next request when the previous ends;
- open loop (`rate=R`): requests start at Poisson arrival times, R per second on average,
  regardless of how many are still running.

TTFT is the time to the first chunk with output (text, reasoning or a tool call); ITL the gaps
between such chunks, so a server that batches several tokens per chunk shows fewer, longer gaps.
A parser that holds text back (markup it has not decided on, byte fragments of an unfinished
UTF-8 character, which a random-weight model emits in long runs) shows as one long gap too. With
`token_ids`, each request asks vLLM for `return_token_ids`: every chunk then lists the tokens it carries, text or
not, so ITL counts every sampled token; the tokens of a chunk that carries several (vLLM merges the outputs a slow
reader has not taken yet) count as arriving together, the first after the gap, the others with none.

A request the server refuses with a 4xx status (a prompt longer than its context, a limit of its
policy) is counted as refused, apart from the failures (5xx, broken streams, transport errors).

Without `duration` each request of the set is sent once; with it the set is cycled until
`duration` seconds have passed (requests already started still finish and count).

Throughput is tokens over the wall time from the first request's start to the last one's end.
Input TPS counts every prompt token (cached ones included); Cache TPS counts the cached ones
again, so the score `0.83·output + 0.14·input + 0.03·cache` rewards prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from serve.accept.client import parse_sse_data, split_base_url
from serve.accept.suite import reasoning_of

SCORE_WEIGHTS = {"output": 0.83, "input": 0.14, "cache": 0.03}
PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    index: int
    """Position of the request in the set."""
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    """Seconds to the first chunk carrying text, reasoning or a tool call — or, for a reply whose
    tokens were all hidden (e.g. swallowed markup), to the chunk with its finish_reason."""
    itl: list[float] = field(default_factory=list)
    """Gaps between successive chunks carrying output."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False
    output_chunks: int = 0
    streamed_tokens: int = 0
    """Token ids the chunks carried (with ``token_ids``; else 0)."""
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None
    """HTTP status of the reply (None when no reply came)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def refused(self) -> bool:
        """The server declined the request with a 4xx status."""
        return self.status is not None and 400 <= self.status < 500

    @property
    def latency(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict:
        data = asdict(self)
        del data["itl"]
        data["itl_mean"] = sum(self.itl) / len(self.itl) if self.itl else None
        data["latency"] = self.latency
        return data


@dataclass(frozen=True)
class ReplayConfig:
    base_url: str
    model: str
    api_key: str | None = None
    concurrency: int | None = 8
    rate: float | None = None
    duration: float | None = None
    timeout: float = 600.0
    seed: int = 0
    ignore_eos: bool = False
    """Send vLLM's `ignore_eos` so every reply runs to its max_tokens (output lengths follow the set)."""
    token_ids: bool = False
    """Send vLLM's `return_token_ids`, so ITL counts every token (see the module docstring)."""

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate={self.rate} must be > 0")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration={self.duration} must be > 0")


def _prepare(body: dict, config: ReplayConfig) -> dict:
    prepared = {**body, "model": config.model, "stream": True, "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        prepared["ignore_eos"] = True
    if config.token_ids:
        prepared["return_token_ids"] = True
    return prepared


async def _send(client: httpx.AsyncClient, url: str, headers: dict, body: dict, record: RequestRecord) -> None:
    """Stream one request, filling `record` (errors are recorded, never raised)."""
    record.start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                payload = parse_sse_data(line)
                if payload is None:
                    continue
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    shown = delta.get("content") or reasoning_of(delta) or delta.get("tool_calls")
                    ids = choice.get("token_ids") or ()
                    if shown or ids:
                        if record.ttft is None:
                            record.ttft = now - record.start
                        else:
                            record.itl.append(now - last)
                        record.itl.extend([0.0] * max(len(ids) - 1, 0))  # tokens that came in the same chunk
                        last = now
                        record.output_chunks += 1
                        record.streamed_tokens += len(ids)
                    if choice.get("finish_reason") is not None:
                        record.finish_reason = choice["finish_reason"]
                        if record.ttft is None:
                            record.ttft = now - record.start
                usage = chunk.get("usage")
                if usage:
                    record.usage_reported = True
                    record.prompt_tokens = usage.get("prompt_tokens") or 0
                    record.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
        if not record.usage_reported:
            # No usage from the server: count output chunks, the best estimate left.
            record.completion_tokens = record.output_chunks
    except (httpx.HTTPError, ValueError) as error:
        record.error = f"{type(error).__name__}: {error}"[:300]
    finally:
        record.end = time.perf_counter()


async def _replay(
    requests: list[dict], config: ReplayConfig, on_done: Callable[[RequestRecord], None] | None
) -> tuple[list[RequestRecord], float]:
    base, _ = split_base_url(config.base_url)
    url = f"{base}/chat/completions"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    width = config.concurrency or 1024
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + config.duration if config.duration else None
    total = None if deadline else len(requests)

    def next_index() -> int | None:
        n = len(records)
        if (total is not None and n >= total) or (deadline is not None and time.perf_counter() >= deadline):
            return None
        records.append(RequestRecord(index=n % len(requests)))
        return n

    async def run(client: httpx.AsyncClient, n: int) -> None:
        record = records[n]
        await _send(client, url, headers, _prepare(requests[record.index], config), record)
        if on_done is not None:
            on_done(record)

    async with httpx.AsyncClient(timeout=config.timeout, limits=limits) as client:
        if config.concurrency is not None:

            async def worker() -> None:
                while (n := next_index()) is not None:
                    await run(client, n)

            await asyncio.gather(*(worker() for _ in range(config.concurrency)))
        else:
            arrivals = random.Random(config.seed)
            tasks = []
            while (n := next_index()) is not None:
                tasks.append(asyncio.create_task(run(client, n)))
                await asyncio.sleep(arrivals.expovariate(config.rate))
            await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def replay(
    requests: list[dict], config: ReplayConfig, on_done: Callable[[RequestRecord], None] | None = None
) -> tuple[list[RequestRecord], float]:
    """Run the replay; returns the per-request records and the wall time in seconds."""
    if not requests:
        raise ValueError("no requests to replay")
    return asyncio.run(_replay(requests, config, on_done))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _distribution(values: list[float]) -> dict:
    stats: dict = {"count": len(values), "mean": sum(values) / len(values) if values else None}
    stats.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    stats["max"] = max(values) if values else None
    return stats


def summarize(records: list[RequestRecord], wall: float) -> dict:
    """Totals, throughput, score and latency distributions over the successful requests."""
    done = [r for r in records if r.ok]
    totals = {
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "completion_tokens": sum(r.completion_tokens for r in done),
        "cached_tokens": sum(r.cached_tokens for r in done),
    }
    window = max(r.end for r in records) - min(r.start for r in records) if records else wall
    window = window if window > 0 else wall
    tps = {
        "output": totals["completion_tokens"] / window,
        "input": totals["prompt_tokens"] / window,
        "cache": totals["cached_tokens"] / window,
    }
    errors: dict[str, int] = {}
    refusals: dict[str, int] = {}
    for r in records:
        if not r.ok:
            kind = r.error.split(":", 1)[0]
            counts = refusals if r.refused else errors
            counts[kind] = counts.get(kind, 0) + 1
    refused = [r for r in records if not r.ok and r.refused]
    failed = [r for r in records if not r.ok and not r.refused]
    tpot = [
        (r.latency - r.ttft) / (r.completion_tokens - 1) for r in done if r.ttft is not None and r.completion_tokens > 1
    ]
    return {
        "requests": len(records),
        "succeeded": len(done),
        "refused": len(refused),
        "failed": len(failed),
        "refusals": refusals,
        "errors": errors,
        "first_refusals": [r.error for r in refused][:5],
        "first_errors": [r.error for r in failed][:5],
        "usage_reported": all(r.usage_reported for r in done),
        "seconds": window,
        "requests_per_second": len(done) / window,
        "totals": totals,
        "tps": tps,
        "score": sum(SCORE_WEIGHTS[k] * tps[k] for k in SCORE_WEIGHTS),
        "latency_seconds": {
            "ttft": _distribution([r.ttft for r in done if r.ttft is not None]),
            "itl": _distribution([gap for r in done for gap in r.itl]),
            "tpot": _distribution(tpot),
            "e2e": _distribution([r.latency for r in done]),
        },
    }


def format_summary(summary: dict, config: ReplayConfig) -> str:
    load = f"concurrency {config.concurrency}" if config.concurrency else f"rate {config.rate}/s"
    totals, tps = summary["totals"], summary["tps"]
    lines = [
        f"model {config.model} at {config.base_url}, {load}"
        + (f", duration {config.duration:g} s" if config.duration else ""),
        f"requests     {summary['succeeded']} ok, {summary['refused']} refused (4xx), {summary['failed']} failed "
        f"in {summary['seconds']:.2f} s "
        f"({summary['requests_per_second']:.2f} req/s)",
        f"tokens       prompt {totals['prompt_tokens']} (cached {totals['cached_tokens']}), "
        f"completion {totals['completion_tokens']}" + ("" if summary["usage_reported"] else "  [usage estimated]"),
        f"throughput   output {tps['output']:.1f} tok/s, input {tps['input']:.1f} tok/s, "
        f"cache {tps['cache']:.1f} tok/s",
        f"score        0.83*{tps['output']:.1f} + 0.14*{tps['input']:.1f} + 0.03*{tps['cache']:.1f} = "
        f"{summary['score']:.1f}",
        "",
        f"{'latency ms':12}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p95", "p99", "max")),
    ]
    for name, stats in summary["latency_seconds"].items():
        cells = [stats[k] for k in ("mean", "p50", "p90", "p95", "p99", "max")]
        lines.append(f"{name.upper():12}" + "".join(f"{'-':>10}" if v is None else f"{v * 1000:10.1f}" for v in cells))
    if summary["refused"] or summary["failed"]:
        lines.append("")
    if summary["refused"]:
        lines.append(f"refusals     {summary['refusals']}; first: {summary['first_refusals'][0]}")
    if summary["failed"]:
        lines.append(f"errors       {summary['errors']}; first: {summary['first_errors'][0]}")
    return "\n".join(lines)


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless forced)."""

    def __init__(self, total: int | None, duration: float | None, enabled: bool | None = None) -> None:
        self.total, self.duration = total, duration
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.perf_counter()
        self.done = self.failed = self.refused = self.tokens = 0

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok and not record.refused
        self.refused += record.refused
        self.tokens += record.completion_tokens if record.ok else 0
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        if self.duration:
            fraction = min(1.0, elapsed / self.duration)
        else:
            fraction = self.done / self.total if self.total else 0.0
        bar = "#" * int(30 * fraction) + "." * (30 - int(30 * fraction))
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        sys.stderr.write(
            f"\r[{bar}] {self.done}{'/' + str(self.total) if self.total else ''} req  {elapsed:6.1f} s  "
            f"out {rate:8.1f} tok/s  refused {self.refused}  errors {self.failed}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
