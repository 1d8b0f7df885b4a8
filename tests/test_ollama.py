"""Ollama's logs: real excerpts from public threads, and a capture rewritten as Ollama v0.30+ logs it."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner, Result

import slotscope
from slotscope.analyze import Options
from slotscope.analyze import ollama as ao
from slotscope.cli import app

from . import conftest
from slotscope.match import MATCH_COLUMNS
from slotscope.ollama import parse_duration_ms

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "ollama"
SHOWN = conftest.EXCERPTS / "ollama"  # the excerpts of public threads, shared with test_excerpts
EXCERPTS = sorted(SHOWN.glob("*.log"))


def truth(variant: str) -> pd.DataFrame:
    return pd.DataFrame([json.loads(x) for x in (FIX / variant / "truth.jsonl").read_text().splitlines()])


@pytest.mark.parametrize("path", EXCERPTS, ids=lambda p: p.name)
def test_every_excerpt_is_read_with_every_line_counted(path: Path) -> None:
    r = CliRunner().invoke(app, ["tasks", str(path), "-f", "csv"])
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    logs = slotscope.read_server_logs([str(path)])
    f = logs.accounting.files[0]
    n = len(path.read_text().splitlines())
    assert f.lines == n and f.used + f.ignored + f.unrecognized == n


def test_gin_lines_become_calls_with_what_the_line_shows() -> None:
    calls = slotscope.read_server_logs([str(SHOWN / "01.log")]).ollama.calls
    assert len(calls) == 9
    first = calls.iloc[0]
    # [GIN] 2025/12/23 - 10:34:40 | 200 | 57.956598944s |   192.168.0.131 | POST     "/api/chat"
    assert first["end_at"] == pd.Timestamp("2025-12-23T10:34:40Z")  # slog lines say Z
    assert first["latency_ms"] == pytest.approx(57956.598944)
    assert first["start_at"] == pd.Timestamp("2025-12-23T10:33:42.043401Z")
    assert (first["status"], first["method"], first["path"], first["client"], first["line"]) == (
        200, "POST", "/api/chat", "192.168.0.131", 6)
    assert calls.iloc[1]["latency_ms"] == 103_000  # 1m43s


def test_gin_times_take_the_slog_zone_and_journald_the_tz() -> None:
    calls = slotscope.read_server_logs([str(SHOWN / "09.log")]).ollama.calls
    assert calls.iloc[0]["end_at"] == pd.Timestamp("2024-12-06T11:14:13+08:00")
    j = slotscope.read_server_logs([str(SHOWN / "03.log")], tz="Europe/Berlin").ollama.calls
    assert list(j["status"].unique()) == [500] and len(j) == 10  # (line 1 pasted with a backtick)
    assert j.iloc[0]["end_at"] == pd.Timestamp("2024-12-11T09:58:58+01:00")
    assert j.iloc[0]["latency_ms"] == 1_799_000  # 29m59s


def test_go_durations() -> None:
    got = parse_duration_ms(pd.Series(["837.348699ms", "57.956598944s", "1m43s", "61.4µs", "1h2m3s", "30m0s", "x"]))
    assert got.iloc[:6].tolist() == pytest.approx([837.348699, 57956.598944, 103000, 0.0614, 3723000, 1800000])
    assert pd.isna(got.iloc[6])


def figures(path: Path) -> dict[str, str]:
    """The ``ollama`` table of a log, figure -> value."""
    table = slotscope.analyze.run(slotscope.load([str(path)]), names=["ollama"], strict=True)["ollama"]
    return dict(zip(table["figure"], table["value"]))


def test_events_aborts_config_and_runner_start() -> None:
    ev = slotscope.read_server_logs([str(SHOWN / "07.log")]).ollama.events
    assert (ev["kind"] == "abort").sum() == 5
    assert figures(SHOWN / "07.log")["client aborts"] == "5"
    # 2024/05/27 12:32:31 routes.go:1028: INFO server config env="map[... OLLAMA_MAX_QUEUE:512 ... OLLAMA_NUM_PARALLEL:1 ...
    fig5 = figures(SHOWN / "05.log")
    assert (fig5["OLLAMA_NUM_PARALLEL"], fig5["OLLAMA_MAX_QUEUE"], fig5["version"]) == ("1", "512", "0.1.39")
    assert figures(SHOWN / "19.log")["runner parallel (-np)"] == "4"  # starting llama server ... --parallel 4


@pytest.mark.parametrize("variant", ["parallel", "serialized"])
def test_calls_match_their_task_one_to_one(variant: str) -> None:
    ds = slotscope.load([str(FIX / variant / "logs")])
    calls = ao.joined_calls(ds)
    t = truth(variant)
    assert len(calls) == len(t) == 49
    assert calls["task_id"].notna().all() and calls["task_id"].is_unique
    # In end order, each [GIN] line's task is the one the load generator's call was served by.
    by_end = t.sort_values("t_end", kind="stable")["task_id"].tolist()
    assert calls["task_id"].astype(int).tolist() == by_end


@pytest.mark.parametrize("variant", ["parallel", "serialized"])
def test_queue_times_within_a_second_of_the_truth(variant: str) -> None:
    calls = ao.joined_calls(slotscope.load([str(FIX / variant / "logs")]))
    m = calls.merge(truth(variant), on="task_id", suffixes=("", "_truth"))
    err = (m["queue_ms"] - m["queue_ms_truth"]).abs()
    if variant == "serialized":
        assert err.max() < 1000
    else:
        # One task of the 49 waited 1.46 s before its prefill with no runner line in between to
        # show it: that wait counts as queue. Every other call is within a second.
        assert (err < 1000).sum() >= 48 and err.max() < 1500


def test_the_parallel_finding_on_the_serialized_variant_only() -> None:
    ser = slotscope.load([str(FIX / "serialized" / "logs")])
    table, said = ao.summary(ser, Options())
    assert any("OLLAMA_NUM_PARALLEL=1 lets the runner take one at a time" in s for s in said)
    fig = dict(zip(table["figure"], table["value"]))
    assert fig["tasks running at once in the runner (most)"] == "1"
    assert int(fig["calls in flight at once (most)"]) > 1
    par = slotscope.load([str(FIX / "parallel" / "logs")])
    table, said = ao.summary(par, Options())
    assert not any("one at a time" in s for s in said)
    assert dict(zip(table["figure"], table["value"]))["tasks running at once in the runner (most)"] == "4"


def test_analyze_shows_ollamas_section() -> None:
    r = CliRunner().invoke(app, ["analyze", str(FIX / "serialized" / "logs")], env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    assert "ollama-findings" in r.output and "OLLAMA_NUM_PARALLEL=1" in r.output
    r = CliRunner().invoke(app, ["analyze", str(FIX / "serialized" / "logs"), "--table", "ollama-calls", "-f", "csv"])
    assert r.exit_code == 0
    header = r.stdout.splitlines()[0].split(",")
    assert header[:10] == ["source", "call_id", "start_at", "end_at", "latency_ms", "status", "method", "path", "client", "line"]
    assert "+01:00" in r.stdout.splitlines()[1]  # the zone of Ollama's slog lines


@pytest.mark.parametrize("variant", ["parallel", "serialized"])
def test_runner_tasks_begin_where_their_lines_allow(variant: str) -> None:
    """A runner line is untimed: the task table itself gives each launch the latest time its
    lines allow, so no table reads a launch after its prefill or a negative wait."""
    tasks = slotscope.read_server_logs([str(FIX / variant / "logs")]).tasks
    assert len(tasks) == 49 and (tasks["time_resolution_s"] == 1.0).all()
    assert (tasks["wait_before_prefill_ms"] >= 0).all()
    assert (tasks["prefill_start_s"] >= tasks["launch_s"]).all()
    m = tasks.merge(truth(variant), on="task_id")
    late = m["launch_at"].astype("int64") / 1e6 - m["launch"]  # (the launch_at's unit: µs)
    # Upper bounds: never early; late by under the 1 s resolution but for the one task whose
    # prefill waited 1.46 s with no runner line in between (its wait is not seen).
    assert late.min() > -0.01 and (late < 1).sum() >= 48 and late.max() < 2


@pytest.mark.parametrize("variant", ["parallel", "serialized"])
def test_a_slot_runs_one_task_at_a_time(variant: str) -> None:
    """A release line is timed by the next stamped line, which may come after the slot's next
    launch: each release is bounded by that launch, so the one slot of the serialized runner
    never shows two tasks, and every release stays an upper bound within the resolution."""
    ds = slotscope.load([str(FIX / variant / "logs")])
    load = slotscope.analyze.run(ds, names=["load"], strict=True)["load"]
    assert int(load["max_running"].max()) <= int(load["n_slots"].max())
    m = ds.tasks.merge(truth(variant), on="task_id")
    late = m["release_at"].astype("int64") / 1e6 - m["release"]
    assert late.min() > -0.01 and late.max() < 1
    for _, slot in ds.tasks.sort_values("launch_s").groupby("slot"):
        assert (slot["launch_s"].to_numpy()[1:] >= slot["release_s"].to_numpy()[:-1]).all()


@pytest.mark.parametrize("variant", ["parallel", "serialized"])
def test_load_is_the_runners_busy_time(variant: str) -> None:
    ds = slotscope.load([str(FIX / variant / "logs")])
    load = slotscope.analyze.run(ds, names=["load"], strict=True)["load"]
    overall = load[load["scope"] == "overall"]
    busy = 1 - float(overall.loc[overall["running"] == 0, "share"].sum())
    t = truth(variant)
    spans = t.sort_values("launch")[["launch", "release"]].to_numpy()
    covered, reach = 0.0, -float("inf")  # the union of launch..release, as the load generator saw it
    for a, b in spans:
        covered += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    assert busy == pytest.approx(covered / (t["release"].max() - t["launch"].min()), abs=0.01)


def run(*args: str) -> Result:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    return r


def test_calls_are_the_gin_lines_without_an_app_log() -> None:
    r = run("calls", str(FIX / "serialized" / "logs"), "-f", "csv")
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(io.StringIO(r.stdout))
    assert list(rows.columns[:10]) == ["source", "call_id", "start_at", "end_at", "latency_ms", "status", "method",
                                       "path", "client", "line"]
    assert len(rows) == 49 and set(rows["path"]) == {"/api/chat"}  # (/api/tags and /api/show: known, ignored)
    log = (FIX / "serialized" / "logs" / "server.log").read_text().splitlines()
    first = rows.iloc[0]
    # [GIN] 2026/11/29 - 08:43:07 | 200 |         1m11s |       127.0.0.1 | POST    "/api/chat"
    assert "[GIN] 2026/11/29 - 08:43:07 | 200 |         1m11s |" in log[first["line"] - 1]
    assert (first["end_at"], first["start_at"], first["latency_ms"]) == (
        "2026-11-29T08:43:07+01:00", "2026-11-29T08:41:56+01:00", 71000.0)
    # Every line counted: the 49 [GIN] calls, the slog lines the report reads and the runner's are used.
    assert f"{len(log)} lines, used 828, ignored 65, unrecognized 0" in r.stderr


def test_match_joins_the_gin_calls_with_an_ollama_log_alone() -> None:
    r = run("match", str(FIX / "parallel" / "logs"), "-f", "csv")
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(io.StringIO(r.stdout))
    assert list(rows.columns[:19]) == MATCH_COLUMNS  # the match table's columns, where [GIN] says them
    assert len(rows) == 49 and (rows["match_method"] == "end+duration").all() and rows["task_id"].is_unique
    m = rows.merge(truth("parallel"), on="task_id", suffixes=("", "_truth"))
    assert ((m["queue_ms"] - m["queue_ms_truth"]).abs() < 1500).all()
    assert rows["purpose"].isna().all() and (rows["prompt_tokens"] > 0).all()
    assert "matched 49 of 49 [GIN] calls to runner tasks" in r.stderr
    r = run("match", str(FIX / "parallel" / "logs"), "--unlogged", "-f", "csv")
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 1  # (the header: every task has its call)


def test_compare_and_timeline_run_on_ollama_logs(tmp_path: Path) -> None:
    ser, par = str(FIX / "serialized" / "logs"), str(FIX / "parallel" / "logs")
    r = run("compare", "--before", ser, "--after", par, "--table", "overall", "-f", "csv")
    assert r.exit_code == 0, r.output
    overall = pd.read_csv(io.StringIO(r.stdout)).set_index("metric")
    assert overall.loc["observed_s", "before"] > overall.loc["observed_s", "after"]  # (one call at a time takes longer)
    r = run("compare", ser, "--before", "2026-11-29T07:40..2026-11-29T07:55", "--after", "2026-11-29T07:55..2026-11-29T08:20")
    assert r.exit_code == 0, r.output
    assert "overall" in r.stdout
    pytest.importorskip("altair")
    r = run("timeline", par, "-o", str(tmp_path / "t.html"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t.html").stat().st_size > 10_000


def test_the_first_call_after_an_unload_waits_for_the_reload() -> None:
    """reload: the parallel capture with a 7-minute quiet spell; the keep-alive (5m0s) unloads
    the model, and the first call after it waits 8.62 s for a new runner."""
    ds = slotscope.load([str(FIX / "reload" / "logs")])
    calls = ao.joined_calls(ds)
    t = truth("reload")
    assert ds.server.sessions["session"].tolist() == [1, 2]  # (a runner process each)
    m = calls.merge(t, on=["session", "task_id"], suffixes=("", "_truth"))
    assert len(m) == len(calls) == 49 and calls["task_id"].notna().all()
    waited = m[m["load_wait_ms"] > 0]
    first = t[t["load_wait_ms"] > 0]
    assert waited["call"].tolist() == first["call"].tolist() == [t.sort_values("t_send")["call"].iloc[25]]
    assert abs(waited["load_wait_ms"].iloc[0] - first["load_wait_ms"].iloc[0]) < 1000
    assert ((m["queue_ms"] - m["queue_ms_truth"]).abs() < 1500).all()
    fig = figures(FIX / "reload" / "logs")
    # Two loads (at start, after the gap), each said twice ("llama-server started in"): one counted.
    assert (fig["model loads"], fig["cold loads (a call waited on them)"], fig["calls that waited on a load"]) == ("2", "1", "1")
    assert float(fig["cold load seconds (total)"]) == pytest.approx(8.62)
    assert fig["model unloads (keep-alive ran out; DEBUG lines)"] == "1"
    said = slotscope.analyze.run(ds, names=["ollama-findings"], strict=True)["ollama-findings"]["finding"].tolist()
    assert any(s.startswith("1 call(s) waited for a model load after 1 unload(s) of the model (keep-alive 5m0s)")
               for s in said)



def test_a_load_that_began_after_the_calls_start_is_cold() -> None:
    """serialized: the runner starts when the first call comes, 2 ms after it; the [GIN] line
    puts that call's start up to a second early (its end is cut to the second, its latency is
    whole seconds above a minute), so the load lies inside the call's wait, not at its start."""
    fig = figures(FIX / "serialized" / "logs")
    assert (fig["model loads"], fig["cold loads (a call waited on them)"], fig["calls that waited on a load"]) == ("1", "1", "1")
    assert float(fig["cold load seconds (total)"]) == pytest.approx(0.51)

_LAUNCH = re.compile(r"id +(\d+) \| task (\d+) \| processing task")
_PROGRESS = re.compile(r"id +(\d+) \| task (\d+) \| prompt processing, n_tokens = +(\d+), progress = ([0-9.]+), "
                       r"t = +([0-9.]+) s / ([0-9.]+) tokens per second")
_HEARTBEAT = re.compile(r"id +(\d+) \| task (\d+) \| n_gen = +(\d+), tg = +([0-9.]+) t/s, tg_3s = +([0-9.]+) t/s")
_TIMING = re.compile(r"\| task (\d+) \| +(prompt eval|eval|total) time = +([0-9.]+) ms")
RUNNER_LOGS = EXCERPTS + [FIX / v / "logs" / "server.log" for v in ("parallel", "serialized", "reload")]


@pytest.mark.parametrize("path", RUNNER_LOGS, ids=lambda p: p.name if p.parent == SHOWN else p.parent.parent.name)
def test_runner_lines_become_tasks_and_samples_as_the_lines_say(path: Path) -> None:
    """Each llama-server line inside an Ollama log is read as the line says: a launch is a
    task at that line, a progress line or heartbeat a sample with the line's figures, and a
    task's timings are those its timing lines print."""
    logs = slotscope.read_server_logs([str(path)])
    text = path.read_text().splitlines()
    launches = [(i + 1, int(m[1]), int(m[2])) for i, ln in enumerate(text) if (m := _LAUNCH.search(ln))]
    tasks = logs.tasks
    assert sorted(zip(tasks["line"], tasks["slot"], tasks["task_id"])) == sorted(launches)
    pre = logs.prefill_samples
    want = [(i + 1, int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5]), float(m[6]))
            for i, ln in enumerate(text) if (m := _PROGRESS.search(ln))]
    got = list(zip(pre["line"], pre["slot"], pre["task_id"], pre["n_tokens"], pre["progress"], pre["elapsed_s"], pre["tps"]))
    assert sorted(got) == sorted(want)
    gen = logs.gen_samples
    want = [(i + 1, int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5]))
            for i, ln in enumerate(text) if (m := _HEARTBEAT.search(ln))]
    assert sorted(zip(gen["line"], gen["slot"], gen["task_id"], gen["n_gen"], gen["tg_tps"], gen["tg_3s_tps"])) == sorted(want)
    # (Task ids repeat across runner processes: a task's timing lines follow its launch.)
    column = {"prompt eval": "prompt_eval_ms", "eval": "eval_ms", "total": "total_ms"}
    for i, ln in enumerate(text):
        if m := _TIMING.search(ln):
            own = tasks[(tasks["task_id"] == int(m[1])) & (tasks["line"] < i + 1)].sort_values("line").iloc[-1]
            assert own[column[m[2]]] == float(m[3]), (i + 1, ln)
    if path.name == "11.log":  # (a task caught mid-prefill: launched, one progress line, no timings)
        assert (len(tasks), tasks["status"].iloc[0], len(pre)) == (1, "incomplete", 1)
