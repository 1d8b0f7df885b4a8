"""The parser's output is byte-identical to what the pre-optimisation parser wrote (fixtures/golden)."""

from __future__ import annotations

import importlib.util

import pytest

from .conftest import ROOT

GOLDEN = ROOT / "fixtures" / "golden"
_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
assert _spec and _spec.loader
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)


@pytest.mark.parametrize("name", sorted(make_golden.inputs()))
def test_output_is_unchanged(name: str) -> None:
    got = make_golden.tables(make_golden.inputs()[name])
    for kind, text in got.items():
        want = (GOLDEN / f"{name}.{kind}.csv").read_text()
        assert text == want, f"{name}.{kind}.csv differs"
