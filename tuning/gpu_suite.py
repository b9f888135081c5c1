"""The whole GPU suite in one call: probe report, GPU tests, benchmarks; JSON + a short table under --out.

    python -m tuning.gpu_suite --out $OUT            # everything
    python -m tuning.gpu_suite --out $OUT --only tests,gdn --quick
    python -m tuning.gpu_suite --out $OUT --budget 540 --part-args "gdn=--quick --fla-deadline 60"

Parts: ``probe`` (qwen35-probe --json), ``tests`` (pytest -m gpu), ``kernels`` (the Triton kernel test
modules, which run on the GPU when there is one: the interpreter cases of CI, compiled for real), ``gdn``,
``gdn_peers`` (ours beside FlashQLA and FLA's Triton path; its wheels must be on PYTHONPATH), ``moe``, ``model``,
``vision``, ``sm70`` (the benchmarks in tuning/bench_*.py). Each part runs in its own
subprocess so one crash does not lose the others; a part whose module is absent is reported as skipped. Writes
``suite.json`` (status + wall time per part), ``suite.log`` (every part's output), ``probe.json``
and each benchmark's own JSON; the status table is printed last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

PARTS = ("probe", "tests", "kernels", "gdn", "gdn_peers", "moe", "model", "vision", "sm70")


# GPU-marked tests live here; other test modules may import CPU-only stacks (vLLM) at collection.
GPU_TEST_PATHS = ("tests/gpu", "tests/test_standalone.py", "tests/test_strided_pools.py",
                  "tests/test_triton_attention.py", "tests/test_tune_gpu.py")
# Kernel test modules whose every case runs on CUDA when present (on CPU, in the interpreter); none imports vLLM.
# (test_triton_attention.py's unmarked cases are CPU-only; its GPU cases are gpu-marked, in GPU_TEST_PATHS.)
KERNEL_TEST_PATHS = ("tests/test_triton_gdn.py", "tests/test_gdn_cut.py", "tests/test_triton_moe.py",
                     "tests/test_triton_moe_down.py", "tests/test_triton_conv_norm.py",
                     "tests/test_triton_attn_glue.py", "tests/test_launch.py")


def _command(part: str, out: Path, quick: bool, extra: list[str]) -> list[str] | None:
    py = sys.executable
    if part == "probe":
        return [py, "-m", "qwen35.probe", "--json"]
    if part == "tests":
        return [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_PATHS, *extra]
    if part == "kernels":
        return [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TEST_PATHS, *extra]
    module = f"tuning.bench_{part}"
    if importlib.util.find_spec(module) is None:
        return None
    return [py, "-m", module, "--out", str(out)] + (["--quick"] if quick else []) + extra


def parse_part_args(items: list[str]) -> dict[str, list[str]]:
    """``["PART=ARGS", ...]`` -> {part: argv}; ARGS are split as a shell would (``"tests=-k 'gdn or moe'"`` keeps
    the expression whole; a plain ``str.split`` handed pytest ``or`` and ``moe`` as paths)."""
    extra = {}
    for item in items:
        name, eq, rest = item.partition("=")
        if name not in PARTS or not eq:
            raise ValueError(f"--part-args {item!r}: expected PART=ARGS with PART in {', '.join(PARTS)}")
        extra[name] = shlex.split(rest)
    return extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_suite", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for JSON results and logs")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="benchmarks run their reduced shape sets")
    ap.add_argument("--part-timeout", type=int, default=540, help="seconds per part before it is killed")
    ap.add_argument("--budget", type=int, default=None, help="seconds for the whole suite (later parts get the rest)")
    ap.add_argument("--part-args", nargs="*", default=[], metavar="PART=ARGS",
                    help='extra arguments for one part, e.g. "gdn=--quick --no-fla" "tests=-n 4 -k \'gdn or moe\'"')
    args = ap.parse_args(argv)
    try:
        extra = parse_part_args(args.part_args)
    except ValueError as e:
        ap.error(str(e))
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    summary = []
    for part in parts:
        cmd = _command(part, out, args.quick, extra.get(part, []))
        if cmd is None:
            summary.append({"part": part, "status": "skipped (module absent)", "seconds": 0.0})
            continue
        t0 = time.time()
        limit = args.part_timeout
        if args.budget is not None:
            limit = int(min(limit, args.budget - (t0 - start)))
            if limit < 10:
                summary.append({"part": part, "status": "skipped (suite budget spent)", "seconds": 0.0})
                continue
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            status, text = ("ok" if proc.returncode == 0 else f"exit {proc.returncode}"), proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            status = f"timeout after {limit}s"
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        secs = time.time() - t0
        if part == "probe" and status == "ok":
            (out / "probe.json").write_text(proc.stdout)
        else:
            with open(out / "suite.log", "a") as log:  # one log file: the device returns at most 8 files
                log.write(f"===== {part}: {status} in {secs:.0f}s\n{text}\n")
        tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] if text.strip() else [""]
        summary.append({"part": part, "status": status, "seconds": round(secs, 1), "last_line": tail[0][:160]})
        print(f"[gpu_suite] {part}: {status} in {secs:.0f}s", flush=True)
        if part != "probe":
            print(text[-6000:], flush=True)
    (out / "suite.json").write_text(json.dumps(summary, indent=1))
    table = "\n".join(f"{s['part']:<6} {s['status']:<28} {s['seconds']:>7.1f}s  {s.get('last_line', '')}"
                      for s in summary)
    print("\n" + table)
    return 0 if all(s["status"] in ("ok",) or s["status"].startswith("skipped") for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
