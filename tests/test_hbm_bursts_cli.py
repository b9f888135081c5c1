"""tuning/hbm_bursts.py's command line (the reads need a GPU; checking what to read does not)."""

from __future__ import annotations

import re

import pytest

from tuning import hbm_bursts


def test_sizes_and_chains_parse(tmp_path, monkeypatch):
    """Sizes and chains in MiB reach run() as tuples (stopped there: no GPU needed)."""
    seen = {}
    monkeypatch.setattr(hbm_bursts.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hbm_bursts, "run", lambda out, sizes, chains, tag: seen.update(sizes=sizes, chains=chains,
                                                                                          tag=tag))
    assert hbm_bursts.main(["--out", str(tmp_path), "--sizes", "1,4,30", "--chains", "4,30;1,4,30", "--tag", "t"]) == 0
    assert seen == dict(sizes=(1, 4, 30), chains=((4, 30), (1, 4, 30)), tag="t")


@pytest.mark.parametrize("args,message", [(["--sizes", "1,x"], "whole MiB"), (["--sizes", "0"], "whole MiB"),
                                          (["--sizes", "1,4", "--chains", "4,30"], r"chain sizes \[30\] MiB")])
def test_bad_sizes_name_the_value(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as stop:
        hbm_bursts.main(["--out", str(tmp_path), *args])
    assert stop.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_run_refuses_chains_outside_the_sizes(tmp_path):
    with pytest.raises(ValueError, match=r"\[48\] MiB are not among the sizes swept \[1, 4\]"):
        hbm_bursts.run(tmp_path, (1, 4), ((1, 48),))
