"""The down GEMM's flat multi-tile loop (``TILES_N`` column tiles per program) gives the one-tile loop's bits;
a group's short last block runs a shorter tile (``SUB_LEVELS``) in both expert GEMMs and gives the same rows.

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


@pytest.mark.parametrize("H,I,block_k", [(64, 32, 16), (80, 48, 32)])  # 80 / 48: ragged K tiles, N tiles that fit
def test_tma_weight_tiles_match(H, I, block_k):
    """Weight tiles through tensor descriptors (``tma=True``; the interpreter emulates them on CPU) give the
    pointer path's rows in both GEMMs, one tile per program and in the flat loop; fp16 (bf16 on GPU only)."""
    gen = torch.Generator().manual_seed(9)
    E, M, k, block_m, block_n = 4, 13, 2, 16, 16
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32).to(DEVICE)
    weights = torch.rand(M, k, generator=gen).to(DEVICE)
    al = talign.align(ids, n_local=E, block_m=block_m)
    x = torch.randn(M, H, generator=gen).to(DEVICE, torch.float16)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(DEVICE, torch.float16)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(DEVICE, torch.float16)
    cfg = GemmConfig(block_m, block_n, block_k, 4, 2)
    starts, counts = al.group_start.tolist(), al.group_count.tolist()
    real = torch.cat([torch.arange(a, a + c) for a, c in zip(starts, counts, strict=True)]).to(DEVICE)
    h = texperts.gate_up(x, w13, None, al, k, cfg, tma=False)
    h_tma = texperts.gate_up(x, w13, None, al, k, cfg, tma=True)
    assert_close(h_tma[real].double().cpu(), h[real].double().cpu(), 2e-3, "h")
    y = texperts.down(h, w2, None, al, weights, cfg, tiles_n=1, tma=False)
    for tiles_n in (1, 3):
        assert_close(texperts.down(h, w2, None, al, weights, cfg, tiles_n=tiles_n, tma=True).double().cpu(),
                     y.double().cpu(), 2e-3, f"y, tiles_n={tiles_n}")


def test_tma_refused_where_impossible():
    """fp32 has no descriptor path: asking for it is an error that names the reason, not a silent fallback."""
    al = talign.align(torch.zeros(2, 1, dtype=torch.int32, device=DEVICE), n_local=1, block_m=16)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        texperts.gate_up(x, torch.randn(1, 32, 32, device=DEVICE), None, al, 1, GemmConfig(16, 16, 16, 4, 2),
                         tma=True)


def test_tma_default_rule():
    """By default only the down GEMM of a CUDA tensor with >= 256 token-slots per group takes descriptors (on sm_90+,
    bf16 / fp16); the CPU interpreter only when asked (``tma=True``)."""
    cfg = GemmConfig(128, 128, 64, 8, 4)
    x = torch.empty(4, 64, dtype=torch.float16, device=DEVICE)
    assert not texperts.tma_default("gate_up", x, cfg, 2048, 512, 1000.0)
    assert not texperts.tma_default("down", x, cfg, 2048, 512, 255.0)
    hopper = x.is_cuda and torch.cuda.get_device_capability()[0] >= 9
    assert texperts.tma_default("down", x, cfg, 2048, 512, 256.0) == hopper
    assert not texperts.tma_default("down", x.float(), cfg, 2048, 512, 1000.0)  # fp32: never


def test_down_tiles_rule():
    """Decode-sized blocks keep one tile per program; larger blocks take about 32 K steps per program."""
    assert texperts.down_tiles_per_program(GemmConfig(16, 128, 64, 4, 5), 2048, 512) == 1
    assert texperts.down_tiles_per_program(GemmConfig(128, 256, 64, 8, 4), 2048, 512) == 4
    assert texperts.down_tiles_per_program(GemmConfig(128, 256, 128, 8, 2), 4096, 128) == 16
    assert texperts.down_tiles_per_program(GemmConfig(64, 128, 64, 4, 4), 4096, 128) == 16


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("block_m", [64, 128])
def test_short_last_blocks(dtype, block_m):
    """Groups of 10 / 40 / 100 / 130 / 0 slots: last blocks with 2-100 real rows take the half / quarter tiles
    (or the full one) by their count; every level gives the reference rows, every tiles_n the same bits."""
    gen = torch.Generator().manual_seed(7)
    counts = [10, 40, 100, 130, 0]
    E, H, I, k = len(counts), 48, 32, 1
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)][:, None].to(DEVICE)
    M = ids.shape[0]
    weights = torch.rand(M, k, generator=gen).to(DEVICE)
    x = torch.randn(M, H, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(DEVICE, dtype)
    al = talign.align(ids, n_local=E, block_m=block_m)
    cfg = GemmConfig(block_m, 16, 16, 4, 2)
    xd, w13d, w2d = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    gate, up = torch.einsum("mh,mnh->mn", xd, w13d[ids[:, 0].long().cpu()]).chunk(2, dim=-1)
    want_h = torch.nn.functional.silu(gate) * up  # per token (k = 1: slot = token)
    rows, starts = al.sorted_slots.long().cpu(), al.group_start.cpu()
    real = torch.cat([rows[int(starts[e]):int(starts[e]) + c] for e, c in enumerate(counts)])
    where = torch.cat([torch.arange(int(starts[e]), int(starts[e]) + c) for e, c in enumerate(counts)])
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    for sub in (0, 1, 2):
        h = texperts.gate_up(x, w13, None, al, k, cfg, sub=sub)
        assert_close(h[where].double().cpu(), want_h[real], tol, f"h, sub={sub}")
        y = texperts.down(h, w2, None, al, weights, cfg, tiles_n=1, sub=sub)
        assert torch.equal(texperts.down(h, w2, None, al, weights, cfg, tiles_n=2, sub=sub), y)
        want_y = weights.double().cpu() * torch.einsum("mi,mhi->mh", h[where].double().cpu()[torch.argsort(real)],
                                                       w2d[ids[:, 0].long().cpu()])
        assert_close(y.double().cpu(), want_y, tol, f"y, sub={sub}")


def test_sub_levels_rule():
    assert [texperts.sub_levels(bm) for bm in (16, 32, 64, 128, 256)] == [0, 0, 0, 2, 2]
