"""--where: column names, literals and operators only; anything that could run code is refused
with one usage error (exit 2), never evaluated."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from typer.testing import CliRunner

from slotscope.cli import app
from slotscope.filters import WHERE_USAGE, WindowError, where

from .conftest import REAL

LOGS = str(REAL / "before" / "logs")
runner = CliRunner()


def _tasks(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["tasks", LOGS, "-q", "-f", "csv", *args])


@pytest.mark.parametrize("expr, rows", [
    ("wait_before_prefill_ms >= 1000", 31),
    ("slot == 2 and status == 'complete'", None),
    ("slot in [0, 3] or n_gen > 800", None),
    ("(slot == 1) | ~(n_gen > 100)", None),
    ("not truncated and -prompt_tokens_new < -10000", None),
])
def test_conditions_of_names_literals_and_operators_select_rows(expr: str, rows: int | None) -> None:
    res = _tasks("--where", expr)
    assert res.exit_code == 0, res.stderr
    got = pd.read_csv(io.StringIO(res.stdout))
    everything = pd.read_csv(io.StringIO(_tasks().stdout))
    want = everything.query(expr, engine="python")
    assert got["task_id"].tolist() == want["task_id"].tolist()
    assert 0 < len(got) < len(everything)
    if rows is not None:
        assert len(got) == rows


REFUSED = [
    ("slot.__class__.__name__ == 'int'", "attribute access (slot.__class__.__name__) is not allowed"),
    ("slot.__class__", "attribute access (slot.__class__) is not allowed"),
    ("__import__('os').system('touch /tmp/x')", "a call (__import__('os').system('touch /tmp/x')) is not allowed"),
    ("status[0] == 'c'", "a subscript (status[0]) is not allowed"),
    ("(lambda: 1)() == 1", "a call ((lambda: 1)()) is not allowed"),
    ("slot == [x for x in status]", "ListComp ([x for x in status]) is not allowed"),
    ("slot == b'1'", "b'1' is not a number or a string"),
    ("slot ==", "not a condition (invalid syntax)"),
    ("slot == @x", "not a condition (invalid syntax)"),
]


@pytest.mark.parametrize("expr, what", REFUSED, ids=[e for e, _ in REFUSED])
def test_anything_else_is_one_usage_error(expr: str, what: str) -> None:
    res = _tasks("--where", expr)
    assert res.exit_code == 2
    assert res.stdout == ""
    assert res.stderr == f"error: --where {expr!r}: {what}; {WHERE_USAGE}\n"


def test_the_usage_names_what_is_allowed_exactly() -> None:
    res = _tasks("--where", "slot.__class__")
    assert res.stderr == (
        "error: --where 'slot.__class__': attribute access (slot.__class__) is not allowed; a condition holds "
        "column names, numbers, quoted strings, lists of them, and the operators == != < <= > >= in, not in, "
        "and or not, & | ~, + - * / // % **\n")


def test_an_unknown_name_is_named_with_the_columns() -> None:
    res = _tasks("--where", "no_such_column > 1")
    assert res.exit_code == 2
    assert res.stderr.startswith("error: --where 'no_such_column > 1': no column 'no_such_column'; columns: source, session, slot,")


def test_refused_before_pandas_sees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check comes first: a refused condition never reaches DataFrame.query."""
    def query(*_: object, **__: object) -> None:
        raise AssertionError("evaluated")

    df = pd.DataFrame({"slot": [1, 2]})
    monkeypatch.setattr(pd.DataFrame, "query", query)
    with pytest.raises(WindowError, match="attribute access"):
        where(df, "slot.__class__")


def test_match_and_unlogged_refuse_the_same() -> None:
    for extra in ([], ["--unlogged"]):
        res = runner.invoke(app, ["match", LOGS, "-q", "-f", "csv", *extra, "--where", "slot.__class__"])
        assert res.exit_code == 2
        assert res.stderr.startswith("error: --where 'slot.__class__': attribute access (slot.__class__) is not allowed;")
