"""Entry points for benchmarks, the tuner and host-cost tools, shared by the kernel packages (each package has its
own too: :mod:`kernels_triton.gdn.bench_api`, :mod:`kernels_triton.moe.bench_api`). Not for model code.

- :func:`jit_launches`: every launch through Triton's JIT instead of the direct launcher (what it saves).
- :func:`launches_stubbed`: every launch a no-op that reports itself (the wrappers' host cost alone).
- Tuned config files: :func:`device_slug`, :func:`shipped_config_dir`, :func:`user_config_dir`,
  :func:`clear_config_cache` (forget loaded files and every choice made from them), :func:`heuristics_only` (every op
  on its own rule, whatever the files say), :func:`read_config_file` (a file as the loader would take it, or why
  not), :func:`config_sources` (the files behind an op on a device), :data:`OP_CONFIG_FILES`.
- Device limits a search space is pruned by: :func:`device_limits`, :data:`SM90_LIMITS` (a plan without a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from kernels_triton import _config, _launch
from kernels_triton._config import (
    OP_CONFIG_FILES,
    SM90_LIMITS,
    DeviceLimits,
    declared_hash,
    device_limits,
    device_slug,
    search_space_hash,
    triton_minor,
)

__all__ = ["OP_CONFIG_FILES", "SM90_LIMITS", "DeviceLimits", "clear_config_cache", "config_sources", "declared_hash",
           "device_limits", "device_slug", "heuristics_only", "jit_launches", "launches_stubbed", "read_config_file",
           "search_space_hash", "shipped_config_dir", "triton_minor", "user_config_dir"]


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


@contextlib.contextmanager
def heuristics_only() -> Iterator[None]:
    """Inside: every lookup of a tuned config returns None, so each op launches with its documented heuristic (the
    tuner's baseline); the loader's caches are cleared on the way in and out."""
    before = _config.set_heuristics_only(True)
    _config.clear_cache()
    try:
        yield
    finally:
        _config.set_heuristics_only(before)
        _config.clear_cache()


def read_config_file(path: Path, device_name: str, op: str) -> tuple[dict | None, str | None]:
    """(data, None) when the loader would use the file at ``path`` for ``op`` on ``device_name``, else (None, why
    not): unreadable, malformed, another device, Triton minor version or search space."""
    return _config.read_file(path, device_slug(device_name), op)


def config_sources(op: str, device_name: str) -> list[str]:
    """The tuned-config files (paths) behind op-table op ``op`` on ``device_name``, user directory and package
    data; empty when the op takes no tuned config or none is there (its heuristic decides)."""
    import kernels_triton  # noqa: F401 - the kernels declare their search spaces at import: files are checked

    return [path for name in OP_CONFIG_FILES.get(op, ()) for path in _config.sources(name, device_name)]
