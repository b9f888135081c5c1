"""tuning.results_table: RESULTS.md is current, the latest record of every point wins, each figure names its record."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuning import results_table

REPO = Path(__file__).resolve().parents[1]


def _record(path: Path, rows: list[dict], *, date: str = "2026-01-02", device: str = "Test GPU", **meta) -> None:
    doc = {
        "name": path.stem,
        "device": device,
        "date": date,
        "torch": "2.0",
        "triton": "3.0",
        "meta": meta,
        "rows": rows,
    }
    path.write_text(json.dumps(doc))


def _gdn_prefill(heads: str, seqs: str, ms: float, speedup: float) -> dict:
    return {
        "device": "Test GPU",
        "op": "gdn_chunk_prefill",
        "shape": f"{heads} H=2 HV=8 {seqs}",
        "dtype": "bfloat16",
        "ours_ms": ms,
        "anchor": "fla",
        "anchor_ms": ms * speedup,
        "speedup": speedup,
        "heads": heads,
        "seqs": seqs,
    }


def _moe(shape: str, m: int, us: float) -> dict:
    return {
        "op": "moe_block_routed",
        "shape": f"{shape} M={m}",
        "M": m,
        "ours_ms": us / 1000,
        "anchor_ms": 4 * us / 1000,
        "speedup": 4.0,
        "method": "graph",
        "x_mem_floor": 1.25,
    }


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    """Records of two sessions; in session 2 the index lists the MoE files' calls in reverse name order."""
    d = tmp_path / "results"
    d.mkdir()
    _record(
        d / "gdn_s1_test.json",
        [_gdn_prefill("A-TP1", "1x8192", 0.5, 2.0), _gdn_prefill("A-TP1", "1x32768", 1.5, 1.6)],
        date="2026-01-01",
    )
    _record(d / "gdn_s2_test.json", [_gdn_prefill("A-TP1", "1x8192", 0.4, 2.5)])
    _record(d / "moe_s2_b_test.json", [_moe("S", 1, 30.0), _moe("S", 16, 160.0)])
    _record(d / "moe_s2_a_test.json", [_moe("S", 1, 20.0), _moe("S", 3, 99.0)])
    index = {
        "name": "gpu_suite_s2",
        "session": 2,
        "date": "2026-01-02",
        "calls": [
            {"call": 1, "results": ["moe_s2_b_test.json", "gdn_s2_test.json"]},
            {"call": 2, "results": ["moe_s2_a_test.json (calls.2)"]},
        ],
    }
    (d / "gpu_suite_s2_test.json").write_text(json.dumps(index))
    (d / "experiment_s2_test.json").write_text(json.dumps([{"what": "an experiment log, not a record"}]))
    return d


def test_latest_row_wins_and_cites_its_record(results: Path) -> None:
    text = results_table.render(results)
    gdn = text.split("### GDN prefill")[1].split("###")[0]
    row = next(line for line in gdn.splitlines() if line.startswith("| A-TP1"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = [
        c.strip() for c in next(line for line in gdn.splitlines() if line.startswith("| heads")).strip("|").split("|")
    ]
    by_col = dict(zip(header, cells, strict=True))
    # 1x8192 comes from session 2 (0.4 ms, 2.50x), 1x32768 only session 1 measured (1.5 ms, 1.60x)
    assert by_col["1x8192"] == "400.0 µs, 2.50x [2]"
    assert by_col["1x32768"] == "1.500 ms, 1.60x [1]"
    assert "[1] Source: `gdn_s1_test.json` (2026-01-01" in gdn
    assert "[2] Source: `gdn_s2_test.json` (2026-01-02" in gdn


def test_call_order_from_the_suite_index_beats_file_names(results: Path) -> None:
    text = results_table.render(results)
    moe = text.split("### MoE block")[1]
    m1 = next(line for line in moe.splitlines() if line.startswith("| S | 1 |"))
    m16 = next(line for line in moe.splitlines() if line.startswith("| S | 16 |"))
    legend = dict(re.findall(r"\[(\d)\] Source: `([^`]+)`", moe))
    # call 2 (moe_s2_a) measured M=1 after call 1 (moe_s2_b), although "a" sorts first by name
    assert "20.00 µs" in m1 and legend[m1.rstrip(" |").split("|")[-1].strip()] == "moe_s2_a_test.json"
    assert "160.0 µs" in m16 and legend[m16.rstrip(" |").split("|")[-1].strip()] == "moe_s2_b_test.json"
    assert "| S | 3 |" not in moe, "token counts off the benchmark grid stay out of the table"
    assert "1.25x" in m1 and "4.00x" in m1


def test_devices_get_their_own_sections(results: Path) -> None:
    _record(results / "gdn_s3_other.json", [_gdn_prefill("B-TP8", "1x8192", 0.2, 5.0)], device="Other GPU")
    text = results_table.render(results)
    assert text.index("## Other GPU") < text.index("## Test GPU")
    other = text.split("## Other GPU")[1].split("## Test GPU")[0]
    assert "B-TP8" in other and "A-TP1" not in other and "`gdn_s3_other.json`" in other


def test_committed_table_is_current_and_names_existing_records() -> None:
    committed = (REPO / "tuning" / "RESULTS.md").read_text()
    assert committed == results_table.render(REPO / "tuning" / "results"), (
        "tuning/RESULTS.md is not current: run `python -m tuning.results_table`"
    )
    cited = set(re.findall(r"Source: `([^`]+\.json)`", committed))
    assert cited, "the table names no source"
    for name in cited:
        assert (REPO / "tuning" / "results" / name).is_file(), name
    assert "DESIGN.md" not in committed


def test_non_finite_figures_are_refused(results: Path) -> None:
    _record(results / "gdn_s3_test.json", [_gdn_prefill("A-TP1", "1x8192", float("nan"), 2.0)], date="2026-01-03")
    with pytest.raises(results_table.ResultsError, match=r"gdn_s3_test\.json.*ours_ms=nan"):
        results_table.render(results)


def test_bad_directories_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(results_table.ResultsError, match="does not exist"):
        results_table.render(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.json").write_text("{}")
    with pytest.raises(results_table.ResultsError, match="no benchmark records"):
        results_table.render(empty)
    (empty / "broken.json").write_text("{not json")
    with pytest.raises(results_table.ResultsError, match=r"broken\.json: not valid JSON"):
        results_table.render(empty)


def test_cli_writes_and_checks(results: Path, tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    cmd = [sys.executable, "-m", "tuning.results_table", "--results", str(results), "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert out.read_text() == results_table.render(results)
    assert subprocess.run([*cmd, "--check"], cwd=REPO, capture_output=True).returncode == 0
    out.write_text(out.read_text() + "edited by hand\n")
    stale = subprocess.run([*cmd, "--check"], cwd=REPO, capture_output=True, text=True)
    assert stale.returncode == 1 and "not current" in stale.stderr
    bad = subprocess.run(
        [*cmd[:-4], "--results", str(tmp_path / "nope"), "--out", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr
