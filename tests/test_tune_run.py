"""``qwen35-tune``'s run loop on the CPU, in Triton's interpreter (timed by wall clock): a wrong candidate is
rejected and never written, a crashing one too, a config no faster than the heuristic is not written, finished
buckets are skipped by a rerun, an interrupt (SIGINT) leaves valid files, and writes are atomic. The files written
are read back by the loader."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels_triton import bench_api  # noqa: E402
from kernels_triton.gdn import bench_api as gdn_api  # noqa: E402
from qwen35.tiny import TinySpec, config_json  # noqa: E402
from tuning import tune, tune_files, tune_run  # noqa: E402
from tuning.tune_model import load_model, shard  # noqa: E402
from tuning.tune_ops import GdnStep, WarmPool  # noqa: E402
from tuning.tune_run import Part, Task, Workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs: CPU only")
CPU = torch.device("cpu")
N = 16416  # 16 x 1026 = 32 x 513: not a multiple of 64


@triton.jit
def _double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, 2.0 * tl.load(x_ptr + offs, mask=mask), mask=mask)


def double(x: torch.Tensor, y: torch.Tensor, block: int) -> torch.Tensor:
    """y = 2x with a launch bug: ``n // BLOCK`` programs (not a ceiling), so a BLOCK that does not divide n leaves
    the tail unwritten -- a config that is fast and wrong."""
    _double_kernel[(x.numel() // block,)](x, y, x.numel(), BLOCK=block)
    return y


def double_task(candidates: list[int], heuristic: int) -> Task:
    """A 3-candidate tunable around :func:`double` (one bucket; the heuristic is ``heuristic``)."""
    def workloads(device: torch.device) -> list[Workload]:
        gen = torch.Generator().manual_seed(0)
        x, check = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
        y = torch.empty(N)

        def parts(cfg: dict) -> list[Part]:
            return [Part(key=cfg["BLOCK"], graph=False,
                         check=lambda: [("y", double(check, torch.zeros(N), cfg["BLOCK"]), 2 * check.double())],
                         calls=lambda: [lambda: double(x, y, cfg["BLOCK"])])]

        return [Workload(label=f"n={N}", baseline={"BLOCK": heuristic}, parts=parts)]

    return Task(tunable="test_double", files={"test_double": f"n={N}"}, bucket=N, label=f"n={N}",
                axes={"BLOCK": (16, 32, 64)}, excluded=lambda c: None, size=3, tolerance=1e-6,
                space_hash={"test_double": "test"}, workloads=workloads, seeds=lambda wls, scratch: [],
                entries=lambda c: {"test_double": {"BLOCK": c["BLOCK"]}},
                explicit=[{"BLOCK": b} for b in candidates])


def _prov() -> dict:
    return tune_files.provenance(CPU, ["--test"])


def _entry(out: Path, op: str, key: str, bucket: int) -> dict:
    data, why = bench_api.read_config_file(out / "cpu" / f"{op}.json", "cpu", op)
    assert why is None, why
    return data["entries"][key][str(bucket)]


def test_a_wrong_candidate_is_rejected_and_never_written(tmp_path):
    """BLOCK 64 skips the tail (and, with the fewest programs, runs fastest): rejected as wrong, not chosen; 32
    beats the heuristic's 16 (half the programs) and is written."""
    outcomes: list = []
    tune_run.run_tasks([double_task([16, 32, 64], heuristic=16)], CPU, tmp_path, 120, False, _prov(), outcomes)
    (out,) = outcomes
    assert [r["config"] for r in out.rejected] == [{"test_double": {"BLOCK": 64}}]
    assert out.rejected[0]["reason"].startswith("wrong y: rel err")
    assert out.tried == 3 and out.status == "tuned" and out.best == {"BLOCK": 32}, out
    entry = _entry(tmp_path, "test_double", f"n={N}", N)
    assert entry["BLOCK"] == 32 and entry["rejected_count"] == 1 and entry["tried"] == 3
    assert entry["tuned_ms"] < entry["heuristic_ms"] and math.isclose(entry["speedup"], entry["heuristic_ms"] /
                                                                       entry["tuned_ms"], rel_tol=1e-3)
    doc = json.loads((tmp_path / "cpu" / "test_double.json").read_text())
    for key in ("device", "capability", "driver", "torch", "triton", "qwen35", "date"):
        assert key in doc["provenance"], key
    assert doc["search_space"] == "test" and doc["triton"] == triton.__version__


def test_a_config_no_faster_than_the_heuristic_is_not_written(tmp_path):
    """The heuristic's 32 against 16 (twice the programs) and the wrong 64: the bucket records that the heuristic
    stays, and the loader gives None there."""
    outcomes: list = []
    tune_run.run_tasks([double_task([16, 64], heuristic=32)], CPU, tmp_path, 120, False, _prov(), outcomes)
    (out,) = outcomes
    assert out.status == "heuristic" and out.best == {"BLOCK": 16}
    entry = _entry(tmp_path, "test_double", f"n={N}", N)
    assert entry["heuristic"] is True and "BLOCK" not in entry and entry["best"] == {"BLOCK": 16}
    assert entry["best_ms"] > entry["heuristic_ms"] * (1 - tune_run.MIN_GAIN)
    os.environ["QWEN35_CONFIG_DIR"] = str(tmp_path)
    try:
        bench_api.clear_config_cache()
        from kernels_triton import _config

        assert _config.lookup("test_double", "cpu", f"n={N}", tokens=N) is None
    finally:
        del os.environ["QWEN35_CONFIG_DIR"]
        bench_api.clear_config_cache()


def test_checks_reject_non_finite_and_wrong_outputs():
    ref = torch.ones(8)
    assert tune_run.output_errors(ref.clone(), ref) == (0.0, 0.0)
    for bad in (math.nan, math.inf):
        got = ref.clone()
        got[3] = bad
        errs = tune_run.output_errors(got, ref)
        assert tune_run.judge({"o": errs}, None, 1e-2) == "non-finite o"
    got = ref.clone()
    got[0] = 1.1  # one element 10 % off: 3.5 % by norm
    why = tune_run.judge({"o": tune_run.output_errors(got, ref)}, None, 2.5e-2)
    assert why.startswith("wrong o: rel err 0.035")
    # within the tolerance but 60x the heuristic config's own largest error (and past a tenth of the tolerance)
    got[0] = 1.0 + 6e-3
    why = tune_run.judge({"o": tune_run.output_errors(got, ref)}, {"o": (1e-4, 1e-4)}, 2.5e-2)
    assert why.startswith("wrong o: largest err 0.006"), why
    assert tune_run.judge({"o": tune_run.output_errors(got, ref)}, {"o": (1e-3, 2e-3)}, 2.5e-2) is None
    with pytest.raises(ValueError, match="shape"):
        tune_run.output_errors(torch.ones(3), ref)


def _tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config_json(TinySpec(moe=True))))
    return path


def test_a_crashing_candidate_of_a_real_op_is_rejected(tmp_path):
    """The GDN decode step with a V block that is not a power of two fails to build: rejected with the reason; the
    other candidates are checked against the fp64 reference and the result read back by the loader."""
    name, cfg = load_model(str(_tiny(tmp_path)))
    (task,) = GdnStep().tasks(shard(name, cfg, 1), torch.float32, [2], bench_api.device_limits(CPU))
    task.explicit = [{"BV": 32, "num_warps": 4, "STREAM": False}, {"BV": 24, "num_warps": 4, "STREAM": False},
                     {"BV": 8, "num_warps": 1, "STREAM": True}]
    outcomes: list = []
    tune_run.run_tasks([task], CPU, tmp_path / "out", 300, False, _prov(), outcomes)
    (out,) = outcomes
    assert out.status in ("tuned", "heuristic") and out.tried == 3
    assert [r["config"]["gdn_recurrent_step"]["BV"] for r in out.rejected] == [24]
    assert "crashed" in out.rejected[0]["reason"] and "power of 2" in out.rejected[0]["reason"]
    entry = _entry(tmp_path / "out", "gdn_recurrent_step", "HV=4,V=32", 2)
    assert entry.get("BV") != 24 and entry["rejected_count"] == 1
    assert gdn_api.step_excluded({"BV": 24, "num_warps": 4, "STREAM": False}, 32, 32,
                                 bench_api.device_limits(CPU)) is not None  # the search itself never tries it


def test_the_compile_warm_up_runs_candidates_in_another_process(tmp_path):
    """With a warm-up process, the candidates run there first; the one that fails is rejected without running in
    the tuning process, the others are checked and timed here as usual."""
    name, cfg = load_model(str(_tiny(tmp_path)))
    (task,) = GdnStep().tasks(shard(name, cfg, 1), torch.float32, [1], bench_api.device_limits(CPU))
    task.explicit = [{"BV": 16, "num_warps": 1, "STREAM": False}, {"BV": 12, "num_warps": 1, "STREAM": False}]
    pool = WarmPool(1)
    outcomes: list = []
    try:
        tune_run.run_tasks([task], CPU, tmp_path / "out", 300, False, _prov(), outcomes, warm=pool)
    finally:
        pool.close()
    (out,) = outcomes
    assert out.tried == 2 and [r["config"]["gdn_recurrent_step"]["BV"] for r in out.rejected] == [12]
    assert "in the compile warm-up" in out.rejected[0]["reason"] and "power of 2" in out.rejected[0]["reason"]
    assert out.status in ("tuned", "heuristic") and out.heuristic_ms > 0


def test_a_rerun_skips_finished_buckets(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--model", str(_tiny(tmp_path)), "--dtype", "fp32", "--ops", "gdn_recurrent_step", "--budget-min",
            "0.05", "--out", str(out), "--summary", str(tmp_path / "summary")]
    assert tune.main(argv + ["--decode-buckets", "1"]) == 0
    path = out / "cpu" / "gdn_recurrent_step.json"
    first = path.read_text()
    assert set(json.loads(first)["entries"]["HV=4,V=32"]) == {"1"}
    capsys.readouterr()
    assert tune.main(argv + ["--decode-buckets", "1,2"]) == 0
    table = capsys.readouterr().out
    assert "skipped: already in" in table
    second = json.loads(path.read_text())["entries"]["HV=4,V=32"]
    assert set(second) == {"1", "2"} and second["1"] == json.loads(first)["entries"]["HV=4,V=32"]["1"]
    summary = json.loads((tmp_path / "summary" / "tune_cpu_tiny_tp1.json").read_text())
    assert [r["bucket"] for r in summary["rows"]] == [1, 2] and summary["rows"][0]["result"].startswith("skipped")
    md = (tmp_path / "summary" / "tune_cpu_tiny_tp1.md").read_text().splitlines()
    assert len([line for line in md if line.startswith("gdn_recurrent_step ")]) == 2


def test_an_interrupt_keeps_valid_files_and_a_rerun_continues(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get(
        "PYTHONPATH", "")}
    argv = ["--model", str(_tiny(tmp_path)), "--dtype", "fp32", "--ops", "gdn_recurrent_step", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "tuning.tune", *argv, "--decode-buckets", "1,2,4,8",
                             "--budget-min", "10"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    path = out / "cpu" / "gdn_recurrent_step.json"
    try:
        deadline = time.time() + 240
        while not path.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert path.exists(), proc.communicate(timeout=60)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr
    data, why = bench_api.read_config_file(path, "cpu", "gdn_recurrent_step")
    assert why is None, why
    done = set(data["entries"]["HV=4,V=32"])
    assert "1" in done and done < {"1", "2", "4", "8"}, done
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert tune.main(argv + ["--decode-buckets", ",".join(sorted(done)), "--budget-min", "0.05"]) == 0
    assert json.loads(path.read_text())["entries"]["HV=4,V=32"] == data["entries"]["HV=4,V=32"]


def test_writes_are_atomic(tmp_path):
    path = tmp_path / "x.json"
    tune_files.atomic_write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        tune_files.atomic_write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_a_file_the_loader_would_not_take_is_tuned_again(tmp_path):
    """An output file from another Triton version: its buckets are not skipped, and the file is replaced."""
    out = tmp_path / "out"
    (out / "cpu").mkdir(parents=True)
    stale = {"device": "cpu", "op": "test_double", "triton": "2.0.0", "entries": {f"n={N}": {str(N): {
        "BLOCK": 64, "tuned_ms": 1.0}}}}
    (out / "cpu" / "test_double.json").write_text(json.dumps(stale))
    outcomes: list = []
    tune_run.run_tasks([double_task([16, 32, 64], heuristic=16)], CPU, out, 120, False, _prov(), outcomes)
    assert outcomes[0].status == "tuned"
    assert _entry(out, "test_double", f"n={N}", N)["BLOCK"] == 32
