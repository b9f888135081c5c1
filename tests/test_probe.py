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



# ----------------------------------------------------------------------------- dtypes, builds, cuda_sm70 policy

# A V100 as the probe would describe it: the policy 'nvidia-sm70' puts cuda_sm70 first. Its choices are made
# without touching CUDA until a self-test runs, so on this CPU host the build decides everything before that.
V100 = dict(device="cuda:0", vendor="nvidia", name="Tesla V100-SXM2-16GB", capability=(7, 0), bf16=False,
            triton_note="(not on this host)")
SM70_OPS = ("gdn_chunk_prefill", "gdn_recurrent_step", "causal_conv1d_prefill", "causal_conv1d_update",
            "rms_norm_gated", "rms_norm_zero_centered", "moe_route", "moe_experts", "moe_block")


def _as_device(fresh_probe, monkeypatch, **facts) -> None:
    """Make the probe see the device ``facts`` describe at their ``device`` key (the facts it would probe there)."""
    caps = fresh_probe.DeviceCaps(**facts)
    monkeypatch.setitem(fresh_probe._CAPS, caps.device, caps)


def test_policy_puts_cuda_sm70_first_below_sm80_and_after_ixformer_on_iluvatar(fresh_probe):
    caps = fresh_probe.DeviceCaps(**V100)
    assert caps.platform == "nvidia-sm70" and caps.compute_dtype == torch.float16
    assert fresh_probe.DeviceCaps(**{**V100, "capability": (7, 5)}).platform == "nvidia-sm70"
    assert fresh_probe.DeviceCaps(**{**V100, "capability": (8, 0), "bf16": True}).platform == "nvidia-sm80+"
    assert fresh_probe.POLICY["nvidia-sm70"] == ("cuda_sm70", "triton", "reference")
    assert fresh_probe.POLICY["iluvatar"] == ("ixformer", "cuda_sm70", "triton", "reference")
    assert "cuda_sm70" not in fresh_probe.POLICY["nvidia-sm80+"]


def test_failed_build_warns_once_and_falls_back(fresh_probe, monkeypatch, tmp_path, caplog):
    """nvcc missing on a V100: the build (run before the first self-test) fails, one WARNING quotes it, and every
    op passes over cuda_sm70 to the next backend of the policy (here the reference: Triton cannot run)."""
    missing = str(tmp_path / "no-cuda" / "bin" / "nvcc")
    monkeypatch.setenv("QWEN35_CUDA_COMPILER", missing)
    _as_device(fresh_probe, monkeypatch, **V100)
    with caplog.at_level(logging.WARNING, logger="qwen35.probe"):
        choices = {op: fresh_probe.choose(op, "cuda:0") for op in backends.OPS}
    for op, c in choices.items():
        assert c.backend == "reference", (op, c)
        why = dict(c.rejected)
        if op in SM70_OPS:
            assert why["cuda_sm70"].startswith("failed its build (CudaBuildError: ") and missing in why["cuda_sm70"]
            assert "cuda_sm70 failed its build" in c.reason
        else:
            assert why["cuda_sm70"] == f"has no {op}"
        assert "cannot run here" in why["triton"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "cuda_sm70 could not be built on cuda:0" in warned[0] and missing in warned[0]
    assert "does not exist" in warned[0]


def test_forced_cuda_sm70_whose_build_fails_raises(fresh_probe, monkeypatch, tmp_path):
    missing = str(tmp_path / "nvcc")
    monkeypatch.setenv("QWEN35_CUDA_COMPILER", missing)
    monkeypatch.setenv("QWEN35_BACKEND", "cuda_sm70")
    _as_device(fresh_probe, monkeypatch, **V100)
    with pytest.raises(RuntimeError, match=r"QWEN35_BACKEND=cuda_sm70 was requested for moe_block on cuda:0 "
                                           r"\(float16\), but it failed its build \(CudaBuildError: .*does not exist"):
        fresh_probe.choose("moe_block", "cuda:0")
    # an op it does not define follows the policy, saying so
    c = fresh_probe.choose("attention_decode", "cuda:0")
    assert c.backend == "reference" and "has no attention_decode (requested by QWEN35_BACKEND)" in c.reason


def test_bf16_calls_pass_over_cuda_sm70_without_building_it(fresh_probe, monkeypatch, tmp_path, caplog):
    """A bf16 model on a V100 (hosts default to fp16 there, but a user may ask): cuda_sm70 is passed over for its
    dtype, before any build, with the reason; a forced cuda_sm70 raises naming the dtypes it computes."""
    monkeypatch.setenv("QWEN35_CUDA_COMPILER", str(tmp_path / "nvcc"))  # a build attempt would WARN
    _as_device(fresh_probe, monkeypatch, **V100)
    with caplog.at_level(logging.WARNING, logger="qwen35.probe"):
        c = fresh_probe.choose("rms_norm_gated", "cuda:0", torch.bfloat16)
    assert c.backend == "reference" and c.dtype == "bfloat16"
    assert dict(c.rejected)["cuda_sm70"] == "computes fp16/fp32, not bf16"
    assert "cuda_sm70 computes fp16/fp32, not bf16" in c.reason
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert not fresh_probe._PREPARED  # no build was tried
    monkeypatch.setenv("QWEN35_BACKEND", "cuda_sm70")
    fresh_probe.reset()
    _as_device(fresh_probe, monkeypatch, **V100)
    with pytest.raises(RuntimeError, match=r"cuda_sm70 was requested for rms_norm_gated on cuda:0 \(bfloat16\), but "
                                           r"it computes fp16/fp32, not bf16"):
        fresh_probe.choose("rms_norm_gated", "cuda:0", torch.bfloat16)


def test_selftest_dtype_uses_fp16_for_a_forced_backend_without_the_default(fresh_probe):
    """On an H200 the default compute dtype is bf16; a forced cuda_sm70 is self-tested in fp16 there."""
    from kernels_cuda import sm70

    h200 = fresh_probe.DeviceCaps(device="cuda:0", vendor="nvidia", name="NVIDIA H200", capability=(9, 0), bf16=True)
    assert h200.compute_dtype == torch.bfloat16
    dt, note = fresh_probe.selftest_dtype(h200.compute_dtype, sm70.DTYPES, fallback=True)
    assert dt == torch.float16 and note == "tested in fp16: it computes fp16/fp32, not the device's default bf16"
    assert fresh_probe.selftest_dtype(torch.bfloat16, sm70.DTYPES) == (None, "computes fp16/fp32, not bf16")
    assert fresh_probe.selftest_dtype(torch.float32, sm70.DTYPES) == (torch.float32, "")
    assert fresh_probe.selftest_dtype(torch.bfloat16, None) == (torch.bfloat16, "")  # no DTYPES: any dtype


def _half_only(calls: list) -> dict:
    def rms_norm_gated(x, z, weight, eps=1e-6):
        calls.append(x.dtype)
        return reference.rms_norm_gated(x, z, weight, eps)
    return {"rms_norm_gated": rms_norm_gated}


def test_backend_dtypes_steer_choices_per_call_dtype(fresh_probe, monkeypatch):
    """A backend that declares DTYPES serves calls in those dtypes; the façade asks per call dtype, so fp32 calls
    on the same device go to the next backend, with the reason."""
    calls: list = []
    _fake_backend(monkeypatch, "halfonly", _half_only(calls))
    sys.modules["qwen35_test_halfonly"].DTYPES = (torch.float16,)
    monkeypatch.setitem(fresh_probe.POLICY, "cpu", ("halfonly", "reference"))
    c16 = fresh_probe.choose("rms_norm_gated", "cpu", torch.float16)
    assert c16.backend == "halfonly" and c16.dtype == "float16" and "(float16)" in c16.reason
    c32 = fresh_probe.choose("rms_norm_gated", "cpu", torch.float32)
    assert c32.backend == "reference" and "halfonly computes fp16, not fp32" in c32.reason
    calls.clear()
    x, z, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    out32 = ops.rms_norm_gated(x, z, w)
    out16 = ops.rms_norm_gated(x.half(), z.half(), w.half())
    assert calls == [torch.float16]  # only the fp16 call reached the fp16-only backend
    assert torch.equal(out32, reference.rms_norm_gated(x, z, w))
    assert torch.equal(out16, reference.rms_norm_gated(x.half(), z.half(), w.half()))
    # without a dtype (the report): the device's default (fp32 here), so the policy passes over it as well
    assert fresh_probe.choose("rms_norm_gated", "cpu").backend == "reference"


def test_forced_backend_without_the_default_dtype_is_tested_in_fp16(fresh_probe, monkeypatch):
    calls: list = []
    _fake_backend(monkeypatch, "halfonly", _half_only(calls))
    sys.modules["qwen35_test_halfonly"].DTYPES = (torch.float16,)
    monkeypatch.setenv("QWEN35_BACKEND_RMS_NORM_GATED", "halfonly")
    c = fresh_probe.choose("rms_norm_gated", "cpu")  # what the report asks: no dtype
    assert c.backend == "halfonly" and c.dtype == "float16" and calls == [torch.float16]
    assert "tested in fp16: it computes fp16, not the device's default fp32" in c.reason
    with pytest.raises(RuntimeError, match=r"halfonly was requested for rms_norm_gated on cpu \(float32\), but it "
                                           r"computes fp16, not fp32"):
        fresh_probe.choose("rms_norm_gated", "cpu", torch.float32)


def test_prepare_runs_once_per_device_before_the_self_test(fresh_probe, monkeypatch, caplog):
    prepared: list = []

    def prepare(device):
        prepared.append(device)

    _fake_backend(monkeypatch, "built", {"rms_norm_gated": reference.rms_norm_gated,
                                         "rms_norm_zero_centered": reference.rms_norm_zero_centered})
    sys.modules["qwen35_test_built"].prepare = prepare
    monkeypatch.setitem(fresh_probe.POLICY, "cpu", ("built", "reference"))
    assert fresh_probe.choose("rms_norm_gated", "cpu").backend == "built"
    assert fresh_probe.choose("rms_norm_zero_centered", "cpu").backend == "built"
    assert prepared == [torch.device("cpu")]

    def broken(device):
        prepared.append("broken")
        raise RuntimeError("compiler says: error: qwen35_undeclared_name\nsecond line")

    sys.modules["qwen35_test_built"].prepare = broken
    fresh_probe.reset()
    with caplog.at_level(logging.WARNING, logger="qwen35.probe"):
        a = fresh_probe.choose("rms_norm_gated", "cpu")
        b = fresh_probe.choose("rms_norm_zero_centered", "cpu")
    assert a.backend == b.backend == "reference" and prepared.count("broken") == 1
    assert dict(a.rejected)["built"] == "failed its build (RuntimeError: compiler says: error: qwen35_undeclared_name" \
                                        "\nsecond line)"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "qwen35_undeclared_name" in warned[0] and "second line" in warned[0]


def test_ixformer_facts_list_the_known_calls(fresh_probe, monkeypatch, tmp_path):
    """The probe's ixformer facts: the seven publicly seen calls, found on a package named ``ixformer`` built
    here from the STAND-IN (tests/ixformer_standin.py; not the real library)."""
    assert fresh_probe.IXFORMER_FUNCTIONS == ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "matmul", "softmax",
                                              "flash_attn_func", "gemv")
    pkg = tmp_path / "ixformer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ixformer_standin import *  # noqa: F403\n__version__ = '0.0-standin'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "ixformer" or m.startswith("ixformer.")]:
        monkeypatch.delitem(sys.modules, name)
    version, found = fresh_probe._ixformer_status()
    assert version == "0.0-standin"
    assert found == tuple(f"ixformer.{f}" for f in fresh_probe.IXFORMER_FUNCTIONS)
    for name in [m for m in sys.modules if m == "ixformer" or m.startswith("ixformer.")]:
        monkeypatch.delitem(sys.modules, name)


def test_cli_dtype_and_build_facts():
    """``--dtype`` makes the choices for that dtype; ``--build`` on a host without CUDA is a usage error naming the
    device; the report carries the build's facts (none here)."""
    doc = json.loads(_probe_cli("--json", "--dtype", "float16", env=_clean_env()).stdout)
    assert doc["dtype"] == "float16" and doc["build"] is None and doc["device"]["compute_dtype"] == "float32"
    assert all(r["dtype"] == "float16" and r["backend"] == "reference" for r in doc["ops"])
    text = _probe_cli(env=_clean_env()).stdout
    assert "build    cuda_sm70 not built in this process" in text and "dtype    the device's default (float32)" in text
    run = subprocess.run([sys.executable, "-m", "qwen35.probe", "--build", "--device", "cpu"], capture_output=True,
                         text=True, env=_clean_env())
    assert run.returncode == 2 and "the cuda_sm70 build needs a CUDA device; got cpu" in run.stderr
    forced = subprocess.run([sys.executable, "-m", "qwen35.probe"], capture_output=True, text=True,
                            env=_clean_env(QWEN35_BACKEND="cuda_sm70"))
    assert forced.returncode == 1 and "Traceback" not in forced.stderr
    assert ("qwen35-probe: QWEN35_BACKEND=cuda_sm70 was requested for gdn_chunk_prefill on cpu (float32), but it "
            "cannot run here (needs a CUDA device)") in forced.stderr


def test_build_facts_in_the_text_report(fresh_probe):
    facts = {"key": "abc", "build_dir": "/c/abc", "fresh": True, "seconds": 96.04, "arch": 75,
             "compiler": "/usr/local/cuda/bin/nvcc", "toolkit": "13.0.88"}
    assert fresh_probe.format_build(facts) == ("build    cuda_sm70 compiled in 96.0s: compute_75 with "
                                               "/usr/local/cuda/bin/nvcc (13.0.88) -> /c/abc")
    assert "loaded from the cache" in fresh_probe.format_build({**facts, "fresh": False})
    failed = fresh_probe.format_build({"error": "CudaBuildError: boom"})
    assert failed == "build    cuda_sm70 FAILED: CudaBuildError: boom"


@pytest.mark.parametrize("op", backends.OPS)
def test_selftest_ignores_the_callers_default_device(op):
    """vLLM builds the model, and so runs the probe, under a CUDA default device: the self-test's CPU generator
    and fp64 reference must not follow it (a factory call on that device with a CPU generator raised for every
    Triton op, which then fell back to the reference). Here the ambient default is the meta device."""
    from qwen35 import selftest

    reference_op = getattr(reference, op)

    def candidate(**kwargs):
        with torch.device("cpu"):
            return reference_op(**kwargs)

    with torch.device("meta"):
        err = selftest.check(op, candidate, torch.device("cpu"), torch.float32)
    assert err <= 1e-6, f"{op}: rel err {err:.3e} under a meta default device"


@pytest.mark.parametrize("op", backends.OPS)
def test_selftest_ignores_the_callers_default_dtype(op):
    """vLLM builds the model, and so runs the probe, with the model's dtype (bf16) as torch's default: a case's
    dtype-less draws must not follow it (the rotary angles came out bf16 and qk_norm_rope's input check rejected
    them, which sent the op to the reference). The candidate is the façade op, input checks included; the caller's
    default dtype is restored afterwards."""
    from qwen35 import selftest

    facade = getattr(ops, op)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        err = selftest.check(op, facade, torch.device("cpu"), torch.float32)
        assert torch.get_default_dtype() == torch.bfloat16
    finally:
        torch.set_default_dtype(saved)
    assert err <= selftest.tolerance(op, torch.float32), f"{op}: rel err {err:.3e} under a bf16 default dtype"


# ----------------------------------------------------------------------------- no choice inside a graph capture


def test_no_choice_is_made_inside_a_capture(fresh_probe, monkeypatch):
    """A choice runs self-tests (launches, host reads) that a CUDA-graph capture cannot hold: while the stream
    captures (emulated here), an op whose backend is not chosen yet raises naming the op, device and dtype and the
    call that chooses at load; nothing is cached, and once chosen outside the capture the same call goes through."""
    x = torch.randn(3, 2, 8)
    z = torch.randn(3, 2, 8)
    w = torch.randn(8)
    monkeypatch.setattr(fresh_probe, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"no backend chosen yet for rms_norm_gated on cpu \(float32\) while a "
                                           r"CUDA graph is being captured.*chosen at load, before capture: call "
                                           r"qwen35\.probe\.choose_at_load"):
        ops.rms_norm_gated(x, z, w)
    with pytest.raises(RuntimeError, match=r"gdn_chunk_prefill on cpu \(the device's default dtype\)"):
        fresh_probe.choose("gdn_chunk_prefill", "cpu")
    assert not fresh_probe._CHOICES and not fresh_probe._CAPS
    monkeypatch.setattr(fresh_probe, "is_current_stream_capturing", lambda: False)
    fresh_probe.choose_at_load("cpu", torch.float32, ["rms_norm_gated"], logging.getLogger("t"))
    monkeypatch.setattr(fresh_probe, "is_current_stream_capturing", lambda: True)
    torch.testing.assert_close(ops.rms_norm_gated(x, z, w), reference.rms_norm_gated(x, z, w))
    assert fresh_probe.choose("rms_norm_gated", "cpu").backend == "reference"  # the default dtype: chosen at load too


def test_choose_at_load_covers_every_dtype_asked_and_the_default(fresh_probe):
    ops_ = ["rms_norm_zero_centered", "moe_block"]
    choices = fresh_probe.choose_at_load("cpu", (torch.bfloat16, torch.float32, torch.float64), ops_,
                                         logging.getLogger("t"))
    assert {(c.op, c.dtype) for c in choices} == {(op, dt) for op in ops_ for dt in ("bfloat16", "float32")}
    assert {k for k in fresh_probe._CHOICES} == {(op, "cpu", dt) for op in ops_
                                                 for dt in (torch.bfloat16, torch.float32, None)}
    with pytest.raises(ValueError, match="unknown op 'moe_blok'"):
        fresh_probe.choose_at_load("cpu", torch.float32, ["moe_blok"], logging.getLogger("t"))
