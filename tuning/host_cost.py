"""Host (Python) cost of one standalone-host step, per profiler range, on the CPU with kernel launches stubbed.

    python -m tuning.host_cost [--tokens 8192] [--decode 1,16] [--reps 7] [--layers 8] [--json PATH]

What runs: :class:`qwen35.standalone.Qwen35Standalone` with every op on the Triton backend (the probe's
choice registered for the CPU device, as ``QWEN35_BACKEND=triton`` does on a GPU), the same layer structure as
``tuning/bench_model.py`` (every 4th layer full attention, MoE with 256 experts top-8 and a shared expert) but
a tiny width, so the torch work that is real CPU compute here (projections, embedding, rotary, copies) stays
small. Everything above the device runs as on the GPU machine: the step layout, the façade's checks, the
Triton wrappers' argument preparation, allocations, views. What is left out:

- kernel launches: ``DirectLauncher.__call__`` and ``JITFunction.run`` (every ``kernel[grid](...)``) are
  no-ops that count themselves per range (the H200 host spends roughly 20-30 us per direct launch and
  45-50 us per JIT launch, see ``kernels_triton/_launch.py``);
- SDPA (full-attention prefill) returns an empty tensor of its output's shape (its CPU math would dominate).

Timed ranges are the profiler ranges of ``tuning/profile_model.py`` (``install_ranges``: every façade op,
projection, attention, MLP, layer and the step layout), each reported as self time (its children's ranges taken
out), median of ``--reps`` steps, microseconds of this thread's CPU time (other processes on a shared CPU do not count).
Numbers come from this CPU: the H200 machine's host ran ~3.5x slower.
Projection ranges are real CPU matmuls at a tiny width: they say nothing about the GPU host; the total
without them is printed too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from tuning import bench_model, profile_model

WIDTH = dict(bench_model.WIDTH, vocab_size=1024, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, moe_intermediate_size=16, shared_expert_intermediate_size=16)
DEVICE = torch.device("cpu")
# This thread's CPU time, not wall time: on a shared CPU the wall clock also counts the time other processes hold
# the core, which is noise for what is measured here (the host has no device to wait for: launches are stubbed).
_now = time.thread_time


class _Clock:
    """Self time and launch counts per range; stands in for ``torch.profiler.record_function``."""

    def __init__(self) -> None:
        self.stack: list[list] = []  # [name, start, time spent in child ranges]
        self.self_us: dict[str, float] = defaultdict(float)
        self.launches: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # range -> [direct, jit]

    @contextlib.contextmanager
    def record_function(self, name: str):
        entry = [name[len(profile_model.RANGE):] if name.startswith(profile_model.RANGE) else name, 0.0, 0.0]
        self.stack.append(entry)
        entry[1] = _now()
        try:
            yield
        finally:
            spent = _now() - entry[1]
            self.stack.pop()
            self.self_us[entry[0]] += (spent - entry[2]) * 1e6
            if self.stack:
                self.stack[-1][2] += spent

    def launch(self, kind: int) -> None:
        self.launches[self.stack[-1][0] if self.stack else "outside any range"][kind] += 1

    def reset(self) -> None:
        self.self_us.clear()
        self.launches.clear()


@contextlib.contextmanager
def _stub_device_work(clock: _Clock):
    """Inside: kernel launches and SDPA are no-ops (launches counted); the probe runs every op on Triton."""
    import kernels_triton
    from kernels_triton.bench_api import launches_stubbed
    from qwen35 import backends, probe, standalone

    def sdpa(q, k, v, **kw):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    standalone.F = type("F", (), {"scaled_dot_product_attention": staticmethod(sdpa)})
    key = probe._device_key(DEVICE)
    for op in backends.OPS:
        fn = getattr(kernels_triton, op)
        probe._remember((op, key), probe.Choice(op, key, "triton", "tuning.host_cost: forced, launches stubbed"), fn)
    with launches_stubbed(lambda kind: clock.launch(0 if kind == "direct" else 1)):
        yield


def _build(layers: int, max_seqs: int, max_len: int):
    from qwen35.config import Qwen35Config
    from qwen35.standalone import Qwen35Standalone

    fields = bench_model.hf_config_fields(layers)
    fields.update(WIDTH)
    cfg = Qwen35Config.from_dict({"architectures": ["Qwen3_5MoeForCausalLM"], **fields})
    ours = Qwen35Standalone(cfg, device=DEVICE, dtype=torch.bfloat16, max_seqs=max_seqs, max_len=max_len)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return ours


def _measure(clock: _Clock, fn, reps: int) -> dict:
    """Median self µs per range over ``reps`` calls of ``fn`` (after two warm-up calls), launches per call."""
    for _ in range(2):
        fn()
    per_range: dict[str, list[float]] = defaultdict(list)
    walls, launches = [], {}
    for _ in range(reps):
        clock.reset()
        t = _now()
        with clock.record_function("step"):
            fn()
        walls.append((_now() - t) * 1e6)
        for name, us in clock.self_us.items():
            per_range[name].append(us)
        launches = {k: tuple(v) for k, v in clock.launches.items()}
    med = {k: statistics.median(v + [0.0] * (reps - len(v))) for k, v in per_range.items()}
    proj = sum(v for k, v in med.items() if k.startswith("proj:"))
    return dict(step_us=round(statistics.median(walls), 1), without_projections_us=round(statistics.median(walls)
                - proj, 1), ranges_us={k: round(v, 1) for k, v in sorted(med.items(), key=lambda kv: -kv[1])},
                launches={k: dict(direct=d, jit=j) for k, (d, j) in sorted(launches.items())})


def _print(title: str, r: dict) -> None:
    d = sum(v["direct"] for v in r["launches"].values())
    j = sum(v["jit"] for v in r["launches"].values())
    print(f"\n== {title}: step {r['step_us']:.0f} us host (without projections {r['without_projections_us']:.0f} us); "
          f"launches stubbed: {d} direct, {j} through the JIT")
    for name, us in r["ranges_us"].items():
        n = r["launches"].get(name)
        extra = f"   launches {n['direct']} direct / {n['jit']} jit" if n else ""
        print(f"   {name:<32} {us:9.1f} us{extra}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="host_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,512", help="prefill: one prompt of each of these lengths (comma "
                    "separated); torch ops do real CPU work in proportion to the tokens (the layer ranges' self time "
                    "at 8192 is mostly that), 512 takes the same code path with little of it")
    ap.add_argument("--decode", default="1,16", help="eager decode batch sizes (comma separated, '' for none)")
    ap.add_argument("--ctx", type=int, default=4096, help="tokens each decode sequence already holds")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    os.environ["QWEN35_CHECK_VALUES"] = "0"  # as bench_model on the GPU (there the host-built steps skip them too)
    clock = _Clock()
    torch.profiler.record_function = clock.record_function  # bench_model's ranges open through this name
    with _stub_device_work(clock):
        decodes = [int(b) for b in args.decode.split(",") if b]
        lengths = [int(t) for t in args.tokens.split(",") if t]
        ours = _build(args.layers, max_seqs=max(decodes + [1]), max_len=max(lengths + [args.ctx + 8]))
        profile_model.install_ranges(ours)
        torch.set_num_threads(1)  # the host work is single-threaded; tiny ops on a shared box stall in thread pools
        out = {}
        for T in lengths:
            prompt = torch.randint(0, WIDTH["vocab_size"], (T,), generator=torch.Generator().manual_seed(1)).tolist()

            def prefill(prompt=prompt):
                slots = ours.allocate(1)
                try:
                    ours.step(slots, [prompt])
                finally:
                    ours.release(slots)

            key = f"prefill 1x{T}"
            out[key] = _measure(clock, prefill, args.reps)
            _print(key, out[key])
        for B in decodes:
            slots = ours.allocate(B)
            steps = [[1] for _ in range(B)]

            def decode(slots=slots, steps=steps):
                for s in slots:
                    ours.lengths[s] = args.ctx
                ours.step(slots, steps)

            key = f"decode eager B={B} ctx={args.ctx}"
            out[key] = _measure(clock, decode, args.reps)
            ours.release(slots)
            _print(key, out[key])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(width=WIDTH, layers=args.layers, reps=args.reps, results=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
