"""``qwen35-tune`` without running a kernel: the plan of every preset at every TP (shapes per rank, buckets, search
spaces that hold the heuristics' configs and leave out what the device cannot run or the code records as
miscompiled), the dry run, and every kind of bad input (exit status 2, one line naming the value and what is
accepted)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels_triton import bench_api
from kernels_triton.gdn import bench_api as gdn_api
from kernels_triton.moe import bench_api as moe_api
from qwen35.tiny import TinySpec, config_json
from tuning import tune
from tuning.tune_model import PRESETS, TPS, USUAL_TP
from tuning.tune_ops import TUNABLES, GdnScan, MoeGemm, MoeShape, pair

SM90 = bench_api.SM90_LIMITS
# (GDN key heads, value heads, MoE (E, top_k, H, I) or None) of each preset at TP 1
SIZES = {"27b": (16, 48, None), "35b-a3b": (16, 32, (256, 8, 2048, 512)), "122b-a10b": (16, 64, (256, 8, 3072, 1024)),
         "397b-a17b": (16, 64, (512, 10, 4096, 1024))}


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    """Plans as on a machine without a GPU (no kernel runs here): for an sm_90 device."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _plan(*argv: str) -> tuple:
    return tune.plan(tune._parser().parse_args(list(argv)))


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("tp", TPS)
def test_the_plan_of_every_preset_and_tp(preset, tp, capsys):
    rank, dtype, tasks, facts = _plan("--model", preset, "--tp", str(tp))
    H, HV, moe = SIZES[preset]
    assert (rank.gdn_key_heads, rank.gdn_value_heads, rank.key_dim, rank.value_dim) == (H // tp, HV // tp, 128, 128)
    assert dtype == torch.bfloat16
    ops = {t.tunable for t in tasks}
    assert ops == ({"gdn_chunk_scan", "gdn_recurrent_step"} | ({"moe_gemm"} if moe else set()))
    by_op = {op: [t for t in tasks if t.tunable == op] for op in ops}
    assert [t.bucket for t in by_op["gdn_recurrent_step"]] == list(tune.DECODE_BUCKETS)
    assert [t.bucket for t in by_op["gdn_chunk_scan"]] == [1024, 4096, 16384]
    assert all(t.files == {"gdn_chunk_scan": f"HV={HV // tp},V=128,dtype=bfloat16"} for t in by_op["gdn_chunk_scan"])
    assert all(t.files == {"gdn_recurrent_step": f"HV={HV // tp},V=128"} for t in by_op["gdn_recurrent_step"])
    if moe:
        E, k, hidden, I = moe
        assert [t.bucket for t in by_op["moe_gemm"]] == [4, 16, 64, 256, 1024, 4096, 16384]  # one token: decode path
        keys = {"moe_gate_up": f"E={E},N={2 * I // tp},K={hidden},dtype=bfloat16",
                "moe_down": f"E={E},N={hidden},K={I // tp},dtype=bfloat16"}
        assert all(t.files == keys for t in by_op["moe_gemm"])
        s = MoeShape(E, k, hidden, I // tp)
        for t in by_op["moe_gemm"]:  # the heuristic pair of every bucket lies in the space it is searched from
            M = t.bucket
            h = pair(moe_api.heuristic("gate_up", M, k, E, 2 * s.I, hidden), moe_api.heuristic("down", M, k, E, hidden,
                                                                                                 s.I))
            assert t.excluded(h) is None, (preset, tp, M, h, t.excluded(h))
    assert facts["device"] is None and facts["limits"] == SM90  # no GPU here: planned for an sm_90 device
    for t in tasks:
        assert t.size > 0 and t.space_hash[next(iter(t.files))] == bench_api.declared_hash(next(iter(t.files)))
    assert tune.main(["--model", preset, "--tp", str(tp), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"model {preset} at TP {tp}" in out and f"{len(tasks)} buckets" in out
    assert "cuda_sm70 (not tunable" in out and "causal_conv1d_prefill" in out


def test_usual_tps_are_plannable():
    for preset, tps in USUAL_TP.items():
        for tp in tps:
            assert _plan("--model", preset, "--tp", str(tp))[2]


def test_buckets_from_the_command_line():
    _, _, tasks, _ = _plan("--model", "35b-a3b", "--decode-buckets", "8,1,8", "--prefill-buckets", "3000,512")
    got = {op: [t.bucket for t in tasks if t.tunable == op] for op in TUNABLES}
    assert got == {"gdn_chunk_scan": [512, 2048],  # tokens per sequence, as the lookup rounds them (down to 2^n)
                   "gdn_recurrent_step": [1, 8], "moe_gemm": [8, 512, 3000]}
    assert GdnScan.counts(1024) == [16, 1] and GdnScan.counts(16384) == [1]
    assert MoeGemm().buckets([1, 2], [1]) == [2]


def test_ops_by_tunable_or_op_table_name():
    _, _, tasks, _ = _plan("--model", "35b-a3b", "--ops", "gdn_chunk_prefill,moe_block")
    assert {t.tunable for t in tasks} == {"gdn_chunk_scan", "moe_gemm"}
    _, _, tasks, _ = _plan("--model", "27b", "--ops", "gdn_recurrent_step")
    assert {t.tunable for t in tasks} == {"gdn_recurrent_step"}


def test_model_from_a_checkpoint_directory_and_a_config_file(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config_json(TinySpec(moe=True, conditional=True))))
    rank, _, tasks, _ = _plan("--model", str(tmp_path / "ckpt"), "--tp", "2", "--dtype", "fp16")
    assert (rank.gdn_value_heads, rank.experts, rank.expert_width) == (2, 8, 32)
    assert {t.tunable for t in tasks} == set(TUNABLES)
    rank, _, _, _ = _plan("--model", str(tmp_path / "ckpt" / "config.json"))
    assert rank.model == "ckpt" and rank.gdn_value_heads == 4


# ----------------------------------------------------------------------------- search spaces


def test_the_scan_space_leaves_out_the_miscompiled_bf16_configs_on_a_gpu():
    gpu = gdn_api.scan_search_space(128, 128, torch.bfloat16, SM90)
    interp = gdn_api.scan_search_space(128, 128, torch.bfloat16, bench_api.DeviceLimits(None, None, None, None))
    bad = [c for c in interp if c["num_stages"] == 1 and c["BV"] < 64]
    assert bad and not [c for c in gpu if c in bad]
    assert all("miscompiled" in gdn_api.scan_excluded(c, 128, 128, torch.bfloat16, SM90) for c in bad)
    fp16 = gdn_api.scan_search_space(128, 128, torch.float16, SM90)
    assert {"BV": 32, "num_warps": 4, "num_stages": 1} in fp16  # the fp32 workspace is built right at every BV


def test_spaces_shrink_with_the_device_limits():
    small = bench_api.DeviceLimits(shared_memory=101_376, registers=65_536, max_threads=1024, capability=(8, 6))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        big, little = (gdn_api.scan_search_space(128, 128, dtype, lim) for lim in (SM90, small))
        assert set(map(str, little)) < set(map(str, big))
        assert all(gdn_api.scan_excluded(c, 128, 128, dtype, small) is None for c in little)
        args = (1024, 8, 256, 1024, 2048, dtype)
        big, little = (moe_api.search_space("gate_up", *args, lim) for lim in (SM90, small))
        assert 0 < len(little) < len(big) and set(little) < set(big)
        assert all("shared memory" in moe_api.excluded("gate_up", c, *args, small) for c in set(big) - set(little))
    few_threads = bench_api.DeviceLimits(None, None, 128, None)
    assert {c["num_warps"] for c in gdn_api.step_search_space(128, 128, few_threads)} == {1, 2, 4}
    assert all(c["BV"] <= 32 for c in gdn_api.step_search_space(128, 32, few_threads))


def test_the_gpu_heuristics_lie_in_their_spaces(monkeypatch):
    """The decode step's and the one-pass scan's configs that the heuristics choose on an sm_90 device with 132 SMs
    are inside the spaces the tuner searches (the split scan is outside by design: a tuned entry runs one pass)."""
    from kernels_triton.gdn import plan, recurrent

    for module in (plan, recurrent):
        monkeypatch.setattr(module, "device_facts", lambda device: ("test-gpu", 132, (9, 0)))
    monkeypatch.setattr(plan, "shared_memory_per_block", lambda device: SM90.shared_memory)
    dev = torch.device("cuda", 0)
    bench_api.clear_config_cache()
    try:
        for HV in (4, 6, 8, 12, 16, 24, 32, 48, 64):
            for B in (1, 4, 16, 64, 256, 1024):
                cfg = dict(gdn_api.decode_config(dev, B, HV, 128))
                cfg.setdefault("STREAM", False)
                assert gdn_api.step_excluded(cfg, 128, 128, SM90) is None, (HV, B, cfg)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for P in (1024, 4096, 16384):
                    for N in GdnScan.counts(P):
                        cfg = gdn_api.scan_config(dev, N, HV, 128, 128, P, dtype)
                        if not cfg.get("SPLIT"):
                            one_pass = {k: cfg[k] for k in gdn_api.SCAN_SEARCH_SPACE}
                            assert gdn_api.scan_excluded(one_pass, 128, 128, dtype, SM90) is None, (HV, P, N, cfg)
    finally:
        bench_api.clear_config_cache()


# ----------------------------------------------------------------------------- bad input


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        rc = tune.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def _bad_configs(tmp_path) -> dict[str, str]:
    broken = tmp_path / "broken.json"
    broken.write_text('{"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": ')
    lacking = tmp_path / "lacking.json"
    lacking.write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64}))
    alien = tmp_path / "alien.json"
    alien.write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(config_json(TinySpec(moe=True, overrides=dict(
        linear_num_key_heads=4, linear_num_value_heads=12)))))
    return {"broken": str(broken), "lacking": str(lacking), "alien": str(alien), "odd": str(odd)}


@pytest.mark.parametrize("case", ["preset", "no-config-dir", "broken", "lacking", "alien", "tp-heads", "tp-value",
                                  "tp-text", "op", "untuned-op", "dense-moe", "dtype", "backend", "sm70", "buckets",
                                  "budget", "jobs", "missing-model"])
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    files = _bad_configs(tmp_path)
    argv, expect = {
        "preset": (["--model", "70b"], ["'70b'", "27b, 35b-a3b, 122b-a10b, 397b-a17b", "config.json"]),
        "no-config-dir": (["--model", str(tmp_path)], [str(tmp_path), "no config.json"]),
        "broken": (["--model", files["broken"]], [files["broken"], "malformed config.json"]),
        "lacking": (["--model", files["lacking"]], [files["lacking"], "malformed", "lacks"]),
        "alien": (["--model", files["alien"]], ["LlamaForCausalLM", "supported"]),
        "tp-heads": (["--model", files["odd"], "--tp", "8"], ["--tp 8", "linear_num_value_heads=12",
                                                             "accepted for it: 1, 2, 4"]),
        "tp-value": (["--model", "27b", "--tp", "3"], ["--tp 3", "accepted 1, 2, 4, 8"]),
        "tp-text": (["--model", "27b", "--tp", "two"], ["'two'", "accepted 1, 2, 4, 8"]),
        "op": (["--model", "27b", "--ops", "gdn_recurrent_step,flash"], ["'flash'", "accepted: gdn_chunk_scan"]),
        "untuned-op": (["--model", "27b", "--ops", "causal_conv1d_prefill"], ["causal_conv1d_prefill",
                                                                              "no tuned config", "accepted"]),
        "dense-moe": (["--model", "27b", "--ops", "moe_gemm"], ["moe_gemm", "dense", "accepted for it"]),
        "dtype": (["--model", "27b", "--dtype", "int8"], ["'int8'", "accepted bf16, fp16, fp32"]),
        "backend": (["--model", "27b", "--backend", "cuda"], ["'cuda'", "accepted triton, cuda_sm70"]),
        "sm70": (["--model", "27b", "--backend", "cuda_sm70"], ["cuda_sm70", "not tunable", "accepted: triton"]),
        "buckets": (["--model", "27b", "--decode-buckets", "1,x"], ["'1,x'", "positive integers"]),
        "budget": (["--model", "27b", "--budget-min", "0"], ["--budget-min 0", "positive"]),
        "jobs": (["--model", "27b", "--jobs", "-1"], ["'-1'", "0 to 64"]),
        "missing-model": ([], ["--model"]),
    }[case]
    for dry in ([], ["--dry-run"]):
        rc, err = _run(argv + dry, capsys)
        assert rc == 2 and len(err) == 1, (case, err)
        assert all(e in err[0] for e in expect), (case, err[0])


def test_tuning_without_a_gpu_exits_2_and_the_dry_run_works(capsys, tmp_path):
    rc, err = _run(["--model", "35b-a3b", "--out", str(tmp_path)], capsys)
    assert rc == 2 and err == [f"qwen35-tune: error: {tune.NO_GPU}"]
    assert not any(tmp_path.iterdir())
    assert tune.main(["--model", "35b-a3b", "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no GPU here" in out and "moe_gate_up.json, moe_down.json" in out


# ----------------------------------------------------------------------------- the probe's report


def test_the_probe_names_the_config_files_behind_each_op(tmp_path, monkeypatch, fresh_probe):
    import triton

    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    bench_api.clear_config_cache()
    try:
        h200 = fresh_probe.DeviceCaps(device="cuda:0", vendor="nvidia", name="NVIDIA H200", capability=(9, 0))
        shipped = bench_api.shipped_config_dir() / "nvidia_h200"
        assert fresh_probe.config_files("moe_block", "triton", h200) == [str(shipped / "moe_gate_up.json"),
                                                                         str(shipped / "moe_down.json")]
        assert fresh_probe.config_files("gdn_chunk_prefill", "triton", h200) == "heuristic"
        assert fresh_probe.config_files("rms_norm_gated", "triton", h200) == "heuristic"
        assert fresh_probe.config_files("moe_block", "cuda_sm70", h200) == "heuristic"
        cpu = fresh_probe.device_caps("cpu")
        path = tmp_path / "cpu" / "gdn_recurrent_step.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"device": "cpu", "op": "gdn_recurrent_step", "triton": triton.__version__,
                                    "search_space": bench_api.declared_hash("gdn_recurrent_step"),
                                    "entries": {"HV=4,V=32": {"1": {"BV": 16, "num_warps": 1}}}}))
        bench_api.clear_config_cache()
        assert fresh_probe.config_files("gdn_recurrent_step", "triton", cpu) == [str(path)]
        path.write_text("{")
        bench_api.clear_config_cache()
        assert fresh_probe.config_files("gdn_recurrent_step", "triton", cpu) == "heuristic"
        rows = fresh_probe.report("cpu")["ops"]
        assert [r["op"] for r in rows] == list(fresh_probe.optable.NAMES)
        assert all(r["config"] == "heuristic" for r in rows)  # the CPU runs the reference
    finally:
        bench_api.clear_config_cache()
