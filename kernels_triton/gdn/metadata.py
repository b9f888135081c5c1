"""The chunk table of a batch for the chunked GDN prefill: which tokens each ``CHUNK``-token chunk of each sequence
covers, built once per batch (on the host from the sequence offsets, or on the device) and shared by every layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

CHUNK = 64  # tokens per chunk; the kernels are written for 16 <= C <= 64 (inverse by 16-row blocks)


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
    offsets: tuple[int, ...] | None = None  # cu_seqlens' values, when built on the host
    # Tables derived from this batch's offsets at first use and shared by every layer (e.g. the cut path's segments,
    # :mod:`.cut`), by what they are for.
    derived: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter, or -1 for an inference tensor (made under ``torch.inference_mode``, as vLLM runs
    its models), which has none: metadata of such a tensor is trusted as prepared for its batch."""
    return -1 if t.is_inference() else t._version


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
                                    cu_seqlens, tensor_version(cu_seqlens))
        cu, seq = cu_seqlens.long(), chunk_indices[:, 0].long()
        start = cu[seq] + chunk_indices[:, 1].long() * CHUNK
        bounds = torch.stack([start, torch.minimum(start + CHUNK, cu[seq + 1])], dim=1).to(torch.int32)
        return GdnChunkMetadata(bounds, n, CHUNK, cu_seqlens, tensor_version(cu_seqlens))
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
        return GdnChunkMetadata(table, n, CHUNK, cu_seqlens, tensor_version(cu_seqlens), chunk_offs, tuple(offsets))
    offs = cu_seqlens.tolist() if offsets is None else list(offsets)
    chunk_offs = chunk_offsets(offs)
    n = chunk_offs[-1]
    host = torch.empty(max(n, 1), 2, dtype=torch.int32, pin_memory=cu_seqlens.is_cuda)
    chunk_table(offs, host.numpy())
    return GdnChunkMetadata(host.to(cu_seqlens.device, non_blocking=True), n, CHUNK, cu_seqlens,
                            tensor_version(cu_seqlens), chunk_offs, tuple(offs))


def chunk_bounds_on_device(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, int]:
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
