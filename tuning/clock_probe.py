"""Does a 1x8192 prefill step's time follow the GPU clock? Per-step times with nvidia-smi samples.

Times single prefill steps of the standalone model (35B-A3B width, random weights, as ``bench_model``)
issued back to back and with an idle gap before each (the host sleeping, or spinning), while
``nvidia-smi`` samples the SM clock, power draw, temperature and the active clock-event (throttle)
reasons every 20 ms; then the host cost of the step layout right after a device synchronisation and
in a loop. Reports, never asserts.

    python -m tuning.clock_probe --out OUT [--layers 8] [--idle-ms 50]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("QWEN35_CHECK_VALUES", "0")

import torch  # noqa: E402

from tuning import _bench, bench_model  # noqa: E402

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def _series(step, n: int, idle_s: float, poll: bool = False) -> list[tuple[float, float]]:
    """(wall-clock start, ms) of ``n`` steps, each timed with CUDA events, ``idle_s`` of GPU idle before each.

    ``poll``: wait for each step by querying its end event in a loop (the host thread stays busy) instead of
    ``synchronize()``: if the host's first work after a wait is slow (a descheduled vCPU, cold caches), the
    start of the next step is slow in the one case and not in the other."""
    out = []
    for _ in range(n):
        if idle_s:
            end = time.perf_counter() + idle_s
            while poll and time.perf_counter() < end:
                pass
            if not poll:
                time.sleep(idle_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time()
        a.record()
        step()
        b.record()
        if poll:
            while not b.query():
                pass
        else:
            b.synchronize()
        out.append((t0, a.elapsed_time(b)))
    return out


def _samples(path: str) -> list[tuple[float, float, float, float, str]]:
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except ValueError:
            continue
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--idle-ms", type=float, default=50.0)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("clock_probe needs a CUDA device", file=sys.stderr)
        return 2
    log = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=log)
    try:
        ours = bench_model.build_ours_random(args.layers, max_seqs=8, max_len=8192 + 64)
        prompts = bench_model._prompts(1, 8192, 2)

        def step() -> None:
            bench_model.fresh_step(ours, prompts)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        idle = args.idle_ms / 1e3
        series = {"back to back": _series(step, args.steps, 0.0),
                  f"{args.idle_ms:g} ms idle before each": _series(step, args.steps, idle),
                  f"{args.idle_ms:g} ms idle before each, host polling": _series(step, args.steps, idle, poll=True),
                  "back to back, again": _series(step, args.steps, 0.0)}
        after_sync, loop = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            slots = ours.allocate(1)
            t = time.perf_counter()
            ours._layout(slots, prompts, False)
            after_sync.append(time.perf_counter() - t)
            ours.release(slots)
        slots = ours.allocate(1)
        for _ in range(20):
            t = time.perf_counter()
            ours._layout(slots, prompts, False)
            loop.append(time.perf_counter() - t)
        ours.release(slots)
        torch.cuda.synchronize()
        time.sleep(0.1)
    finally:
        smi.terminate()
        smi.wait()
        log.close()
    samples = _samples(log.name)
    os.unlink(log.name)
    rows = []
    for label, runs in series.items():
        ms = [m for _, m in runs]
        sel = [s for s in samples if runs[0][0] <= s[0] <= runs[-1][0] + 0.03]
        row = dict(series=label, steps=len(ms), median_ms=round(statistics.median(ms), 3), min_ms=round(min(ms), 3),
                   max_ms=round(max(ms), 3), tok_s=round(8192 / statistics.median(ms) * 1e3),
                   all_ms=[round(m, 2) for m in ms])
        if sel:
            clk, pw = [s[1] for s in sel], [s[2] for s in sel]
            row.update(sm_mhz_median=statistics.median(clk), sm_mhz_min=min(clk), sm_mhz_max=max(clk),
                       power_w_max=max(pw), temp_c_last=sel[-1][3], reasons=sorted({s[4] for s in sel}))
        rows.append(row)
        print(f"{label}: median {row['median_ms']} ms ({row['tok_s']} tok/s), min {row['min_ms']}, max {row['max_ms']};"
              f" SM MHz median {row.get('sm_mhz_median')}, reasons {row.get('reasons')}", flush=True)
    layout = dict(after_sync_us=round(statistics.median(after_sync) * 1e6),
                  loop_us=round(statistics.median(loop) * 1e6))
    print(f"step layout host time: {layout['after_sync_us']} us right after a sync, {layout['loop_us']} us in a loop")
    _bench.write_results(args.out, "model_clock_probe", rows, dict(layers=args.layers, idle_ms=args.idle_ms,
                                                                  layout_host=layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
