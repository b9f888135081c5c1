"""Every ``QWEN35_*`` environment switch, with its default and meaning, in one table.

Code reads a switch through :func:`get` (or :func:`on` for ``0``/``1`` switches), never through
``os.environ`` directly, so that the table below is the whole list. ``qwen35-probe`` prints the active
ones, and :func:`warn_unknown` logs one WARNING for a ``QWEN35_*`` variable that is not in the table
(a misspelt switch would otherwise do nothing, silently).

This module imports only the standard library: the kernel packages read their switches through it
too, as the one exception to "kernels import only torch, triton and numpy".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("qwen35")

PREFIX = "QWEN35_"


@dataclass(frozen=True)
class Knob:
    """One switch. ``choices``: the accepted values (None: free text); ``family``: the name is a prefix
    (``QWEN35_BACKEND_<OP>``), and any variable that starts with it belongs to this knob."""

    name: str
    default: str | None
    meaning: str
    choices: tuple[str, ...] | None = None
    family: bool = False


BOOL = ("0", "1")

KNOBS: tuple[Knob, ...] = (
    # -- backend choice (qwen35.probe)
    Knob("QWEN35_BACKEND", None, "force one backend for every op that it defines (reference, triton, cuda_sm70, "
         "ixformer, ...); a forced backend that cannot run or fails its self-test raises"),
    Knob("QWEN35_BACKEND_", None, "QWEN35_BACKEND_<OP>=<backend>: force the backend of one op "
         "(e.g. QWEN35_BACKEND_MOE_BLOCK=reference); wins over QWEN35_BACKEND", family=True),
    Knob("QWEN35_REQUIRE_ACCELERATED", "0", "1: a model host on an accelerator (GPU) refuses to start "
         "(RuntimeError) when an op the model calls would run on the reference backend; 0 logs one ERROR naming "
         "those ops and why instead", BOOL),
    # -- façade checks (qwen35._checks)
    Knob("QWEN35_CHECK_VALUES", "1", "read tensor values in the façade's input checks (slots, offsets, expert "
         "ids); 0 skips them (each is a device synchronisation on a GPU)", BOOL),
    # -- kernels
    Knob("QWEN35_CONFIG_DIR", "~/.cache/qwen35/configs", "directory of user-tuned kernel configs "
         "(<dir>/<device>/<op>.json); a file there replaces the one shipped in kernels_triton/configs"),
    Knob("QWEN35_DIRECT_LAUNCH", "1", "launch Triton kernels through the cached direct launcher; 0 uses "
         "Triton's own launch path (profilers that hook launches)", BOOL),
    Knob("QWEN35_GDN_PDL", None, "GDN decode step with programmatic dependent launch on sm_90+ "
         "(unset: on; 0 off, for profilers or drivers that mishandle PDL; 1 on)", BOOL),
    Knob("QWEN35_MOE_PDL", None, "MoE launches with programmatic dependent launch on sm_90+ "
         "(unset: the size rule of kernels_triton/moe/pdl.py; 0 never, for profilers or drivers that mishandle PDL; "
         "1 at every size, the one-token path included)", BOOL),
    Knob("QWEN35_MOE_DECODE", "1", "one token takes the MoE decode path (three GEMV launches); 0 sends it through "
         "the general pipeline, a way around that path (its output differs from the pipeline's in the last bits)",
         BOOL),
    Knob("QWEN35_CUDA_ARCH", None, "target of the cuda_sm70 JIT build (e.g. sm_70, compute_75); "
         "unset: from the device and the toolkit"),
    Knob("QWEN35_CUDA_COMPILER", None, "compiler of the cuda_sm70 JIT build: a path to nvcc or CoreX's clang++ "
         "(unset: CUDA_HOME's nvcc, nvcc on PATH, /usr/local/cuda, then CoreX's clang++)"),
    Knob("QWEN35_CUDA_CACHE", None, "build cache of the cuda_sm70 extension, one directory per sources x arch x "
         "toolkit (unset: ~/.cache/qwen35/cuda_sm70)"),
    Knob("QWEN35_COREX_ARCH", "ivcore10", "--cuda-gpu-arch of a CoreX clang++ build of cuda_sm70 (ivcore10: "
         "BI-V100; ivcore11: BI-V150, MR-V100)"),
    # -- weights (qwen35.checkpoint)
    Knob("QWEN35_FP16_OVERFLOW", "warn", "checkpoint values beyond fp16's range (|x| > 65504) loaded into a float16 "
         "model: warn (one WARNING naming the tensors; the values saturate to +-65504) or error (CheckpointError)",
         ("warn", "error")),
    # -- serving and set-up (serve.*, scripts/bootstrap.sh)
    Knob("QWEN35_CACHE_DIR", None, "where the embedded default checkpoint is built "
         "(unset: ~/.cache/qwen35)"),
    Knob("QWEN35_VENV", ".venv", "the virtual environment that ./run.sh and ./test.sh create and use"),
)

_BY_NAME = {k.name: k for k in KNOBS}
_WARNED: set[str] = set()


def knob(name: str) -> Knob:
    """The table row for ``name`` (a family's member names its family's row); KeyError if undeclared."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    for k in KNOBS:
        if k.family and name.startswith(k.name) and len(name) > len(k.name):
            return k
    raise KeyError(f"{name} is not a qwen35 switch; known: {', '.join(known_names())}")


def get(name: str) -> str | None:
    """The switch's value: the environment's, else its default. A value outside the knob's choices raises
    ValueError naming the variable, the value and the accepted ones."""
    k = knob(name)
    value = os.environ.get(name)
    if value is None or value == "":
        return k.default
    if k.choices is not None and value not in k.choices:
        raise ValueError(f"{name}={value!r} is not accepted; use one of {', '.join(k.choices)}")
    return value


def on(name: str) -> bool | None:
    """A ``0``/``1`` switch as a bool; None when it is unset and has no default."""
    value = get(name)
    return None if value is None else value == "1"


def known_names() -> list[str]:
    return [k.name + "<OP>" if k.family else k.name for k in KNOBS]


def active() -> dict[str, str]:
    """The declared switches set in the environment: {name: value}."""
    out = {}
    for name, value in sorted(os.environ.items()):
        if name.startswith(PREFIX):
            try:
                knob(name)
            except KeyError:
                continue
            out[name] = value
    return out


def unknown() -> list[str]:
    """``QWEN35_*`` variables in the environment that no knob declares."""
    out = []
    for name in sorted(os.environ):
        if name.startswith(PREFIX):
            try:
                knob(name)
            except KeyError:
                out.append(name)
    return out


def warn_unknown() -> list[str]:
    """One WARNING per process for each undeclared ``QWEN35_*`` variable; returns them."""
    names = [n for n in unknown() if n not in _WARNED]
    if names:
        _WARNED.update(names)
        log.warning("qwen35: unknown switch%s %s (ignored); known: %s", "es" if len(names) > 1 else "",
                    ", ".join(names), ", ".join(known_names()))
    return names
