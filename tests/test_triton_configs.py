"""The tuned-config loader (kernels_triton/_config.py), on a CPU: the package's own files, a user directory whose
files win (``QWEN35_CONFIG_DIR``, default ``~/.cache/qwen35/configs``), the nearest token bucket, and a missing file
or shape that gives None and one INFO line."""

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
    (root / slug / f"{op}.json").write_text(json.dumps({"device": H200, "op": op, "entries": entries}))


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


def test_a_user_file_wins_over_the_shipped_one(user_dir):
    entry = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 2, "num_stages": 2}
    _write(user_dir, "nvidia_h200", "moe_gate_up", {KEY: {"1": entry}})
    _config.clear_cache()
    assert _config.lookup("moe_gate_up", H200, KEY, tokens=1) == entry
    # the user's file replaces the shipped one for that op: a shape only the shipped file has is not found
    other = "E=512,N=512,K=4096,dtype=bfloat16"
    shipped = json.loads((bench_api.shipped_config_dir() / "nvidia_h200" / "moe_gate_up.json").read_text())
    assert other in shipped["entries"] and _config.lookup("moe_gate_up", H200, other) is None
    # another op keeps the shipped file
    assert _config.lookup("moe_down", H200, "E=256,N=2048,K=512,dtype=bfloat16", tokens=1) is not None


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
