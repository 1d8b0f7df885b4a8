"""Streaming holds: results do not depend on block size, and memory does not grow with the input.

The input is several MB made by repeating the real captured (bare) logs back to back (each repeat
restarts the server clock, so it is a new session: task ids repeat, keys do not). Not timed:
the benchmark in bench/ measures speed and RSS; these tests pin the behaviour they rely on.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from slotscope import store

from slotscope import tasks as tasks_mod
from slotscope.accounting import FileAccount
from slotscope.server_log import StreamState, assign_sessions, parse_chunk, read_server_logs
from slotscope.sources import iter_chunks, open_binary

from .conftest import REAL

REPEATS = 16  # ~5 MB
# The bare logs (wallclock carries a `ts` wrapper, which one file cannot mix with bare lines).
SCENARIOS = ["before", "after", "b2048-unified", "restart"]


@pytest.fixture(scope="module")
def big_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logs = [(REAL / s / "logs" / "llama-server.log").read_bytes() for s in SCENARIOS]
    path = tmp_path_factory.mktemp("big") / "llama-server.log"
    path.write_bytes(b"".join(logs) * REPEATS)
    return path


def _events(path: Path, size: int) -> tuple[pd.DataFrame, FileAccount]:
    state = StreamState(source="s")
    acc = FileAccount(str(path))
    parts, line = [], 1
    for chunk in iter_chunks(open_binary(str(path)), str(path), size):
        parts.append(parse_chunk(chunk, line, state, acc))
        line = acc.lines + 1
    return pd.concat(parts, ignore_index=True), acc


def test_events_do_not_depend_on_block_size(big_log: Path) -> None:
    whole, acc_whole = _events(big_log, 1 << 30)  # one block
    assert acc_whole.lines == big_log.read_bytes().count(b"\n")
    for size in (50_000, 1 << 20, 3 << 20):
        ev, acc = _events(big_log, size)
        assert (acc.lines, acc.used, acc.ignored, acc.unrecognized) == (
            acc_whole.lines, acc_whole.used, acc_whole.ignored, acc_whole.unrecognized)
        pd.testing.assert_frame_equal(ev, whole, check_exact=True)
    assert acc_whole.unrecognized == 0
    # line numbers are exact: every launch event sits on a "processing task" line
    lines = big_log.read_bytes().split(b"\n")
    launches = whole.loc[whole["kind"] == 1, "line"].to_numpy()
    assert all(b"processing task" in lines[i - 1] for i in launches[:: max(1, len(launches) // 200)])


def test_tables_do_not_depend_on_block_size(big_log: Path) -> None:
    ref = read_server_logs([big_log], chunk_size=1 << 30)
    assert len(ref.tasks) == REPEATS * sum(
        (REAL / s / "logs" / "llama-server.log").read_text().count("processing task") for s in SCENARIOS)
    for size in (64 << 10, 1 << 20):
        got = read_server_logs([big_log], chunk_size=size)
        for name in ("tasks", "gen_samples", "prefill_samples", "sessions"):
            pd.testing.assert_frame_equal(getattr(got, name), getattr(ref, name), check_exact=True, obj=name)


@pytest.mark.parametrize("compressed", [False, True])
def test_tables_do_not_depend_on_worker_processes(big_log: Path, tmp_path: Path, compressed: bool) -> None:
    """Blocks parsed by worker processes (byte spans of a plain file; of temporary copies of a
    .gz's blocks) give the same tables and line accounts as parsing them in this process, and
    no temporary copy is left behind."""
    path = big_log
    if compressed:
        import gzip

        path = tmp_path / "llama-server.log.gz"
        path.write_bytes(gzip.compress(big_log.read_bytes(), 1))
    ref = read_server_logs([path], chunk_size=64 << 10, jobs=1)
    before = set(Path(tempfile.gettempdir()).glob("slotscope-blocks-*"))
    got = read_server_logs([path], chunk_size=64 << 10, jobs=2)
    assert set(Path(tempfile.gettempdir()).glob("slotscope-blocks-*")) == before
    for name in ("tasks", "gen_samples", "prefill_samples", "sessions"):
        pd.testing.assert_frame_equal(getattr(got, name), getattr(ref, name), check_exact=True, obj=name)
    (a,), (b,) = ref.accounting.files, got.accounting.files
    assert (a.lines, a.used, a.ignored, a.unrecognized, a.examples) == (b.lines, b.used, b.ignored, b.unrecognized, b.examples)
    assert a.lines == big_log.read_bytes().count(b"\n")


def test_worker_processes_report_bad_lines_by_file_line(tmp_path: Path) -> None:
    """An unrecognized line far into a file parsed by workers is named by its own line number."""
    real = (REAL / "before" / "logs" / "llama-server.log").read_bytes()
    lines = real.splitlines(keepends=True)
    good = next(ln for ln in lines if b"n_gen =" in ln)
    broken = good[: good.index(b"n_gen =") + 9] + b"\n"  # a heartbeat cut short
    body = real * 8
    at = body.count(b"\n") + 1
    path = tmp_path / "llama-server.log"
    path.write_bytes(body + broken + real)
    logs = read_server_logs([path], chunk_size=32 << 10, jobs=2)
    (acc,) = logs.accounting.files
    assert acc.unrecognized == 1
    assert acc.examples[0][0] == at
    assert acc.lines == (body + broken + real).count(b"\n")


def test_only_open_tasks_are_held_and_finished_ones_are_numeric(big_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    open_counts: list[int] = []
    real_merge = tasks_mod.TaskAssembler.merge

    def merge(self: tasks_mod.TaskAssembler, *args: object, **kwargs: object) -> None:
        real_merge(self, *args, **kwargs)  # type: ignore[arg-type]
        if self._open is not None:
            open_counts.append(len(self._open["task"]))
        for part in self._done._pending:
            assert all(v.dtype != object for v in part.values())

    monkeypatch.setattr(tasks_mod.TaskAssembler, "merge", merge)
    logs = read_server_logs([big_log], chunk_size=64 << 10)
    assert len(open_counts) > 50
    # A 4-slot server has at most a handful of tasks in flight; the few cancelled tasks that
    # were never released stay open until their session ends (restart scenario: 1 per repeat).
    assert max(open_counts) <= 12 + REPEATS
    assert len(logs.tasks) > 20 * max(open_counts)


def test_one_block_of_repeated_lines_equals_the_stream(big_log: Path) -> None:
    """parse_chunk + assign_sessions over the whole input at once, or block by block."""
    data = big_log.read_bytes()
    state = StreamState(source="s")
    acc = FileAccount("x")
    whole = assign_sessions(parse_chunk(data, 1, state, acc), state)
    state2 = StreamState(source="s")
    acc2 = FileAccount("x")
    parts, line = [], 1
    for chunk in iter_chunks(open_binary(str(big_log)), str(big_log), 200_000):
        ev = parse_chunk(chunk, line, state2, acc2)
        line = acc2.lines + 1
        parts.append(assign_sessions(ev, state2))
    pd.testing.assert_frame_equal(pd.concat(parts, ignore_index=True), whole, check_exact=True)
    assert whole["session"].nunique() == REPEATS * (len(SCENARIOS) + 1)  # restart holds 2 sessions
    assert np.all(np.diff(whole["line"].to_numpy()) > 0)


@pytest.mark.parametrize("tail", [b"", b"no newline at the end", b"\n\n"])
def test_spans_cover_the_file_and_end_at_newlines(tmp_path: Path, tail: bytes) -> None:
    from slotscope.sources import is_plain, iter_spans, read_span

    real = (REAL / "after" / "logs" / "llama-server.log").read_bytes()
    data = real[: 300_000] + tail
    path = tmp_path / "x.log"
    path.write_bytes(data)
    for size in (1, 100, 4096, 1 << 20):
        with open_binary(str(path)) as f:
            assert is_plain(f)
            spans = list(iter_spans(f, str(path), size))
        pieces = [read_span(s) for s in spans]
        assert b"".join(pieces) == data
        assert all(p.endswith(b"\n") for p in pieces[:-1])
        assert all(p for p in pieces)


def test_staged_blocks_come_back_as_they_went_and_leave_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a stream that cannot be cut into spans go to the workers through temporary
    files: each reads back as the block, is removed once read, and what is not read is removed
    when the reader closes it (not when the last block is given out: workers may still be
    reading); the source iterator is closed (its read-ahead thread stopped)."""
    from slotscope.sources import Span, read_span, staged

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = (REAL / "after" / "logs" / "llama-server.log").read_bytes()
    blocks = [real[i : i + 5000] for i in range(0, 40_000, 5000)]
    closed = []

    def source():
        try:
            yield from blocks
        finally:
            closed.append(True)

    out = staged(source())
    spans = [next(out) for _ in range(3)]
    assert all(isinstance(s, Span) and s.staged for s in spans)
    assert [read_span(s) for s in spans] == blocks[:3]
    assert not any(Path(s.path).exists() for s in spans)  # removed by their reader
    more = next(out)
    assert Path(more.path).exists()
    out.close()  # the reader stops early
    assert closed == [True] and not Path(more.path).exists() and not list(tmp_path.iterdir())
    every = staged(iter(blocks))
    spans = list(every)
    assert all(Path(s.path).exists() for s in spans)  # the last block given out: not removed yet
    assert [read_span(s) for s in spans] == blocks
    every.close()
    assert not list(tmp_path.iterdir())


def _full_disk_new_file(path: str) -> object:
    """``store.new_file`` as on a full disk."""
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", path)


def _full_disk_open(path: str, mode: str = "r", *args: object, **kwargs: object) -> object:
    """``open`` as on a full disk: writing fails, reading works."""
    import builtins
    import errno

    if "w" in mode:
        raise OSError(errno.ENOSPC, "No space left on device")
    return builtins.open(path, mode, *args, **kwargs)  # type: ignore[call-overload]


def test_staged_blocks_go_as_bytes_where_no_file_can_be_written(monkeypatch: pytest.MonkeyPatch) -> None:
    from slotscope import sources

    monkeypatch.setattr(sources, "open", _full_disk_open, raising=False)
    blocks = [b"a\n", b"b\n"]
    assert list(sources.staged(iter(blocks))) == blocks


def test_task_batches_join_to_the_task_table(big_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished tasks spill to disk in chunks and come back in output order, batch by batch:
    joined, the batches are the task table; no more than a chunk of finished rows is held."""
    import os

    from slotscope.server_log import read_task_batches

    whole = read_server_logs([big_log], keep_samples=False)
    held: list[int] = []
    real_append = tasks_mod.FinishedRows.append

    def append(self: tasks_mod.FinishedRows, rows: dict) -> None:
        real_append(self, rows)
        held.append(self._n_pending)
        dirs.update(self._disk.paths)

    dirs: set[str] = set()
    monkeypatch.setattr(tasks_mod.FinishedRows, "append", append)
    batches, acc = read_task_batches([big_log], rows=500, chunk_size=256 << 10)
    parts = list(batches)
    assert len(dirs) >= len(whole.tasks) // 500 - 1  # spilled as it went
    assert max(held) < 500 + 50  # one chunk and the tasks one block finished
    assert all(len(p) == 500 for p in parts[:-1])
    pd.testing.assert_frame_equal(pd.concat(parts, ignore_index=True), whole.tasks.astype({"source": object, "file": object}),
                                  check_exact=True, check_categorical=False, check_dtype=False)
    assert (acc.tasks_complete, acc.tasks_cancelled, acc.tasks_incomplete, acc.sessions) == (
        whole.accounting.tasks_complete, whole.accounting.tasks_cancelled, whole.accounting.tasks_incomplete,
        whole.accounting.sessions)
    assert not any(os.path.exists(d) for d in dirs)  # the temporary chunks are gone


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_task_batches_made_as_text_by_workers_join_to_the_table(big_log: Path, tmp_path: Path, fmt: str) -> None:
    """Workers build batches from the spilled rows and turn them into text; joined in order,
    the text is what writing the whole table gives."""
    import functools

    from slotscope import output
    from slotscope.server_log import read_task_batches

    whole = read_server_logs([big_log], keep_samples=False, jobs=1)
    output.write(whole.tasks, fmt, str(tmp_path / "whole"))
    then = functools.partial(output.text_piece, fmt=fmt)
    for jobs in (1, 2):
        pieces, acc = read_task_batches([big_log], rows=700, chunk_size=256 << 10, jobs=jobs, then=then)
        output.write_pieces(pieces, fmt, str(tmp_path / f"parts{jobs}"))  # type: ignore[arg-type]
        assert (tmp_path / f"parts{jobs}").read_bytes() == (tmp_path / "whole").read_bytes()
        assert acc.tasks_complete == whole.accounting.tasks_complete


def test_a_full_temporary_directory_is_a_message_not_a_traceback(big_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slotscope.errors import SlotscopeError
    from slotscope.server_log import read_task_batches

    monkeypatch.setattr(store, "new_file", _full_disk_new_file)  # the spill's writes fail
    with pytest.raises(SlotscopeError, match="finished tasks .*No space left on device.*TMPDIR"):
        read_task_batches([big_log], rows=500, jobs=1)
    from slotscope.server_log import read_sample_batches

    monkeypatch.setattr(tasks_mod, "SAMPLE_SPILL_ROWS", 500)
    with pytest.raises(SlotscopeError, match="heartbeat samples .*No space left on device.*TMPDIR"):
        read_sample_batches([big_log], kind="gen", jobs=1)
    from slotscope.dataset import load

    with pytest.raises(SlotscopeError, match="heartbeat samples .*No space left on device.*TMPDIR"):
        load([big_log])  # (analyze: the samples wait on disk)


@pytest.mark.parametrize("kind", ["gen", "prefill"])
@pytest.mark.parametrize("jobs", [1, 2])
def test_sample_batches_join_to_the_samples_table(big_log: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                                                  jobs: int) -> None:
    """Samples spill to disk in chunks as the log is read and come back sorted, batch by batch
    (each with the sample before it, for the first window and step): joined, the batches are
    the samples table, with the same line and task counts; the chunks are removed after."""
    import os

    from slotscope.server_log import read_sample_batches

    whole = read_server_logs([big_log])
    want = whole.gen_samples if kind == "gen" else whole.prefill_samples
    monkeypatch.setattr(tasks_mod, "SAMPLE_SPILL_ROWS", 2000)
    dirs: set[str] = set()
    real_append = tasks_mod.FinishedRows.append

    def append(self: tasks_mod.FinishedRows, rows: dict) -> None:
        real_append(self, rows)
        dirs.update(self._disk.paths)

    monkeypatch.setattr(tasks_mod.FinishedRows, "append", append)
    batches, acc = read_sample_batches([big_log], kind=kind, rows=777, chunk_size=256 << 10, jobs=jobs)
    parts = list(batches)
    assert len(parts) == -(-len(want) // 777) and len(dirs) >= len(want) // 4000  # spilled as it went
    pd.testing.assert_frame_equal(pd.concat(parts, ignore_index=True), want, check_exact=True)
    assert (acc.lines, acc.tasks_complete, acc.tasks_cancelled, acc.tasks_incomplete, acc.sessions) == (
        whole.accounting.lines, whole.accounting.tasks_complete, whole.accounting.tasks_cancelled,
        whole.accounting.tasks_incomplete, whole.accounting.sessions)
    assert not any(os.path.exists(d) for d in dirs)


def test_first_tokens_are_found_by_port_session_and_task() -> None:
    """The first-token lookup of the gen windows, against a dict: tasks of two ports and
    sessions with the same ids, a task listed twice (its first row counts), ids far apart."""
    ids = [0, 1, 7, 10**12]
    rows = [(p, s, t, float(100 * p + 10 * s + t % 97)) for p in (-1, 8081) for s in (0, 1, 3) for t in ids]
    rows.append((8081, 1, 7, -5.0))  # the same task again: the first row wins
    tasks = pd.DataFrame(rows, columns=["port", "session", "task_id", "first_token_s"])
    want = {}
    for p, s, t, v in rows:
        want.setdefault((p, s, t), v)
    ft = tasks_mod.FirstTokens.of(tasks)
    ask = list(want) + [(-1, 2, 0), (8081, 0, 2), (8080, 0, 0), (-1, 0, -1), (-1, 0, 10**12 + 1)]
    got = ft.at(*(np.array(c, dtype=np.int64) for c in zip(*ask)))
    assert list(got[: len(want)]) == list(want.values())
    assert np.isnan(got[len(want):]).all()


@pytest.mark.parametrize("size", [7, 100, 4096])
def test_block_pieces_join_to_the_blocks(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compressed input is staged for the workers from pieces (what the last read left, then
    this read up to its last newline), written one after the other instead of joined: they
    make the same blocks, also with lines longer than a read and a last line without newline;
    where no file can be written, a block goes on joined."""
    import io

    from slotscope import sources

    real = (REAL / "after" / "logs" / "llama-server.log").read_bytes()[:20_000]
    data = real + b"x" * 300 + b"\n" + real[:500] + b"tail without newline"
    whole = list(sources.iter_chunks(io.BytesIO(data), "t", size))
    pieces = list(sources.iter_chunks(io.BytesIO(data), "t", size, pieces=True))
    assert [b"".join(p) for p in pieces] == whole and b"".join(whole) == data
    monkeypatch.setattr(sources, "open", _full_disk_open, raising=False)
    assert list(sources.staged(sources.iter_chunks(io.BytesIO(data), "t", size, pieces=True))) == whole
