"""Programmatic dependent launch (PDL, sm_90+): the pieces every kernel family shares.

A launch with PDL may start while the launch before it on the stream is still running; its programs first wait
for that launch to finish (``griddepcontrol.wait``: its results complete and visible), then let the next launch
start (``griddepcontrol.launch_dependents``). Each launch's start-up (scheduling its programs, their prologue)
thus overlaps its predecessor's tail. A kernel launched this way waits before it reads or writes anything a launch
before it touches (:func:`enter` as its first statement). Captured into CUDA graphs as programmatic edges.
Users: :mod:`kernels_triton.moe.pdl` (the MoE block's launches) and the GDN decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels_triton._config import device_facts


def supported(device: torch.device) -> bool:
    """Whether launches on ``device`` can use PDL (a CUDA device of compute capability 9.0 or newer)."""
    return device.type == "cuda" and device_facts(device)[2] >= (9, 0)


def options(on: bool) -> dict:
    """Launch options: ``launch_pdl`` when on (a compile option: the kernel must then wait as :func:`enter` does)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """First thing a kernel launched with PDL does: wait for the launch before it, then let the next one start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """Let the next launch start now, for a kernel launched with PDL that waits for the launch before it on its own
    terms (finer-grained flags that launch's programs set) instead of by :func:`enter`."""
    if PDL:
        gdc_launch_dependents()
