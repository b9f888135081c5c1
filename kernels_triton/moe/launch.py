"""Launching the MoE kernels without Triton's per-call argument binding, once a call has compiled them.

``kernel[grid](...)`` goes through ``JITFunction.run``: it binds and specializes every argument,
builds the cache key, builds launch metadata and calls the (empty) launch hooks, on every launch.
On the H200 VM that is tens of µs per launch: a ``moe_block`` call of 5-6 launches cost 190-340 µs
of host time, more than its GPU time up to M ~ 1024 tokens.

:class:`DirectLauncher` remembers the compiled kernel a call got and launches it directly when a
later call's arguments specialize the same way. Triton 3.x specializes an int argument on being
1 and on divisibility by 16, a tensor on its dtype and 16-byte alignment; the key here is stricter
(the exact int values), so a hit can never pick a kernel compiled for another specialization.
Anything else takes the ordinary path: a miss (which also records the kernel), tensors not on a
CUDA device (the interpreter), launch hooks installed (profilers), or ``QWEN35_MOE_DIRECT_LAUNCH=0``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from triton import knobs
from triton.runtime import driver

ENABLED = os.environ.get("QWEN35_MOE_DIRECT_LAUNCH", "1") != "0"
MAX_ENTRIES = 4096  # per kernel; the cache is dropped when it grows past this (many distinct token counts)


def _no_hooks() -> bool:
    rt = knobs.runtime
    return all(h is None or not getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


class DirectLauncher:
    """``DirectLauncher(kernel)[grid](*args, **constexprs_and_options)``, same call as ``kernel[grid](...)``."""

    def __init__(self, kernel) -> None:  # noqa: ANN001 - a triton JITFunction
        self.kernel = kernel
        self.names = tuple(kernel.arg_names)
        self.compiled: dict = {}
        self.hits = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        """Constexprs and options, exact ints, (dtype, address mod 16) per tensor, device; None: not launchable here.

        One flat tuple, built in one pass: this runs on every launch. Each call site passes the same
        kinds of arguments in the same positions, so positions need no type tags.
        """
        key = [tuple(kwargs.items())]
        append = key.append
        first = None
        for a in args:
            if type(a) is int:
                append(a)
            elif isinstance(a, torch.Tensor):
                append(a.dtype)
                append(a.data_ptr() & 15)
                if first is None:
                    first = a
            else:
                return None
        if first is None or not first.is_cuda:
            return None
        append(first.get_device())
        return tuple(key)

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        key = self._key(args, kwargs) if ENABLED and _no_hooks() else None
        hit = self.compiled.get(key) if key is not None else None
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and compiled is not None and not hasattr(compiled, "result"):
                if len(self.compiled) >= MAX_ENTRIES:
                    self.compiled.clear()
                # the constexpr values, in signature order after the positional arguments (the launcher skips them)
                tail = tuple(kwargs[name] for name in self.names[len(args):])
                self.compiled[key] = (compiled, tail)
            return
        self.hits += 1
        compiled, tail = hit
        grid = (*grid, 1, 1)
        stream = driver.active.get_current_stream(driver.active.get_current_device())  # as JITFunction.run does
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *tail)
