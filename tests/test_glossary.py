"""`slotscope explain`: every table and every term the report prints has its line."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from slotscope import analyze as analysis
from slotscope import glossary
from slotscope.cli import app
from slotscope.analyze import has_server_log
from slotscope.glossary import REPORT_COLUMNS
from slotscope.report import FOOTNOTE_COLUMNS, _readable, _sections, _sentences

from .conftest import REAL, ROOT, SCENARIOS

OLLAMA = ROOT / "fixtures" / "ollama"

runner = CliRunner()
# The columns whose values are the report's own words (not the app's purposes, users or labels).
VOCABULARY = ["class", "cause", "component", "basis", "by", "verdict"]


def test_every_report_table_has_an_entry_in_report_order() -> None:
    assert list(glossary.TABLES)[: len(analysis.REPORT_ORDER)] == analysis.REPORT_ORDER
    assert list(glossary.TABLES) == analysis.table_names()


def _printed_terms(ds, tables: dict[str, pd.DataFrame]) -> set[str]:
    """The words the report prints for a dataset: its tables' names, the columns it shows, the
    footnotes' names, the values of its vocabulary columns and the clock alignment's method."""
    printed = _sections(ds, tables)
    terms = set(printed)
    for name, df in ((n, tables[n]) for n in printed):
        if _sentences(name, df) is not None:
            if name == "ruled-out":
                terms |= set(df["verdict"])
            continue
        shown = _readable(name, df)
        terms |= set(map(str, shown.columns))
        terms |= {c for c in FOOTNOTE_COLUMNS if c in df.columns and df[c].replace("", None).notna().any()}
        for c in VOCABULARY:
            if c in shown.columns:
                terms |= set(shown[c].dropna().astype(str))
        if name in ("stalls", "stalls-worst", "context") and "basis" in df.columns:
            terms |= set(df["basis"].dropna().astype(str))
        if name == "prefills" and "by" in df.columns:
            terms |= set(df.loc[df["by"] == "cause", "value"].astype(str))
        if name == "load":
            terms |= {"overall"} & set(df["scope"])
    if ds.matches is not None:
        terms |= set(ds.matches.aligned["method"].astype(str))
        if not has_server_log(ds):  # an app log alone: the report lists its calls
            terms |= {"calls", *REPORT_COLUMNS["calls"]}
    return terms


@pytest.mark.parametrize("logs", [REAL / s / "logs" for s in SCENARIOS]
                         + [OLLAMA / "parallel" / "logs", REAL / "before" / "logs" / "app.jsonl"],
                         ids=[*SCENARIOS, "ollama", "app-log-alone"])
def test_every_term_the_report_prints_has_an_entry(logs: Path) -> None:
    from slotscope.dataset import load

    scenario = logs.parent.name
    ds = load([logs])
    terms = _printed_terms(ds, analysis.run(ds))
    if scenario == "before":  # the terms a newcomer asked about are among them
        assert {"basis", "few_samples", "deferred", "generation_only", "alone", "exact+split", "waits"} <= terms
    missing = sorted(t for t in terms if not glossary.lookup(t))
    assert missing == []


@pytest.mark.parametrize("asked,first", [
    (["stalls"], "stalls  Generation speed of a slot by what the other slots did meanwhile"),
    (["few", "samples"], "few_samples  True when the row rests on fewer than 10 samples"),
    (["median tok/s"], "median_tg_3s_tps (median tok/s)  Median generation speed"),
    (["exact+split"], "exact+split  The row mixes exact stretches and split ones"),
    (["waits", "basis"], "waits basis  The waits rows count waits before prefill"),
    (["Generation-Only"], "generation_only  Stretches with no prefill in other slots"),
])
def test_explain_prints_the_entry(asked: list[str], first: str) -> None:
    res = runner.invoke(app, ["explain", *asked])
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith(first)


def test_explain_a_table_lists_the_columns_the_report_shows() -> None:
    lines = runner.invoke(app, ["explain", "waits"]).stdout.splitlines()
    assert lines[1] == "waits columns:"
    assert [line.split()[0] for line in lines[2:]] == ["cause", "count", "total", "max", "median", "few"]
    assert lines[3].split(None, 1)[1] == glossary.TERMS["count"]


def test_explain_without_a_term_prints_every_entry_and_an_unknown_one_is_a_usage_error() -> None:
    every = runner.invoke(app, ["explain"]).stdout.splitlines()
    assert len(every) == 2 + len(glossary.TABLES) + len(glossary.TERMS)
    res = runner.invoke(app, ["explain", "defered"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == "error: no glossary entry for 'defered'; did you mean deferred?\n"


def test_captions_name_the_thresholds_the_tables_were_made_with(tmp_path: Path) -> None:
    """`--wait-threshold 5 --big-prefill 8000`: the waits and prefills captions say 5 s and
    8,000, as the tables' own rows and basis do; explain names the defaults."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(analysis.Options)}
    assert all(defaults[k] == v for k, v in glossary.THRESHOLDS.items())
    logs = str(REAL / "before" / "logs")
    r = CliRunner().invoke(app, ["analyze", logs, "--wait-threshold", "5", "--big-prefill", "8000", "-f", "table"],
                           env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    assert "Waits of 5 s or more before a prefill started" in r.stdout and ">= 5 s" in r.stdout
    assert "Long prefills (8,000+ new tokens)" in r.stdout and ">= 8,000 new tokens" in r.stdout
    assert "Waits of 1 s or more" not in r.stdout and "5,000+" not in r.stdout
    r = CliRunner().invoke(app, ["analyze", logs, "--wait-threshold", "5", "-o", str(tmp_path / "out") + "/"])
    assert r.exit_code == 0, r.output
    assert "Waits of 5 s or more" in (tmp_path / "out" / "findings.md").read_text()
    r = CliRunner().invoke(app, ["analyze", logs, "--wait-threshold", "5", "--html", str(tmp_path / "r.html"), "-q"])
    assert r.exit_code == 0, r.output
    assert "Waits of 5 s or more" in (tmp_path / "r.html").read_text()
    said = CliRunner().invoke(app, ["explain", "waits"]).stdout
    assert "Waits of 1 s or more" in said
