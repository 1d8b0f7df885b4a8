"""The tables do not depend on where the server log is cut into blocks, nor on the workers.

Every real capture (fixtures/real/*/logs), as captured and with mutations made of its own
lines (a release line twice with a block edge inside the first copy, a task id used again
after its release, lines repeated, dropped and moved), read in blocks of a few KB in one
process and in two worker processes, gives the tables of a reading in one block.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from slotscope import server_log
from slotscope.server_log import read_server_logs

from .conftest import FORMATS, REAL, SCENARIOS

SMALL = 3 << 10  # a few KB: 20-40 blocks per capture
TABLES = ("tasks", "gen_samples", "prefill_samples", "sessions")


def _lines(scenario: str) -> list[bytes]:
    return (REAL / scenario / "logs" / "llama-server.log").read_bytes().splitlines(keepends=True)


def _release_twice(lines: list[bytes]) -> tuple[list[bytes], int, bytes]:
    """The first release of a complete task after the first 2 KB, twice; where the middle of
    its first copy is (a block edge there: one way of cutting puts both copies in the next
    block, the other one copy on each side), and its task id."""
    at = 0
    for i, line in enumerate(lines):
        if at > 2048 and b"stop processing" in line:
            task = line.split(b"| task ")[1].split(b" ")[0]
            return lines[: i + 1] + [line] + lines[i + 1 :], at + len(line) // 2, task
        at += len(line)
    raise AssertionError("no release line")


def _mutated(scenario: str) -> tuple[bytes, int]:
    """The capture with a release twice (and the block edge inside it), a launch line again
    after its task's release (the id used a second time), and every 41st line repeated, every
    53rd dropped, every 67th moved after the next; and the edge."""
    lines, edge, _ = _release_twice(_lines(scenario))
    launch, release = _launch_and_release(lines, len(lines) // 2)
    lines.insert(release + 3, lines[launch])
    edited: list[bytes] = []
    for i, line in enumerate(lines):
        if i < 200:  # (the release twice and its edge stay where they are)
            edited.append(line)
        elif i % 53 == 0:
            continue
        elif i % 41 == 0:
            edited += [line, line]
        elif i % 67 == 0 and i + 1 < len(lines):
            edited.append(lines[i + 1])
            lines[i + 1] = line
        else:
            edited.append(line)
    return b"".join(edited), edge


def _launch_and_release(lines: list[bytes], after: int) -> tuple[int, int]:
    """The first launch after line ``after`` of a task released later, and its release."""
    for i in range(after, len(lines)):
        if b"processing task" in lines[i]:
            tid = lines[i].split(b"| task ")[1].split(b" ")[0]
            for k in range(i, len(lines)):
                if b"| task " + tid + b" |" in lines[k] and b"stop processing" in lines[k]:
                    return i, k
    raise AssertionError("no released task")


def _read(path: Path, chunk: int | None = None, jobs: int = 1) -> dict[str, object]:
    logs = read_server_logs([path], chunk_size=chunk, jobs=jobs)
    out: dict[str, object] = {t: getattr(logs, t) for t in TABLES}
    acc = logs.accounting
    out["accounting"] = ([(f.lines, f.used, f.ignored, f.unrecognized, f.examples, f.wrapper) for f in acc.files],
                         acc.tasks_complete, acc.tasks_cancelled, acc.tasks_incomplete, acc.tasks_cut_at_start)
    return out


def _assert_same(got: dict[str, object], want: dict[str, object], what: str) -> None:
    for name, table in want.items():
        if isinstance(table, pd.DataFrame):
            pd.testing.assert_frame_equal(got[name], table, check_exact=True, obj=f"{what}: {name}")  # type: ignore[arg-type]
        else:
            assert got[name] == table, f"{what}: {name}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tables_do_not_depend_on_block_edges_or_workers(scenario: str, tmp_path: Path) -> None:
    captured = REAL / scenario / "logs" / "llama-server.log"
    want = _read(captured)
    for jobs in (1, 2):
        _assert_same(_read(captured, SMALL, jobs), want, f"{scenario}, {SMALL}-byte blocks, {jobs} job(s)")
    data, edge = _mutated(scenario)
    path = tmp_path / "llama-server.log"
    path.write_bytes(data)
    want = _read(path)
    for chunk in (SMALL, edge):
        for jobs in (1, 2):
            _assert_same(_read(path, chunk, jobs), want, f"{scenario} mutated, {chunk}-byte blocks, {jobs} job(s)")


def test_a_release_twice_across_a_block_edge_is_one_complete_task(tmp_path: Path) -> None:
    """The issue's case: a complete task's release line twice, the block edge inside the first
    copy. Cut by spans (workers), the copies fall into two blocks; that made a second,
    "cancelled" task of the second copy."""
    lines, edge, task = _release_twice(_lines("before"))
    path = tmp_path / "llama-server.log"
    path.write_bytes(b"".join(lines))
    captured = read_server_logs([REAL / "before" / "logs" / "llama-server.log"]).tasks
    for jobs in (1, 2):
        tasks = read_server_logs([path], chunk_size=edge, jobs=jobs).tasks
        assert len(tasks) == len(captured) == sum(b"processing task" in ln for ln in lines)
        assert tasks.loc[tasks["task_id"] == int(task), "status"].tolist() == ["complete"]
        assert tasks["status"].value_counts().to_dict() == captured["status"].value_counts().to_dict()


def test_a_task_id_used_again_is_read_as_one_task_whatever_the_blocks(tmp_path: Path) -> None:
    """A launch line again after its task's release (an id used twice), stamped as the line
    before it (the clock going back would start a new session): one task, its values the
    first launch's, in one block as across an edge between them."""
    lines = _lines("after")
    launch, release = _launch_and_release(lines, 300)
    tid = int(lines[launch].split(b"| task ")[1].split(b" ")[0])
    again = lines[release + 1].split(b" ", 1)[0] + b" " + lines[launch].split(b" ", 1)[1]
    path = tmp_path / "llama-server.log"
    path.write_bytes(b"".join(lines[: release + 2] + [again] + lines[release + 2 :]))
    edge = sum(len(ln) for ln in lines[: release + 2])  # the repeated launch opens the second block
    one = read_server_logs([path]).tasks
    assert (one["task_id"] == tid).sum() == 1
    assert one.loc[one["task_id"] == tid, "line"].tolist() == [launch + 1]
    for jobs in (1, 2):
        pd.testing.assert_frame_equal(read_server_logs([path], chunk_size=edge, jobs=jobs).tasks, one, check_exact=True)


def test_the_wrapper_is_decided_by_the_first_lines_not_the_first_block(tmp_path: Path) -> None:
    """journalctl starts its output with a header line of its own (and one at each boot):
    in blocks of a few lines, the first block was mostly such lines and the stream was read
    as bare llama-server lines."""
    text = b"".join((FORMATS / "journald_short.log").read_bytes().splitlines(keepends=True)[:50])
    path = tmp_path / "journal.log"
    path.write_bytes(b"-- Journal begins at Thu 2026-09-10 22:00:01 UTC, ends at Fri 2026-09-11 00:30:12 UTC. --\n"
                     b"-- Boot 4f1c2a9e0d6b4e7f9a3c5d8e1f2b4a6c --\n" + text)
    want = _read(path)
    assert want["accounting"][0][0][-1] == "journald"  # type: ignore[index]
    assert len(want["tasks"]) >= 3  # type: ignore[arg-type]
    for jobs in (1, 2):
        _assert_same(_read(path, 200, jobs), want, f"200-byte blocks, {jobs} job(s)")


def test_a_session_takes_its_first_config_line_in_every_block(tmp_path: Path) -> None:
    """A second config line in a session (here the 2-slot capture's, stamped as the line
    before it): the first one counts, whether or not a block edge falls between them."""
    lines = _lines("before")
    config = next(ln for ln in _lines("wallclock") if b"n_slots = 2" in ln).split(b" ", 1)[1]
    at = len(lines) // 2
    lines.insert(at, lines[at - 1].split(b" ", 1)[0] + b" " + config.split(b" ", 1)[1])
    path = tmp_path / "llama-server.log"
    path.write_bytes(b"".join(lines))
    want = read_server_logs([path]).sessions
    assert want["n_slots"].tolist() == [4]
    for jobs in (1, 2):
        pd.testing.assert_frame_equal(read_server_logs([path], chunk_size=SMALL, jobs=jobs).sessions, want, check_exact=True)


def test_analyze_tables_do_not_depend_on_block_edges_or_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's tables over a mutated capture and its app log: the same in one block, in
    small blocks in one process, and with an edge inside the repeated release read by two
    workers (which split the task in two: the ruled-out samples changed; in the fuzz,
    stalls-worst raised ValueError on such a task)."""
    from slotscope import analyze, load

    data, edge = _mutated("before")
    (tmp_path / "llama-server.log").write_bytes(data)
    (tmp_path / "app.jsonl").write_bytes((REAL / "before" / "logs" / "app.jsonl").read_bytes())

    def tables(chunk: int, jobs: int) -> dict[str, pd.DataFrame]:
        monkeypatch.setattr(server_log, "CHUNK_SIZE", chunk)
        monkeypatch.setenv("SLOTSCOPE_JOBS", str(jobs))
        return analyze.run(load([tmp_path]), strict=True)

    want = tables(server_log.CHUNK_SIZE, 1)
    for chunk, jobs in ((SMALL, 1), (edge, 2)):
        got = tables(chunk, jobs)
        assert list(got) == list(want)
        for name, table in want.items():
            pd.testing.assert_frame_equal(got[name], table, check_exact=True, obj=f"{name}, {chunk}-byte blocks, {jobs} job(s)")


def _restarted_without_llama_clock(lines: list[bytes], hours: int) -> list[bytes]:
    """The `ts`-stamped capture's lines as a second process would print them an hour later
    started without ``--log-timestamps``: the outer stamp moved on, llama's own stamp gone."""
    import datetime as dt
    import re

    out = []
    for line in lines:
        stamp, rest = line.split(b" ", 1)
        at = dt.datetime.strptime(stamp.decode(), "%Y-%m-%dT%H:%M:%S.%f%z") + dt.timedelta(hours=hours)
        rest = re.sub(rb"^\d+\.\d\d\.\d{3}\.\d{3} ", b"", rest)
        out.append(at.strftime("%Y-%m-%dT%H:%M:%S.%f%z").encode() + b" " + rest)
    return out


@pytest.mark.parametrize("llama_clock_first", [True, False])
def test_a_stream_that_mixes_clocks_is_timed_the_same_in_any_blocks(tmp_path: Path, llama_clock_first: bool) -> None:
    """One `ts`-stamped stream, two processes: one with llama's own clock, one without. Each
    block chose its clock by its own lines: a block holding both kinds left the lines without
    llama's stamp untimed, one holding those alone timed them by the outer stamp, so tasks
    and sessions changed with the block size and the workers. The stream's first timed line
    decides its clock, for the whole stream."""
    captured = _lines("wallclock")
    bare = _restarted_without_llama_clock(captured, 1)
    lines = captured + bare if llama_clock_first else _restarted_without_llama_clock(captured, -1) + captured
    path = tmp_path / "llama-server.log"
    path.write_bytes(b"".join(lines))
    want = _read(path)
    tasks = want["tasks"]
    assert isinstance(tasks, pd.DataFrame)
    launches = sum(b"processing task" in ln for ln in lines)
    assert len(tasks) == launches and (tasks["status"] == "complete").all()
    timed = tasks["launch_s"].notna()
    if llama_clock_first:  # llama's clock: the lines without it stay untimed
        assert timed.sum() == launches // 2
        alone = read_server_logs([REAL / "wallclock" / "logs" / "llama-server.log"]).tasks
        pd.testing.assert_series_equal(tasks.loc[timed, "launch_s"], alone["launch_s"], check_exact=True)
    else:  # the outer stamps time every line, across the restart
        assert timed.all()
        assert len(want["sessions"]) == 2  # type: ignore[arg-type]
    for chunk in (SMALL, 50_000):
        for jobs in (1, 2):
            _assert_same(_read(path, chunk, jobs), want, f"{chunk}-byte blocks, {jobs} job(s)")
