"""Per-device tuned kernel configs: lookup in the JSON files the tuner writes.

Files are read from the user's directory ``$QWEN35_CONFIG_DIR/<device-slug>/<op>.json`` (default
``~/.cache/qwen35/configs``) first, then from the package's own ``kernels_triton/configs/<device-slug>/<op>.json``
(package data): a user's file for an op replaces the shipped one. Format::

    {"device": "NVIDIA H200", "op": "moe_gemm", "triton": "3.6.0",
     "entries": {"<shape key>": {"<token bucket>": {"BLOCK_M": 64, ..., "num_warps": 4, "num_stages": 3}}}}

``<shape key>`` is written by the op (e.g. ``"E=256,N=1024,K=2048,dtype=bfloat16"``); token
buckets are integers as strings, and a lookup takes the bucket nearest in log-space. A missing
file or key returns ``None`` and the op falls back to its documented heuristic (logged once).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from pathlib import Path

import torch

from qwen35 import knobs as qwen35_knobs

log = logging.getLogger("qwen35.kernels_triton")
SHIPPED_DIR = Path(__file__).resolve().parent / "configs"


@functools.cache
def device_facts(device: torch.device) -> tuple[str, int, tuple[int, int]]:
    """(name, multiprocessor count, capability); cached: asking the driver costs host time on every call."""
    if device.type != "cuda":
        return "cpu", 1, (0, 0)
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count, (props.major, props.minor)


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200' (file-system safe)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def user_dir() -> Path:
    """The user's config directory: ``QWEN35_CONFIG_DIR``, default ``~/.cache/qwen35/configs``."""
    return Path(qwen35_knobs.get("QWEN35_CONFIG_DIR")).expanduser()


def _search_dirs() -> list[Path]:
    return [user_dir(), SHIPPED_DIR]


@functools.cache
def _load(slug: str, op: str) -> dict | None:
    for d in _search_dirs():
        path = d / slug / f"{op}.json"
        if path.is_file():
            with open(path) as f:
                return json.load(f)
    return None


_WARNED: set[tuple[str, str, str]] = set()


def lookup(op: str, device_name: str, shape_key: str, tokens: int | None = None,
           fields: tuple[str, ...] | None = None) -> dict | None:
    """The tuned config for (op, device, shape) at ``tokens``, or None (and one INFO line) if absent.

    ``fields``: keep only these keys (a tuned entry may also record what was measured, e.g. its time).
    """
    found = _lookup(op, device_name, shape_key, tokens)
    if found is None or fields is None:
        return found
    return {k: v for k, v in found.items() if k in fields}


def _lookup(op: str, device_name: str, shape_key: str, tokens: int | None) -> dict | None:
    data = _load(device_slug(device_name), op)
    entry = (data or {}).get("entries", {}).get(shape_key)
    if not entry:
        tag = (op, device_name, shape_key)
        if tag not in _WARNED:
            _WARNED.add(tag)
            log.info("qwen35: no tuned %s config for %s on %s; using the heuristic", op, shape_key, device_name)
        return None
    if tokens is None or len(entry) == 1:
        return next(iter(entry.values()))
    target = math.log(max(tokens, 1))
    best = min(entry, key=lambda b: abs(math.log(max(int(b), 1)) - target))
    return entry[best]


_DERIVED: list = []  # caches of launch choices made from the tuned files


def derived(fn):  # noqa: ANN001, ANN201 - a functools cache
    """Register a cached function whose results come from tuned files: :func:`clear_cache` clears it too."""
    _DERIVED.append(fn)
    return fn


def clear_cache() -> None:
    """Forget the loaded files (e.g. after ``QWEN35_CONFIG_DIR`` changed) and every choice made from them."""
    _load.cache_clear()
    _WARNED.clear()
    for fn in _DERIVED:
        fn.cache_clear()
