"""Our plugin against vLLM's native Qwen3.5 class on one GPU or several (tensor parallel): agreement, throughput,
start-up, long-context decode, decode ITL with and without CUDA graphs.

    python -m tuning.gpu_vllm --out $OUT                          # the comparison at TP 1, <= --budget seconds
    python -m tuning.gpu_vllm --out $OUT --tp 2 --skip eager,hf   # TP 2 (after a TP 1 run on the same machine)
    python -m tuning.gpu_vllm --out $OUT --profile --skip eager,hf   # plus a torch-profiler window per engine

Needs vLLM 0.26 (``scripts/vllm_gpu_install.sh``; ``PYTHONPATH=/tmp/site:$PWD``). Phases, each skipped (and said
so) when the budget cannot hold it:

1. ``ckpt``: a random-weight checkpoint of a published Qwen3.5 width (``--shape``, 35B-A3B by default) with
   ``--layers`` layers (:mod:`tuning.vllm_ckpt`: transformers' config classes, hub layout, padded tokenizer).
2. ``graphs``: ``vllm serve`` for ``ours`` (``VLLM_PLUGINS=qwen35``) first; when it does not start, the run stops
   there (native's start is skipped) with the diagnosis in ``server_logs.txt``. Then ``native`` (no plugin), with
   the same arguments (:data:`SERVER_ARGS` + :data:`COMPILE` + ``--tensor-parallel-size``): prefix caching,
   16384-token chunks, a fixed KV cache so that two servers share the GPU, full CUDA graphs for uniform decode
   batches (``-cc.mode=none -cc.cudagraph_mode=FULL_DECODE_ONLY``; ``--compile default`` keeps vLLM's defaults).
   While native starts, ours answers the agreement prompts (untimed). Start-up seconds are rows; the backends our
   plugin chose (the log's probe table) go into ``meta.backends``.
3. ``agree``: 32 prompts (64-512 tokens of learned BPE ids): teacher-forced log-probs (``prompt_logprobs``) and the
   engines' top-1 at each position; greedy 32 x 64 tokens (EOS ignored): token match rate, common-prefix rate, and
   the log-prob gap at each first divergence (a near-tie when small). At TP n > 1, each engine also against its
   own TP 1 answers saved by an earlier run on this machine (``agree_tpN_vs_tp1``), with ``tf_within_bf16_budget``.
4. ``longctx``: 4 prompts of 32256 tokens decoded for 512 tokens (streamed, EOS ignored): seconds, TTFT, the longest
   gap between tokens (a stall), and the greedy tokens against the other engine and against TP 1.
5. ``throughput``: ``qwen35-bench replay`` (EOS ignored) of fixed synthetic sets: ``prefill`` (prompts 2k-16k tokens,
   64 out, concurrency 16), ``decode`` (prompts 256, 512 out, concurrency 64), ``mixed`` (``qwen35-bench
   generate``'s default production-like mix, concurrency 32) and ``decode_c1`` (one stream). Output / Input / Cache
   TPS, score = 0.83 / 0.14 / 0.03 of them, TTFT / ITL / TPOT p50 and p99; at TP n > 1 the scaling efficiency
   (score at TP n / (n x score at TP 1), TP 1 from the saved run).
6. ``eager``: both engines again with ``--enforce-eager``: decode ITL without CUDA graphs (``decode_eager``,
   ``decode_c1_eager``), and ours' greedy tokens with graphs against without.
7. ``hf``: transformers' fp32 model on the same weights (alongside step 6's start-up, in a subprocess; TP 1 only):
   teacher-forced log-probs of both engines against it.
8. ``profile`` (``--profile``): the step-2 servers carry a torch profiler; one decode window (16 streams x 64
   tokens) and one prefill window (2 x 8192 tokens) per engine: GPU time per kernel category and top kernels.

Writes into ``--out``: ``gpu_vllm.json`` (``meta`` and ``rows`` of ``device, tp, engine, mix, metric, value``;
rewritten after every phase), ``gpu_vllm.txt`` (the table) and ``server_logs.txt`` (per server: state, chosen
backends, qwen35's warnings, the first traceback, the log's tail; rewritten every 10 s and as soon as a start
fails, so that a run killed at the call's limit keeps it). Under ``/tmp/gpu_vllm`` (kept while the machine is
warm): the checkpoint, the request sets, the logs, and each TP's answers and rows for a later run to compare with.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tuning import vllm_serving as vs

KV_GIB = 24
GPU_UTIL = 0.35  # only vLLM's start-up check of free memory: the KV cache size is fixed (--kv-gib)
SERVER_ARGS = ["--dtype", "bfloat16", "--max-model-len", "32768", "--max-num-seqs", "128",
               "--max-num-batched-tokens", "16384", "--enable-prefix-caching", "--language-model-only",
               "--gdn-prefill-backend", "triton", "--enable-prompt-tokens-details", "--enable-auto-tool-choice",
               "--tool-call-parser", "qwen3_coder", "--seed", "0", "--disable-uvicorn-access-log"]
# Both engines get the same compilation arguments. "none": no torch.compile (ours has no compiled pieces anyway;
# native's start-up drops Dynamo and inductor) and full CUDA graphs for uniform decode batches in both, the mode
# named explicitly (vLLM turns a piecewise default into no graphs at all without compilation).
COMPILE = {"none": ["-cc.mode=none", "-cc.cudagraph_mode=FULL_DECODE_ONLY"], "default": []}
AGREE_PROMPTS, AGREE_NEW = 32, 64
LONG_PROMPTS, LONG_NEW = 4, 512
LONG_LEN = 32768 - LONG_NEW  # the longest prompt --max-model-len takes with 512 new tokens
BF16_BUDGET = {"mean_abs": 0.05, "max_abs": 0.5}  # nats: teacher-forced |log-prob diff| of two bf16 engines
PHASES = ("agree", "longctx", "throughput", "eager", "hf")
WORK = Path("/tmp/gpu_vllm")  # checkpoint, request sets, logs, saved answers (kept for a follow-up run)
# server log lines kept in the results: what each engine chose for graphs, compilation and its kernels
NOTES = r"cudagraph|CUDAGraph|CUDA graph|[Aa]ttention backend|GDN prefill|MoE backend|torch.compile|[Gg]raph capturing"


class Run:
    """Rows, meta and the deadline of one comparison run; results are rewritten after every phase."""

    def __init__(self, out: Path, budget: float, device: str, tp: int = 1) -> None:
        self.out, self.t0, self.deadline, self.device = out, time.perf_counter(), time.perf_counter() + budget, device
        self.tp = tp
        self.rows: list[dict] = []
        self.meta: dict = {"phases": {}, "skipped": {}, "errors": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[gpu_vllm {time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def add(self, engine: str, mix: str, metric: str, value: float) -> None:
        value = float(value)
        self.rows.append({"device": self.device, "tp": self.tp, "engine": engine, "mix": mix, "metric": metric,
                          "value": value if math.isfinite(value) else None})

    def phase(self, name: str, need_s: float, fn) -> bool:
        """Run ``fn()`` if ``need_s`` seconds are left; record its time, or why it was skipped / failed."""
        if self.left() < need_s:
            self.meta["skipped"][name] = f"{self.left():.0f} s left, needs ~{need_s:.0f} s"
            self.log(f"skip {name}: {self.meta['skipped'][name]}")
            return False
        t = time.perf_counter()
        self.log(f"phase {name}")
        try:
            fn()
            ok = True
        except Exception as e:  # noqa: BLE001 - recorded in the results; later phases still run
            self.meta["errors"][name] = f"{type(e).__name__}: {e}"[-3000:]
            self.log(f"{name} failed: {type(e).__name__}: {str(e)[-1500:]}")
            traceback.print_exc()
            ok = False
        self.meta["phases"][name] = round(time.perf_counter() - t, 1)
        self.write()
        return ok

    def write(self) -> None:
        (self.out / "gpu_vllm.json").write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1))
        (self.out / "gpu_vllm.txt").write_text(table(self.rows) + "\n")


def table(rows: list[dict]) -> str:
    """Rows side by side: one line per (mix, metric), ours, native and ours / native."""
    keyed: dict[tuple[str, str], dict[str, float | None]] = {}
    for r in rows:
        keyed.setdefault((r["mix"], r["metric"]), {})[r["engine"]] = r["value"]
    lines = [f"{'mix':<18} {'metric':<28} {'ours':>12} {'native':>12} {'ours/native':>11}"]
    for (mix, metric), v in keyed.items():
        o, n = v.get("ours"), v.get("native")
        other = {k: x for k, x in v.items() if k not in ("ours", "native")}
        ratio = f"{o / n:11.3f}" if isinstance(o, float) and isinstance(n, float) and n else " " * 11
        fmt = lambda x: f"{x:12.4g}" if isinstance(x, float) else f"{'-':>12}"  # noqa: E731
        extra = "  " + ", ".join(f"{k}={x:.4g}" for k, x in other.items() if isinstance(x, float)) if other else ""
        lines.append(f"{mix:<18} {metric:<28} {fmt(o)} {fmt(n)} {ratio}{extra}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- request sets


def _text_of_tokens(tokenizer, rng: random.Random, words: list[str], n_tokens: int) -> str:
    """Prose of corpus words that the checkpoint's tokenizer turns into ~``n_tokens`` tokens."""
    pool = " ".join(rng.choice(words) for _ in range(n_tokens + 16))
    enc = tokenizer.encode(pool)
    while len(enc.ids) < n_tokens:
        pool += " " + " ".join(rng.choice(words) for _ in range(n_tokens))
        enc = tokenizer.encode(pool)
    return pool[: enc.offsets[n_tokens - 1][1]]


def request_sets(ckpt: Path, work: Path, quick: bool) -> dict[str, tuple[Path, int]]:
    """{mix: (JSONL of chat bodies, concurrency)}; the same files for both engines (fixed seeds)."""
    from tokenizers import Tokenizer

    from serve.bench.generate import WORDS, MixConfig, generate_requests, write_requests

    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    sets: dict[str, tuple[Path, int]] = {}

    def chat(rng: random.Random, prompt: int, out: int) -> dict:
        return {"messages": [{"role": "user", "content": _text_of_tokens(tokenizer, rng, WORDS, prompt)}],
                "max_tokens": out, "temperature": 0.0}

    specs = {  # mix: (requests, prompt lengths, max_tokens, concurrency)
        "prefill": (16 if quick else 48, "2k-16k", 64, 8 if quick else 16),
        "decode": (64 if quick else 128, 256, 256 if quick else 512, 64),
        "decode_c1": (4, 256, 128, 1),
    }
    for mix, (n, prompt, out, conc) in specs.items():
        rng = random.Random(f"{mix}-0")
        bodies = []
        for _ in range(n):
            length = int(round(math.exp(rng.uniform(math.log(2048), math.log(16384))))) if prompt == "2k-16k" \
                else prompt
            bodies.append(chat(rng, length, out))
        path = work / f"{mix}.jsonl"
        write_requests(path, bodies)
        sets[mix] = (path, conc)
    mixed = generate_requests(MixConfig(num_requests=48 if quick else 100, seed=0))
    write_requests(work / "mixed.jsonl", mixed)
    sets["mixed"] = (work / "mixed.jsonl", 32)
    return sets


def agreement_prompts(seed: int = 0) -> list[list[int]]:
    """32 prompts of 64-512 learned BPE ids (what text looks like to every engine; no control tokens)."""
    from tuning.vllm_ckpt import learned_token_range

    hi = learned_token_range()
    rng = random.Random(seed)
    return [[rng.randrange(hi) for _ in range(int(math.exp(rng.uniform(math.log(64), math.log(512)))))]
            for _ in range(AGREE_PROMPTS)]


def long_prompts(n: int = LONG_PROMPTS, length: int = LONG_LEN, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` learned BPE ids for the long-context decode check."""
    from tuning.vllm_ckpt import learned_token_range

    hi = learned_token_range()
    rng = random.Random(f"long-{seed}")
    return [[rng.randrange(hi) for _ in range(length)] for _ in range(n)]


# ----------------------------------------------------------------------------- phases


def agreement_rows(run: Run, name: str, a: list[dict] | None, b: list[dict] | None, tf_a=None, tf_b=None,
                   engine: str = "ours") -> None:
    """Rows comparing engine results ``a`` with ``b`` (greedy) and ``tf_a`` with ``tf_b`` (teacher-forced)."""
    if tf_a is not None and tf_b is not None:
        d = vs.logprob_diff([r["logprobs"] for r in tf_a], [r["logprobs"] for r in tf_b], name)
        for k in ("mean_abs", "p99_abs", "max_abs"):
            run.add(engine, name, f"tf_logprob_{k}", d[k])
        run.add(engine, name, "tf_top1_agreement", vs.top1_agreement(tf_a, tf_b))
        run.add(engine, name, "tf_within_bf16_budget",
                float(d["mean_abs"] <= BF16_BUDGET["mean_abs"] and d["max_abs"] <= BF16_BUDGET["max_abs"]))
    if a is not None and b is not None:
        g = vs.greedy_agreement(a, b)
        for k, v in g.items():
            run.add(engine, name, f"greedy_{k}", v)


def longctx_rows(run: Run, engine: str, results: list[dict]) -> None:
    run.add(engine, "longctx", "seconds_max", max(r["seconds"] for r in results))
    run.add(engine, "longctx", "ttft_max_s", max(r["ttft_s"] for r in results))
    run.add(engine, "longctx", "itl_max_ms", 1e3 * max(r["itl_max_s"] for r in results))
    run.add(engine, "longctx", "itl_p50_ms", 1e3 * sorted(r["itl_p50_s"] for r in results)[len(results) // 2])
    run.add(engine, "longctx", "decode_tps",
            sum(len(r["tokens"]) for r in results) / max(r["seconds"] - r["ttft_s"] for r in results))


def saved_path(ckpt: Path, tp: int, what: str) -> Path:
    """Where a run keeps its ``what`` (answers, rows) for this checkpoint and TP, for later runs to compare with."""
    return WORK / f"{what}_{ckpt.name}_tp{tp}.json"


def scaling_rows(run: Run, ckpt: Path) -> None:
    """TP scaling efficiency per engine and mix: score (and output TPS) at TP n / (n x the same at TP 1)."""
    path = saved_path(ckpt, 1, "rows")
    if run.tp == 1 or not path.is_file():
        return
    tp1 = {(r["engine"], r["mix"], r["metric"]): r["value"] for r in json.loads(path.read_text())}
    for r in list(run.rows):
        if r["metric"] in ("score", "output_tps") and r["value"] and tp1.get((r["engine"], r["mix"], r["metric"])):
            base = tp1[(r["engine"], r["mix"], r["metric"])]
            run.add(r["engine"], r["mix"], f"tp_scaling_efficiency_{r['metric']}", r["value"] / (run.tp * base))
    run.meta["tp1_rows"] = str(path)


def main(argv: list[str] | None = None) -> int:
    from tuning.vllm_ckpt import SHAPES

    ap = argparse.ArgumentParser(prog="python -m tuning.gpu_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", default="35b-a3b", choices=SHAPES, help="published width (default %(default)s)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--overrides", type=json.loads, default=None, metavar="JSON",
                    help='text-config fields over the shape\'s, e.g. \'{"num_experts": 128}\' (memory) or a tiny '
                         'width for a smoke run on vLLM\'s CPU build')
    ap.add_argument("--long-len", type=int, default=LONG_LEN, help="long-context prompt tokens (default %(default)s)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every server (default 1)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default %(default)s)")
    ap.add_argument("--compile", default="none", choices=sorted(COMPILE),
                    help="compilation arguments of both engines (default none: no torch.compile, full decode graphs)")
    ap.add_argument("--kv-gib", type=float, default=KV_GIB, help="KV cache per GPU and server (default %(default)s)")
    ap.add_argument("--gpu-util", type=float, default=GPU_UTIL, help="vLLM's --gpu-memory-utilization: the share of "
                    "a GPU each server may hold, weights + KV + graphs (default %(default)s: two servers share one)")
    ap.add_argument("--quick", action="store_true", help="smaller request sets")
    ap.add_argument("--profile", action="store_true", help="torch-profiler windows (decode, prefill) per engine")
    ap.add_argument("--skip", default="", help=f"comma-separated phases to leave out: {','.join(PHASES)} (skipping "
                    "agree, longctx and throughput starts no graph servers; hf then compares the answers an earlier "
                    "run saved)")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(PHASES):
        ap.error(f"--skip {sorted(skip - set(PHASES))}: accepted {', '.join(PHASES)}")
    import torch

    if args.tp < 1 or (torch.cuda.is_available() and args.tp > torch.cuda.device_count()):
        ap.error(f"--tp {args.tp}: accepted 1..{torch.cuda.device_count()} (the GPUs of this machine)")
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    run = Run(args.out, args.budget, device, args.tp)
    server_args = [*SERVER_ARGS, *COMPILE[args.compile], "--tensor-parallel-size", str(args.tp),
                   "--kv-cache-memory-bytes", str(int(args.kv_gib * (1 << 30))), "--gpu-memory-utilization",
                   str(args.gpu_util)]
    run.meta.update(vllm=vllm.__version__, torch=torch.__version__, shape=args.shape, layers=args.layers, tp=args.tp,
                    overrides=args.overrides, long_len=args.long_len, compile=args.compile, quick=args.quick,
                    server_args=server_args, server_env=vs.SERVER_ENV, argv=sys.argv[1:] if argv is None else argv)
    run.log(f"vLLM {vllm.__version__}, torch {torch.__version__}, {device} x{args.tp}, budget {args.budget:.0f} s")
    WORK.mkdir(parents=True, exist_ok=True)
    log_dir = WORK / "logs"
    mirror = vs.LogMirror(args.out / "server_logs.txt")
    state: dict = {"servers": [], "answers": {"tf": {}, "greedy": {}, "longctx": {}}}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a kill at the call's limit still runs the finally

    def ckpt() -> None:
        from tuning.vllm_ckpt import write_checkpoint

        t = time.perf_counter()
        state["ckpt"] = write_checkpoint(WORK / "ckpt", layers=args.layers, shape=args.shape, overrides=args.overrides,
                                         device="cuda" if torch.cuda.is_available() else "cpu")
        run.meta["checkpoint"] = {"path": str(state["ckpt"]), "seconds": round(time.perf_counter() - t, 1),
                                  "done": (state["ckpt"] / "DONE").read_text().strip()}
        state["sets"] = request_sets(state["ckpt"], WORK, args.quick)
        state["prompts"] = agreement_prompts()

    def launch(engine: str, mode: str, extra: list[str]) -> vs.Server:
        more = list(extra)
        if args.profile and mode == "graphs":
            more += ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_with_stack": False,
                                                      "torch_profiler_dir": str(WORK / f"profile_{engine}")})]
        server = vs.start_server(f"{engine}_{mode}_tp{args.tp}", engine, str(state["ckpt"]), server_args + more,
                                 log_dir)
        state["servers"].append(server)
        mirror.add([server])
        return server

    def ready(servers: list[vs.Server], mode: str, within: float) -> dict[str, vs.Server]:
        """Wait for ``servers``; rows and notes for each, the diagnosis file at once when one failed."""
        failed = vs.wait_ready(servers, deadline=min(run.deadline - 30, time.perf_counter() + within),
                               raise_on_failure=False)
        for s in servers:
            if s.ready_s is not None:
                run.add(s.engine, mode, "startup_s", s.ready_s)
                run.log(f"{s.name} up in {s.ready_s:.1f} s")
            text = s.log_path.read_text(errors="replace")
            run.meta.setdefault("server_notes", {})[s.name] = s.log_lines(NOTES)[-10:]
            if s.engine == "ours":
                run.meta.setdefault("backends", {})[s.name] = {
                    dev: {op: r["backend"] for op, r in rows.items()} for dev, rows in vs.backend_table(text).items()}
            if s.name in failed:
                run.meta["errors"][f"{s.name}_start"] = (vs.first_traceback(text) or failed[s.name])[-3000:]
        if failed:
            mirror.write()
            run.write()
            run.log("start failed: " + "; ".join(s.failed for s in servers if s.failed))
        up = {s.engine: s for s in servers if s.ready_s is not None}
        for s in up.values():  # warm-up: kernels for the first real shapes, not timed
            vs.replay(s, state["sets"]["decode_c1"][0], 1, WORK / f"warm_{s.name}.json")
        return up

    def answers(server: vs.Server) -> None:
        """Teacher-forced and greedy answers of one engine (untimed; ours' run while native starts)."""
        e, a = server.engine, state["answers"]
        if "agree" not in skip:
            a["tf"][e] = vs.teacher_forced(server, state["prompts"])
            a["greedy"][e] = vs.greedy(server, state["prompts"], AGREE_NEW)

    def graphs() -> None:
        ours = ready([launch("ours", "graphs", [])], "graphs", 360)
        if "ours" not in ours:  # native's start is skipped; one eager start says whether capture is what failed
            tried = run.left() > 300
            eager = ready([launch("ours", "eager", ["--enforce-eager"])], "eager", 240) if tried else {}
            for server in eager.values():  # a server that failed was stopped by wait_ready
                server.stop()
            run.meta["ours_eager_after_graphs_failed"] = ("started: capture is what failed" if eager else
                                                          "failed too" if tried else "not tried (no time left)")
            raise RuntimeError(f"ours did not start with CUDA graphs (eager: "
                               f"{run.meta['ours_eager_after_graphs_failed']}); native's start is skipped; "
                               f"server_logs.txt has the diagnosis")
        native = launch("native", "graphs", [])
        answers(ours["ours"])
        state["graphs"] = {**ours, **ready([native], "graphs", 420)}
        if "native" in state["graphs"]:
            answers(state["graphs"]["native"])

    def agree() -> None:
        a = state["answers"]
        if len(a["tf"]) == 2:
            agreement_rows(run, "agree_ours_vs_native", a["greedy"]["ours"], a["greedy"]["native"], a["tf"]["ours"],
                           a["tf"]["native"])
        tp1 = saved_path(state["ckpt"], 1, "answers")
        if args.tp > 1 and tp1.is_file():
            old = json.loads(tp1.read_text())
            for e in a["tf"]:
                if e in old["tf"] and old["prompts"] == state["prompts"]:
                    agreement_rows(run, f"agree_tp{args.tp}_vs_tp1", a["greedy"][e], old["greedy"][e], a["tf"][e],
                                   old["tf"][e], engine=e)
            run.meta["tp1_answers"] = str(tp1)

    def longctx() -> None:
        prompts, a = long_prompts(length=args.long_len), state["answers"]
        for e, server in state["graphs"].items():
            a["longctx"][e] = vs.stream_greedy(server, prompts, LONG_NEW)
            longctx_rows(run, e, a["longctx"][e])
        if len(a["longctx"]) == 2:
            agreement_rows(run, "longctx_ours_vs_native", a["longctx"]["ours"], a["longctx"]["native"])
        tp1 = saved_path(state["ckpt"], 1, "answers")
        if args.tp > 1 and tp1.is_file():
            old = json.loads(tp1.read_text()).get("longctx", {})
            for e in a["longctx"]:
                if e in old:
                    agreement_rows(run, f"longctx_tp{args.tp}_vs_tp1", a["longctx"][e], old[e], engine=e)

    def save_answers() -> None:
        a = state["answers"]
        if a["tf"] or a["longctx"]:
            saved_path(state["ckpt"], args.tp, "answers").write_text(json.dumps({"prompts": state["prompts"], **a}))

    def throughput() -> None:
        for mix in ("decode_c1", "decode", "prefill", "mixed"):
            path, conc = state["sets"][mix]
            for engine, server in state["graphs"].items():
                summary = vs.replay(server, path, conc, WORK / f"replay_{mix}_{engine}.json")
                for metric, value in vs.replay_metrics(summary).items():
                    run.add(engine, mix, metric, value)
                run.log(f"{mix:<10} {engine:<6} score {summary['score']:10.1f}  out {summary['tps']['output']:9.1f}"
                        f"  in {summary['tps']['input']:10.1f} tok/s  failed {summary['failed']}")
        saved_path(state["ckpt"], args.tp, "rows").write_text(json.dumps(run.rows))
        scaling_rows(run, state["ckpt"])

    def profile() -> None:
        from serve.bench.generate import read_requests

        for engine, s in state["graphs"].items():
            pdir = WORK / f"profile_{engine}"
            decode = read_requests(state["sets"]["decode"][0])[:16]
            prefill = read_requests(state["sets"]["prefill"][0])[:2]
            for kind, bodies, conc in (("decode", decode, 16), ("prefill", prefill, 2)):
                f = WORK / f"profile_{kind}.jsonl"
                f.write_text("".join(json.dumps({**b, "max_tokens": 64 if kind == "decode" else 1}) + "\n"
                                     for b in bodies))
                for old in pdir.rglob("*"):
                    if old.is_file():
                        old.unlink()
                result = vs.profile_window(s, lambda s=s, f=f, conc=conc: vs.replay(s, f, conc, WORK / "p.json"), pdir)
                run.meta.setdefault("profile", {}).setdefault(engine, {})[kind] = result
                for k, ms in result.get("gpu_ms_by_kind", {}).items():
                    run.add(engine, f"profile_{kind}", f"gpu_ms_{k}", ms)

    def stop(mode: str) -> None:
        for s in state.get(mode, {}).values():
            s.stop()

    def eager_and_hf() -> None:
        a, hf = state["answers"], None
        if not a["tf"] and saved_path(state["ckpt"], args.tp, "answers").is_file():  # a follow-up run
            saved = json.loads(saved_path(state["ckpt"], args.tp, "answers").read_text())
            if saved["prompts"] == state["prompts"]:
                a.update({k: v for k, v in saved.items() if k != "prompts"})
                run.meta["answers_from"] = str(saved_path(state["ckpt"], args.tp, "answers"))
        if "hf" not in skip and a["tf"] and args.tp == 1:  # the fp32 reference loads while the eager servers start
            job = WORK / "hf_job.json"
            job.write_text(json.dumps({"ckpt": str(state["ckpt"]), "prompts": state["prompts"]}))
            hf = subprocess.Popen([sys.executable, "-m", "tuning.gpu_vllm_hf", str(job), str(WORK / "hf.json")],
                                  stdout=open(log_dir / "hf.log", "w"), stderr=subprocess.STDOUT,
                                  env=vs.engine_env("native"), cwd=str(Path(__file__).resolve().parent.parent))
        try:
            if "eager" not in skip:
                state["eager"] = ready([launch(e, "eager", ["--enforce-eager"]) for e in vs.ENGINES], "eager", 300)
            if hf is not None:  # done before anything is timed on the eager servers
                hf.wait(timeout=max(30.0, run.left() - 60))
                if hf.returncode != 0 or not (WORK / "hf.json").is_file():
                    raise RuntimeError(f"HF reference failed (rc {hf.returncode}): "
                                       f"{(log_dir / 'hf.log').read_text()[-2000:]}")
                ref = json.loads((WORK / "hf.json").read_text())
                run.meta["hf_seconds"] = ref["seconds"]
                for engine, tf in a["tf"].items():
                    d = vs.logprob_diff([r["logprobs"] for r in tf], ref["logprobs"], engine + " vs HF")
                    for k in ("mean_abs", "p99_abs", "max_abs"):
                        run.add(engine, "agree_vs_hf_fp32", f"tf_logprob_{k}", d[k])
                run.write()
        finally:
            if hf is not None and hf.poll() is None:
                hf.kill()
        if state.get("eager"):
            from serve.bench.generate import read_requests, write_requests

            e = state["eager"]
            if "ours" in a["greedy"] and "ours" in e:
                agreement_rows(run, "agree_graphs_vs_eager", a["greedy"]["ours"],
                               vs.greedy(e["ours"], state["prompts"], AGREE_NEW))
            short = WORK / "decode_eager.jsonl"  # eager steps are slow: 64 streams x 256 tokens
            write_requests(short, [{**b, "max_tokens": 256} for b in read_requests(state["sets"]["decode"][0])[:64]])
            for mix, (path, conc) in (("decode_c1", state["sets"]["decode_c1"]), ("decode", (short, 64))):
                for engine, server in e.items():
                    summary = vs.replay(server, path, conc, WORK / f"replay_{mix}_eager_{engine}.json")
                    for metric in ("itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "output_tps", "score"):
                        run.add(engine, f"{mix}_eager", metric, vs.replay_metrics(summary)[metric])
            stop("eager")

    try:
        if not run.phase("ckpt", 60, ckpt):
            return 1
        if not {"agree", "longctx", "throughput"} <= skip or args.profile:
            if not run.phase("graphs", 240, graphs):
                return 1
            if "agree" not in skip:
                run.phase("agree", 10, agree)
            if "longctx" not in skip:
                run.phase("longctx", 60, longctx)
            save_answers()
            if "throughput" not in skip:
                run.phase("throughput", 90 if args.quick else 150, throughput)
            if args.profile:
                run.phase("profile", 60, profile)
            stop("graphs")
        if not {"eager", "hf"} <= skip:
            run.phase("eager+hf", 150, eager_and_hf)
    finally:  # results and logs first: a kill at the call's limit may leave no time for stopping the servers
        run.meta["seconds"] = round(time.perf_counter() - run.t0, 1)
        run.write()
        mirror.write()
        for s in state["servers"]:
            s.stop()
        mirror.close()
        run.write()
        print("\n" + table(run.rows), flush=True)
        run.log(f"done; phases {run.meta['phases']}, skipped {run.meta['skipped']}, errors {list(run.meta['errors'])}")
    return 0 if not run.meta["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
