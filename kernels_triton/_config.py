"""Per-device tuned kernel configs: lookup in the JSON files ``qwen35-tune`` writes.

Files are read from the package's own ``kernels_triton/configs/<device-slug>/<op>.json`` (package data) and from the
user's directory ``$QWEN35_CONFIG_DIR/<device-slug>/<op>.json`` (default ``~/.cache/qwen35/configs``), once, at the
first lookup of an op; the two are merged by shape key and the user's file wins for every shape it has. Format::

    {"device": "NVIDIA H200", "op": "moe_gate_up", "triton": "3.6.0", "search_space": "<hash>",
     "provenance": {...},
     "entries": {"<shape key>": {"<token bucket>": {"BLOCK_M": 64, ..., "num_warps": 4, "num_stages": 3}}}}

``<shape key>`` is written by the op (e.g. ``"E=256,N=1024,K=2048,dtype=bfloat16"``); token buckets are integers as
strings, and a lookup takes the bucket nearest in log-space. An entry ``{"heuristic": true, ...}`` says that the
tuner found nothing faster than the op's own rule at that bucket: the lookup returns None there. Entries may carry
more keys (what was measured: ``tuned_ms``, ``heuristic_ms``, ...); callers pick their fields.

A file is used only when it is a JSON object whose ``entries`` map shape keys to objects of bucket objects, and, for
each of these fields that it has: ``device`` names this device (by slug), ``triton`` has the running Triton's major
and minor version, ``search_space`` equals the hash the kernel declares for the op (:func:`declare_search_space`).
Any other file gives one WARNING naming the file and why, and is skipped: the other directory's file or the op's
heuristic decides. Files without the optional fields (hand-written ones) load. A missing file or key returns None and
the op falls back to its documented heuristic (one INFO line). Lookups never tune.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
from pathlib import Path
from typing import NamedTuple

import torch

from qwen35 import knobs as qwen35_knobs

log = logging.getLogger("qwen35.kernels_triton")
SHIPPED_DIR = Path(__file__).resolve().parent / "configs"
# Config files each op of the op table reads (the ops not listed take no tuned config: fixed launch rules).
OP_CONFIG_FILES: dict[str, tuple[str, ...]] = {
    "gdn_chunk_prefill": ("gdn_chunk_scan",),
    "gdn_recurrent_step": ("gdn_recurrent_step",),
    "moe_experts": ("moe_gate_up", "moe_down"),
    "moe_block": ("moe_gate_up", "moe_down"),
}


@functools.cache
def device_facts(device: torch.device) -> tuple[str, int, tuple[int, int]]:
    """(name, multiprocessor count, capability); cached: asking the driver costs host time on every call."""
    if device.type != "cuda":
        return "cpu", 1, (0, 0)
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count, (props.major, props.minor)


def device_slug(name: str) -> str:
    """A device name as a file-system-safe directory name: lower case, every run of other characters than letters
    and digits one ``_``, none at either end ('NVIDIA H200' -> 'nvidia_h200', 'Tesla V100-SXM2-32GB' ->
    'tesla_v100_sxm2_32gb'); 'unknown' for a name without letters or digits."""
    return re.sub(r"[^a-z0-9]+", "_", name.strip().lower()).strip("_") or "unknown"


class DeviceLimits(NamedTuple):
    """What a launch config must fit on a device; None: not limited (the CPU interpreter)."""

    shared_memory: int | None  # bytes per block (the opt-in maximum)
    registers: int | None  # 32-bit registers per block
    max_threads: int | None  # threads per block
    capability: tuple[int, int] | None  # None on the CPU interpreter (no GPU compiler, no miscompiles)


# An sm_90 device with 227 KB of shared memory per block (the H200): the limits a plan uses without a GPU.
SM90_LIMITS = DeviceLimits(shared_memory=232_448, registers=65_536, max_threads=1024, capability=(9, 0))


def device_limits(device: torch.device) -> DeviceLimits:
    if device.type != "cuda":
        return DeviceLimits(None, None, None, None)
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)
    regs = getattr(props, "regs_per_block", None) or getattr(props, "regs_per_multiprocessor", None)
    threads = getattr(props, "max_threads_per_block", None) or 1024
    return DeviceLimits(smem, regs, threads, (props.major, props.minor))


def user_dir() -> Path:
    """The user's config directory: ``QWEN35_CONFIG_DIR``, default ``~/.cache/qwen35/configs``."""
    return Path(qwen35_knobs.get("QWEN35_CONFIG_DIR")).expanduser()


def _search_dirs() -> list[Path]:
    """Lowest priority first: a later directory's entries replace an earlier one's, shape by shape."""
    return [SHIPPED_DIR, user_dir()]


# ----------------------------------------------------------------------------- search spaces and versions

_SPACE_HASHES: dict[str, str] = {}


def search_space_hash(space: object) -> str:
    """A short stable hash of a search-space declaration (any JSON-able value)."""
    text = json.dumps(space, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def declare_search_space(ops: tuple[str, ...], space: object) -> str:
    """Record the search space of the configs in files ``ops`` (called where the kernel declares it); a file
    written for another space is not used. Returns its hash."""
    digest = search_space_hash(space)
    for op in ops:
        _SPACE_HASHES[op] = digest
    return digest


def declared_hash(op: str) -> str | None:
    return _SPACE_HASHES.get(op)


def triton_minor(version: str | None = None) -> str | None:
    """'3.6.0' -> '3.6' (the running Triton's when ``version`` is None; None without Triton)."""
    if version is None:
        try:
            import triton

            version = triton.__version__
        except ImportError:
            return None
    parts = str(version).split(".")
    return ".".join(parts[:2])


def check_file(data: object, slug: str, op: str) -> str | None:
    """Why a loaded file cannot be used for ``op`` on the device ``slug``, or None (see the module docstring)."""
    if not isinstance(data, dict):
        return "not a JSON object"
    entries = data.get("entries")
    if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and all(isinstance(b, str) and b.isdigit() and isinstance(v, dict)
                                        for b, v in e.items()) for e in entries.values()):
        return "'entries' is not an object of shape keys -> {token bucket: config}"
    if data.get("op") not in (None, op):
        return f"it is for op {data['op']!r}"
    if data.get("device") is not None and device_slug(str(data["device"])) != slug:
        return f"it is for device {data['device']!r}"
    running = triton_minor()
    if data.get("triton") is not None and running is not None and triton_minor(data["triton"]) != running:
        return f"it was tuned with Triton {data['triton']}, this is Triton {running}"
    want = declared_hash(op)
    if data.get("search_space") is not None and want is not None and data["search_space"] != want:
        return f"its search space {data['search_space']} is not the kernel's ({want}): tuned for other code"
    return None


def read_file(path: Path, slug: str, op: str) -> tuple[dict | None, str | None]:
    """(the file's data, None) if it can be used, else (None, why not)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__}: {str(e)[:120]})"
    why = check_file(data, slug, op)
    return (None, why) if why else (data, None)


@functools.cache
def _load(slug: str, op: str) -> dict:
    """{"entries": merged entries, "files": {shape key: the file it came from}, "used": files read}."""
    entries: dict[str, dict] = {}
    files: dict[str, str] = {}
    used: list[str] = []
    for d in _search_dirs():
        path = d / slug / f"{op}.json"
        if not path.is_file():
            continue
        data, why = read_file(path, slug, op)
        if data is None:
            log.warning("qwen35: ignoring tuned config %s: %s; the %s heuristic decides where no other file does",
                        path, why, op)
            continue
        used.append(str(path))
        for key, buckets in data["entries"].items():
            entries[key] = buckets
            files[key] = str(path)
    return {"entries": entries, "files": files, "used": used}


_WARNED: set[tuple[str, str, str]] = set()
_HEURISTICS_ONLY = [False]


def lookup(op: str, device_name: str, shape_key: str, tokens: int | None = None,
           fields: tuple[str, ...] | None = None) -> dict | None:
    """The tuned config for (op, device, shape) at ``tokens``, or None (and one INFO line) if absent.

    ``fields``: keep only these keys (a tuned entry also records what was measured, e.g. its time).
    """
    found = _lookup(op, device_name, shape_key, tokens)
    if found is None or fields is None:
        return found
    return {k: v for k, v in found.items() if k in fields}


def _lookup(op: str, device_name: str, shape_key: str, tokens: int | None) -> dict | None:
    if _HEURISTICS_ONLY[0]:
        return None
    entry = _load(device_slug(device_name), op)["entries"].get(shape_key)
    if not entry:
        tag = (op, device_name, shape_key)
        if tag not in _WARNED:
            _WARNED.add(tag)
            log.info("qwen35: no tuned %s config for %s on %s; using the heuristic", op, shape_key, device_name)
        return None
    if tokens is None or len(entry) == 1:
        found = next(iter(entry.values()))
    else:
        target = math.log(max(tokens, 1))
        found = entry[min(entry, key=lambda b: abs(math.log(max(int(b), 1)) - target))]
    return None if found.get("heuristic") else found


def sources(op: str, device_name: str) -> list[str]:
    """The files (paths) whose entries ``op``'s lookups on ``device_name`` use; empty: the heuristic alone."""
    return list(_load(device_slug(device_name), op)["used"])


def set_heuristics_only(on: bool) -> bool:
    """Lookups return None (every op takes its heuristic) while on; returns the previous setting. The caller
    clears the caches (:func:`clear_cache`) around a change."""
    before = _HEURISTICS_ONLY[0]
    _HEURISTICS_ONLY[0] = bool(on)
    return before


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
