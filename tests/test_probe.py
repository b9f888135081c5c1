"""Capability probe: CPU choice and reason, overrides, self-test rejection, fallbacks, CLI."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from qwen35 import backends, ops, reference
from qwen35.backends import Backend


def _fake_backend(monkeypatch, name: str, ops_impl: dict, availability=None) -> None:
    """Register a backend whose module is built here (never imported from disk)."""
    mod = types.ModuleType(f"qwen35_test_{name}")
    for op, fn in ops_impl.items():
        setattr(mod, op, fn)
    if availability is not None:
        mod.availability = availability
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    backends.register(Backend(name, mod.__name__, "test backend"))


@pytest.fixture(autouse=True)
def _private_registry(monkeypatch):
    """Backends registered by a test vanish after it."""
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))


def _wrong_norm(x, weight, eps=1e-6, residual=None):  # a plausible bug: an offset of 0.9 instead of 1
    return reference.rms_norm_zero_centered(x, weight - 0.1, eps, residual)


def test_cpu_picks_reference_and_says_why(fresh_probe):
    for op in backends.OPS:
        choice = fresh_probe.choose(op, "cpu")
        assert choice.backend == "reference"
        assert "CPU device" in choice.reason and "reference" in choice.reason
    caps = fresh_probe.device_caps("cpu")
    assert caps.vendor == "cpu" and caps.platform == "cpu"


def test_global_override_forces_backend(fresh_probe, monkeypatch):
    monkeypatch.setenv("QWEN35_BACKEND", "reference")
    choice = fresh_probe.choose("gdn_chunk_prefill", "cpu")
    assert choice.backend == "reference" and "forced by QWEN35_BACKEND" in choice.reason


def test_unknown_backend_name_is_a_value_error(fresh_probe, monkeypatch):
    monkeypatch.setenv("QWEN35_BACKEND_RMS_NORM_GATED", "nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'.*reference"):
        fresh_probe.choose("rms_norm_gated", "cpu")


def test_failing_selftest_is_not_chosen_and_warns(fresh_probe, monkeypatch, caplog):
    _fake_backend(monkeypatch, "broken", {"rms_norm_zero_centered": _wrong_norm})
    monkeypatch.setitem(fresh_probe.POLICY, "cpu", ("broken", "reference"))
    with caplog.at_level(logging.WARNING, logger="qwen35.probe"):
        choice = fresh_probe.choose("rms_norm_zero_centered", "cpu")
    assert choice.backend == "reference"
    assert choice.rejected and choice.rejected[0][0] == "broken"
    assert "self-test rel err" in choice.rejected[0][1]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("broken" in m and "rel err" in m for m in warned), warned
    # the broken backend is not what the façade runs
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(ops.rms_norm_zero_centered(x, w), reference.rms_norm_zero_centered(x, w))


def test_nan_output_fails_selftest(fresh_probe, monkeypatch):
    def nan_norm(x, z, weight, eps=1e-6):
        return torch.full_like(x, float("nan"))

    _fake_backend(monkeypatch, "nan", {"rms_norm_gated": nan_norm})
    monkeypatch.setitem(fresh_probe.POLICY, "cpu", ("nan", "reference"))
    choice = fresh_probe.choose("rms_norm_gated", "cpu")
    assert choice.backend == "reference" and "inf" in choice.rejected[0][1]


def test_forced_backend_that_fails_selftest_raises(fresh_probe, monkeypatch):
    _fake_backend(monkeypatch, "broken", {"rms_norm_zero_centered": _wrong_norm})
    monkeypatch.setenv("QWEN35_BACKEND_RMS_NORM_ZERO_CENTERED", "broken")
    with pytest.raises(RuntimeError, match="broken.*self-test rel err"):
        fresh_probe.choose("rms_norm_zero_centered", "cpu")


def test_good_backend_is_chosen_after_selftest(fresh_probe, monkeypatch):
    calls = []

    def good(x, z, weight, eps=1e-6):
        calls.append(1)
        return reference.rms_norm_gated(x, z, weight, eps)

    _fake_backend(monkeypatch, "good", {"rms_norm_gated": good})
    monkeypatch.setitem(fresh_probe.POLICY, "cpu", ("good", "reference"))
    choice = fresh_probe.choose("rms_norm_gated", "cpu")
    assert choice.backend == "good" and choice.selftest_rel_err is not None and choice.selftest_rel_err < 1e-6
    assert "first choice" in choice.reason
    ops.rms_norm_gated(torch.randn(2, 4), torch.randn(2, 4), torch.randn(4))
    assert len(calls) == 2  # self-test + the real call


def test_partial_backend_falls_back_per_op(fresh_probe, monkeypatch):
    _fake_backend(monkeypatch, "partial", {"rms_norm_gated": reference.rms_norm_gated})
    monkeypatch.setenv("QWEN35_BACKEND", "partial")
    assert fresh_probe.choose("rms_norm_gated", "cpu").backend == "partial"
    other = fresh_probe.choose("moe_route", "cpu")
    assert other.backend == "reference"
    assert any(name == "partial" and "has no moe_route" in why for name, why in other.rejected)


def test_unavailable_and_unimportable_backends_are_skipped_with_reason(fresh_probe, monkeypatch):
    _fake_backend(monkeypatch, "elsewhere", {"moe_route": reference.moe_route},
                  availability=lambda caps: "needs an imaginary accelerator")
    backends.register(Backend("ghost", "qwen35_no_such_module", "missing"))
    monkeypatch.setitem(fresh_probe.POLICY, "cpu", ("ghost", "elsewhere", "reference"))
    choice = fresh_probe.choose("moe_route", "cpu")
    assert choice.backend == "reference"
    reasons = dict(choice.rejected)
    assert "does not import" in reasons["ghost"]
    assert "imaginary accelerator" in reasons["elsewhere"]


def test_forced_unrunnable_backend_raises(fresh_probe, monkeypatch):
    monkeypatch.setenv("QWEN35_BACKEND_GDN_CHUNK_PREFILL", "cuda_sm70")
    with pytest.raises(RuntimeError, match="cuda_sm70.*cannot run here"):
        fresh_probe.choose("gdn_chunk_prefill", "cpu")


def test_choice_is_cached(fresh_probe, monkeypatch):
    first = fresh_probe.choose("moe_block", "cpu")
    monkeypatch.setenv("QWEN35_BACKEND", "nope")  # ignored until reset()
    assert fresh_probe.choose("moe_block", "cpu") is first


def _clean_env(**switches: str) -> dict[str, str]:
    """This process's environment without any QWEN35_* variable, plus ``switches``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN35_")}
    env.update(switches)
    return env


def _probe_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen35.probe", *args], capture_output=True, text=True, check=True,
                          env=env)


def test_cli_table_and_json():
    run = _probe_cli(env=_clean_env())
    table = run.stdout
    assert "gdn_chunk_prefill" in table and "reference" in table and "vendor=cpu" in table
    assert "switches none set" in table and "WARNING" not in run.stderr
    doc = json.loads(_probe_cli("--json", env=_clean_env()).stdout)
    assert [r["op"] for r in doc["ops"]] == list(backends.OPS)
    assert all(r["backend"] == "reference" and r["reason"] for r in doc["ops"])
    assert doc["device"]["vendor"] == "cpu"
    assert doc["switches"] == {} and doc["unknown_switches"] == []


def test_cli_lists_active_switches_and_warns_once_about_unknown_ones():
    """A real ``python -m qwen35.probe`` run: the switches set are printed (text and JSON) and act; a misspelt
    QWEN35_* variable gets exactly one WARNING that names it and the known switches."""
    env = _clean_env(QWEN35_BACKEND="reference", QWEN35_CHECK_VALUES="0", QWEN35_MOE_PLD="1")
    for args in ((), ("--json",)):
        run = _probe_cli(*args, env=env)
        warnings = [line for line in run.stderr.splitlines() if line.startswith("WARNING")]
        assert len(warnings) == 1, run.stderr
        assert "unknown switch QWEN35_MOE_PLD" in warnings[0]
        assert "known: QWEN35_BACKEND, QWEN35_BACKEND_<OP>" in warnings[0] and "QWEN35_MOE_PDL" in warnings[0]
        if args:
            doc = json.loads(run.stdout)
            assert doc["switches"] == {"QWEN35_BACKEND": "reference", "QWEN35_CHECK_VALUES": "0"}
            assert doc["unknown_switches"] == ["QWEN35_MOE_PLD"]
            assert all(r["reason"].startswith("forced by QWEN35_BACKEND") for r in doc["ops"])
        else:
            assert "switches QWEN35_BACKEND=reference  QWEN35_CHECK_VALUES=0" in run.stdout
            assert "unknown (ignored): QWEN35_MOE_PLD" in run.stdout
            assert "forced by QWEN35_BACKEND" in run.stdout


def test_first_choice_warns_once_per_process(fresh_probe, monkeypatch, caplog):
    from qwen35 import knobs

    monkeypatch.setattr(knobs, "_WARNED", set())
    monkeypatch.setattr(fresh_probe, "_SWITCHES_CHECKED", False)
    monkeypatch.setenv("QWEN35_BAKEND", "reference")  # misspelt
    with caplog.at_level(logging.WARNING, logger="qwen35"):
        for op in ("moe_route", "moe_block", "rms_norm_gated"):
            fresh_probe.choose(op, "cpu")
        fresh_probe.reset()
        fresh_probe.choose("moe_route", "cpu")
    warned = [r.getMessage() for r in caplog.records if "unknown switch" in r.getMessage()]
    assert len(warned) == 1 and "QWEN35_BAKEND" in warned[0] and "QWEN35_BACKEND" in warned[0], warned

