"""How fast one short kernel can read N MB from HBM on this GPU: the bound for decode-sized MoE launches.

    python -m tuning.hbm_bursts --out DIR     # -> DIR/hbm_bursts_<device>.json
    python -m tuning.hbm_bursts --out DIR --sizes 1,4,30 --chains 4,30 --tag s22   # other sizes / chains

A read-only Triton kernel (each program sums its contiguous share of the bytes and stores one fp32) over program
counts, block widths, warps and pipeline stages, per size (the best row per size printed); torch's copy for
reference; and chains of dependent reads shaped like the one-token MoE block (router 1 MB -> gate_up 32 MB ->
down 16 MB at 35B-A3B), each read at its size's best shape (sizes in MiB; a chain's sizes must be among the sizes
swept). CUDA-graph replay; the buffers rotate over 32 regions so L2 holds none of a read's bytes when it starts.
Reports, never asserts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels_triton.bench_api import device_slug
from tuning import _bench

SIZES_MB = (1, 2, 4, 8, 16, 32, 48, 64)
PROGRAMS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BLOCKS = ((1024, 4), (2048, 8), (4096, 8))  # (elements per load, warps)
CHAINS = ((32, 16), (1, 32, 16), (1, 48))


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per, BLOCK: tl.constexpr):
    base = x_ptr + tl.program_id(0).to(tl.int64) * n_per
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, n_per, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


class _Reader:
    """Reads of ``mb`` MB from 4 buffers of 128 MB at 8 offsets each, a new region per call (cold L2)."""

    def __init__(self) -> None:
        self.bufs = [torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        self.part = torch.empty(1 << 16, device="cuda")
        self.calls = 0

    def __call__(self, mb: int, programs: int, block: int, warps: int, stages: int) -> None:
        n = (mb << 20) // 2
        region = self.calls % 32
        offset = ((region // 4) % 8) * n if 8 * n <= self.bufs[0].numel() else 0
        self.calls += 1
        _read_kernel[(programs,)](self.bufs[region % 4][offset:], self.part, n // programs, BLOCK=block,
                                  num_warps=warps, num_stages=stages)


def run(out: Path, sizes: tuple[int, ...] = SIZES_MB, chains: tuple[tuple[int, ...], ...] = CHAINS,
        tag: str = "") -> list[dict]:
    _check_chains(sizes, chains)
    read, rows = _Reader(), []
    for mb in sizes:
        n = (mb << 20) // 2
        for programs in PROGRAMS:
            for block, warps in BLOCKS:
                if n % programs or (n // programs) % block:
                    continue
                for stages in (1, 3):
                    def four(mb=mb, programs=programs, block=block, warps=warps, stages=stages) -> None:
                        for _ in range(4):
                            read(mb, programs, block, warps, stages)
                    us = _bench.time_graph_ms(four, calls_per_graph=5) * 1e3 / 4
                    rows.append(dict(what="read", MB=mb, programs=programs, block=block, warps=warps, stages=stages,
                                     us=round(us, 2), TBps=round(mb * (1 << 20) / us / 1e6, 2)))
        print(json.dumps(_best(rows, mb)), flush=True)
        srcs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        pairs = [(s, torch.empty_like(s)) for s in srcs]

        def copies(pairs=pairs) -> None:
            for s, d in pairs:
                d.copy_(s)
        us = _bench.time_graph_ms(copies, calls_per_graph=5) * 1e3 / 4
        rows.append(dict(what="copy", MB=mb, us=round(us, 2),
                         TBps_read_plus_write=round(2 * mb * (1 << 20) / us / 1e6, 2)))
        print(json.dumps(rows[-1]), flush=True)
        del srcs, pairs
    for links in chains:
        shapes = [_best(rows, mb) for mb in links]

        def chain(links=links, shapes=shapes) -> None:
            for _ in range(4):
                for mb, s in zip(links, shapes, strict=True):
                    read(mb, s["programs"], s["block"], s["warps"], s["stages"])
        us = _bench.time_graph_ms(chain, calls_per_graph=5) * 1e3 / 4
        rows.append(dict(what="chain " + " -> ".join(f"{mb} MB" for mb in links), us=round(us, 2),
                         TBps=round(sum(links) * (1 << 20) / us / 1e6, 2)))
        print(json.dumps(rows[-1]), flush=True)
    name = f"hbm_bursts_{tag}_" if tag else "hbm_bursts_"
    _bench.write_results(out, name + device_slug(_bench.device_name()), rows, meta=dict(
        op="HBM read bursts", dtype="bfloat16", what="graph replay, 32 regions rotated (cold L2); us per read"))
    return rows


def _check_chains(sizes: tuple[int, ...], chains: tuple[tuple[int, ...], ...]) -> None:
    missing = sorted({mb for chain in chains for mb in chain} - set(sizes))
    if missing:
        raise ValueError(f"hbm_bursts: chain sizes {missing} MiB are not among the sizes swept {sorted(sizes)}")


def _sizes(value: str) -> tuple[int, ...]:
    """``"1,4,30"`` -> (1, 4, 30): positive whole MiB."""
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected comma-separated whole MiB >= 1, e.g. 1,4,30")
    return sizes


def _best(rows: list[dict], mb: int) -> dict:
    return min((r for r in rows if r.get("MB") == mb and r["what"] == "read"), key=lambda r: r["us"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", type=_sizes, default=SIZES_MB, help="comma-separated read sizes in MiB")
    p.add_argument("--chains", type=lambda v: tuple(_sizes(c) for c in v.split(";")), default=CHAINS,
                   help="semicolon-separated chains of dependent reads, each comma-separated sizes in MiB")
    p.add_argument("--tag", default="", help="inserted in the results file name")
    args = p.parse_args(argv)
    try:
        _check_chains(args.sizes, args.chains)
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        print("hbm_bursts: needs a CUDA device")
        return 2
    run(args.out, args.sizes, args.chains, args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
