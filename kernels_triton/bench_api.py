"""Entry points for benchmarks, the tuner and host-cost tools, shared by the kernel packages (each package has its
own too: :mod:`kernels_triton.gdn.bench_api`, :mod:`kernels_triton.moe.bench_api`). Not for model code.

- :func:`jit_launches`: every launch through Triton's JIT instead of the direct launcher (what it saves).
- :func:`launches_stubbed`: every launch a no-op that reports itself (the wrappers' host cost alone).
- Tuned config files: :func:`device_slug`, :func:`shipped_config_dir`, :func:`user_config_dir`,
  :func:`clear_config_cache` (forget loaded files and every choice made from them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from kernels_triton import _config, _launch
from kernels_triton._config import device_slug

__all__ = ["clear_config_cache", "device_slug", "jit_launches", "launches_stubbed", "shipped_config_dir",
           "user_config_dir"]


@contextlib.contextmanager
def jit_launches() -> Iterator[None]:
    """Inside: every kernel launch goes through ``JITFunction.run`` (the direct launcher off), as
    ``QWEN35_DIRECT_LAUNCH=0`` does for a whole process."""
    before = _launch.set_enabled(False)
    try:
        yield
    finally:
        _launch.set_enabled(before)


@contextlib.contextmanager
def launches_stubbed(on_launch: Callable[[str], None] = lambda kind: None) -> Iterator[None]:
    """Inside: no kernel runs; each launch calls ``on_launch("direct")`` (through the direct launcher) or
    ``on_launch("jit")`` (through ``JITFunction.run``) instead. What is left of a call is its host-side work:
    argument checks, plans, allocations, views. Not thread-safe (it replaces the two launch methods)."""
    from triton.runtime.jit import JITFunction

    direct, jit = _launch.DirectLauncher.__call__, JITFunction.run
    _launch.DirectLauncher.__call__ = lambda self, grid, args, options, stream=None: on_launch("direct")
    JITFunction.run = lambda self, *args, grid, warmup, **kw: on_launch("jit")
    try:
        yield
    finally:
        _launch.DirectLauncher.__call__, JITFunction.run = direct, jit


def shipped_config_dir() -> Path:
    """The tuned configs that ship with the package: ``<dir>/<device slug>/<op>.json``."""
    return _config.SHIPPED_DIR


def user_config_dir() -> Path:
    """Where user-tuned configs are read from (``QWEN35_CONFIG_DIR``, default ``~/.cache/qwen35/configs``); its
    files win over the shipped ones."""
    return _config.user_dir()


def clear_config_cache() -> None:
    """Forget the loaded config files and every launch choice made from them (after writing or moving files)."""
    _config.clear_cache()
