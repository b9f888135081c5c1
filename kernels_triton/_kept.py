"""Scratch buffers kept between calls, per thread, device and stream: allocations and views a call need not redo.

An op's internal scratch (what no caller sees after the call: router partials, alignment tables, a prefill
workspace) can live in one buffer that the next call on the same stream reuses: calls on one stream run one after
another, so the next call's kernels start after this call's last reader, exactly the guarantee torch's caching
allocator relies on when it hands a freed block to the next allocation of that stream. What that saves is host time:
tens of µs per MoE block before its expert GEMMs start (measured on the H200's host: 2.5-4.5 µs per ``torch.empty``,
~3 µs per tensor view; tuning/notes_moe.md).

:func:`kept` returns the record for a name, or None where a buffer must not be kept: not a CUDA device, or a CUDA
graph being captured (a captured graph must own its memory: a kept buffer is replaced when it grows, and two graphs
or a graph and eager calls would share one). A record's ``views`` dict is the caller's cache of views into the
buffer by layout; it is emptied whenever the buffer is replaced. Per thread as well as per stream: two threads
issuing calls on one stream would interleave their kernels on one buffer. :func:`kept_views` is the common use: a
call's views of its scratch, built once per layout over the kept buffer, or over a new one where none may be kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_local = threading.local()
MAX_VIEWS = 64  # layouts whose views a record caches before it starts again from empty


class Kept:
    """One kept buffer and the caller's views into it (by layout)."""

    __slots__ = ("buffer", "views")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.views: dict = {}

    def view(self, layout: object, build) -> object:  # noqa: ANN001
        """``build(buffer)`` for ``layout``, made once per layout while the buffer stays."""
        found = self.views.get(layout)
        if found is None:
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            found = self.views[layout] = build(self.buffer)
        return found


def kept(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Kept | None:
    """This thread's kept ``dtype`` buffer ``name`` on ``device`` for the current stream, at least ``numel``
    elements (replaced by a larger one when it is smaller), or None where none may be kept (see the module
    docstring). A replaced buffer goes back to torch's allocator for its stream, so work still queued there keeps
    its memory until it has run."""
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    mine = getattr(_local, "kept", None)
    if mine is None:
        mine = _local.kept = {}
    key = (name, index, torch._C._cuda_getCurrentRawStream(index), dtype)
    record = mine.get(key)
    if record is None or record.buffer.numel() < numel:
        record = mine[key] = Kept(torch.empty(numel, dtype=dtype, device=device))
    return record


def kept_views(name: str, numel: int, dtype: torch.dtype, device: torch.device, layout: object,
               build: Callable[[torch.Tensor], T], keep: bool = True) -> T:
    """``build(buffer)``: the views of one call's scratch for ``layout`` (``numel`` elements of ``dtype`` in all),
    made once per layout over this thread's kept buffer ``name`` (:func:`kept`, :meth:`Kept.view`), or made over a
    new buffer where none may be kept or ``keep`` is False."""
    record = kept(name, numel, dtype, device) if keep else None
    if record is None:
        return build(torch.empty(numel, dtype=dtype, device=device))
    return record.view(layout, build)
