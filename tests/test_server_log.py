"""The parser on the real captured logs, checked against the server's own timings in truth.jsonl."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from slotscope.server_log import read_server_logs

from .conftest import FORMATS, REAL, SCENARIOS, load_meta, load_truth


@pytest.fixture(scope="module", params=SCENARIOS)
def scenario(request: pytest.FixtureRequest) -> tuple[str, object]:
    name = request.param
    return name, read_server_logs([REAL / name / "logs"])


def test_every_line_is_used_or_known(scenario) -> None:
    name, logs = scenario
    acc = logs.accounting
    server = [f for f in acc.files if f.kind == "server"]
    assert len(server) == 1
    raw = (REAL / name / "logs" / "llama-server.log").read_bytes()
    assert server[0].lines == raw.count(b"\n")
    assert server[0].unrecognized == 0, acc.examples()
    assert server[0].used + server[0].ignored == server[0].lines


def test_one_task_per_launch_line(scenario) -> None:
    name, logs = scenario
    launches = (REAL / name / "logs" / "llama-server.log").read_text().count("processing task")
    assert len(logs.tasks) == launches
    assert not logs.tasks.duplicated(["source", "session", "task_id"]).any()


def test_each_call_with_timings_has_exactly_one_equal_task(scenario) -> None:
    name, logs = scenario
    t = logs.tasks
    calls = [c for c in load_truth(name) if c.get("timings")]
    assert calls
    for c in calls:
        tm = c["timings"]
        hit = t[
            (t["prompt_tokens_new"] == tm["prompt_n"])
            & (t["n_gen"] == tm["predicted_n"])
            & ((t["prompt_eval_ms"] - round(tm["prompt_ms"], 2)).abs() < 0.006)
            & ((t["eval_ms"] - round(tm["predicted_ms"], 2)).abs() < 0.006)
        ]
        assert len(hit) == 1, c["id"]
        row = hit.iloc[0]
        # cached prompt tokens derived from the release line equal the server's cache_n
        assert row["prompt_tokens_cached"] == tm["cache_n"]
        assert row["status"] == "complete"


def test_derived_times_follow_the_log_arithmetic(scenario) -> None:
    _, logs = scenario
    t = logs.tasks[logs.tasks["status"] == "complete"]
    assert (t["wait_before_prefill_ms"] >= -1).all()  # prefill never starts before the launch
    assert ((t["release_s"] - t["first_token_s"]) * 1000 >= t["eval_ms"] - 1).all()
    gap = (t["first_token_s"] - t["prefill_start_s"]) * 1000 - t["prompt_eval_ms"]
    assert gap.abs().max() < 0.01


def test_restart_gives_two_sessions_and_no_task_spans_them() -> None:
    logs = read_server_logs([REAL / "restart" / "logs"])
    assert len(logs.sessions) == 2
    t = logs.tasks
    assert sorted(t["session"].unique()) == [1, 2]
    # task ids restart at 0 in the second process: both sessions have a task 0
    assert set(t.loc[t["task_id"] == 0, "session"]) == {1, 2}
    cut = t[t["cut_by_restart"]]
    assert len(cut) == 1 and cut.iloc[0]["status"] == "cancelled"
    s1_end = logs.sessions.loc[logs.sessions["session"] == 1, "last_s"].iloc[0]
    assert (t.loc[t["session"] == 1, "launch_s"] <= s1_end).all()


def test_each_session_names_the_model_its_start_up_loads(tmp_path) -> None:
    """The restart capture has two processes, each with its `loading model` line. A copy with
    the second one naming another file, and a build line (-lv 4 only: common.cpp's
    "%s: build %d (%s) with %s for %s%s", in the frame of the real verbosity line) before the
    first start-up's verbosity line: each session keeps its own."""
    lines = (REAL / "restart" / "logs" / "llama-server.log").read_text().splitlines(keepends=True)
    at = [i for i, ln in enumerate(lines) if "loading model '" in ln]
    names = [re.search(r"loading model '(.*)'", lines[i]).group(1) for i in at]  # type: ignore[union-attr]
    logs = read_server_logs([REAL / "restart" / "logs"])
    assert len(at) == 2 and logs.sessions["model"].tolist() == names
    assert logs.sessions["build"].isna().all()
    assert logs.sessions.columns[-2:].tolist() == ["model", "build"]  # after the columns users had

    lines[at[1]] = lines[at[1]].replace(f"'{names[1]}'", "'models/other-q4.gguf'")
    verbosity = next(i for i, ln in enumerate(lines) if "common_params_print_info: verbosity" in ln)
    head = lines[verbosity].split("common_params_print_info:")[0]
    lines.insert(verbosity, head + "common_params_print_info: build 11434 (4f8e1c2) with GNU 13.3.0 for Linux x86_64\n")
    (tmp_path / "llama-server.log").write_text("".join(lines))
    changed = read_server_logs([tmp_path / "llama-server.log"])
    assert changed.sessions["model"].tolist() == [names[0], "models/other-q4.gguf"]
    assert changed.sessions["build"].iloc[0] == "11434 (4f8e1c2)" and pd.isna(changed.sessions["build"].iloc[1])
    acc = changed.accounting
    assert acc.used == logs.accounting.used + 1 and acc.unrecognized == 0  # the build line is used


def test_wallclock_columns_within_a_second_of_truth() -> None:
    logs = read_server_logs([REAL / "wallclock" / "logs"])
    t = logs.tasks
    assert isinstance(t["launch_at"].dtype, pd.DatetimeTZDtype)
    meta = load_meta("wallclock")
    start = logs.sessions["start_at"].iloc[0].timestamp()
    assert abs(start - meta["server_starts"][0]["popen_wall"]) < 1.0
    checked = 0
    for c in load_truth("wallclock"):
        tm = c["timings"]
        row = t[(t["prompt_tokens_new"] == tm["prompt_n"]) & (t["n_gen"] == tm["predicted_n"])].iloc[0]
        # headers reach the client when prefill starts; the first token at the end of prefill
        assert abs(row["prefill_start_at"].timestamp() - (c["t_send"] + c["headers_ms"] / 1000)) < 1.0
        assert abs(row["first_token_at"].timestamp() - (c["t_send"] + c["first_token_ms"] / 1000)) < 1.0
        assert abs(row["release_at"].timestamp() - c["t_end"]) < 1.0
        checked += 1
    assert checked == len(t)


def test_heartbeat_windows_reproduce_tg_3s() -> None:
    """tg_3s = tokens / window; our window (from timestamps and the first token) must agree."""
    g = read_server_logs([REAL / "after" / "logs"]).gen_samples
    assert len(g) > 100
    speed = g["tokens"].astype(float) / g["window_s"]
    rel = (speed - g["tg_3s_tps"]).abs() / g["tg_3s_tps"]
    assert (rel < 0.02).mean() > 0.98


def test_prefill_steps_show_the_batch_size() -> None:
    before = read_server_logs([REAL / "before" / "logs"]).prefill_samples
    after = read_server_logs([REAL / "after" / "logs"]).prefill_samples
    assert before["step_tokens"].max() == 2048
    assert after["step_tokens"].max() == 512
    assert (after["step_tokens"].dropna() <= 512).all()


def test_wall_offsets_follow_each_rows_session() -> None:
    """Each task row takes its own (port, session)'s wall offset: the lookup agrees with a
    MultiIndex over sessions in any order, some without an offset, rows of unknown sessions."""
    import numpy as np

    from slotscope.tasks import _wall_offsets

    rng = np.random.default_rng(7)
    for _ in range(100):
        pairs = list({(int(rng.integers(-1, 3)), int(rng.integers(0, 5))) for _ in range(int(rng.integers(1, 9)))})
        sessions = pd.DataFrame({"port": [p for p, _ in pairs], "session": [s for _, s in pairs],
                                 "wall_offset_us": [None if rng.random() < 0.3 else int(rng.integers(0, 10**15)) for _ in pairs]})
        n = int(rng.integers(0, 40))
        port, session = rng.integers(-1, 4, n), rng.integers(0, 6, n)
        offsets = sessions.set_index(["port", "session"])["wall_offset_us"].to_numpy(dtype="float64", na_value=np.nan)
        at = sessions.set_index(["port", "session"]).index.get_indexer(pd.MultiIndex.from_arrays([port, session]))
        want = np.where(at >= 0, offsets[at] if n else np.nan, np.nan)
        assert np.array_equal(_wall_offsets(sessions, port, session), want, equal_nan=True)


def test_several_logs_keep_source_and_file_one_category_each() -> None:
    """``source`` and ``file`` are categorical whatever the number of server logs: joined with
    their categories unified and sorted, not turned into a string per row (as pandas joins
    categoricals whose categories differ: five times the memory, and a dtype that depended on
    how many servers were read). Values, order and the text sort are those of the logs alone."""
    paths = [str(REAL / s / "logs" / "llama-server.log") for s in ("restart", "after", "before")]
    alone = [read_server_logs([p]) for p in paths]
    both = read_server_logs(paths)
    for name in ("tasks", "gen_samples", "prefill_samples"):
        joined = getattr(both, name)
        for c in ("source", "file"):
            if c not in joined.columns:
                continue
            col = joined[c]
            assert isinstance(col.dtype, pd.CategoricalDtype), (name, c, col.dtype)
            assert list(col.cat.categories) == sorted(paths), (name, c)
            assert isinstance(getattr(alone[0], name)[c].dtype, pd.CategoricalDtype)
            # sorting by the column sorts as its text does
            assert col.sort_values(kind="stable").astype(str).tolist() == sorted(col.astype(str))
        # each log's rows as read alone (by value), in the order the logs were given
        expect = pd.concat([getattr(s, name).astype({"source": str}) for s in alone], ignore_index=True)
        got = joined.astype({"source": str})
        if "file" in got.columns:
            expect, got = expect.astype({"file": str}), got.astype({"file": str})
        pd.testing.assert_frame_equal(got, expect, check_exact=True)


def test_each_sample_names_the_file_its_line_is_in() -> None:
    """Rotated logs (x.log.2.gz, x.log.1, x.log) number lines per file: every heartbeat and
    progress sample's ``file`` and ``line`` name a line of that kind in that file (the stream's
    name alone, ``source``, would point into the wrong file for two of the three)."""
    import gzip

    logs = read_server_logs([str(FORMATS / "rotated")])
    texts = {}
    for name in logs.tasks["file"].cat.categories:
        with (gzip.open if name.endswith(".gz") else open)(name, "rt") as f:
            texts[name] = f.read().split("\n")
    for table, kind in ((logs.gen_samples, "n_gen ="), (logs.prefill_samples, "prompt processing")):
        assert isinstance(table["file"].dtype, pd.CategoricalDtype)
        assert table["file"].nunique() == 3  # samples in every file
        assert all(kind in texts[f][line - 1] for f, line in zip(table["file"], table["line"]))


def test_samples_kept_on_disk_build_the_same_tables(scenario, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample rows wait in a temporary directory (so reading holds only the tasks) and
    each table, built when read, is the same on every read and pickles as a table."""
    import pickle
    import tempfile

    from slotscope.server_log import Samples

    name, logs = scenario
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lazy = read_server_logs([REAL / name / "logs"])
    assert isinstance(lazy.__dict__["_gen_samples"], Samples)
    assert any(tmp_path.iterdir())  # the rows are on disk, not only in memory
    pd.testing.assert_frame_equal(lazy.tasks, logs.tasks)
    for kind in ("gen_samples", "prefill_samples"):
        pd.testing.assert_frame_equal(getattr(lazy, kind), getattr(logs, kind))
        assert getattr(lazy, kind) is getattr(lazy, kind)  # built once
    copy = pickle.loads(pickle.dumps(lazy))  # pickled as tables: the files stay this process'
    assert isinstance(copy.__dict__["_prefill_samples"], pd.DataFrame)
    pd.testing.assert_frame_equal(copy.prefill_samples, logs.prefill_samples)


def test_a_task_launched_before_the_log_began_is_cut_at_start_not_cancelled(tmp_path) -> None:
    """A log that begins mid-task (rotated, or a paste) has the task's release and timings but
    not its launch. It is `cut_at_start`, counted so, and not a whole task: the statistics that
    need its launch leave it out."""
    from .conftest import REAL

    lines = (REAL / "before" / "logs" / "llama-server.log").read_text().splitlines(keepends=True)
    launch = next(i for i, line in enumerate(lines) if "launch_slot_" in line and "task 0 " in line)
    log = tmp_path / "llama-server.log"
    log.write_text("".join(lines[launch + 1:]))
    logs = read_server_logs([str(log)])
    t = logs.tasks.set_index("task_id")
    assert t.loc[0, "status"] == "cut_at_start" and pd.isna(t.loc[0, "launch_s"])
    assert (t.drop(index=0)["status"] != "cut_at_start").all()
    assert logs.accounting.tasks_cut_at_start == 1
    assert any("1 cut at the log's start" in line for line in logs.accounting.summary_lines())
