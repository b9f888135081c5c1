"""The files of a ``qwen35-tune`` run: where and with what a config was tuned (provenance), atomic JSON writes, and
the per-device config files the run fills bucket by bucket (:class:`ConfigFiles`), in the format the kernels'
loader reads (:mod:`kernels_triton._config`: every field it checks is written, ``entries`` keep their shape)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels_triton import bench_api

if TYPE_CHECKING:
    from tuning.tune_run import Outcome, Task

MAX_REJECTED_LISTED = 20  # rejected candidates listed per bucket (all are counted)
TOOL = "qwen35-tune"


def provenance(device: torch.device, argv: list[str] | None = None) -> dict:
    """Where and with what a config was tuned."""
    import triton

    facts: dict = {"device": device_name(device), "torch": torch.__version__, "triton": triton.__version__,
                   "qwen35": _qwen35_version(), "date": _dt.date.today().isoformat(), "python": sys.version.split()[0]}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts["capability"] = f"{props.major}.{props.minor}"
        facts["driver"] = _driver_version()
        facts["cuda"] = torch.version.cuda
    else:
        facts["capability"] = None
        facts["driver"] = None
        facts["note"] = "Triton interpreter on the CPU (timed by wall clock): for tests, not for use"
    if argv is not None:
        facts["command"] = " ".join([TOOL, *argv])
    return facts


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _qwen35_version() -> str:
    try:
        from importlib.metadata import version

        v = version("qwen35")
    except Exception:  # noqa: BLE001 - not installed: the source tree
        v = "source"
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False).stdout.strip()
        if rev:
            v += f"+g{rev}"
    except (OSError, subprocess.SubprocessError):
        pass
    return v


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is not None:
        v = int(get())
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    return None


def atomic_write_json(path: Path, doc: dict) -> None:
    """Write ``doc`` to ``path`` through a temporary file in the same directory renamed over it: a reader (or a
    Ctrl-C) sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ConfigFiles:
    """The output files of a run: ``<out>/<device slug>/<op>.json``, loaded (when the loader would take them) and
    updated bucket by bucket."""

    def __init__(self, out: Path, device_name: str, prov: dict) -> None:
        self.dir = Path(out) / bench_api.device_slug(device_name)
        self.device_name, self.prov = device_name, prov
        self.docs: dict[str, dict] = {}
        self.notes: list[str] = []

    def path(self, op: str) -> Path:
        return self.dir / f"{op}.json"

    def doc(self, op: str, space_hash: str) -> dict:
        if op not in self.docs:
            path = self.path(op)
            data = None
            if path.is_file():
                data, why = bench_api.read_config_file(path, self.device_name, op)
                if data is not None and data.get("search_space") not in (None, space_hash):
                    data, why = None, f"its search space {data['search_space']} is not the kernel's ({space_hash})"
                if data is None:
                    self.notes.append(f"{path}: {why}; its buckets are tuned again and the file replaced")
            self.docs[op] = data if data is not None else {"entries": {}}
        return self.docs[op]

    def done(self, task: Task) -> bool:
        """Whether every file of ``task`` already holds its bucket (written by this tool)."""
        for op, key in task.files.items():
            entry = self.doc(op, task.space_hash[op]).get("entries", {}).get(key, {}).get(str(task.bucket))
            if not entry or ("tuned_ms" not in entry and not entry.get("heuristic")):
                return False
        return True

    def record(self, out: Outcome) -> None:
        """Write ``out``'s bucket into every file of its task."""
        task = out.task
        common = {"heuristic_ms": rounded(out.heuristic_ms), "tried": out.tried, "rejected": out.rejected[
            :MAX_REJECTED_LISTED], "rejected_count": len(out.rejected), "date": _dt.date.today().isoformat()}
        if out.before_ms is not None:
            common["before_ms"] = rounded(out.before_ms)
        if out.layouts:
            common["layouts"] = out.layouts
        if out.budget_cut:
            common["budget_cut"] = True
        fields = task.entries(out.best) if out.best is not None else {}
        for op, key in task.files.items():
            doc = self.doc(op, task.space_hash[op])
            if out.status == "tuned":
                entry = {**fields[op], **common, "tuned_ms": rounded(out.tuned_ms),
                         "speedup": round(out.heuristic_ms / out.tuned_ms, 4)}
            else:
                entry = {"heuristic": True, **common, "best_ms": rounded(out.tuned_ms),
                         **({"best": fields[op]} if fields else {}), "note": out.note}
            doc.setdefault("entries", {}).setdefault(key, {})[str(task.bucket)] = entry
            doc.update({"device": self.device_name, "op": op, "triton": self.prov["triton"],
                        "search_space": task.space_hash[op], "provenance": self.prov, "tool": TOOL})
            atomic_write_json(self.path(op), doc)


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
