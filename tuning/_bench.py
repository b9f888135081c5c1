"""Shared benchmark plumbing: GPU timing (events, CUDA graphs), ceilings, result rows, tables, JSON.

Benchmarks report; they never assert times. Every result row is a flat dict with at least
``device, op, shape, dtype, ours_ms, anchor, anchor_ms, speedup`` (anchor fields may be None).
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_CEILINGS: dict[str, float] = {}


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def time_ms(fn: Callable[[], object], *, warmup: int = 5, rep: int = 30, idle_s: float = 0.0) -> float:
    """Median wall time of ``fn`` in ms, timed with CUDA events per call (host overhead included).

    ``idle_s``: the GPU idles that long before each timed call (not counted), as before a request that reaches
    an idle server. Calls of tens of ms issued back to back hold an H200 at its power cap (SM clock ~1815
    instead of 1980 MHz, throttle reason SW power cap; tuning/notes_model.md), which a single call from an idle GPU
    does not meet.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        if idle_s:
            time.sleep(idle_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph_ms(fn: Callable[[], object], *, calls_per_graph: int = 20, rep: int = 20) -> float:
    """GPU time of one ``fn`` call in ms, measured by replaying a CUDA graph of ``calls_per_graph`` calls.

    Launch gaps vanish, so this is the number for decode-sized work. ``fn`` must be capturable
    (no host sync, static shapes); it is run a few times eagerly first (compiles kernels).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_graph)
    return statistics.median(times)


def host_us_per_call(fn: Callable[[], object], calls: int = 200, rounds: int = 5) -> float:
    """CPU wall time per call of back-to-back launches (no sync inside): the host cost when the GPU keeps up.

    The median over ``rounds`` rounds of ``calls`` calls each (the GPU drained between rounds): a pause of the
    (virtualised) host of a few ms inside a round moves that round's mean by tens of µs, and no longer the figure
    (one mean of 60 µs was seen where the same code took 29-41 µs in other rounds)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        per_round.append((t1 - t0) / calls * 1e6)
    return statistics.median(per_round)


def ceilings() -> dict[str, float]:
    """Measured once per process: device copy bandwidth (bytes read + written, GB/s) and bf16 matmul TFLOP/s."""
    if _CEILINGS:
        return _CEILINGS
    n = 1 << 30  # 1 GiB source: far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, rep=10)
    _CEILINGS["copy_GBps"] = 2 * n / ms / 1e6
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=3, rep=10)
    _CEILINGS["bf16_TFLOPs"] = 2 * m**3 / ms / 1e9
    return _CEILINGS


def row(op: str, shape: str, dtype: str, ours_ms: float, anchor: str | None = None, anchor_ms: float | None = None,
        **extra: object) -> dict:
    """One result row; ``speedup`` = anchor_ms / ours_ms (> 1 means we are faster)."""
    r = {"device": device_name(), "op": op, "shape": shape, "dtype": dtype, "ours_ms": round(ours_ms, 5),
         "anchor": anchor, "anchor_ms": None if anchor_ms is None else round(anchor_ms, 5),
         "speedup": None if anchor_ms is None else round(anchor_ms / ours_ms, 3)}
    r.update(extra)
    return r


def format_table(rows: Iterable[dict], columns: list[str]) -> str:
    rows = list(rows)

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    widths = [max(len(c), *(len(cell(r.get(c))) for r in rows)) if rows else len(c) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def write_results(out_dir: str | Path, name: str, rows: list[dict], meta: dict | None = None) -> Path:
    """Write ``{name}.json`` (meta + rows) under ``out_dir``; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "device": device_name(), "date": _dt.date.today().isoformat(),
           "torch": torch.__version__, "meta": meta or {}, "rows": rows}
    try:
        import triton

        doc["triton"] = triton.__version__
    except ImportError:
        pass
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path
