"""The peer benchmark (tuning/bench_gdn_peers.py) on CPU: ``--tiny`` runs ours and the forced cut path on tiny shapes
in Triton's interpreter and writes a record whose rows carry the fields the GPU run's rows carry; the peers (FlashQLA,
FLA) are GPU-only and are skipped with the reason; bad arguments are refused."""

from __future__ import annotations

import json
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (also done by conftest)

import pytest
import torch

from tuning import bench_gdn_peers


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite's gdn_peers part runs the real set")
def test_tiny_run_writes_the_rows(tmp_path, capsys):
    rc = bench_gdn_peers.main(["--tiny", "--out", str(tmp_path), "--budget", "600", "--cut-segments", "1,auto"])
    assert rc == 0
    doc = json.loads((tmp_path / "gdn_peers_cpu.json").read_text())
    rows = doc["rows"]
    assert all(k in r for r in rows for k in ("device", "op", "shape", "dtype", "impl", "gpu_ms", "call_ms"))
    assert not [r for r in rows if "error" in r], rows
    prefill = [r for r in rows if r["op"] == "gdn_prefill_peers"]
    assert {r["impl"] for r in prefill} == {"ours", "ours_cut"}
    assert {r["cut"] for r in prefill if r["impl"] == "ours_cut"} == {1, 4}  # 'auto' is 4 chunks at 300 tokens
    for r in prefill:
        assert r["gpu_ms"] is None and r["call_ms"] > 0
        if r["impl"] == "ours_cut":
            assert 0 < r["rel_vs_ours"] < 1e-4, r  # the same math, other rounding
    assert [r["impl"] for r in rows if r["op"] == "gdn_decode_peers"] == ["ours"]
    assert doc["meta"]["not_run"] == []
    assert "ours_cut@1" in capsys.readouterr().out


def test_peers_need_a_gpu_and_bad_impls_are_refused(monkeypatch):
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)  # restored after the test
    peers, status = bench_gdn_peers.load_peers(["flashqla", "fla_triton"], gpu=False)
    assert peers == {} and status == {"flashqla": "skipped: needs a CUDA device",
                                      "fla_triton": "skipped: needs a CUDA device"}
    assert os.environ.get("FLA_FLASH_QLA") == "0"  # set before FLA could be imported
    with pytest.raises(SystemExit):
        bench_gdn_peers.main(["--tiny", "--impls", "ours,bogus"])
