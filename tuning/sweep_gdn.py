"""Launch-config sweeps of the GDN kernels (``python -m tuning.bench_gdn --sweep --sweep-set X``): GPU kernel time
(torch.profiler) of forced prepare / scan configs on prefill shapes, decode-step configs through CUDA graphs, and
the output error of prepare variants on strongly correlated keys. Configs are forced through
:mod:`kernels_triton.gdn.bench_api`; what each set found is in tuning/notes_gdn.md. Reports, never asserts.
"""

from __future__ import annotations

import time

import torch

from tuning import _bench
from tuning.bench_gdn import HEADS, K, V, _decode_fn, _decode_inputs, _ours_prefill, _prefill_inputs, kernel_times_ms

P1 = {"num_warps": 4, "num_stages": 1}  # the prepare kernel's launch options (its loops are not pipelined)
SHAPES = {
    "27B-TP1 1x8192": ("27B-TP1", [8192]), "27B-TP1 1x32768": ("27B-TP1", [32768]),
    "27B-TP1 8x4096": ("27B-TP1", [4096] * 8), "27B-TP1 64x512": ("27B-TP1", [512] * 64),
    "27B-TP4 1x8192": ("27B-TP4", [8192]), "27B-TP4 1x32768": ("27B-TP4", [32768]),
    "27B-TP4 8x4096": ("27B-TP4", [4096] * 8),
    "35B-A3B-TP1 1x8192": ("35B-A3B-TP1", [8192]), "35B-A3B-TP1 1x32768": ("35B-A3B-TP1", [32768]),
    "35B-A3B-TP1 8x4096": ("35B-A3B-TP1", [4096] * 8),
    "397B-TP8 1x2048": ("397B-TP8", [2048]), "397B-TP8 1x8192": ("397B-TP8", [8192]),
    "397B-TP8 2x8192": ("397B-TP8", [8192] * 2), "397B-TP8 1x32768": ("397B-TP8", [32768]),
    "397B-TP8 1x65536": ("397B-TP8", [65536]),
}


def _shapes(*names: str) -> dict:
    return {n: SHAPES[n] for n in names}


_SPLIT_16 = {"BV": 16, "num_warps": 4, "num_stages": 4, "SPLIT": True}
_MANY = ("27B-TP1 1x32768", "397B-TP8 1x65536", "27B-TP4 8x4096", "27B-TP1 64x512")
_SPLIT_SHAPES = ("397B-TP8 1x32768", "27B-TP4 1x32768", "397B-TP8 1x8192", "27B-TP4 1x8192", "397B-TP8 1x2048",
                 "397B-TP8 2x8192", "35B-A3B-TP1 1x32768", "27B-TP1 1x32768")
_DECODE_SHAPES = (("27B-TP1", 1), ("35B-A3B-TP1", 1), ("27B-TP4", 1), ("397B-TP8", 1), ("397B-TP8", 128),
                  ("27B-TP4", 128), ("35B-A3B-TP1", 128))
# set -> (what it varies, prefill shapes, [(phase, config)], decode shapes, also the prepare variants' accuracy).
# phase: "prepare" / "scan" (one kernel's time), "both" ({"prepare": cfg, "scan": cfg}: every kernel and the
# call's time), "decode" (the step through CUDA graphs).
SETS: dict[str, tuple[str, dict, list, tuple, bool]] = {
    "a": ("prepare register caps and warps, scan V blocks and stages, decode blocks", _shapes(*_MANY),
          [("prepare", dict(P1, **x)) for x in ({}, {"maxnreg": 168}, {"maxnreg": 128}, {"num_warps": 8},
                                                  {"num_warps": 8, "maxnreg": 128})]
          + [("scan", {"BV": bv, "num_warps": 4, "num_stages": st}) for bv in (16, 32, 64) for st in (2, 3)]
          + [("decode", {"BV": bv, "num_warps": w}) for bv, w in ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2),
                                                                   (32, 4), (64, 2), (64, 4), (128, 4), (128, 8))],
          (("27B-TP1", 1), ("35B-A3B-TP1", 1), ("27B-TP4", 1), ("397B-TP8", 128), ("27B-TP1", 128)), False),
    "c": ("the diagonal inverse's block rows (16 / 8 / 4) with register caps",
          _shapes("27B-TP1 1x32768", "27B-TP4 8x4096"),
          [("prepare", dict(P1, **x)) for x in ({}, {"maxnreg": 168}, {"DIAG_ROWS": 8},
                                                  {"DIAG_ROWS": 8, "maxnreg": 168}, {"DIAG_ROWS": 4},
                                                  {"DIAG_ROWS": 4, "maxnreg": 168}, {"DIAG_ROWS": 4, "maxnreg": 152})],
          (), True),
    "d": ("decode blocks with and without streaming cache hints on the state", {},
          [("decode", {"BV": bv, "num_warps": w, **x}) for bv, w in ((16, 1), (32, 1), (32, 2), (64, 4))
           for x in ({}, {"STREAM": True})], _DECODE_SHAPES, False),
    "e": ("scan V blocks, warps and stages at 32-48 pairs",
          _shapes("35B-A3B-TP1 1x8192", "35B-A3B-TP1 1x32768", "35B-A3B-TP1 8x4096", "27B-TP1 1x8192",
                  "27B-TP1 1x32768", "27B-TP1 8x4096"),
          [("scan", {"BV": bv, "num_warps": w, "num_stages": st}) for bv, w, st in (
              (64, 4, 3), (64, 4, 2), (32, 4, 3), (32, 4, 2), (16, 4, 3), (64, 8, 3), (64, 4, 1), (16, 4, 2))],
          (), False),
    "h": ("the prepare's q / k / v column blocks", _shapes("27B-TP1 8x4096", "35B-A3B-TP1 8x4096", "27B-TP4 1x32768"),
          [("prepare", {**P1, "maxnreg": 168, **x}) for x in ({}, {"BKC": 32, "BVC": 32}, {"BKC": 32},
                                                              {"BKC": 32, "BVC": 32, "maxnreg": 160},
                                                              {"BKC": 32, "BVC": 32, "maxnreg": 184})], (), False),
    "i": ("the inverse's merges on its diagonal blocks (BLOCK_INV), W from T diag(beta) (SCALE_K), register caps",
          _shapes("27B-TP1 8x4096", "35B-A3B-TP1 8x4096", "27B-TP4 1x32768", "35B-A3B-TP1 1x32768",
                  "397B-TP8 1x32768"),
          [("prepare", {**P1, "maxnreg": 168, **x}) for x in ({}, {"BLOCK_INV": 0, "SCALE_K": False},
                                                              {"SCALE_K": False}, {"maxnreg": 128},
                                                              {"maxnreg": 152})], (), True),
    "m": ("the split scan (output in a parallel launch) against the one-pass scan", _shapes(*_SPLIT_SHAPES),
          [("both", {"scan": None})] + [("both", {"scan": {"BV": bv, "num_warps": 4, "num_stages": st, "SPLIT": True}})
                                        for bv in (16, 32, 64) for st in (3, 4)], (), False),
    "p": ("the split scan's pipeline depth", _shapes(*_SPLIT_SHAPES[:6]),
          [("both", {"scan": None})] + [("both", {"scan": dict(_SPLIT_16, num_stages=st)}) for st in (5, 6)], (),
          False),
    "q": ("the decode step with and without programmatic dependent launch", {},
          [("decode", {"PDL": False}), ("decode", {"PDL": True})],
          tuple((h, B) for h in ("27B-TP1", "27B-TP4", "35B-A3B-TP1", "397B-TP8") for B in (1, 8, 32, 128, 512)),
          False),
    "s": ("one sequence's split scan in overlapping parts (SEGMENTS, SEG_PREPARE) at few pairs",
          _shapes("397B-TP8 1x32768", "27B-TP4 1x32768", "397B-TP8 1x8192", "27B-TP4 1x8192", "397B-TP8 1x65536"),
          [("both", {"scan": None})] + [("both", {"scan": dict(_SPLIT_16, SEGMENTS=n, SEG_PREPARE=p)})
                                        for n in (2, 4, 8) for p in (False, True)], (), False),
    "t": ("one sequence in parts at 32-48 pairs, split and one-pass", _shapes("35B-A3B-TP1 1x32768", "27B-TP1 1x32768"),
          [("both", {"scan": None})] + [("both", {"scan": {"BV": bv, "num_warps": 4, "num_stages": 3, "SPLIT": True,
                                                          "SEGMENTS": n, "SEG_PREPARE": p}})
                                        for bv in (32, 64) for n, p in ((1, False), (4, False), (4, True), (8, True))],
          (), False),
    "u": ("the one-pass scan with the whole V width per program",
          _shapes("27B-TP1 8x4096", "35B-A3B-TP1 8x4096", "27B-TP4 8x4096", "27B-TP1 1x32768"),
          [("scan", {"BV": bv, "num_warps": w, "num_stages": st}) for bv, w, st in (
              (64, 4, 3), (128, 8, 2), (128, 8, 3), (128, 4, 2), (64, 8, 3))], (), False),
}


def variants(sweep_set: str) -> list[tuple[str, dict]]:
    return SETS[sweep_set][2]


def warm(index: int, sweep_set: str = "a") -> None:
    """Compile variant ``index`` of ``sweep_set`` on a tiny input (same specialisation as the sweep): several of these
    run in parallel processes before a sweep, which then finds every kernel in Triton's cache."""
    import kernels_triton as kt

    phase, cfg = variants(sweep_set)[index]
    if phase == "decode":
        _decode_fn(_decode_inputs(2, 2, 8), cfg)()
    elif phase == "both":  # one sequence of four chunks (segments: first, middle and last parts)
        d = _prefill_inputs([256], 2, 8)
        _ours_prefill(d, kt.prepare_gdn_metadata(d["cu"]), **{p: c for p, c in cfg.items() if c is not None})()
    else:
        d = _prefill_inputs([64, 64], 2, 8)
        _ours_prefill(d, kt.prepare_gdn_metadata(d["cu"]), **{phase: cfg})()
    torch.cuda.synchronize()


def prepare_variant_errors(rows: list[dict], save, configs: list[dict], hard: bool = False) -> None:  # noqa: ANN001
    """Relative error of the output for every prepare config against the fp64 reference, on all-positive (strongly
    correlated) keys with weak decay: the hard case for the inverse; ``hard``: keys |z| + 1, beta near 1 and almost
    no decay."""
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
    for cfg in configs:
        got, _ = _ours_prefill(d, meta, prepare=cfg)()
        err = float((got.double() - want).norm() / want.norm())
        rows.append({"sweep": "prepare accuracy", "shape": label, "config": cfg, "rel_err": err,
                     "finite": bool(torch.isfinite(got).all())})
        print(rows[-1], flush=True)
        save()


def sweep(sweep_set: str, rows: list[dict], deadline: float, save=lambda: None) -> None:  # noqa: ANN001
    """Every variant of ``sweep_set`` on its shapes (prefill: GPU kernel time by torch.profiler; decode: CUDA-graph
    time), then (sets that vary the prepare's inverse) each prepare variant's accuracy."""
    _, shapes, variant_list, decode_shapes, accuracy = SETS[sweep_set]
    prefill = [(p, c) for p, c in variant_list if p != "decode"]
    if prefill:
        sweep_prefill(rows, deadline, shapes, prefill, save)
    decode = [c for p, c in variant_list if p == "decode"]
    if decode and time.time() < deadline:
        sweep_decode(rows, deadline, decode_shapes, decode, save)
    if accuracy and time.time() < deadline:
        configs = [c for p, c in variant_list if p == "prepare"]
        prepare_variant_errors(rows, save, configs)
        prepare_variant_errors(rows, save, configs, hard=True)


def sweep_prefill(rows: list[dict], deadline: float, shapes: dict, variant_list: list[tuple[str, dict]],
                  save=lambda: None) -> None:  # noqa: ANN001
    """GPU kernel time (torch.profiler) of each (phase, config) variant on each prefill shape."""
    import kernels_triton as kt
    from kernels_triton.gdn.bench_api import PREFILL_KERNELS

    for label, (hname, lens) in shapes.items():
        H, HV = HEADS[hname]
        d = _prefill_inputs(lens, H, HV)
        meta = kt.prepare_gdn_metadata(d["cu"])
        for phase, cfg in variant_list:
            if time.time() > deadline:
                print("sweep: deadline reached", flush=True)
                return
            try:
                if phase == "both":  # {"prepare": config or None, "scan": config or None}: every kernel, summed
                    kw = {p: c for p, c in cfg.items() if c is not None}
                    names = tuple(PREFILL_KERNELS.values())
                else:
                    kw = {phase: cfg}
                    names = (PREFILL_KERNELS[phase],)
                fn = _ours_prefill(d, meta, **kw)
                kernels = kernel_times_ms(fn, calls=3)
                rows.append({"sweep": phase, "shape": label, "config": cfg, "kernel_ms": round(
                    sum(v for k, v in kernels.items() if k.startswith(names)), 4),
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


def sweep_decode(rows: list[dict], deadline: float, shapes, configs: list[dict], save=lambda: None) -> None:  # noqa: ANN001
    """Decode step configs through CUDA graphs (GPU time per call, state traffic rate)."""
    for hname, B in shapes:
        H, HV = HEADS[hname]
        d = _decode_inputs(B, H, HV)
        for cfg in configs:
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
