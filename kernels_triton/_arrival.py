"""Arrival counters: the last program of a launch to finish does the work that needs every program's results.

Saves a launch where a small finishing step (the MoE routing after the router GEMV, say) would otherwise wait for a
launch boundary: each program stores its part, takes a ticket from a device counter (an acquire-release atomic after
a barrier over the program's threads, so its stores are visible to whoever sees the ticket), and the program that
draws the last ticket reads every part back (loads that skip L1: ``cache_modifier=".cg"``), finishes, and puts the
counter back to zero for the next launch. The order of the finishing work does not depend on which program came
last, so the results are as deterministic as with a separate launch.

One counter per device and calling thread, zeroed once when first asked for outside a graph capture. Launches
that use one counter must run one at a time (stream order: one thread's calls, as every op of this package issues
them); two such launches running at once -- one thread's calls on two streams at the same time, or a graph captured
in one thread replayed while that thread's own calls run on another stream -- would share the ticket count. Asked
for first *inside* a capture, the counter is zeroed by a node of the graph being captured and belongs to that graph
alone (not kept for later calls, which never saw it zeroed).

Block counters (:func:`block_counters`, same rules): one launch's programs :func:`signal` the counter of the block
they worked on, and a later launch's programs :func:`wait_for` their own block's count instead of the whole launch
before them (the MoE down GEMM after the gate_up GEMM: ``kernels_triton.moe.experts.block_wait_default``); a
launch after every waiter zeroes them.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

_local = threading.local()


def counters() -> dict[str, torch.Tensor]:
    """This thread's counters by device."""
    found = getattr(_local, "counters", None)
    if found is None:
        found = _local.counters = {}
    return found


BLOCK_COUNTERS = 1024  # entries of :func:`block_counters`


def _zeroed(device: torch.device, key: str, n: int) -> torch.Tensor:
    mine = counters()
    counter = mine.get(key)
    if counter is not None:
        return counter
    counter = torch.zeros(n, dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return counter
    mine[key] = counter
    return counter


def arrival_counter(device: torch.device) -> torch.Tensor:
    """This thread's zeroed int32 counter on ``device`` for :func:`last_to_arrive` (see the module docstring)."""
    return _zeroed(device, str(device), 4)


def block_counters(device: torch.device) -> torch.Tensor:
    """This thread's BLOCK_COUNTERS zeroed int32 counters on ``device``, one per block of a launch whose programs
    signal a later launch's programs block by block (:func:`signal` / :func:`wait_for`); same rules as the
    arrival counter (module docstring), and every user leaves them zero again."""
    return _zeroed(device, f"{device}/blocks", BLOCK_COUNTERS)


@triton.jit
def last_to_arrive(count_ptr, n_programs):
    """True in the one program of the launch's ``n_programs`` that takes the last ticket, which also resets the
    counter. Call it after the program's stores of its part, with every program of the launch calling it once."""
    tl.debug_barrier()  # every thread of this program has stored its part before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == n_programs - 1
    tl.store(count_ptr, 0, mask=last)  # every other program has taken its ticket: nothing races this store
    return last


@triton.jit
def signal(count_ptr):
    """This program's part is stored: add one to ``*count_ptr`` (release, after a barrier over its threads)."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait_for(count_ptr, signals):
    """Wait until ``signals`` programs have :func:`signal`-ed ``*count_ptr`` (acquire: their stores are visible to
    every thread of this program after it). The signalling programs must already be running or done (a launch that
    may start before them must not wait on them: it would hold their place on the GPU); whoever resets the counter
    must run after every waiter has passed."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < signals:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
