"""Benchmark: the cuda_sm70 backend (CUDA C++, SM70 features) against the Triton backend, the 1Cat-vLLM
token-recurrent GDN kernel and the reference, fp16, GPU time by CUDA-graph replay.

Rows: ``device, op, shape, dtype, impl, gpu_ms`` (impl: ``cuda_sm70`` / ``1cat_recurrent`` / ``triton`` /
``reference``) plus, where they apply, the state traffic rate (GB/s), the weight-read floor and TFLOP/s; written
as ``sm70.json`` under ``--out`` with a short table on stdout.

- GDN prefill at the issue's shapes (27B-TP4 4/12 heads at T = 512, 4096, 16384; 35B 16/32 at 4096, 16384;
  27B-TP1 16/48 at 512): raw gating, L2 norm in the op, a pool slot in and out. The 1Cat kernel gets the same
  q, k, v with precomputed g / beta and pre-normalised q, k (its op has no gating or norm of its own). The
  reference at 27B-TP4 1 x 8192 (events: it synchronises the host).
- GDN decode at B >= 128: state traffic (fp32 state read and written once) in GB/s.
- MoE (35B-A3B routed experts, E = 256, k = 8, H = 2048, I = 512): M <= 16 against the weight-read floor (the
  touched experts' weights once, at the measured copy bandwidth), M >= 4096 in TFLOP/s.

The 1Cat kernel (``--peer DIR``, a copy of ``anchors/sm70_1cat``; MIT) is built beside ours as compute_75 PTX
into the build cache; it is never imported into the package. ``--build-peer DIR`` only builds it (the GPU command
starts that in the background while the tests run).

``python -m tuning.bench_sm70 --out DIR [--peer DIR] [--quick] [--skip triton,reference,1cat]``; reports, never
asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from tuning import _bench

K = V = 128
PREFILL = [("27B-TP4", 4, 12, 512), ("27B-TP4", 4, 12, 4096), ("27B-TP4", 4, 12, 16384), ("35B", 16, 32, 4096),
           ("35B", 16, 32, 16384), ("27B-TP1", 16, 48, 512)]
REFERENCE_AT = ("27B-TP4", 4, 12, 8192)
DECODE = [("35B", 16, 32, 128), ("35B", 16, 32, 512), ("27B-TP4", 4, 12, 256), ("27B-TP1", 16, 48, 128)]
MOE = dict(E=256, k=8, H=2048, I=512)
MOE_SMALL = (1, 4, 16)
MOE_LARGE = (4096, 16384)
DEV = "cuda"
DT = torch.float16


# ----------------------------------------------------------------------------- the 1Cat peer


def peer_build_dir() -> str:
    root = os.environ.get("QWEN35_CUDA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qwen35")
    return os.path.join(root, "peer_1cat")


def load_peer(path: str):  # noqa: ANN201
    """Build (or load) the 1Cat token-recurrent kernel from ``path`` (its csrc/gdn_forward.cu) as compute_75 PTX."""
    import torch.utils.cpp_extension as cpp

    src = Path(path) / "csrc" / "gdn_forward.cu"
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found: --peer must name a copy of anchors/sm70_1cat")
    out = peer_build_dir()
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    mod = cpp.load(name="gdn1cat_peer", sources=[str(src)], build_directory=out, verbose=False,
                   extra_cuda_cflags=["-O3", "-gencode=arch=compute_75,code=compute_75"])
    print(f"[bench_sm70] 1Cat peer ready in {time.time() - t0:.0f}s ({out})", flush=True)
    return mod


# ----------------------------------------------------------------------------- GDN


def _prefill_inputs(H: int, HV: int, T: int, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape, dtype=DT, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    return dict(q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, HV, V), a=rnd(T, HV), b=rnd(T, HV),
                A_log=rnd(HV, dtype=torch.float32, scale=0.5), dt_bias=rnd(HV, dtype=torch.float32, scale=0.5))


def _prefill_fn(impl: str, d: dict, HV: int):  # noqa: ANN202
    pool = torch.zeros(2, HV, K, V, device=DEV)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    if impl == "cuda_sm70":
        from kernels_cuda import sm70

        return lambda: sm70.gdn_chunk_prefill(**d, state_pool=pool, state_slots=slots, use_qk_l2norm=True)
    if impl == "triton":
        import kernels_triton as kt

        return lambda: kt.gdn_chunk_prefill(**d, state_pool=pool, state_slots=slots, use_qk_l2norm=True)
    if impl == "reference":
        from qwen35 import reference as ref

        return lambda: ref.gdn_chunk_prefill(**d, state_pool=pool, state_slots=slots, use_qk_l2norm=True)
    raise ValueError(impl)


def _peer_fn(peer, d: dict):  # noqa: ANN001, ANN202
    from qwen35.reference.gdn import gating_from_raw, l2_normalize

    g, beta = gating_from_raw(d["a"], d["b"], d["A_log"], d["dt_bias"], torch.float32)
    q = l2_normalize(d["q"].float()).to(DT)[None]
    k = l2_normalize(d["k"].float()).to(DT)[None]
    v = d["v"][None]
    g, beta = g[None].contiguous(), beta[None].contiguous()
    HV = v.shape[2]
    h0 = torch.zeros(1, HV, K, V, device=DEV)
    return lambda: peer.gdn_forward(q, k, v, g, beta, h0, K**-0.5, True, False)


def _time(fn) -> tuple[float, str]:  # noqa: ANN001
    """(GPU ms per call, how it was timed): graph replay, or events when the call cannot be captured."""
    try:
        return _bench.time_graph_ms(fn, calls_per_graph=3, rep=10), "graph"
    except Exception as e:  # noqa: BLE001 - e.g. a host synchronisation inside the call
        torch.cuda.synchronize()
        print(f"[bench_sm70] graph capture failed ({type(e).__name__}: {str(e)[:120]}); timing with events",
              flush=True)
        return _bench.time_ms(fn, warmup=2, rep=5), "events"


def bench_prefill(rows: list[dict], impls: list[str], peer, quick: bool) -> None:  # noqa: ANN001
    shapes = PREFILL[:2] if quick else PREFILL
    for name, H, HV, T in shapes:
        d = _prefill_inputs(H, HV, T)
        shape = f"{name} ({H}/{HV}) 1x{T}"
        for impl in impls:
            try:
                fn = _peer_fn(peer, d) if impl == "1cat_recurrent" else _prefill_fn(impl, d, HV)
                ms, how = _time(fn)
            except Exception as e:  # noqa: BLE001 - one failing impl must not lose the others' rows
                traceback.print_exc()
                rows.append(_row("gdn_chunk_prefill", shape, impl, None, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            rows.append(_row("gdn_chunk_prefill", shape, impl, ms, timed=how))
            print(_line(rows[-1]), flush=True)
        del d
        torch.cuda.empty_cache()


def bench_reference(rows: list[dict]) -> None:
    name, H, HV, T = REFERENCE_AT
    d = _prefill_inputs(H, HV, T)
    shape = f"{name} ({H}/{HV}) 1x{T}"
    for impl in ("cuda_sm70", "reference"):
        fn = _prefill_fn(impl, d, HV)
        ms = _bench.time_ms(fn, warmup=1, rep=3) if impl == "reference" else _time(fn)[0]
        rows.append(_row("gdn_chunk_prefill", shape, impl, ms, timed="events" if impl == "reference" else "graph"))
        print(_line(rows[-1]), flush=True)


def bench_decode(rows: list[dict], impls: list[str], quick: bool) -> None:
    for name, H, HV, B in DECODE[:2] if quick else DECODE:
        gen = torch.Generator(device=DEV).manual_seed(B)
        d = dict(q=torch.randn(B, 1, H, K, generator=gen, device=DEV).to(DT),
                 k=torch.randn(B, 1, H, K, generator=gen, device=DEV).to(DT),
                 v=torch.randn(B, 1, HV, V, generator=gen, device=DEV).to(DT),
                 a=torch.randn(B, 1, HV, generator=gen, device=DEV).to(DT),
                 b=torch.randn(B, 1, HV, generator=gen, device=DEV).to(DT),
                 A_log=torch.randn(HV, generator=gen, device=DEV) * 0.5, dt_bias=torch.randn(HV, generator=gen,
                                                                                            device=DEV) * 0.5)
        pool = torch.randn(B + 1, HV, K, V, generator=gen, device=DEV) * 0.1
        slots = torch.randperm(B + 1, generator=gen, device=DEV)[:B].to(torch.int32)
        traffic = 2 * B * HV * K * V * 4
        for impl in (i for i in impls if i in ("cuda_sm70", "triton")):
            if impl == "cuda_sm70":
                from kernels_cuda import sm70 as mod
            else:
                import kernels_triton as mod
            fn = (lambda mod=mod, d=d, pool=pool, slots=slots: mod.gdn_recurrent_step(
                **d, state_pool=pool, state_slots=slots, use_qk_l2norm=True))
            try:
                ms, how = _time(fn)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(_row("gdn_recurrent_step", f"{name} B={B}", impl, None, error=str(e)[:300]))
                continue
            rows.append(_row("gdn_recurrent_step", f"{name} ({H}/{HV}) B={B} T=1", impl, ms, timed=how,
                             state_GBps=round(traffic / ms / 1e6, 1)))
            print(_line(rows[-1]), flush=True)


# ----------------------------------------------------------------------------- MoE


def bench_moe(rows: list[dict], impls: list[str], copy_GBps: float, quick: bool) -> None:
    E, k, H, I = MOE["E"], MOE["k"], MOE["H"], MOE["I"]
    gen = torch.Generator(device=DEV).manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device=DEV) * H**-0.5).to(DT)
    w2 = (torch.randn(E, H, I, generator=gen, device=DEV) * I**-0.5).to(DT)
    expert_bytes = 3 * I * H * 2
    from qwen35 import reference as ref

    for M in (MOE_SMALL[:2] + MOE_LARGE[:1]) if quick else (MOE_SMALL + MOE_LARGE):
        x = torch.randn(M, H, generator=gen, device=DEV).to(DT)
        weights, ids = ref.moe_route(torch.randn(M, E, generator=gen, device=DEV), k)
        touched = int(torch.unique(ids).numel())
        shape = f"35B-A3B E={E} k={k} H={H} I={I} M={M}"
        for impl in (i for i in impls if i in ("cuda_sm70", "triton")):
            if impl == "cuda_sm70":
                from kernels_cuda import sm70 as mod
            else:
                import kernels_triton as mod
            fn = (lambda mod=mod, x=x, weights=weights, ids=ids: mod.moe_experts(x, w13, w2, weights, ids))
            try:
                ms, how = _time(fn)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(_row("moe_experts", shape, impl, None, error=str(e)[:300]))
                continue
            extra = {"timed": how}
            if M in MOE_SMALL:
                floor = touched * expert_bytes / copy_GBps / 1e6
                extra.update(experts_touched=touched, floor_ms=round(floor, 5), x_floor=round(ms / floor, 2))
            else:
                extra["TFLOPs"] = round(2 * M * k * 3 * I * H / ms / 1e9, 1)
            rows.append(_row("moe_experts", shape, impl, ms, **extra))
            print(_line(rows[-1]), flush=True)


# ----------------------------------------------------------------------------- plumbing


def _row(op: str, shape: str, impl: str, ms: float | None, **extra: object) -> dict:
    r = {"device": _bench.device_name(), "op": op, "shape": shape, "dtype": "float16", "impl": impl,
         "gpu_ms": None if ms is None else round(ms, 5)}
    r.update(extra)
    return r


def _line(r: dict) -> str:
    keys = ("state_GBps", "floor_ms", "x_floor", "TFLOPs", "error")
    more = "  ".join(f"{k}={r[k]}" for k in keys if k in r)
    return f"{r['op']:<20} {r['shape']:<40} {r['impl']:<15} {r['gpu_ms']}  {more}"


def summarize(rows: list[dict]) -> list[dict]:
    """Per shape: our time against each other impl (> 1: we are faster)."""
    out = []
    by_shape: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if r.get("gpu_ms"):
            by_shape.setdefault((r["op"], r["shape"]), {})[r["impl"]] = r["gpu_ms"]
    for (op, shape), t in by_shape.items():
        ours = t.get("cuda_sm70")
        if not ours:
            continue
        for impl, ms in t.items():
            if impl != "cuda_sm70":
                out.append({"op": op, "shape": shape, "vs": impl, "speedup": round(ms / ours, 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_sm70", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for sm70.json")
    ap.add_argument("--peer", default=None, help="a copy of anchors/sm70_1cat (built as compute_75 PTX)")
    ap.add_argument("--build-peer", default=None, metavar="DIR", help="only build the 1Cat peer from DIR, then exit")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--skip", default="", help="comma-separated impls to leave out: triton, reference, 1cat")
    args = ap.parse_args(argv)
    if args.build_peer:
        load_peer(args.build_peer)
        return 0
    if args.out is None:
        ap.error("--out is required")
    if not torch.cuda.is_available():
        print("bench_sm70: no CUDA device; nothing to measure")
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    from kernels_cuda import build, sm70

    t0 = time.time()
    sm70.extension(torch.device(DEV))
    meta = {"build": {k: v for k, v in build.last_build.items()}, "build_wall_s": round(time.time() - t0, 1)}
    print(f"[bench_sm70] cuda_sm70 ready: {meta['build']}", flush=True)
    peer = None
    if args.peer and "1cat" not in skip:
        try:
            peer = load_peer(args.peer)
        except Exception as e:  # noqa: BLE001 - the peer is optional
            traceback.print_exc()
            meta["peer_error"] = f"{type(e).__name__}: {e}"[:500]
    impls = ["cuda_sm70"] + (["triton"] if "triton" not in skip else []) + (["1cat_recurrent"] if peer else [])
    ceil = _bench.ceilings()
    meta["ceilings"] = ceil
    rows: list[dict] = []

    def save() -> None:
        _bench.write_results(args.out, "sm70", rows, {**meta, "summary": summarize(rows)})

    for part, fn in (("prefill", lambda: bench_prefill(rows, impls, peer, args.quick)),
                     ("reference", lambda: "reference" in skip or bench_reference(rows)),
                     ("decode", lambda: bench_decode(rows, impls, args.quick)),
                     ("moe", lambda: bench_moe(rows, impls, ceil["copy_GBps"], args.quick))):
        try:
            fn()
        except Exception:  # noqa: BLE001 - keep the rows of the other parts
            traceback.print_exc()
            meta.setdefault("failed_parts", []).append(part)
        save()
    cols = ["op", "shape", "impl", "gpu_ms", "state_GBps", "floor_ms", "x_floor", "TFLOPs"]
    print("\n" + _bench.format_table(rows, cols))
    print("\n" + _bench.format_table(summarize(rows), ["op", "shape", "vs", "speedup"]))
    print(f"\nceilings: {json.dumps(ceil)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
