"""tuning/scan_precision.py: both forms of the scan's chunk step track fp64 at bf16-level error (an algebra
slip in either form would give errors of order one)."""

from __future__ import annotations

import pytest

from tuning.scan_precision import compare


@pytest.mark.parametrize("case", ["normal", "weak", "hard"])
def test_both_scan_forms_track_fp64(case):
    rel = compare(300, case, K=32, V=32)
    assert all(0.0 < err < 2e-2 for err in rel.values()), rel
