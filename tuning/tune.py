"""``qwen35-tune``: tune the Triton kernels' launch configs for one model on this GPU; per-device JSON configs.

    qwen35-tune --model 35b-a3b --tp 1 --dry-run                  # the plan: ops x buckets x candidates
    qwen35-tune --model 35b-a3b --tp 1 --budget-min 10            # tune into the user config directory
    qwen35-tune --model /ckpt/Qwen3.5-27B --tp 4 --ops gdn_chunk_scan,gdn_recurrent_step --out DIR

For every tunable op of the model (:mod:`tuning.tune_ops`: the GDN prefill's scan, the GDN decode step, the MoE
GEMM pair) and every token bucket, candidates from the kernel's declared search space are checked against the
reference, timed, and the fastest is written when it beats the op's heuristic (:mod:`tuning.tune_run`).
Files go to ``<out>/<device slug>/<op>.json`` (``--out`` defaults to the user config directory, which the kernels
read at first use, over the configs that ship in ``kernels_triton/configs``). Finished buckets are written at once:
Ctrl-C keeps them and a rerun skips them. ``--from-scratch`` starts every search from the heuristic alone (the
configs already in files are not seeds; their time is still reported as ``before_ms``). A rerun skips the buckets
already in the ``--out`` files (delete a file to tune its op again).

Bad input (unknown preset, op, dtype or backend, a malformed config.json, a TP that does not divide the heads) exits
with status 2 and one line naming the value and what is accepted; so does tuning without a GPU (``--dry-run``
works anywhere). Under ``TRITON_INTERPRET=1`` without a GPU it tunes on Triton's CPU interpreter, timed by wall
clock: for tests only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from kernels_triton import bench_api
from qwen35 import optable
from tuning import _bench
from tuning.tune_files import atomic_write_json, provenance
from tuning.tune_model import PRESETS, TPS, USUAL_TP, BadInput, RankShapes, load_model, shard
from tuning.tune_ops import ALIASES, BACKENDS, TUNABLES, UNTUNED, WarmPool
from tuning.tune_run import (
    SUMMARY_COLUMNS,
    ContextLost,
    Outcome,
    Task,
    geomean,
    geomean_speedup,
    run_tasks,
    summary_rows,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DECODE_BUCKETS = (1, 4, 16, 64, 256)  # decode batch rows (MoE: tokens)
PREFILL_BUCKETS = (1024, 4096, 16384)  # prefill tokens (GDN scan: tokens per sequence)
DEFAULT_BUDGET_MIN = 20.0
DEFAULT_JOBS = 8
NO_GPU = "tuning needs a GPU; --dry-run shows the plan"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (and exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="qwen35-tune", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True,
                    help=f"a preset ({', '.join(PRESETS)}), an HF config.json or a checkpoint directory")
    ap.add_argument("--tp", default="1", help=f"tensor-parallel size: {', '.join(map(str, TPS))} (default 1)")
    ap.add_argument("--dtype", default="bf16", help=f"activation dtype: {', '.join(DTYPES)} (default bf16)")
    ap.add_argument("--ops", default="all", help=f"comma-separated: {', '.join(TUNABLES)} (or the op-table and "
                    f"config-file names {', '.join(ALIASES)}); default all that the model has")
    ap.add_argument("--decode-buckets", default=",".join(map(str, DECODE_BUCKETS)),
                    help="decode batch sizes (GDN decode rows; MoE tokens)")
    ap.add_argument("--prefill-buckets", default=",".join(map(str, PREFILL_BUCKETS)),
                    help="prefill token counts (GDN scan: tokens per sequence; MoE tokens)")
    ap.add_argument("--backend", default="triton", help=f"kernel backend: {', '.join(BACKENDS)} (default triton)")
    ap.add_argument("--out", default=None, help="config root: files go to OUT/<device>/<op>.json "
                    "(default: the user config directory, QWEN35_CONFIG_DIR or ~/.cache/qwen35/configs)")
    ap.add_argument("--budget-min", type=float, default=DEFAULT_BUDGET_MIN,
                    help=f"minutes for the whole run (default {DEFAULT_BUDGET_MIN:g}); a rerun continues")
    ap.add_argument("--from-scratch", action="store_true",
                    help="ignore the configs in files (shipped or user): search from the heuristic alone")
    ap.add_argument("--jobs", default=None, help="processes that compile candidates ahead of timing (default: "
                    f"{DEFAULT_JOBS} on a GPU, at most half the CPU cores; 0 on the interpreter)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (ops x buckets x candidates) and exit")
    ap.add_argument("--summary", default=None, help="also write the final table as DIR/tune_<device>_<model>_tp<N>"
                    ".json and .md")
    return ap


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise BadInput(f"{flag} {text!r}: accepted a comma-separated list of positive integers") from None
    if not values or values[0] < 1:
        raise BadInput(f"{flag} {text!r}: accepted a comma-separated list of positive integers")
    return values


def _ops(text: str, rank: RankShapes) -> list[str]:
    names = list(TUNABLES) if text == "all" else [x.strip() for x in text.split(",") if x.strip()]
    chosen: list[str] = []
    for name in names:
        tunable = ALIASES.get(name, name)
        if tunable not in TUNABLES:
            if name in UNTUNED:
                raise BadInput(f"--ops {name}: takes no tuned config ({UNTUNED[name]}); accepted: "
                               f"{', '.join(TUNABLES)}")
            raise BadInput(f"--ops {name!r}: unknown op; accepted: {', '.join(TUNABLES)}, or the op-table and "
                           f"config-file names {', '.join(ALIASES)}")
        why = TUNABLES[tunable].applies(rank)
        if why and text != "all":
            raise BadInput(f"--ops {name}: nothing to tune: {why}; accepted for it: "
                           f"{', '.join(t for t in TUNABLES if not TUNABLES[t].applies(rank))}")
        if not why and tunable not in chosen:
            chosen.append(tunable)
    return chosen


def plan(args: argparse.Namespace) -> tuple[RankShapes, torch.dtype, list[Task], dict]:
    """(shapes, dtype, tasks, facts) from the command line; BadInput for any value that cannot be used."""
    if args.backend not in BACKENDS:
        raise BadInput(f"--backend {args.backend!r}: accepted {', '.join(BACKENDS)}")
    if BACKENDS[args.backend]:
        raise BadInput(f"--backend {args.backend}: not tunable ({BACKENDS[args.backend]}); accepted: triton")
    if args.dtype not in DTYPES:
        raise BadInput(f"--dtype {args.dtype!r}: accepted {', '.join(DTYPES)}")
    try:
        tp = int(args.tp)
    except ValueError:
        raise BadInput(f"--tp {args.tp!r}: accepted {', '.join(map(str, TPS))}") from None
    if not args.budget_min > 0:
        raise BadInput(f"--budget-min {args.budget_min:g}: accepted a positive number of minutes")
    if args.jobs is not None and not (args.jobs.isdigit() and int(args.jobs) <= 64):
        raise BadInput(f"--jobs {args.jobs!r}: accepted an integer from 0 to 64")
    name, cfg = load_model(args.model)
    rank = shard(name, cfg, tp)
    dtype = DTYPES[args.dtype]
    decode, prefill = _ints("--decode-buckets", args.decode_buckets), _ints("--prefill-buckets", args.prefill_buckets)
    device, limits, where = _device()
    tasks = []
    for op in _ops(args.ops, rank):
        tunable = TUNABLES[op]
        tasks += tunable.tasks(rank, dtype, tunable.buckets(decode, prefill), limits)
    return rank, dtype, tasks, {"device": device, "where": where, "limits": limits}


def _device() -> tuple[torch.device | None, bench_api.DeviceLimits, str]:
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(dev)
        return dev, bench_api.device_limits(dev), f"{torch.cuda.get_device_name(dev)} (sm_{major}{minor})"
    if os.environ.get("TRITON_INTERPRET") == "1":
        dev = torch.device("cpu")
        return dev, bench_api.device_limits(dev), "cpu (Triton interpreter, wall-clock timing: for tests)"
    return None, bench_api.SM90_LIMITS, ("no GPU here: candidate counts for an sm_90 device with "
                                         f"{bench_api.SM90_LIMITS.shared_memory} bytes of shared memory per block")


def out_root(args: argparse.Namespace) -> Path:
    return Path(args.out).expanduser() if args.out else bench_api.user_config_dir()


def print_plan(args: argparse.Namespace, rank: RankShapes, dtype: torch.dtype, tasks: list[Task], facts: dict,
               stream=None) -> None:  # noqa: ANN001 - a text stream, default stdout
    stream = stream or sys.stdout
    out = out_root(args)
    print(f"model {rank.model} at TP {rank.tp} ({args.dtype}): GDN H={rank.gdn_key_heads} HV={rank.gdn_value_heads} "
          f"K={rank.key_dim} V={rank.value_dim}" + (f"; MoE E={rank.experts} top-{rank.top_k} H={rank.hidden} "
                                                    f"I={rank.expert_width}" if rank.is_moe else "; dense MLP"),
          file=stream)
    print(f"device {facts['where']}", file=stream)
    print(f"backend triton; budget {args.budget_min:g} min; out {out}" + ("; from scratch" if args.from_scratch
                                                                          else ""), file=stream)
    rows = []
    for t in tasks:
        rows.append({"op": t.tunable, "files": ", ".join(f"{f}.json" for f in t.files), "shape": t.label,
                     "bucket": t.bucket, "kind": TUNABLES[t.tunable].bucket_kind, "candidates": t.size,
                     "note": t.note})
    print(_bench.format_table(rows, ["op", "files", "shape", "bucket", "kind", "candidates", "note"]), file=stream)
    print(f"{len(tasks)} buckets, {sum(t.size for t in tasks)} candidates in their spaces (the search tries "
          "the seeds, then steps from the best while it improves)", file=stream)
    untuned = [n for n in optable.NAMES if n not in ALIASES and n not in TUNABLES]
    print("not tuned (no config file; fixed launch rules): " + ", ".join(untuned) +
          "; the GDN prefill's prepare launch; the one-token MoE path", file=stream)
    print("backends: triton (tunable); " + "; ".join(f"{b} (not tunable: {why})" for b, why in BACKENDS.items()
                                                     if why), file=stream)


def write_summary(directory: Path, device_name: str, rank: RankShapes, rows: list[dict], meta: dict) -> Path:
    name = f"tune_{bench_api.device_slug(device_name)}_{bench_api.device_slug(rank.model)}_tp{rank.tp}"
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_json(directory / f"{name}.json", {"meta": meta, "rows": rows})
    table = _bench.format_table(rows, SUMMARY_COLUMNS)
    (directory / f"{name}.md").write_text(f"# {name}\n\n{json.dumps(meta, sort_keys=True)}\n\n```\n{table}\n```\n")
    return directory / f"{name}.json"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        rank, dtype, tasks, facts = plan(args)
    except BadInput as e:
        print(f"qwen35-tune: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_plan(args, rank, dtype, tasks, facts)
        return 0
    device = facts["device"]
    if device is None:
        print(f"qwen35-tune: error: {NO_GPU}", file=sys.stderr)
        return 2
    print_plan(args, rank, dtype, tasks, facts, stream=sys.stderr)
    prov = provenance(device, argv)
    outcomes: list[Outcome] = []
    status = 0
    jobs = int(args.jobs) if args.jobs is not None else (
        min(DEFAULT_JOBS, max(1, (os.cpu_count() or 2) // 2)) if device.type == "cuda" else 0)
    pool = WarmPool(jobs) if jobs else None
    try:
        run_tasks(tasks, device, out_root(args), args.budget_min * 60, args.from_scratch, prov, outcomes, warm=pool)
    except KeyboardInterrupt:
        print("\ninterrupted: the finished buckets are in their files; a rerun continues from there", file=sys.stderr)
        status = 130
    except ContextLost as e:
        print(f"\nqwen35-tune: a candidate left the CUDA context unusable ({e}); it is recorded and skipped from now "
              "on; the finished buckets are in their files: run again to continue", file=sys.stderr)
        status = 1
    finally:
        if pool is not None:
            pool.close()
    rows = summary_rows(outcomes)
    print(_bench.format_table(rows, SUMMARY_COLUMNS))
    gain = geomean_speedup(outcomes)
    if gain is not None:
        print(f"geomean speedup over the heuristic (buckets measured in this run): {gain:.3f}x")
    vs_before = [r["vs_before"] for r in rows if r["vs_before"]]
    if vs_before:
        print(f"against the configs in files before the run ({len(vs_before)} buckets): geomean "
              f"{geomean(vs_before):.3f}x, lowest {min(vs_before):.3f}x")
    if args.summary:
        meta = {**prov, "model": rank.model, "tp": rank.tp, "dtype": args.dtype, "budget_min": args.budget_min,
                "from_scratch": args.from_scratch, "geomean_speedup": gain, "usual_tp": USUAL_TP.get(rank.model),
                "geomean_vs_before": geomean(vs_before), "lowest_vs_before": min(vs_before, default=None)}
        print(f"wrote {write_summary(Path(args.summary), prov['device'], rank, rows, meta)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
