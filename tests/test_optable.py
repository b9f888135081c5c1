"""The op table's checklist: every row is complete, and the façade, the registry, the self-test and the probe
list exactly the table's ops."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from qwen35 import backends, cases, ops, optable, reference, selftest, validate

CPU = torch.device("cpu")
FACADE_HELPERS = {"prepare_gdn_metadata", "gdn_chunk_table", "host_built_inputs", "MAX_SPEC_TOKENS"}
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _params(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def _facade_only(row: optable.Op) -> set[str]:
    """Parameters of the op that the façade's ``call`` consumes (the reference does not take them)."""
    return set(_params(row.validate)) - set(_params(row.reference))


def _case(row: optable.Op, dtype: torch.dtype = torch.float32) -> cases.Case:
    return row.case(CPU, dtype, torch.Generator().manual_seed(0))


def test_names_are_unique_and_the_order_is_the_tables():
    assert len(set(optable.NAMES)) == len(optable.NAMES) == len(optable.OPS)
    assert optable.NAMES == tuple(op.name for op in optable.OPS)
    with pytest.raises(ValueError, match="unknown op 'gdn_prefil'; ops: gdn_chunk_prefill, "):
        optable.get("gdn_prefil")


@pytest.mark.parametrize("name", optable.NAMES)
def test_row_names_its_own_functions(name):
    """The row's validator, reference and case are the functions of the op's name in their modules."""
    row = optable.get(name)
    assert row.validate is getattr(validate, name)
    assert row.reference is getattr(reference, name) and name in reference.__all__
    assert row.case is getattr(cases, name)


@pytest.mark.parametrize("name", optable.NAMES)
def test_reference_takes_the_ops_signature(name):
    """The validator's signature is the op's; the reference has the same parameters (names, kinds, defaults),
    less the façade-only ones that the row's ``call`` consumes, which must be optional keywords."""
    row = optable.get(name)
    op_params, ref_params = _params(row.validate), _params(row.reference)
    extra = _facade_only(row)
    assert not set(ref_params) - set(op_params), f"{name}: the reference takes {set(ref_params) - set(op_params)}"
    assert [p for p in op_params if p not in extra] == list(ref_params)
    for p in ref_params:
        assert (op_params[p].kind, op_params[p].default) == (ref_params[p].kind, ref_params[p].default), (name, p)
    if extra:
        assert row.call is not None, f"{name}: façade-only parameters {extra} but no call to consume them"
        for p in extra:
            assert op_params[p].kind == inspect.Parameter.KEYWORD_ONLY and op_params[p].default is None, (name, p)


@pytest.mark.parametrize("name", optable.NAMES)
def test_row_has_a_doc_and_a_tolerance_per_dtype(name):
    row = optable.get(name)
    doc = inspect.cleandoc(row.doc)
    assert len(doc.splitlines()[0]) > 20, f"{name}: the doc's first line says too little: {doc!r}"
    assert inspect.getdoc(getattr(ops, name)) == doc
    for dtype in COMPUTE_DTYPES:
        tol = row.tolerance[dtype]
        assert 0 < tol < 0.1 and math.isfinite(tol), (name, dtype, tol)


@pytest.mark.parametrize("name", optable.NAMES)
def test_case_validates_and_the_reference_meets_its_tolerance(name):
    """The self-test case binds to the op's signature and passes its validator; the fp32 reference on it is
    within the fp32 tolerance of the fp64 reference (what the probe asks of every backend)."""
    row = optable.get(name)
    case = _case(row)
    inspect.signature(row.validate).bind(**case.kwargs)
    assert row.validate(**case.kwargs) is None
    assert set(case.mutated) <= set(case.kwargs)
    assert any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in case.kwargs.values())
    err = selftest.check(name, row.reference, CPU, torch.float32)
    assert err <= selftest.tolerance(name, torch.float32), f"{name}: fp32 reference rel err {err:.3g}"


@pytest.mark.parametrize("name", optable.NAMES)
def test_validator_rejects_a_non_tensor_first_input(name):
    row = optable.get(name)
    kwargs = dict(_case(row).kwargs)
    first = next(iter(_params(row.validate)))
    kwargs[first] = [[1.0, 2.0]]
    with pytest.raises(ValueError, match=f"{first} must be a torch.Tensor, got list"):
        getattr(ops, name)(**kwargs)


@pytest.mark.parametrize("name", optable.NAMES)
def test_selftest_catches_a_wrong_result(name):
    """A backend whose outputs are off by a few percent fails the op's self-test."""
    row = optable.get(name)

    def off(**kw):
        out = row.reference(**kw)
        outs = out if isinstance(out, tuple) else (out,)
        bumped = tuple(t * 1.05 if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in outs)
        return bumped if isinstance(out, tuple) else bumped[0]

    err = selftest.check(name, off, CPU, torch.float32)
    assert not err <= selftest.tolerance(name, torch.float32), f"{name}: a 5% error passed (rel err {err:.3g})"


def test_facade_exports_exactly_the_table():
    assert set(ops.__all__) - FACADE_HELPERS == set(optable.NAMES)
    for name in optable.NAMES:
        fn = getattr(ops, name)
        assert callable(fn) and fn.__name__ == name
        assert list(inspect.signature(fn).parameters) == list(_params(optable.get(name).validate))


def test_registry_and_selftest_list_the_table():
    assert backends.OPS == optable.NAMES
    for name in optable.NAMES:
        assert selftest.tolerance(name, torch.float32) == optable.get(name).tolerance[torch.float32]


@pytest.mark.parametrize("backend", backends.names())
def test_backend_functions_take_the_ops_arguments(backend):
    """Where a registered backend defines an op, it takes every argument the façade may pass (façade-only ones
    aside) with the same kind and default, and requires nothing more."""
    module = backends.load(backend)
    for name in optable.NAMES:
        fn = backends.implementation(module, name)
        if fn is None:
            continue
        row = optable.get(name)
        want, have = _params(row.validate), _params(fn)
        for p, spec in want.items():
            if p in _facade_only(row) and p not in have:
                continue
            assert p in have, f"{backend}.{name} lacks parameter {p}"
            assert (have[p].kind, have[p].default) == (spec.kind, spec.default), f"{backend}.{name}: {p}"
        required = {p for p, spec in have.items() if spec.default is inspect.Parameter.empty}
        assert required <= set(want), f"{backend}.{name} requires {required - set(want)}"


def test_probe_cli_reports_exactly_the_table():
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN35_")}
    out = subprocess.run([sys.executable, "-m", "qwen35.probe", "--json"], capture_output=True, text=True,
                         check=True, env=env).stdout
    assert [r["op"] for r in json.loads(out)["ops"]] == list(optable.NAMES)
