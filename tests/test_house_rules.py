"""House rules of the package code (issue 31): no session narratives, no file over MAX_LINES, no reference to a design
document outside the repository, and the benchmarks and tools in tuning/ reach the kernel packages through public
names only (their bench-facing APIs: kernels_triton.bench_api, kernels_triton.gdn.bench_api,
kernels_triton.moe.bench_api).

Each rule is checked on every ``.py`` file of the package folders, and each checker on a snippet that breaks it (a
checker that cannot fail checks nothing). ``KNOWN`` lists the files that still break a rule, with the work that
removes them; an entry that no longer breaks it fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("qwen35", "kernels_triton", "kernels_cuda", "serve", "tuning")
KERNEL_PACKAGES = ("kernels_triton", "kernels_cuda")
MAX_LINES = 700
SESSION = re.compile(r"\bsessions? \d+", re.IGNORECASE)
# (rule, file) -> why it still breaks the rule
KNOWN: dict[tuple[str, str], str] = {}


def _files(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def session_mentions(text: str) -> list[int]:
    """Line numbers that narrate a numbered session."""
    return [i for i, line in enumerate(text.splitlines(), 1) if SESSION.search(line)]


def private_kernel_uses(source: str) -> list[str]:
    """Underscore names of the kernel packages that ``source`` imports or reads: a module path or imported name
    starting with ``_`` under kernels_triton / kernels_cuda, or ``module._name`` on a name bound to one of their
    modules (dunder names aside)."""
    tree = ast.parse(source)
    bound: set[str] = set()
    found = []

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in KERNEL_PACKAGES:
                    if any(private(p) for p in parts):
                        found.append(f"line {node.lineno}: import {alias.name}")
                    bound.add(alias.asname or parts[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in KERNEL_PACKAGES:
            if any(private(p) for p in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _broken(rule: str, check) -> dict[str, str]:  # noqa: ANN001
    """{file: what breaks ``rule``} over the package folders (``check(path, text)`` -> description or None)."""
    out = {}
    for path in _files(*(("tuning",) if rule == "private" else PACKAGES)):
        text = path.read_text()
        why = check(path, text)
        if why:
            out[_rel(path)] = why
    return out


RULES = {
    "session": lambda path, text: ", ".join(f"line {n}" for n in session_mentions(text)) or None,
    "lines": lambda path, text: (f"{len(text.splitlines())} lines > {MAX_LINES}"
                                 if len(text.splitlines()) > MAX_LINES else None),
    "design_doc": lambda path, text: "mentions DESIGN.md (not in the repository)" if "DESIGN.md" in text else None,
    "private": lambda path, text: "; ".join(private_kernel_uses(text)) or None,
}


@pytest.mark.parametrize("rule", list(RULES))
def test_package_code_keeps_the_house_rules(rule):
    broken = _broken(rule, RULES[rule])
    known = {f for (r, f) in KNOWN if r == rule}
    new = {f: why for f, why in broken.items() if f not in known}
    assert not new, f"{rule}: {new}"
    fixed = sorted(known - set(broken))
    assert not fixed, f"{rule}: {fixed} keep the rule now: remove them from KNOWN"


def test_the_checkers_catch_what_they_are_for():
    assert session_mentions("x = 1\n# as measured in Session 12\n# sessions 3-4\n") == [2, 3]
    assert session_mentions("# the session's state\nsession_id = 4\n") == []
    bad = """
import kernels_triton as kt
import kernels_triton._launch
from kernels_triton import _config, bench_api
from kernels_triton.gdn import chunk
from kernels_triton._config import device_slug
from kernels_cuda.sm70 import _ops as ops

def f():
    from kernels_triton.moe import config
    chunk._launch_scan(1)
    kt.gdn.plan._scan_config(1)
    config._near(None, 1)
    return bench_api.__doc__, kt.gdn_chunk_prefill, ops
"""
    found = private_kernel_uses(bad)
    for expected in ("import kernels_triton._launch", "import _config", "from kernels_triton._config",
                     "import _ops", "chunk._launch_scan", "kt.gdn.plan._scan_config", "config._near"):
        assert any(expected in f for f in found), (expected, found)
    assert not any("__doc__" in f or "gdn_chunk_prefill" in f for f in found), found
    assert private_kernel_uses("from tuning import _bench\n_bench.time_ms(f)\n") == []  # tuning's own helpers


README_MAX_BYTES = 16 * 1024


def test_readme_stays_a_short_manual():
    """The README is a user's manual: short (at most 16 KiB) and free of session narratives."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_MAX_BYTES, f"README.md is {len(text.encode())} bytes > {README_MAX_BYTES}"
    assert not re.search(r"\bsession \d+", text, re.IGNORECASE), "README.md narrates a session"
