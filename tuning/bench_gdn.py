"""Benchmark: Triton GDN chunked prefill and decode step vs FLA, side by side in one process (bf16).

Prefill rows time the whole op (CUDA events around each call, host work included) for ours
(raw gating a/b/A_log/dt_bias fused, L2 norm in kernel, initial state in, final state out,
prepared metadata) and FLA's ``chunk_gated_delta_rule`` (g/beta precomputed, qk-l2norm in
kernel, h0 + final state, cu_seqlens and chunk indices precomputed). Each row also gives the
GPU time of every kernel (torch.profiler), TFLOP/s by the chunked form's FLOP count
(:func:`flop_per_token_head`) and % of the measured bf16 matmul ceiling. Decode rows are timed through CUDA
graphs; their roofline is the state traffic (read + write of fp32 state) against the measured copy bandwidth.
Host cost per call is the CPU wall time of back-to-back calls on a tiny prefill (the GPU is idle-bound there).

``python -m tuning.bench_gdn --out DIR [--quick] [--no-fla] [--tag T]``; ``--sweep --sweep-set X`` times the
launch-config variants of :mod:`tuning.sweep_gdn` first (``--warm N`` for every variant N in parallel processes
fills Triton's cache before a sweep). Reports, never asserts.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

from tuning import _bench

HEADS = {  # name: (H, HV) at K = V = 128
    "27B-TP1": (16, 48),
    "27B-TP4": (4, 12),
    "35B-A3B-TP1": (16, 32),
    "397B-TP8": (2, 8),
}
# --sweep-set choices: tuning/sweep_gdn.py's sets (named here so that --help works without a GPU import)
SWEEP_SETS = {"a": "prepare caps and warps, scan blocks, decode blocks", "c": "the inverse's block rows",
              "d": "decode streaming hints", "e": "scan V blocks at 32-48 pairs", "h": "prepare column blocks",
              "i": "the inverse's merges on its blocks", "m": "split against one-pass scan",
              "p": "split scan stages", "q": "decode with PDL", "s": "one sequence in parts, few pairs",
              "t": "one sequence in parts, 32-48 pairs", "u": "one-pass scan at BV 128"}
PREFILL_SHAPES = {  # name: sequence lengths
    "1x2048": [2048], "1x8192": [8192], "1x32768": [32768], "1x65536": [65536],
    "8x4096": [4096] * 8, "64x512": [512] * 64,
}
DECODE_BATCHES = (1, 8, 32, 128, 512)
K = V = 128
CHUNK = 64
DEVICE = "cuda"
DTYPE = torch.bfloat16
# The reference FLA figures: FLA 0.6.0's chunk_gated_delta_rule (its Triton path) on one H200, bf16, ms, at
# PREFILL_SHAPES in order, measured with this benchmark's inputs when the project was planned (tuning/notes_gdn.md).
# The anchor of a row when FLA cannot run in this process.
FLA_REFERENCE_MS = {
    "27B-TP1": [0.77, 1.24, 2.94, 5.90, 2.79, 3.03],
    "27B-TP4": [0.95, 0.80, 1.25, 2.47, 1.52, 1.53],
    "35B-A3B-TP1": [0.73, 0.78, 2.10, 4.19, 2.11, 2.33],
    "397B-TP8": [1.03, 1.01, 1.16, 2.01, 1.05, 1.03],
}


def flop_per_token_head(k: int = K, v: int = V, c: int = CHUNK) -> float:
    """FLOP per token and value head of the chunked form: 6KV + 6CK + 4CV + C^2/3."""
    return 6 * k * v + 6 * c * k + 4 * c * v + c * c / 3


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices
    except Exception as e:  # noqa: BLE001 - FLA is optional: anchors become None
        print(f"FLA not available ({type(e).__name__}: {e}); anchor columns are None", flush=True)
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, prepare_chunk_indices


def _prefill_inputs(lens: list[int], H: int, HV: int, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    T = sum(lens)

    def rnd(*shape, dtype=None, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype or DTYPE)

    d = dict(q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, HV, V), a=rnd(T, HV), b=rnd(T, HV),
             A_log=rnd(HV, dtype=torch.float32, scale=0.5), dt_bias=rnd(HV, dtype=torch.float32, scale=0.5))
    d["cu"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    d["h0"] = rnd(len(lens), HV, K, V, dtype=torch.float32, scale=0.1)
    # FLA takes precomputed gating (what vLLM computes before calling it).
    d["g"] = (-d["A_log"].exp() * torch.nn.functional.softplus(d["a"].float() + d["dt_bias"])).contiguous()
    d["beta"] = torch.sigmoid(d["b"].float()).to(DTYPE)
    return d


def _ours_prefill(d: dict, meta, **forced):
    """Our prefill on ``d``; ``forced``: ``prepare`` / ``scan`` configs (:mod:`kernels_triton.gdn.bench_api`)."""
    import kernels_triton as kt
    from kernels_triton.gdn import bench_api

    op = bench_api.gdn_chunk_prefill if forced else kt.gdn_chunk_prefill
    return lambda: op(
        d["q"], d["k"], d["v"], a=d["a"], b=d["b"], A_log=d["A_log"], dt_bias=d["dt_bias"], cu_seqlens=d["cu"],
        initial_state=d["h0"], output_final_state=True, use_qk_l2norm=True, metadata=meta, **forced)


def _fla_prefill(fla, d: dict):
    chunk, _, prepare_chunk_indices = fla
    cu64 = d["cu"].long()
    cu_cpu = cu64.cpu()
    idx = prepare_chunk_indices(cu64, CHUNK)
    q, k, v, g, beta = (d[n][None] for n in ("q", "k", "v", "g", "beta"))
    return lambda: chunk(q, k, v, g, beta, initial_state=d["h0"], output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu, chunk_indices=idx)


def kernel_times_ms(fn, calls: int = 3) -> dict[str, float]:
    """GPU time per call of each kernel ``fn`` launches (torch.profiler), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:60]] += ev.device_time_total / 1000 / calls  # us -> ms
    return {k: round(v, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def bench_prefill(fla, args, ceil: dict, rows: list[dict], deadline: float, save=lambda: None) -> None:
    """Every shape timed first, the per-kernel breakdowns (torch.profiler) after: a CUDA-activity profile leaves
    CUPTI attached for the rest of the process (Kineto detaches it only with TEARDOWN_CUPTI=1), which would slow
    every launch timed after it."""
    import kernels_triton as kt

    pending: list[tuple[dict, list[int], int, int, bool]] = []
    for hname, (H, HV) in HEADS.items():
        for si, (sname, lens) in enumerate(PREFILL_SHAPES.items()):
            if args.quick and sname not in ("1x8192", "1x32768", "8x4096"):
                continue
            T = sum(lens)
            try:
                d = _prefill_inputs(lens, H, HV)
                meta = kt.prepare_gdn_metadata(d["cu"])
                ours = _ours_prefill(d, meta)
                ours_ms = _bench.time_ms(ours)
                anchor_ms, source = None, None
                if fla is not None and time.time() < deadline:
                    try:
                        theirs = _fla_prefill(fla, d)
                        anchor_ms = _bench.time_ms(theirs)
                        source = "fla measured"
                    except Exception as e:  # noqa: BLE001 - an anchor failure must not stop the table
                        source = f"fla failed: {type(e).__name__}: {str(e)[:200]}"
                if anchor_ms is None:
                    anchor_ms = FLA_REFERENCE_MS[hname][si]
                    source = (source + "; " if source else "") + "reference FLA figures"
                flops = flop_per_token_head() * T * HV
                tflops = flops / ours_ms / 1e9
                rows.append(_bench.row(
                    "gdn_chunk_prefill", f"{hname} H={H} HV={HV} {sname}", "bfloat16", ours_ms,
                    "fla.chunk_gated_delta_rule", anchor_ms, heads=hname, seqs=sname, T=T,
                    tokens_per_s=round(T / ours_ms * 1e3), tflops=round(tflops, 1),
                    roofline_pct=round(100 * tflops / ceil["bf16_TFLOPs"], 1), ours_kernels_ms=None,
                    anchor_kernels_ms=None, anchor_source=source))
                pending.append((rows[-1], lens, H, HV, source == "fla measured"))
                print(_line(rows[-1]), flush=True)
                save()
                del d, ours
            except Exception as e:  # noqa: BLE001 - record and continue with the next shape
                traceback.print_exc()
                rows.append(_bench.row("gdn_chunk_prefill", f"{hname} {sname}", "bfloat16", math.nan,
                                       error=f"{type(e).__name__}: {str(e)[:300]}"))
            torch.cuda.empty_cache()
    for row, lens, H, HV, with_fla in pending:
        try:
            d = _prefill_inputs(lens, H, HV)
            row["ours_kernels_ms"] = kernel_times_ms(_ours_prefill(d, kt.prepare_gdn_metadata(d["cu"])))
            if with_fla:
                row["anchor_kernels_ms"] = kernel_times_ms(_fla_prefill(fla, d))
            del d
        except Exception as e:  # noqa: BLE001 - the timings stand without their breakdown
            row["kernels_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        save()
        torch.cuda.empty_cache()


def bench_host(fla, rows: list[dict], deadline: float) -> None:
    """CPU time per prefill call at T=64 (GPU idle-bound): as shipped (kernels launched directly after their
    first call), through Triton's JIT launch path, with the launches left out (wrapper and allocations), and
    FLA's when it is there."""
    import kernels_triton as kt
    from kernels_triton.bench_api import jit_launches, launches_stubbed

    for hname in ("27B-TP4", "397B-TP8"):
        H, HV = HEADS[hname]
        d = _prefill_inputs([64], H, HV)
        meta = kt.prepare_gdn_metadata(d["cu"])
        fn = _ours_prefill(d, meta)
        ours = _bench.host_us_per_call(fn)
        with jit_launches():  # every launch through the JIT
            jit = _bench.host_us_per_call(fn)
        with launches_stubbed():
            wrapper = _bench.host_us_per_call(fn)
        theirs = _bench.host_us_per_call(_fla_prefill(fla, d)) if fla is not None and time.time() < deadline else None
        rows.append(_bench.row("gdn_chunk_prefill host cost", f"{hname} T=64", "bfloat16", ours / 1e3,
                               "fla.chunk_gated_delta_rule" if theirs else None,
                               None if theirs is None else theirs / 1e3, host_us=round(ours, 1),
                               host_us_jit_launch=round(jit, 1), host_us_no_launch=round(wrapper, 1),
                               anchor_host_us=None if theirs is None else round(theirs, 1)))
        print(_line(rows[-1]), flush=True)


def _decode_inputs(B: int, H: int, HV: int, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*shape, dtype=None, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype or DTYPE)

    return dict(q=rnd(B, 1, H, K), k=rnd(B, 1, H, K), v=rnd(B, 1, HV, V), a=rnd(B, 1, HV), b=rnd(B, 1, HV),
                A_log=rnd(HV, dtype=torch.float32, scale=0.5), dt_bias=rnd(HV, dtype=torch.float32, scale=0.5),
                pool=rnd(B, HV, K, V, dtype=torch.float32, scale=0.1),
                slots=torch.arange(B, dtype=torch.int32, device=DEVICE))


def bench_decode(fla, args, ceil: dict, rows: list[dict], save=lambda: None) -> None:

    for hname, (H, HV) in HEADS.items():
        for B in DECODE_BATCHES:
            if args.quick and B not in (1, 128):
                continue
            try:
                d = _decode_inputs(B, H, HV)
                ours_ms = _bench.time_graph_ms(_decode_fn(d))
                anchor_ms = None
                if fla is not None:
                    try:
                        h0 = d["pool"].clone()
                        theirs = lambda d=d, h0=h0, recurrent=fla[1]: recurrent(  # noqa: E731
                            d["q"], d["k"], d["v"], g=d["a"], beta=d["b"], initial_state=h0,
                            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                            A_log=d["A_log"], dt_bias=d["dt_bias"], use_beta_sigmoid_in_kernel=True)
                        anchor_ms = _bench.time_graph_ms(theirs)
                    except Exception as e:  # noqa: BLE001
                        print(f"FLA decode failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                state_bytes = 2 * B * HV * K * V * 4
                gbps = state_bytes / ours_ms / 1e6
                rows.append(_bench.row(
                    "gdn_recurrent_step", f"{hname} H={H} HV={HV} B={B}", "bfloat16", ours_ms,
                    "fla.fused_recurrent_gated_delta_rule" if anchor_ms else None, anchor_ms, heads=hname, B=B,
                    tokens_per_s=round(B / ours_ms * 1e3), us=round(ours_ms * 1e3, 2),
                    state_GBps=round(gbps), roofline_pct=round(100 * gbps / ceil["copy_GBps"], 1),
                    anchor_state_GBps=None if not anchor_ms else round(state_bytes / anchor_ms / 1e6)))
                print(_line(rows[-1]), flush=True)
                save()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(_bench.row("gdn_recurrent_step", f"{hname} B={B}", "bfloat16", math.nan,
                                       error=f"{type(e).__name__}: {str(e)[:300]}"))


def _decode_fn(d: dict, cfg: dict | None = None):
    """Our decode step on ``d``; ``cfg``: a forced step config (:mod:`kernels_triton.gdn.bench_api`)."""
    import kernels_triton as kt
    from kernels_triton.gdn import bench_api

    if cfg is None:
        return lambda: kt.gdn_recurrent_step(
            d["q"], d["k"], d["v"], state_pool=d["pool"], state_slots=d["slots"], a=d["a"], b=d["b"],
            A_log=d["A_log"], dt_bias=d["dt_bias"], use_qk_l2norm=True)
    return lambda: bench_api.gdn_recurrent_step(
        d["q"], d["k"], d["v"], state_pool=d["pool"], state_slots=d["slots"], a=d["a"], b=d["b"],
        A_log=d["A_log"], dt_bias=d["dt_bias"], use_qk_l2norm=True, config=cfg)


def dump_fla_autotune(path: Path) -> int:
    """Write the configs FLA's autotuners picked in this process (FLA's config-file format, all kernels in one
    JSON), so a later run can load them with FLA_CACHE_MODE=strict instead of autotuning again."""
    from triton.runtime.autotuner import Autotuner

    try:
        from fla.ops.utils.cache import AutotuneKey
    except Exception:  # noqa: BLE001
        return 0
    out: dict[str, dict] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in vars(mod).values():
            if isinstance(obj, Autotuner) and obj.cache:
                kname = obj.fn.fn.__name__ if hasattr(obj.fn, "fn") else obj.fn.__name__
                entries = out.setdefault(kname, {"kernel_name": kname, "autotune_entries": {}})["autotune_entries"]
                for key, cfg in obj.cache.items():
                    entries[AutotuneKey.key_hash(key)] = {"autotune_key": list(key), "config": {
                        "kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                        "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)}}
    path.write_text(json.dumps(out, indent=1, default=str))
    return len(out)


def _line(r: dict) -> str:
    keys = ("shape", "ours_ms", "anchor_ms", "speedup", "tflops", "state_GBps", "roofline_pct", "host_us",
            "anchor_host_us", "error")
    return "  ".join(f"{k}={r[k]}" for k in keys if r.get(k) is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_gdn", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tuning/results", help="directory for gdn_<device>.json")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--sweep", action="store_true", help="also time launch-config variants (gdn_sweep.json; "
                        "its profiles leave CUPTI attached, so time the main rows in another process: --sweep-only)")
    parser.add_argument("--no-fla", action="store_true", help="skip the FLA anchor (the reference FLA figures are "
                        "used)")
    parser.add_argument("--fla-deadline", type=float, default=1e9,
                        help="seconds after start beyond which FLA prefill anchors are not run (autotune is slow)")
    parser.add_argument("--sweep-deadline", type=float, default=1e9, help="seconds after start to stop the sweep")
    parser.add_argument("--tag", default="", help="inserted into the result file names (gdn_<tag>_<device>.json)")
    parser.add_argument("--sweep-set", default="a", choices=sorted(SWEEP_SETS),
                        help="; ".join(f"{k}: {v}" for k, v in SWEEP_SETS.items()))
    parser.add_argument("--sweep-only", action="store_true", help="with --sweep: stop after the sweep")
    parser.add_argument("--warm", type=int, default=None,
                        help="only compile variant N of the sweep (run several in parallel before a sweep)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn needs a CUDA device", file=sys.stderr)
        return 2
    if args.warm is not None:
        from tuning import sweep_gdn

        sweep_gdn.warm(args.warm, args.sweep_set)
        return 0
    start = time.time()
    torch.set_grad_enabled(False)
    ceil = _bench.ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    fla = None if args.no_fla else _fla()
    rows: list[dict] = []
    tag = f"{args.tag}_" if args.tag else ""
    name = f"gdn_{tag}" + _bench.device_name().lower().replace(" ", "_")
    meta = {"ceilings": ceil, "flop_per_token_head": flop_per_token_head(), "quick": args.quick,
            "ours": "raw gating + L2 + h0/final state + metadata",
            "anchor": "FLA g/beta precomputed, qk-l2norm in kernel, h0/final state, chunk indices precomputed"}

    def save() -> Path:  # after every row, so a run stopped at its time limit still leaves its rows
        meta["wall_s"] = round(time.time() - start)
        return _bench.write_results(args.out, name, rows, meta)

    if args.sweep:  # first: its configs are what the rest is judged by, and it is deadline-bound
        from tuning import sweep_gdn

        sweep_rows: list[dict] = []
        sweep_gdn.sweep(args.sweep_set, sweep_rows, start + args.sweep_deadline,
              lambda: _bench.write_results(args.out, f"gdn_sweep_{tag}" + name[len(f"gdn_{tag}"):], sweep_rows,
                                           {"ceilings": ceil}))
        if args.sweep_only:
            return 0
    bench_decode(fla, args, ceil, rows, save)
    try:
        bench_host(fla, rows, start + args.fla_deadline)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    bench_prefill(fla, args, ceil, rows, start + args.fla_deadline, save)
    path = save()
    if fla is not None:
        n = dump_fla_autotune(Path(args.out) / "fla_autotune.json")
        print(f"FLA autotune configs of {n} kernels -> {Path(args.out) / 'fla_autotune.json'}")
    cols = ["op", "shape", "ours_ms", "anchor_ms", "speedup", "tokens_per_s", "tflops", "state_GBps",
            "roofline_pct", "host_us", "anchor_host_us"]
    print(_bench.format_table([r for r in rows if "error" not in r], cols))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
