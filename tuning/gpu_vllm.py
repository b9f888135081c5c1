"""Our plugin against vLLM's native Qwen3.5-MoE class on one GPU: agreement, throughput, start-up, decode ITL.

    python -m tuning.gpu_vllm --out $OUT                 # the whole comparison, <= --budget seconds (540)
    python -m tuning.gpu_vllm --out $OUT --profile       # plus a torch-profiler window per engine
    python -m tuning.gpu_vllm --out $OUT --quick         # smaller request sets

Needs vLLM 0.26 (``scripts/vllm_gpu_install.sh``; ``PYTHONPATH=/tmp/site:$PWD``). Phases, each skipped (and said
so) when the budget cannot hold it:

1. ``ckpt``: a random-weight checkpoint of Qwen3.5-35B-A3B width with ``--layers`` layers
   (:mod:`tuning.vllm_ckpt`: transformers' ``Qwen3_5MoeConfig``, hub layout, padded embedded tokenizer).
2. ``start``: ``vllm serve`` for ``ours`` (``VLLM_PLUGINS=qwen35``) and ``native`` (no plugin) at once, with the same
   arguments (:data:`SERVER_ARGS`: prefix caching, 16384-token chunks, a fixed KV cache so that two servers share
   the GPU, the default cudagraph mode: full graphs for uniform decode batches). Start-up seconds are rows.
3. ``agree``: 32 prompts (64-512 tokens of learned BPE ids): teacher-forced log-probs (``prompt_logprobs``) and the
   engines' top-1 at each position; greedy 32 x 64 tokens (EOS ignored): token match rate, common-prefix rate, and
   the log-prob gap at each first divergence (a near-tie when small).
4. ``throughput``: ``qwen35-bench replay`` (EOS ignored) of fixed synthetic sets: ``prefill`` (prompts 2k-16k tokens,
   64 out, concurrency 16), ``decode`` (prompts 256, 512 out, concurrency 64), ``mixed`` (``qwen35-bench
   generate``'s default production-like mix, concurrency 32) and ``decode_c1`` (one stream). Output / Input / Cache
   TPS, score = 0.83 / 0.14 / 0.03 of them, TTFT / ITL / TPOT p50 and p99.
5. ``eager``: both engines again with ``--enforce-eager``: decode ITL without CUDA graphs (``decode_eager``,
   ``decode_c1_eager``), and ours' greedy tokens with graphs against without.
6. ``hf``: transformers' fp32 model on the same weights (alongside step 5's start-up, in a subprocess):
   teacher-forced log-probs of both engines against it.
7. ``profile`` (``--profile``): the step-2 servers carry a torch profiler; one decode window (16 streams x 64
   tokens) and one prefill window (2 x 8192 tokens) per engine: GPU time per kernel category and top kernels.

Writes ``gpu_vllm.json`` (``meta`` and ``rows`` of ``device, engine, mix, metric, value``; rewritten after every
phase), ``gpu_vllm.txt`` (the table) and ``server_logs.txt`` (the tail of every server log) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tuning import vllm_serving as vs

KV_CACHE_BYTES = 24 << 30
GPU_UTIL = 0.35  # only vLLM's start-up check of free memory: the KV cache size is fixed above
SERVER_ARGS = ["--dtype", "bfloat16", "--max-model-len", "32768", "--max-num-seqs", "128",
               "--max-num-batched-tokens", "16384", "--enable-prefix-caching", "--language-model-only",
               "--gdn-prefill-backend", "triton", "--enable-prompt-tokens-details", "--enable-auto-tool-choice",
               "--tool-call-parser", "qwen3_coder", "--seed", "0", "--disable-uvicorn-access-log"]
AGREE_PROMPTS, AGREE_NEW = 32, 64
WORK = Path("/tmp/gpu_vllm")  # checkpoint, request sets, logs (kept for a follow-up run on the same machine)
# server log lines kept in the results: what each engine chose for graphs, compilation and its kernels
NOTES = r"cudagraph|CUDAGraph|CUDA graph|[Aa]ttention backend|GDN prefill|MoE backend|torch.compile|[Gg]raph capturing"


class Run:
    """Rows, meta and the deadline of one comparison run; results are rewritten after every phase."""

    def __init__(self, out: Path, budget: float, device: str) -> None:
        self.out, self.t0, self.deadline, self.device = out, time.perf_counter(), time.perf_counter() + budget, device
        self.rows: list[dict] = []
        self.meta: dict = {"phases": {}, "skipped": {}, "errors": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[gpu_vllm {time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def add(self, engine: str, mix: str, metric: str, value: float) -> None:
        value = float(value)
        self.rows.append({"device": self.device, "engine": engine, "mix": mix, "metric": metric,
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


# ----------------------------------------------------------------------------- phases


def agreement_rows(run: Run, name: str, a: list[dict], b: list[dict] | None, tf_a=None, tf_b=None) -> None:
    """Rows comparing engine results ``a`` with ``b`` (greedy) and ``tf_a`` with ``tf_b`` (teacher-forced)."""
    if tf_a is not None and tf_b is not None:
        d = vs.logprob_diff([r["logprobs"] for r in tf_a], [r["logprobs"] for r in tf_b], name)
        for k in ("mean_abs", "p99_abs", "max_abs"):
            run.add("ours", name, f"tf_logprob_{k}", d[k])
        run.add("ours", name, "tf_top1_agreement", vs.top1_agreement(tf_a, tf_b))
    if a is not None and b is not None:
        g = vs.greedy_agreement(a, b)
        for k, v in g.items():
            run.add("ours", name, f"greedy_{k}", v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tuning.gpu_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="smaller request sets")
    ap.add_argument("--profile", action="store_true", help="torch-profiler windows (decode, prefill) per engine")
    ap.add_argument("--skip", default="", help="comma-separated phases to leave out: agree,throughput,eager,hf "
                    "(skipping agree and throughput starts no graph servers; hf then compares the answers an earlier "
                    "run saved)")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"agree", "throughput", "eager", "hf"}
    if unknown:
        ap.error(f"--skip {sorted(unknown)}: accepted agree, throughput, eager, hf")

    import torch
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    run = Run(args.out, args.budget, device)
    run.meta.update(vllm=vllm.__version__, torch=torch.__version__, layers=args.layers, quick=args.quick,
                    server_args=SERVER_ARGS, kv_cache_bytes=KV_CACHE_BYTES, argv=sys.argv[1:])
    run.log(f"vLLM {vllm.__version__}, torch {torch.__version__}, {device}, budget {args.budget:.0f} s")
    WORK.mkdir(parents=True, exist_ok=True)
    state: dict = {"servers": []}
    log_dir = WORK / "logs"

    def ckpt() -> None:
        from tuning.vllm_ckpt import write_checkpoint

        t = time.perf_counter()
        state["ckpt"] = write_checkpoint(WORK / "ckpt", layers=args.layers)
        run.meta["checkpoint"] = {"path": str(state["ckpt"]), "seconds": round(time.perf_counter() - t, 1),
                                  "done": (state["ckpt"] / "DONE").read_text().strip()}
        state["sets"] = request_sets(state["ckpt"], WORK, args.quick)
        state["prompts"] = agreement_prompts()

    def start(mode: str, extra: list[str]) -> None:
        servers = []
        for engine in vs.ENGINES:
            more = list(extra)
            if args.profile and mode == "graphs":
                pdir = WORK / f"profile_{engine}"
                more += ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(pdir),
                                                          "torch_profiler_with_stack": False})]
            servers.append(vs.start_server(f"{engine}_{mode}", engine, str(state["ckpt"]),
                                           SERVER_ARGS + ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                                                          "--gpu-memory-utilization", str(GPU_UTIL)] + more, log_dir))
        state["servers"] += servers
        failed = vs.wait_ready(servers, deadline=min(run.deadline - 60, time.perf_counter() + 420),
                               raise_on_failure=False)
        for s in servers:
            if s.ready_s is not None:
                run.add(s.engine, mode, "startup_s", s.ready_s)
                run.log(f"{s.name} up in {s.ready_s:.1f} s")
            run.meta.setdefault("server_notes", {})[s.name] = s.log_lines(NOTES)[-10:]
        state[mode] = {s.engine: s for s in servers if s.ready_s is not None}  # the rest: one engine still runs
        for s in state[mode].values():  # warm-up: kernels for the first real shapes, not timed
            vs.replay(s, state["sets"]["decode_c1"][0], 1, WORK / f"warm_{s.name}.json")
        if failed:
            raise RuntimeError("; ".join(failed.values()))

    def agree() -> None:
        g = state["graphs"]
        tf = {e: vs.teacher_forced(g[e], state["prompts"]) for e in vs.ENGINES}
        gr = {e: vs.greedy(g[e], state["prompts"], AGREE_NEW) for e in vs.ENGINES}
        state["tf"], state["greedy"] = tf, gr
        agreement_rows(run, "agree_ours_vs_native", gr["ours"], gr["native"], tf["ours"], tf["native"])
        (WORK / "agree.json").write_text(json.dumps({"prompts": state["prompts"], "tf": tf, "greedy": gr}))

    def throughput() -> None:
        for mix in ("decode_c1", "decode", "prefill", "mixed"):
            path, conc = state["sets"][mix]
            for engine, server in state["graphs"].items():
                summary = vs.replay(server, path, conc, WORK / f"replay_{mix}_{engine}.json")
                for metric, value in vs.replay_metrics(summary).items():
                    run.add(engine, mix, metric, value)
                run.log(f"{mix:<10} {engine:<6} score {summary['score']:10.1f}  out {summary['tps']['output']:9.1f}"
                        f"  in {summary['tps']['input']:10.1f} tok/s  failed {summary['failed']}")

    def profile() -> None:
        from serve.bench.generate import read_requests

        for engine, s in state["graphs"].items():
            pdir = WORK / f"profile_{engine}"
            decode = read_requests(state["sets"]["decode"][0])[:16]
            prefill = [b for b in read_requests(state["sets"]["prefill"][0])][:2]
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
        hf = None
        if "hf" not in skip and "tf" in state:  # the fp32 reference loads while the eager servers start
            job = WORK / "hf_job.json"
            job.write_text(json.dumps({"ckpt": str(state["ckpt"]), "prompts": state["prompts"]}))
            hf = subprocess.Popen([sys.executable, "-m", "tuning.gpu_vllm_hf", str(job), str(WORK / "hf.json")],
                                  stdout=open(WORK / "logs" / "hf.log", "w"), stderr=subprocess.STDOUT,
                                  env=vs.engine_env("native"), cwd=str(Path(__file__).resolve().parent.parent))
        try:
            if "eager" not in skip:
                try:
                    start("eager", ["--enforce-eager"])
                except RuntimeError as err:  # one engine did not start: the other is still measured
                    run.meta["errors"]["eager_start"] = str(err)[-3000:]
            if hf is not None:  # done before anything is timed on the eager servers
                hf.wait(timeout=max(30.0, run.left() - 60))
                if hf.returncode != 0 or not (WORK / "hf.json").is_file():
                    raise RuntimeError(f"HF reference failed (rc {hf.returncode}): "
                                       f"{(WORK / 'logs' / 'hf.log').read_text()[-2000:]}")
                ref = json.loads((WORK / "hf.json").read_text())
                run.meta["hf_seconds"] = ref["seconds"]
                for engine in vs.ENGINES:
                    d = vs.logprob_diff([r["logprobs"] for r in state["tf"][engine]], ref["logprobs"],
                                        engine + " vs HF")
                    for k in ("mean_abs", "p99_abs", "max_abs"):
                        run.add(engine, "agree_vs_hf_fp32", f"tf_logprob_{k}", d[k])
                run.write()
        finally:
            if hf is not None and hf.poll() is None:
                hf.kill()
        if "eager" not in skip and state.get("eager"):
            from serve.bench.generate import read_requests, write_requests

            e = state["eager"]
            if "greedy" in state and "ours" in e:
                ours_eager = vs.greedy(e["ours"], state["prompts"], AGREE_NEW)
                agreement_rows(run, "agree_graphs_vs_eager", state["greedy"]["ours"], ours_eager)
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
        if not {"agree", "throughput"} <= skip or args.profile:
            run.phase("start", 150, lambda: start("graphs", []))
            if not state.get("graphs"):
                return 1
        elif (WORK / "agree.json").is_file():  # a follow-up run: the graph servers' answers of an earlier one
            saved = json.loads((WORK / "agree.json").read_text())
            if saved["prompts"] == state["prompts"]:
                state["tf"], state["greedy"] = saved["tf"], saved["greedy"]
                run.meta["agree_from"] = str(WORK / "agree.json")
        if "agree" not in skip and len(state.get("graphs", {})) == 2:
            run.phase("agree", 30, agree)
        if "throughput" not in skip:
            run.phase("throughput", 90 if args.quick else 150, throughput)
        if args.profile:
            run.phase("profile", 60, profile)
        stop("graphs")
        if not ({"eager", "hf"} <= skip):
            run.phase("eager+hf", 100, eager_and_hf)
    finally:
        for s in state["servers"]:
            s.stop()
        with open(args.out / "server_logs.txt", "w") as f:
            for s in state["servers"]:
                f.write(f"===== {s.name} ({' '.join(s.argv[3:])})\n{s.log_tail(150)}\n")
        run.meta["seconds"] = round(time.perf_counter() - run.t0, 1)
        run.write()
        print("\n" + table(run.rows), flush=True)
        run.log(f"done; phases {run.meta['phases']}, skipped {run.meta['skipped']}, errors {list(run.meta['errors'])}")
    return 0 if not run.meta["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
