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


def arrival_counter(device: torch.device) -> torch.Tensor:
    """This thread's zeroed int32 counter on ``device`` for :func:`last_to_arrive` (see the module docstring)."""
    mine = counters()
    key = str(device)
    counter = mine.get(key)
    if counter is not None:
        return counter
    counter = torch.zeros(4, dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return counter
    mine[key] = counter
    return counter


@triton.jit
def last_to_arrive(count_ptr, n_programs):
    """True in the one program of the launch's ``n_programs`` that takes the last ticket, which also resets the
    counter. Call it after the program's stores of its part, with every program of the launch calling it once."""
    tl.debug_barrier()  # every thread of this program has stored its part before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == n_programs - 1
    tl.store(count_ptr, 0, mask=last)  # every other program has taken its ticket: nothing races this store
    return last
