"""Depthwise causal conv1d (GDN's short conv, window W <= 8) with SiLU fused: varlen prefill and the decode update.

Prefill with a conv pool is two launches: the conv over (token block, channel block) tiles,
each row finding its sequence by binary search in ``cu_seqlens``, skipping each sequence's
first ``W - 1`` rows; then one program per (sequence, channel block) computes those rows from
the slot's history and writes the new history. Keeping every read and write of a slot in one
program is what makes the in-place update race-free (a short sequence's new history overlaps
the old one it reads); keeping the gather of history out of the big kernel keeps it lean.
The decode update reads the window, writes the shifted history and the output in one program
per (row, channel block); padding rows (slot < 0) write zeros and leave the pool alone.

Plane layout (``planes=(n0, n1, n2)``, ``PLANES`` in the kernels): x and y hold up to three planes back to back,
plane p ``[rows, n_p]`` contiguous, channels ``n0 + ... + n_{p-1}`` onwards of the weight, bias and conv pool.
GDN's q, k and v are three such planes of one buffer, so one launch convolves all three and each comes
out contiguous. A channel block never straddles two planes: each plane has its own blocks.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher
from kernels_triton._util import pow2

MAX_WIDTH = 8  # as the façade
PREFILL_ROWS = 16  # token rows per prefill program (BT)



@triton.jit
def _silu(y):
    return y / (1.0 + tl.exp(-y))


@triton.jit
def _channel_block(pid, rows, D, P1, P2, BD: tl.constexpr, PLANES: tl.constexpr):
    """Channel block ``pid``: (channels d into weight / bias / pool, their mask, the block's columns c in its
    plane, the plane's offset in x and y in elements, its row stride). Without ``PLANES``: one plane ``[rows, D]``.
    Planes: channels [0, P1), [P1, P2), [P2, D), blocks numbered plane after plane."""
    if PLANES:
        b1 = (P1 + BD - 1) // BD
        b2 = b1 + (P2 - P1 + BD - 1) // BD
        first = tl.where(pid >= b2, P2, tl.where(pid >= b1, P1, 0))
        width = tl.where(pid >= b2, D - P2, tl.where(pid >= b1, P2 - P1, P1))
        c = (pid - tl.where(pid >= b2, b2, tl.where(pid >= b1, b1, 0))) * BD + tl.arange(0, BD)
        d = first + c
        dmask = c < width
        plane = first.to(tl.int64) * rows
        stride = width
    else:
        d = pid * BD + tl.arange(0, BD)
        c = d
        dmask = d < D
        plane = 0
        stride = D
    return d, dmask, c, plane, stride


@triton.jit
def _prefill_tile(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, T, D, N, P1, P2,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    VARLEN: tl.constexpr, SKIP_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PLANES: tl.constexpr,
):
    """Conv over a (token block, channel block) tile; taps before a sequence's start read zeros.

    With ``SKIP_HEADS`` the first W-1 rows of each sequence are left to ``_conv_head_kernel``
    (they need the slot's history)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d, dmask, c, plane, stride = _channel_block(tl.program_id(1), T, D, P1, P2, BD, PLANES)
    tmask = t < T
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
        xv = tl.load(x_ptr + plane + pos.to(tl.int64)[:, None] * stride + c[None, :],
                     mask=(tmask & (pos >= start))[:, None] & dmask[None, :], other=0.0)
        acc += xv.to(tl.float32) * tl.load(w_ptr + d * W + tap, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = _silu(acc)
    if SKIP_HEADS:
        tmask = tmask & (t - start >= W - 1)
    tl.store(y_ptr + plane + t.to(tl.int64)[:, None] * stride + c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _head_rows(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, pool_ptr, slots_ptr, has_init_ptr, T, D, pool_slot_stride, P1, P2,
    W: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
    VARLEN: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PLANES: tl.constexpr,
):
    """Sequence n's first W-1 outputs (their taps reach into the slot's history), then its new
    history: the last W-1 inputs, reaching into the old history when the sequence is shorter.
    One program reads the old history before writing the new one, so nothing races."""
    n = tl.program_id(0)
    d, dmask, c, plane, stride = _channel_block(tl.program_id(1), T, D, P1, P2, BD, PLANES)
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
        xv = tl.load(x_ptr + plane + pos.to(tl.int64)[:, None] * stride + c[None, :], mask=inside & dmask[None, :],
                     other=0.0)
        hv = tl.load(hist_ptrs + (pos - start + W - 1)[:, None], mask=~inside & dmask[None, :] & use_hist, other=0.0)
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * tl.load(w_ptr + d * W + tap, mask=dmask, other=0.0).to(
            tl.float32)[None, :]
    if SILU:
        acc = _silu(acc)

    pos = end - (W - 1) + r  # token position of new history column r
    cmask = (r < W - 1)[:, None] & dmask[None, :]
    new = tl.load(x_ptr + plane + pos.to(tl.int64)[:, None] * stride + c[None, :], mask=cmask & (pos >= start)[:, None],
                  other=0.0)
    old = tl.load(hist_ptrs + (pos - start + W - 1)[:, None], mask=cmask & (pos < start)[:, None] & use_hist, other=0.0)

    tl.store(y_ptr + plane + t.to(tl.int64)[:, None] * stride + c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=((r < W - 1) & (t < end))[:, None] & dmask[None, :])
    if slot >= 0:
        tl.store(hist_ptrs + r[:, None], tl.where((pos >= start)[:, None], new, old), mask=cmask)


@triton.jit
def _update_row(
    x_ptr, w_ptr, bias_ptr, y_ptr, pool_ptr, slots_ptr, B, D, pool_slot_stride, P1, P2,
    W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PLANES: tl.constexpr,
):
    """Decode: one row's window (history, then the new input) -> output, and the shifted history."""
    row = tl.program_id(0)
    d, dmask, c_in, plane, stride = _channel_block(tl.program_id(1), B, D, P1, P2, BD, PLANES)
    x_at = plane + row * stride + c_in  # x[row, d] and y[row, d]
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(y_ptr + x_at, tl.zeros((BD,), dtype=y_ptr.dtype.element_ty), mask=dmask)
    else:
        c = tl.arange(0, BW)
        hist_ptrs = pool_ptr + slot * pool_slot_stride + d[:, None] * (W - 1) + c[None, :]
        x = tl.load(x_ptr + x_at, mask=dmask, other=0.0)
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
        tl.store(y_ptr + x_at, y.to(y_ptr.dtype.element_ty), mask=dmask)


# Kernels: rows of D channels, and the same over planes (its own kernels, so the row layout's code and
# signatures stay as they were).


@triton.jit(do_not_specialize=["T", "N"])
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, T, D, N,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    VARLEN: tl.constexpr, SKIP_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    _prefill_tile(x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, T, D, N, D, D,
                  W, BT, BD, SEARCH_STEPS, VARLEN, SKIP_HEADS, HAS_BIAS, SILU, False)


@triton.jit(do_not_specialize=["T", "N"])
def _conv_prefill_planes_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, T, D, N, P1, P2,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    VARLEN: tl.constexpr, SKIP_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    _prefill_tile(x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, T, D, N, P1, P2,
                  W, BT, BD, SEARCH_STEPS, VARLEN, SKIP_HEADS, HAS_BIAS, SILU, True)


@triton.jit(do_not_specialize=["T"])
def _conv_head_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, pool_ptr, slots_ptr, has_init_ptr, T, D, pool_slot_stride,
    W: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
    VARLEN: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    _head_rows(x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, pool_ptr, slots_ptr, has_init_ptr, T, D, pool_slot_stride,
               D, D, W, BD, BH, VARLEN, HAS_INIT_FLAGS, HAS_BIAS, SILU, False)


@triton.jit(do_not_specialize=["T"])
def _conv_head_planes_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, pool_ptr, slots_ptr, has_init_ptr, T, D, pool_slot_stride, P1, P2,
    W: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
    VARLEN: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    _head_rows(x_ptr, w_ptr, bias_ptr, y_ptr, cu_ptr, pool_ptr, slots_ptr, has_init_ptr, T, D, pool_slot_stride,
               P1, P2, W, BD, BH, VARLEN, HAS_INIT_FLAGS, HAS_BIAS, SILU, True)


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, pool_ptr, slots_ptr, D, pool_slot_stride,
    W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    _update_row(x_ptr, w_ptr, bias_ptr, y_ptr, pool_ptr, slots_ptr, 0, D, pool_slot_stride, D, D,
                W, BD, BW, HAS_BIAS, SILU, False)


@triton.jit(do_not_specialize=["B"])
def _conv_update_planes_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, pool_ptr, slots_ptr, B, D, pool_slot_stride, P1, P2,
    W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    _update_row(x_ptr, w_ptr, bias_ptr, y_ptr, pool_ptr, slots_ptr, B, D, pool_slot_stride, P1, P2,
                W, BD, BW, HAS_BIAS, SILU, True)


_launch_prefill = DirectLauncher(_conv_prefill_kernel)
_launch_head = DirectLauncher(_conv_head_kernel)
_launch_update = DirectLauncher(_conv_update_kernel)
_launch_prefill_planes = DirectLauncher(_conv_prefill_planes_kernel)
_launch_head_planes = DirectLauncher(_conv_head_planes_kernel)
_launch_update_planes = DirectLauncher(_conv_update_planes_kernel)

_WARPS4 = {"num_warps": 4}
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"triton conv1d takes fp16, bf16 or fp32 activations, got {x.dtype}")
    W = weight.shape[1]
    if W > MAX_WIDTH:
        raise ValueError(f"triton conv1d takes window W <= {MAX_WIDTH}, got {W}")
    return W


def _channel_plan(D: int, planes: tuple[int, ...] | None, BD: int) -> tuple[int, int, int, bool]:
    """(P1, P2, channel blocks, plane mode?) for ``D`` channels, optionally split into up to three planes."""
    if planes is None:
        return D, D, -(-D // BD), False
    if not 1 <= len(planes) <= 3 or min(planes) < 0 or sum(planes) != D:
        raise ValueError(f"planes={planes} must be 1 to 3 non-negative widths summing to the channels D={D}")
    widths = (*planes, 0, 0)[:3]
    return widths[0], widths[0] + widths[1], sum(-(-n // BD) for n in widths), True


@functools.lru_cache(maxsize=1024)
def _prefill_plan(D: int, W: int, N: int, planes: tuple[int, ...] | None) -> tuple:
    """(BD, P1, P2, channel blocks, plane mode?, binary-search steps over N sequences, BH): launch parameters that
    depend on shapes only, computed once per shape (each costs host time on every call otherwise)."""
    BD = min(128, pow2(D))
    return BD, *_channel_plan(D, planes, BD), max(1, (N - 1).bit_length()), pow2(W - 1)


@functools.lru_cache(maxsize=1024)
def _update_plan(D: int, W: int, planes: tuple[int, ...] | None) -> tuple:
    """(BD, P1, P2, channel blocks, plane mode?, BW) of the decode update."""
    BD = min(256, pow2(D))
    return BD, *_channel_plan(D, planes, BD), pow2(W)


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
    planes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.causal_conv1d_prefill`.

    ``planes``: x ``[T, D]`` holds up to three planes ``[T, planes[p]]`` back to back (summing to D) rather than
    rows of D channels, and y comes back in the same layout (see the module docstring).
    """
    W = _check(x, weight)
    T, D = x.shape
    y = torch.empty_like(x)
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else 1
    BD, P1, P2, d_blocks, plane_mode, search_steps, BH = _prefill_plan(D, W, N, planes and tuple(planes))
    if N == 0:
        return y
    pool = conv_pool is not None
    silu = activation == "silu"
    consts = (W, PREFILL_ROWS, BD, search_steps, varlen, pool and W > 1, bias is not None, silu)
    if T > 0 and plane_mode:
        _launch_prefill_planes((-(-T // PREFILL_ROWS), d_blocks),
                               (x, weight, bias, y, cu_seqlens, T, D, N, P1, P2, *consts), _WARPS4)
    elif T > 0:
        _launch_prefill((-(-T // PREFILL_ROWS), d_blocks), (x, weight, bias, y, cu_seqlens, T, D, N, *consts), _WARPS4)
    if pool and W > 1:
        args = (x, weight, bias, y, cu_seqlens, conv_pool, conv_slots, has_initial_state, T, D, conv_pool.stride(0))
        consts = (W, BD, BH, varlen, has_initial_state is not None, bias is not None, silu)
        if plane_mode:
            _launch_head_planes((N, d_blocks), (*args, P1, P2, *consts), _WARPS4)
        else:
            _launch_head((N, d_blocks), (*args, *consts), _WARPS4)
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_pool: torch.Tensor,
    conv_slots: torch.Tensor,
    activation: str | None = "silu",
    planes: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.causal_conv1d_update` (CUDA-graph capturable); ``planes`` as in
    :func:`causal_conv1d_prefill` (planes of B rows)."""
    W = _check(x, weight)
    B, D = x.shape
    y = torch.empty_like(x)
    BD, P1, P2, d_blocks, plane_mode, BW = _update_plan(D, W, planes and tuple(planes))
    if B == 0:
        return y
    consts = (W, BD, BW, bias is not None, activation == "silu")
    if plane_mode:
        _launch_update_planes((B, d_blocks), (
            x, weight, bias, y, conv_pool, conv_slots, B, D, conv_pool.stride(0), P1, P2, *consts), _WARPS4)
    else:
        _launch_update((B, d_blocks), (x, weight, bias, y, conv_pool, conv_slots, D, conv_pool.stride(0), *consts),
                       _WARPS4)
    return y
