"""tuning/gpu_suite.py's command line (the suite itself needs a GPU; its argument handling does not)."""

from __future__ import annotations

import pytest

from tuning.gpu_suite import parse_part_args


def test_part_args_split_like_a_shell():
    """A quoted pytest -k expression stays one argument (a whitespace split handed pytest "or" as a path)."""
    got = parse_part_args(["tests=-n 8 -k 'gdn or standalone'", "gdn=--quick --fla-deadline 40", "moe="])
    assert got == {"tests": ["-n", "8", "-k", "gdn or standalone"], "gdn": ["--quick", "--fla-deadline", "40"],
                   "moe": []}


@pytest.mark.parametrize("item", ["bogus=--quick", "tests", "=x"])
def test_part_args_name_the_bad_item(item):
    with pytest.raises(ValueError, match="expected PART=ARGS"):
        parse_part_args([item])
