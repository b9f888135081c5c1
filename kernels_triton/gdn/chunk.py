"""Chunked Gated DeltaNet prefill in two launches, one for short batches (varlen, grouped heads, fused gating).

The WY/UT chunk form of :mod:`qwen35.reference.gdn` is split where its dependencies split:

1. ``_chunk_prepare_kernel`` -- one program per (chunk, value head), all chunks in parallel. It
   does every piece that does not need the running state: gating from raw a/b (or g/beta),
   chunk-local cumulative decay, L2 norm of q/k, ``A = strict_lower(beta K K^T * Gamma)``,
   ``T = (I + A)^-1`` (16-row blocks by substitution, then two block merges with dots),
   ``W = T beta K exp(g)``, ``U = T beta V`` and the masked intra-chunk scores
   ``Aqk = (Q K^T * Gamma)`` on and below the diagonal. It writes W, U, Aqk and the cumulative
   decay to a head-major workspace.
2. ``_chunk_scan_kernel`` -- one program per (sequence, value head, V block), walking the chunks
   of its sequence in order with its slice of the state ``S[:, v-block]`` in registers:
   ``V' = U - W S``, ``O = (Q exp(g)) S + Aqk V'``, ``S <- exp(g_C) S + (K exp(g_C - g))^T V'``.
   The state never leaves the chip between chunks (no per-chunk state tensor, no V' tensor),
   and the output is produced in the same pass. Columns of S are independent, so splitting V
   into blocks keeps the GPU busy when there are few heads (TP4/TP8) or one long sequence.
   With at most 16 (sequence, head) pairs the scan is latency-bound and its output dots take half
   its time, so it walks the state path alone ("split"), leaving each chunk's starting state and V',
   and ``_chunk_output_kernel`` computes the output of all chunks in parallel (H200: 397B-TP8
   1x32768 0.95 -> 0.79 ms). One such sequence of >= 16384 tokens runs in segments: the scan parts in order on
   a high-priority stream, each part's prepare and output beside the scan of the part before / after it on
   two other streams (H200, eager: 397B-TP8 1x32768 0.78 -> 0.69 ms, 27B-TP4 0.92 -> 0.79-0.83). The one-pass
   scan runs one long sequence in parts too (part lengths by ``ONE_PASS_SEGMENT_RATIO``), and a batch of
   several long sequences in groups of whole sequences, each group's prepare beside the scan of the group before
   (``GROUPS``; needs the metadata built from the host's offsets).

By default the one-pass scan forms ``V'`` itself (scan_config ``SCAN_T``): the prepare stops after the inverse and
writes ``T diag(beta)`` (``[C, C]`` per chunk and head) where W and U would go, and each scan step computes
``V' = (T diag(beta)) (V - diag(e^g / |k|) K S)`` from the chunk's v rows: one more ``C x C x BV`` dot on the
state's path, but the prepare loses its W and U phases and their stores (H200: 27B-TP1 8x4096 prepare 1.05 -> 0.77
ms, scan 0.80 -> 0.87). The split scan keeps W and U (its latency-bound state path got slower with the extra dot).

A batch of at most ``CHUNK`` tokens (every sequence within one chunk: short prompts, where the host's launch
cost dominates) runs both phases in one launch instead, ``_chunk_single_kernel``: one program per (sequence,
value head, 64-wide V block) prepares its chunk into its own copy of the workspace and scans its V block
(H200, T=64: 40 -> 30 µs of host per call, 17.5 -> 19.0 µs of GPU time; tuning/notes_gdn.md session 7).

Numerics: decays enter only as chunk-local differences ``g_i - g_j`` (i >= j) and ``g_C - g_i``;
S and all accumulations are fp32. The workspace is bf16 for bf16 inputs and fp32 for fp16/fp32
inputs (fp16 could overflow there); dots run with bf16 operands for bf16, tf32 for fp16 and full
fp32 (``ieee``) for fp32 inputs.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kernels_triton import _config
from kernels_triton._config import device_facts
from kernels_triton._kept import kept
from kernels_triton._launch import DirectLauncher

CHUNK = 64  # tokens per chunk; the kernels are written for 16 <= C <= 64 (inverse by 16-row blocks)
MAX_HEAD_DIM = 256  # K and V beyond this would not fit the per-program tiles
L2_EPS = 1e-6  # as qwen35.reference.gdn.l2_normalize


@dataclass(frozen=True)
class GdnChunkMetadata:
    """Per-batch chunk table for :func:`gdn_chunk_prefill`, built once by :func:`prepare_gdn_metadata`.

    ``chunk_bounds`` ``[num_chunks, 2]`` int32 holds (first token, end token) of every chunk of
    every sequence, in order; ``cu_seqlens`` is the tensor it was built from (checked by identity
    of storage and length, not by value, so no synchronisation happens at use) and ``version`` its
    version counter then: if the tensor was written in place since (a persistent buffer reused by
    a later batch), the op builds the table again on the device instead of trusting this one.
    """

    chunk_bounds: torch.Tensor
    num_chunks: int
    chunk_size: int
    cu_seqlens: torch.Tensor
    version: int = -1
    chunk_offsets: tuple[int, ...] | None = None  # each sequence's first chunk (and the total), when built on the host


def chunk_table(offsets: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
    """The chunk table of a batch, built on the host from the sequence offsets (``cu_seqlens``' values): int32
    ``[max(n, 1), 2]`` holding (first token, end token) of each of the n chunks, in order (one empty row when
    n = 0). Written into ``out`` (a flat int32 array of that many values, e.g. part of a caller's pinned
    step buffer) when given; n is the last of :func:`chunk_offsets` of the offsets."""
    offs = np.asarray(offsets, dtype=np.int64)
    counts = -(-(offs[1:] - offs[:-1]) // CHUNK)  # chunks per sequence (none for an empty one)
    n = int(counts.sum())
    rows = np.zeros((max(n, 1), 2), dtype=np.int32) if out is None else out.reshape(max(n, 1), 2)
    if n:
        seq = np.repeat(np.arange(counts.size), counts)  # sequence of each chunk
        starts = offs[:-1][seq] + (np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)) * CHUNK
        rows[:, 0] = starts
        rows[:, 1] = np.minimum(starts + CHUNK, offs[1:][seq])
    else:
        rows[:] = 0
    return rows


def chunk_offsets(offsets: Sequence[int]) -> tuple[int, ...]:
    """Each sequence's first chunk in the batch's chunk table, then the number of chunks (n + 1 values for the n
    sequences the offsets delimit)."""
    return (0, *itertools.accumulate(-(-(e - s) // CHUNK) for s, e in itertools.pairwise(offsets)))


def prepare_gdn_metadata(cu_seqlens: torch.Tensor, chunk_size: int = 64, *, offsets: Sequence[int] | None = None,
                         table: torch.Tensor | None = None,
                         chunk_indices: torch.Tensor | None = None) -> GdnChunkMetadata:
    """Chunk table for a batch: built on the host from ``offsets`` (the values of ``cu_seqlens``), read back
    from the device when not given (one host synchronisation, here, instead of one per layer).

    ``table``: the table already on ``cu_seqlens``' device (:func:`chunk_table` of ``offsets``, sent by the
    caller with its other per-step data: no copy here); it needs ``offsets``. This backend always uses
    ``CHUNK``-token chunks; ``chunk_size`` is accepted for the façade's signature (the result of the op does
    not depend on it beyond rounding). A table built here goes to the device from pinned memory: a copy from
    pageable memory would wait for the work queued before it. ``chunk_indices``: ``[n, 2]`` (sequence, chunk
    within it) pairs of ``chunk_size``-token chunks on the device, as FLA's ``prepare_chunk_indices`` and vLLM's
    GDN metadata hold them; the table is computed from them on the device, nothing read back (needs
    ``chunk_size == CHUNK``).
    """
    if chunk_indices is not None:
        if chunk_size != CHUNK:
            raise ValueError(f"chunk_indices are of {chunk_size}-token chunks; this backend's are {CHUNK}")
        if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2 or chunk_indices.device != cu_seqlens.device:
            raise ValueError(f"chunk_indices must be [n, 2] on {cu_seqlens.device}, got {list(chunk_indices.shape)} "
                             f"on {chunk_indices.device}")
        n = chunk_indices.shape[0]
        if n == 0:
            return GdnChunkMetadata(torch.zeros(1, 2, dtype=torch.int32, device=cu_seqlens.device), 0, CHUNK,
                                    cu_seqlens, cu_seqlens._version)
        cu, seq = cu_seqlens.long(), chunk_indices[:, 0].long()
        start = cu[seq] + chunk_indices[:, 1].long() * CHUNK
        bounds = torch.stack([start, torch.minimum(start + CHUNK, cu[seq + 1])], dim=1).to(torch.int32)
        return GdnChunkMetadata(bounds, n, CHUNK, cu_seqlens, cu_seqlens._version)
    if table is not None:
        if offsets is None:
            raise ValueError("a chunk table on the device needs the offsets it was built from")
        chunk_offs = chunk_offsets(offsets)
        n = chunk_offs[-1]
        rows = max(n, 1)
        if (table.dtype != torch.int32 or tuple(table.shape) != (rows, 2) or table.device != cu_seqlens.device
                or not table.is_contiguous()):
            raise ValueError(f"table must be a contiguous int32 [{rows}, 2] tensor on {cu_seqlens.device} (the chunk "
                             f"table of offsets {list(offsets)[:8]}...), got {table.dtype} {list(table.shape)} on "
                             f"{table.device}")
        return GdnChunkMetadata(table, n, CHUNK, cu_seqlens, cu_seqlens._version, chunk_offs)
    offs = cu_seqlens.tolist() if offsets is None else list(offsets)
    chunk_offs = chunk_offsets(offs)
    n = chunk_offs[-1]
    host = torch.empty(max(n, 1), 2, dtype=torch.int32, pin_memory=cu_seqlens.is_cuda)
    chunk_table(offs, host.numpy())
    return GdnChunkMetadata(host.to(cu_seqlens.device, non_blocking=True), n, CHUNK, cu_seqlens, cu_seqlens._version,
                            chunk_offs)


def _chunk_bounds_on_device(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, int]:
    """The chunk table computed with device ops only (no sync): ``T // C + N`` rows, unused rows empty."""
    N = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    ends = counts.cumsum(0)
    rows = T // CHUNK + N
    idx = torch.arange(rows, device=cu.device)
    seq = torch.searchsorted(ends, idx, right=True).clamp_max(N - 1)
    start = cu[seq] + (idx - (ends[seq] - counts[seq])) * CHUNK
    end = torch.minimum(start + CHUNK, cu[seq + 1])
    valid = idx < ends[-1]
    table = torch.stack([torch.where(valid, start, 0), torch.where(valid, end, 0)], dim=1)
    return table.to(torch.int32), rows


# ----------------------------------------------------------------------------- kernels


def gate_rows(g: torch.Tensor | None, beta: torch.Tensor | None, a: torch.Tensor | None,
              b: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``(g, beta, a, b, row stride)``: the given gating pair (a, b, else g, beta), ``[..., HV]``, as rows of HV
    values a common stride apart. Views into a wider projection output (the model's b | a columns) keep their
    memory; a pair whose rows cannot be addressed that way is copied."""
    x, y = (a, b) if a is not None else (g, beta)
    HV = x.shape[-1]
    if x.is_contiguous() and y.is_contiguous():  # the common case first: host time matters at short prompts
        stride = HV
    else:
        try:
            xs, ys = x.view(-1, HV), y.view(-1, HV)
        except RuntimeError:  # leading dims not flattenable without a copy
            xs = ys = None
        if (xs is not None and xs.stride(0) == ys.stride(0) and (HV <= 1 or xs.stride(1) == ys.stride(1) == 1)
                and xs.shape[0] > 0):
            stride = xs.stride(0)
        else:
            x, y, stride = x.contiguous(), y.contiguous(), HV
    return (g, beta, x, y, stride) if a is not None else (x, y, a, b, stride)


@triton.jit
def _gating(t, tmask, hv, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, gate_stride,
            RAW_GATING: tl.constexpr):
    """(g, beta) fp32 for token rows ``t`` of value head ``hv``; zero on masked rows. The gating inputs (a, b or
    g, beta) have rows ``gate_stride`` apart (see :func:`gate_rows`)."""
    if RAW_GATING:
        x = tl.load(a_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
        x = x + tl.load(dt_bias_ptr + hv).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
        g = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32)) * softplus
        braw = tl.load(b_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-braw))
    else:
        g = tl.load(g_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * gate_stride + hv, mask=tmask, other=0.0).to(tl.float32)
    return tl.where(tmask, g, 0.0), tl.where(tmask, beta, 0.0)


@triton.jit
def _tile_mask(rmask, cols, D: tl.constexpr, EVEN: tl.constexpr):
    """Row mask, and the column mask only when the tile overhangs: a mask that is constant along the
    columns keeps loads and stores vectorised (and their address registers few)."""
    if EVEN:
        return rmask[:, None]
    else:
        return rmask[:, None] & (cols[None, :] < D)


@triton.jit
def _workspace(ws_ptr, T, HV, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """The one workspace allocation: W ``[HV, T, K]``, U ``[HV, T, V]``, Aqk ``[HV, T, C]`` back to back in
    the workspace dtype, then (from a 16-byte aligned offset) three fp32 ``[HV, T]`` rows per token: the
    cumulative log-decay g, the q row scale ``scale e^g / |q|`` and the k row scale ``1 / |k|``. With scan_config
    ``SCAN_T`` the W part's start holds ``T diag(beta)`` ``[HV, T, C]`` instead (and U's part is unused, or holds the
    split scan's ``V'``)."""
    head_major = HV.to(tl.int64) * T
    rows_end = head_major * ((K + V + C + 7) // 8 * 8)
    gcum_ptr = (ws_ptr + rows_end).to(tl.pointer_type(tl.float32), bitcast=True)
    return ws_ptr, ws_ptr + head_major * K, ws_ptr + head_major * (K + V), gcum_ptr


@triton.jit
def _merge_blocks(A, X, i, j, B: tl.constexpr, DOT_PREC: tl.constexpr, MERGE_DTYPE: tl.constexpr):
    """Inverse on ``2B``-row diagonal blocks from the inverse ``X`` on ``B``-row ones:
    ``T_21 = -T_22 A_21 T_11`` for every pair of neighbouring blocks at once, in two dots."""
    off = ((i // (2 * B)) == (j // (2 * B))) & ((i // B) != (j // B))
    P = tl.dot(tl.where(off, A, 0.0).to(MERGE_DTYPE), X.to(MERGE_DTYPE), input_precision=DOT_PREC)
    return X - tl.dot(X.to(MERGE_DTYPE), P.to(MERGE_DTYPE), input_precision=DOT_PREC)


@triton.jit
def _unit_lower_inverse(A, C: tl.constexpr, DOT_PREC: tl.constexpr, DIAG_BY_PRODUCT: tl.constexpr,
                        EXACT_PREC: tl.constexpr, MERGE_DTYPE: tl.constexpr, DIAG_ROWS: tl.constexpr = 16):
    """``(I + A)^-1`` for a strictly lower-triangular fp32 ``[C, C]`` tile (C in 16, 32, 64).

    Diagonal blocks first, all at once: ``DIAG_ROWS``-row blocks (16, 8 or 4) by column-oriented
    forward substitution (``DIAG_ROWS - 1`` dependent steps, each a cross-warp reduction), or with
    ``DIAG_BY_PRODUCT`` 16-row blocks by the exact finite series ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)
    (I + N^8)`` (six dependent dots at ``EXACT_PREC``; its intermediates cancel, so it needs fp32-accurate
    dots: see ``_prepare_config``). Then block merges ``T_21 = -T_22 A_21 T_11`` up to ``C`` rows with two
    dots each, their operands in ``MERGE_DTYPE`` (fp32 at ``DOT_PREC``, or the bf16 workspace dtype).
    """
    rows = tl.arange(0, C)
    i = rows[:, None]
    j = rows[None, :]
    same16 = (i // 16) == (j // 16)
    eye = tl.where(i == j, 1.0, 0.0)
    if DIAG_BY_PRODUCT:
        Ad = tl.where(same16, A, 0.0)
        N2 = tl.dot(Ad, Ad, input_precision=EXACT_PREC)
        N4 = tl.dot(N2, N2, input_precision=EXACT_PREC)
        X = tl.dot(eye - Ad, eye + N2, input_precision=EXACT_PREC)
        X = tl.dot(X, eye + N4, input_precision=EXACT_PREC)
        X = tl.dot(X, eye + tl.dot(N4, N4, input_precision=EXACT_PREC), input_precision=EXACT_PREC)
    else:
        same_block = (i // DIAG_ROWS) == (j // DIAG_ROWS)
        Ad = tl.where(same_block, A, 0.0)
        X = eye
        sub = rows % DIAG_ROWS
        for p in tl.static_range(DIAG_ROWS - 1):
            # Ad and X are block-diagonal, so "column / row p of my own block" needs no block test; the
            # outer product is cut back to the diagonal blocks. Column p of each block is final in X's row
            # (block start + p) and is subtracted from the later rows (Ad[i, block + p] is 0 for i <= p).
            a_col = tl.sum(tl.where((sub == p)[None, :], Ad, 0.0), axis=1)  # Ad[i, block(i) + p]
            x_row = tl.sum(tl.where((sub == p)[:, None], X, 0.0), axis=0)  # X[block(c) + p, c]
            X = X - tl.where(same_block, a_col[:, None] * x_row[None, :], 0.0)
        if DIAG_ROWS <= 4:
            X = _merge_blocks(A, X, i, j, 4, DOT_PREC, MERGE_DTYPE)
        if DIAG_ROWS <= 8:
            X = _merge_blocks(A, X, i, j, 8, DOT_PREC, MERGE_DTYPE)
    if C > 16:
        X = _merge_blocks(A, X, i, j, 16, DOT_PREC, MERGE_DTYPE)
        if C > 32:
            X = _merge_blocks(A, X, i, j, 32, DOT_PREC, MERGE_DTYPE)
    return X


@triton.jit
def _diag_blocks(M, C: tl.constexpr, B: tl.constexpr):
    """The ``C / B`` diagonal ``[B, B]`` blocks of a ``[C, C]`` tile, as one ``[C / B, B, B]`` tensor."""
    NB: tl.constexpr = C // B
    M4 = tl.permute(tl.reshape(M, (NB, B, NB, B)), (0, 2, 1, 3))  # [row block, col block, B, B]
    b = tl.arange(0, NB)
    same = (b[:, None] == b[None, :])[:, :, None, None]
    return tl.sum(tl.where(same, M4, 0.0), axis=1)


@triton.jit
def _block_diag(Xb, C: tl.constexpr, B: tl.constexpr):
    """The block-diagonal ``[C, C]`` tile whose diagonal blocks are ``Xb`` ``[C / B, B, B]`` (zero elsewhere)."""
    NB: tl.constexpr = C // B
    b = tl.arange(0, NB)
    same = (b[:, None] == b[None, :])[:, :, None, None]
    X4 = tl.where(same, tl.broadcast_to(Xb[:, None, :, :], (NB, NB, B, B)), 0.0)
    return tl.reshape(tl.permute(X4, (0, 2, 1, 3)), (C, C))


@triton.jit
def _merge_batched(A, X, B: tl.constexpr, DOT_PREC: tl.constexpr, MERGE_DTYPE: tl.constexpr):
    """:func:`_merge_blocks` on a batch of diagonal blocks ``A``, ``X`` ``[n, R, R]`` (R >= 16): inverse on
    ``2B``-row blocks from ``B``-row ones inside each ``R``-row block. Only the blocks' own products are formed, not
    the full tile's (a ``[C, C]`` merge spends ``C / R`` times the multiply-adds on zeros)."""
    r = tl.arange(0, A.shape[1])
    i = r[None, :, None]
    j = r[None, None, :]
    off = ((i // (2 * B)) == (j // (2 * B))) & ((i // B) != (j // B))
    P = tl.dot(tl.where(off, A, 0.0).to(MERGE_DTYPE), X.to(MERGE_DTYPE), input_precision=DOT_PREC)
    return X - tl.dot(X.to(MERGE_DTYPE), P.to(MERGE_DTYPE), input_precision=DOT_PREC)


@triton.jit
def _blocked_lower_inverse(A, C: tl.constexpr, DOT_PREC: tl.constexpr, MERGE_DTYPE: tl.constexpr,
                           DIAG_ROWS: tl.constexpr, LEVELS: tl.constexpr):
    """:func:`_unit_lower_inverse`'s substitution and merges (same products, same precision) on the diagonal
    blocks only. The ``DIAG_ROWS``-row substitution and the merges up to 16 rows run on the ``C / 16`` diagonal
    16-row blocks as one batch; ``LEVELS`` 1 then merges 16 -> C on the full tile as before, ``LEVELS`` 2 merges
    16 -> 32 on the 32-row diagonal blocks and 32 -> 64 on the quadrants (``T_21 = -T_22 A_21 T_11``: two 32-row
    products). Tensor-core work of the inverse at C = 64: 4 full 64-row tf32 merges (2.1 M multiply-adds) ->
    64 K + 1 M (LEVELS 1) or + 0.26 M (LEVELS 2); the price is the tiles' reshuffles between layouts."""
    A16 = _diag_blocks(A, C, 16)
    r = tl.arange(0, 16)
    i = r[None, :, None]
    j = r[None, None, :]
    same_block = (i // DIAG_ROWS) == (j // DIAG_ROWS)
    Ad = tl.where(same_block, A16, 0.0)
    X = tl.where(i == j, 1.0, 0.0) + tl.zeros_like(A16)
    sub = r % DIAG_ROWS
    for p in tl.static_range(DIAG_ROWS - 1):  # as in _unit_lower_inverse, one batch of 16-row blocks
        a_col = tl.sum(tl.where((sub == p)[None, None, :], Ad, 0.0), axis=2)
        x_row = tl.sum(tl.where((sub == p)[None, :, None], X, 0.0), axis=1)
        X = X - tl.where(same_block, a_col[:, :, None] * x_row[:, None, :], 0.0)
    if DIAG_ROWS <= 4:
        X = _merge_batched(A16, X, 4, DOT_PREC, MERGE_DTYPE)
    if DIAG_ROWS <= 8:
        X = _merge_batched(A16, X, 8, DOT_PREC, MERGE_DTYPE)
    # (One return at the end: Triton builds the code after a constexpr-guarded return too.)
    if C == 16:
        T = tl.reshape(X, (C, C))
    elif LEVELS == 1:
        rows = tl.arange(0, C)
        T = _block_diag(X, C, 16)
        T = _merge_blocks(A, T, rows[:, None], rows[None, :], 16, DOT_PREC, MERGE_DTYPE)
        if C > 32:
            T = _merge_blocks(A, T, rows[:, None], rows[None, :], 32, DOT_PREC, MERGE_DTYPE)
    else:
        X32 = _diag_blocks(_block_diag(X, C, 16), C, 32)
        X32 = _merge_batched(_diag_blocks(A, C, 32), X32, 16, DOT_PREC, MERGE_DTYPE)
        if C == 32:
            T = tl.reshape(X32, (C, C))
        else:  # C = 64: T_21 = -T_22 A_21 T_11 on the 32-row quadrants
            b = tl.arange(0, 2)
            first = (b == 0)[:, None, None]
            T11 = tl.sum(tl.where(first, X32, 0.0), axis=0)
            T22 = tl.sum(tl.where(first, 0.0, X32), axis=0)
            A4 = tl.permute(tl.reshape(A, (2, 32, 2, 32)), (0, 2, 1, 3))
            lower_left = ((b[:, None] == 1) & (b[None, :] == 0))[:, :, None, None]
            A21 = tl.sum(tl.sum(tl.where(lower_left, A4, 0.0), axis=1), axis=0)
            P = tl.dot(A21.to(MERGE_DTYPE), T11.to(MERGE_DTYPE), input_precision=DOT_PREC)
            T21 = -tl.dot(T22.to(MERGE_DTYPE), P.to(MERGE_DTYPE), input_precision=DOT_PREC)
            b1 = b[:, None, None, None]
            b2 = b[None, :, None, None]
            X4 = tl.where((b1 == 0) & (b2 == 0), T11[None, None, :, :],
                          tl.where((b1 == 1) & (b2 == 1), T22[None, None, :, :],
                                   tl.where((b1 == 1) & (b2 == 0), T21[None, None, :, :], 0.0)))
            T = tl.reshape(tl.permute(X4, (0, 2, 1, 3)), (C, C))
    return T


@triton.jit
def _load_tile(base, row_stride, rmask, c0, D: tl.constexpr, BD: tl.constexpr):
    """Columns ``c0 .. c0 + BD`` (of ``D``) of the rows at ``base + r * row_stride``, 0 outside ``rmask``.

    The row offset is a scalar in ``base``; per-element offsets stay small 32-bit numbers, which keeps
    address registers few (64-bit per-element offsets cost ~30 registers per tile here)."""
    rows = tl.arange(0, rmask.shape[0])
    cols = c0 + tl.arange(0, BD)
    return tl.load(base + rows[:, None] * row_stride + cols[None, :], mask=_tile_mask(rmask, cols, D, D % BD == 0),
                   other=0.0)


@triton.jit
def _store_tile(base, row_stride, rmask, c0, D: tl.constexpr, BD: tl.constexpr, x):
    """Store ``x`` ``[rows, BD]`` at columns ``c0 ..`` of the rows at ``base + r * row_stride`` (see _load_tile)."""
    rows = tl.arange(0, rmask.shape[0])
    cols = c0 + tl.arange(0, BD)
    tl.store(base + rows[:, None] * row_stride + cols[None, :], x.to(base.dtype.element_ty),
             mask=_tile_mask(rmask, cols, D, D % BD == 0))


@triton.jit
def _prepare_chunk(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, ws_ptr, start, end, hv,
                   u_lo, u_hi, T, scale, H, HV, gate_stride, K: tl.constexpr, V: tl.constexpr, BKC: tl.constexpr,
                   BVC: tl.constexpr, C: tl.constexpr, RAW_GATING: tl.constexpr, USE_L2: tl.constexpr,
                   DOT_PREC: tl.constexpr, EXACT_PREC: tl.constexpr, DIAG_BY_PRODUCT: tl.constexpr,
                   LOWP_MERGE: tl.constexpr, DIAG_ROWS: tl.constexpr, STOP: tl.constexpr, BLOCK_INV: tl.constexpr = 0,
                   SCALE_K: tl.constexpr = False, T_OUT: tl.constexpr = False):
    """Phase 1 for the non-empty chunk ``[start, end)`` (at most C tokens) of value head ``hv``: its workspace rows
    (W, U, Aqk, g and the row scales; see the module docstring), U only in columns ``u_lo .. u_hi``. ``T_OUT``: the
    ``[C, C]`` rows of ``T diag(beta)`` instead of W and U (row stride C from the W part's start; the scan forms
    ``V'`` from them, scan_config ``SCAN_T``). STOP: see
    ``_chunk_prepare_kernel``. (One body on purpose: split into helpers for the scores and the W / U phase, the
    kernel built with 64 instead of 40 bytes of spills and timed 2-3 % slower on the H200, gdn_sweep_s9i3.)"""
    h = hv // (HV // H)
    rows = tl.arange(0, C)
    t = (start + rows).to(tl.int64)
    tmask = rows < end - start
    ws_dtype = ws_ptr.dtype.element_ty  # workspace and dot-operand dtype
    w_ptr, u_ptr, aqk_ptr, gcum_ptr = _workspace(ws_ptr, T, HV, K, V, C)
    head_row = hv.to(tl.int64) * T + start  # this chunk's first row in the head-major workspace
    q_base = q_ptr + (start.to(tl.int64) * H + h) * K
    k_base = k_ptr + (start.to(tl.int64) * H + h) * K
    v_base = v_ptr + (start.to(tl.int64) * HV + hv) * V

    # Raw K K^T, Q K^T and row sums of squares, K in column blocks: a small live set.
    kk = tl.zeros((C, C), dtype=tl.float32)
    qk = tl.zeros((C, C), dtype=tl.float32)
    ssk = tl.zeros((C,), dtype=tl.float32)
    ssq = tl.zeros((C,), dtype=tl.float32)
    for c0 in tl.range(0, K, BKC):
        k = _load_tile(k_base, H * K, tmask, c0, K, BKC).to(ws_dtype)
        q = _load_tile(q_base, H * K, tmask, c0, K, BKC).to(ws_dtype)
        kk = tl.dot(k, tl.trans(k), acc=kk, input_precision=DOT_PREC)
        qk = tl.dot(q, tl.trans(k), acc=qk, input_precision=DOT_PREC)
        if USE_L2:
            kf = k.to(tl.float32)
            qf = q.to(tl.float32)
            ssk += tl.sum(kf * kf, axis=1)
            ssq += tl.sum(qf * qf, axis=1)
    if USE_L2:
        rk = tl.rsqrt(ssk + 1e-6)
        rq = tl.rsqrt(ssq + 1e-6) * scale
    else:
        rk = tl.full((C,), 1.0, dtype=tl.float32)
        rq = tl.full((C,), scale, dtype=tl.float32)

    g, beta = _gating(t, tmask, hv, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, gate_stride,
                      RAW_GATING)
    g = tl.cumsum(g, axis=0)  # chunk-local cumulative log-decay
    if STOP == 1:
        _store_tile(aqk_ptr + head_row * C, C, tmask, 0, C, C, kk + qk * (rq * g)[:, None] + (rk * beta)[None, :])
        return
    # Row scales for the scan (it then feeds q and k to its dots untouched): g, |q|^-1 scale e^g, |k|^-1.
    tl.store(gcum_ptr + head_row + rows, g, mask=tmask)
    plane = HV.to(tl.int64) * T  # the three fp32 row-scale planes of gcum, each [HV, T]
    tl.store(gcum_ptr + plane + head_row + rows, rq * tl.exp(g), mask=tmask)
    tl.store(gcum_ptr + 2 * plane + head_row + rows, rk, mask=tmask)

    i = rows[:, None]
    j = rows[None, :]
    gamma = tl.exp(tl.where(i >= j, g[:, None] - g[None, :], float("-inf")))  # exp(g_i - g_j), i >= j
    _store_tile(aqk_ptr + head_row * C, C, tmask, 0, C, C, qk * (rq[:, None] * rk[None, :]) * gamma)
    A = tl.where(i > j, kk * ((beta * rk)[:, None] * rk[None, :]) * gamma, 0.0)
    if STOP == 2:
        _store_tile(u_ptr + head_row * V, V, tmask, 0, V, C, A)
        return
    if BLOCK_INV and not DIAG_BY_PRODUCT:
        Tinv = _blocked_lower_inverse(A, C, DOT_PREC, ws_dtype if LOWP_MERGE else tl.float32, DIAG_ROWS, BLOCK_INV)
    else:
        Tinv = _unit_lower_inverse(A, C, DOT_PREC, DIAG_BY_PRODUCT, EXACT_PREC,
                                   ws_dtype if LOWP_MERGE else tl.float32, DIAG_ROWS)
    if STOP == 3:
        _store_tile(u_ptr + head_row * V, V, tmask, 0, V, C, Tinv)
        return

    # W = T diag(beta exp(g) / |k|) K and U = T diag(beta) V, in column blocks (k, v re-read from L1/L2).
    # SCALE_K: W = (T diag(beta)) (diag(exp(g) / |k|) K), one T operand for both products.
    tu = (Tinv * beta[None, :]).to(ws_dtype)
    if T_OUT:
        _store_tile(w_ptr + head_row * C, C, tmask, 0, C, C, tu)
    elif SCALE_K:
        ks = tl.exp(g) * rk
        for c0 in tl.range(0, K, BKC):
            k = (_load_tile(k_base, H * K, tmask, c0, K, BKC).to(tl.float32) * ks[:, None]).to(ws_dtype)
            _store_tile(w_ptr + head_row * K, K, tmask, c0, K, BKC, tl.dot(tu, k, input_precision=DOT_PREC))
    else:
        tw = (Tinv * (beta * tl.exp(g) * rk)[None, :]).to(ws_dtype)
        for c0 in tl.range(0, K, BKC):
            k = _load_tile(k_base, H * K, tmask, c0, K, BKC).to(ws_dtype)
            _store_tile(w_ptr + head_row * K, K, tmask, c0, K, BKC, tl.dot(tw, k, input_precision=DOT_PREC))
    if STOP == 4:
        return
    if not T_OUT:
        for c0 in tl.range(u_lo, u_hi, BVC):
            v = _load_tile(v_base, HV * V, tmask, c0, V, BVC).to(ws_dtype)
            _store_tile(u_ptr + head_row * V, V, tmask, c0, V, BVC, tl.dot(tu, v, input_precision=DOT_PREC))


@triton.jit
def _program_chunk(pid, HV, bounds_ptr, T, C: tl.constexpr, VARLEN: tl.constexpr):
    """(chunk, value head, first token, end token) of a program of a grid over (chunk, value head) pairs, value heads
    fastest: chunks from the batch's chunk table, or the C-token chunks of one sequence."""
    chunk = pid // HV
    hv = pid % HV
    if VARLEN:
        start = tl.load(bounds_ptr + 2 * chunk)
        end = tl.load(bounds_ptr + 2 * chunk + 1)
    else:
        start = chunk * C
        end = tl.minimum(start + C, T)
    return chunk, hv, start, end


@triton.jit(do_not_specialize=["T", "H", "HV", "gate_stride", "chunk_base"])  # one compile for every length, head count
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr,
    g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    bounds_ptr,
    ws_ptr,
    T, scale, chunk_base,
    H, HV, gate_stride, K: tl.constexpr, V: tl.constexpr,
    BKC: tl.constexpr, BVC: tl.constexpr, C: tl.constexpr,
    VARLEN: tl.constexpr, RAW_GATING: tl.constexpr, USE_L2: tl.constexpr, DOT_PREC: tl.constexpr,
    EXACT_PREC: tl.constexpr, DIAG_BY_PRODUCT: tl.constexpr = False, LOWP_MERGE: tl.constexpr = False,
    DIAG_ROWS: tl.constexpr = 16, STOP: tl.constexpr = 0, BLOCK_INV: tl.constexpr = 0, SCALE_K: tl.constexpr = False,
    T_OUT: tl.constexpr = False,
):
    # STOP (timing only, never a default): 1-4 end the program after phase 1-4 (raw products and gating; scores and
    # A; the inverse; W), storing that phase's result where U / Aqk would go so the compiler keeps the work; the
    # benchmark times the truncations to split the kernel's time by phase (bench_gdn --sweep-set f).
    # Value heads vary fastest: the HV / H programs of one key head and chunk run side by side and
    # share their q / k rows through L2.
    # chunk_base: the first chunk of this launch (a sequence prepared in parts, see gdn_chunk_prefill's segments).
    pid = tl.program_id(0) + chunk_base * HV
    chunk, hv, start, end = _program_chunk(pid, HV, bounds_ptr, T, C, VARLEN)
    if end > start:
        _prepare_chunk(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, ws_ptr, start, end,
                       hv, 0, V, T, scale, H, HV, gate_stride, K, V, BKC, BVC, C, RAW_GATING, USE_L2, DOT_PREC,
                       EXACT_PREC, DIAG_BY_PRODUCT, LOWP_MERGE, DIAG_ROWS, STOP, BLOCK_INV, SCALE_K, T_OUT)


@triton.jit
def _state_tile_io(ptr, S, hv, vb, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   STORE: tl.constexpr):
    """Load (``STORE`` False: fp32, ``S`` unused) or store ``S`` as the ``[BK, BV]`` tile of V block ``vb`` of value
    head ``hv`` in the ``[HV, K, V]`` state at ``ptr``; unmasked (vectorised) when the tile does not overhang."""
    kcols = tl.arange(0, BK)
    vcols = vb * BV + tl.arange(0, BV)
    ptrs = ptr + (hv * K + kcols[:, None]).to(tl.int64) * V + vcols[None, :]
    if (BK == K) & (V % BV == 0):
        if STORE:
            tl.store(ptrs, S.to(ptr.dtype.element_ty))
        else:
            S = tl.load(ptrs).to(tl.float32)
    else:
        smask = (kcols[:, None] < K) & (vcols[None, :] < V)
        if STORE:
            tl.store(ptrs, S.to(ptr.dtype.element_ty), mask=smask)
        else:
            S = tl.load(ptrs, mask=smask, other=0.0).to(tl.float32)
    return S


@triton.jit
def _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, vb, pool_slot_stride, HV, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STATE_IN: tl.constexpr, POOL: tl.constexpr,
                   HAS_INIT_FLAGS: tl.constexpr):
    """(state tile fp32, pool slot) of sequence ``n``: a per-sequence tensor, a pool slot (negative slot or
    has_initial_state False: zeros), or zeros; the slot is -1 without a pool."""
    S = tl.zeros((BK, BV), dtype=tl.float32)
    slot = tl.full((), -1, dtype=tl.int64)
    if POOL:
        slot = tl.load(slots_ptr + n).to(tl.int64)
        use_init = slot >= 0
        if HAS_INIT_FLAGS:
            use_init = use_init & (tl.load(has_init_ptr + n) != 0)
        if use_init:
            S = _state_tile_io(h0_ptr + slot * pool_slot_stride, S, hv, vb, K, V, BK, BV, False)
    elif STATE_IN:
        S = _state_tile_io(h0_ptr + n.to(tl.int64) * (HV * K * V), S, hv, vb, K, V, BK, BV, False)
    return S, slot


@triton.jit
def _final_state(ht_ptr, S, slot, n, hv, vb, pool_slot_stride, HV, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, STATE_OUT: tl.constexpr, POOL: tl.constexpr):
    """Write sequence ``n``'s final state tile: to its pool slot (none when the slot is negative) or tensor row."""
    if POOL:
        if slot >= 0:
            _state_tile_io(ht_ptr + slot * pool_slot_stride, S, hv, vb, K, V, BK, BV, True)
    elif STATE_OUT:
        _state_tile_io(ht_ptr + n.to(tl.int64) * (HV * K * V), S, hv, vb, K, V, BK, BV, True)


@triton.jit
def _scan_chunk(S, q_ptr, k_ptr, v_ptr, w_ptr, u_ptr, aqk_ptr, gcum_ptr, o_ptr, chunk_start, seq_end, hv, h, T, H, HV,
                vb, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                DOT_PREC: tl.constexpr, SPLIT: tl.constexpr = False, st_ptr=None, st_row=0,
                SCAN_T: tl.constexpr = False):
    """One chunk of phase 2 for V block ``vb`` of value head ``hv`` (key head ``h``; workspace parts as
    :func:`_workspace` gives them, computed once by the caller): writes the chunk's output block, returns the state
    after it (``S``: the state before, fp32). ``SPLIT``: the state path alone; it leaves the chunk's starting state
    (workspace dtype, ``[HV, K, V]`` at row ``st_row`` of ``st_ptr``) and ``V'`` (over U's block) to
    ``_chunk_output_kernel``. ``SCAN_T``: the workspace holds ``T diag(beta)`` (the prepare's ``T_OUT``) instead of
    W and U, and ``V' = U - W S = (T diag(beta)) (V - diag(e^g / |k|) K S)`` is formed here from the chunk's v rows
    (with SPLIT, ``V'`` still goes to U's part: ``T diag(beta)`` then fits W's, ``K >= C``)."""
    ws_dtype = w_ptr.dtype.element_ty
    rows = tl.arange(0, C)
    tmask = rows < seq_end - chunk_start
    head_row = hv.to(tl.int64) * T + chunk_start  # this chunk's first row in the head-major workspace
    g = tl.load(gcum_ptr + head_row + rows, mask=tmask, other=0.0)
    g_last = tl.load(gcum_ptr + head_row + tl.minimum(C, seq_end - chunk_start) - 1)
    plane = HV.to(tl.int64) * T  # the row-scale planes of gcum (see the prepare kernel)
    k_scale = tl.load(gcum_ptr + 2 * plane + head_row + rows, mask=tmask, other=0.0)
    if not SPLIT:
        q_scale = tl.load(gcum_ptr + plane + head_row + rows, mask=tmask, other=0.0)
        q = _load_tile(q_ptr + (chunk_start * H + h) * K, H * K, tmask, 0, K, BK).to(ws_dtype)
    k = _load_tile(k_ptr + (chunk_start * H + h) * K, H * K, tmask, 0, K, BK).to(ws_dtype)
    if SCAN_T:
        tu = _load_tile(w_ptr + head_row * C, C, tmask, 0, C, C)
        v = _load_tile(v_ptr + (chunk_start * HV + hv) * V, HV * V, tmask, vb * BV, V, BV)
    else:
        w = _load_tile(w_ptr + head_row * K, K, tmask, 0, K, BK)
        u = _load_tile(u_ptr + head_row * V, V, tmask, vb * BV, V, BV).to(tl.float32)
    if not SPLIT:
        aqk = _load_tile(aqk_ptr + head_row * C, C, tmask, 0, C, C)

    # q and k go into the dots as loaded; their norms, scale and decays are row scales of the results.
    Sd = S.to(ws_dtype)
    if SCAN_T:
        kS = tl.dot(k, Sd, input_precision=DOT_PREC) * (k_scale * tl.exp(g))[:, None]  # diag(e^g / |k|) K S
        v_new = tl.dot(tu, (v.to(tl.float32) - kS).to(ws_dtype), input_precision=DOT_PREC)
    else:
        v_new = u - tl.dot(w, Sd, input_precision=DOT_PREC)
    if SPLIT:
        _state_tile_io(st_ptr + st_row * (HV * K * V), S, hv, vb, K, V, BK, BV, True)
        _store_tile(u_ptr + head_row * V, V, tmask, vb * BV, V, BV, v_new)
    else:
        o = tl.dot(q, Sd, input_precision=DOT_PREC) * q_scale[:, None]
        o = tl.dot(aqk, v_new.to(ws_dtype), acc=o, input_precision=DOT_PREC)
        _store_tile(o_ptr + (chunk_start * HV + hv) * V, HV * V, tmask, vb * BV, V, BV, o)
    v_scaled = (v_new * (k_scale * tl.exp(g_last - g))[:, None]).to(ws_dtype)
    return S * tl.exp(g_last) + tl.dot(tl.trans(k), v_scaled, input_precision=DOT_PREC)


@triton.jit
def _sequence_bounds(cu_ptr, n, T, VARLEN: tl.constexpr):
    """(first token, end token) of sequence ``n``, int64: from ``cu_seqlens`` or the whole batch."""
    if VARLEN:
        start = tl.load(cu_ptr + n).to(tl.int64)
        end = tl.load(cu_ptr + n + 1).to(tl.int64)
    else:
        start = tl.zeros((), dtype=tl.int64)
        end = start + T
    return start, end


@triton.jit(do_not_specialize=["T", "H", "HV", "NH", "chunk_lo", "chunk_hi", "nh_base"])
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, ws_ptr, o_ptr, st_ptr,
    cu_ptr, h0_ptr, ht_ptr, slots_ptr, has_init_ptr, carry_ptr,
    T, pool_slot_stride, chunk_lo, chunk_hi, nh_base,
    H, HV, NH, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    VARLEN: tl.constexpr, STATE_IN: tl.constexpr, STATE_OUT: tl.constexpr, POOL: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr = False,
    PART: tl.constexpr = False, CARRY_IN: tl.constexpr = False, CARRY_OUT: tl.constexpr = False,
    SCAN_T: tl.constexpr = False,
):
    # SPLIT: the state path alone, the output left to _chunk_output_kernel; chunk states go to st_ptr [chunks, HV, K,
    # V] in the chunk table's order (sequences in order, ceil(len / C) chunks each).
    # PART (one sequence scanned in parts, see gdn_chunk_prefill's segments): only chunks chunk_lo .. chunk_hi - 1 of
    # the sequence; CARRY_IN / CARRY_OUT: the state before / after them is the fp32 [HV, K, V] tensor at carry_ptr
    # instead of the initial / final state.
    # nh_base: the launch's first (sequence, head) pair (a batch scanned in groups of sequences); NH: its end.
    # SCAN_T: V' formed from v and T diag(beta) (see _scan_chunk; the prepare ran with T_OUT).
    vb = tl.program_id(0)
    nh = nh_base + tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)  # (sequence, head) pairs: see grid_rows
    if nh >= NH:
        return
    n = nh // HV
    hv = nh % HV
    seq_start, seq_end = _sequence_bounds(cu_ptr, n, T, VARLEN)
    h = hv // (HV // H)
    w_ptr, u_ptr, aqk_ptr, gcum_ptr = _workspace(ws_ptr, T, HV, K, V, C)
    if CARRY_IN:
        S = _state_tile_io(carry_ptr, None, hv, vb, K, V, BK, BV, False)
        slot = tl.full((), -1, dtype=tl.int64)
        if POOL:
            slot = tl.load(slots_ptr + n).to(tl.int64)
    else:
        S, slot = _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV,
                                 STATE_IN, POOL, HAS_INIT_FLAGS)
    row = tl.zeros((), dtype=tl.int64)  # SPLIT: the chunk's row in the chunk table
    if SPLIT & VARLEN:
        for m in range(0, n):
            row += (tl.load(cu_ptr + m + 1) - tl.load(cu_ptr + m) + C - 1) // C
    first, stop = seq_start, seq_end
    if PART:
        row += chunk_lo
        first = seq_start + chunk_lo.to(tl.int64) * C
        stop = tl.minimum(seq_end, seq_start + chunk_hi.to(tl.int64) * C)
    for chunk_start in range(first, stop, C):
        S = _scan_chunk(S, q_ptr, k_ptr, v_ptr, w_ptr, u_ptr, aqk_ptr, gcum_ptr, o_ptr, chunk_start, seq_end, hv, h, T,
                        H, HV, vb, K, V, BK, BV, C, DOT_PREC, SPLIT, st_ptr, row, SCAN_T)
        row += 1
    if CARRY_OUT:
        _state_tile_io(carry_ptr, S, hv, vb, K, V, BK, BV, True)
    else:
        _final_state(ht_ptr, S, slot, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV, STATE_OUT, POOL)


@triton.jit(do_not_specialize=["T", "H", "HV", "chunk_base"])
def _chunk_output_kernel(
    q_ptr, ws_ptr, st_ptr, o_ptr, bounds_ptr,
    T, H, HV, chunk_base, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The output of a ``SPLIT`` scan, all chunks in parallel: ``O = (Q e^g) S_c + Aqk V'`` for V block
    ``program_id(1)`` of (chunk, value head) ``program_id(0)``, from the chunk's starting state ``S_c`` and ``V'``
    the scan left (the same operands, rounded the same way, as the one-pass scan's output dots). ``chunk_base``: the
    first chunk of this launch (segments)."""
    pid = tl.program_id(0) + chunk_base * HV
    vb = tl.program_id(1)
    chunk, hv, start, end = _program_chunk(pid, HV, bounds_ptr, T, C, VARLEN)
    if end > start:
        ws_dtype = ws_ptr.dtype.element_ty
        h = hv // (HV // H)
        _, u_ptr, aqk_ptr, gcum_ptr = _workspace(ws_ptr, T, HV, K, V, C)
        rows = tl.arange(0, C)
        tmask = rows < end - start
        head_row = hv.to(tl.int64) * T + start
        q_scale = tl.load(gcum_ptr + HV.to(tl.int64) * T + head_row + rows, mask=tmask, other=0.0)
        q = _load_tile(q_ptr + (start.to(tl.int64) * H + h) * K, H * K, tmask, 0, K, BK).to(ws_dtype)
        aqk = _load_tile(aqk_ptr + head_row * C, C, tmask, 0, C, C)
        v_new = _load_tile(u_ptr + head_row * V, V, tmask, vb * BV, V, BV)
        Sd = _state_tile_io(st_ptr + chunk.to(tl.int64) * (HV * K * V), None, hv, vb, K, V, BK, BV, False)
        o = tl.dot(q, Sd.to(ws_dtype), input_precision=DOT_PREC) * q_scale[:, None]
        o = tl.dot(aqk, v_new, acc=o, input_precision=DOT_PREC)
        _store_tile(o_ptr + (start.to(tl.int64) * HV + hv) * V, HV * V, tmask, vb * BV, V, BV, o)


@triton.jit(do_not_specialize=["T", "H", "HV", "gate_stride", "ws_copy"])
def _chunk_single_kernel(
    q_ptr, k_ptr, v_ptr,
    g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    ws_ptr, o_ptr,
    cu_ptr, h0_ptr, ht_ptr, slots_ptr, has_init_ptr,
    T, scale, pool_slot_stride, ws_copy,
    H, HV, gate_stride, K: tl.constexpr, V: tl.constexpr,
    BKC: tl.constexpr, BVC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    VARLEN: tl.constexpr, RAW_GATING: tl.constexpr, USE_L2: tl.constexpr,
    STATE_IN: tl.constexpr, STATE_OUT: tl.constexpr, POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    DOT_PREC: tl.constexpr, EXACT_PREC: tl.constexpr, DIAG_BY_PRODUCT: tl.constexpr, LOWP_MERGE: tl.constexpr,
    DIAG_ROWS: tl.constexpr, STOP: tl.constexpr, BLOCK_INV: tl.constexpr, SCALE_K: tl.constexpr,
):
    """Both phases in one launch for a batch whose sequences fit one chunk each (T <= C; the host checks): one
    program per (sequence, value head, V block) prepares the chunk (U in its own V block only) into its own copy of
    the workspace (``ws_copy`` elements apart), then scans its V block. The V blocks' programs repeat the prepare
    side by side instead of waiting for one another: at one chunk, latency is what counts."""
    nh = tl.program_id(0)
    vb = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    start, end = _sequence_bounds(cu_ptr, n, T, VARLEN)
    ws_ptr += vb * ws_copy
    if end > start:
        _prepare_chunk(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, ws_ptr, start, end,
                       hv, vb * BV, tl.minimum(vb * BV + BV, V), T, scale, H, HV, gate_stride, K, V, BKC, BVC, C,
                       RAW_GATING, USE_L2, DOT_PREC, EXACT_PREC, DIAG_BY_PRODUCT, LOWP_MERGE, DIAG_ROWS, STOP,
                       BLOCK_INV, SCALE_K)
    tl.debug_barrier()  # the workspace rows the program's threads wrote are read back by the others below
    h = hv // (HV // H)
    w_ptr, u_ptr, aqk_ptr, gcum_ptr = _workspace(ws_ptr, T, HV, K, V, C)
    S, slot = _initial_state(h0_ptr, slots_ptr, has_init_ptr, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV,
                             STATE_IN, POOL, HAS_INIT_FLAGS)
    if end > start:
        S = _scan_chunk(S, q_ptr, k_ptr, v_ptr, w_ptr, u_ptr, aqk_ptr, gcum_ptr, o_ptr, start, end, hv, h, T, H, HV,
                        vb, K, V, BK, BV, C, DOT_PREC)
    _final_state(ht_ptr, S, slot, n, hv, vb, pool_slot_stride, HV, K, V, BK, BV, STATE_OUT, POOL)


# ----------------------------------------------------------------------------- host side


def _pow2(n: int, lo: int = 16) -> int:
    """Next power of two >= n (at least ``lo``); plain Python: triton.next_power_of_2 costs ~5 us a call."""
    return max(lo, 1 << max(n - 1, 0).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MAX_GRID_Y = 65535  # CUDA's limit on grid dimensions y and z


def grid_rows(rows: int) -> tuple[int, int]:
    """(y, z) grid sizes covering ``rows`` programs, y <= MAX_GRID_Y; the kernel's row is
    ``program_id(1) + program_id(2) * num_programs(1)`` and rows past the end return at once."""
    z = _cdiv(rows, MAX_GRID_Y)
    return _cdiv(rows, z), z


def check_head_dims(K: int, V: int) -> None:
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"triton GDN kernels take head dims K, V <= {MAX_HEAD_DIM}; got K={K}, V={V}")


BF16_MIN_HEAD_DIM = 32  # bf16 prepare tiles narrower than this many columns (64 bytes a row) are miscompiled


def workspace_dtype(dtype: torch.dtype, device: torch.device, K: int = 128, V: int = 128) -> tuple[torch.dtype, str]:
    """(workspace / dot-operand dtype, dot input precision) for an activation dtype and head dims.

    fp32 inputs get fp32-accurate dots: three tf32 passes on GPUs that have tf32 (``ieee`` FMA
    dots need too many registers for these tiles), plain fp32 elsewhere. bf16 with a head dim under
    ``BF16_MIN_HEAD_DIM`` takes the fp32 workspace (tf32 dots) as fp16 does: Triton 3.6 builds the one-stage
    prepare kernel wrong on bf16 tiles of 16 columns (H200, session 9: K = 16 gave an illegal address at V = 16
    and V = 48, and output errors of 0.01-1.1 with other flags, where the fp32 workspace gave 1.1e-3); no
    Qwen3.5 size is near (K = V = 128), the tiny test models have 32.
    """
    if dtype == torch.bfloat16:
        if min(K, V) < BF16_MIN_HEAD_DIM:
            return torch.float32, "tf32"
        return torch.bfloat16, "tf32"
    if dtype == torch.float16:
        return torch.float32, "tf32"  # fp16 workspace could overflow; tf32 keeps fp16-level precision
    if dtype == torch.float32:
        tf32 = device_facts(device)[2] >= (8, 0)
        return torch.float32, "tf32x3" if tf32 else "ieee"
    raise ValueError(f"triton GDN kernels take fp16, bf16 or fp32 activations, got {dtype}")


@_config.derived
@functools.lru_cache(maxsize=1024)
def _scan_config(device: torch.device, N: int, HV: int, K: int, V: int, per_seq: int, dtype: torch.dtype) -> dict:
    """Phase-2 launch config: a tuned file entry if present, else the heuristic below. Cached: the
    caller rounds ``per_seq`` (tokens per sequence) down to a power of two.

    From the H200 sweep (tuning/results/gdn_sweep_nvidia_h200.json): 64-wide V blocks win whenever
    there are >= 32 (sequence, head) pairs, even with fewer programs than SMs (48 pairs: BV 64
    1.19 ms, 32: 1.56, 16: 2.31); with few pairs (TP8, one sequence) more, narrower blocks win
    (8 pairs: BV 16 1.63 ms, 32: 2.00, 64: 2.54). 4 warps always; 3 stages for long sequences,
    2 for short ones. Round 2 (norms and decays precomputed by phase 1, tuning/results/gdn_sweep_r2*.json):
    3 stages won every pair measured (27B-TP1 1x32768 BV 64: 1.01 vs 1.27 ms; 397B-TP8 1x65536 BV 16:
    1.43 vs 1.93; 27B-TP1 8x4096 BV 64: 0.81 vs 1.02), as far as shared memory allows.
    Set e (tuning/results/gdn_sweep_s6e_nvidia_h200.json): at exactly 32 pairs (35B-A3B, one sequence) 64-wide
    blocks leave half the SMs idle (64 programs) and 32-wide ones win (1x8192 0.254 -> 0.212 ms, 1x32768 0.983 ->
    0.819), while at 48 pairs (96 vs 192 programs) 64 still wins (27B-TP1 1x8192 0.259 vs 0.409 ms) and at 256
    (35B 8x4096) too (0.54 vs 0.85). So from 16 pairs on: 64-wide blocks once they make at least half as many
    programs as there are SMs, else 32.
    """
    if device.type != "cuda":  # the interpreter: fewest programs is fastest
        return {"BV": _pow2(V), "num_warps": 4, "num_stages": 1}
    tuned = _config.lookup("gdn_chunk_scan", device_facts(device)[0],
                           f"HV={HV},V={V},dtype={str(dtype).replace('torch.', '')}", tokens=per_seq,
                           fields=("BV", "num_warps", "num_stages"))
    if tuned:
        return _avoid_miscompiled_scan(dict(tuned), dtype, V)
    pairs = N * HV
    # The tiles grow with K beyond 128.
    smem = _shared_memory_per_block(device) * 128 // max(_pow2(K), 128)
    if pairs <= 16 and per_seq >= 1024 and V >= 64:
        # Session 8 (gdn_sweep_s8s / s8n_v3_nvidia_h200.json): with this few pairs the scan is latency-bound and its
        # output dots take half its time, so it walks the state path alone (SPLIT) and a parallel launch computes
        # the output: 397B-TP8 1x32768 0.947 -> 0.788 ms, 27B-TP4 1x32768 1.048 -> 0.936, 397B-TP8 2x8192 0.321 ->
        # 0.295, 1x2048 0.060 -> 0.055 (all kernels); at 32 and more pairs the states' traffic costs more than that
        # saves (35B-A3B 1x32768 1.70 -> 1.90). Shared memory of the split scan at BV 16 (sm_90 builds, K = 128):
        # bf16 108 / 143 KB at 3 / 4 stages (2: ~72); fp16 ~106 / 144 KB at 2 / 3; fp32 ~144 / 214 KB at 2 / 3.
        if dtype == torch.bfloat16:  # never one stage: _miscompiled_scan
            stages = 4 if smem >= 150_000 else 3 if smem >= 115_000 else 2
        else:
            two, three = (110_000, 150_000) if dtype == torch.float16 else (150_000, 220_000)
            stages = 3 if smem >= three else 2 if smem >= two else 1
        # Session 10 (gdn_segments_s10_nvidia_h200.json, tuning/notes_gdn.md): one long sequence in parts, each part's
        # prepare and output beside the scan of the part before / after (SEGMENTS, SEG_PREPARE). Graph replay, one
        # part -> this rule: 397B-TP8 1x32768 0.75 -> 0.63-0.64 ms, 27B-TP4 0.87 -> 0.73-0.74, 1x65536 1.70 -> 1.40,
        # 1x16384 0.39 -> 0.35; eager (events) 0.79-0.87 -> 0.69-0.76 at 397B-TP8 1x32768. A part costs the host
        # ~100 µs of launches and events, so a part holds >= 8192 tokens (parts apply to one sequence only;
        # gdn_chunk_prefill checks). At 32-48 pairs the split scan in parts loses to the one-pass scan (set t).
        parts = _segment_parts(N, per_seq)
        return {"BV": 16, "num_warps": 4, "num_stages": stages, "SPLIT": True, "SEGMENTS": parts,
                "SEG_PREPARE": parts > 1}
    if pairs >= 16:
        BV = 64 if 2 * pairs * _cdiv(V, 64) >= device_facts(device)[1] else 32
    else:
        BV = 16
    BV = min(_pow2(V), BV)
    # Shared memory of the pipelined loads (sm_90 builds, K = 128): bf16 at BV 64 takes 74 / 140 / 206 KB
    # with 1 / 2 / 3 stages; the fp32 workspace (fp16 and fp32 inputs) 82 / 197 / 329 KB at most.
    if dtype == torch.bfloat16:
        stages = 3 if smem >= 210_000 else 2 if smem >= 145_000 else 1
    else:
        stages = 2 if smem >= 200_000 else 1
    # Sessions 10-11: one sequence in parts here too, each part's prepare beside the scan part before it (the one-pass
    # scan carries the state from part to part). Graph replay, one part -> 2 / 3 / 4 parts (gdn_segments_s10 run 5):
    # 35B-A3B 1x32768 1.54 -> 1.41 / 1.40 / 1.40 ms, 27B-TP1 2.06 -> 1.88 / 1.82 / 1.80; one part -> this rule
    # (gdn_segments_s11_nvidia_h200.json): 35B 1x16384 / 1x32768 / 1x65536 0.79 -> 0.73, 1.56 -> 1.42, 3.08 -> 2.76,
    # 27B-TP1 1.06 -> 0.96, 2.08 -> 1.81, 4.11 -> 3.52. The split path's part count (one per 8192 tokens, at most 6);
    # part lengths by ONE_PASS_SEGMENT_RATIO (session 13: a prepare part beside a scan part runs ~1.8x slower than
    # alone, so the first part, whose prepare runs alone, is the longest; session 14: with SCAN_T's shorter prepare,
    # equal parts at BV 64).
    parts = _segment_parts(N, per_seq)
    if parts > 1:
        return _avoid_miscompiled_scan({"BV": BV, "num_warps": 4, "num_stages": stages, "SEGMENTS": parts,
                                        "SEG_PREPARE": True}, dtype, V)
    # Session 13 (gdn_groups_s13_nvidia_h200.json): several sequences of >= 8192 tokens at >= 32 value heads in two
    # groups of sequences, the second group's prepare beside the first group's scan. A / B in one process, events /
    # graph replay, ms: 27B-TP1 2x16384 2.232 / 2.085 -> 2.050 / 1.888, 35B-A3B 4x8192 1.383 / 1.247 -> 1.354 /
    # 1.202; 8x4096 within 1.5 % (27B-TP1 2.000 / 1.858 -> 2.002 / 1.846, 35B 1.401 / 1.264 -> 1.400 / 1.246); at 12 /
    # 8 value heads (TP4 / TP8) or 2048-token sequences slower, 64x512 within noise.
    if N > 1 and HV >= 32 and per_seq >= 8192:
        return _avoid_miscompiled_scan({"BV": BV, "num_warps": 4, "num_stages": stages, "GROUPS": 2,
                                        "SEG_PREPARE": True}, dtype, V)
    return _avoid_miscompiled_scan({"BV": BV, "num_warps": 4, "num_stages": stages}, dtype, V)


def scan_t_fits(K: int, V: int, split: bool) -> bool:
    """Whether ``T diag(beta)`` (``[C, C]`` per chunk and head, scan_config ``SCAN_T``) fits the workspace where W and U
    go: both parts in the one-pass scan, W's alone in the split scan (which writes ``V'`` into U's)."""
    return K >= CHUNK if split else K + V >= CHUNK


def _default_scan_t(split: bool) -> bool:
    """scan_config ``SCAN_T`` where neither a tuned entry nor the caller sets it (see :func:`_scan_chunk`): the
    prepare leaves ``T diag(beta)`` and the scan forms ``V'`` itself. Session 14, H200, bf16, one process, events /
    graph replay, ms (tuning/results/gdn_scan_t_s14_nvidia_h200.json): 27B-TP1 8x4096 1.877 / 1.843 -> 1.665 / 1.623
    (prepare 1.053 -> 0.765, scan 0.800 -> 0.874), 35B-A3B 8x4096 1.288 -> 1.138, 35B-A3B 1x32768 1.430 -> 1.231,
    27B-TP1 1x32768 1.819 -> 1.741, 27B-TP1 1x8192 0.560 -> 0.516, 35B-A3B 1x8192 0.436 -> 0.378, 27B-TP1 64x512
    2.032 -> 1.839, 397B-TP8 8x4096 0.350 -> 0.313, 27B-TP4 8x4096 0.570 -> 0.570 (graph 0.530 -> 0.485); output
    errors against the fp64 reference the same or lower (hard keys 0.0055 -> 0.0051). The split scan keeps W and U:
    its latency-bound state path gets the extra dot (gdn_scan_t_split_s14: 27B-TP4 1x32768 0.791 -> 0.881 ms,
    397B-TP8 1x32768 0.689 -> 0.812)."""
    return not split


def _segment_parts(N: int, per_seq: int) -> int:
    """Parts of one sequence's scan (both scan forms, see :func:`_scan_config`): one per 8192 tokens, at most 6; a
    batch of several sequences runs in one part."""
    return max(1, min(6, per_seq // 8192)) if N == 1 else 1


def _miscompiled_scan(dtype: torch.dtype, BV: int, stages: int) -> bool:
    """Whether Triton 3.6 builds a wrong scan for this config on a GPU: with the bf16 workspace, one pipeline stage
    and V blocks narrower than 64 (tiles of fewer than 128 bytes per row), the H200 gave wrong output (BV 32:
    rel. error 1.2) or an out-of-range shared-memory address (BV 16) in the ``Aqk V'`` dot; two or three stages,
    BV 64, and the fp32 workspace (fp16, fp32 inputs) at every BV were right (tuning/notes_gdn.md, session 7)."""
    return dtype == torch.bfloat16 and stages < 2 and BV < 64


def _avoid_miscompiled_scan(cfg: dict, dtype: torch.dtype, V: int) -> dict:
    """A chosen config moved off :func:`_miscompiled_scan`: 64-wide blocks where V has them, else two stages (a
    device without the shared memory for them then fails to launch, loudly, instead of computing garbage)."""
    if _miscompiled_scan(dtype, cfg["BV"], cfg["num_stages"]):
        if V >= 64:
            cfg["BV"] = 64
        else:
            cfg["num_stages"] = 2
    return cfg


@functools.cache
def _shared_memory_per_block(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


# scan_config keys that are not launch options
SCAN_KEYS = ("BV", "SPLIT", "SEGMENTS", "SEG_PREPARE", "GROUPS", "SCAN_T")
# prepare_config keys that are kernel flags (the rest are launch options)
PREPARE_CONSTEXPRS = ("DIAG_BY_PRODUCT", "LOWP_MERGE", "EXACT_PREC", "DIAG_ROWS", "STOP", "BLOCK_INV", "SCALE_K")
PREPARE_BLOCKS = ("BKC", "BVC")  # prepare_config keys that set its column blocks (prepare_consts)


@functools.lru_cache(maxsize=64)
def _prepare_config(device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """(kernel flags, launch options) of phase 1 for this device and activation dtype.

    The diagonal inverse stays exact in fp32 for every dtype. bf16 and fp16 on sm80+ invert 4-row diagonal
    blocks by substitution (3 dependent steps) and merge them 4 -> 8 -> 16 -> 32 -> 64 in tf32 dots: merges
    ``T_21 = -T_22 A_21 T_11`` do not cancel, so they keep the bf16 budget on the hard keys (GPU test
    ``test_prefill_prepare_variants_correlated_keys``). H200 sweep (tuning/results/gdn_sweep_c_nvidia_h200.json):
    1.31 ms against 1.92 ms for 16-row substitution at 27B-TP1 T=32768, 0.335 against 0.492 at 27B-TP4
    8x4096, output errors equal to 3 digits on both key sets. fp32 (tf32x3 merges, not timed) and pre-sm80
    GPUs (no tf32) keep 16-row substitution. bf16 also caps registers at 168 (3 CTAs per SM instead of 2:
    1.93 against 2.15 ms with 16-row blocks; no difference with 4-row blocks).

    With 4-row blocks the substitution and the merges up to 16 rows run on the four diagonal 16-row blocks as one
    batch (``BLOCK_INV`` 1, :func:`_blocked_lower_inverse`): the same products without the full tile's zeros. H200
    (tuning/results/gdn_sweep_s9i_nvidia_h200.json): 27B-TP1 8x4096 1.306 -> 1.092 ms, 35B 1x32768 0.881 -> 0.735,
    27B-TP4 1x32768 0.334 -> 0.279, the output the same to every printed digit (hard keys too). Not ``BLOCK_INV`` 2
    (the 32- and 64-row merges on their blocks too): the reshuffles between layouts cost more than it saves (1.547).
    With them ``SCALE_K``: ``W = (T diag(beta)) (diag(e^g / |k|) K)``, one T operand for the W and U products
    (gdn_sweep_s9i2: 1.090 -> 1.057 ms at 27B-TP1 8x4096, half the spills; output error the same or lower).

    Not the product series in plain tf32 dots (``DIAG_BY_PRODUCT`` with ``EXACT_PREC="tf32"``), although
    it measured 1.45 ms: ``(I - N)(I + N^2)(I + N^4)(I + N^8)`` builds large intermediate products that
    cancel, and tf32 operands do not survive the cancellation when keys are strongly correlated and
    beta is near 1 (as after the conv's SiLU): an emulation of tf32 rounding on such 16-row blocks
    (keys |z|+1, beta in [0.95, 1], no decay) gives inverse errors of 0.1-0.28, far past the bf16
    budget. With fp32-accurate dots (tf32x3) the series is accurate but no faster than substitution.
    """
    tf32 = device_facts(device)[2] >= (8, 0)
    four_rows = tf32 and dtype in (torch.bfloat16, torch.float16)
    flags = {"DIAG_BY_PRODUCT": False, "LOWP_MERGE": False, "EXACT_PREC": "tf32x3" if tf32 else "ieee",
             "DIAG_ROWS": 4 if four_rows else 16, "BLOCK_INV": 1 if four_rows else 0, "SCALE_K": four_rows}
    options = {"num_warps": 4, "num_stages": 1}
    if dtype == torch.bfloat16 and tf32:
        options["maxnreg"] = 168
    return flags, options


def _split_prepare_config(device: torch.device, dtype: torch.dtype, override: dict | None) -> tuple[dict, dict]:
    flags, options = _prepare_config(device, dtype)
    if override:
        if override.get("DIAG_BY_PRODUCT") and "DIAG_ROWS" not in override:
            override = {**override, "DIAG_ROWS": 16}  # the series inverts 16-row blocks, whatever the default
        flags = {**flags, **{k: v for k, v in override.items() if k in PREPARE_CONSTEXPRS}}
        options = {**options, **{k: v for k, v in override.items()
                                 if k not in PREPARE_CONSTEXPRS and k not in PREPARE_BLOCKS}}
    return flags, options


def _prepare_flags(dot_prec: str, flags: dict) -> tuple:
    """The prepare kernel's trailing constexprs, in its signature's order."""
    if flags["DIAG_ROWS"] not in (4, 8, 16) or (flags["DIAG_BY_PRODUCT"] and flags["DIAG_ROWS"] != 16):
        raise ValueError(f"prepare_config DIAG_ROWS={flags['DIAG_ROWS']}: accepted 4, 8 or 16 (16 with "
                         "DIAG_BY_PRODUCT)")
    if flags.get("BLOCK_INV", 0) not in (0, 1, 2):
        raise ValueError(f"prepare_config BLOCK_INV={flags['BLOCK_INV']}: accepted 0 (merges on the full tile), 1 "
                         "(merges up to 16 rows on the diagonal blocks) or 2 (every merge on its blocks)")
    if flags.get("STOP", 0) not in (0, 1, 2, 3, 4):
        raise ValueError(f"prepare_config STOP={flags['STOP']}: accepted 0 (the whole kernel) to 4 (timing only)")
    return (dot_prec, flags["EXACT_PREC"], flags["DIAG_BY_PRODUCT"], flags["LOWP_MERGE"], flags["DIAG_ROWS"],
            flags.get("STOP", 0), flags.get("BLOCK_INV", 0), bool(flags.get("SCALE_K", False)))


class _Plan(NamedTuple):
    """Everything about a call that depends only on (device, dtype, sequences, heads, head dims, tokens per
    sequence rounded to a power of two): computed once, so the per-call host work is allocations and launches."""

    ws_dtype: torch.dtype
    ws_row: int  # workspace elements per (value head, token), see _workspace
    dot_prec: str
    prepare_consts: tuple  # K, V, BKC, BVC, C
    prepare_flags: tuple  # the prepare kernel's trailing constexprs (see _prepare_flags)
    prepare_options: dict
    scan_consts: tuple  # K, V, BK, BV, C
    scan_options: dict
    single_options: dict  # the single-launch kernel's: the prepare's without its register cap (few programs)
    split: bool = False  # the scan's state path alone, then the output of all chunks in parallel (scan_config SPLIT)
    segments: int = 1  # one split sequence in this many parts, overlapping launches (scan_config SEGMENTS)
    seg_prepare: bool = False  # segments: the prepare in parts too (scan_config SEG_PREPARE)
    groups: int = 1  # a batch of one-pass scans in this many groups of sequences, overlapping launches (GROUPS)
    scan_t: bool = False  # the scan forms V' from v and T diag(beta), which the prepare stores (SCAN_T)

    @property
    def segment_ratio(self) -> float | None:
        """:func:`segment_cuts`' ``ratio`` for one sequence's parts: by the one-pass scan's V block
        (:data:`ONE_PASS_SEGMENT_RATIO`), None (its weights) for the split scan."""
        return None if self.split else ONE_PASS_SEGMENT_RATIO.get(self.scan_consts[3], 0.6)

    def scan_grid(self, N: int, HV: int) -> tuple[int, int, int]:
        V, BV = self.scan_consts[1], self.scan_consts[3]
        return (-(-V // BV), *grid_rows(N * HV))

    def _replace_configs(self, device: torch.device, dtype: torch.dtype, prepare_config: dict | None,
                         scan_config: dict | None) -> _Plan:
        """This plan with the launch configs a caller passed in (the benchmark's variants)."""
        plan = self
        if prepare_config is not None:
            if prepare_config.get("num_stages", 1) != 1:
                raise ValueError(f"prepare_config num_stages={prepare_config['num_stages']}: accepted 1 (its loops "
                                 "are not pipelined; Triton 3.6 gave wrong output with 2 stages on an H200)")
            flags, options = _split_prepare_config(device, dtype, prepare_config)
            plan = plan._replace(prepare_options=options, prepare_flags=_prepare_flags(plan.dot_prec, flags))
            if any(k in prepare_config for k in PREPARE_BLOCKS):
                K, V, BKC, BVC, C = plan.prepare_consts
                BKC, BVC = prepare_config.get("BKC", BKC), prepare_config.get("BVC", BVC)
                if not all(b in (16, 32, 64) for b in (BKC, BVC)):
                    raise ValueError(f"prepare_config BKC={BKC}, BVC={BVC}: accepted 16, 32 or 64")
                plan = plan._replace(prepare_consts=(K, V, BKC, BVC, C))
        if scan_config is not None:
            if device.type == "cuda" and _miscompiled_scan(dtype, scan_config["BV"], scan_config.get("num_stages", 3)):
                raise ValueError(f"scan_config {scan_config}: bf16 scans need num_stages >= 2 or BV >= 64 on a GPU "
                                 "(Triton 3.6 builds a wrong kernel for narrower blocks in one stage)")
            K, V, BK, _, C = plan.scan_consts
            split = scan_config.get("SPLIT", False)
            segments = scan_config.get("SEGMENTS", 1)
            seg_prepare = scan_config.get("SEG_PREPARE", False)
            groups = scan_config.get("GROUPS", 1)
            scan_t = scan_config.get("SCAN_T", False)
            for name, value in (("SPLIT", split), ("SEG_PREPARE", seg_prepare), ("SCAN_T", scan_t)):
                if not isinstance(value, bool):
                    raise ValueError(f"scan_config {name}={value!r}: accepted True or False")
            for name, value in (("SEGMENTS", segments), ("GROUPS", groups)):
                if type(value) is not int or value < 1:
                    raise ValueError(f"scan_config {name}={value!r}: accepted an integer >= 1")
            if scan_t and not scan_t_fits(K, V, split):
                raise ValueError(f"scan_config SCAN_T=True with K={K}, V={V}, SPLIT={split}: T diag(beta) needs K + V "
                                 f">= {C} (W and U's place) in the one-pass scan, K >= {C} (W's) in the split scan")
            plan = plan._replace(scan_consts=(K, V, BK, scan_config["BV"], C), split=split, segments=segments,
                                 seg_prepare=seg_prepare, groups=groups, scan_t=scan_t,
                                 scan_options={k: v for k, v in scan_config.items() if k not in SCAN_KEYS})
        return plan


@_config.derived
@functools.lru_cache(maxsize=1024)
def _plan(device: torch.device, dtype: torch.dtype, N: int, HV: int, K: int, V: int, per_seq: int) -> _Plan:
    ws_dtype, dot_prec = workspace_dtype(dtype, device, K, V)
    BK, BV_full = _pow2(K), _pow2(V)
    flags, prepare_options = _split_prepare_config(device, dtype, None)
    scan = _scan_config(device, N, HV, K, V, per_seq, dtype)
    split = scan.get("SPLIT", False)
    return _Plan(
        ws_dtype=ws_dtype, ws_row=(K + V + CHUNK + 7) // 8 * 8 + 3 * (4 // ws_dtype.itemsize), dot_prec=dot_prec,
        prepare_consts=(K, V, min(BK, 64), min(BV_full, 64), CHUNK),
        prepare_flags=_prepare_flags(dot_prec, flags),
        prepare_options=prepare_options, scan_consts=(K, V, BK, scan["BV"], CHUNK),
        scan_options={k: v for k, v in scan.items() if k not in SCAN_KEYS}, split=split,
        segments=scan.get("SEGMENTS", 1), seg_prepare=scan.get("SEG_PREPARE", False), groups=scan.get("GROUPS", 1),
        scan_t=scan.get("SCAN_T", _default_scan_t(split)) and scan_t_fits(K, V, split),
        single_options={k: v for k, v in prepare_options.items() if k != "maxnreg"})


_launch_prepare = DirectLauncher(_chunk_prepare_kernel)
_launch_scan = DirectLauncher(_chunk_scan_kernel)
_launch_single = DirectLauncher(_chunk_single_kernel)
_launch_output = DirectLauncher(_chunk_output_kernel)


def _state_io(initial_state: torch.Tensor | None, state_pool: torch.Tensor | None, output_final_state: bool, N: int,
              HV: int, K: int, V: int, device: torch.device) -> tuple:
    """(states read, states written, the final states returned): the pool both ways, else the initial states and a
    new ``[N, HV, K, V]`` fp32 tensor when the caller asks for the final states."""
    if state_pool is not None:
        return state_pool, state_pool, None
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if output_final_state else None
    return initial_state, final, final


def _single_workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The single-launch path's workspace (T <= CHUNK: at most a few MB): one buffer per thread, device, stream and
    dtype, kept between calls (:func:`kernels_triton._kept.kept`) -- a call saves an allocation (1-4 µs on the H200's
    hosts, of 30-55 per short prefill). Under a CUDA-graph capture a new allocation, the graph's own."""
    record = kept("gdn_single", numel, dtype, device)
    return torch.empty(numel, dtype=dtype, device=device) if record is None else record.buffer


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    state_pool: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    metadata: object | None = None,
    out: torch.Tensor | None = None,
    prepare_config: dict | None = None,
    scan_config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton implementation of :func:`qwen35.ops.gdn_chunk_prefill` (see the module docstring).

    ``prepare_config`` (``num_warps``, ``num_stages`` (1 only), optionally ``maxnreg``, the column blocks
    ``BKC`` / ``BVC``, and the kernel flags ``DIAG_BY_PRODUCT``, ``LOWP_MERGE``, ``EXACT_PREC``, ``DIAG_ROWS``,
    ``STOP``) and ``scan_config`` (``BV``, ``num_warps``, ``num_stages``, ``SPLIT``: the output in a parallel
    launch after the scan; for one sequence, ``SEGMENTS``: the scan in that many parts, each part's output (split) and
    with ``SEG_PREPARE`` its prepare beside the scan of the part before / after; for several, ``GROUPS``: the one-pass
    scan in that many groups of whole sequences, the same way, when ``metadata`` was built from the host's offsets;
    ``SCAN_T``: the prepare leaves ``T diag(beta)`` and the scan forms ``V'`` itself, the default of the one-pass scan
    but off in a caller's scan_config unless set) override the launch configs of the two phases; the benchmark times
    variants with them. Either one also turns off the single-launch path of batches of at most ``CHUNK`` tokens.
    Host cost matters here (short prompts at TP4/TP8): one workspace allocation (kept per thread and stream for
    batches of at most ``CHUNK`` tokens), cached configs, and kernels launched through :class:`DirectLauncher`.
    """
    T, H, K = q.shape
    _, HV, V = v.shape
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        check_head_dims(K, V)
    dev = q.device
    if (q.data_ptr() | k.data_ptr()) & 15:
        # The scan stages q and k through pipelined (asynchronous) copies; from views that are not
        # 16-byte aligned these read wrong rows on an H200 (seen with a 2-byte offset), so realign.
        q, k = q.clone(), k.clone()
    for name, st in (("initial_state", initial_state), ("state_pool", state_pool)):
        if st is not None and st.dtype is not torch.float32 and st.dtype is not torch.float64:
            raise ValueError(f"{name} has dtype {st.dtype}; states are fp32 (fp64 accepted)")
    g, beta, a, b, gate_stride = gate_rows(g, beta, a, b)
    scale = K**-0.5 if scale is None else float(scale)
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else 1
    # Every sequence within one chunk: both phases in one launch, no chunk table (short prompts are host-bound).
    # Not for bf16 with V < 64: its scan tile would be one of the miscompiled class (see _miscompiled_scan).
    single = (0 < T <= CHUNK and N > 0 and prepare_config is None and scan_config is None
              and (V >= 64 or q.dtype != torch.bfloat16))
    if varlen:
        if isinstance(metadata, GdnChunkMetadata):
            mcu = metadata.cu_seqlens
            if mcu is not cu_seqlens and (mcu.data_ptr() != cu_seqlens.data_ptr() or mcu.shape[0] != N + 1):
                raise ValueError("metadata was prepared for another cu_seqlens tensor; call prepare_gdn_metadata "
                                 "on this batch's cu_seqlens")
            if single:
                bounds, num_chunks = None, N
            elif metadata.version == cu_seqlens._version:
                bounds, num_chunks = metadata.chunk_bounds, metadata.num_chunks
            else:  # written in place since: the table may be stale
                bounds, num_chunks = _chunk_bounds_on_device(cu_seqlens, T) if N > 0 else (None, 0)
        elif metadata is None:
            bounds, num_chunks = (_chunk_bounds_on_device(cu_seqlens, T) if N > 0 and not single else (None, N))
        else:
            raise ValueError(f"metadata must come from kernels_triton.prepare_gdn_metadata, got {type(metadata)}")
    else:
        bounds, num_chunks = None, -(-T // CHUNK)
    plan = _plan(dev, q.dtype, N, HV, K, V, 1 << max(T // max(N, 1), 1).bit_length() - 1)
    if prepare_config is not None or scan_config is not None:
        plan = plan._replace_configs(dev, q.dtype, prepare_config, scan_config)

    # V blocks of the single-launch and output kernels; 64: narrower would be of the miscompiled class for bf16
    # (_miscompiled_scan)
    wide_bv = min(_pow2(V), 64)
    pool = state_pool is not None
    pool_slot_stride = state_pool.stride(0) if pool else HV * K * V
    if single:  # both phases in one launch; each of its programs has its own copy of the workspace
        copies = _cdiv(V, wide_bv)
        ws = _single_workspace(copies * HV * T * plan.ws_row, plan.ws_dtype, dev)
        o = torch.empty(T, HV, V, dtype=q.dtype, device=dev) if out is None else out
        h0, ht, final = _state_io(initial_state, state_pool, output_final_state, N, HV, K, V, dev)
        Kc, Vc, BKC, BVC, C = plan.prepare_consts
        _launch_single((N * HV, copies), (q, k, v, g, beta, a, b, A_log, dt_bias, ws, o, cu_seqlens, h0, ht,
                                           state_slots, has_initial_state, T, scale, pool_slot_stride,
                                           HV * T * plan.ws_row, H, HV, gate_stride, Kc, Vc, BKC, min(BVC, wide_bv),
                                           plan.scan_consts[2], wide_bv, C, varlen, a is not None, use_qk_l2norm,
                                           h0 is not None, ht is not None, pool, has_initial_state is not None,
                                           *plan.prepare_flags),
                       plan.single_options)
        return o, final
    ws = torch.empty(HV * T * plan.ws_row, dtype=plan.ws_dtype, device=dev)  # layout: _workspace
    work = num_chunks > 0 and T > 0
    # One long sequence in parts (segments): each part's prepare (SEG_PREPARE) and output (split scans) run beside a
    # scan part.
    streams = dev.type != "cuda" or _cuda_driver() is not None
    cuts = (segment_cuts(num_chunks, plan.segments, ratio=plan.segment_ratio)
            if work and N == 1 and plan.segments > 1 and streams else None)
    # A batch of sequences (one-pass scans) in groups of whole sequences, the same way: each group's prepare beside the
    # scan of the group before. Needs the chunk table's sequence offsets on the host (metadata built from them).
    seq_cuts = None
    if (work and N > 1 and plan.groups > 1 and not plan.split and streams and isinstance(metadata, GdnChunkMetadata)
            and metadata.chunk_offsets is not None and bounds is metadata.chunk_bounds):
        seq_cuts = sequence_groups(metadata.chunk_offsets, plan.groups)
        cuts = [metadata.chunk_offsets[s] for s in seq_cuts]
    if work:
        prepare_args = (q, k, v, g, beta, a, b, A_log, dt_bias, bounds, ws, T, scale, 0, H, HV, gate_stride,
                        *plan.prepare_consts, varlen, a is not None, use_qk_l2norm, *plan.prepare_flags, plan.scan_t)
        # Phase 1: everything that does not need the running state, all chunks in parallel (in segments, with
        # SEG_PREPARE: the first segment's chunks). Launched before the other allocations: the GPU starts on it
        # while the host does them.
        first = cuts[1] if cuts is not None and plan.seg_prepare else num_chunks
        _launch_prepare((first * HV,), prepare_args, plan.prepare_options)
    o = torch.empty(T, HV, V, dtype=q.dtype, device=dev) if out is None else out
    h0, ht, final = _state_io(initial_state, state_pool, output_final_state, N, HV, K, V, dev)

    # Phase 2: the sequential pass over chunks, state in registers, output and final state written (SPLIT: the
    # chunks' starting states and V' written instead, and the output computed from them with all chunks in parallel).
    split = plan.split and work
    states = torch.empty(num_chunks, HV, K, V, dtype=plan.ws_dtype, device=dev) if split else None
    scan_args = (q, k, v, ws, o, states, cu_seqlens, h0, ht, state_slots, has_initial_state, None, T,
                 pool_slot_stride, 0, 0, 0, H, HV, N * HV, *plan.scan_consts, varlen, h0 is not None, ht is not None,
                 pool, has_initial_state is not None, plan.dot_prec, split, False, False, False, plan.scan_t)
    output_args = (q, ws, states, o, bounds, T, H, HV, 0, K, V, plan.scan_consts[2], wide_bv, CHUNK, varlen,
                   plan.dot_prec) if split else ()
    if cuts is not None and len(cuts) > 2:
        scans = (_group_scans(plan, seq_cuts, HV, scan_args) if seq_cuts is not None
                 else _segment_scans(plan, cuts, HV, scan_args))
        _scan_in_parts(plan, cuts, scans, HV, prepare_args, output_args)
        return o, final
    if N > 0:
        _launch_scan(plan.scan_grid(N, HV), scan_args, plan.scan_options)
    if split:
        _launch_output((num_chunks * HV, _cdiv(V, wide_bv)), output_args, _OUTPUT_OPTIONS)
    return o, final


_OUTPUT_OPTIONS = {"num_warps": 4, "num_stages": 1}
_scan_streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_thread = threading.local()  # .events: device index -> raw event handles (per thread: calls from two threads at once
# must not re-record each other's events between a record and its wait)


@functools.cache
def _cuda_driver() -> ctypes.CDLL | None:
    """The driver's event calls, for the few µs torch's Python wrappers add to each (a call in parts makes up to
    three per part); event and stream handles are the runtime's, which the driver shares. None where there is no
    such driver (a HIP build, a runtime without ``libcuda``): calls then run in one part."""
    if torch.version.hip is not None:
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    except (OSError, AttributeError):
        return None
    return lib


def _order(rc: int) -> None:
    if rc:
        raise RuntimeError(f"CUDA driver error {rc} ordering the parts of a segmented GDN scan")


def _record(event: int, stream: int) -> None:
    """Record raw event ``event`` on raw stream ``stream``."""
    _order(_cuda_driver().cuEventRecord(event, stream))


def _wait(stream: int, event: int) -> None:
    """Make raw stream ``stream`` wait for raw event ``event`` (a fork or a join, also under CUDA-graph capture)."""
    _order(_cuda_driver().cuStreamWaitEvent(stream, event, 0))


def _side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The streams of a segmented scan's parts, one pair per device: (scan, prepare). The scan's at the highest
    priority, so that a scan part's programs take free SM slots before pending prepare / output programs do."""
    streams = _scan_streams.get(device.index)
    if streams is None:
        streams = _scan_streams[device.index] = (torch.cuda.Stream(device, priority=-100), torch.cuda.Stream(device))
    return streams


def _event(device: int, i: int) -> int:
    """The i-th of device ``device``'s reusable events, a raw handle (a wait takes the event's state when it is
    enqueued, so recording it again later, also in a later call, does not touch waits already enqueued)."""
    if not hasattr(_thread, "events"):
        _thread.events = {}
    events = _thread.events.setdefault(device, [])
    while len(events) <= i:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):  # the device's primary context, current for the driver call
            _order(_cuda_driver().cuEventCreate(ctypes.byref(handle), 2))  # CU_EVENT_DISABLE_TIMING
        events.append(handle.value)
    return events[i]


# Relative lengths of the first, middle and last segments of a split scan (see segment_cuts)
SEGMENT_WEIGHTS = (1.0, 1.0, 0.5)
# The one-pass scan's segments: each part this much of the one before (see segment_cuts), by the scan's V block.
# Session 13, H200 (tuning/results/gdn_segment_ratio_s13_nvidia_h200.json), graph replay at the default part counts,
# SEGMENT_WEIGHTS -> 0.6: 35B-A3B 1x32768 1.409 -> 1.390 ms, 1x65536 2.748 -> 2.717, 27B-TP1 1x32768 1.809 -> 1.781,
# 1x65536 3.521 -> 3.487 (0.6-0.9 measured; 16384 tokens within noise). Session 14, with SCAN_T (a prepare ~27 %
# shorter; gdn_scan_t_split_s14_nvidia_h200.json), events / graph: at BV 64 (27B-TP1, 48 pairs: 96 scan programs)
# equal parts won, 1x32768 1.735 / 1.681 -> 1.660 / 1.609 ms, 1x16384 0.932 / 0.888 -> 0.905 / 0.866 (0.8 between);
# at BV 32 (35B-A3B) 0.6 still did, 1x32768 1.221 against 1.242 (0.8) / 1.253 (1.0), 1x65536 2.374 / 2.397 / 2.418.
ONE_PASS_SEGMENT_RATIO: dict[int, float] = {32: 0.6, 64: 1.0}  # BV -> ratio; other BVs 0.6


def segment_cuts(num_chunks: int, parts: int, weights: tuple[float, float, float] | None = None,
                 ratio: float | None = None) -> list[int]:
    """Chunk bounds of ``parts`` segments of a sequence. Lengths in the ratio ``weights`` (first, every middle one,
    last; default :data:`SEGMENT_WEIGHTS`): the last part's output has no scan part beside it, so it is shorter,
    while part 1's prepare must finish beside scan part 0. Or, with ``ratio``, each part ``ratio`` times the one
    before: a prepare beside a scan part runs slower than alone, so to be done when the scan part before it ends it
    must cover fewer chunks than that part. Strictly increasing: fewer parts where the sequence has too few chunks
    for them (no empty launch)."""
    if ratio is not None:
        w = [ratio**i for i in range(parts)]
    else:
        first, middle, last = SEGMENT_WEIGHTS if weights is None else weights
        w = [first] + [middle] * (parts - 2) + [last] if parts > 1 else [1.0]
    total, acc, cuts = sum(w), 0.0, [0]
    for x in w[:-1]:
        acc += x
        cuts.append(round(num_chunks * acc / total))
    cuts.append(num_chunks)
    return sorted(set(cuts))


def _with(args: tuple, at: int, *values) -> tuple:  # noqa: ANN002
    """``args`` with ``len(values)`` of its entries from index ``at`` on replaced by ``values``."""
    return (*args[:at], *values, *args[at + len(values):])


# Where the per-part arguments sit in the launches' positional argument tuples (from the kernels' signatures).
_PREPARE_BASE = _chunk_prepare_kernel.arg_names.index("chunk_base")
_SCAN_CARRY = _chunk_scan_kernel.arg_names.index("carry_ptr")
_SCAN_BOUNDS = _chunk_scan_kernel.arg_names.index("chunk_lo")  # chunk_lo, chunk_hi
_SCAN_PART = _chunk_scan_kernel.arg_names.index("PART")  # PART, CARRY_IN, CARRY_OUT
_SCAN_NH_BASE = _chunk_scan_kernel.arg_names.index("nh_base")
_SCAN_NH = _chunk_scan_kernel.arg_names.index("NH")
_OUTPUT_BASE = _chunk_output_kernel.arg_names.index("chunk_base")
_OUTPUT_BV = _chunk_output_kernel.arg_names.index("BV")


def _segment_scans(plan: _Plan, cuts: list[int], HV: int, scan_args: tuple) -> list[tuple[tuple, tuple]]:
    """(grid, arguments) of each scan part of one sequence in segments (chunk bounds ``cuts``): the state goes from
    part to part in an fp32 tensor."""
    K, V = plan.scan_consts[0], plan.scan_consts[1]
    carry = torch.empty(HV, K, V, dtype=torch.float32, device=scan_args[0].device)
    grid, parts = plan.scan_grid(1, HV), len(cuts) - 1
    return [(grid, _with(_with(_with(scan_args, _SCAN_CARRY, carry), _SCAN_BOUNDS, cuts[i], cuts[i + 1]), _SCAN_PART,
                         True, i > 0, i < parts - 1)) for i in range(parts)]


def _group_scans(plan: _Plan, seq_cuts: list[int], HV: int, scan_args: tuple) -> list[tuple[tuple, tuple]]:
    """(grid, arguments) of each scan part of a batch in groups of whole sequences (bounds ``seq_cuts``,
    :func:`sequence_groups`): the (sequence, head) pairs of each group."""
    n_vb = plan.scan_grid(1, HV)[0]
    return [((n_vb, *grid_rows((hi - lo) * HV)), _with(_with(scan_args, _SCAN_NH_BASE, lo * HV), _SCAN_NH, hi * HV))
            for lo, hi in itertools.pairwise(seq_cuts)]


def sequence_groups(chunk_offs: Sequence[int], groups: int, ratio: float | None = 1.0) -> list[int]:
    """Sequence bounds ``[0, .., N]`` of at most ``groups`` groups of whole sequences (``chunk_offs``: each sequence's
    first chunk, then the total, :func:`chunk_offsets`), cut at the sequence boundaries nearest to
    :func:`segment_cuts`' chunk bounds (lengths shrinking by ``ratio``; default equal, which measured faster than
    0.6 for groups: gdn_groups_s13); every group holds at least one chunk."""
    n, N = chunk_offs[-1], len(chunk_offs) - 1
    cuts = [0]
    for target in segment_cuts(n, groups, ratio=ratio)[1:-1]:
        s = bisect.bisect_left(chunk_offs, target)  # chunk_offs[s - 1] < target <= chunk_offs[s]
        if s > 0 and target - chunk_offs[s - 1] < chunk_offs[s] - target:
            s -= 1
        if chunk_offs[cuts[-1]] < chunk_offs[s] < n:
            cuts.append(s)
    cuts.append(N)
    return cuts


def _scan_in_parts(plan: _Plan, cuts: list[int], scans: list[tuple[tuple, tuple]], HV: int, prepare_args: tuple,
                   output_args: tuple) -> None:
    """Phase 2 in parts: scan launch i (``scans[i]``: grid, arguments) covers the chunks ``cuts[i] .. cuts[i + 1]``
    (one sequence's segments, :func:`_segment_scans`, or groups of sequences, :func:`_group_scans`), after the
    caller launched the prepare of every chunk or (``seg_prepare``) of the first part's. On a GPU the scan parts run
    in order on a high-priority stream; beside scan part i run, on the caller's stream, the output of part i - 1
    (split scans) and, with ``seg_prepare``, on a third stream the prepares of the parts after it (each scan part
    waits for its own). Launches are issued in the order the scan chain needs them (a launch costs the host ~20 µs).
    The caller's stream ends after every part (events only: nothing else to synchronise, and CUDA-graph capture
    sees forks and joins)."""
    dev = prepare_args[0].device
    parts = len(cuts) - 1
    gpu = dev.type == "cuda"
    n_out = _cdiv(plan.scan_consts[1], output_args[_OUTPUT_BV]) if plan.split else 0
    if gpu:
        d = dev.index
        side, prep = _side_streams(dev)
        main, raw_side, raw_prep = torch._C._cuda_getCurrentRawStream(d), side.cuda_stream, prep.cuda_stream
        forked, prep_done = _event(d, 2 * parts), _event(d, 2 * parts + 1)
        _record(forked, main)  # after the caller's work and the first prepare
        _wait(raw_side, forked)
        if plan.seg_prepare:
            _wait(raw_prep, forked)

    def prepare(i: int) -> None:
        pa = _with(prepare_args, _PREPARE_BASE, cuts[i])
        _launch_prepare(((cuts[i + 1] - cuts[i]) * HV,), pa, plan.prepare_options, prep if gpu else None)
        if gpu:
            _record(_event(d, parts + i), raw_prep)

    def output(i: int) -> None:
        if gpu:
            _wait(main, _event(d, i))  # output part i (and the caller's later work) after scan part i
        if plan.split:  # (the one-pass scan wrote the output itself)
            oa = _with(output_args, _OUTPUT_BASE, cuts[i])
            _launch_output(((cuts[i + 1] - cuts[i]) * HV, n_out), oa, _OUTPUT_OPTIONS)

    for i, (grid, sa) in enumerate(scans):
        if gpu:
            if plan.seg_prepare and i > 0:
                _wait(raw_side, _event(d, parts + i))  # scan part i after its prepare
            _launch_scan(grid, sa, plan.scan_options, side)
            _record(_event(d, i), raw_side)
        else:
            _launch_scan(grid, sa, plan.scan_options)
        if plan.seg_prepare and i + 1 < parts:
            prepare(i + 1)  # runs beside scan part i (issued after it: the host's launches lag the GPU at first)
        if i > 0:
            output(i - 1)
    output(parts - 1)
    if gpu and plan.seg_prepare:  # an explicit join of the prepare stream (graph capture wants every fork joined)
        _record(prep_done, raw_prep)
        _wait(main, prep_done)
