"""Capability probe: what this device can run, and which backend each op uses, with the reason.

Run once per device and activation dtype at first use and cached. For every op it walks the policy list for
the device's platform (below), skips backends that cannot import, cannot run here, lack the op or do not
compute the dtype, builds the first remaining one where it needs a build (:func:`_prepare`), and checks it
numerically on a tiny input against the fp64 reference (:mod:`qwen35.selftest`). A backend whose build or
check fails is skipped with a WARNING that says what failed (the compiler's first error lines; by how much);
``reference`` ends every list and needs no check.

Dtype. The façade asks for the op and the dtype of the call's activations (:func:`implementation`), so a
backend that declares the dtypes it computes (``DTYPES`` in its module) is passed over for others: a bf16
model on a V100 gets the next backend of the policy with the reason "cuda_sm70 computes fp16/fp32, not bf16"
instead of a ``ValueError`` at its first call (the standalone host's ``dtype="auto"`` picks fp16 there:
``DeviceCaps.compute_dtype``).
Without a dtype (:func:`report`, ``qwen35-probe``, the hosts' start-up report) the choice is the one for the
device's default compute dtype (bf16 where the device computes it, else fp16; fp32 on the CPU), except that a
forced backend which does not compute that dtype is self-tested in fp16, the dtype it runs in there (so a
forced ``cuda_sm70`` on an H200 is checked in fp16, not refused for bf16).

Builds. A backend module may define ``prepare(device)``, which ``cuda_sm70`` uses to JIT-build its
extension (:func:`kernels_cuda.sm70.prepare`). It runs once per backend and device, before the first
self-test; a failure (no nvcc, no ninja, a compile error) is one WARNING quoting the error, and every op
passes to the next backend. ``qwen35-probe --build`` runs the build ahead of serving and prints its facts.

Overrides (read at selection time; :func:`reset` forgets earlier choices):

- ``QWEN35_BACKEND=<name>``: every op uses that backend where it defines the op (others follow
  the policy, saying so).
- ``QWEN35_BACKEND_<OP>=<name>`` (e.g. ``QWEN35_BACKEND_MOE_BLOCK=reference``): that op uses it.

A forced backend that cannot import, cannot run here, does not compute the call's dtype, fails its build or
fails its self-test raises ``RuntimeError``: an explicit request is never silently replaced.

Capture. A choice runs self-tests (kernel launches, host reads), which a CUDA graph being captured cannot hold:
:func:`choose` raises ``RuntimeError`` instead of choosing while the current stream captures. Hosts choose at load
(:func:`choose_at_load`) for every op their model calls, in every dtype it calls them with, so that a capture only
ever finds cached choices; the same call logs one ERROR, or raises under ``QWEN35_REQUIRE_ACCELERATED=1``, when an
op of the model would run on the reference on an accelerator (slow, and its host reads break capture).

Switches are read through :mod:`qwen35.knobs`. The first choice a process makes logs one WARNING for any
``QWEN35_*`` variable that no knob declares (a misspelt switch would otherwise do nothing), and the report
(``qwen35-probe``, text or ``--json``) lists the switches that are set.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field

import torch

from qwen35 import backends, knobs, optable, selftest

log = logging.getLogger("qwen35.probe")

# Platform -> backends to try, in order. Why this order:
# - sm80+ NVIDIA: Triton compiles to tensor cores with bf16; our CUDA path is SM70-only. ``flashqla`` (the GDN
#   prefill only) comes first: it is there only with the optional extra on sm90/sm100 and a crossover table that
#   gives it batches (its availability says why not otherwise), and it hands every other batch to triton.
# - sm70/sm75 NVIDIA: the SM70 CUDA path is written for exactly these (fp16, no bf16);
#   Triton also runs there in fp16 and backs it up.
# - Iluvatar CoreX: the vendor library first where it has the op, then the SM70 CUDA path
#   (CoreX compiles CUDA; it reports capability 7.0), then Triton.
# - CPU: only the reference (Triton runs on CPU only under TRITON_INTERPRET=1, for tests).
POLICY: dict[str, tuple[str, ...]] = {
    "nvidia-sm80+": ("flashqla", "triton", "reference"),
    "nvidia-sm70": ("cuda_sm70", "triton", "reference"),
    "iluvatar": ("ixformer", "cuda_sm70", "triton", "reference"),
    "cpu": ("reference",),
}

# ixformer's publicly seen calls (all fp16; no MoE, top-k, GDN or conv op): the probe reports which are present.
# kernels_cuda.ixformer routes the façade ops that map onto them; the rest go to cuda_sm70.
IXFORMER_FUNCTIONS = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "matmul",
    "softmax",
    "flash_attn_func",
    "gemv",
)
IXFORMER_MODULES = ("ixformer.inference.functions", "ixformer.functions", "ixformer")  # where to look, in order


@dataclass(frozen=True)
class DeviceCaps:
    device: str
    vendor: str  # "nvidia" | "iluvatar" | "cpu"
    name: str
    capability: tuple[int, int] | None = None
    bf16: bool = False
    shared_mem_per_block: int | None = None
    warp_size: int | None = None
    triton_version: str | None = None
    triton_runs: bool = False
    triton_note: str = ""
    nvcc: str | None = None
    corex_clang: str | None = None
    ninja: str | None = None
    ixformer_version: str | None = None
    ixformer_functions: tuple[str, ...] = ()

    @property
    def platform(self) -> str:
        if self.vendor == "cpu":
            return "cpu"
        if self.vendor == "iluvatar":
            return "iluvatar"
        return "nvidia-sm80+" if (self.capability or (0, 0)) >= (8, 0) else "nvidia-sm70"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The device's default activation dtype: bf16 where the device computes it, else fp16 (sm70/sm75,
        Iluvatar); fp32 on the CPU. What a host's ``dtype="auto"`` picks, and what choices without a dtype
        are made for."""
        if self.vendor == "cpu":
            return torch.float32
        return torch.bfloat16 if self.bf16 else torch.float16


@dataclass
class Choice:
    op: str
    device: str
    backend: str
    reason: str
    selftest_rel_err: float | None = None
    rejected: list[tuple[str, str]] = field(default_factory=list)
    dtype: str | None = None  # the activation dtype the choice was made (and self-tested) for


# ----------------------------------------------------------------------------- device facts

def _device_key(device: torch.device | str | None) -> str:
    d = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if d.type == "cuda":
        return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}"
    return d.type


def _is_iluvatar(name: str) -> bool:
    tagged = any(tag in name.lower() for tag in ("iluvatar", "bi-v", "mr-v", "corex"))
    return tagged or os.path.isdir("/usr/local/corex")


def _triton_status(device: torch.device) -> tuple[str | None, bool, str]:
    """(version, runs, note): imports triton and runs a trivial kernel on ``device``."""
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - any import failure means "no Triton"
        return None, False, f"triton does not import: {type(e).__name__}: {e}"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu" and not interpret:
        return triton.__version__, False, "no GPU; Triton runs on CPU only under TRITON_INTERPRET=1"
    try:
        @triton.jit
        def _probe_add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

        x = torch.arange(100, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        _probe_add[(1,)](x, y, 100, BLOCK=128)
        if not torch.equal(y.cpu(), x.cpu() + 1):
            return triton.__version__, False, "trivial kernel ran but wrote wrong values"
    except Exception as e:  # noqa: BLE001 - compile/launch failures are what we probe for
        return triton.__version__, False, f"trivial kernel failed: {type(e).__name__}: {str(e)[:200]}"
    return triton.__version__, True, "interpreter" if device.type == "cpu" else "compiled and ran a trivial kernel"


def _nvcc_path() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.isfile(os.path.join(cand, "bin", "nvcc")):
            return os.path.join(cand, "bin", "nvcc")
    return shutil.which("nvcc")


def _ninja_path() -> str | None:
    path = shutil.which("ninja")
    if path is None and importlib.util.find_spec("ninja") is not None:
        try:
            import ninja  # the PyPI wheel ships a binary

            path = os.path.join(ninja.BIN_DIR, "ninja")
        except Exception:  # noqa: BLE001
            path = None
    return path


def _ixformer_status() -> tuple[str | None, tuple[str, ...]]:
    if importlib.util.find_spec("ixformer") is None:
        return None, ()
    try:
        ix = importlib.import_module("ixformer")
    except Exception:  # noqa: BLE001 - present but broken counts as absent; the reason shows in the table
        return None, ()
    modules = []
    for sub in IXFORMER_MODULES:
        try:
            modules.append((sub, importlib.import_module(sub)))
        except Exception:  # noqa: BLE001
            continue
    found = []
    for f in IXFORMER_FUNCTIONS:  # each call where it is first found
        where = next((sub for sub, mod in modules if callable(getattr(mod, f, None))), None)
        if where is not None:
            found.append(f"{where}.{f}")
    return getattr(ix, "__version__", "unknown"), tuple(found)


_CAPS: dict[str, DeviceCaps] = {}


def device_caps(device: torch.device | str | None = None) -> DeviceCaps:
    """Probe (once per device) vendor, name, capability, dtype support, toolchains, libraries."""
    key = _device_key(device)
    if key in _CAPS:
        return _CAPS[key]
    dev = torch.device(key)
    tv, truns, tnote = _triton_status(dev)
    nvcc, ninja = _nvcc_path(), _ninja_path()
    clang = "/usr/local/corex/bin/clang++" if os.path.isfile("/usr/local/corex/bin/clang++") else None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = props.name
        vendor = "iluvatar" if _is_iluvatar(name) else "nvidia"
        ixv, ixf = _ixformer_status()
        caps = DeviceCaps(
            device=key, vendor=vendor, name=name, capability=(props.major, props.minor),
            bf16=bool(torch.cuda.is_bf16_supported()) and props.major >= 8,
            shared_mem_per_block=getattr(props, "shared_memory_per_block_optin", None)
            or getattr(props, "shared_memory_per_block", None),
            warp_size=getattr(props, "warp_size", None),
            triton_version=tv, triton_runs=truns, triton_note=tnote,
            nvcc=nvcc, corex_clang=clang, ninja=ninja, ixformer_version=ixv, ixformer_functions=ixf)
    else:
        import platform

        caps = DeviceCaps(device=key, vendor="cpu", name=platform.processor() or platform.machine(),
                          bf16=True, triton_version=tv, triton_runs=truns, triton_note=tnote,
                          nvcc=nvcc, corex_clang=clang, ninja=ninja)
    _CAPS[key] = caps
    return caps


# ----------------------------------------------------------------------------- selection

Key = tuple[str, str, "torch.dtype | None"]  # (op, device key, activation dtype or None for the default)

_CHOICES: dict[Key, Choice] = {}
_IMPLS: dict[Key, object] = {}
_BY_DEVICE: dict[tuple[str, torch.device, torch.dtype | None], object] = {}  # by the tensor's own device
_PREPARED: dict[tuple[str, str], str | None] = {}  # (backend, device key) -> None when built, else why not


def reset() -> None:
    """Forget cached choices, builds' outcomes and device facts (after changing env overrides or the registry)."""
    _CHOICES.clear()
    _IMPLS.clear()
    _BY_DEVICE.clear()
    _PREPARED.clear()
    _CAPS.clear()


def _forced(op: str) -> tuple[str | None, str]:
    """(backend, the switch that asks for it), or (None, "") when no override names one for ``op``."""
    per_op = f"QWEN35_BACKEND_{op.upper()}"
    for switch in (per_op, "QWEN35_BACKEND"):
        name = knobs.get(switch)
        if name:
            return name, switch
    return None, ""


_SWITCHES_CHECKED = False


def _check_switches_once() -> None:
    """One WARNING per process for undeclared QWEN35_* variables, when the first choice is made."""
    global _SWITCHES_CHECKED
    if not _SWITCHES_CHECKED:
        _SWITCHES_CHECKED = True
        knobs.warn_unknown()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bf16`` (fp16, fp32, fp64 likewise; other dtypes by torch's name)."""
    short = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
    return short.get(dtype, str(dtype).replace("torch.", ""))


def selftest_dtype(dtype: torch.dtype, computes: tuple[torch.dtype, ...] | None, fallback: bool = False
                   ) -> tuple[torch.dtype | None, str]:
    """(the dtype a backend is self-tested in, a note) for a choice made for ``dtype``; (None, why not) when the
    backend does not compute ``dtype``.

    ``computes``: the backend's ``DTYPES`` (None: any). ``fallback`` (a forced backend, choice without a call's
    dtype): instead of ruling the backend out, test it in fp16 (else its first dtype), the dtype a model runs in
    on that backend.
    """
    if not computes or dtype in computes:
        return dtype, ""
    names = "/".join(dtype_name(d) for d in computes)
    if not fallback:
        return None, f"computes {names}, not {dtype_name(dtype)}"
    pick = torch.float16 if torch.float16 in computes else computes[0]
    return pick, f"tested in {dtype_name(pick)}: it computes {names}, not the device's default {dtype_name(dtype)}"


def _prepare(name: str, module: object, caps: DeviceCaps) -> str | None:
    """Run the backend's ``prepare(device)`` (its JIT build) once per device; None when it succeeded, else the
    rejection note. The first failure logs one WARNING quoting the error (the compiler's first lines)."""
    prep = getattr(module, "prepare", None)
    if not callable(prep):
        return None
    key = (name, caps.device)
    if key not in _PREPARED:
        try:
            prep(torch.device(caps.device))
            _PREPARED[key] = None
        except Exception as e:  # noqa: BLE001 - a failed build (any cause) rules the backend out, with its words
            _PREPARED[key] = f"failed its build ({type(e).__name__}: {e})"
            log.warning("qwen35: backend %s could not be built on %s; its ops go to the next backend of the "
                        "policy (or raise where it is forced): %s: %s", name, caps.device, type(e).__name__, e)
    return _PREPARED[key]


def _try(name: str, op: str, caps: DeviceCaps, dtype: torch.dtype, fallback: bool = False
         ) -> tuple[object | None, str, float | None, torch.dtype]:
    """Load ``name`` and check it for ``op`` in ``dtype`` (``fallback``: see :func:`selftest_dtype`). Returns
    (fn or None, why-not / ok note, rel err, the dtype it was tested in)."""
    try:
        module = backends.load(name)
    except Exception as e:  # noqa: BLE001 - any import failure disqualifies, with its message
        return None, f"does not import ({type(e).__name__}: {e})", None, dtype
    avail = getattr(module, "availability", None)
    why_not = avail(caps) if callable(avail) else None
    if why_not:
        return None, f"cannot run here ({why_not})", None, dtype
    fn = backends.implementation(module, op)
    if fn is None:
        return None, f"has no {op}", None, dtype
    if name == "reference":
        return fn, "reference", None, dtype
    test_dtype, dtype_note = selftest_dtype(dtype, getattr(module, "DTYPES", None), fallback)
    if test_dtype is None:
        return None, dtype_note, None, dtype
    failed = _prepare(name, module, caps)
    if failed:
        return None, failed, None, dtype
    try:
        err = selftest.check(op, fn, torch.device(caps.device), test_dtype)
    except Exception as e:  # noqa: BLE001 - a crash in the self-test is a failed self-test
        return None, f"self-test raised {type(e).__name__}: {str(e)[:300]}", None, test_dtype
    tol = selftest.tolerance(op, test_dtype)
    dt = str(test_dtype).replace("torch.", "") + (f"; {dtype_note}" if dtype_note else "")
    if not (err <= tol):  # also catches NaN
        return None, f"self-test rel err {err:.3g} > {tol:g} ({dt})", err, test_dtype
    return fn, f"self-test rel err {err:.2g} <= {tol:g} ({dt})", err, test_dtype


def is_current_stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where torch has no CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_in_capture(op: str, dev: str, dtype: torch.dtype | None) -> None:
    """Raise when a choice (self-tests: launches and host reads) would run inside a CUDA-graph capture."""
    if is_current_stream_capturing():
        what = _dname(dtype) if dtype is not None else "the device's default dtype"
        raise RuntimeError(
            f"qwen35: no backend chosen yet for {op} on {dev} ({what}) while a CUDA graph is being captured; the "
            f"probe's self-tests cannot run inside a capture. Backends are chosen at load, before capture: call "
            f"qwen35.probe.choose_at_load(device, dtype, ops) for the ops and dtypes the model calls (the model "
            f"hosts do), or run one eager step before capturing")


def choose(op: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Choice:
    """The backend ``op`` uses on ``device`` for activations of ``dtype``, chosen once and cached (see the module
    docstring).

    ``dtype`` None: the choice for the device's default compute dtype (the same choice, cached once), except
    that a forced backend which does not compute that dtype is self-tested in fp16 instead of refused.
    """
    optable.get(op)  # ValueError for unknown ops, listing the table's
    dev = _device_key(device)
    key = (op, dev, dtype)
    if key in _CHOICES:
        return _CHOICES[key]
    _check_switches_once()
    if dev not in _CAPS:
        _refuse_in_capture(op, dev, dtype)  # probing the device launches a kernel
    caps = device_caps(dev)
    if dtype is not None:
        _refuse_in_capture(op, dev, dtype)
        choice, fn = _select(op, caps, dtype, fallback=False)
        return _remember(key, choice, fn)
    default = caps.compute_dtype
    same = (op, dev, default)
    if same in _CHOICES:
        return _remember(key, _CHOICES[same], _IMPLS[same], quiet=True)
    _refuse_in_capture(op, dev, None)
    choice, fn = _select(op, caps, default, fallback=True)
    if choice.dtype == _dname(default):  # also the choice for calls in that dtype
        _remember(same, choice, fn, quiet=True)
    return _remember(key, choice, fn)


def _select(op: str, caps: DeviceCaps, dtype: torch.dtype, fallback: bool) -> tuple[Choice, object]:
    """Walk the override, then the policy, for ``op`` in ``dtype``; (the choice, its callable)."""
    dev = caps.device
    forced, source = _forced(op)
    rejected: list[tuple[str, str]] = []
    if forced:
        backends.get(forced)  # ValueError for unknown names, listing the registered ones
        fn, note, err, tested = _try(forced, op, caps, dtype, fallback)
        if fn is not None:
            return Choice(op, dev, forced, f"forced by {source}; {note}", err, dtype=_dname(tested)), fn
        if source.endswith(op.upper()) or not note.startswith("has no"):
            raise RuntimeError(f"{source}={forced} was requested for {op} on {dev} ({_dname(dtype)}), but it {note}")
        rejected.append((forced, f"{note} (requested by {source})"))
    order = POLICY[caps.platform]
    for name in order:
        if any(name == r for r, _ in rejected):
            continue
        fn, note, err, tested = _try(name, op, caps, dtype)
        if fn is None:
            rejected.append((name, note))
            if err is not None or "self-test" in note:
                log.warning("qwen35: backend %s rejected for %s on %s: %s", name, op, dev, note)
            continue
        first = not rejected
        why = f"policy {caps.platform}: {' > '.join(order)}; " + (
            "first choice" if first else "; ".join(f"{r} {w}" for r, w in rejected))
        if name != "reference":
            why += f"; {note}"
        elif caps.vendor == "cpu" and len(order) == 1:
            why = ("CPU device: policy 'cpu' lists only the reference (GPU backends need an accelerator; "
                   "Triton runs on CPU only in its interpreter, for tests)")
        return Choice(op, dev, name, why, err, rejected, _dname(tested)), fn
    raise RuntimeError(f"no backend can run {op} on {dev} ({_dname(dtype)}): "
                       + "; ".join(f"{r}: {w}" for r, w in rejected))


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _remember(key: Key, choice: Choice, fn: object, quiet: bool = False) -> Choice:
    _CHOICES[key] = choice
    _IMPLS[key] = fn
    op, dev, dtype = key
    for cached in [k for k in _BY_DEVICE if k[0] == op and k[2] == dtype and _device_key(k[1]) == dev]:
        del _BY_DEVICE[cached]  # a new choice for this op, device and dtype replaces the fast-path entry
    if not quiet:
        log.info("qwen35: %s on %s (%s) -> %s (%s)", choice.op, choice.device, choice.dtype, choice.backend,
                 choice.reason)
    return choice


def implementation(op: str, device: torch.device, dtype: torch.dtype | None = None) -> object:
    """The callable the probe chose for ``op`` on ``device`` for activations of ``dtype`` (the façade passes the
    dtype of the call's first tensor; None: the device's default).

    Called once per op call: a tensor's own device (which always carries its index) is looked up
    directly; building the normalised key costs microseconds of host time per call.
    """
    fn = _BY_DEVICE.get((op, device, dtype))
    if fn is not None:
        return fn
    key = (op, _device_key(device), dtype)
    fn = _IMPLS.get(key)
    if fn is None:
        choose(op, device, dtype)
        fn = _IMPLS[key]
    if isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None):
        _BY_DEVICE[(op, device, dtype)] = fn
    return fn


def choose_at_load(device: torch.device | str | None, dtypes: torch.dtype | None | tuple[torch.dtype | None, ...],
                   ops: tuple[str, ...] | list[str], log: logging.Logger, who: str = "qwen35") -> list[Choice]:
    """Choose now, before any CUDA-graph capture, the backend of each of ``ops`` (the ones the host's model calls)
    for each of ``dtypes`` (the dtypes of the calls' first tensors; None: the device's default, which the GDN
    metadata helpers ask for) and return the choices.

    On an accelerator, an op left on the reference (every faster backend rejected, or the reference forced) is
    slow, and its host reads break CUDA-graph capture: one ERROR names those ops and the reasons, or, with
    ``QWEN35_REQUIRE_ACCELERATED=1``, a ``RuntimeError`` with the same text stops the host from starting. ``who``
    names the host in that message.
    """
    # fp64 calls always take the reference (the façade's ground truth) and never ask the probe
    dtypes = tuple(d for d in (dtypes if isinstance(dtypes, tuple) else (dtypes,)) if d != torch.float64)
    for op in ops:
        optable.get(op)  # ValueError for unknown ops, listing the table's
    choices = [choose(op, device, dt) for dt in dict.fromkeys((*dtypes, None)) for op in ops]
    caps = device_caps(device)
    if caps.vendor == "cpu":
        return choices
    slow = {}
    for c in choices:
        if c.backend == "reference":
            slow.setdefault(c.op, c)
    if slow:
        names = ", ".join(dtype_name(d) if d is not None else "default" for d in dict.fromkeys(dtypes))
        msg = (f"{who}: {len(slow)} op(s) the model calls would run on the reference backend on {caps.device} "
               f"({caps.name}, {names}): "
               + "; ".join(f"{op}: {c.reason}" for op, c in slow.items())
               + ". The reference is a slow fallback whose host reads break CUDA-graph capture; "
               + ("QWEN35_REQUIRE_ACCELERATED=1 refuses to serve this way."
                  if knobs.on("QWEN35_REQUIRE_ACCELERATED") else
                  "set QWEN35_REQUIRE_ACCELERATED=1 to refuse to start instead."))
        if knobs.on("QWEN35_REQUIRE_ACCELERATED"):
            raise RuntimeError(msg)
        log.error(msg)
    return choices


# ----------------------------------------------------------------------------- the report


def build_facts() -> dict | None:
    """The facts of this process's ``cuda_sm70`` build or load (directory, seconds, arch, compiler, toolkit,
    whether it compiled), or None when nothing was built here. Does not import the build module."""
    build = sys.modules.get("kernels_cuda.build")
    facts = getattr(build, "last_build", None) if build is not None else None
    return dict(facts) if facts else None


def run_build(device: torch.device | str | None = None) -> dict:
    """Build (or load from the cache) the ``cuda_sm70`` extension for ``device`` now, as ``qwen35-probe --build``
    does ahead of serving; returns the build's facts. Raises ``ValueError`` for a device that is not CUDA and
    :class:`kernels_cuda.build.CudaBuildError` when the build fails (its message quotes the compiler)."""
    dev = torch.device(_device_key(device))
    if dev.type != "cuda":
        raise ValueError(f"the cuda_sm70 build needs a CUDA device; got {dev} (use --device cuda:N on a GPU host)")
    from kernels_cuda import build

    build.load(dev)
    return dict(build.last_build)


def report(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> dict:
    """Device facts, the choice for every op of the table (for activations of ``dtype``; None: the device's
    default), the ``cuda_sm70`` build's facts when this process built or loaded it, and the ``QWEN35_*``
    switches set (declared ones with their values; undeclared ones, which nothing reads, by name), as plain
    data. Each op's row names the tuned-config files its backend reads here (``config``: paths, or
    ``"heuristic"``)."""
    caps = device_caps(device)
    rows = [asdict(choose(op, caps.device, dtype)) for op in optable.NAMES]
    for row in rows:
        row["config"] = config_files(row["op"], row["backend"], caps)
    facts = asdict(caps)
    facts["platform"] = caps.platform
    facts["compute_dtype"] = str(caps.compute_dtype).replace("torch.", "")
    return {"device": facts, "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "build": build_facts(), "switches": knobs.active(), "unknown_switches": knobs.unknown(), "ops": rows}


def config_files(op: str, backend: str, caps: DeviceCaps) -> list[str] | str:
    """The tuned-config files (package data and the user's, ``qwen35-tune``'s output) behind ``op`` when
    ``backend`` runs it on this device, or ``"heuristic"``: the op's launch rule alone."""
    if backend != "triton":
        return "heuristic"
    try:
        from kernels_triton.bench_api import config_sources

        files = config_sources(op, "cpu" if caps.vendor == "cpu" else caps.name)
    except Exception:  # noqa: BLE001 - the report names what it can; the kernels fall back the same way
        return "heuristic"
    return files or "heuristic"


def format_build(facts: dict | None) -> str:
    """One line for the report: the cuda_sm70 build's facts, its error, or that nothing was built."""
    if not facts:
        return "build    cuda_sm70 not built in this process"
    if facts.get("error"):
        return f"build    cuda_sm70 FAILED: {facts['error']}"
    how = "compiled" if facts.get("fresh") else "loaded from the cache"
    return (f"build    cuda_sm70 {how} in {facts['seconds']:.1f}s: compute_{facts['arch']} with {facts['compiler']} "
            f"({facts['toolkit']}) -> {facts['build_dir']}")


def format_report(rep: dict) -> str:
    d = rep["device"]
    cc = ".".join(map(str, d["capability"])) if d["capability"] else "-"
    lines = [
        f"device   {d['device']}  vendor={d['vendor']}  name={d['name']!r}  cc={cc}  platform={d['platform']}",
        f"         bf16={d['bf16']}  smem/block={d['shared_mem_per_block']}  warp={d['warp_size']}",
        f"triton   {d['triton_version'] or 'absent'}  runs={d['triton_runs']}  ({d['triton_note']})",
        f"toolch.  nvcc={d['nvcc'] or '-'}  corex-clang={d['corex_clang'] or '-'}  ninja={d['ninja'] or '-'}",
        f"ixformer {d['ixformer_version'] or 'absent'}  {', '.join(d['ixformer_functions']) or ''}".rstrip(),
        format_build(rep.get("build")),
        "switches " + ("  ".join(f"{k}={v}" for k, v in rep["switches"].items()) or "none set"),
    ]
    if rep["unknown_switches"]:
        lines.append(f"         unknown (ignored): {'  '.join(rep['unknown_switches'])}")
    dtype = rep.get("dtype")
    lines += [
        f"dtype    {dtype}" if dtype else f"dtype    the device's default ({d.get('compute_dtype', '-')})",
        "",
        f"{'op':<24} {'backend':<10} reason",
        f"{'-' * 24} {'-' * 10} {'-' * 40}",
    ]
    for r in rep["ops"]:
        lines.append(f"{r['op']:<24} {r['backend']:<10} {r['reason']}")
    return "\n".join(lines)


DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qwen35-probe", description="Show which backend each qwen35 op uses here, and why.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--device", default=None, help="torch device to probe (default: current CUDA device, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="the model's activation dtype (default: the device's: bf16 where it computes it, "
                             "else fp16; fp32 on the CPU)")
    parser.add_argument("--build", action="store_true",
                        help="build the cuda_sm70 extension now (JIT, cached), so that no request pays for it, "
                             "and report the build; exit status 1 when it fails")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    failed = None
    if args.build:
        try:
            run_build(args.device)
        except ValueError as e:
            parser.error(str(e))
        except Exception as e:  # noqa: BLE001 - the report still shows what the probe falls back to
            failed = f"{type(e).__name__}: {e}"
            print(f"qwen35-probe --build: {failed}", file=sys.stderr)
    try:
        rep = report(args.device, DTYPE_NAMES.get(args.dtype))
    except RuntimeError as e:  # a forced backend that cannot serve: say so without a traceback
        print(f"qwen35-probe: {e}", file=sys.stderr)
        return 1
    if failed:
        rep["build"] = {"error": failed}
    if args.json:
        print(json.dumps(rep, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)))
    else:
        print(format_report(rep))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
