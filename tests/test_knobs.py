"""The switch table: lookups, validation, the unknown-variable warning, and that the code reads no
``QWEN35_*`` variable the table does not declare."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest

from qwen35 import knobs

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("qwen35", "kernels_triton", "kernels_cuda", "serve", "tuning", "scripts")


def test_get_returns_the_default_and_the_environment(monkeypatch):
    monkeypatch.delenv("QWEN35_CHECK_VALUES", raising=False)
    assert knobs.get("QWEN35_CHECK_VALUES") == "1" and knobs.on("QWEN35_CHECK_VALUES") is True
    monkeypatch.setenv("QWEN35_CHECK_VALUES", "0")
    assert knobs.on("QWEN35_CHECK_VALUES") is False
    monkeypatch.delenv("QWEN35_GDN_PDL", raising=False)
    assert knobs.on("QWEN35_GDN_PDL") is None


def test_a_value_outside_the_choices_names_it_and_the_accepted_ones(monkeypatch):
    monkeypatch.setenv("QWEN35_GDN_PDL", "yes")
    with pytest.raises(ValueError, match=r"QWEN35_GDN_PDL='yes' is not accepted; use one of 0, 1"):
        knobs.get("QWEN35_GDN_PDL")


def test_family_members_and_undeclared_names(monkeypatch):
    assert knobs.knob("QWEN35_BACKEND_MOE_BLOCK").name == "QWEN35_BACKEND_"
    with pytest.raises(KeyError, match="QWEN35_NOPE is not a qwen35 switch"):
        knobs.get("QWEN35_NOPE")
    monkeypatch.setenv("QWEN35_BACKEND_MOE_BLOCK", "reference")
    assert knobs.active()["QWEN35_BACKEND_MOE_BLOCK"] == "reference"


def test_unknown_variables_get_one_warning_naming_the_known_ones(monkeypatch, caplog):
    monkeypatch.setenv("QWEN35_MOE_PLD", "0")  # misspelt
    monkeypatch.setattr(knobs, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="qwen35"):
        assert knobs.warn_unknown() == ["QWEN35_MOE_PLD"]
        assert knobs.warn_unknown() == []
    warnings = [r.getMessage() for r in caplog.records if "unknown switch" in r.getMessage()]
    assert len(warnings) == 1 and "QWEN35_MOE_PLD" in warnings[0] and "QWEN35_MOE_PDL" in warnings[0]


def test_every_switch_the_code_names_is_declared():
    files = subprocess.run(["git", "ls-files", *PACKAGES, "*.sh"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    named: dict[str, str] = {}
    for f in files:
        if f.endswith((".py", ".sh")):
            for m in re.finditer(r"QWEN35_[A-Z0-9_]*[A-Z0-9]", (ROOT / f).read_text()):
                named.setdefault(m.group(0), f)
    undeclared = {}
    for name, where in named.items():
        try:
            knobs.knob(name)
        except KeyError:
            undeclared[name] = where
    # QWEN35_DEFAULTS is serve.config's table of serving defaults, not an environment variable.
    undeclared.pop("QWEN35_DEFAULTS", None)
    assert not undeclared, f"switches read in code but not declared in qwen35/knobs.py: {undeclared}"
