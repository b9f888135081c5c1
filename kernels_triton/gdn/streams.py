"""Streams and events of a prefill scanned in parts, through the CUDA driver's own calls (ctypes on ``libcuda``).

torch's Python wrappers add a few µs to each event record and stream wait, and a call in parts makes up to three
per part; the driver calls take the runtime's stream and event handles, which the driver shares. Events are raw
handles made once per thread and device and reused: a wait takes the event's state when it is enqueued, so
recording it again later, also in a later call, does not touch waits already enqueued. Per thread: calls from two
threads at once must not re-record each other's events between a record and its wait.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

_side: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_thread = threading.local()  # .events: device index -> raw event handles


@functools.cache
def driver() -> ctypes.CDLL | None:
    """The driver library with the event calls' argument types set, or None where there is no such driver (a HIP
    build, a runtime without ``libcuda``): calls then run in one part."""
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


def _check(rc: int) -> None:
    if rc:
        raise RuntimeError(f"CUDA driver error {rc} ordering the parts of a segmented GDN scan")


def record(event: int, stream: int) -> None:
    """Record raw event ``event`` on raw stream ``stream``."""
    _check(driver().cuEventRecord(event, stream))


def wait(stream: int, event: int) -> None:
    """Make raw stream ``stream`` wait for raw event ``event`` (a fork or a join, also under CUDA-graph capture)."""
    _check(driver().cuStreamWaitEvent(stream, event, 0))


def side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The streams of a scan's parts, one pair per device: (scan, prepare). The scan's at the highest priority, so
    that a scan part's programs take free SM slots before pending prepare / output programs do."""
    streams = _side.get(device.index)
    if streams is None:
        streams = _side[device.index] = (torch.cuda.Stream(device, priority=-100), torch.cuda.Stream(device))
    return streams


def event(device: int, i: int) -> int:
    """The i-th of this thread's reusable events on device ``device``, a raw handle."""
    if not hasattr(_thread, "events"):
        _thread.events = {}
    events = _thread.events.setdefault(device, [])
    while len(events) <= i:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):  # the device's primary context, current for the driver call
            _check(driver().cuEventCreate(ctypes.byref(handle), 2))  # CU_EVENT_DISABLE_TIMING
        events.append(handle.value)
    return events[i]
