"""The command line as a user meets it: exit codes, stdout = data, stderr = accounting."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from slotscope import output
from slotscope.cli import app

from .conftest import FORMATS, REAL

runner = CliRunner()
TASK_COLUMNS = ("source,session,slot,task_id,launch_s,prefill_start_s,first_token_s,release_s,wait_before_prefill_ms,"
                "prompt_tokens_new,prompt_tokens_cached,n_gen,prompt_eval_ms,eval_ms,prefill_tps,gen_tps,truncated,status,line")
GEN_COLUMNS = "source,session,slot,task_id,t_s,n_gen,tg_tps,tg_3s_tps,window_s"
PREFILL_COLUMNS = "source,session,slot,task_id,t_s,n_tokens,progress,elapsed_s,tps,step_tokens"
MATCH_COLUMNS = ("call_id,start_at,purpose,user,lora,prompt_tokens,completion_tokens,source,session,task_id,slot,"
                 "match_method,confidence,queue_ms,wait_before_prefill_ms,prefill_ms,generation_ms,ttft_ms,total_ms")


def run(*args: str):
    return runner.invoke(app, list(args))


def refused(*args: str) -> str:
    """The stderr of a command that must refuse its input: exit 1, no traceback."""
    res = run(*args)
    assert res.exit_code == 1 and "Traceback" not in res.stderr, res.stderr
    return res.stderr.strip()


@pytest.mark.parametrize("cmd", ["tasks", "samples", "calls", "match", "analyze", "demo", "explain", "compare", "timeline", "whatif"])
def test_every_command_has_help(cmd: str) -> None:
    res = run(cmd, "--help")
    assert res.exit_code == 0
    assert "Usage" in res.stdout
    assert "<bool>" not in res.stdout  # a flag is shown as a flag: `--strict`, not `--strict <bool>`


def test_version() -> None:
    import tomllib

    import slotscope

    res = run("--version")
    assert res.exit_code == 0 and res.stdout == f"slotscope {slotscope.__version__}\n"
    project = tomllib.loads((REAL.parent.parent / "pyproject.toml").read_text())["project"]
    assert slotscope.__version__ == project["version"]


def test_flags_read_as_flags_in_help() -> None:
    text = run("analyze", "--help").stdout
    for flag in ("--strict", "--quiet", "--help"):
        line = next(line for line in text.splitlines() if f" {flag} " in line)
        assert "<" not in line and "BOOL" not in line.upper(), line
    assert "<bool>" not in run("--help").stdout


def test_help_summaries_read_as_one_paragraph() -> None:
    """Each command's summary in `slotscope --help` is the first paragraph of its docstring,
    reflowed: a line break in the source does not break the summary's line."""
    import inspect
    import textwrap

    rows: dict[str, list[str]] = {}
    name = None
    for line in run("--help").stdout.splitlines():
        cells = line.strip().strip("│").strip()
        if not line.startswith("│") or not cells:
            continue
        first, _, rest = cells.partition(" ")
        if not line.startswith("│ " + " " * 3):  # (a command's first line; its others are indented)
            name = first
            rows[name] = [rest.strip()]
        elif name is not None:
            rows[name].append(cells)
    width = max(len(line) for lines in rows.values() for line in lines)  # (the summaries' column)
    for info in app.registered_commands:
        cmd = info.name or info.callback.__name__
        if cmd not in rows:
            continue
        want = " ".join(inspect.cleandoc(info.callback.__doc__).split("\n\n")[0].replace("`", "").split())
        got = [line.replace("`", "") for line in rows[cmd]]
        assert got == textwrap.wrap(want, width, break_on_hyphens=False), cmd


def test_analyze_help_lists_the_table_names_and_the_shell_completes_them() -> None:
    from slotscope import analyze as analysis

    text = " ".join(run("analyze", "--help").stdout.replace("│", " ").split())
    assert f"Only this table: {', '.join(analysis.table_names())} (slotscope explain TABLE says" in text
    assert "--install-completion" in run("--help").stdout
    env = {"_SLOTSCOPE_COMPLETE": "complete_bash", "COMP_WORDS": "slotscope analyze --table st", "COMP_CWORD": "3"}
    res = runner.invoke(app, [], env=env, prog_name="slotscope")
    assert res.stdout.split() == ["stalls", "stalls-worst"]


def test_tasks_csv_when_piped_has_the_stable_columns_first() -> None:
    res = run("tasks", str(REAL / "before" / "logs"))
    assert res.exit_code == 0, res.stderr
    header, *rows = res.stdout.splitlines()
    assert header.startswith(TASK_COLUMNS)
    assert len(rows) == 45
    assert "lines read 563" in res.stderr and "unrecognized 0" in res.stderr
    assert "tasks: 45 complete" in res.stderr


def test_wallclock_tasks_have_iso_wall_columns() -> None:
    res = run("tasks", str(REAL / "wallclock" / "logs"), "-f", "csv", "-q")
    df = pd.read_csv(io.StringIO(res.stdout))
    assert df["launch_at"].str.match(r"^2026-11-29T\d\d:\d\d:\d\d\.\d{6}\+00:00$").all()
    assert res.stderr == ""


@pytest.mark.parametrize("kind,columns", [("gen", GEN_COLUMNS), ("prefill", PREFILL_COLUMNS)])
def test_samples(kind: str, columns: str) -> None:
    res = run("samples", str(REAL / "after" / "logs"), "--kind", kind, "-q")
    assert res.exit_code == 0
    assert res.stdout.splitlines()[0].startswith(columns)


def test_since_until_on_the_server_clock() -> None:
    res = run("tasks", str(REAL / "before" / "logs"), "--since", "100", "--until", "200", "-q")
    df = pd.read_csv(io.StringIO(res.stdout))
    assert len(df) > 0 and df["launch_s"].between(100, 200).all()
    res = run("tasks", str(REAL / "before" / "logs"), "--since", "2026-11-29T07:35:00")
    assert res.exit_code == 2 and "wall-clock" in res.stderr


def test_match_csv_columns() -> None:
    res = run("match", str(REAL / "restart" / "logs"), "-f", "csv")
    assert res.exit_code == 0
    assert res.stdout.splitlines()[0].startswith(MATCH_COLUMNS)
    assert "server started" in res.stderr and "matched 40 of 40 calls" in res.stderr


def test_format_from_extension_and_parquet(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    res = run("tasks", str(REAL / "before" / "logs"), "-o", str(out), "-q")
    assert res.exit_code == 0 and res.stdout == ""
    assert len(pd.read_parquet(out)) == 45
    js = tmp_path / "t.json"
    run("tasks", str(REAL / "before" / "logs"), "-o", str(js), "-q")
    assert len(pd.read_json(js)) == 45


def test_parquet_to_a_terminal_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "is_terminal", lambda stream: True)
    res = run("tasks", str(REAL / "before" / "logs"), "-f", "parquet")
    assert res.exit_code == 2
    assert "refusing to write binary Parquet to a terminal" in res.stderr


def test_table_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "is_terminal", lambda stream: True)
    res = run("tasks", str(REAL / "before" / "logs"), "-q")
    assert res.exit_code == 0
    assert "complete" in res.stdout and "source,session" not in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 100


@pytest.mark.parametrize("content,reason", [(b"", "empty file"), (b"\x00\x01\x02" * 500, "binary data"),
                                            (b"hello world\n", "neither a llama-server log nor an app call log")])
def test_unusable_file_is_one_error_line(tmp_path: Path, content: bytes, reason: str) -> None:
    f = tmp_path / "x.log"
    f.write_bytes(content)
    res = run("tasks", str(f))
    assert res.exit_code == 1
    assert res.stderr.strip() == f"error: {f}: {reason}" or res.stderr.strip().startswith(f"error: {f}: {reason}")
    assert "Traceback" not in res.stderr


def test_usage_errors_exit_2() -> None:
    assert run("tasks").exit_code == 2
    assert run("samples", str(REAL / "before" / "logs"), "--kind", "nope").exit_code == 2
    assert run("tasks", str(REAL / "before" / "logs"), "--format", "xml").exit_code == 2


def test_missing_path() -> None:
    res = run("tasks", "/no/such/dir")
    assert res.exit_code == 1
    assert res.stderr.strip() == "error: /no/such/dir: no such file or directory"


def test_a_directory_that_cannot_be_listed_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real logs in a directory with mode 000: listing it ended in a PermissionError
    traceback (found by fault injection). One line names the directory instead."""
    import os
    import shutil

    logs = tmp_path / "logs"
    shutil.copytree(REAL / "before" / "logs", logs)
    logs.chmod(0)
    if os.geteuid() == 0:  # (root lists any directory: answer as the kernel does for others)
        listdir = os.listdir

        def denied(p: object) -> list[str]:
            if os.fspath(p) == str(logs):  # type: ignore[call-overload]
                raise PermissionError(13, "Permission denied", str(logs))
            return listdir(p)  # type: ignore[call-overload]

        monkeypatch.setattr(os, "listdir", denied)
    try:
        for cmd in ("tasks", "analyze"):
            assert refused(cmd, str(logs)) == f"error: {logs}: cannot read: Permission denied"
    finally:
        logs.chmod(0o755)


def _first_app_record(field: str, value: object) -> str:
    import json

    lines = (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    record[field] = value
    record.pop("end")  # (a duration without an end: the end is derived from it)
    return "\n".join([json.dumps(record)] + lines[1:]) + "\n"


def _header_only_csv() -> str:
    return "request_id,timestamp,kind,user_id,adapter,input_tokens,output_tokens,cached_tokens,status_code,error,latency_ms\n"


# (command, file, its text, the first lines of stderr: {f} is the file) for the fuzz's crash
# cases (a TypeError, OutOfBoundsDatetime, ArrowNotImplementedError), now each read as the
# README says: a damaged count or time reads as missing, a task id past 2^53 unrecognized.
_PLAIN = (FORMATS / "plain.log").read_text()
CRASHES = {
    "task id 2^63-1": ("tasks", "llama-server.log", _PLAIN.replace("| task 0 |", "| task 9223372036854775807 |"),
                       ["lines read 299: used 236, known and ignored 55, unrecognized 8",
                        "  {f} (server): 299 lines, used 236, ignored 55, unrecognized 8",
                        "tasks: 24 complete, 0 cancelled, 0 incomplete; server sessions: 1",
                        "  unrecognized: {f}:11: 0.04.741.786 I slot launch_slot_: id  3 | task 9223372036854775807 | "
                        "processing task, is_child = 0"]),
    "n_tokens 1e20": ("tasks", "llama-server.log", _PLAIN.replace("/  2281 tokens", "/  100000000000000000000 tokens", 1),
                      ["lines read 299: used 243, known and ignored 56, unrecognized 0",
                       "  {f} (server): 299 lines, used 243, ignored 56, unrecognized 0",
                       "tasks: 25 complete, 0 cancelled, 0 incomplete; server sessions: 1"]),
    "n_gen 1e26": ("samples", "llama-server.log", _PLAIN.replace("n_gen =    148,", "n_gen = 100000000000000000000000000,", 1),
                   ["lines read 299: used 243, known and ignored 56, unrecognized 0",
                    "  {f} (server): 299 lines, used 243, ignored 56, unrecognized 0",
                    "tasks: 25 complete, 0 cancelled, 0 incomplete; server sessions: 1"]),
    "prompt_tokens 2^63": ("calls", "app.jsonl", _first_app_record("prompt_tokens", 2**63),
                           ["lines read 45: used 45, known and ignored 0, unrecognized 0",
                            "  {f} (app): 45 lines, used 45, ignored 0, unrecognized 0",
                            "  unrecognized: {f}:1: prompt_tokens out of range: 9223372036854775808"]),
    "duration_ms 1e308": ("calls", "app.jsonl", _first_app_record("duration_ms", 1e308),
                          ["lines read 45: used 45, known and ignored 0, unrecognized 0",
                           "  {f} (app): 45 lines, used 45, ignored 0, unrecognized 0",
                           "  unrecognized: {f}:1: duration_ms out of range: 1e+308"]),
    "header-only CSV": ("calls", "calls.csv", _header_only_csv(),
                        ["lines read 1: used 0, known and ignored 1, unrecognized 0",
                         "  {f} (app): 1 lines, used 0, ignored 1, unrecognized 0"]),
}


@pytest.mark.parametrize("case", sorted(CRASHES))
def test_the_fuzz_crash_cases_exit_0_with_their_lines_counted(tmp_path: Path, case: str) -> None:
    """The crash cases of the fuzz, derived from real lines, as the command line meets them:
    exit 0, stdout the table, and stderr's accounting exactly."""
    cmd, name, text, want = CRASHES[case]
    f = tmp_path / name
    f.write_text(text)
    res = run(cmd, str(f), "-f", "csv")
    assert res.exit_code == 0 and res.exception is None, res.stderr
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr
    assert res.stderr.splitlines()[: len(want)] == [w.format(f=f) for w in want]


def test_strict_fails_on_unrecognized_lines(tmp_path: Path) -> None:
    f = tmp_path / "l.log"
    f.write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes() + b"what is this\n")
    assert run("tasks", str(f), "-q").exit_code == 0
    res = run("tasks", str(f), "--strict")
    assert res.exit_code == 1
    assert f"{f}:564: what is this" in res.stderr


def test_stdin_and_gzip(tmp_path: Path) -> None:
    import gzip

    raw = (REAL / "before" / "logs" / "llama-server.log").read_bytes()
    plain = runner.invoke(app, ["tasks", "-", "-q"], input=raw)
    assert plain.exit_code == 0 and len(plain.stdout.splitlines()) == 46
    packed = runner.invoke(app, ["tasks", "-", "-q"], input=gzip.compress(raw))
    assert packed.exit_code == 0 and packed.stdout == plain.stdout


def test_head_closes_the_pipe_quietly(tmp_path: Path) -> None:
    big = tmp_path / "big.log"
    raw = (REAL / "after" / "logs" / "llama-server.log").read_bytes()
    big.write_bytes(raw * 60)
    proc = subprocess.Popen([sys.executable, "-m", "slotscope", "tasks", str(big), "-f", "csv", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    _, errout = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert b"Traceback" not in errout and errout == b""


def test_where_lists_the_tasks_behind_a_row() -> None:
    res = run("tasks", str(REAL / "before" / "logs"), "--where", "wait_before_prefill_ms >= 1000", "-q")
    df = pd.read_csv(io.StringIO(res.stdout))
    assert len(df) == 31 and (df["wait_before_prefill_ms"] >= 1000).all()  # = the waits table's 29 + 2
    bad = run("tasks", str(REAL / "before" / "logs"), "--where", "no_such_column > 1")
    assert bad.exit_code == 2 and "columns: source, session" in bad.stderr


def test_a_compressed_copy_beside_the_log_is_not_read_as_its_rotation(tmp_path: Path) -> None:
    import gzip

    raw = (REAL / "before" / "logs" / "llama-server.log").read_bytes()
    (tmp_path / "llama-server.log").write_bytes(raw)
    (tmp_path / "llama-server.log.gz").write_bytes(gzip.compress(raw))
    res = run("tasks", str(tmp_path))
    df = pd.read_csv(io.StringIO(res.stdout))
    assert df.groupby("source").size().tolist() == [45, 45]  # two sources, each read once
    assert "hold the same rotation position" in res.stderr


def test_progress_bar_draws_without_a_thread_so_workers_fork_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte bar (a terminal, large input) is drawn by the reading thread: when the worker
    processes are forked, no rich refresh thread is alive to be copied holding a lock."""
    import os
    import threading

    from rich.console import Console

    from slotscope import cli, server_log

    monkeypatch.setenv("TERM", "xterm")  # the suite's "dumb" terminal draws no bar
    screen = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=screen, force_terminal=True, width=100))
    logs = REAL / "before" / "logs"
    size = (logs / "llama-server.log").stat().st_size
    monkeypatch.setattr(cli, "_long_run", lambda paths: size)
    monkeypatch.setenv("SLOTSCOPE_JOBS", "2")
    monkeypatch.setattr(server_log, "CHUNK_SIZE", 8192)  # several blocks: the workers parse them
    threads_at_fork: list[int] = []
    watching = [True]
    os.register_at_fork(before=lambda: watching[0] and threads_at_fork.append(threading.active_count()))
    try:
        before = threading.active_count()
        res = run("tasks", str(logs), "-f", "csv", "--quiet")
    finally:
        watching[0] = False
    assert res.exit_code == 0, res.output
    assert threads_at_fork and set(threads_at_fork) == {before}
    assert "reading" in screen.getvalue() and "kB" in screen.getvalue()  # the bar was drawn
    assert len(res.stdout.splitlines()) == 46  # header + 45 tasks, as without the bar


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_tmpdir_that_is_not_a_directory_is_one_clear_error(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python falls back to /tmp when TMPDIR is unusable, without a word: a user who set it to
    spare a small /tmp would fill it. slotscope says so instead, in one line."""
    bad = tmp_path / "nowhere"
    if kind == "a file":
        bad.write_text("")
    monkeypatch.setenv("TMPDIR", str(bad))
    res = run("analyze", str(REAL / "before" / "logs"))
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {bad}: TMPDIR is not a directory: cannot write ")
    assert "Traceback" not in res.stderr


def test_no_usable_temporary_directory_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TMPDIR unset and none of Python's fallbacks writable (/tmp read-only, found by fault
    injection): the FileNotFoundError's handler asked Python for the directory again and raised
    a second time, a traceback. One line says what was tried and what to set."""
    import tempfile

    gone = tmp_path / "gone"
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(gone)])
    err = refused("analyze", str(REAL / "before" / "logs"))
    assert err.splitlines()[-1] == (
        "error: cannot write finished tasks (~300 bytes per row) to the temporary directory (No usable temporary "
        f"directory found in [{str(gone)!r}]); set TMPDIR to a directory with room")


def test_an_app_log_with_no_usable_call_gives_the_report_and_counts_its_lines(tmp_path: Path) -> None:
    """Every call's start time unreadable (the real app log's, spoiled): no call to join, so
    the report is the server log's, and each app line is counted as unrecognized."""
    import json
    import shutil

    logs = REAL / "before" / "logs"
    shutil.copy(logs / "llama-server.log", tmp_path / "llama-server.log")
    records = [json.loads(line) for line in (logs / "app.jsonl").read_text().splitlines()]
    spoiled = [{**r, "start": "not a time", "end": "not a time"} for r in records]
    (tmp_path / "app.jsonl").write_text("".join(json.dumps(r) + "\n" for r in spoiled))
    res = run("analyze", str(tmp_path))
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr and "could not compute" not in res.stdout + res.stderr
    assert f"app.jsonl (app): {len(records)} lines, used 0, ignored 0, unrecognized {len(records)}" in res.stderr


def test_a_log_that_only_starts_like_gzip_is_one_clear_error(tmp_path: Path) -> None:
    """Two bytes of gzip's magic before real lines (found by fuzzing): the inflater's own error
    class (isal's, not zlib's) ended in a traceback. One line names the file instead."""
    log = tmp_path / "llama-server.log"
    log.write_bytes(b"\x1f\x8b" + (REAL / "before" / "logs" / "llama-server.log").read_bytes()[:4000])
    err = refused("analyze", str(log))
    assert err.splitlines()[-1].startswith(f"error: {log}: cannot read: ")


def test_a_server_log_without_tasks_is_an_empty_report_that_says_why(tmp_path: Path) -> None:
    """Real excerpts often hold only the start-up lines. The task table then has every column
    (no rows): each report table computes, and the report says why it is empty."""
    from slotscope import analyze as analysis
    from slotscope.dataset import load

    lines = (REAL / "before" / "logs" / "llama-server.log").read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if "launch_slot_" in line)
    log = tmp_path / "llama-server.log"
    log.write_text("".join(lines[:first]))
    res = run("analyze", str(log))
    assert res.exit_code == 0 and "Traceback" not in res.stderr
    assert "No task in the server log" in res.stdout and "could not compute" not in res.stdout + res.stderr
    ds = load([log])
    full = load([REAL / "before" / "logs" / "llama-server.log"])
    assert list(ds.server.tasks.columns) == list(full.server.tasks.columns) and len(ds.server.tasks) == 0
    tables = analysis.run(ds, strict=True)  # (strict: a table that fails raises)
    assert "note" not in tables["load"].columns


APP_ALONE = REAL / "before" / "logs" / "app.jsonl"
NEEDS_SERVER = (f"error: no llama-server log among the inputs, only the app call log {APP_ALONE} (45 calls): "
                "{what} needs the server's tasks; an app log alone gives `slotscope analyze` (turns and calls) "
                "and `slotscope calls`")


def test_an_app_log_alone_gives_turns_and_calls_and_says_what_the_server_log_adds() -> None:
    res = run("analyze", str(APP_ALONE))
    assert res.exit_code == 0, res.stderr
    assert "Traceback" not in res.stderr and "could not compute" not in res.stdout
    out = " ".join(res.stdout.split())
    assert "No llama-server log was given: only the app's own times are known" in out
    assert "The server log would add time to first token" in out
    sections = [line.split(" ")[0] for line in res.stdout.splitlines() if line.endswith("─") and " ─" in line]
    assert sections == ["slotscope", "turns", "calls"]
    assert " c-00001 " in res.stdout and "33 more rows" in out
    csv = run("analyze", str(APP_ALONE), "--table", "turns", "-f", "csv")
    assert csv.exit_code == 0, csv.stderr
    turns = pd.read_csv(io.StringIO(csv.stdout)).set_index(["by", "group"])
    assert turns.loc[("purpose", "chat"), "count"] == 31 and turns.loc[("chat turns", "all"), "count"] == 37


@pytest.mark.parametrize("args,what", [(["analyze", "--table", "stalls"], "`stalls`"), (["timeline", "-o", "t.html"], "`timeline`"),
                                       (["compare", "--before", str(APP_ALONE), "--after"], "`compare`")])
def test_what_needs_the_server_log_is_one_line_on_an_app_log_alone(args: list[str], what: str) -> None:
    res = run(*args, str(APP_ALONE))
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines()[-1] == NEEDS_SERVER.format(what=what)
    assert "Traceback" not in res.stderr


def test_match_on_an_app_log_alone_lists_every_call_unmatched() -> None:
    res = run("match", str(APP_ALONE), "-f", "csv")
    assert res.exit_code == 0, res.stderr
    calls = pd.read_csv(io.StringIO(res.stdout))
    assert len(calls) == 45 and (calls["match_method"] == "unmatched:no_server_log").all()
    assert "matched 0 of 45 calls (45 successful)" in res.stderr



@pytest.mark.parametrize("args", [["--help"], ["explain", "basis"], ["explain"]])
def test_help_and_the_glossary_import_no_pandas(args: list[str]) -> None:
    """Commands that read no log start without pandas (the import is most of a run's time)."""
    code = ("import sys; from slotscope.cli import app; from typer.testing import CliRunner; "
            f"r = CliRunner().invoke(app, {args!r}); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('pandas', 'pyarrow', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("shape,said", [
    ("utf-16-le", "UTF-16 text without a byte-order mark; slotscope reads UTF-8, and UTF-16 files that start with "
                  "a byte-order mark: convert it first, e.g. iconv -f UTF-16LE -t UTF-8 FILE"),
    ("utf-16-be", "UTF-16 text without a byte-order mark; slotscope reads UTF-8, and UTF-16 files that start with "
                  "a byte-order mark: convert it first, e.g. iconv -f UTF-16BE -t UTF-8 FILE"),
    ("utf-16.gz", "compressed UTF-16 text; slotscope reads UTF-8, and UTF-16 files that start with a byte-order "
                  "mark: convert it first, e.g. iconv -f UTF-16LE -t UTF-8 FILE"),
])
def test_an_app_log_in_another_shape_says_what_it_is_and_how_to_convert(tmp_path: Path, shape: str, said: str) -> None:
    """The real app log in UTF-16 without a byte-order mark, or compressed: one error line that
    names what was seen and the command that converts it."""
    import json

    records = [json.loads(line) for line in (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()]
    text = "".join(json.dumps(r) + "\n" for r in records)
    f = tmp_path / "calls.json"
    if shape == "utf-16.gz":  # (python's utf-16 writes a byte-order mark, little-endian here)
        import gzip

        f = tmp_path / "calls.json.gz"
        f.write_bytes(gzip.compress(text.encode("utf-16")))
    else:
        f.write_bytes(text.encode(shape))
    err = refused("calls", str(f))
    assert err.startswith(f"error: {f}: {said}")


CR_ONLY = ("line ends are CR alone (as classic Mac OS programs write); slotscope reads LF and CRLF line ends: "
           "convert it first, e.g. tr '\\r' '\\n' < FILE > FILE.txt")


def _cr_only(tmp_path: Path, name: str) -> Path:
    """A real log (the server's, the app's JSONL, or the app's records as a CSV) with each
    line ending in a CR alone."""
    import csv
    import json

    logs = REAL / "before" / "logs"
    if name == "calls.csv":
        records = [json.loads(line) for line in (logs / "app.jsonl").read_text().splitlines()]
        text = io.StringIO()
        w = csv.writer(text, lineterminator="\r")
        w.writerow(["id", "start", "purpose", "user", "prompt_tokens", "completion_tokens", "duration_ms"])
        w.writerows([r["id"], r["start"], r["purpose"], r["user"], r["prompt_tokens"], r["completion_tokens"],
                     r["duration_ms"]] for r in records)
        data = text.getvalue().encode()
    else:
        data = (logs / name).read_bytes().replace(b"\n", b"\r")
    f = tmp_path / name
    f.write_bytes(data)
    return f


@pytest.mark.parametrize("name", ["llama-server.log", "app.jsonl", "calls.csv"])
def test_a_log_whose_lines_end_in_cr_alone_says_so_and_how_to_convert(tmp_path: Path, name: str) -> None:
    """Line ends of a CR alone: the CSV app log ended in a csv.Error traceback, the JSONL one
    was one unrecognized line ("invalid JSON: Extra data"), the server log one line used and
    no task, without a word. Each is one error line that says what it is and how to convert."""
    f = _cr_only(tmp_path, name)
    assert refused("tasks" if name.endswith(".log") else "calls", str(f)) == f"error: {f}: {CR_ONLY}"


def test_a_cr_alone_app_log_in_a_folder_is_skipped_with_the_reason(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "llama-server.log").write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    f = _cr_only(logs, "calls.csv")
    res = run("analyze", str(logs), "--table", "waits", "-f", "csv")
    assert res.exit_code == 0 and "Traceback" not in res.stderr and res.exception is None
    assert f"skipped {f}: {CR_ONLY}" in res.stderr.splitlines()


@pytest.mark.parametrize("shape", ["array", "array-one-line", "pretty"])
def test_an_app_log_as_a_json_document_reads_the_calls_of_its_lines(tmp_path: Path, shape: str) -> None:
    """The real app log as a JSON array (indented, or on one line) or as pretty-printed records
    one after another (`jq .`): the calls of the JSON lines, each at the line its record starts
    on, and every line counted (they were refused as "a JSON array; convert it first")."""
    import json

    jsonl = REAL / "before" / "logs" / "app.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    text = {"array": json.dumps(records, indent=2) + "\n", "array-one-line": json.dumps(records),
            "pretty": "".join(json.dumps(r, indent=2) + "\n" for r in records)}[shape]
    f = tmp_path / "calls.json"
    f.write_text(text)
    res, want = run("calls", str(f), "-f", "csv"), run("calls", str(jsonl), "-f", "csv")
    assert res.exit_code == 0 and "Traceback" not in res.stderr
    got_rows, want_rows = res.stdout.splitlines(), want.stdout.splitlines()
    assert len(got_rows) == len(records) + 1
    header = got_rows[0].split(",")
    at = header.index("line")
    starts = [int(row.split(",")[at]) for row in got_rows[1:]]
    lines = text.splitlines()
    assert all(lines[n - 1].lstrip("[ ").startswith("{") for n in starts)
    other = {at, header.index("file")}
    strip = lambda rows: [",".join(c for i, c in enumerate(r.split(",")) if i not in other) for r in rows]  # noqa: E731
    assert strip(got_rows) == strip(want_rows)
    n, used = len(lines), min(len(lines), len(records))  # (one line of many records is one line used)
    assert res.stderr.splitlines()[0] == f"lines read {n}: used {used}, known and ignored {n - used}, unrecognized 0"


def test_a_bad_record_in_a_json_array_is_one_error_naming_its_line(tmp_path: Path) -> None:
    """A record broken in the middle of an indented array: one error line at the line where the
    JSON breaks (a document cannot be read on past it)."""
    import json

    records = [json.loads(line) for line in (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()]
    lines = json.dumps(records, indent=2).splitlines()
    bad = next(i for i, ln in enumerate(lines) if '"c-00010"' in ln)
    lines[bad] = lines[bad].rstrip(",")  # (a comma lost)
    f = tmp_path / "calls.json"
    f.write_text("\n".join(lines) + "\n")
    err = refused("calls", str(f))
    assert err == (f"error: {f}:{bad + 2}: invalid JSON: Expecting ',' delimiter; a JSON document "
                   "cannot be read on past a bad record: mend it, or write one record per line "
                   "(JSONL), where a bad line is dropped")


def test_a_json_array_of_no_calls_says_what_its_records_hold(tmp_path: Path) -> None:
    """A JSON array that is not a call log (here: the format variants' manifest): what was
    seen, and what an app log's records need."""
    import json

    from .conftest import FORMATS

    variants = json.loads((FORMATS / "manifest.json").read_text())["variants"]
    f = tmp_path / "variants.json"
    f.write_text(json.dumps([{"variant": k, "lines": v["physical_lines"]} for k, v in variants.items()], indent=2))
    err = refused("calls", str(f))
    assert err == (f"error: {f}: a JSON document whose first records have the keys variant, lines; an app "
                   "call log's records need a start time and one of end, duration_ms, prompt_tokens, "
                   "completion_tokens, purpose, lora (--app-columns maps other names)")


def test_how_an_app_log_was_read_is_said_on_stderr(tmp_path: Path) -> None:
    """The real app log with its stamps' zone cut off: the note that they were read as UTC
    reaches stderr (it was kept in the library's accounting only), after the summary."""
    lines = (REAL / "before" / "logs" / "app.jsonl").read_text().replace("+00:00", "")
    f = tmp_path / "app.jsonl"
    f.write_text(lines)
    res = run("calls", str(f), "-f", "csv")
    assert res.exit_code == 0
    assert res.stderr.splitlines()[-1] == f"note: {f}: 90 timestamp(s) without a zone read as UTC (set --tz if wrong)"
    assert "note:" not in run("calls", str(REAL / "before" / "logs" / "app.jsonl"), "-f", "csv").stderr


@pytest.mark.parametrize("shape", ["array", "pretty"])
def test_log_lines_as_one_json_document_say_how_to_convert_them(tmp_path: Path, shape: str) -> None:
    """`journalctl -o json-pretty` (or the records as an array): the server's lines in JSON
    records that span lines. Neither an app log nor server lines to read line by line (every
    line would be unrecognized): one error line that says what it is and how to write it one
    record per line."""
    import json

    from .conftest import FORMATS

    records = [json.loads(line) for line in (FORMATS / "journald_json.log").read_text().splitlines()]
    f = tmp_path / "journal.json"
    f.write_text(json.dumps(records, indent=1) if shape == "array" else "".join(json.dumps(r, indent=8) + "\n"
                                                                                for r in records))
    err = refused("tasks", str(f))
    assert err == (f"error: {f}: log lines as one JSON document (an array, or pretty-printed); JSON "
                   "log lines are read as one object per line: convert it first, e.g. jq -c '.[]' "
                   "FILE (an array) or jq -c . FILE (pretty-printed) > FILE.jsonl (journalctl: "
                   "-o json, not json-pretty)")
