"""MoE benchmark: Triton ``kernels_triton.moe`` vs a ``torch._grouped_mm`` pipeline vs the roofline.

    python -m tuning.bench_moe --out DIR [--quick]           # benchmark -> DIR/moe_<device>.json

Launch configs are tuned by ``qwen35-tune`` (:mod:`tuning.tune`), not here.

What is timed: the routed part of a Qwen3.5 MoE block, routing included (router GEMM, softmax /
top-k / renormalise, then the experts and the weighted top-k sum), bf16. Ours is one
``moe_block`` call without a shared expert (``ours_shared_ms`` adds the gated shared expert);
the anchor is torch: fp32 router logits, softmax, topk, renormalise, stable sort by expert,
``torch._grouped_mm`` (gate_up), silu*mul, ``torch._grouped_mm`` (down), weight, ``index_add_``.
M <= 256 is timed by replaying a CUDA graph (launch gaps vanish), larger M with events (host work
included); ``gpu_ms`` is the graph-replayed time at every M and ``host_us`` the host time of one
eager call (enqueue time of back-to-back calls), so events time ~ max(gpu, host) shows which bounds it.
Where a row is timed with events, ``anchor_gpu_ms`` is the anchor's graph-replayed time and ``speedup_gpu`` the
ratio of the two GPU times (the events rows include each call's host latency from an idle GPU: with ~0.2 ms of
host work before the expert GEMMs on a slow host, that is most of the gap at 1024 tokens).

Roofline: ``mem_floor_ms`` = bytes of the experts the routing actually picked (3*I*H each) plus
the router, over the measured copy bandwidth; ``flop_floor_ms`` = 6*M*k*H*I + 2*M*E*H FLOP over the
measured bf16 matmul rate. ``x_mem_floor`` = ours / mem floor (target <= 1.5 for M <= 16);
``TFLOPs`` counts the expert FLOPs only (target >= 400 for M >= 4096).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from tuning import _bench

DEVICE = "cuda"
SHAPES = {  # name: (E, k, H, I)
    "35B-A3B": (256, 8, 2048, 512),
    "122B-A10B": (256, 8, 3072, 1024),
    "397B-A17B-TP4": (512, 10, 4096, 256),
    "397B-A17B-TP8": (512, 10, 4096, 128),
}
MS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
QUICK_SHAPES, QUICK_MS = ("35B-A3B", "397B-A17B-TP8"), (1, 16, 1024, 16384)
GRAPH_MAX_M = 256
BREAKDOWN_MS = (1, 16, 1024, 4096, 8192, 16384)
SHARED_BREAKDOWN_MAX_M = 16


# ----------------------------------------------------------------------------- the two pipelines


def torch_pipeline(x, router_weight, w13, w2, top_k):  # noqa: ANN001, ANN201
    """Routed MoE with torch ops only: sort by expert -> grouped GEMM -> silu*mul -> grouped GEMM -> scatter."""
    M, H = x.shape
    E = w13.shape[0]
    probs = torch.softmax(F.linear(x.float(), router_weight.float()), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // top_k
    gate_up = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y.float() * weights.flatten()[order, None]
    return torch.zeros(M, H, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)


def ours(x, router_weight, w13, w2, top_k, shared=None):  # noqa: ANN001, ANN201
    import kernels_triton as kt

    kw = {} if shared is None else dict(shared_w13=shared[0], shared_w2=shared[1], shared_gate_weight=shared[2])
    return kt.moe_block(x, router_weight, w13, w2, top_k, **kw)


def _time(fn, M: int) -> tuple[float, str]:  # noqa: ANN001
    if M <= GRAPH_MAX_M:
        try:
            return _bench.time_graph_ms(fn), "graph"
        except Exception as e:  # noqa: BLE001 - fall back to events, and say so
            print(f"  graph capture failed ({type(e).__name__}: {str(e)[:120]}); timing with events", flush=True)
            torch.cuda.synchronize()
    return _bench.time_ms(fn), "events"


def _gpu_ms(fn, M: int) -> float:  # noqa: ANN001
    """GPU time alone (CUDA-graph replay, at every M): with events time, it separates host from device work."""
    try:
        return _bench.time_graph_ms(fn, calls_per_graph=20 if M <= GRAPH_MAX_M else 4, rep=10)
    except Exception as e:  # noqa: BLE001 - report, don't fail the row
        print(f"  graph timing failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
        torch.cuda.synchronize()
        return math.nan


def _host_us_binder(fn) -> float:  # noqa: ANN001
    """``host_us`` with every launch through ``JITFunction.run`` (DirectLauncher off): what the direct path saves."""
    from kernels_triton.bench_api import jit_launches

    with jit_launches():
        return _bench.host_us_per_call(fn, calls=50)


def _weights(E: int, H: int, I: int, dtype=torch.bfloat16, seed: int = 0) -> dict:  # noqa: ANN001
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*s, scale):
        return (torch.randn(*s, generator=gen, device=DEVICE) * scale).to(dtype)

    return dict(router_weight=rnd(E, H, scale=H**-0.5 * 4), w13=rnd(E, 2 * I, H, scale=H**-0.5),
                w2=rnd(E, H, I, scale=I**-0.5), shared=(rnd(2 * I, H, scale=H**-0.5), rnd(H, I, scale=I**-0.5),
                                                         rnd(1, H, scale=H**-0.5)))


def _x(M: int, H: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed + M)
    return torch.randn(M, H, generator=gen, device=DEVICE).to(torch.bfloat16)


def _routing(x, w, top_k):  # noqa: ANN001, ANN202
    from kernels_triton.moe import bench_api as moe

    logits, n_splits = moe.router_logits(x, w["router_weight"], None)
    return moe.route(logits, top_k, True, n_splits=n_splits)


def _stage_ms(x, w, top_k, with_shared: bool = False) -> dict:  # noqa: ANN001
    """Each launch group of ours (as moe_block runs them) timed alone on its real inputs: where the GPU time goes.

    Timed by graph replay at every M, so host work is not in these numbers (it is in ``host_us``). One token: the
    decode path's router GEMV that also routes (no alignment) in ``router_gemm`` (``route_align`` 0), its down GEMV
    (the combine fused, ``combine`` 0).
    ``with_shared``: the fused shared expert (its gate as one more router column, one more group).
    """
    from kernels_triton.moe import bench_api as moe

    M, H = x.shape
    E, I = w["w13"].shape[0], w["w2"].shape[2]
    sw13, sw2, gate = w["shared"] if with_shared else (None, None, None)
    slots = top_k + int(with_shared)
    if M == 1 and moe.decode_path_enabled():  # one token: the decode path's launches (kernels_triton/moe/decode.py)
        cfg = moe.decode_config(H, I)

        def route():  # noqa: ANN202
            return moe.route_one(x, w["router_weight"], top_k, True, n_local=E, expert_map=None, gate_weight=gate,
                                    shared=with_shared)

        groups, weights = route()
        h = moe.gate_up_one(x, w["w13"], sw13, groups, cfg)
        stages = {
            "router_gemm": route,  # the router GEMV whose last program routes
            "gate_up": lambda: moe.gate_up_one(x, w["w13"], sw13, groups, cfg),
            "down": lambda: moe.down_one(h, w["w2"], sw2, groups, weights, cfg),
        }
        ms = {name: round(_gpu_ms(fn, M), 5) for name, fn in stages.items()}
        return {"router_gemm": ms["router_gemm"], "route_align": 0.0, "gate_up": ms["gate_up"], "down": ms["down"],
                "combine": 0.0}
    logits, n_splits = moe.router_logits(x, w["router_weight"], gate)
    up_cfg, down_cfg = moe.configs(M, top_k, E, H, I, x.dtype, x.device)

    def route_align():  # noqa: ANN202
        return moe.route_and_align(logits, n_splits, top_k, True, n_experts=E, n_local=E, block_m=up_cfg.BLOCK_M,
                                     expert_map=None, gate=with_shared, shared=with_shared)

    weights, _, al = route_align()
    h = moe.gate_up(x, w["w13"], sw13, al, slots, up_cfg)
    y = moe.down(h, w["w2"], sw2, al, weights, down_cfg)
    stages = {
        "router_gemm": lambda: moe.router_logits(x, w["router_weight"], gate),
        "route_align": route_align,
        "gate_up": lambda: moe.gate_up(x, w["w13"], sw13, al, slots, up_cfg),
        "down": lambda: moe.down(h, w["w2"], sw2, al, weights, down_cfg),
        "combine": lambda: moe.combine(y, al, M, slots),
    }
    return {name: round(_gpu_ms(fn, M), 5) for name, fn in stages.items()}


# ----------------------------------------------------------------------------- benchmark


def bench_shape(name: str, M: int, w: dict, ceil: dict, with_breakdown: bool, shared_breakdown_max_m: int) -> dict:
    E, k, H, I = SHAPES[name]
    x = _x(M, H)
    args = (x, w["router_weight"], w["w13"], w["w2"], k)
    _, ids = _routing(x, w, k)
    active = int(torch.unique(ids).numel())
    weight_bytes = active * 3 * I * H * 2 + E * H * 2
    expert_flop = 6 * M * k * H * I
    mem_floor = weight_bytes / ceil["copy_GBps"] / 1e6
    flop_floor = (expert_flop + 2 * M * E * H) / ceil["bf16_TFLOPs"] / 1e9
    ours_ms, method = _time(lambda: ours(*args), M)
    host_us = _bench.host_us_per_call(lambda: ours(*args), calls=50)
    host_binder_us = _host_us_binder(lambda: ours(*args))
    gpu_ms = ours_ms if method == "graph" else _gpu_ms(lambda: ours(*args), M)
    shared_ms, _ = _time(lambda: ours(*args, shared=w["shared"]), M)
    extra = dict(M=M, E=E, k=k, H=H, I=I, method=method, active_experts=active,
                 mem_floor_ms=round(mem_floor, 5), flop_floor_ms=round(flop_floor, 5),
                 x_mem_floor=round(ours_ms / mem_floor, 3), x_floor=round(ours_ms / max(mem_floor, flop_floor), 3),
                 TFLOPs=round(expert_flop / ours_ms / 1e9, 1), ours_shared_ms=round(shared_ms, 5),
                 host_us=round(host_us, 1), host_binder_us=round(host_binder_us, 1), gpu_ms=round(gpu_ms, 5))
    anchor_ms = None
    try:
        expect = torch_pipeline(*args)
        extra["rel_err_vs_torch"] = round(_rel(ours(*args), expect), 6)
        anchor_ms, anchor_method = _time(lambda: torch_pipeline(*args), M)
        extra["anchor_TFLOPs"] = round(expert_flop / anchor_ms / 1e9, 1)
        # GPU time of both pipelines (graph replay) where the row itself is timed eagerly (host time included):
        # the GPU-work comparison beside the one-call latency
        anchor_gpu = anchor_ms if anchor_method == "graph" else _gpu_ms(lambda: torch_pipeline(*args), M)
        extra["anchor_gpu_ms"] = round(anchor_gpu, 5)
        extra["speedup_gpu"] = round(anchor_gpu / gpu_ms, 3)
    except Exception as e:  # noqa: BLE001 - keep our numbers even if the anchor cannot run
        extra["anchor_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if with_breakdown:
        extra["stages_ms"] = _stage_ms(x, w, k)
        if M <= shared_breakdown_max_m:  # where the shared expert's extra time goes
            extra["stages_shared_ms"] = _stage_ms(x, w, k, with_shared=True)
    return _bench.row("moe_block_routed", f"{name} M={M}", "bf16", ours_ms, "torch._grouped_mm pipeline",
                      anchor_ms, **extra)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_benchmark(out: Path, shapes: list[str], ms: list[int],
                  shared_breakdown_max_m: int = SHARED_BREAKDOWN_MAX_M, tag: str = "") -> list[dict]:
    ceil = dict(_bench.ceilings())
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows = []
    name_json = f"moe_{tag + '_' if tag else ''}{_config_slug()}"
    meta = dict(ceilings=ceil, shapes={n: SHAPES[n] for n in shapes}, ms=list(ms), note=__doc__.split("\n")[0])
    path = None
    for name in shapes:
        E, k, H, I = SHAPES[name]
        w = _weights(E, H, I)
        for M in ms:
            t0 = time.time()
            try:
                r = bench_shape(name, M, w, ceil, M in BREAKDOWN_MS, shared_breakdown_max_m)
            except Exception as e:  # noqa: BLE001 - record and go on to the next shape
                traceback.print_exc()
                r = _bench.row("moe_block_routed", f"{name} M={M}", "bf16", math.nan, M=M,
                               error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(r)
            print(f"  {r['shape']}: ours {r['ours_ms']} ms, torch {r.get('anchor_ms')} ms ({time.time() - t0:.1f}s)",
                  flush=True)
            path = _bench.write_results(out, name_json, rows, meta=meta)  # after every row: a killed run keeps them
        del w
        torch.cuda.empty_cache()
    cols = ["shape", "ours_ms", "anchor_ms", "speedup", "x_mem_floor", "x_floor", "TFLOPs", "ours_shared_ms", "host_us",
            "host_binder_us", "gpu_ms", "anchor_gpu_ms", "speedup_gpu"]
    print(_bench.format_table(rows, cols))
    stage_rows = [dict(shape=r["shape"], **r["stages_ms"]) for r in rows if r.get("stages_ms")]
    stage_rows += [dict(shape=r["shape"] + " +shared", **r["stages_shared_ms"]) for r in rows
                   if r.get("stages_shared_ms")]
    if stage_rows:
        print("GPU time per stage (ms, graph replay):")
        print(_bench.format_table(stage_rows, list(stage_rows[0])))
    print(f"wrote {path}")
    return rows


def _config_slug() -> str:
    from kernels_triton.bench_api import device_slug

    return device_slug(_bench.device_name())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_moe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON results")
    ap.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, M in {QUICK_MS}")
    ap.add_argument("--shapes", default=None, help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--ms", default=None, help="comma-separated token counts")
    ap.add_argument("--down-flat", action="store_true", help="sweep the down GEMM's column tiles per program")
    ap.add_argument("--tma", action="store_true", help="both expert GEMMs with weight tiles by pointers and by TMA")
    ap.add_argument("--sub-tiles", action="store_true", help="gate_up/down with and without shorter tiles for short "
                    "last blocks, at 64- and 128-row blocks")
    ap.add_argument("--pdl", action="store_true", help="the whole block with and without programmatic dependent "
                    "launch (QWEN35_MOE_PDL)")
    ap.add_argument("--decode", action="store_true", help="one token: the general pipeline against the decode path")
    ap.add_argument("--shared-breakdown-max-m", type=int, default=SHARED_BREAKDOWN_MAX_M,
                    help="also time each stage with the shared expert up to this many tokens")
    ap.add_argument("--tag", default="", help="inserted into the result file name (moe_<tag>_<device>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA device; nothing to do")
        return 0
    shapes = args.shapes.split(",") if args.shapes else list(QUICK_SHAPES if args.quick else SHAPES)
    out = Path(args.out)
    sweeps = {"down_flat": [1024, 4096, 16384], "tma": [1, 16, 1024, 4096, 8192, 16384], "pdl": [1, 4, 16, 64, 256],
              "sub_tiles": [2048, 4096, 8192, 16384]}
    ms = [int(m) for m in args.ms.split(",")] if args.ms else None
    for name, default_ms in sweeps.items():
        if getattr(args, name):
            from tuning import sweep_moe

            getattr(sweep_moe, f"{name}_sweep")(out, shapes, ms or default_ms)
            return 0
    if args.decode:
        from tuning import sweep_moe

        sweep_moe.decode_sweep(out, shapes)
        return 0
    ms = [int(m) for m in args.ms.split(",")] if args.ms else list(QUICK_MS if args.quick else MS)
    run_benchmark(out, shapes, ms, args.shared_breakdown_max_m, tag=args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
