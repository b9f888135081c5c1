"""The down GEMM's flat multi-tile loop (``TILES_N`` column tiles per program) gives the one-tile loop's bits.

Runs on CPU under TRITON_INTERPRET=1 (fp16/fp32: the interpreter's bf16 dot is broken), or on CUDA. Its sm_90
build is part of tests/test_triton_moe.py::test_kernels_build_for_hopper.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import pytest  # noqa: E402
from helpers import assert_close  # noqa: E402

from kernels_triton.moe import align as talign  # noqa: E402
from kernels_triton.moe import experts as texperts  # noqa: E402
from kernels_triton.moe.config import GemmConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("H,I,block_k", [(64, 32, 16), (80, 40, 16)])  # 80 / 40: ragged N and K tiles
def test_down_flat_tiles_bit_identical(dtype, H, I, block_k):
    gen = torch.Generator().manual_seed(5)
    E, M, k, block_m, block_n = 4, 11, 2, 16, 16
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32).to(DEVICE)
    weights = torch.rand(M, k, generator=gen).to(DEVICE)
    al = talign.align(ids, n_local=E, block_m=block_m)
    h = (torch.randn(al.max_blocks * block_m, I, generator=gen)).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(DEVICE, dtype)
    cfg = GemmConfig(block_m, block_n, block_k, 4, 2)
    one = texperts.down(h, w2, None, al, weights, cfg, tiles_n=1)
    n_tiles = -(-H // block_n)
    for tiles_n in (2, 3, n_tiles):  # 3 leaves a short last group when n_tiles is 4 or 5
        assert torch.equal(texperts.down(h, w2, None, al, weights, cfg, tiles_n=tiles_n), one), tiles_n
    # and it is the down GEMM: y[slot] = weight[slot] * h[row] @ W2[e]^T for every real row
    rows = al.sorted_slots.long().cpu()
    counts, starts = al.group_count.cpu(), al.group_start.cpu()
    y = one.double().cpu()
    for e in range(E):
        for r in range(int(starts[e]), int(starts[e]) + int(counts[e])):
            slot = int(rows[r])
            want = weights.flatten()[slot].double().cpu() * (h[r].double().cpu() @ w2[e].double().cpu().T)
            assert_close(y[slot], want, 2e-3 if dtype == torch.float16 else 1e-5, f"slot {slot}")


def test_down_tiles_rule():
    """Decode-sized blocks keep one tile per program; larger blocks take about 32 K steps per program."""
    assert texperts.down_tiles_per_program(GemmConfig(16, 128, 64, 4, 5), 2048, 512) == 1
    assert texperts.down_tiles_per_program(GemmConfig(128, 256, 64, 8, 4), 2048, 512) == 4
    assert texperts.down_tiles_per_program(GemmConfig(128, 256, 128, 8, 2), 4096, 128) == 16
    assert texperts.down_tiles_per_program(GemmConfig(64, 128, 64, 4, 4), 4096, 128) == 16
