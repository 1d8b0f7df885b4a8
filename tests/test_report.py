"""`slotscope analyze`: the report as a user reads it, and each table as a spreadsheet gets it."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from slotscope import analyze as analysis
from slotscope.cli import app

from .conftest import FORMATS, OLLAMA, REAL, SCENARIOS

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_bundled_example_report_without_a_path() -> None:
    res = run("analyze")
    assert res.exit_code == 0, res.stderr
    assert "bundled example" in res.stderr
    for name in ("findings", "turns", "load", "breakdown", "stalls", "waits", "prefills", "prefill-speed",
                 "context", "cache", "lora-switch"):
        assert f"\n{name} ─" in res.stdout
    assert "could not compute" not in res.stdout


def test_report_says_which_model_and_slots_the_server_ran() -> None:
    """From the start-up lines: `loading model '...'` and `initializing, n_slots = .., n_ctx_slot = ..`."""
    log = (REAL / "before" / "logs" / "llama-server.log").read_text()
    model = re.search(r"loading model '(.*)'", log).group(1)  # type: ignore[union-attr]
    slots, ctx = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)", log).groups()  # type: ignore[union-attr]
    res = run("analyze", str(REAL / "before" / "logs"))
    assert res.exit_code == 0
    assert f"\nserver: model {model}; {slots} slots x {int(ctx):,} tokens of context\n" in res.stdout


def test_report_fits_100_columns_on_the_largest_scenario() -> None:
    res = run("analyze", str(REAL / "wallclock" / "logs"))
    assert res.exit_code == 0
    widths = [len(line) for line in res.stdout.splitlines()]
    assert max(widths) <= 100
    assert "\x1b[" not in res.stdout  # no colour codes when piped


def test_findings_name_both_causes_in_before() -> None:
    res = run("analyze", str(REAL / "before" / "logs"), "--table", "findings", "-f", "json", "-q")
    found = json.loads(res.stdout)
    text = " ".join(f["finding"] for f in found)
    assert "prefilled" in text and "different LoRA setting" in text
    # the long-prefill class rests on 4 stretches in `before`: said, but not as a finding
    lp = [f for f in found if "≥15K" in f["finding"]]
    assert lp and all(not f["supported"] for f in lp) and "too few" in lp[0]["finding"]


def test_findings_in_after_do_not_blame_lora() -> None:
    res = run("analyze", str(REAL / "after" / "logs"), "--table", "findings", "-f", "csv", "-q")
    df = pd.read_csv(io.StringIO(res.stdout))
    assert not df["finding"].str.contains("happened while a task with a different LoRA").any()
    assert df["finding"].str.contains("≥15K").any()


@pytest.mark.parametrize("table,columns", [
    ("stalls", ["class", "samples", "median_tg_3s_tps", "p10_tg_3s_tps"]),
    ("waits", ["cause", "count", "total_s", "max_s"]),
])
def test_stable_table_columns_as_csv(table: str, columns: list[str]) -> None:
    res = run("analyze", str(REAL / "before" / "logs"), "--table", table, "-f", "csv", "-q")
    assert res.exit_code == 0
    df = pd.read_csv(io.StringIO(res.stdout))
    assert list(df.columns[: len(columns)]) == columns
    if table == "stalls":
        assert list(df["class"]) == ["long_prefill", "other_prefill", "generation_only", "alone"]
    else:
        assert list(df["cause"])[:4] == ["different_lora", "same_lora", "nothing", "deferred"]


@pytest.mark.parametrize("table", analysis.table_names())
def test_every_table_exports(table: str, tmp_path) -> None:
    out = tmp_path / f"{table}.parquet"
    res = run("analyze", str(REAL / "restart" / "logs"), "--table", table, "-o", str(out), "-q")
    assert res.exit_code == 0, res.stderr
    df = pd.read_parquet(out)
    assert "note" not in df.columns or not df["note"].astype(str).str.startswith("could not compute").any()


def test_export_needs_a_table() -> None:
    res = run("analyze", str(REAL / "before" / "logs"), "-f", "csv")
    assert res.exit_code == 2 and "--table NAME" in res.stderr and "-o DIR/ writes every table" in res.stderr


# Each real capture, and the fixtures that make other tables: whole-second stamps, two ports,
# LM Studio's headers, rotated files, and an Ollama log (its own tables).
EXPORTED = ([REAL / s / "logs" for s in SCENARIOS] + [FORMATS / n for n in ("json2024.log", "router.log", "lmstudio.log", "rotated")]
            + [OLLAMA / "parallel" / "logs"])


@pytest.mark.parametrize("logs", EXPORTED, ids=[str(p.relative_to(p.parents[2])) for p in EXPORTED])
def test_analyze_into_a_directory_writes_every_table_as_table_writes_it(logs: Path, tmp_path: Path) -> None:
    """`analyze logs/ -o report/`: one CSV per table, each the bytes `--table NAME -f csv`
    writes (that command computes the table alone: ``run(ds, names=[NAME])``), and findings.md
    with the findings' sentences."""
    from slotscope import output
    from slotscope.dataset import load

    res = run("analyze", str(logs), "-o", f"{tmp_path}/report/", "-q")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "" and res.stderr == ""
    names = analysis.table_names()
    report = tmp_path / "report"
    assert sorted(p.name for p in report.iterdir()) == sorted([f"{n}.csv" for n in names] + ["findings.md"])
    ds = load([logs])
    for name in names:
        alone = analysis.run(ds, names=[name])[name]
        assert (report / f"{name}.csv").read_bytes() == output.render_text(alone, "csv").encode(), name
    md = (report / "findings.md").read_text()
    findings = pd.read_csv(report / "findings.csv")["finding"]
    assert md.startswith("# slotscope report: ") and "[`stalls.csv`](stalls.csv)" in md
    assert all(f"\n- {f}\n" in md for f in findings)


def test_a_directory_export_and_one_table_are_the_same_bytes_through_the_command(tmp_path: Path) -> None:
    logs = REAL / "before" / "logs"
    assert run("analyze", str(logs), "-o", str(tmp_path), "-q").exit_code == 0  # an existing directory
    for name in ("stalls", "findings"):
        one = run("analyze", str(logs), "--table", name, "-f", "csv", "-q")
        assert one.exit_code == 0 and (tmp_path / f"{name}.csv").read_text() == one.stdout


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_a_directory_export_takes_the_format(fmt: str, tmp_path: Path) -> None:
    logs = REAL / "restart" / "logs"
    res = run("analyze", str(logs), "-o", f"{tmp_path}/r/", "-f", fmt)
    assert res.exit_code == 0, res.stderr
    names = analysis.table_names()
    assert f"wrote {len(names)} table(s) and findings.md to {tmp_path}/r/" in res.stderr
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([f"{n}.{fmt}" for n in names] + ["findings.md"])
    stalls = run("analyze", str(logs), "--table", "stalls", "-f", "csv", "-q").stdout
    read = pd.read_json if fmt == "json" else pd.read_parquet
    got = read(tmp_path / "r" / f"stalls.{fmt}")
    pd.testing.assert_frame_equal(got, pd.read_csv(io.StringIO(stalls)), check_dtype=False)


def test_json_without_a_table_is_every_table_in_one_object(tmp_path: Path) -> None:
    logs = REAL / "before" / "logs"
    res = run("analyze", str(logs), "-f", "json", "-q")
    assert res.exit_code == 0, res.stderr
    whole = json.loads(res.stdout)
    assert list(whole) == analysis.table_names()
    for name in ("waits", "findings"):
        assert whole[name] == json.loads(run("analyze", str(logs), "--table", name, "-f", "json", "-q").stdout)
    out = tmp_path / "report.json"
    assert run("analyze", str(logs), "-o", str(out), "-q").exit_code == 0
    assert out.read_text() == res.stdout


def test_a_directory_export_refuses_a_terminal_table_and_a_file_in_the_way(tmp_path: Path) -> None:
    logs = REAL / "before" / "logs"
    res = run("analyze", str(logs), "-o", f"{tmp_path}/r/", "-f", "table")
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines()[-1] == "error: a directory of tables is written as csv, json or parquet, not table"
    (tmp_path / "f").write_text("")
    res = run("analyze", str(logs), "-o", f"{tmp_path}/f/")
    assert res.exit_code == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"error: {tmp_path}/f/: is not a directory: cannot write the tables into it"


def test_without_app_log_the_report_says_what_it_would_add() -> None:
    res = run("analyze", str(REAL / "before" / "logs" / "llama-server.log"))
    assert res.exit_code == 0
    assert "No app call log was given" in res.stdout
    assert "\nstalls ─" in res.stdout and "could not compute" not in res.stdout


def test_library_run_by_name_in_a_fresh_process() -> None:
    """A notebook asks for tables by name without importing the analyzer modules first."""
    import subprocess
    import sys

    code = ("import slotscope, slotscope.analyze as a; ds = slotscope.load([%r]); "
            "t = a.run(ds, names=['stalls', 'waits']); print(sorted(t), list(t['stalls'].columns[:2]))") % str(REAL / "before" / "logs")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "['stalls', 'waits'] ['class', 'samples']" in out


def test_long_runs_can_say_what_runs_next() -> None:
    """The hooks behind the status line on long runs: each stage of loading, then each table
    in the order computed with its place among them, findings last. The result lists the
    tables in report order."""
    from slotscope.dataset import load

    stages: list[str] = []
    ds = load([REAL / "before" / "logs"], stage=stages.append)
    assert stages == ["reading server logs", "reading app logs", "aligning clocks and matching calls to tasks"]
    said: list[tuple[str, int, int]] = []
    tables = analysis.run(ds, on_table=lambda name, i, n: said.append((name, i, n)))
    assert list(tables) == analysis.table_names()
    assert sorted(name for name, _, _ in said) == sorted(tables) and said[-1][0] == "findings"
    assert [i for _, i, _ in said] == list(range(1, len(tables) + 1)) and {n for _, _, n in said} == {len(tables)}
    said.clear()
    analysis.run(ds, names=["stalls", "load"], on_table=lambda name, i, n: said.append((name, i, n)))
    assert said == [("stalls", 1, 2), ("load", 2, 2)]


@pytest.mark.parametrize("name", ["stalls-worst", "waits-worst", "stalls"])
def test_a_table_wider_than_the_page_shows_the_columns_that_fit(name: str) -> None:
    """At 100 columns the report's stalls-worst and waits-worst are wider than the page; rich
    would cut their last columns (the cause's line among them), and stacked halves are hard
    to read. The first columns that fit are shown whole, every value of them printed, and the
    caption names the others; a table that fits shows every column."""
    from rich.console import Console

    from slotscope.dataset import load
    from slotscope.output import print_table, _cell
    from slotscope.report import _readable

    ds = load([REAL / "before" / "logs"])
    shown = _readable(name, analysis.run(ds, names=[name])[name]).head(12)
    buf = io.StringIO()
    print_table(Console(file=buf, width=100, soft_wrap=False), shown, max_rows=12)
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 100
    caption = " ".join(" ".join(lines).split())
    hidden = re.search(r"(\d+) more columns? \(([^)]*)\): --format csv shows all", caption)
    if name == "stalls":
        assert hidden is None
        kept = list(shown.columns)
    else:
        assert hidden is not None
        names = hidden.group(2).split(", ")
        assert int(hidden.group(1)) == len(names) and names == [str(c) for c in shown.columns[-len(names):]]
        kept = list(shown.columns[:-len(names)])
    assert len(kept) >= 4
    body = [line.split() for line in lines]
    for i, (_, rec) in enumerate(shown.iterrows()):
        cells = [_cell(rec[c]) for c in kept]
        whole = [x for x in cells if x and " " not in x and len(x) <= 24]
        assert any(b[:1] == cells[:1] and all(x in b for x in whole) for b in body), (i, cells)


def test_shares_print_as_percentages_on_the_terminal_and_as_fractions_in_csv() -> None:
    logs = REAL / "before" / "logs"
    load = pd.read_csv(io.StringIO(run("analyze", str(logs), "--table", "load", "-f", "csv", "-q").stdout))
    overall = load[load["scope"] == "overall"]
    assert load["share"].between(0, 1).all() and abs(overall["share"].sum() - 1) < 1e-3
    report = run("analyze", str(logs), "-q").stdout
    section = report.split("\nload ─")[1].split("\nbreakdown ─")[0]
    for r in overall.itertuples():
        row = next(line.split() for line in section.splitlines() if line.split()[:2] == ["overall", str(r.running)])
        assert row[-1] == f"{100 * r.share:.3g}%"
    assert " 100%" in report.split("\nbreakdown ─")[1].split("\nstalls ─")[0]  # the total row


def test_the_terminal_shows_short_labels_and_csv_the_stable_names() -> None:
    """A header wraps between words only, and the long names become short labels: the stalls
    table's `median_tg_3s_tps` is `median tok/s` on the terminal (four lines of header before)."""
    logs = REAL / "before" / "logs"
    section = run("analyze", str(logs), "-q").stdout.split("\nstalls ─")[1].split("\nstalls-worst ─")[0]
    head = section.splitlines()[2:5]  # the caption, a blank line, then the header
    words = " ".join(head).split()
    assert {"median", "p10", "pooled", "tok/s"} <= set(words) and "tg" not in words and "3s" not in words
    assert len([line for line in head if line.strip()]) == 2
    csv = run("analyze", str(logs), "--table", "stalls", "-f", "csv", "-q").stdout
    assert csv.splitlines()[0].startswith("class,samples,median_tg_3s_tps,p10_tg_3s_tps,tokens,seconds,tok_per_s_pooled")


def test_a_source_path_longer_than_the_page_is_not_cut(tmp_path: Path) -> None:
    import shutil

    deep = tmp_path / ("captured-on-the-production-host-" * 3) / "logs"
    shutil.copytree(REAL / "before" / "logs", deep)
    res = run("analyze", str(deep), "-q")
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert lines[1] == "slotscope report:" and lines[2] == f"  {deep / 'llama-server.log'}"


def test_names_from_the_logs_print_as_written(tmp_path: Path) -> None:
    """A user or purpose is the app's own string: rich must not read "[bold]" in it as markup,
    nor ":fire:" as an emoji code (the before capture's app log, two names changed)."""
    lines = (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["user"], first["purpose"] = "[bold]ana[/bold]", "chat :fire:"
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "app.jsonl").write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    (logs / "llama-server.log").write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    res = runner.invoke(app, ["calls", str(logs), "-f", "table"])
    assert res.exit_code == 0, res.output
    assert "[bold]ana[/bold]" in res.output and "chat :fire:" in res.output
