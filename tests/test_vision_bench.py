"""tuning/bench_vision.py runs on CPU with --tiny: its rows are complete and its agreement row is within 1e-4."""

from __future__ import annotations

import json
import math

import pytest

from tuning import bench_vision

pytest.importorskip("transformers")


def test_tiny_run_writes_complete_rows(tmp_path, capsys):
    assert bench_vision.main(["--tiny", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "vision.json").read_text())
    rows = {(r["op"], r["shape"]): r for r in doc["rows"]}
    agreement = [r for r in doc["rows"] if r["op"] == "agreement"]
    assert agreement and all(r["rel_err"] <= 1e-4 for r in agreement)
    for size, batches in bench_vision.TINY["sizes"].items():
        for b in batches:
            r = rows[("encode", f"{b}x{size}^2")]
            assert math.isfinite(r["images_per_s"]) and r["images_per_s"] > 0 and r["hf_images_per_s"] > 0
            assert r["tokens_per_image"] == (size // 16) ** 2 // 4
        assert rows[("preprocess", f"1x{size}^2")]["images_per_s"] > 0
    assert "images_per_s" in capsys.readouterr().out  # the table is printed


def test_full_size_needs_a_gpu_or_tiny():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full-size run is valid")
    with pytest.raises(SystemExit):
        bench_vision.main([])
