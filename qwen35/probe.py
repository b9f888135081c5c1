"""Capability probe: what this device can run, and which backend each op uses, with the reason.

Run once per device at first use and cached. For every op it walks the policy list for the
device's platform (below), skips backends that cannot import, cannot run here or lack the op,
and checks the first remaining one numerically on a tiny input against the fp64 reference
(:mod:`qwen35.selftest`). A backend that fails its check is skipped with a WARNING that says
what failed and by how much; ``reference`` ends every list and needs no check.

Overrides (read at selection time; :func:`reset` forgets earlier choices):

- ``QWEN35_BACKEND=<name>``: every op uses that backend where it defines the op (others follow
  the policy, saying so).
- ``QWEN35_BACKEND_<OP>=<name>`` (e.g. ``QWEN35_BACKEND_MOE_BLOCK=reference``): that op uses it.

A forced backend that cannot import, cannot run here or fails its self-test raises
``RuntimeError``: an explicit request is never silently replaced.

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

IXFORMER_FUNCTIONS = (
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "rms_norm",
    "fused_add_rms_norm",
    "moe_align_block_size",
    "fused_moe",
    "topk_softmax",
)


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
        """The dtype self-tests run in: what a model would use on this device."""
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
    found = []
    for sub in ("ixformer.functions", "ixformer.inference.functions", "ixformer"):
        try:
            mod = importlib.import_module(sub)
        except Exception:  # noqa: BLE001
            continue
        found += [f"{sub}.{f}" for f in IXFORMER_FUNCTIONS if hasattr(mod, f)]
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

_CHOICES: dict[tuple[str, str], Choice] = {}
_IMPLS: dict[tuple[str, str], object] = {}
_BY_DEVICE: dict[tuple[str, torch.device], object] = {}  # implementation() by the tensor's own device


def reset() -> None:
    """Forget cached choices and device facts (after changing env overrides or the registry)."""
    _CHOICES.clear()
    _IMPLS.clear()
    _BY_DEVICE.clear()
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


def _try(name: str, op: str, caps: DeviceCaps) -> tuple[object | None, str, float | None]:
    """Load ``name`` and check it for ``op``. Returns (fn or None, why-not / ok note, rel err)."""
    try:
        module = backends.load(name)
    except Exception as e:  # noqa: BLE001 - any import failure disqualifies, with its message
        return None, f"does not import ({type(e).__name__}: {e})", None
    avail = getattr(module, "availability", None)
    why_not = avail(caps) if callable(avail) else None
    if why_not:
        return None, f"cannot run here ({why_not})", None
    fn = backends.implementation(module, op)
    if fn is None:
        return None, f"has no {op}", None
    if name == "reference":
        return fn, "reference", None
    dtype = caps.compute_dtype
    try:
        err = selftest.check(op, fn, torch.device(caps.device), dtype)
    except Exception as e:  # noqa: BLE001 - a crash in the self-test is a failed self-test
        return None, f"self-test raised {type(e).__name__}: {str(e)[:300]}", None
    tol = selftest.tolerance(op, dtype)
    if not (err <= tol):  # also catches NaN
        return None, f"self-test rel err {err:.3g} > {tol:g} ({str(dtype).replace('torch.', '')})", err
    return fn, f"self-test rel err {err:.2g} <= {tol:g} ({str(dtype).replace('torch.', '')})", err


def choose(op: str, device: torch.device | str | None = None) -> Choice:
    """The backend ``op`` uses on ``device``, chosen once and cached (see module docstring)."""
    optable.get(op)  # ValueError for unknown ops, listing the table's
    key = (op, _device_key(device))
    if key in _CHOICES:
        return _CHOICES[key]
    _check_switches_once()
    caps = device_caps(key[1])
    forced, source = _forced(op)
    rejected: list[tuple[str, str]] = []
    if forced:
        backends.get(forced)  # ValueError for unknown names, listing the registered ones
        fn, note, err = _try(forced, op, caps)
        if fn is not None:
            choice = Choice(op, key[1], forced, f"forced by {source}; {note}", err)
            return _remember(key, choice, fn)
        if source.endswith(op.upper()) or not note.startswith("has no"):
            raise RuntimeError(f"{source}={forced} was requested for {op} on {key[1]}, but it {note}")
        rejected.append((forced, f"{note} (requested by {source})"))
    order = POLICY[caps.platform]
    for name in order:
        if any(name == r for r, _ in rejected):
            continue
        fn, note, err = _try(name, op, caps)
        if fn is None:
            rejected.append((name, note))
            if err is not None or "self-test" in note:
                log.warning("qwen35: backend %s rejected for %s on %s: %s", name, op, key[1], note)
            continue
        first = not rejected
        why = f"policy {caps.platform}: {' > '.join(order)}; " + (
            "first choice" if first else "; ".join(f"{r} {w}" for r, w in rejected))
        if name != "reference":
            why += f"; {note}"
        elif caps.vendor == "cpu" and len(order) == 1:
            why = ("CPU device: policy 'cpu' lists only the reference (GPU backends need an accelerator; "
                   "Triton runs on CPU only in its interpreter, for tests)")
        return _remember(key, Choice(op, key[1], name, why, err, rejected), fn)
    raise RuntimeError(f"no backend can run {op} on {key[1]}: " + "; ".join(f"{r}: {w}" for r, w in rejected))


def _remember(key: tuple[str, str], choice: Choice, fn: object) -> Choice:
    _CHOICES[key] = choice
    _IMPLS[key] = fn
    for cached in [k for k in _BY_DEVICE if k[0] == key[0] and _device_key(k[1]) == key[1]]:
        del _BY_DEVICE[cached]  # a new choice for this op and device replaces the fast-path entry
    log.info("qwen35: %s on %s -> %s (%s)", choice.op, choice.device, choice.backend, choice.reason)
    return choice


def implementation(op: str, device: torch.device) -> object:
    """The callable the probe chose for ``op`` on ``device``.

    Called once per op call: a tensor's own device (which always carries its index) is looked up
    directly; building the normalised key costs microseconds of host time per call.
    """
    fn = _BY_DEVICE.get((op, device))
    if fn is not None:
        return fn
    key = (op, _device_key(device))
    fn = _IMPLS.get(key)
    if fn is None:
        choose(op, device)
        fn = _IMPLS[key]
    if isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None):
        _BY_DEVICE[(op, device)] = fn
    return fn


def report(device: torch.device | str | None = None) -> dict:
    """Device facts, the choice for every op of the table, and the ``QWEN35_*`` switches set (declared ones with
    their values; undeclared ones, which nothing reads, by name), as plain data."""
    caps = device_caps(device)
    rows = [asdict(choose(op, caps.device)) for op in optable.NAMES]
    facts = asdict(caps)
    facts["platform"] = caps.platform
    return {"device": facts, "switches": knobs.active(), "unknown_switches": knobs.unknown(), "ops": rows}


def format_report(rep: dict) -> str:
    d = rep["device"]
    cc = ".".join(map(str, d["capability"])) if d["capability"] else "-"
    lines = [
        f"device   {d['device']}  vendor={d['vendor']}  name={d['name']!r}  cc={cc}  platform={d['platform']}",
        f"         bf16={d['bf16']}  smem/block={d['shared_mem_per_block']}  warp={d['warp_size']}",
        f"triton   {d['triton_version'] or 'absent'}  runs={d['triton_runs']}  ({d['triton_note']})",
        f"toolch.  nvcc={d['nvcc'] or '-'}  corex-clang={d['corex_clang'] or '-'}  ninja={d['ninja'] or '-'}",
        f"ixformer {d['ixformer_version'] or 'absent'}  {', '.join(d['ixformer_functions']) or ''}".rstrip(),
        "switches " + ("  ".join(f"{k}={v}" for k, v in rep["switches"].items()) or "none set"),
    ]
    if rep["unknown_switches"]:
        lines.append(f"         unknown (ignored): {'  '.join(rep['unknown_switches'])}")
    lines += [
        "",
        f"{'op':<24} {'backend':<10} reason",
        f"{'-' * 24} {'-' * 10} {'-' * 40}",
    ]
    for r in rep["ops"]:
        lines.append(f"{r['op']:<24} {r['backend']:<10} {r['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qwen35-probe", description="Show which backend each qwen35 op uses here, and why.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--device", default=None, help="torch device to probe (default: current CUDA device, else cpu)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    rep = report(args.device)
    if args.json:
        print(json.dumps(rep, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)))
    else:
        print(format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
