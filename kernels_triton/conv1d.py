"""Depthwise causal conv1d (GDN's short conv, window W <= 8) with SiLU fused: varlen prefill and the decode update.

Prefill with a conv pool is two launches: the conv over (token block, channel block) tiles,
each row finding its sequence by binary search in ``cu_seqlens``, skipping each sequence's
first ``W - 1`` rows; then one program per (sequence, channel block) computes those rows from
the slot's history and writes the new history. Keeping every read and write of a slot in one
program is what makes the in-place update race-free (a short sequence's new history overlaps
the old one it reads); keeping the gather of history out of the big kernel keeps it lean.
The decode update reads the window, writes the shifted history and the output in one program
per (row, channel block); padding rows (slot < 0) write zeros and leave the pool alone.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher

MAX_WIDTH = 8  # as the façade
PREFILL_ROWS = 16  # token rows per prefill program (BT)


def _pow2(n: int) -> int:
    """Next power of two >= n; plain Python (triton.next_power_of_2 costs microseconds of host time)."""
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def _silu(y):
    return y / (1.0 + tl.exp(-y))


@triton.jit(do_not_specialize=["T", "N"])
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, T, D, N,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    VARLEN: tl.constexpr, SKIP_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """Conv over a (token block, channel block) tile; taps before a sequence's start read zeros.

    With ``SKIP_HEADS`` the first W-1 rows of each sequence are left to ``_conv_head_kernel``
    (they need the slot's history)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    tmask = t < T
    dmask = d < D
    start = tl.zeros((BT,), dtype=tl.int32)
    if VARLEN:
        # Sequence of each row: the last n with cu[n] <= t (zero-length sequences are skipped over).
        lo = tl.zeros((BT,), dtype=tl.int32)
        hi = tl.zeros((BT,), dtype=tl.int32) + (N - 1)
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            take = tl.load(cu_ptr + mid, mask=tmask, other=0) <= t
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        start = tl.load(cu_ptr + lo, mask=tmask, other=0).to(tl.int32)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    for tap in tl.static_range(W):
        pos = t - (W - 1) + tap
        xv = tl.load(x_ptr + pos.to(tl.int64)[:, None] * D + d[None, :],
                     mask=(tmask & (pos >= start))[:, None] & dmask[None, :], other=0.0)
        acc += xv.to(tl.float32) * tl.load(w_ptr + d * W + tap, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = _silu(acc)
    if SKIP_HEADS:
        tmask = tmask & (t - start >= W - 1)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * D + d[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["T"])
def _conv_head_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, pool_ptr, slots_ptr, has_init_ptr, T, D, pool_slot_stride,
    W: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
    VARLEN: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """Sequence n's first W-1 outputs (their taps reach into the slot's history), then its new
    history: the last W-1 inputs, reaching into the old history when the sequence is shorter.
    One program reads the old history before writing the new one, so nothing races."""
    n = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = d < D
    if VARLEN:
        start = tl.load(cu_ptr + n)
        end = tl.load(cu_ptr + n + 1)
    else:
        start = 0
        end = T
    slot = tl.load(slots_ptr + n).to(tl.int64)
    use_hist = slot >= 0
    if HAS_INIT_FLAGS:
        use_hist = use_hist & (tl.load(has_init_ptr + n) != 0)
    hist_ptrs = pool_ptr + slot * pool_slot_stride + d[None, :] * (W - 1)  # [1, BD]; + column index

    r = tl.arange(0, BH)  # row r of the sequence / column r of the history
    t = start + r
    acc = tl.zeros((BH, BD), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    for tap in tl.static_range(W):
        pos = t - (W - 1) + tap
        inside = (pos >= start)[:, None]
        xv = tl.load(x_ptr + pos.to(tl.int64)[:, None] * D + d[None, :], mask=inside & dmask[None, :], other=0.0)
        hv = tl.load(hist_ptrs + (pos - start + W - 1)[:, None], mask=~inside & dmask[None, :] & use_hist, other=0.0)
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * tl.load(w_ptr + d * W + tap, mask=dmask, other=0.0).to(
            tl.float32)[None, :]
    if SILU:
        acc = _silu(acc)

    pos = end - (W - 1) + r  # token position of new history column r
    cmask = (r < W - 1)[:, None] & dmask[None, :]
    new = tl.load(x_ptr + pos.to(tl.int64)[:, None] * D + d[None, :], mask=cmask & (pos >= start)[:, None], other=0.0)
    old = tl.load(hist_ptrs + (pos - start + W - 1)[:, None], mask=cmask & (pos < start)[:, None] & use_hist, other=0.0)

    tl.store(y_ptr + t.to(tl.int64)[:, None] * D + d[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=((r < W - 1) & (t < end))[:, None] & dmask[None, :])
    if slot >= 0:
        tl.store(hist_ptrs + r[:, None], tl.where((pos >= start)[:, None], new, old), mask=cmask)


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, pool_ptr, slots_ptr, D, pool_slot_stride,
    W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    row = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = d < D
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(y_ptr + row * D + d, tl.zeros((BD,), dtype=y_ptr.dtype.element_ty), mask=dmask)
    else:
        c = tl.arange(0, BW)
        hist_ptrs = pool_ptr + slot * pool_slot_stride + d[:, None] * (W - 1) + c[None, :]
        x = tl.load(x_ptr + row * D + d, mask=dmask, other=0.0)
        # Window = [history (W-1 columns), x]; column W-1 is the new input.
        window = tl.load(hist_ptrs, mask=dmask[:, None] & (c < W - 1)[None, :], other=0.0).to(tl.float32)
        window = tl.where((c == W - 1)[None, :], x.to(tl.float32)[:, None], window)
        wt = tl.load(w_ptr + d[:, None] * W + c[None, :], mask=dmask[:, None] & (c < W)[None, :], other=0.0)
        y = tl.sum(window * wt.to(tl.float32), axis=1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        if SILU:
            y = _silu(y)
        if W > 1:
            shifted = tl.load(hist_ptrs + 1, mask=dmask[:, None] & (c < W - 2)[None, :], other=0.0)
            shifted = tl.where((c == W - 2)[None, :], x[:, None], shifted)
            tl.store(hist_ptrs, shifted, mask=dmask[:, None] & (c < W - 1)[None, :])
        tl.store(y_ptr + row * D + d, y.to(y_ptr.dtype.element_ty), mask=dmask)


_launch_prefill = DirectLauncher(_conv_prefill_kernel)
_launch_head = DirectLauncher(_conv_head_kernel)
_launch_update = DirectLauncher(_conv_update_kernel)

_WARPS4 = {"num_warps": 4}
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"triton conv1d takes fp16, bf16 or fp32 activations, got {x.dtype}")
    W = weight.shape[1]
    if W > MAX_WIDTH:
        raise ValueError(f"triton conv1d takes window W <= {MAX_WIDTH}, got {W}")
    return W


@functools.lru_cache(maxsize=1024)
def _prefill_plan(D: int, W: int, N: int) -> tuple[int, int, int, int]:
    """(BD, channel blocks, binary-search steps over N sequences, BH): the launch parameters that depend on
    shapes only, computed once per shape (each costs host time on every call otherwise)."""
    BD = min(128, _pow2(D))
    return BD, -(-D // BD), max(1, (N - 1).bit_length()), _pow2(W - 1)


@functools.lru_cache(maxsize=1024)
def _update_plan(D: int, W: int) -> tuple[int, int, int]:
    """(BD, channel blocks, BW) of the decode update."""
    BD = min(256, _pow2(D))
    return BD, -(-D // BD), _pow2(W)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    conv_pool: torch.Tensor | None = None,
    conv_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.causal_conv1d_prefill`."""
    W = _check(x, weight)
    T, D = x.shape
    y = torch.empty_like(x)
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else 1
    if N == 0:
        return y
    BD, d_blocks, search_steps, BH = _prefill_plan(D, W, N)
    pool = conv_pool is not None
    silu = activation == "silu"
    if T > 0:
        _launch_prefill((-(-T // PREFILL_ROWS), d_blocks), (
            x, weight, bias, y, cu_seqlens, T, D, N,
            W, PREFILL_ROWS, BD, search_steps, varlen, pool and W > 1, bias is not None, silu), _WARPS4)
    if pool and W > 1:
        _launch_head((N, d_blocks), (
            x, weight, bias, y, cu_seqlens, conv_pool, conv_slots, has_initial_state, T, D, conv_pool.stride(0),
            W, BD, BH, varlen, has_initial_state is not None, bias is not None, silu), _WARPS4)
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_pool: torch.Tensor,
    conv_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.causal_conv1d_update` (CUDA-graph capturable)."""
    W = _check(x, weight)
    B, D = x.shape
    y = torch.empty_like(x)
    if B == 0:
        return y
    BD, d_blocks, BW = _update_plan(D, W)
    _launch_update((B, d_blocks), (
        x, weight, bias, y, conv_pool, conv_slots, D, conv_pool.stride(0),
        W, BD, BW, bias is not None, activation == "silu"), _WARPS4)
    return y
