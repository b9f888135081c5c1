"""Sweeps of the MoE kernels' launch choices, each a choice the op makes by itself, timed both ways on the GPU
(``python -m tuning.bench_moe --down-flat | --tma | --sub-tiles | --pdl | --decode``). Stages are run through
:mod:`kernels_triton.moe.bench_api`; what each sweep found is in tuning/notes_moe.md. Reports, never asserts.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from pathlib import Path

import torch

from kernels_triton.moe import bench_api as moe
from tuning import _bench
from tuning.bench_moe import SHAPES, _config_slug, _gpu_ms, _rel, _weights, _x, ours


def _record(rows: list[dict], r: dict, out: Path, stem: str) -> None:
    """One sweep row: kept, printed, and the sweep's JSON rewritten (a killed run keeps what it measured)."""
    rows.append(r)
    print(r, flush=True)
    _bench.write_results(out, f"{stem}_{_config_slug()}", rows)


def down_flat_sweep(out: Path, shapes: list[str], ms: list[int]) -> list[dict]:
    """The down GEMM alone (graph replay) with 1, 2, 4, ... column tiles per program (``TILES_N``, a flat loop
    over (tile, K step)): the tiles' K loops are short (I = 128..1024), so per-tile fill and index loads count."""
    rows = []
    for name in shapes:
        E, k, H, I = SHAPES[name]
        w = _weights(E, H, I)
        for M in ms:
            x = _x(M, H)
            up_cfg, down_cfg = moe.configs(M, k, E, H, I, x.dtype, x.device)
            weights, _, al = _route_align_for(x, w, k, up_cfg.BLOCK_M)
            h = moe.gate_up(x, w["w13"], None, al, k, up_cfg)
            n_tiles = -(-H // down_cfg.BLOCK_N)
            want = moe.down(h, w["w2"], None, al, weights, down_cfg, tiles_n=1)
            for tiles_n in sorted({1, 2, 4, 8, 16, n_tiles} & set(range(1, n_tiles + 1))):
                call = functools.partial(moe.down, h, w["w2"], None, al, weights, down_cfg, tiles_n=tiles_n)
                try:
                    same = bool(torch.equal(call(), want))
                    ms_ = _gpu_ms(call, M)
                    r = dict(sweep="down_tiles_n", shape=f"{name} M={M}", config=down_cfg.as_dict(), tiles_n=tiles_n,
                             us=round(ms_ * 1e3, 1), TFLOPs=round(2 * M * k * H * I / ms_ / 1e9, 1), same_bits=same)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record and go on
                    r = dict(sweep="down_tiles_n", shape=f"{name} M={M}", tiles_n=tiles_n,
                             error=f"{type(e).__name__}: {str(e)[:200]}")
                _record(rows, r, out, "moe_down_flat")
        torch.cuda.empty_cache()
    return rows


def env_sweep(out: Path, shapes: list[str], ms: list[int], env: str, stem: str, sweep: str) -> list[dict]:
    """The whole block (router to combine; without and with the shared expert; graph replay) with the switch ``env``
    set to 0 and to 1, alternating (best of two rounds each): ``us_off`` / ``us_on`` repeat one batch, ``rot_off`` /
    ``rot_on`` cycle through 8 batches routed to different experts (their weights not left in L2, as between a
    model's layers); and whether the two give the same bits."""
    rows = []
    for name in shapes:
        E, k, H, I = SHAPES[name]
        w = _weights(E, H, I)
        for M, shared in itertools.product(ms, (False, True)):
            xs = [_x(M, H, seed=1 + s) for s in range(8)]
            calls = [functools.partial(ours, x, w["router_weight"], w["w13"], w["w2"], k,
                                       w["shared"] if shared else None) for x in xs]
            got, us, rot = {}, {False: [], True: []}, {False: [], True: []}
            try:
                for _ in range(2):
                    for on in (False, True):
                        os.environ[env] = "1" if on else "0"
                        got[on] = calls[0]()
                        us[on].append(_bench.time_graph_ms(calls[0]) * 1e3)
                        rot[on].append(_rotating_graph_us(calls))
                r = dict(sweep=sweep, shape=f"{name} M={M}", shared=shared, us_off=round(min(us[False]), 2),
                         us_on=round(min(us[True]), 2), rot_off=round(min(rot[False]), 2),
                         rot_on=round(min(rot[True]), 2), same_bits=bool(torch.equal(got[True], got[False])))
            except Exception as e:  # noqa: BLE001 - record and go on
                r = dict(sweep=sweep, shape=f"{name} M={M}", shared=shared, error=f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                os.environ.pop(env, None)
            _record(rows, r, out, stem)
        del w
        torch.cuda.empty_cache()
    return rows


def pdl_sweep(out: Path, shapes: list[str], ms: list[int]) -> list[dict]:
    """:func:`env_sweep` of programmatic dependent launch (``QWEN35_MOE_PDL``, kernels_triton/moe/pdl.py)."""
    return env_sweep(out, shapes, ms, moe.PDL_ENV, "moe_pdl", "pdl")


def _rotating_graph_us(calls: list) -> float:
    """µs per call of a CUDA graph cycling through ``calls`` (tokens routed to different experts: their weights
    are not left in L2 by the call before, as between a model's layers)."""
    return _bench.time_graph_ms(lambda: [c() for c in calls], calls_per_graph=4) * 1e3 / len(calls)


def decode_sweep(out: Path, shapes: list[str], rounds: int = 3) -> list[dict]:
    """One token: the general pipeline (``QWEN35_MOE_DECODE=0``, PDL as by default) against the decode path
    (kernels_triton/moe/decode.py; also with PDL), without and with the shared expert, graph replay, alternating
    for ``rounds`` rounds (best kept): ``us`` repeats one token (its experts' weights partly stay in L2 between
    calls), ``us_rot`` cycles through 8 tokens routed to different experts."""
    rows = []
    for name in shapes:
        E, k, H, I = SHAPES[name]
        w = _weights(E, H, I)
        xs = [_x(1, H, seed=s) for s in range(8)]
        for shared in (False, True):
            sw = w["shared"] if shared else (None, None, None)

            def general(x, w=w, sw=sw, k=k):  # noqa: ANN001, ANN202
                os.environ[moe.DECODE_ENV] = "0"
                try:
                    return ours(x, w["router_weight"], w["w13"], w["w2"], k, sw if sw[0] is not None else None)
                finally:
                    os.environ.pop(moe.DECODE_ENV, None)

            def one(x, use_pdl, w=w, sw=sw, k=k):  # noqa: ANN001, ANN202
                return moe.moe_block_one_token(x, w["router_weight"], w["w13"], w["w2"], k, True, *sw, None,
                                                  pdl=use_pdl and moe.pdl_enabled(x))

            variants = {"general": general, "decode": functools.partial(one, use_pdl=False),
                        "decode_pdl": functools.partial(one, use_pdl=True)}
            best: dict = {v: {"us": math.inf, "us_rot": math.inf} for v in variants}
            ref_out = general(xs[0])
            rel = {v: _rel(fn(xs[0]), ref_out) for v, fn in variants.items()}
            for _ in range(rounds):
                for v, fn in variants.items():
                    calls = [functools.partial(fn, x) for x in xs]
                    best[v]["us"] = min(best[v]["us"], _bench.time_graph_ms(calls[0]) * 1e3)
                    best[v]["us_rot"] = min(best[v]["us_rot"], _rotating_graph_us(calls))
            for v in variants:
                r = dict(sweep="decode", shape=f"{name} M=1", shared=shared, variant=v, us=round(best[v]["us"], 2),
                         us_rot=round(best[v]["us_rot"], 2), rel_vs_general=round(rel[v], 6))
                _record(rows, r, out, "moe_decode")
        del w
        torch.cuda.empty_cache()
    return rows


def _sweep_points(shapes: list[str], ms: list[int]):  # noqa: ANN202
    """(name, (E, k, H, I), weights, M, x, router partials, n_splits) for every shape and token count of a GEMM sweep,
    the router run with the shared expert's gate as in the model; the device cache is emptied between shapes."""
    for name in shapes:
        E, k, H, I = SHAPES[name]
        w = _weights(E, H, I)
        for M in ms:
            x = _x(M, H)
            logits, n_splits = moe.router_logits(x, w["router_weight"], w["shared"][2])
            yield name, (E, k, H, I), w, M, x, logits, n_splits
        del w
        torch.cuda.empty_cache()


def tma_sweep(out: Path, shapes: list[str], ms: list[int]) -> list[dict]:
    """gate_up and down alone (graph replay, shared expert fused as in the model) with their weight tiles loaded by
    pointers (as before) and through tensor descriptors (TMA, ``moe.gate_up(tma=True)``), at the configured tile
    and with one stage more; rel = the TMA output against the pointer path's."""
    rows = []
    for name, (E, k, H, I), w, M, x, logits, n_splits in _sweep_points(shapes, ms):
        sw13, sw2, _ = w["shared"]
        up_cfg, down_cfg = moe.configs(M, k, E, H, I, x.dtype, x.device)
        weights, _, al = moe.route_and_align(logits, n_splits, k, True, n_experts=E, n_local=E,
                                               block_m=up_cfg.BLOCK_M, expert_map=None, gate=True, shared=True)
        starts, counts = al.group_start.tolist(), al.group_count.tolist()
        written = torch.cat([torch.arange(a, a + c) for a, c in zip(starts, counts, strict=True)]).to(x.device)
        h = moe.gate_up(x, w["w13"], sw13, al, k + 1, up_cfg, tma=False)
        y = moe.down(h, w["w2"], sw2, al, weights, down_cfg, tma=False)
        flops = 2 * M * (k + 1) * H * I
        for which, base, fn, want in (
                ("gate_up", up_cfg, functools.partial(moe.gate_up, x, w["w13"], sw13, al, k + 1), h),
                ("down", down_cfg, functools.partial(moe.down, h, w["w2"], sw2, al, weights), y)):
            for stages in (base.num_stages, base.num_stages + 1):
                cfg = moe.GemmConfig(base.BLOCK_M, base.BLOCK_N, base.BLOCK_K, base.num_warps, stages)
                for tma in (False, True) if stages == base.num_stages else (True,):
                    call = functools.partial(fn, cfg, tma=tma)
                    try:
                        got = call()
                        same = got[written] if which == "gate_up" else got
                        ref = want[written] if which == "gate_up" else want
                        ms_ = _gpu_ms(call, M)
                        r = dict(sweep="tma", which=which, shape=f"{name} M={M}", config=cfg.as_dict(), tma=tma,
                                 us=round(ms_ * 1e3, 1),
                                 TFLOPs=round((2 if which == "gate_up" else 1) * flops / ms_ / 1e9, 1),
                                 rel_vs_pointer=round(_rel(same, ref), 6))
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record and go on
                        r = dict(sweep="tma", which=which, shape=f"{name} M={M}", config=cfg.as_dict(), tma=tma,
                                 error=f"{type(e).__name__}: {str(e)[:200]}")
                    _record(rows, r, out, "moe_tma")
    return rows


# (gate_up, down) as (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the tuned 35B 4096 / 16384 ones
SUB_SWEEP_CONFIGS = {
    64: ((64, 256, 64, 8, 3), (64, 128, 64, 4, 4)),
    128: ((128, 128, 64, 8, 4), (128, 256, 64, 8, 4)),
}


def sub_tiles_sweep(out: Path, shapes: list[str], ms: list[int]) -> list[dict]:
    """gate_up and down (graph replay, shared expert fused as in the model) with and without the shorter tiles for
    a group's short last block (``moe.sub_levels``), at 64- and 128-row blocks; with the padding they face."""
    rows = []
    for name, (E, k, _, _), w, M, x, logits, n_splits in _sweep_points(shapes, ms):
        sw13, sw2, _ = w["shared"]
        for bm, (up_t, down_t) in SUB_SWEEP_CONFIGS.items():
            up_cfg, down_cfg = moe.GemmConfig(*up_t), moe.GemmConfig(*down_t)
            weights, _, al = moe.route_and_align(logits, n_splits, k, True, n_experts=E, n_local=E, block_m=bm,
                                                   expert_map=None, gate=True, shared=True)
            blocks = int(al.total_blocks.item())
            full = (al.group_count.long() // bm).sum().item()
            h = moe.gate_up(x, w["w13"], sw13, al, k + 1, up_cfg, sub=0)
            want = moe.down(h, w["w2"], sw2, al, weights, down_cfg, sub=0)
            for sub in sorted({0, moe.sub_levels(bm)}):
                up = functools.partial(moe.gate_up, x, w["w13"], sw13, al, k + 1, up_cfg, sub=sub)
                dn = functools.partial(moe.down, h, w["w2"], sw2, al, weights, down_cfg, sub=sub)
                try:
                    got = moe.down(up(), w["w2"], sw2, al, weights, down_cfg, sub=sub)
                    up_ms, down_ms = _gpu_ms(up, M), _gpu_ms(dn, M)
                    r = dict(sweep="sub_tiles", shape=f"{name} M={M}", block_m=bm, sub=sub, gate_up_us=round(
                        up_ms * 1e3, 1), down_us=round(down_ms * 1e3, 1), both_us=round((up_ms + down_ms) * 1e3, 1),
                        blocks=blocks, full_blocks=full, real_rows=M * (k + 1),
                        padded_pct=round(100 * (1 - M * (k + 1) / (blocks * bm)), 1),
                        rel_vs_sub0=round(_rel(got, want), 6))
                except Exception as e:  # noqa: BLE001 - record and go on
                    r = dict(sweep="sub_tiles", shape=f"{name} M={M}", block_m=bm, sub=sub,
                             error=f"{type(e).__name__}: {str(e)[:200]}")
                _record(rows, r, out, "moe_sub_tiles")
    return rows


def _route_align_for(x, w, top_k, block_m):  # noqa: ANN001, ANN202
    E = w["w13"].shape[0]
    logits, n_splits = moe.router_logits(x, w["router_weight"], None)
    return moe.route_and_align(logits, n_splits, top_k, True, n_experts=E, n_local=E, block_m=block_m,
                                 expert_map=None, gate=False, shared=False)
