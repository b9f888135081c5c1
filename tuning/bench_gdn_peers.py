"""Benchmark: our GDN prefill and decode beside FlashQLA and FLA's Triton path, in one process (issue 34's set).

Implementations (``impl`` of a row):

- ``ours``: ``kernels_triton.gdn_chunk_prefill`` as the model calls it (raw gating a / b / A_log / dt_bias fused, L2
  norms in the kernel, metadata from ``prepare_gdn_metadata`` built once per batch);
- ``ours_cut``: the same with the cut-and-correct path forced (``kernels_triton.gdn.bench_api.cut_scan_config``; off
  in every default plan), on the shapes with few (sequence, head) pairs, one row per segment length asked for;
- ``flashqla``: ``flash_qla.chunk_gated_delta_rule`` with its context-parallel plan built once per batch
  (``kernels_cuda.flashqla.kernel().context``) and passed as ``cp_context``;
- ``fla_triton``: FLA's ``chunk_gated_delta_rule`` with ``FLA_FLASH_QLA=0`` (set here before FLA is imported: FLA
  0.6 hands the call to FlashQLA by itself when ``flash_qla`` imports); each row says which path ran (``fla_path``,
  FLA's active backend for the op); cu_seqlens (int64), their host copy and chunk indices built once per batch and
  the same tensor objects reused (FLA caches by tensor identity).

Peers get g (fp32) and beta precomputed, as a serving host computes them before the call. Every prefill call: bf16,
K = V = 128, q / k L2-normalised in the kernel, no initial state, final state out. Decode rows: ``ours``
(``gdn_recurrent_step``) and ``fla_triton`` (``fused_recurrent_gated_delta_rule``, gating in its kernel), one token
per row, pool states; FlashQLA has no decode kernel. ``gpu_ms``: GPU time per call by CUDA-graph replay; ``call_ms``:
one call timed by CUDA events (host work included). ``rel_vs_ours``: the output's relative difference from ours (a
sanity check, not an accuracy figure). ``first_call_s``: a peer's first call of that shape (TileLang / Triton
compilation and autotuning included).

``--budget S`` stops starting measurements S seconds after the start (rows left out are listed in the record's
``meta.not_run``); the JSON is written after every row. Rows run implementation by implementation in the order of
:data:`IMPLS`, FLA's prefill (its autotuning is the slowest) last, after the decode rows. ``--tiny`` runs ours (and
ours_cut) on tiny shapes, also on CPU in Triton's interpreter (a smoke test). ``python -m tuning.bench_gdn_peers
--out DIR [--budget 420] [--impls ours,ours_cut,flashqla,fla_triton] [--cut-segments auto,8,32] [--no-decode]
[--tag T]``. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

from tuning import _bench

HEADS = {"27B-TP1": (16, 48), "35B-A3B-TP1": (16, 32), "27B-TP4": (4, 12), "397B-TP8": (2, 8)}
# (heads, sequence lengths): issue 34's set, its order (the FlashQLA comparison first)
PREFILL_SET = (
    ("27B-TP1", [8192]), ("27B-TP1", [32768]), ("27B-TP1", [4096] * 8), ("27B-TP1", [512] * 64),
    ("35B-A3B-TP1", [8192]), ("35B-A3B-TP1", [32768]), ("35B-A3B-TP1", [4096] * 8),
    ("27B-TP4", [32768]), ("27B-TP4", [4096] * 8),
    ("397B-TP8", [2048]), ("397B-TP8", [32768]), ("397B-TP8", [65536]),
)
DECODE_BATCHES = (1, 32, 128, 512)
CUT_MAX_PAIRS = 96  # ours_cut rows where sequences x value heads is at most this
IMPLS = ("ours", "ours_cut", "flashqla", "fla_triton")  # the order rows are measured in (decode before fla_triton)
TINY_HEADS = {"tiny": (1, 2)}
TINY_PREFILL = (("tiny", [300]), ("tiny", [70, 0, 130]))
TINY_DECODE = (2,)
K = V = 128
DTYPE = torch.bfloat16


def _shape_name(lens: list[int]) -> str:
    return f"{len(lens)}x{max(lens)}"


# ----------------------------------------------------------------------------- timing


def _time_cpu_ms(fn, rep: int = 1) -> float:  # noqa: ANN001 - after a first call
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(fn, T: int, gpu: bool, row: dict) -> None:  # noqa: ANN001
    """Into ``row``: ``first_call_s`` (the first call, compilation included), ``call_ms`` (events around one call;
    wall time on CPU), ``gpu_ms`` (graph replay; None on CPU, and a ``graph_error`` where the call cannot be
    captured)."""
    t0 = time.perf_counter()
    fn()
    if gpu:
        torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - t0, 2)
    if not gpu:
        row["call_ms"] = round(_time_cpu_ms(fn), 5)
        return
    row["call_ms"] = round(_bench.time_ms(fn, warmup=3, rep=20), 5)
    try:
        row["gpu_ms"] = round(_bench.time_graph_ms(fn, calls_per_graph=5 if T >= 32768 else 20, rep=10), 5)
    except Exception as e:  # noqa: BLE001 - the call time stands without it
        row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- inputs and implementations


def prefill_inputs(lens: list[int], H: int, HV: int, k: int, device: str, dtype: torch.dtype = DTYPE,
                   seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)

    def rnd(*shape, dt=None, scale=1.0):  # noqa: ANN002, ANN202
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dt or dtype)

    d = dict(q=rnd(T, H, k), k=rnd(T, H, k), v=rnd(T, HV, k), a=rnd(T, HV), b=rnd(T, HV),
             A_log=rnd(HV, dt=torch.float32, scale=0.5), dt_bias=rnd(HV, dt=torch.float32, scale=0.5))
    d["cu"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    d["g"] = (-d["A_log"].exp() * torch.nn.functional.softplus(d["a"].float() + d["dt_bias"])).contiguous()
    d["beta"] = torch.sigmoid(d["b"].float()).to(dtype)
    return d


def ours_fn(d: dict, cut: int | None = None):  # noqa: ANN201
    """Our prefill on ``d`` (metadata built here, once); ``cut``: segment chunks of the forced cut path."""
    import kernels_triton as kt
    from kernels_triton.gdn import bench_api

    meta = kt.prepare_gdn_metadata(d["cu"])
    args = (d["q"], d["k"], d["v"])
    kw = dict(a=d["a"], b=d["b"], A_log=d["A_log"], dt_bias=d["dt_bias"], cu_seqlens=d["cu"], output_final_state=True,
              use_qk_l2norm=True, metadata=meta)
    if cut is None:
        return lambda: kt.gdn_chunk_prefill(*args, **kw)
    T, N, HV = d["q"].shape[0], d["cu"].shape[0] - 1, d["v"].shape[1]
    cfg = bench_api.cut_scan_config(d["q"].device, d["q"].dtype, N, HV, d["q"].shape[2], d["v"].shape[2], T,
                                    seg_chunks=cut)
    return lambda: bench_api.gdn_chunk_prefill(*args, scan=cfg, **kw)


def flashqla_fn(d: dict):  # noqa: ANN201
    from kernels_cuda import flashqla

    kern = flashqla.kernel()
    cu64 = d["cu"].long()
    ctx = kern.context(cu64, d["v"].shape[1])  # built once per batch
    q, k, v, g, beta = (d[n][None] for n in ("q", "k", "v", "g", "beta"))
    return lambda: kern.run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu64, cp_context=ctx)


def fla_fn(fla, d: dict):  # noqa: ANN001, ANN201
    chunk, _, prepare_chunk_indices = fla
    cu64 = d["cu"].long()
    cu_cpu = cu64.cpu()
    idx = prepare_chunk_indices(cu64, 64)
    q, k, v, g, beta = (d[n][None] for n in ("q", "k", "v", "g", "beta"))
    return lambda: chunk(q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu, chunk_indices=idx)


def load_peers(impls: list[str], gpu: bool) -> tuple[dict, dict]:
    """(loaded peers, {peer: status}) -- a peer that does not import is skipped with the reason."""
    peers, status = {}, {}
    if "flashqla" in impls:
        if not gpu:
            status["flashqla"] = "skipped: needs a CUDA device"
        else:
            try:
                from kernels_cuda import flashqla

                peers["flashqla"] = flashqla.kernel()
                status["flashqla"] = f"flash_qla {peers['flashqla'].version}"
            except Exception as e:  # noqa: BLE001 - the peer is optional
                status["flashqla"] = f"skipped: flash_qla does not import ({type(e).__name__}: {str(e)[:200]})"
    if "fla_triton" in impls:
        os.environ["FLA_FLASH_QLA"] = "0"  # FLA's own Triton path, not its hand-off to FlashQLA
        if not gpu:
            status["fla_triton"] = "skipped: needs a CUDA device"
        else:
            try:
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
                from fla.ops.utils.index import prepare_chunk_indices

                peers["fla_triton"] = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, prepare_chunk_indices)
                status["fla_triton"] = f"fla {_version('fla')}, path {fla_path()}"
            except Exception as e:  # noqa: BLE001
                status["fla_triton"] = f"skipped: fla does not import ({type(e).__name__}: {str(e)[:200]})"
    return peers, status


def _version(module: str) -> str:
    try:
        return getattr(__import__(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001
        return "unknown"


def fla_path() -> str:
    """Which implementation FLA's ``chunk_gated_delta_rule`` runs: its first enabled backend for the op, else its
    own Triton kernels."""
    try:
        from fla.backends import _load_operation_registry

        active = _load_operation_registry("gated_delta_rule").get_active()
    except Exception as e:  # noqa: BLE001 - an FLA without the backend registry runs its Triton kernels
        return f"triton (no backend registry: {type(e).__name__})"
    return "triton" if active is None else f"{active.backend_type} (FLA_FLASH_QLA={os.environ.get('FLA_FLASH_QLA')})"


# ----------------------------------------------------------------------------- the run


class Run:
    """Rows, the budget, and the record written after every row."""

    def __init__(self, args: argparse.Namespace, device: str, meta: dict) -> None:
        self.args, self.device, self.meta = args, device, meta
        self.dtype = DTYPE if device == "cuda" else torch.float32  # the interpreter has no bf16 dots
        self.start = time.time()
        self.deadline = self.start + args.budget
        self.rows: list[dict] = []
        self.meta["not_run"] = []
        tag = f"{args.tag}_" if args.tag else ""
        self.name = f"gdn_peers_{tag}" + _bench.device_name().lower().replace(" ", "_")

    def time_left(self) -> bool:
        return time.time() < self.deadline

    def add(self, row: dict) -> None:
        self.rows.append({"device": _bench.device_name(), "dtype": str(self.dtype).replace("torch.", ""), **row})
        r = self.rows[-1]
        print("  ".join(f"{k}={r[k]}" for k in ("op", "shape", "impl", "gpu_ms", "call_ms", "rel_vs_ours", "cut",
                                                 "first_call_s", "error") if r.get(k) is not None), flush=True)
        self.save()

    def skip(self, op: str, shape: str, impl: str) -> None:
        self.meta["not_run"].append(f"{op} {shape} {impl}")

    def save(self) -> None:
        self.meta["wall_s"] = round(time.time() - self.start)
        _bench.write_results(self.args.out, self.name, self.rows, self.meta)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(f"{float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)):.3g}")


def bench_prefill(run: Run, impl: str, peers: dict, heads: dict, shapes: tuple, cut_segments: list) -> None:
    gpu = run.device == "cuda"
    for hname, lens in shapes:
        H, HV = heads[hname]
        k = K if gpu else 32
        T, N = sum(lens), len(lens)
        shape = f"{hname} H={H} HV={HV} {_shape_name(lens)}"
        variants = [None]
        if impl == "ours_cut":
            if N * HV > CUT_MAX_PAIRS:
                continue
            from kernels_triton.gdn import bench_api

            variants = sorted({bench_api.suggested_segment_chunks(N, HV, T) if c == "auto" else int(c)
                               for c in cut_segments})
        for cut in variants:
            if not run.time_left():
                run.skip("gdn_prefill_peers", shape, impl if cut is None else f"{impl} cut={cut}")
                continue
            row = {"op": "gdn_prefill_peers", "shape": shape, "impl": impl, "heads": hname, "seqs": _shape_name(lens),
                   "T": T, "gpu_ms": None, "call_ms": None}
            try:
                d = prefill_inputs(lens, H, HV, k, run.device, run.dtype)
                if impl == "ours":
                    fn = ours_fn(d)
                elif impl == "ours_cut":
                    fn, row["cut"] = ours_fn(d, cut), cut
                elif impl == "flashqla":
                    fn = flashqla_fn(d)
                else:
                    fn, row["fla_path"] = fla_fn(peers["fla_triton"], d), fla_path()
                measure(fn, T, gpu, row)
                if impl != "ours":
                    row["rel_vs_ours"] = _rel(fn()[0].reshape(T, HV, -1), ours_fn(d)()[0])
                if row["gpu_ms"]:
                    flop = (6 * k * k + 6 * 64 * k + 4 * 64 * k + 64 * 64 / 3) * T * HV
                    row["tflops"] = round(flop / row["gpu_ms"] / 1e9, 1)
                del d, fn
            except Exception as e:  # noqa: BLE001 - record and go on
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            run.add(row)
            if gpu:
                torch.cuda.empty_cache()


def bench_decode(run: Run, impl: str, peers: dict, heads: dict, batches: tuple) -> None:
    gpu = run.device == "cuda"
    for hname, (H, HV) in heads.items():
        for B in batches:
            shape = f"{hname} H={H} HV={HV} B={B}"
            if not run.time_left():
                run.skip("gdn_decode_peers", shape, impl)
                continue
            row = {"op": "gdn_decode_peers", "shape": shape, "impl": impl, "heads": hname, "B": B, "gpu_ms": None,
                   "call_ms": None}
            try:
                fn = _decode_fn(impl, peers, B, H, HV, K if gpu else 32, run.device, run.dtype)
                measure(fn, 1, gpu, row)
                if row["gpu_ms"]:
                    row["state_GBps"] = round(2 * B * HV * (K * V) * 4 / row["gpu_ms"] / 1e6)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            run.add(row)


def _decode_fn(impl: str, peers: dict, B: int, H: int, HV: int, k: int, device: str,  # noqa: ANN202
               dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=None, scale=1.0):  # noqa: ANN002, ANN202
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dt or dtype)

    q, kk, v, a, b = rnd(B, 1, H, k), rnd(B, 1, H, k), rnd(B, 1, HV, k), rnd(B, 1, HV), rnd(B, 1, HV)
    A_log, dt_bias = rnd(HV, dt=torch.float32, scale=0.5), rnd(HV, dt=torch.float32, scale=0.5)
    pool = rnd(B, HV, k, k, dt=torch.float32, scale=0.1)
    if impl == "ours":
        import kernels_triton as kt

        slots = torch.arange(B, dtype=torch.int32, device=device)
        return lambda: kt.gdn_recurrent_step(q, kk, v, state_pool=pool, state_slots=slots, a=a, b=b, A_log=A_log,
                                             dt_bias=dt_bias, use_qk_l2norm=True)
    recurrent = peers["fla_triton"][1]
    return lambda: recurrent(q, kk, v, g=a, beta=b, initial_state=pool, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                             use_beta_sigmoid_in_kernel=True)


def summary(rows: list[dict]) -> str:
    """Prefill rows side by side: GPU and call ms per implementation, ours against FlashQLA."""
    by_shape: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["op"] == "gdn_prefill_peers" and r.get("call_ms") is not None:
            name = r["impl"] + (f"@{r['cut']}" if r.get("cut") else "")
            by_shape.setdefault(r["shape"], {})[name] = r
    lines = []
    for shape, impls in by_shape.items():
        cells = {n: f"{_fmt(r['gpu_ms'])}/{_fmt(r['call_ms'])}" for n, r in impls.items()}
        ours, fq = impls.get("ours"), impls.get("flashqla")
        ratio = ""
        if ours and fq and ours.get("gpu_ms") and fq.get("gpu_ms"):
            ratio = (f"  ours vs flashqla {fq['gpu_ms'] / ours['gpu_ms']:.2f}x gpu, "
                     f"{fq['call_ms'] / ours['call_ms']:.2f}x call")
        lines.append(f"{shape:<28} " + "  ".join(f"{n} {c}" for n, c in cells.items()) + ratio)
    return "gpu_ms/call_ms by implementation\n" + "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_gdn_peers", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tuning/results", help="directory for gdn_peers_<device>.json")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds after the start beyond which no measurement starts (peers compile at first use)")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--cut-segments", default="auto",
                        help="segment lengths (chunks) of the ours_cut rows: integers and/or 'auto' (the suggested)")
    parser.add_argument("--no-decode", action="store_true", help="prefill rows only")
    parser.add_argument("--quick", action="store_true", help="accepted for the GPU suite; the set is already short")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, ours and ours_cut only (runs on CPU)")
    parser.add_argument("--tag", default="", help="inserted into the result file name")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    if sorted(set(impls) - set(IMPLS)):
        parser.error(f"--impls {args.impls}: choose from {', '.join(IMPLS)}")
    gpu = torch.cuda.is_available()
    if not gpu and not args.tiny:
        print("bench_gdn_peers needs a CUDA device (or --tiny)", file=sys.stderr)
        return 2
    if args.tiny:
        impls = [i for i in impls if i in ("ours", "ours_cut")]
        if not gpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels_triton imports triton
    torch.set_grad_enabled(False)
    peers, status = load_peers(impls, gpu)
    for name, s in status.items():
        print(f"{name}: {s}", flush=True)
    meta = {"peers": status, "impls": impls, "budget_s": args.budget, "tiny": args.tiny,
            "conditions": "bf16, K = V = 128, L2 norms in the kernel, no initial state, final state out; ours: raw "
                          "gating fused, metadata once per batch; peers: g fp32 / beta precomputed, their per-batch "
                          "data built once (FlashQLA cp_context, FLA cu_seqlens / chunk indices reused)",
            "decode": "ours and fla_triton by CUDA-graph replay and events; FlashQLA has no decode kernel"}
    run = Run(args, "cuda" if gpu else "cpu", meta)
    heads = TINY_HEADS if args.tiny else HEADS
    shapes = TINY_PREFILL if args.tiny else PREFILL_SET
    cut_segments = [c.strip() for c in args.cut_segments.split(",") if c.strip()]
    order = [i for i in ("ours", "ours_cut", "flashqla") if i in impls]  # FlashQLA compiles longest: last but FLA
    for impl in order:
        if impl in ("ours", "ours_cut") or impl in peers:
            bench_prefill(run, impl, peers, heads, shapes, cut_segments)
    if not args.no_decode:
        for impl in ("ours", "fla_triton"):
            if impl == "ours" and "ours" in impls or impl in peers:
                bench_decode(run, impl, peers, heads, TINY_DECODE if args.tiny else DECODE_BATCHES)
    if "fla_triton" in peers:
        bench_prefill(run, "fla_triton", peers, heads, shapes, cut_segments)
    run.save()
    print(summary(run.rows))
    if run.meta["not_run"]:
        print(f"not run (budget): {len(run.meta['not_run'])} rows, listed in meta.not_run")
    print(f"wrote {os.path.join(args.out, run.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
