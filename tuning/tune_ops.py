"""The ops ``qwen35-tune`` tunes: every launch config that a kernel reads from a tuned file today.

- ``gdn_chunk_scan`` (file ``gdn_chunk_scan.json``): the GDN chunked prefill's scan launch (V block, warps,
  stages), by tokens per sequence. A tuned entry runs the one-pass scan; the heuristic's split scan, parts and
  groups stay the heuristic's. The entry's shape key has no sequence count, so each candidate runs on two layouts
  (the bucket's batch of ``PREFILL_BATCH_TOKENS`` tokens and one sequence) and must not be slower on either.
- ``gdn_recurrent_step`` (``gdn_recurrent_step.json``): the GDN decode step (V block, warps, streaming hints), by
  batch rows.
- ``moe_gemm`` (``moe_gate_up.json`` and ``moe_down.json``): the two grouped expert GEMMs of the MoE pipeline
  (one BLOCK_M for both, each its own tiles, warps, stages), by tokens; timed apart and summed. One token takes the
  MoE decode path, whose launch shape is a fixed rule: its bucket is not tuned.

Taking no tuned config (fixed launch rules, nothing to tune): the GDN prefill's prepare launch, causal conv1d,
the norms, MoE routing and the one-token MoE path, decode attention and its q/k norm + rope and output gate.
The ``cuda_sm70`` backend's kernels take no launch configs either.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from kernels_triton import bench_api
from kernels_triton.gdn import bench_api as gdn_api
from kernels_triton.moe import bench_api as moe_api
from qwen35 import optable
from qwen35 import reference as ref
from tuning.tune_model import RankShapes
from tuning.tune_run import Part, Task, Workload, device_alive, reason

PREFILL_BATCH_TOKENS = 16384  # tokens of a prefill batch (vLLM's chunked prefill): a bucket of P tokens per sequence
GRAPH_MAX_TOKENS = 256  # MoE buckets up to this many tokens are timed by graph replay
ROTATE_MAX = 384  # input sets a graph cycles through at most
UNTUNED = {
    "causal_conv1d_prefill": "its launch shape is a fixed rule (kernels_triton/conv1d.py)",
    "causal_conv1d_update": "its launch shape is a fixed rule (kernels_triton/conv1d.py)",
    "rms_norm_gated": "its launch shape is a fixed rule (kernels_triton/norms.py)",
    "rms_norm_zero_centered": "its launch shape is a fixed rule (kernels_triton/norms.py)",
    "moe_route": "routing launches follow a fixed rule (kernels_triton/moe/routing.py)",
    "attention_decode": "its split plan is a fixed rule (kernels_triton/attention.py)",
    "qk_norm_rope": "its launch shape is a fixed rule (kernels_triton/attn_glue.py)",
    "sigmoid_gate_mul": "its launch shape is a fixed rule (kernels_triton/attn_glue.py)",
}
BACKENDS = {"triton": None, "cuda_sm70": "its kernels take no launch configs: nothing to tune yet"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _rnd(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(dtype)


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, math.nan)


def _rotations(device: torch.device, bytes_per_call: int) -> int:
    """Input sets to cycle through in a graph so that their memory is about three times L2 (cold caches)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    return max(1, min(ROTATE_MAX, math.ceil(3 * l2 / max(bytes_per_call, 1))))


def _pow2_below(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << max(int(n), 1).bit_length() - 1


def _in_space(cand: dict, axes: dict) -> dict:
    return {k: cand[k] for k in axes if k in cand}


class Tunable:
    """One tunable op: its name, the config files it writes, the op-table op whose reference and tolerance check
    it, and how a model's shapes become tasks."""

    name = ""
    files: tuple[str, ...] = ()
    optable_op = ""
    bucket_kind = ""  # what a bucket counts, for plans

    def applies(self, rank: RankShapes) -> str | None:
        """Why this op has nothing to tune for the model, or None."""
        return None

    def buckets(self, decode: list[int], prefill: list[int]) -> list[int]:
        raise NotImplementedError

    def tasks(self, rank: RankShapes, dtype: torch.dtype, buckets: list[int],
              limits: bench_api.DeviceLimits) -> list[Task]:
        raise NotImplementedError

    def tolerance(self, dtype: torch.dtype) -> float:
        return optable.get(self.optable_op).tolerance[dtype]


# ----------------------------------------------------------------------------- GDN decode step


class GdnStep(Tunable):
    name, files, optable_op, bucket_kind = "gdn_recurrent_step", ("gdn_recurrent_step",), "gdn_recurrent_step", \
        "batch rows"

    def buckets(self, decode: list[int], prefill: list[int]) -> list[int]:
        return list(decode)

    def tasks(self, rank: RankShapes, dtype: torch.dtype, buckets: list[int],
              limits: bench_api.DeviceLimits) -> list[Task]:
        H, HV, K, V = rank.gdn_key_heads, rank.gdn_value_heads, rank.key_dim, rank.value_dim
        axes = dict(gdn_api.STEP_SEARCH_SPACE)
        size = len(gdn_api.step_search_space(K, V, limits))
        key = gdn_api.step_shape_key(HV, V)
        return [Task(
            tunable=self.name, files={"gdn_recurrent_step": key}, bucket=B, label=f"H={H},{key}", axes=axes,
            excluded=functools.partial(gdn_api.step_excluded, K=K, V=V, limits=limits), size=size,
            tolerance=self.tolerance(dtype), space_hash={"gdn_recurrent_step": bench_api.declared_hash(self.name)},
            workloads=functools.partial(self._workloads, B=B, H=H, HV=HV, K=K, V=V, dtype=dtype),
            seeds=lambda wls, scratch, axes=axes: [_in_space(wls[0].baseline, axes)] + (
                [] if scratch or wls[0].current is None else [_in_space(wls[0].current, axes)]),
            entries=lambda c: {"gdn_recurrent_step": {k: c[k] for k in ("BV", "num_warps", "STREAM")}},
            spec=(self.name, rank, dtype, B, limits))
            for B in buckets]

    @staticmethod
    def _full(cfg: dict) -> dict:
        return {"BV": cfg["BV"], "num_warps": cfg["num_warps"], "STREAM": bool(cfg.get("STREAM", False)),
                **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {})}

    def _workloads(self, device: torch.device, B: int, H: int, HV: int, K: int, V: int,
                   dtype: torch.dtype) -> list[Workload]:
        with bench_api.heuristics_only():
            heuristic = self._full(gdn_api.decode_config(device, B, HV, V))
        current = self._full(gdn_api.decode_config(device, B, HV, V))
        rot = _rotations(device, B * HV * K * V * 4)
        gen = _gen(device, 1000 + B)

        def inputs(g: torch.Generator, rows: int) -> dict:
            return dict(q=_rnd(g, B, 1, H, K, dtype=dtype), k=_rnd(g, B, 1, H, K, dtype=dtype),
                        v=_rnd(g, B, 1, HV, V, dtype=dtype), a=_rnd(g, B, 1, HV, dtype=dtype),
                        b=_rnd(g, B, 1, HV, dtype=dtype), A_log=_rnd(g, HV, dtype=torch.float32, scale=0.5),
                        dt_bias=_rnd(g, HV, dtype=torch.float32, scale=0.5),
                        pool=_rnd(g, rows, HV, K, V, dtype=torch.float32, scale=0.1))

        timed = inputs(gen, rot * B)
        slots = [torch.arange(r * B, (r + 1) * B, dtype=torch.int32, device=device) for r in range(rot)]
        out = torch.empty(B, 1, HV, V, dtype=dtype, device=device)
        check = inputs(_gen(device, 7 + B), B)
        check_slots = torch.arange(B, dtype=torch.int32, device=device)
        want = {}

        def reference() -> dict:
            if not want:
                pool = check["pool"].double()
                o = ref.gdn_recurrent_step(
                    *(check[n].double() for n in ("q", "k", "v")), state_pool=pool, state_slots=check_slots,
                    a=check["a"].double(), b=check["b"].double(), A_log=check["A_log"].double(),
                    dt_bias=check["dt_bias"].double(), use_qk_l2norm=True)
                want.update(o=o, state=pool)
            return want

        def step(d: dict, slot: torch.Tensor, cfg: dict, o: torch.Tensor) -> torch.Tensor:
            return gdn_api.gdn_recurrent_step(d["q"], d["k"], d["v"], state_pool=d["pool"], state_slots=slot,
                                              config=cfg, a=d["a"], b=d["b"], A_log=d["A_log"],
                                              dt_bias=d["dt_bias"], use_qk_l2norm=True, out=o)

        def parts(cfg: dict) -> list[Part]:
            def run_check() -> list:
                d = dict(check, pool=check["pool"].clone())
                o = step(d, check_slots, cfg, _nan_like(out))
                r = reference()
                return [("o", o, r["o"]), ("state", d["pool"], r["state"])]

            return [Part(key=tuple(sorted(cfg.items())), check=run_check, graph=True,
                         calls=lambda: [functools.partial(step, timed, s, cfg, out) for s in slots])]

        return [Workload(label=f"B={B}", baseline=heuristic, parts=parts,
                         current=None if current == heuristic else current)]


# ----------------------------------------------------------------------------- GDN chunked prefill: the scan


class GdnScan(Tunable):
    name, files, optable_op, bucket_kind = "gdn_chunk_scan", ("gdn_chunk_scan",), "gdn_chunk_prefill", \
        "tokens per sequence"

    def buckets(self, decode: list[int], prefill: list[int]) -> list[int]:
        return [1 << (p.bit_length() - 1) for p in prefill]  # the lookup's tokens per sequence: powers of two

    def tasks(self, rank: RankShapes, dtype: torch.dtype, buckets: list[int],
              limits: bench_api.DeviceLimits) -> list[Task]:
        H, HV, K, V = rank.gdn_key_heads, rank.gdn_value_heads, rank.key_dim, rank.value_dim
        axes = dict(gdn_api.SCAN_SEARCH_SPACE)
        size = len(gdn_api.scan_search_space(K, V, dtype, limits))
        key = gdn_api.scan_shape_key(HV, V, dtype)
        return [Task(
            tunable=self.name, files={"gdn_chunk_scan": key}, bucket=P, label=f"H={H},{key}", axes=axes,
            excluded=functools.partial(gdn_api.scan_excluded, K=K, V=V, dtype=dtype, limits=limits), size=size,
            tolerance=self.tolerance(dtype), space_hash={"gdn_chunk_scan": bench_api.declared_hash(self.name)},
            workloads=functools.partial(self._workloads, P=P, H=H, HV=HV, K=K, V=V, dtype=dtype),
            seeds=functools.partial(self._seeds, axes=axes),
            entries=lambda c: {"gdn_chunk_scan": {k: c[k] for k in ("BV", "num_warps", "num_stages")}},
            note="layouts: " + " and ".join(f"{n} x {P}" for n in self.counts(P)),
            spec=(self.name, rank, dtype, P, limits))
            for P in buckets]

    @staticmethod
    def counts(P: int) -> list[int]:
        """Sequences per layout at P tokens per sequence: a prefill batch's worth, and one."""
        return sorted({max(1, PREFILL_BATCH_TOKENS // P), 1}, reverse=True)

    @staticmethod
    def _seeds(wls: list[Workload], scratch: bool, axes: dict) -> list[dict]:
        seeds = [_in_space(wl.baseline, axes) for wl in wls]
        if not scratch:
            seeds += [_in_space(wl.current, axes) for wl in wls if wl.current is not None]
        return seeds

    def _workloads(self, device: torch.device, P: int, H: int, HV: int, K: int, V: int,
                   dtype: torch.dtype) -> list[Workload]:
        return [self._layout(device, N, P, H, HV, K, V, dtype) for N in self.counts(P)]

    def _layout(self, device: torch.device, N: int, P: int, H: int, HV: int, K: int, V: int,
                dtype: torch.dtype) -> Workload:
        import kernels_triton as kt

        per_seq = 1 << max(P, 1).bit_length() - 1
        with bench_api.heuristics_only():
            heuristic = gdn_api.scan_forced(gdn_api.scan_config(device, N, HV, K, V, per_seq, dtype), K, V)
        current = gdn_api.scan_forced(gdn_api.scan_config(device, N, HV, K, V, per_seq, dtype), K, V)
        T = N * P
        cu = torch.arange(0, T + 1, P, dtype=torch.int32, device=device)
        meta = kt.prepare_gdn_metadata(cu)

        def inputs(g: torch.Generator) -> dict:
            return dict(q=_rnd(g, T, H, K, dtype=dtype), k=_rnd(g, T, H, K, dtype=dtype),
                        v=_rnd(g, T, HV, V, dtype=dtype), a=_rnd(g, T, HV, dtype=dtype),
                        b=_rnd(g, T, HV, dtype=dtype), A_log=_rnd(g, HV, dtype=torch.float32, scale=0.5),
                        dt_bias=_rnd(g, HV, dtype=torch.float32, scale=0.5),
                        h0=_rnd(g, N, HV, K, V, dtype=torch.float32, scale=0.1))

        timed, check = inputs(_gen(device, 2000 + P + N)), inputs(_gen(device, 3000 + P + N))
        out = torch.empty(T, HV, V, dtype=dtype, device=device)
        want = {}

        def reference() -> dict:
            if not want:
                o, final = ref.gdn_chunk_prefill(
                    *(check[n].double() for n in ("q", "k", "v")), a=check["a"].double(), b=check["b"].double(),
                    A_log=check["A_log"].double(), dt_bias=check["dt_bias"].double(), cu_seqlens=cu,
                    initial_state=check["h0"].double(), output_final_state=True, use_qk_l2norm=True)
                want.update(o=o, state=final)
            return want

        def prefill(d: dict, scan: dict, o: torch.Tensor) -> tuple:
            return gdn_api.gdn_chunk_prefill(d["q"], d["k"], d["v"], scan=scan, a=d["a"], b=d["b"],
                                             A_log=d["A_log"], dt_bias=d["dt_bias"], cu_seqlens=cu,
                                             initial_state=d["h0"], output_final_state=True, use_qk_l2norm=True,
                                             metadata=meta, out=o)

        def parts(cfg: dict) -> list[Part]:
            forced = gdn_api.scan_forced(cfg, K, V)

            def run_check() -> list:
                o, final = prefill(check, forced, _nan_like(out))
                r = reference()
                return [("o", o, r["o"]), ("state", final, r["state"])]

            return [Part(key=tuple(sorted(forced.items())), check=run_check, graph=False,
                         calls=lambda: [functools.partial(prefill, timed, forced, out)])]

        return Workload(label=f"{N}x{P}", baseline=heuristic, parts=parts,
                        current=None if current == heuristic else current)


# ----------------------------------------------------------------------------- MoE grouped GEMMs

UP_AXES = {"up_N": "BLOCK_N", "up_K": "BLOCK_K", "up_warps": "num_warps", "up_stages": "num_stages"}
DOWN_AXES = {"down_N": "BLOCK_N", "down_K": "BLOCK_K", "down_warps": "num_warps", "down_stages": "num_stages"}


def pair(up: moe_api.GemmConfig, down: moe_api.GemmConfig) -> dict:
    """A (gate_up, down) config pair as one candidate (one BLOCK_M: gate_up's, as the op runs them)."""
    return {"BLOCK_M": up.BLOCK_M, **{a: getattr(up, f) for a, f in UP_AXES.items()},
            **{a: getattr(down, f) for a, f in DOWN_AXES.items()}}


def split(cand: dict) -> tuple[moe_api.GemmConfig, moe_api.GemmConfig]:
    bm = cand["BLOCK_M"]
    up = moe_api.GemmConfig(bm, *(cand[a] for a in UP_AXES))
    down = moe_api.GemmConfig(bm, *(cand[a] for a in DOWN_AXES))
    return up, down


@dataclass(frozen=True)
class MoeShape:
    E: int
    top_k: int
    H: int
    I: int

    def keys(self, dtype: torch.dtype) -> dict[str, str]:
        return {moe_api.GATE_UP_OP: moe_api.shape_key(self.E, 2 * self.I, self.H, dtype),
                moe_api.DOWN_OP: moe_api.shape_key(self.E, self.H, self.I, dtype)}


class MoeGemm(Tunable):
    name, files, optable_op, bucket_kind = "moe_gemm", ("moe_gate_up", "moe_down"), "moe_experts", "tokens"

    def __init__(self) -> None:
        self._weights: tuple | None = None  # (shape, dtype, device, (w13, w2)): one shape's experts at a time

    def applies(self, rank: RankShapes) -> str | None:
        return None if rank.is_moe else f"model {rank.model} is dense (no MoE layers)"

    def buckets(self, decode: list[int], prefill: list[int]) -> list[int]:
        return sorted({m for m in (*decode, *prefill) if m > 1})  # one token: the decode path, a fixed rule

    def excluded(self, cand: dict, s: MoeShape, M: int, dtype: torch.dtype,
                 limits: bench_api.DeviceLimits) -> str | None:
        up, down = split(cand)
        return (moe_api.excluded("gate_up", up, M, s.top_k, s.E, 2 * s.I, s.H, dtype, limits)
                or moe_api.excluded("down", down, M, s.top_k, s.E, s.H, s.I, dtype, limits))

    def tasks(self, rank: RankShapes, dtype: torch.dtype, buckets: list[int],
              limits: bench_api.DeviceLimits) -> list[Task]:
        s = MoeShape(rank.experts, rank.top_k, rank.hidden, rank.expert_width)
        axes = {"BLOCK_M": moe_api.SEARCH_SPACE["BLOCK_M"],
                **{a: moe_api.SEARCH_SPACE[f] for a, f in UP_AXES.items()},
                **{a: moe_api.SEARCH_SPACE[f] for a, f in DOWN_AXES.items()}}
        tasks = []
        for M in buckets:
            ups = len(moe_api.search_space("gate_up", M, s.top_k, s.E, 2 * s.I, s.H, dtype, limits))
            downs = len(moe_api.search_space("down", M, s.top_k, s.E, s.H, s.I, dtype, limits))
            hashes = {op: bench_api.declared_hash(op) for op in self.files}
            tasks.append(Task(
                tunable=self.name, files=s.keys(dtype), bucket=M,
                label=f"E={s.E},k={s.top_k},H={s.H},I={s.I},dtype={_dtype_name(dtype)}", axes=axes,
                excluded=functools.partial(self.excluded, s=s, M=M, dtype=dtype, limits=limits), size=ups + downs,
                tolerance=self.tolerance(dtype), space_hash=hashes,
                workloads=functools.partial(self._workloads, s=s, M=M, dtype=dtype),
                seeds=functools.partial(self._seeds, s=s, M=M, dtype=dtype, limits=limits),
                entries=functools.partial(self._entries, M=M),
                note=f"{ups} gate_up + {downs} down configs, timed apart",
                spec=(self.name, rank, dtype, M, limits)))
        return tasks

    @staticmethod
    def _entries(cand: dict, M: int) -> dict[str, dict]:
        up, down = split(cand)
        return {moe_api.GATE_UP_OP: {**up.as_dict(), "M": M}, moe_api.DOWN_OP: {**down.as_dict(), "M": M}}

    def _seeds(self, wls: list[Workload], scratch: bool, s: MoeShape, M: int, dtype: torch.dtype,
               limits: bench_api.DeviceLimits) -> list[dict]:
        """The heuristic pair, what the files give (unless from scratch), and the heuristic's tiles at every other
        BLOCK_M in the space (made to fit: more warps, then narrower tiles)."""
        base = wls[0].baseline
        seeds = [base] + ([] if scratch or wls[0].current is None else [wls[0].current])
        shapes = {"up": ("gate_up", 2 * s.I, s.H), "down": ("down", s.H, s.I)}
        for bm in moe_api.SEARCH_SPACE["BLOCK_M"]:
            if bm != base["BLOCK_M"] and bm <= moe_api.block_m_cap(M, s.top_k, s.E):
                c = {**base, "BLOCK_M": bm}
                for side, (which, N, K) in shapes.items():
                    def out(c: dict = c, side: str = side, which: str = which, N: int = N, K: int = K) -> bool:
                        gemm = split(c)[0 if side == "up" else 1]
                        return moe_api.excluded(which, gemm, M, s.top_k, s.E, N, K, dtype, limits) is not None

                    while out() and c[f"{side}_warps"] < 8:
                        c[f"{side}_warps"] *= 2
                    while out() and c[f"{side}_N"] > 16:
                        c[f"{side}_N"] //= 2
                    while out() and c[f"{side}_stages"] > 2:
                        c[f"{side}_stages"] -= 1
                seeds.append(c)
        return seeds

    def _experts(self, s: MoeShape, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._weights is None or self._weights[:3] != (s, dtype, device):
            self._weights = None
            gen = _gen(device, 11)
            w13 = _rnd(gen, s.E, 2 * s.I, s.H, dtype=dtype, scale=s.H**-0.5)
            w2 = _rnd(gen, s.E, s.H, s.I, dtype=dtype, scale=s.I**-0.5)
            self._weights = (s, dtype, device, (w13, w2))
        return self._weights[3]

    def _workloads(self, device: torch.device, s: MoeShape, M: int, dtype: torch.dtype) -> list[Workload]:
        w13, w2 = self._experts(s, dtype, device)
        with bench_api.heuristics_only():
            heuristic = pair(*moe_api.configs(M, s.top_k, s.E, s.H, s.I, dtype, device))
        current = pair(*moe_api.configs(M, s.top_k, s.E, s.H, s.I, dtype, device))
        graph = M <= GRAPH_MAX_TOKENS
        rot = 4 if graph and device.type == "cuda" else 1

        def routed(seed: int) -> dict:
            g = _gen(device, seed)
            weights, ids = ref.moe_route(torch.randn(M, s.E, generator=g, device=device), s.top_k)
            return dict(x=_rnd(g, M, s.H, dtype=dtype), weights=weights.float().contiguous(), ids=ids, al={}, h={})

        sets = [routed(4000 + 17 * r + M) for r in range(rot)]
        check = routed(5000 + M)
        want = {}

        def alignment(d: dict, bm: int) -> object:
            if bm not in d["al"]:
                d["al"][bm] = moe_api.align(d["ids"], n_local=s.E, block_m=bm)
            return d["al"][bm]

        def partner(bm: int, which: str) -> moe_api.GemmConfig:
            """Small tiles that fit any device (no wider than the matrix): the other GEMM of a check, and the gate_up
            before a timed down."""
            cols, k = (s.I, s.H) if which == "gate_up" else (s.H, s.I)
            return moe_api.GemmConfig(bm, max(16, min(32, _pow2_below(cols))), max(16, min(64, _pow2_below(k))), 4, 2)

        def hidden(d: dict, bm: int) -> torch.Tensor:  # gate_up's output at this BLOCK_M (the down GEMM's input)
            if bm not in d["h"]:
                d["h"][bm] = moe_api.gate_up(d["x"], w13, None, alignment(d, bm), s.top_k, partner(bm, "gate_up"))
            return d["h"][bm]

        def reference() -> torch.Tensor:
            if not want:
                want["out"] = ref.moe_experts(check["x"].double(), w13.double(), w2.double(),
                                              check["weights"].double(), check["ids"])
            return want["out"]

        def pipeline(up: moe_api.GemmConfig, down: moe_api.GemmConfig) -> torch.Tensor:
            al = alignment(check, up.BLOCK_M)
            h = moe_api.gate_up(check["x"], w13, None, al, s.top_k, up)
            y = moe_api.down(h, w2, None, al, check["weights"], down)
            return moe_api.combine(y, al, M, s.top_k)

        def parts(cfg: dict) -> list[Part]:
            up, down = split(cfg)
            bm = up.BLOCK_M
            return [
                Part(key=("gate_up", up), graph=graph,
                     check=lambda: [("out", pipeline(up, partner(bm, "down")), reference())],
                     calls=lambda: [functools.partial(moe_api.gate_up, d["x"], w13, None, alignment(d, bm), s.top_k,
                                                      up) for d in sets]),
                Part(key=("down", down), graph=graph,
                     check=lambda: [("out", pipeline(partner(bm, "gate_up"), down), reference())],
                     calls=lambda: [functools.partial(moe_api.down, hidden(d, bm), w2, None, alignment(d, bm),
                                                      d["weights"], down) for d in sets]),
            ]

        return [Workload(label=f"M={M}", baseline=heuristic, parts=parts,
                         current=None if current == heuristic else current)]


TUNABLES: dict[str, Tunable] = {t.name: t for t in (GdnScan(), GdnStep(), MoeGemm())}
# op-table names (and the config files) that select a tunable
ALIASES: dict[str, str] = {"gdn_chunk_prefill": "gdn_chunk_scan", "moe_experts": "moe_gemm", "moe_block": "moe_gemm",
                           "moe_gate_up": "moe_gemm", "moe_down": "moe_gemm"}


# ----------------------------------------------------------------------------- compile warm-up in other processes

_WARM: dict = {}  # in a warm-up process: the workloads of the task it warmed last


def warm_one(spec: tuple, cand: dict) -> str | None:
    """In a warm-up process: run every part of ``cand`` once on the task's timing inputs, which compiles its kernels
    into Triton's on-disk cache. None, or why it failed (the process exits at its next call once its CUDA context
    is lost)."""
    if _WARM.get("dead"):
        os._exit(70)
    if _WARM.get("spec") != spec:
        _WARM.clear()
        name, rank, dtype, bucket, limits = spec
        (task,) = TUNABLES[name].tasks(rank, dtype, [bucket], limits)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        _WARM.update(spec=spec, device=device, workloads=task.workloads(device))
    try:
        for wl in _WARM["workloads"]:
            for part in wl.parts(cand):
                part.calls()[0]()
        if _WARM["device"].type == "cuda":
            torch.cuda.synchronize(_WARM["device"])
    except Exception as e:  # noqa: BLE001 - what failed is the answer
        if not device_alive(_WARM["device"]):
            _WARM["dead"] = True
            return f"lost the CUDA context in the compile warm-up: {reason(e)}"
        return f"{reason(e)} (in the compile warm-up)"
    return None


class WarmPool:
    """``jobs`` processes that compile candidates ahead of the run loop (:meth:`TaskRun.prewarm`); a candidate that
    fails there is rejected without running in the tuning process. A pool whose process died is replaced; the
    candidates it had not finished are left to the run loop."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.pool: ProcessPoolExecutor | None = None

    def __call__(self, task: Task, cands: list[dict]) -> dict[tuple, str]:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"))
        futures = [(tuple(sorted(c.items())), self.pool.submit(warm_one, task.spec, c)) for c in cands]
        failed, broken = {}, False
        for key, future in futures:
            try:
                why = future.result(timeout=900)
            except Exception:  # noqa: BLE001 - a dead process or a timeout: the run loop tries it itself
                broken, why = True, None
            if why:
                failed[key] = f"crashed: {why}"
        if broken:
            self.close()
        return failed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
