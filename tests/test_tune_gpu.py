"""``qwen35-tune`` on a GPU (skipped without one): a short run of every tunable op of a small MoE preset at one bucket
each writes files the loader takes, whose configs the ops then use, never slower than the heuristic by the tuner's
own measurement; a rerun skips them."""

from __future__ import annotations

import json

import pytest
import torch

from kernels_triton import bench_api
from tuning import tune

pytestmark = pytest.mark.gpu


def test_a_short_run_writes_configs_the_ops_use(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QWEN35_CONFIG_DIR", str(tmp_path))
    argv = ["--model", "397b-a17b", "--tp", "8", "--decode-buckets", "16", "--prefill-buckets", "4096",
            "--budget-min", "1.5", "--summary", str(tmp_path / "summary")]
    assert tune.main(argv) == 0
    name = torch.cuda.get_device_name()
    folder = tmp_path / bench_api.device_slug(name)
    for op in ("gdn_chunk_scan", "gdn_recurrent_step", "moe_gate_up", "moe_down"):
        data, why = bench_api.read_config_file(folder / f"{op}.json", name, op)
        assert why is None, (op, why)
        assert data["provenance"]["capability"] and data["search_space"] == bench_api.declared_hash(op)
        for buckets in data["entries"].values():
            for entry in buckets.values():
                assert entry["heuristic_ms"] > 0 and entry["tried"] >= 1
                if not entry.get("heuristic"):
                    assert entry["tuned_ms"] <= entry["heuristic_ms"], (op, entry)
    assert bench_api.config_sources("moe_block", name)[-1] == str(folder / "moe_down.json")
    rows = json.loads(next((tmp_path / "summary").glob("*.json")).read_text())["rows"]
    assert {r["op"] for r in rows} == {"gdn_chunk_scan", "gdn_recurrent_step", "moe_gemm"}
    capsys.readouterr()
    assert tune.main(argv) == 0
    assert capsys.readouterr().out.count("skipped: already in") == 3
