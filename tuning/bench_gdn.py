"""Benchmark: Triton GDN chunked prefill and decode step vs FLA, side by side in one process (bf16).

Prefill rows time the whole op (CUDA events around each call, host work included) for ours
(raw gating a/b/A_log/dt_bias fused, L2 norm in kernel, initial state in, final state out,
prepared metadata) and FLA's ``chunk_gated_delta_rule`` (g/beta precomputed, qk-l2norm in
kernel, h0 + final state, cu_seqlens and chunk indices precomputed). Each row also gives the
GPU time of every kernel (torch.profiler), TFLOP/s by the DESIGN.md count and % of the measured
bf16 matmul ceiling. Decode rows are timed through CUDA graphs; their roofline is the state
traffic (read + write of fp32 state) against the measured copy bandwidth. Host cost per call
is the CPU wall time of back-to-back calls on a tiny prefill (the GPU is idle-bound there).

``python -m tuning.bench_gdn --out DIR [--quick] [--sweep] [--no-fla] [--tag T]``; before a sweep,
``--warm N`` for every variant N in parallel processes fills Triton's cache. Reports, never asserts.
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
PREFILL_SHAPES = {  # name: sequence lengths
    "1x2048": [2048], "1x8192": [8192], "1x32768": [32768], "1x65536": [65536],
    "8x4096": [4096] * 8, "64x512": [512] * 64,
}
DECODE_BATCHES = (1, 8, 32, 128, 512)
K = V = 128
CHUNK = 64
DEVICE = "cuda"
DTYPE = torch.bfloat16
# FLA 0.6.0 on one H200, from DESIGN.md: the anchor when FLA cannot run in this process.
DESIGN_FLA_MS = {
    "27B-TP1": [0.77, 1.24, 2.94, 5.90, 2.79, 3.03],
    "27B-TP4": [0.95, 0.80, 1.25, 2.47, 1.52, 1.53],
    "35B-A3B-TP1": [0.73, 0.78, 2.10, 4.19, 2.11, 2.33],
    "397B-TP8": [1.03, 1.01, 1.16, 2.01, 1.05, 1.03],
}


def flop_per_token_head(k: int = K, v: int = V, c: int = CHUNK) -> float:
    """DESIGN.md's count for the chunked form: 6KV + 6CK + 4CV + C^2/3."""
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


def _ours_prefill(d: dict, meta, **cfg):
    import kernels_triton as kt

    return lambda: kt.gdn_chunk_prefill(
        d["q"], d["k"], d["v"], a=d["a"], b=d["b"], A_log=d["A_log"], dt_bias=d["dt_bias"], cu_seqlens=d["cu"],
        initial_state=d["h0"], output_final_state=True, use_qk_l2norm=True, metadata=meta, **cfg)


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
                    anchor_ms = DESIGN_FLA_MS[hname][si]
                    source = (source + "; " if source else "") + "DESIGN.md table"
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
    from kernels_triton import _launch
    from kernels_triton.gdn import chunk

    for hname in ("27B-TP4", "397B-TP8"):
        H, HV = HEADS[hname]
        d = _prefill_inputs([64], H, HV)
        meta = kt.prepare_gdn_metadata(d["cu"])
        fn = _ours_prefill(d, meta)
        ours = _bench.host_us_per_call(fn)
        _launch.ENABLED = False  # every launch through the JIT
        try:
            jit = _bench.host_us_per_call(fn)
        finally:
            _launch.ENABLED = True
        launchers = chunk._launch_prepare, chunk._launch_scan, chunk._launch_single
        chunk._launch_prepare = chunk._launch_scan = chunk._launch_single = lambda grid, args, options: None
        try:
            wrapper = _bench.host_us_per_call(fn)
        finally:
            chunk._launch_prepare, chunk._launch_scan, chunk._launch_single = launchers
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


SWEEP_PREFILL = {  # shapes whose best configs differ most: many heads, few heads, long/short seqs
    "27B-TP1 1x32768": ("27B-TP1", [32768]),
    "397B-TP8 1x65536": ("397B-TP8", [65536]),
    "27B-TP4 8x4096": ("27B-TP4", [4096] * 8),
    "27B-TP1 64x512": ("27B-TP1", [512] * 64),
}
# Prepare variants: register caps trade spills for resident CTAs (the kernel is latency-bound); the 16-row
# diagonal inverse by substitution or by the finite product series (tf32x3 or plain tf32 dots); block
# merges with bf16 operands.
PREPARE_VARIANTS = [
    {"num_warps": 4, "num_stages": 1},
    {"num_warps": 4, "num_stages": 1, "maxnreg": 168},
    {"num_warps": 4, "num_stages": 1, "maxnreg": 128},
    {"num_warps": 8, "num_stages": 1},
    {"num_warps": 8, "num_stages": 1, "maxnreg": 128},
    {"num_warps": 4, "num_stages": 1, "DIAG_BY_PRODUCT": True},
    {"num_warps": 4, "num_stages": 1, "DIAG_BY_PRODUCT": True, "EXACT_PREC": "tf32"},
    {"num_warps": 4, "num_stages": 1, "DIAG_BY_PRODUCT": True, "EXACT_PREC": "tf32", "maxnreg": 168},
    {"num_warps": 4, "num_stages": 1, "LOWP_MERGE": True},
    {"num_warps": 4, "num_stages": 1, "LOWP_MERGE": True, "maxnreg": 168},
]
# Second round: around the first round's winner (product series in plain tf32, register cap).
PREPARE_VARIANTS_B = [
    {"num_warps": 4, "num_stages": 1, "DIAG_BY_PRODUCT": True, "EXACT_PREC": "tf32", **extra}
    for extra in ({}, {"maxnreg": 152}, {"maxnreg": 168}, {"maxnreg": 184}, {"maxnreg": 200},
                  {"LOWP_MERGE": True, "maxnreg": 152}, {"LOWP_MERGE": True, "maxnreg": 168},
                  {"LOWP_MERGE": True, "maxnreg": 184})
] + [{"num_warps": 4, "num_stages": 1}]
# Third round: fp32-exact diagonal inverses only (the tf32 product series is inaccurate on correlated keys
# with beta near 1): substitution on 16-, 8- or 4-row blocks (15, 7 or 3 dependent steps, then merges).
PREPARE_VARIANTS_C = [
    {"num_warps": 4, "num_stages": 1, **extra}
    for extra in ({}, {"maxnreg": 168}, {"DIAG_ROWS": 8}, {"DIAG_ROWS": 8, "maxnreg": 168}, {"DIAG_ROWS": 4},
                  {"DIAG_ROWS": 4, "maxnreg": 168}, {"DIAG_ROWS": 4, "maxnreg": 152})
]
SCAN_VARIANTS = [{"BV": bv, "num_warps": 4, "num_stages": st} for bv in (16, 32, 64) for st in (2, 3)]
DECODE_VARIANTS = [{"BV": bv, "num_warps": w} for bv, w in ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4),
                                                             (64, 2), (64, 4), (128, 4), (128, 8))]
DECODE_SWEEP = (("27B-TP1", 1), ("35B-A3B-TP1", 1), ("27B-TP4", 1), ("397B-TP8", 128), ("27B-TP1", 128))


DECODE_SWEEP_D = (("27B-TP1", 1), ("35B-A3B-TP1", 1), ("27B-TP4", 1), ("397B-TP8", 1), ("397B-TP8", 128),
                  ("27B-TP4", 128), ("35B-A3B-TP1", 128))
DECODE_VARIANTS_D = [{"BV": bv, "num_warps": w, **extra} for bv, w in ((16, 1), (32, 1), (32, 2), (64, 4))
                     for extra in ({}, {"STREAM": True})]


# Set e: the scan's V blocks at 32 (sequence, head) pairs, the heuristic's boundary (35B-A3B TP1: 32 value heads,
# one sequence, the model benchmark's GDN shape), against many sequences and a long one.
SWEEP_PREFILL_E = {
    "35B-A3B-TP1 1x8192": ("35B-A3B-TP1", [8192]),
    "35B-A3B-TP1 1x32768": ("35B-A3B-TP1", [32768]),
    "35B-A3B-TP1 8x4096": ("35B-A3B-TP1", [4096] * 8),
    "27B-TP1 1x8192": ("27B-TP1", [8192]),
    "27B-TP1 1x32768": ("27B-TP1", [32768]),
    "27B-TP1 8x4096": ("27B-TP1", [4096] * 8),
}
# (BV, warps, stages). Session 6 ran the first six here and two 2-warp ones (they spill: 11-54 ms); session 7 the
# single-stage ones, to see whether programs sharing an SM overlap one's loads with another's dots (at one wave,
# 35B 1x8192, they lost: 0.44-0.49 ms against 0.22), and BV 32 / 16 in one stage, which Triton builds wrong for
# bf16 (see chunk._miscompiled_scan; the op now refuses them), then the set again with 27B-TP1 8x4096 (six waves).
SCAN_VARIANTS_E = [{"BV": bv, "num_warps": w, "num_stages": st} for bv, w, st in (
    (64, 4, 3), (64, 4, 2), (32, 4, 3), (32, 4, 2), (16, 4, 3), (64, 8, 3), (64, 4, 1), (16, 4, 2))]


# Set f: where the prepare kernel's time goes. STOP=1-4 end each program after a phase (raw K K^T / Q K^T and
# gating; scores and A; the inverse; W), so differences of these times split the kernel by phase at the
# occupancy it runs at (168 registers, three programs per SM, in every truncation); then variants of the
# default (4-row blocks): bf16 merges, 8 warps, other register caps. (Session 7 also ran pipelined q/k loads,
# num_stages 2, which gave wrong output: the op now refuses prepare stages other than 1.)
SWEEP_PREFILL_F = {
    "27B-TP1 8x4096": ("27B-TP1", [4096] * 8),
    "35B-A3B-TP1 8x4096": ("35B-A3B-TP1", [4096] * 8),
    "27B-TP4 1x32768": ("27B-TP4", [32768]),
}
PREPARE_VARIANTS_F = [{"num_warps": 4, "num_stages": 1, "maxnreg": 168, **extra} for extra in (
    {"STOP": 1}, {"STOP": 2}, {"STOP": 3}, {"STOP": 4}, {}, {"LOWP_MERGE": True}, {"maxnreg": 200},
    {"maxnreg": 152})] + [{"num_warps": 8, "num_stages": 1, "maxnreg": 128}, {"num_warps": 8, "num_stages": 1}]


# Set h: the default prepare spills 92 bytes per thread at its 168-register cap, all of it in the W / U phase
# (none when truncated after the inverse); ncu on the H200 counted 4.3 M local-memory requests, L1 hit rate 8 %,
# and the U phase (the last) took 23 % of the kernel. 32-column blocks for the q/k/v tiles and the W / U dots
# build without spills at the same cap (bundled ptxas, sm_90). Outcome: slower (1.470 vs 1.317 ms at 27B-TP1
# 8x4096), so the spills are not what the U phase costs. (Set g, an L2 prefetch of the v / q / k rows, changed
# nothing and its code is gone; its results are in gdn_sweep_s7g_nvidia_h200.json.)
PREPARE_VARIANTS_H = [{"num_warps": 4, "num_stages": 1, "maxnreg": 168, **extra} for extra in (
    {}, {"BKC": 32, "BVC": 32}, {"BKC": 32}, {"BKC": 32, "BVC": 32, "STOP": 4}, {"BKC": 32, "BVC": 32, "STOP": 1},
    {"BKC": 32, "BVC": 32, "maxnreg": 160}, {"BKC": 32, "BVC": 32, "maxnreg": 184})]


# Set m. Session 7's one-dot scan form and prepare/scan overlap were measured in session 8 and removed (slower / no
# gain: gdn_sweep_s8m_nvidia_h200.json). The scan's state path alone (no q / Aqk loads, no output dots or stores)
# took half the scan's time on every shape (gdn_sweep_s8o_nvidia_h200.json: 397B-TP8 1x32768 0.72 -> 0.36 ms), so
# now: scan_config SPLIT (the scan leaves chunk states and V', a parallel launch computes the output) against the
# default, every kernel timed together and the call's wall time, from few (sequence, head) pairs to many.
SWEEP_PREFILL_M = {
    "397B-TP8 1x32768": ("397B-TP8", [32768]),
    "27B-TP4 1x32768": ("27B-TP4", [32768]),
    "397B-TP8 1x8192": ("397B-TP8", [8192]),
    "27B-TP4 1x8192": ("27B-TP4", [8192]),
    "397B-TP8 1x2048": ("397B-TP8", [2048]),
    "397B-TP8 2x8192": ("397B-TP8", [8192] * 2),
    "35B-A3B-TP1 1x32768": ("35B-A3B-TP1", [32768]),
    "27B-TP1 1x32768": ("27B-TP1", [32768]),
}
BOTH_VARIANTS_M = [{"scan": None}] + [{"scan": {"BV": bv, "num_warps": 4, "num_stages": st, "SPLIT": True}}
                                      for bv in (16, 32, 64) for st in (3, 4)]


# Set n: set m's variants at four shapes, for a run with DISABLE_MMA_V3=1 (Triton then builds dots from
# register-operand mma.sync instead of warpgroup wgmma; a separate TRITON_CACHE_DIR) against one without: every scan
# slower that way (gdn_sweep_s8n_v2 vs s8n_v3_nvidia_h200.json; 397B-TP8 1x32768 split scan 0.46 -> 0.86 ms).
# (A prepare and scan running at once, the scan on a high-priority stream waiting on per-(chunk, head) ready flags
# and preparing unclaimed chunks itself, was built and timed in session 8 and removed (gdn_sweep_s8v_nvidia_h200.json):
# the scan took 1.23-1.37 ms instead of 0.46 at 397B-TP8 1x32768 (cause not isolated: prepare programs beside it,
# 500 bytes of spills from the inline prepare path, or its pipeline restarting at every block of flags), and with
# more scan programs than SMs the two crawled (27B-TP1 8x4096 11.9 ms against 2.19).)
SWEEP_PREFILL_N = {k: SWEEP_PREFILL_M[k] for k in ("397B-TP8 1x32768", "27B-TP4 1x32768", "35B-A3B-TP1 1x32768")}
SWEEP_PREFILL_N["27B-TP1 8x4096"] = ("27B-TP1", [4096] * 8)


# Set p: the split scan's pipeline depth (BV 16; 4 stages take 143 KB of shared memory, each more ~35 KB) where
# the heuristic splits (<= 16 pairs, sequences >= 1024 tokens). (Also timed in session 8 and not kept: the output
# kernel recomputing V' = U - W S_c so the scan stores only the chunk states: scan 0.460 -> 0.437 ms, output 0.104
# -> 0.170 at 397B-TP8 1x32768; gdn_sweep_s8q_nvidia_h200.json. Storing the states is most of the split's cost.)
SWEEP_PREFILL_P = {k: SWEEP_PREFILL_M[k] for k in ("397B-TP8 1x32768", "27B-TP4 1x32768", "397B-TP8 1x8192",
                                                  "27B-TP4 1x8192", "397B-TP8 2x8192")}
BOTH_VARIANTS_P = [{"scan": None}] + [{"scan": {"BV": 16, "num_warps": 4, "num_stages": st, "SPLIT": True}}
                                      for st in (5, 6)]


# Set i: the prepare's inverse with its merges on the diagonal blocks only (BLOCK_INV 1: the merges inside 16-row
# blocks as one batch of [C/16, 16, 16] products; 2: every merge, 32 -> 64 on the quadrants) against four full
# 64-row tf32 merges (2.1 M multiply-adds per chunk and head, ~35 % of the kernel in set f), and the variants'
# accuracy on the hard keys. Runs (session 9, gdn_sweep_s9i*_nvidia_h200.json): (1) BLOCK_INV 1 1.306 -> 1.092 ms
# at 27B-TP1 8x4096 (inverse phase 0.46 -> 0.22), the same output to every digit; BLOCK_INV 2 slower (1.547: its
# reshuffles between layouts cost more than the products it saves). (2) SCALE_K (W = (T diag(beta)) (diag(exp(g) /
# |k|) K): one T operand for the W and U products, half the spills) on top: 1.090 -> 1.057 ms, 0.739 -> 0.715 at 35B
# 1x32768; a 184-register cap slower. (3) One program per (chunk, key head) for its HV / H value heads, the q / k
# products and norms once (code since removed): ~850 bytes of spills at the 168 cap and slower at every cap
# (27B-TP1 8x4096 1.083 -> 1.828 / 1.597 / 1.281 ms at caps 168 / 200 / none; 397B-TP8 1x32768 0.189 -> 0.216 at
# best). (4) These rows: the default against the full-tile merges, SCALE_K off, truncations and other caps.
SWEEP_PREFILL_I = dict(SWEEP_PREFILL_F)
SWEEP_PREFILL_I["35B-A3B-TP1 1x32768"] = ("35B-A3B-TP1", [32768])
SWEEP_PREFILL_I["397B-TP8 1x32768"] = ("397B-TP8", [32768])
PREPARE_VARIANTS_I = [{"num_warps": 4, "num_stages": 1, "maxnreg": 168, **extra} for extra in (
    {}, {"BLOCK_INV": 0, "SCALE_K": False}, {"SCALE_K": False}, {"STOP": 3}, {"STOP": 4}, {"maxnreg": 128},
    {"maxnreg": 152})]


# (A set r, session 9: the split scan two chunks per step, chunk 2's V' rewritten on inputs alone, was 2.4x slower,
# 0.459 -> 1.097 ms at 397B-TP8 1x32768 (255 registers and spills), and wrong in bf16; removed, results in
# gdn_sweep_s9r_nvidia_h200.json.)
# Set q: the decode step launched with programmatic dependent launch (each step's start-up overlapping the one
# before; kernels_triton._pdl) against without, on the heuristic's blocks, through CUDA graphs.
DECODE_SWEEP_Q = [(h, B) for h in ("27B-TP1", "27B-TP4", "35B-A3B-TP1", "397B-TP8") for B in (1, 8, 32, 128, 512)]
DECODE_VARIANTS_Q = [{"PDL": False}, {"PDL": True}]


# Set s: one long sequence of a split scan in parts (scan_config SEGMENTS): the scan parts in order on a
# high-priority stream, part i's output kernel on the caller's stream beside scan part i + 1 (SEG_PREPARE: the
# prepare in parts too, part i + 1's beside scan part i), the state carried between parts in fp32. At few pairs the
# split scan holds 64-96 of the 132 SMs for 0.45 ms while the output (0.10-0.15 ms) and the prepare (0.18-0.27)
# ran before / after it. Set t: the same at 32-48 pairs, where the one-pass scan is the default. Outcome (session 10,
# gdn_sweep_s10s / s10t_nvidia_h200.json; the code changed after set s's run, see tuning/notes_gdn.md): parts with
# their prepare beside the scan are the default for one sequence of >= 16384 tokens at <= 16 pairs; at 32-48 pairs
# the split scan in parts stays slower than the one-pass scan.
SWEEP_PREFILL_S = {k: SWEEP_PREFILL_M[k] for k in ("397B-TP8 1x32768", "27B-TP4 1x32768", "397B-TP8 1x8192",
                                                  "27B-TP4 1x8192")}
SWEEP_PREFILL_S["397B-TP8 1x65536"] = ("397B-TP8", [65536])
_SPLIT_16 = {"BV": 16, "num_warps": 4, "num_stages": 4, "SPLIT": True}
BOTH_VARIANTS_S = [{"scan": None}] + [{"scan": dict(_SPLIT_16, SEGMENTS=n, SEG_PREPARE=p)}
                                      for n in (2, 4, 8) for p in (False, True)]
SWEEP_PREFILL_T = {k: SWEEP_PREFILL_M[k] for k in ("35B-A3B-TP1 1x32768", "27B-TP1 1x32768")}
BOTH_VARIANTS_T = [{"scan": None}] + [{"scan": {"BV": bv, "num_warps": 4, "num_stages": 3, "SPLIT": True,
                                                "SEGMENTS": n, "SEG_PREPARE": p}}
                                      for bv in (32, 64) for n, p in ((1, False), (4, False), (4, True), (8, True))]


# Set u: the one-pass scan with the whole V width per program (BV 128: one program per (sequence, head) pair,
# W / K / Q tiles loaded once per pair instead of once per 64-wide block) where there are many pairs and the 64-wide
# scan runs several waves of one program per SM (27B-TP1 8x4096: 768 programs, ~6 waves). Outcome (session 10,
# gdn_sweep_s10u_nvidia_h200.json): slower everywhere (27B-TP1 8x4096 0.813 -> 1.112 ms at 8 warps / 2 stages, 1.653
# at 4 warps; 3 stages need 238.6 KB of shared memory); BV 64 at 8 warps slower too (1.091).
SWEEP_PREFILL_U = {"27B-TP1 8x4096": ("27B-TP1", [4096] * 8), "35B-A3B-TP1 8x4096": ("35B-A3B-TP1", [4096] * 8),
                   "27B-TP4 8x4096": ("27B-TP4", [4096] * 8), "27B-TP1 1x32768": ("27B-TP1", [32768])}
SCAN_VARIANTS_U = [{"BV": bv, "num_warps": w, "num_stages": st} for bv, w, st in (
    (64, 4, 3), (128, 8, 2), (128, 8, 3), (128, 4, 2), (64, 8, 3))]


# Sets that sweep one phase: set -> (phase, its variants).
ONE_PHASE_SETS = {"c": ("prepare", PREPARE_VARIANTS_C), "d": ("decode", DECODE_VARIANTS_D),
                  "e": ("scan", SCAN_VARIANTS_E), "f": ("prepare", PREPARE_VARIANTS_F),
                  "h": ("prepare", PREPARE_VARIANTS_H), "m": ("both", BOTH_VARIANTS_M),
                  "n": ("both", BOTH_VARIANTS_M),
                  "p": ("both", BOTH_VARIANTS_P), "i": ("prepare", PREPARE_VARIANTS_I),
                  "q": ("decode", DECODE_VARIANTS_Q), "s": ("both", BOTH_VARIANTS_S), "t": ("both", BOTH_VARIANTS_T),
                  "u": ("scan", SCAN_VARIANTS_U)}


def all_variants(sweep_set: str = "a") -> list[tuple[str, dict]]:
    if sweep_set in ONE_PHASE_SETS:
        phase, variants = ONE_PHASE_SETS[sweep_set]
        return [(phase, c) for c in variants]
    if sweep_set == "b":
        return ([("prepare", c) for c in PREPARE_VARIANTS_B] + [("scan", c) for c in SCAN_VARIANTS]
                + [("decode", {"BV": 16, "num_warps": 1}), ("decode", {"BV": 64, "num_warps": 4})])
    return ([("prepare", c) for c in PREPARE_VARIANTS] + [("scan", c) for c in SCAN_VARIANTS]
            + [("decode", c) for c in DECODE_VARIANTS])


def _decode_fn(d: dict, cfg: dict | None = None):
    import kernels_triton as kt

    return lambda: kt.gdn_recurrent_step(
        d["q"], d["k"], d["v"], state_pool=d["pool"], state_slots=d["slots"], a=d["a"], b=d["b"],
        A_log=d["A_log"], dt_bias=d["dt_bias"], use_qk_l2norm=True, step_config=cfg)


def warm(index: int, sweep_set: str = "a") -> None:
    """Compile variant ``index`` of :func:`all_variants` on a tiny input (same specialisation as the sweep):
    several of these run in parallel processes before a sweep, which then finds every kernel in Triton's cache."""
    import kernels_triton as kt

    phase, cfg = all_variants(sweep_set)[index]
    if phase == "decode":
        _decode_fn(_decode_inputs(2, 2, 8), cfg)()
    elif phase == "both":  # one sequence of four chunks (segments: first, middle and last parts)
        d = _prefill_inputs([256], 2, 8)
        _ours_prefill(d, kt.prepare_gdn_metadata(d["cu"]),
                      **{f"{part}_config": c for part, c in cfg.items() if c is not None})()
    else:
        d = _prefill_inputs([64, 64], 2, 8)
        _ours_prefill(d, kt.prepare_gdn_metadata(d["cu"]), **{f"{phase}_config": cfg})()
    torch.cuda.synchronize()


def prepare_variant_errors(rows: list[dict], save=lambda: None, variants: list[dict] | None = None,
                           hard: bool = False) -> None:
    """Relative error of the output for every prepare variant (default: the second round's) against the fp64
    reference, on all-positive (strongly correlated) keys with weak decay: the hard case for the inverse;
    ``hard``: keys |z| + 1, beta near 1 and almost no decay, where a cancelling inverse fails."""
    import kernels_triton as kt
    from qwen35 import reference as ref

    lens, (H, HV) = ([1024, 77] if hard else [8192, 777]), HEADS["27B-TP4"]
    d = _prefill_inputs(lens, H, HV, seed=3)
    d["k"] = d["k"].abs() + (1.0 if hard else 0.5)
    d["a"] = d["a"] - (20.0 if hard else 4.0)  # decay: none to speak of / weak
    if hard:
        d["b"] = d["b"].abs() + 3.0  # beta = sigmoid(b) in [0.95, 1)
    f64 = {n: d[n].double() for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "h0")}
    want, _ = ref.gdn_chunk_prefill(f64["q"], f64["k"], f64["v"], a=f64["a"], b=f64["b"], A_log=f64["A_log"],
                                    dt_bias=f64["dt_bias"], cu_seqlens=d["cu"], initial_state=f64["h0"],
                                    use_qk_l2norm=True)
    meta = kt.prepare_gdn_metadata(d["cu"])
    label = ("27B-TP4 1024+77 keys |z|+1, beta near 1, no decay" if hard
             else "27B-TP4 8192+777 correlated keys, weak decay")
    for cfg in variants or PREPARE_VARIANTS_B:
        got, _ = _ours_prefill(d, meta, prepare_config=cfg)()
        err = float((got.double() - want).norm() / want.norm())
        rows.append({"sweep": "prepare accuracy", "shape": label, "config": cfg, "rel_err": err,
                     "finite": bool(torch.isfinite(got).all())})
        print(rows[-1], flush=True)
        save()


def sweep_b(args, rows: list[dict], deadline: float, save=lambda: None) -> None:
    """Second round: prepare variants around the first winner (time and accuracy) and scan stages at
    4096-token sequences. Third round (``--sweep-set c``): the exact-inverse prepare variants only, their
    accuracy also on the hard keys."""
    third = args.sweep_set == "c"
    prepare_variants = PREPARE_VARIANTS_C if third else PREPARE_VARIANTS_B
    shapes = {"27B-TP1 1x32768": ("27B-TP1", [32768]), "27B-TP4 8x4096": ("27B-TP4", [4096] * 8),
              "27B-TP1 8x4096": ("27B-TP1", [4096] * 8)}
    for label, shape in shapes.items():
        variants = [("prepare", c) for c in prepare_variants] if label != "27B-TP1 8x4096" else []
        if label != "27B-TP1 1x32768" and not third:
            variants += [("scan", c) for c in SCAN_VARIANTS if c["BV"] >= 32]
        _sweep_prefill(rows, deadline, {label: shape}, variants, save)
        if time.time() > deadline:
            return
    prepare_variant_errors(rows, save, prepare_variants)
    if third:
        prepare_variant_errors(rows, save, prepare_variants, hard=True)


def sweep(args, rows: list[dict], deadline: float, save=lambda: None) -> None:
    """GPU kernel time (torch.profiler) of every prepare and scan variant on the sweep shapes, and decode
    variants through CUDA graphs."""
    if args.sweep_set in ("b", "c"):
        sweep_b(args, rows, deadline, save)
        return
    if args.sweep_set in ("d", "q"):
        shapes, variants = (DECODE_SWEEP_D, DECODE_VARIANTS_D) if args.sweep_set == "d" else (DECODE_SWEEP_Q,
                                                                                               DECODE_VARIANTS_Q)
        sweep_decode(rows, deadline, shapes, variants, save)
        return
    shapes = {"e": SWEEP_PREFILL_E, "f": SWEEP_PREFILL_F, "h": SWEEP_PREFILL_F, "m": SWEEP_PREFILL_M,
              "n": SWEEP_PREFILL_N, "p": SWEEP_PREFILL_P, "i": SWEEP_PREFILL_I, "s": SWEEP_PREFILL_S,
              "t": SWEEP_PREFILL_T, "u": SWEEP_PREFILL_U}
    if args.sweep_set in shapes:
        _sweep_prefill(rows, deadline, shapes[args.sweep_set], all_variants(args.sweep_set), save)
        if args.sweep_set in ("f", "h", "i"):  # prepare variants: their accuracy too
            accuracy = [c for _, c in all_variants(args.sweep_set) if "STOP" not in c and c.get("maxnreg") == 168]
            prepare_variant_errors(rows, save, accuracy)
            prepare_variant_errors(rows, save, accuracy, hard=True)
        return

    for label, shape in SWEEP_PREFILL.items():
        variants = [("prepare", c) for c in PREPARE_VARIANTS]
        if label in ("27B-TP1 1x32768", "397B-TP8 1x65536"):
            variants += [("scan", c) for c in SCAN_VARIANTS]
        _sweep_prefill(rows, deadline, {label: shape}, variants, save)
        if time.time() > deadline:
            return
    sweep_decode(rows, deadline, DECODE_SWEEP, DECODE_VARIANTS, save)


def _sweep_prefill(rows: list[dict], deadline: float, shapes: dict, variants: list[tuple[str, dict]],
                   save=lambda: None) -> None:
    """GPU kernel time (torch.profiler) of each (phase, config) variant on each prefill shape."""
    import kernels_triton as kt

    for label, (hname, lens) in shapes.items():
        H, HV = HEADS[hname]
        d = _prefill_inputs(lens, H, HV)
        meta = kt.prepare_gdn_metadata(d["cu"])
        for phase, cfg in variants:
            if time.time() > deadline:
                print("sweep: deadline reached", flush=True)
                return
            try:
                if phase == "both":  # {"prepare": config or None, "scan": config or None}: every kernel, summed
                    kw = {f"{part}_config": c for part, c in cfg.items() if c is not None}
                    name = "_chunk_"
                else:
                    kw = {f"{phase}_config": cfg}
                    name = "_chunk_scan_kernel" if phase == "scan" else "_chunk_prepare_kernel"
                fn = _ours_prefill(d, meta, **kw)
                kernels = kernel_times_ms(fn, calls=3)
                rows.append({"sweep": phase, "shape": label, "config": cfg, "kernel_ms": round(
                    sum(v for k, v in kernels.items() if k.startswith(name)), 4),
                    "kernels_ms": {k: round(v, 4) for k, v in kernels.items()}})
                if phase == "both":  # the call's time by events, gaps included (TEARDOWN_CUPTI=1 for clean ones)
                    rows[-1]["wall_ms"] = round(_bench.time_ms(fn), 4)
                    rows[-1]["graph_ms"] = round(_bench.time_graph_ms(fn, calls_per_graph=5, rep=10), 4)
            except Exception as e:  # noqa: BLE001
                rows.append({"sweep": phase, "shape": label, "config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
            print(rows[-1], flush=True)
            save()
        del d
        torch.cuda.empty_cache()


def sweep_decode(rows: list[dict], deadline: float, shapes, variants: list[dict], save=lambda: None) -> None:  # noqa: ANN001
    """Decode step variants through CUDA graphs (GPU time per call, state traffic rate)."""
    for hname, B in shapes:
        H, HV = HEADS[hname]
        d = _decode_inputs(B, H, HV)
        for cfg in variants:
            if time.time() > deadline:
                return
            try:
                ms = _bench.time_graph_ms(_decode_fn(d, cfg))
                rows.append({"sweep": "decode", "shape": f"{hname} B={B}", "config": cfg, "us": round(ms * 1e3, 2),
                             "state_GBps": round(2 * B * HV * K * V * 4 / ms / 1e6)})
            except Exception as e:  # noqa: BLE001
                rows.append({"sweep": "decode", "shape": f"{hname} B={B}", "config": cfg,
                             "error": f"{type(e).__name__}: {e}"[:300]})
            print(rows[-1], flush=True)
            save()


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
    parser.add_argument("--no-fla", action="store_true", help="skip the FLA anchor (DESIGN.md figures are used)")
    parser.add_argument("--fla-deadline", type=float, default=1e9,
                        help="seconds after start beyond which FLA prefill anchors are not run (autotune is slow)")
    parser.add_argument("--sweep-deadline", type=float, default=1e9, help="seconds after start to stop the sweep")
    parser.add_argument("--tag", default="", help="inserted into the result file names (gdn_<tag>_<device>.json)")
    parser.add_argument("--sweep-set", default="a", choices=("a", "b", "c", "d", "e", "f", "h", "i", "m", "n", "p",
                                                              "q", "s", "t", "u"),
                        help="a: first round; b: around its winner; c: exact diagonal inverses (8/4-row blocks); "
                             "d: decode blocks with and without streaming cache hints; e: scan V blocks at 35B; "
                             "f: prepare time by phase (truncations) and variants of its default; "
                             "h: its column blocks; m: the output split from the scan; "
                             "n: set m at four shapes (for DISABLE_MMA_V3 runs); p: the split scan's stages; "
                             "i: the inverse's merges on its diagonal blocks; q: the decode step with PDL; "
                             "s / t: one sequence's split scan in overlapping parts at few / 32-48 pairs; "
                             "u: the one-pass scan at BV 128")
    parser.add_argument("--sweep-only", action="store_true", help="with --sweep: stop after the sweep")
    parser.add_argument("--warm", type=int, default=None,
                        help="only compile variant N of the sweep (run several in parallel before a sweep)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn needs a CUDA device", file=sys.stderr)
        return 2
    if args.warm is not None:
        warm(args.warm, args.sweep_set)
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
        sweep_rows: list[dict] = []
        sweep(args, sweep_rows, start + args.sweep_deadline,
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
