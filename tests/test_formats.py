"""Every framing of llama-server lines (wrappers, colours, older builds) reads to the same tasks.

The variants in fixtures/formats were derived from real b11434 lines by fixtures/make_variants.py;
its manifest says what a correct parser must find in each.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime

import pandas as pd
import pytest

import slotscope
import slotscope.analyze
from slotscope.server_log import read_server_logs

from .conftest import EXCERPTS, FORMATS, REAL

MANIFEST = json.loads((FORMATS / "manifest.json").read_text())["variants"]


def _paths(spec: dict) -> list[str]:
    return [str(FORMATS / f) for f in spec["files"]]


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_variant_reads_every_task(name: str) -> None:
    spec = MANIFEST[name]
    logs = read_server_logs(_paths(spec))
    acc = logs.accounting
    assert acc.lines == spec["physical_lines"]
    assert acc.unrecognized == spec["unrecognized_lines"], acc.examples()
    assert acc.used + acc.ignored + acc.unrecognized == acc.lines
    tasks = logs.tasks
    assert len(tasks) == spec["tasks_launched"]
    for want in spec["complete_tasks"]:
        sel = tasks["task_id"] == want["task_id"]
        if "port" in want:
            sel &= tasks["port"] == want["port"]
        got = tasks[sel]
        assert len(got) == 1, want
        row = got.iloc[0]
        assert row["status"] == "complete"
        assert row["prompt_tokens_new"] == want["prompt_eval_tokens"]
        assert row["n_gen"] == want["n_gen"]
        assert row["prompt_eval_ms"] == pytest.approx(want["prompt_eval_ms"], abs=0.005)
        assert row["eval_ms"] == pytest.approx(want["eval_ms"], abs=0.005)
    if spec.get("first_launch_wall_iso"):
        want_at = pd.Timestamp(datetime.fromisoformat(spec["first_launch_wall_iso"]))
        first = tasks.sort_values("launch_at").iloc[0]["launch_at"]
        assert abs((first - want_at).total_seconds()) < 0.001
    if spec.get("ports"):
        assert sorted(tasks["port"].unique().tolist()) == spec["ports"]
    # Each session's model: the `loading model` line its start-up has in this framing (if kept).
    raw = b"".join((FORMATS / f).read_bytes() for f in spec["files"] if not f.endswith((".gz", ".zst")))
    named = sorted(set(re.findall(rb"loading model '([^'\\\"]*)'", raw)))
    if named and len(logs.sessions):  # (no sessions where no line has a time)
        assert sorted(set(logs.sessions["model"].dropna())) == [n.decode() for n in named]
        assert logs.sessions["model"].notna().all()


def test_garbage_lines_are_named_with_their_line_numbers() -> None:
    spec = MANIFEST["garbage"]
    acc = read_server_logs(_paths(spec)).accounting
    lines = {line for f in acc.files for line, _text in f.examples}
    assert set(int(k) for k in spec["junk_line_kinds"]) <= lines
    assert spec["final_partial_line"] in lines


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_variant_reads_the_same_in_small_blocks_and_worker_processes(name: str) -> None:
    """Blocks folded on their own (by workers, or here) and joined in order give the tables of
    one whole read, for every framing: wall-clock-only times, multi-line timing blocks cut
    between blocks, several ports, restarts."""
    paths = _paths(MANIFEST[name])
    whole = read_server_logs(paths, chunk_size=1 << 30, jobs=1)
    for jobs in (1, 2):
        got = read_server_logs(paths, chunk_size=700, jobs=jobs)
        for table in ("tasks", "gen_samples", "prefill_samples", "sessions"):
            pd.testing.assert_frame_equal(getattr(got, table), getattr(whole, table), check_exact=True, obj=table)
        assert [(f.lines, f.used, f.ignored, f.unrecognized, f.examples) for f in got.accounting.files] == [
            (f.lines, f.used, f.ignored, f.unrecognized, f.examples) for f in whole.accounting.files]


JOURNALD = FORMATS / "journald_short.log"


def _journald_variant(tmp_path, old: str, new: str) -> list[str]:
    text = JOURNALD.read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "journald.log"
    path.write_text(text.replace(old, new), encoding="utf-8")
    return [str(path)]


def test_journald_with_the_host_and_pid_redacted_reads_the_same_tasks(tmp_path) -> None:
    """Logs pasted in public threads often blank the host and the PID
    (``Sep 11 00:04:26   ollama[]: ...``): the same tasks, at the same wall times."""
    want = read_server_logs([str(JOURNALD)])
    got = read_server_logs(_journald_variant(tmp_path, " host llama-server[22304]: ", "   llama-server[]: "))
    assert got.accounting.unrecognized == want.accounting.unrecognized
    pd.testing.assert_series_equal(got.tasks["launch_at"], want.tasks["launch_at"])
    assert got.tasks["launch_at"].notna().all()


@pytest.mark.parametrize("pid", ["XXXX", "pid", "***", "<pid>", "REDACTED"])
def test_journald_with_the_pid_replaced_by_a_placeholder_reads_the_same_tasks(tmp_path, pid: str) -> None:
    """A PID blanked with a placeholder rather than emptied (``ollama[XXXX]:``): every line was
    unrecognized. The same tasks, at the same wall times, and an Ollama excerpt so redacted
    reads as the excerpt does."""
    want = read_server_logs([str(JOURNALD)])
    got = read_server_logs(_journald_variant(tmp_path, " host llama-server[22304]: ", f" <host> llama-server[{pid}]: "))
    assert got.accounting.unrecognized == want.accounting.unrecognized == 0
    pd.testing.assert_series_equal(got.tasks["launch_at"], want.tasks["launch_at"])
    excerpt = EXCERPTS / "ollama" / "03.log"
    text = excerpt.read_text(encoding="utf-8")
    assert " quorra ollama[1543654]: " in text
    redacted = tmp_path / "ollama.log"
    redacted.write_text(text.replace(" quorra ollama[1543654]: ", f" <host> ollama[{pid}]: "), encoding="utf-8")
    a, b = read_server_logs([str(excerpt)]).accounting, read_server_logs([str(redacted)]).accounting
    assert (b.used, b.ignored, b.unrecognized, b.files[0].wrapper) == (a.used, a.ignored, a.unrecognized, a.files[0].wrapper)


@pytest.mark.parametrize("month, number", [("janv.", 1), ("févr.", 2), ("mär", 3), ("juin", 6), ("juil.", 7),
                                           ("ago", 8), ("9月", 9), ("Okt", 10), ("ноя", 11), ("Dez", 12)])
def test_journald_months_in_other_locales_give_the_wall_clock(tmp_path, month: str, number: int) -> None:
    """journalctl prints the month as the system's locale abbreviates it: the tasks are the
    same, launched on that month and day (the 28th: every month has one), at the same time."""
    want = read_server_logs([str(JOURNALD)]).tasks["launch_at"]
    got = read_server_logs(_journald_variant(tmp_path, "Nov 29 ", f"{month} 28 ")).tasks["launch_at"]
    assert len(got) == len(want) and got.notna().all()
    assert (got.dt.month == number).all() and (got.dt.day == 28).all()
    assert (got.dt.strftime("%H:%M:%S.%f") == want.dt.strftime("%H:%M:%S.%f")).all()


def test_times_from_one_second_stamps_stay_within_what_the_stamps_allow() -> None:
    """The 2024 JSON format stamps unix seconds: a prefill start derived from the timing line's
    stamp came out up to 0.2 s before the launch, a wait of -194 ms. Derived times stay after
    the launch, a wait under the resolution is 0, and each task says its resolution; every
    wait is within that resolution of the same tasks' waits in the microsecond log."""
    coarse = read_server_logs([str(FORMATS / "json2024.log")]).tasks.set_index("task_id")
    fine = read_server_logs([str(FORMATS / "plain.log")]).tasks.set_index("task_id")
    assert (coarse["time_resolution_s"] == 1.0).all() and (fine["time_resolution_s"] == 1e-6).all()
    timed = coarse["prefill_start_s"].notna()
    assert timed.sum() >= 20
    assert (coarse.loc[timed, "prefill_start_s"] >= coarse.loc[timed, "launch_s"]).all()
    assert (coarse.loc[timed, "wait_before_prefill_ms"] >= 0).all()
    both = coarse.index[timed].intersection(fine.index)
    diff = (coarse.loc[both, "wait_before_prefill_ms"] - fine.loc[both, "wait_before_prefill_ms"]).abs()
    assert (diff <= 1000 + 1e-6).all()


def test_the_waits_table_says_when_waits_are_timed_by_whole_seconds() -> None:
    """A wait under the stamps' resolution reads 0, so the waits table's basis says how many
    tasks are timed by whole-second stamps; the microsecond log's basis does not."""
    ds = slotscope.load([str(FORMATS / "json2024.log")])
    n = len(ds.server.tasks)
    coarse = slotscope.analyze.run(ds, names=["waits"], strict=True)["waits"]
    fine = slotscope.analyze.run(slotscope.load([str(FORMATS / "plain.log")]), names=["waits"], strict=True)["waits"]
    waits = coarse["cause"] != "deferred"
    assert coarse.loc[waits, "basis"].str.endswith(f"; {n} of {n} tasks timed by whole-second stamps: a wait under 1 s reads 0").all()
    assert (fine.loc[fine["cause"] != "deferred", "basis"] == "wait before prefill >= 1 s").all()


LMSTUDIO = FORMATS / "lmstudio.log"
_PLACE = ["source", "file", "line", "release_line"]  # where the rows are read, not what they say


def test_lmstudio_reads_the_plain_lines_tasks() -> None:
    """LM Studio's developer log (a ``YYYY-MM-DD HH:MM:SS [DEBUG]`` header before each line,
    the line indented by one space, heartbeats as ``n_decoded``/``tg``) reads to the plain
    lines' tasks, each at twice its plain line number (one header line before each)."""
    plain = read_server_logs([str(FORMATS / "plain.log")])
    got = read_server_logs([str(LMSTUDIO)])
    assert got.accounting.files[0].wrapper == "lmstudio"
    assert got.accounting.unrecognized == 0
    assert got.accounting.used == plain.accounting.used  # the headers: known, ignored
    assert got.accounting.ignored == plain.accounting.ignored + plain.accounting.lines
    want, tasks = plain.tasks, got.tasks
    pd.testing.assert_frame_equal(tasks[want.columns].drop(columns=_PLACE), want.drop(columns=_PLACE))
    assert (tasks["line"] == 2 * want["line"]).all() and (tasks["release_line"] == 2 * want["release_line"]).all()
    gen = got.gen_samples
    assert len(gen) == len(plain.gen_samples) > 0 and gen["tg_3s_tps"].isna().all()
    assert (gen["tg_tps"].to_numpy() == plain.gen_samples["tg_tps"].to_numpy()).all()


SERVER_START_US = json.loads((FORMATS / "manifest.json").read_text())["source"]["server_start_wall_unix_us"]


@pytest.mark.parametrize("name", ["lmstudio", "journald_short", "journald_short_iso"])
def test_whole_second_stamps_give_the_wall_clock_to_a_few_milliseconds(name: str) -> None:
    """Stamps cut to the whole second (LM Studio's headers, journald's short forms) are up to
    1 s before the moment a line was written: the offset taken from the smallest stamp - server
    time put every task up to 1 s early (-998 ms here). From the largest, each launch and
    release is at most a few ms before when the server really wrote it (server start + its
    relative time; 299 stamped lines), never after."""
    tasks = read_server_logs(_paths(MANIFEST[name])).tasks
    start = pd.Timestamp(SERVER_START_US, unit="us", tz="UTC")
    for rel, at in (("launch_s", "launch_at"), ("release_s", "release_at")):
        early = start + pd.to_timedelta(tasks[rel], unit="s") - tasks[at]
        assert tasks[at].notna().all()
        assert ((early >= pd.Timedelta(0)) & (early < pd.Timedelta(milliseconds=10))).all(), (at, early.max())


def test_lmstudio_header_times_give_the_wall_clock(tmp_path) -> None:
    """LM Studio's headers are its wall clock: read in --tz, and in agreement with the app's
    clock (no skew warning when the app log aligns the session)."""
    tasks = read_server_logs([str(LMSTUDIO)]).tasks
    # LM Studio writes local time: read in another zone, the same tasks an hour earlier in UTC.
    paris = read_server_logs([str(LMSTUDIO)], tz="Europe/Paris").tasks
    assert ((tasks["launch_at"] - paris["launch_at"]) == pd.Timedelta(hours=1)).all()
    from slotscope.dataset import load

    shutil.copy(LMSTUDIO, tmp_path / "lmstudio.log")
    calls = (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines(keepends=True)[:25]  # (the 25 tasks' calls)
    (tmp_path / "app.jsonl").write_text("".join(calls))
    aligned = load([tmp_path]).matches.aligned.iloc[0]
    assert aligned["support"] == 25 and aligned["warning"] == ""
    assert abs(aligned["app_clock_skew_s"]) < 0.05


def test_lmstudio_log_file_stamps_in_brackets_read_the_same(tmp_path) -> None:
    """LM Studio's log files put the stamp in front of the line: ``[2026-11-29 07:31:43][DEBUG] ...``."""
    lines = LMSTUDIO.read_text(encoding="utf-8").splitlines()
    joined = [f"[{head[:19]}][DEBUG] {line[1:]}" for head, line in zip(lines[::2], lines[1::2])]
    path = tmp_path / "lmstudio-file.log"
    path.write_text("\n".join(joined) + "\n", encoding="utf-8")
    want = read_server_logs([str(LMSTUDIO)])
    got = read_server_logs([str(path)])
    assert got.accounting.files[0].wrapper == "lmstudio-file" and got.accounting.unrecognized == 0
    cols = [c for c in want.tasks.columns if c not in _PLACE]
    pd.testing.assert_frame_equal(got.tasks[cols], want.tasks[cols])


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_with_a_byte_order_mark_reads_as_utf8(tmp_path, encoding: str) -> None:
    """Windows PowerShell's `>` writes UTF-16 with a byte-order mark and CRLF: the real capture
    and its app log written so read to the same tasks, calls and line counts as captured,
    in small blocks and by workers too (they were refused as "UTF-16 text")."""
    from slotscope import load

    captured = REAL / "restart" / "logs"
    for name in ("llama-server.log", "app.jsonl"):
        text = (captured / name).read_text().replace("\n", "\r\n")
        (tmp_path / name).write_bytes("\ufeff".encode(encoding) + text.encode(encoding))
    want, got = load([captured]), load([tmp_path])
    assert [(f.kind, f.lines, f.used, f.ignored, f.unrecognized) for f in got.accounting.files] == [
        (f.kind, f.lines, f.used, f.ignored, f.unrecognized) for f in want.accounting.files]
    assert len(got.server.tasks) == 40
    pd.testing.assert_frame_equal(got.server.tasks.drop(columns=["source", "file"]),
                                  want.server.tasks.drop(columns=["source", "file"]), check_exact=True)
    pd.testing.assert_frame_equal(got.app.calls.drop(columns="file"), want.app.calls.drop(columns="file"), check_exact=True)
    for jobs in (1, 2):
        small = read_server_logs([tmp_path / "llama-server.log"], chunk_size=3 << 10, jobs=jobs).tasks
        pd.testing.assert_frame_equal(small, got.server.tasks, check_exact=True)
