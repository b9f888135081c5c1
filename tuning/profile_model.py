"""``python -m tuning.bench_model --out DIR --profile [--timed] [--sdpa] [--lag] [--tag NAME]``: our model alone.

Builds the standalone model at bench_model's width with random weights (no HF model) and runs a 1x8192 and an
8x4096 prefill and eager decode steps at B=1/16 (4096 context) under torch.profiler: device time per innermost range
(façade op, projection, attention, MLP, layer glue, LM head; kernels are tied to their launching call through the
trace's correlation ids, Triton launches included), host time per range, top kernels and top CPU ops, to
``model_profile[_TAG].json``. ``--lag`` first records, without the profiler, when the GPU reaches each layer of those
prefills vs when the host launched it (:func:`lag_trace`). ``--timed`` adds bench_model's prefill and decode rows,
``--sdpa`` which SDPA kernel torch picks per attention shape and its cost.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from tuning import _bench
from tuning.bench_model import WIDTH, _prompts, decode_rows, fill_context, fresh_step, hf_config_fields, prefill_row

PROFILE_PREFILLS = [(1, 8192), (8, 4096)]
PROFILE_DECODES = [1, 16]
RANGE = "q35|"  # prefix of the profiler ranges the breakdown attributes kernels to


def build_ours_random(layers: int, max_seqs: int, max_len: int, dtype: torch.dtype = torch.bfloat16):
    """Our standalone model alone (no HF build), random weights: matrices N(0, 0.02), zero-centred norm
    weights near 0, the GDN output norm's plain weight near 1, decay parameters in their usual ranges."""
    from qwen35.config import Qwen35Config
    from qwen35.standalone import Qwen35Standalone

    cfg = Qwen35Config.from_dict({"architectures": ["Qwen3_5MoeForCausalLM"], **hf_config_fields(layers)})
    ours = Qwen35Standalone(cfg, device="cuda", dtype=dtype, max_seqs=max_seqs, max_len=max_len)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in ours.model.named_parameters():
            if name.endswith("mixer.norm_weight"):
                p.normal_(1.0, 0.02, generator=gen)
            elif name.endswith("norm_weight"):
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("A_log"):
                p.uniform_(0.0, 2.7, generator=gen)  # exp(A_log) in 1..16
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return ours


def _ranged(name: str, fn):
    def wrapped(*args, **kw):
        with torch.profiler.record_function(RANGE + name):
            return fn(*args, **kw)
    return wrapped


def install_ranges(ours):
    """Profiler ranges around every façade op, projection, attention, MoE block, layer and the LM head,
    so each kernel can be attributed to the innermost range that launched it. Returns an undo function."""
    from qwen35 import ops

    saved_ops = {op: getattr(ops, op) for op in ops.__all__ if callable(getattr(ops, op))}
    for op, fn in saved_ops.items():
        setattr(ops, op, _ranged(f"op:{op}", fn))
    model = ours.model
    for layer in model.layers:
        kind = "gdn" if layer.layer_type == "linear_attention" else "attn"
        layer.forward = _ranged(f"layer:{kind}", layer.forward)
        mixer = layer.mixer
        for proj in ("in_proj", "out_proj", "qkv_proj", "o_proj"):
            if hasattr(mixer, proj):
                getattr(mixer, proj).forward = _ranged(f"proj:{kind}.{proj}", getattr(mixer, proj).forward)
        if hasattr(mixer, "attn"):
            mixer.attn.forward = _ranged("attn:sdpa+kv_write", mixer.attn.forward)
        layer.mlp.forward = _ranged("mlp", layer.mlp.forward)
    model.embed_tokens.forward = _ranged("embed", model.embed_tokens.forward)
    model.logits = _ranged("lm_head", model.logits)
    ours._layout = _ranged("host:layout", ours._layout)
    patched = [ours, model, model.embed_tokens] + [m for layer in model.layers
                                                   for m in (layer, layer.mlp, *layer.mixer.children())]

    def undo() -> None:
        for op, fn in saved_ops.items():
            setattr(ops, op, fn)
        for obj in patched:
            for attr in ("forward", "logits", "_layout"):
                obj.__dict__.pop(attr, None)
    return undo


def _innermost_range(evt) -> str:
    e = evt
    while e is not None:
        if e.name.startswith(RANGE):
            return e.name[len(RANGE):]
        e = e.cpu_parent
    return "outside any range"


def device_time_by_range(trace: dict) -> tuple[dict[str, float], dict[str, list[float]]]:
    """From a chrome trace: device time (ms) per innermost range and per kernel name ([calls, ms]).

    A kernel, copy or memset is tied to the runtime / driver call that launched it (same
    ``correlation``), and that call to the innermost profiler range open on its thread at that time;
    this covers Triton's driver-API launches, which torch's own event tree leaves unattributed.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges: dict[object, list[tuple[float, float, str]]] = {}
    launches: dict[object, tuple[object, float]] = {}
    for e in events:
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "user_annotation" and name.startswith(RANGE):
            ranges.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e.get("dur", 0), name[len(RANGE):]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e["tid"], e["ts"])
    by_range: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e.get("dur", 0) / 1e3
        label = "outside any range"
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None:
            tid, ts = launch
            inside = [r for r in ranges.get(tid, []) if r[0] <= ts <= r[1]]
            if inside:
                label = max(inside)[2]  # the latest-opened range holding the launch is the innermost
        by_range[label] = by_range.get(label, 0.0) + ms
        entry = kernels.setdefault(e.get("name", "?")[:140], [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    return by_range, kernels


def breakdown(prof, wall_ms: float, per: int) -> dict:
    """One profiled region, per call: device time and host (self CPU) time per innermost range, the
    top kernels and the top CPU ops."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            by_range, kernels = device_time_by_range(json.load(f))
    host_by_range: dict[str, float] = {}
    for evt in prof.events():
        label = _innermost_range(evt)
        host_by_range[label] = host_by_range.get(label, 0.0) + evt.self_cpu_time_total / 1e3
    total = sum(by_range.values())

    def per_call(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v / per, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    cpu = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:30]
    return dict(
        wall_ms=round(wall_ms / per, 4), kernel_ms=round(total / per, 4),
        gpu_busy_pct=round(100 * total / max(wall_ms, 1e-9), 1),
        by_range_ms=per_call(by_range), host_by_range_ms=per_call(host_by_range),
        top_kernels=[dict(name=n, calls=c / per, ms=round(t / per, 4))
                     for n, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:30]],
        top_cpu_ops=[dict(name=a.key[:140], calls=a.count / per,
                          self_cpu_ms=round(a.self_cpu_time_total / 1e3 / per, 4),
                          cpu_total_ms=round(a.cpu_time_total / 1e3 / per, 4)) for a in cpu])


def _profiled(fn, calls: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) * 1e3
    return breakdown(prof, wall_ms, calls)


def sdpa_diagnostics() -> list[dict]:
    """Which SDPA kernel torch picks for our attention shapes and what each costs, first call included
    (a backend that plans per shape shows it there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    dev, dt = "cuda", torch.bfloat16
    cases = []
    for B in (1, 16):
        for L in (4097, 4098):
            q = torch.randn(B, 2, 8, 256, device=dev, dtype=dt)
            k = torch.randn(B, 2, L, 256, device=dev, dtype=dt)
            mask = (torch.arange(L, device=dev)[None, :] < torch.full((B, 1), L, device=dev))[:, None, None, :]
            cases.append((f"decode B={B} L={L}", q, k, dict(attn_mask=mask)))
    q = torch.randn(1, 16, 8192, 256, device=dev, dtype=dt)
    k = torch.randn(1, 2, 8192, 256, device=dev, dtype=dt)
    cases.append(("prefill 1x8192 causal gqa", q, k, dict(is_causal=True, enable_gqa=True)))
    backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]
    for label, q, k, kw in cases:
        try:
            choice = int(torch._fused_sdp_choice(q, k, k, kw.get("attn_mask"), 0.0, kw.get("is_causal", False),
                                                 enable_gqa=kw.get("enable_gqa", False)))
        except Exception as e:  # noqa: BLE001 - a private API: report what happened
            choice = f"{type(e).__name__}: {str(e)[:80]}"
        for name, backend in backends:
            def call(q=q, k=k, kw=kw, backend=backend):
                if backend is None:
                    return torch.nn.functional.scaled_dot_product_attention(q, k, k, **kw)
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, k, **kw)
            try:
                torch.cuda.synchronize()
                t = time.perf_counter()
                call()
                torch.cuda.synchronize()
                first = (time.perf_counter() - t) * 1e3
                steady = _bench.time_ms(call, warmup=2, rep=5)
                rows.append(dict(case=label, backend=name, torch_choice=choice, first_call_ms=round(first, 3),
                                 steady_ms=round(steady, 4)))
            except Exception as e:  # noqa: BLE001 - unsupported combinations are part of the answer
                rows.append(dict(case=label, backend=name, torch_choice=choice, error=str(e).split("\n")[0][:160]))
    return rows


def print_profile(key: str, p: dict) -> None:
    print(f"\n== {key}: wall {p['wall_ms']} ms, kernels {p['kernel_ms']} ms ({p['gpu_busy_pct']}% busy)")
    host = p["host_by_range_ms"]
    for r in dict.fromkeys([*list(p["by_range_ms"])[:16], *list(host)[:6]]):
        print(f"   {r:<36} gpu {p['by_range_ms'].get(r, 0.0):9.4f} ms   host {host.get(r, 0.0):9.4f} ms")
    for r in p["top_kernels"][:10]:
        print(f"   {r['ms']:9.4f} ms  x{r['calls']:<5g} {r['name'][:90]}")
    for r in p["top_cpu_ops"][:6]:
        print(f"   cpu {r['self_cpu_ms']:9.4f} ms  x{r['calls']:<5g} {r['name'][:80]}")
    sys.stdout.flush()


def lag_trace(ours, n: int, t: int, reps: int = 5) -> dict:
    """Where the GPU waits for the host during one prefill step, without the profiler's own host cost.

    An event is recorded (and the host clock read) at the start of the step, once the step's layout is sent, at
    each layer, when the first GDN layer's core starts (its norm and input projections are queued by then),
    before the LM head and at the end. ``lead_ms`` at a marker = when the GPU reached it minus
    when the host recorded it (both from the step's start, which the GPU reaches at once since it is
    idle): near zero means the GPU had drained its queue and was waiting for the host there; growing
    means the host is ahead. ``gpu_ms`` per segment includes any wait inside it. Median over ``reps`` steps.
    """
    prompts = _prompts(n, t, 3)
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(label: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((label, time.perf_counter(), ev))

    def at_entry(label: str, fn):
        def wrapped(*a, **kw):
            mark(label)
            return fn(*a, **kw)
        return wrapped

    def after(label: str, fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            mark(label)
            return out
        return wrapped

    model = ours.model
    for i, layer in enumerate(model.layers):
        kind = "gdn" if layer.layer_type == "linear_attention" else "attn"
        layer.forward = at_entry(f"layer {i} {kind}", layer.forward)
    model.logits = at_entry("lm_head", model.logits)
    ours._layout = after("layout sent", ours._layout)
    first_gdn = next((layer.mixer.state for layer in model.layers if layer.layer_type == "linear_attention"), None)
    if first_gdn is not None:  # layer 0's norm and input projections are queued when its core starts
        first_gdn.run = at_entry("gdn core (first)", first_gdn.run)
    runs: list[list[tuple[str, float, float]]] = []
    try:
        for _ in range(reps + 2):
            marks.clear()
            slots = ours.allocate(n)
            torch.cuda.synchronize()
            mark("start")
            try:
                ours.step(slots, prompts)
            finally:
                ours.release(slots)
            mark("end")
            torch.cuda.synchronize()
            h0, e0 = marks[0][1], marks[0][2]
            runs.append([(lab, (h - h0) * 1e3, e0.elapsed_time(ev)) for lab, h, ev in marks])
    finally:
        for obj in [ours, model, *model.layers, *([first_gdn] if first_gdn is not None else [])]:
            for attr in ("forward", "logits", "_layout", "run"):
                obj.__dict__.pop(attr, None)
    runs = runs[2:]
    rows = []
    for j, (lab, _, _) in enumerate(runs[0]):
        host = sorted(r[j][1] for r in runs)[len(runs) // 2]
        gpu = sorted(r[j][2] for r in runs)[len(runs) // 2]
        rows.append(dict(marker=lab, host_ms=round(host, 3), gpu_ms=round(gpu, 3), lead_ms=round(gpu - host, 3)))
    for a, b in zip(rows, rows[1:], strict=False):
        b["host_seg_ms"] = round(b["host_ms"] - a["host_ms"], 3)
        b["gpu_seg_ms"] = round(b["gpu_ms"] - a["gpu_ms"], 3)
    return dict(shape=f"{n}x{t}", reps=len(runs), markers=rows)


def profile_main(args) -> int:
    """One prefill and a few eager decode steps under torch.profiler; kernel time per range and the
    top kernels / CPU ops, plus timed rows for prefill and decode (eager and CUDA graph)."""
    from qwen35 import probe

    t0 = time.time()
    max_b = max(PROFILE_DECODES + [64] + [n for n, _ in PROFILE_PREFILLS] + [8])
    ours = build_ours_random(args.layers, max_seqs=max_b, max_len=8192 + 64)
    print(f"built ours in {time.time() - t0:.1f}s", flush=True)
    meta = dict(layers=args.layers, width=WIDTH, tag=args.tag, check_values=os.environ.get("QWEN35_CHECK_VALUES"),
                backends=probe.report("cuda")["ops"], weights="random (profile mode, no HF model)")
    doc: dict = dict(meta=meta, profiles={}, timed=[], sdpa=[], lag=[])
    name = f"model_profile_{args.tag}" if args.tag else "model_profile"

    def save():
        out = _bench.write_results(args.out, name, doc["timed"],
                                   dict(meta, profiles=doc["profiles"], sdpa=doc["sdpa"], lag=doc["lag"]))
        return out

    if args.lag:
        for n, t in PROFILE_PREFILLS:
            doc["lag"].append(lag_trace(ours, n, t))
            print(f"[{time.time() - t0:.0f}s] lag trace prefill {n}x{t} (ms from the step's start):")
            for r in doc["lag"][-1]["markers"]:
                print(f"  {r['marker']:<14} host {r['host_ms']:8.3f} gpu {r['gpu_ms']:8.3f} lead {r['lead_ms']:8.3f}"
                      f"  segment host {r.get('host_seg_ms', 0):7.3f} gpu {r.get('gpu_seg_ms', 0):7.3f}", flush=True)
            save()
    # Timed rows before anything runs under torch.profiler: after a CUDA-activity profile, CUPTI can stay
    # attached and slow every later launch (pytorch/pytorch#144455); the lag trace above runs no profiler either.
    if args.timed:
        ceil = _bench.ceilings()
        for n, t, as_lists, sustained in [(1, 8192, False, False), (8, 4096, False, False), (1, 8192, True, False),
                                          (1, 8192, False, True), (8, 4096, False, True)]:
            doc["timed"].append(prefill_row(ours, n, t, as_lists, sustained))
            save()
            print(f"[{time.time() - t0:.0f}s] prefill {n}x{t} ({doc['timed'][-1]['tokens']}, "
                  f"{doc['timed'][-1]['mode']}): {doc['timed'][-1]['ours_ms']} ms, {doc['timed'][-1]['tok_s']} tok/s",
                  flush=True)
        for B in (1, 16, 64):
            doc["timed"] += decode_rows(ours, B, 4096, ceil["copy_GBps"])
            save()
            for r in doc["timed"][-2:]:
                print(f"[{time.time() - t0:.0f}s] {r['shape']} {r.get('mode')}: {r['ours_ms']} ms, {r['tok_s']} tok/s",
                      flush=True)
        print(f"[{time.time() - t0:.0f}s] timed rows done", flush=True)
    undo = install_ranges(ours)
    for n, t in PROFILE_PREFILLS:
        prompts = _prompts(n, t, 2)

        def prefill(prompts=prompts):
            fresh_step(ours, prompts)

        for _ in range(2):
            prefill()
        key = f"prefill {n}x{t}"
        doc["profiles"][key] = _profiled(prefill, 1)
        print(f"[{time.time() - t0:.0f}s]", end="")
        print_profile(key, doc["profiles"][key])
        save()
    for B in PROFILE_DECODES:
        slots = ours.allocate(B)
        try:
            fill_context(ours, slots, 4096)
            steps = [[1] for _ in range(B)]
            for _ in range(3):
                ours.step(slots, steps)
            key = f"decode eager B={B} ctx=4096"
            doc["profiles"][key] = _profiled(lambda s=slots, st=steps: ours.step(s, st), 5)
        finally:
            ours.release(slots)
        print(f"[{time.time() - t0:.0f}s]", end="")
        print_profile(key, doc["profiles"][key])
        save()
    undo()
    if args.sdpa:
        doc["sdpa"] = sdpa_diagnostics()
    path = save()
    if doc["timed"]:
        print(_bench.format_table(doc["timed"], ["op", "shape", "mode", "ours_ms", "tok_s", "pct_of_floor"]))
    for r in doc["sdpa"]:
        print(r)
    print(f"wrote {path}")
    return 0
