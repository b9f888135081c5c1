"""The tuned-config loader (kernels_triton/_config.py), on a CPU: the package's own files, a user directory whose
entries win shape by shape (``QWEN35_CONFIG_DIR``, default ``~/.cache/qwen35/configs``), the nearest token bucket, a
bucket where the heuristic stays, a missing file or shape that gives None and one INFO line, and files that cannot be
used (corrupt, malformed, another device, Triton minor version or search space) that give one WARNING and the
heuristic, never an error."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from kernels_triton import _config, bench_api

ROOT = Path(__file__).resolve().parent.parent
H200 = "NVIDIA H200"
KEY = "E=256,N=1024,K=2048,dtype=bfloat16"  # 35B-A3B's gate_up, tuned on the H200


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user config directory in force, the loader's caches clear before and after."""
    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    _config.clear_cache()
    yield tmp_path
    _config.clear_cache()


def _write(root: Path, slug: str, op: str, entries: dict) -> None:
    (root / slug).mkdir(parents=True, exist_ok=True)
    (root / slug / f"{op}.json").write_text(json.dumps({"op": op, "entries": entries}))


def test_shipped_configs_are_package_data(user_dir):
    """The H200's MoE files live in the package (kernels_triton/configs), the loader reads them from there, and the
    wheel's package data takes them along."""
    shipped = bench_api.shipped_config_dir()
    assert shipped == ROOT / "kernels_triton" / "configs"
    assert sorted(p.name for p in (shipped / "nvidia_h200").iterdir()) == ["moe_down.json", "moe_gate_up.json"]
    want = json.loads((shipped / "nvidia_h200" / "moe_gate_up.json").read_text())["entries"][KEY]["1"]
    assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) == want
    if sys.version_info >= (3, 11):
        import tomllib

        data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
        assert "configs/**/*.json" in data["kernels_triton"]


def test_a_user_file_wins_over_the_shipped_one_shape_by_shape(user_dir):
    entry = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 2, "num_stages": 2}
    _write(user_dir, "nvidia_h200", "moe_gate_up", {KEY: {"1": entry}})
    _config.clear_cache()
    # the user's shape replaces the shipped one whole: every token count of it comes from the user's buckets
    assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) == entry
    assert _config.lookup("moe_gate_up", H200, KEY, tokens=4096) == entry
    # a shape only the shipped file has is still found there
    other = "E=512,N=512,K=4096,dtype=bfloat16"
    shipped = json.loads((bench_api.shipped_config_dir() / "nvidia_h200" / "moe_gate_up.json").read_text())
    assert _config.lookup("moe_gate_up", H200, other, tokens=16) == shipped["entries"][other]["16"]
    # another op keeps the shipped file
    assert _config.lookup("moe_down", H200, "E=256,N=2048,K=512,dtype=bfloat16", tokens=1) is not None
    assert bench_api.config_sources("moe_experts", H200) == [
        str(bench_api.shipped_config_dir() / "nvidia_h200" / "moe_gate_up.json"),
        str(user_dir / "nvidia_h200" / "moe_gate_up.json"),
        str(bench_api.shipped_config_dir() / "nvidia_h200" / "moe_down.json")]


def test_the_default_user_directory_is_in_the_home_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("QWEN35_CONFIG_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bench_api.user_config_dir() == tmp_path / ".cache" / "qwen35" / "configs"
    _write(tmp_path / ".cache" / "qwen35" / "configs", "some_gpu", "gdn_chunk_scan", {"HV=8,V=128": {"64": {"BV": 16}}})
    _config.clear_cache()
    try:
        assert _config.lookup("gdn_chunk_scan", "Some GPU", "HV=8,V=128", tokens=64) == {"BV": 16}
    finally:
        _config.clear_cache()


def test_the_nearest_bucket_in_log_space_and_only_the_fields_asked_for(user_dir):
    _write(user_dir, "some_gpu", "op", {"k": {"16": {"BV": 16, "ms": 1.0}, "1024": {"BV": 64, "ms": 2.0}}})
    assert _config.lookup("op", "Some GPU", "k", tokens=100)["BV"] == 16  # log2: 100 is nearer 16 than 1024
    assert _config.lookup("op", "Some GPU", "k", tokens=200)["BV"] == 64
    assert _config.lookup("op", "Some GPU", "k", tokens=200, fields=("BV",)) == {"BV": 64}


def test_a_missing_file_or_shape_gives_none_and_one_info_line(user_dir, caplog):
    with caplog.at_level(logging.INFO, logger="qwen35.kernels_triton"):
        for _ in range(3):
            assert _config.lookup("moe_gate_up", "No Such GPU", KEY, tokens=4) is None
            assert _config.lookup("moe_gate_up", H200, "E=1,N=2,K=3,dtype=bfloat16", tokens=4) is None
    lines = [r.getMessage() for r in caplog.records if "no tuned moe_gate_up config" in r.getMessage()]
    assert len(lines) == 2 and "No Such GPU" in lines[0] and "E=1,N=2,K=3" in lines[1], lines


def test_a_heuristic_bucket_gives_none_there_and_the_neighbour_elsewhere(user_dir):
    """A bucket where the tuner kept the heuristic stops a neighbouring bucket's config from reaching it."""
    tuned = {"BV": 64, "num_warps": 4, "num_stages": 2, "tuned_ms": 1.0, "heuristic_ms": 1.2}
    _write(user_dir, "some_gpu", "gdn_chunk_scan", {"k": {"1024": tuned, "16384": {"heuristic": True,
                                                                                   "heuristic_ms": 3.0}}})
    assert _config.lookup("gdn_chunk_scan", "Some GPU", "k", tokens=2048, fields=("BV",)) == {"BV": 64}
    assert _config.lookup("gdn_chunk_scan", "Some GPU", "k", tokens=16384) is None
    assert _config.lookup("gdn_chunk_scan", "Some GPU", "k", tokens=8192) is None


def test_the_shipped_h200_files_keep_loading():
    """The hand-tuned H200 files (no search-space hash, no provenance) pass the loader's checks on this Triton."""
    for op in ("moe_gate_up", "moe_down"):
        data, why = bench_api.read_config_file(bench_api.shipped_config_dir() / "nvidia_h200" / f"{op}.json", H200,
                                               op)
        assert why is None and data["entries"], why


def _bad_files(current_hash: str) -> dict[str, tuple[str, str]]:
    """name -> (file text, what the WARNING must say)."""
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    good = {"E=8,N=128,K=128,dtype=float32": {"4": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 2,
                                                     "num_stages": 2}}}
    doc = {"device": "cpu", "op": "moe_gate_up", "triton": triton.__version__, "search_space": current_hash,
           "entries": good}
    return {
        "corrupt": ('{"device": "cpu", "entries": {', "unreadable"),
        "not an object": ("[1, 2, 3]", "not a JSON object"),
        "malformed entries": (json.dumps({**doc, "entries": {"k": [1, 2]}}), "'entries' is not an object"),
        "non-numeric bucket": (json.dumps({**doc, "entries": {"k": {"many": {}}}}), "'entries' is not an object"),
        "another Triton": (json.dumps({**doc, "triton": f"{major}.{minor + 1}.0"}),
                           f"tuned with Triton {major}.{minor + 1}.0"),
        "another search space": (json.dumps({**doc, "search_space": "0123456789abcdef"}), "search space"),
        "another device": (json.dumps({**doc, "device": "NVIDIA H200"}), "for device 'NVIDIA H200'"),
        "another op": (json.dumps({**doc, "op": "moe_down"}), "for op 'moe_down'"),
    }


def test_files_that_cannot_be_used_give_one_warning_and_the_heuristic(user_dir, caplog):
    """Each kind of bad user file for the MoE gate_up GEMM on this (CPU) device: one WARNING naming the file and the
    reason (however many lookups), the op's own heuristic config, and the op's output still right."""
    import torch

    from kernels_triton import moe as tmoe
    from kernels_triton.moe import bench_api as moe_api
    from qwen35 import reference as ref

    E, k, H, I, M = 8, 2, 128, 64, 4
    heuristic = moe_api.configs(M, k, E, H, I, torch.float32, torch.device("cpu"))
    assert heuristic[0] == moe_api.heuristic("gate_up", M, k, E, 2 * I, H)
    gen = torch.Generator().manual_seed(3)
    x, w13, w2 = torch.randn(M, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen) * H**-0.5, \
        torch.randn(E, H, I, generator=gen) * I**-0.5
    weights, ids = ref.moe_route(torch.randn(M, E, generator=gen), k)
    want = ref.moe_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    path = user_dir / "cpu" / "moe_gate_up.json"
    path.parent.mkdir(parents=True)
    for name, (text, reason) in _bad_files(bench_api.declared_hash("moe_gate_up")).items():
        path.write_text(text)
        bench_api.clear_config_cache()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qwen35.kernels_triton"):
            for _ in range(3):
                assert moe_api.configs(M, k, E, H, I, torch.float32, torch.device("cpu")) == heuristic, name
                out = tmoe.moe_experts(x, w13, w2, weights, ids)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0] and reason in warnings[0], (name, warnings)
        assert bench_api.config_sources("moe_experts", "cpu") == [], name
        assert float((out.double() - want).norm() / want.norm()) < 1e-5, name


def test_a_good_user_file_is_used_and_a_bad_one_falls_back_to_the_shipped_file(user_dir, caplog):
    import triton

    entry = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 2, "num_stages": 2}
    doc = {"device": H200, "op": "moe_gate_up", "triton": triton.__version__,
           "search_space": bench_api.declared_hash("moe_gate_up"), "entries": {KEY: {"1": entry}}}
    folder = user_dir / "nvidia_h200"
    folder.mkdir(parents=True)
    (folder / "moe_gate_up.json").write_text(json.dumps(doc))
    bench_api.clear_config_cache()
    assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) == entry
    (folder / "moe_gate_up.json").write_text(json.dumps({**doc, "search_space": "ffffffffffffffff"}))
    bench_api.clear_config_cache()
    shipped = json.loads((bench_api.shipped_config_dir() / "nvidia_h200" / "moe_gate_up.json").read_text())
    with caplog.at_level(logging.WARNING, logger="qwen35.kernels_triton"):
        assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) == shipped["entries"][KEY]["1"]
    assert sum("search space" in r.getMessage() for r in caplog.records) == 1


def test_heuristics_only_turns_every_lookup_off_for_its_duration(user_dir):
    assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) is not None
    with bench_api.heuristics_only():
        assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) is None
    assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) is not None


@pytest.mark.parametrize("name,slug", [
    ("NVIDIA H200", "nvidia_h200"), ("  NVIDIA  H200 ", "nvidia_h200"), ("NVIDIA H200 NVL", "nvidia_h200_nvl"),
    ("Tesla V100-SXM2-32GB", "tesla_v100_sxm2_32gb"), ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090"),
    ("Iluvatar BI-V100", "iluvatar_bi_v100"), ("cpu", "cpu"), ("--", "unknown"),
    ("H100/PCIe (80GB)", "h100_pcie_80gb")])
def test_device_names_normalise_to_directory_names(name, slug):
    assert bench_api.device_slug(name) == slug
