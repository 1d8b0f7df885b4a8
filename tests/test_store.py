"""Tables on disk (slotscope.store) read back as they were: whole, by columns, and as
dataclass fields that build them only when read whole. A small table is held in memory
instead: these tests write every table to disk, except where they compare the two."""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from slotscope import store
from slotscope.dataset import Dataset, load, task_view

from .conftest import REAL


@lru_cache(maxsize=None)
def _ds(scenario: str) -> Dataset:
    return load([REAL / scenario / "logs"])


DEFAULT_SMALL_ROWS = store.SMALL_ROWS


@pytest.fixture(autouse=True)
def _on_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "SMALL_ROWS", 0)


@pytest.mark.parametrize("small_rows", [0, DEFAULT_SMALL_ROWS], ids=["on disk", "held"])
@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_real_tables_read_back_equal_whole_and_by_columns(scenario: str, small_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task table, the matched calls and the task view (categories, nullable integers,
    wall times, texts) come back equal, written in slices of 7 rows, or held in memory."""
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 7)
    monkeypatch.setattr(store, "SMALL_ROWS", small_rows)
    ds = _ds(scenario)
    for df in (ds.server.tasks, ds.matches.calls, task_view(ds)):
        st = store.StoredTable(df)
        assert len(st) == len(df)
        pd.testing.assert_frame_equal(st.read(), df.reset_index(drop=True))
        some = [c for c in df.columns[::3]]
        pd.testing.assert_frame_equal(st.read(some + ["no such column"]), df[some].reset_index(drop=True))
        assert list(st.read([]).columns) == [] and len(st.read([])) == len(df)
        pd.testing.assert_frame_equal(pd.concat(st.batches()), df.reset_index(drop=True))
        # Rows of a few stored batches, in any order, of some columns (or all)
        for rows in ([3, 1, 2], [9, 8, 20, 15], [len(df) - 1, 0], list(range(len(df)))[::-5], []):
            want = df.reset_index(drop=True).iloc[rows].reset_index(drop=True)
            pd.testing.assert_frame_equal(st.take(np.array(rows, dtype=np.int64), some), want[some])
            pd.testing.assert_frame_equal(st.take(np.array(rows, dtype=np.int64)), want)


def test_a_text_column_empty_in_the_first_slice_reads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schema comes from the whole table: a column of Python strings that the first slice
    has only gaps of is text, not null."""
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 5)
    tasks = _ds("before").server.tasks
    df = tasks[["task_id", "status"]].copy()
    df["status"] = df["status"].astype(object)
    df.loc[df.index[:5], "status"] = None
    back = store.StoredTable(df).read()
    # (a gap of a Python-object column comes back as Arrow gives it, None, whatever it was)
    assert back["status"].isna().tolist() == df["status"].isna().tolist() and back["status"].dtype == object
    pd.testing.assert_frame_equal(back.iloc[5:], df.iloc[5:])


def test_a_stored_field_is_built_only_when_read_whole() -> None:
    ds = load([REAL / "after" / "logs"])  # (with an app log: the tasks wait on disk)
    tasks = ds.server.tasks.copy()
    store.keep_on_disk(ds.server, "tasks", "tasks")  # (already there: nothing to do)
    st = store.stored(ds.server, "tasks")
    assert st is not None
    st.unload()
    part = store.columns_of(ds.server, "tasks", ["task_id", "launch_s"])
    assert st._built is None  # the columns alone were read
    pd.testing.assert_frame_equal(part, tasks[["task_id", "launch_s"]])
    pd.testing.assert_frame_equal(ds.server.tasks, tasks)  # read whole: built, and kept
    assert st._built is not None and ds.server.tasks is st._built
    store.unload(ds.server, "tasks")
    assert st._built is None


def test_a_full_temporary_directory_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A table that cannot be written (disk full) is a SlotscopeError naming the directory and
    what to do, and leaves no directory behind."""
    import errno
    import tempfile

    from slotscope.errors import SlotscopeError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.pa, "OSFile", full)
    with pytest.raises(SlotscopeError) as e:
        store.StoredTable(_ds("before").server.tasks, "tasks")
    assert "cannot write the tasks to the temporary directory (No space left on device)" in str(e.value)
    assert "TMPDIR" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_table_written_in_parts_reads_back_as_the_parts_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """of_parts and batches: parts of uneven sizes (categories, nullable integers, wall times)
    read back whole, by columns and a stored batch at a time, as pd.concat joins them."""
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 7)
    df = _ds("restart").matches.calls
    parts = [df.iloc[:3], df.iloc[3:20], df.iloc[20:21], df.iloc[21:]]
    st = store.StoredTable.of_parts(iter(parts), "calls")
    assert len(st) == len(df)
    pd.testing.assert_frame_equal(st.read(), df.reset_index(drop=True))
    pd.testing.assert_frame_equal(st.read(["start_at", "purpose"]), df[["start_at", "purpose"]].reset_index(drop=True))
    got = list(st.batches())
    rest = len(df) - 21  # (each part is written in slices of ROWS_PER_BATCH rows)
    assert [len(b) for b in got] == [3, 7, 7, 3, 1] + [7] * (rest // 7) + ([rest % 7] if rest % 7 else [])
    pd.testing.assert_frame_equal(pd.concat(got), df.reset_index(drop=True))


def test_parts_that_differ_in_dtypes_are_an_error_and_leave_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import tempfile

    df = _ds("before").server.tasks[["task_id", "slot"]]  # (read first: a load has files of its own)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parts = [df.iloc[:5], df.iloc[5:].astype({"slot": "float64"})]
    with pytest.raises(ValueError, match="dtypes differ"):
        store.StoredTable.of_parts(iter(parts), "tasks")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("paths", [["before"], ["before", "wallclock", "restart"]])
def test_the_task_table_written_as_it_is_finished_equals_the_one_built_whole(paths, monkeypatch) -> None:
    """read_server_logs writes batches of TASK_ROWS tasks, from finished rows spilled to disk;
    the tables (and samples, sessions, accounting) equal those of one batch, one server or
    three (categories joined as _concat joins them)."""
    from slotscope import server_log

    logs = [REAL / p / "logs" / "llama-server.log" for p in paths]
    whole = server_log.read_server_logs(logs)
    monkeypatch.setattr(server_log, "TASK_ROWS", 7)
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 5)
    parts = server_log.read_server_logs(logs)
    assert store.stored(parts, "tasks") is not None
    assert len(whole.tasks) > 3 * 7
    pd.testing.assert_frame_equal(parts.tasks, whole.tasks)
    pd.testing.assert_frame_equal(parts.gen_samples, whole.gen_samples)
    pd.testing.assert_frame_equal(parts.prefill_samples, whole.prefill_samples)
    pd.testing.assert_frame_equal(parts.sessions, whole.sessions)
    assert parts.accounting == whole.accounting


@pytest.mark.parametrize("paths", [["before"], ["before", "wallclock"], ["before", "wallclock/logs/llama-server.log"]])
def test_the_task_view_written_in_parts_equals_the_one_built_whole(paths, monkeypatch) -> None:
    """keep_on_disk builds the task view a stored batch of tasks at a time; equal to the view
    built whole: one app log, two, and a server whose tasks have no calls (NA and the dtypes a
    left merge gives, also in batches whose tasks all have calls)."""
    from slotscope import server_log

    monkeypatch.setattr(server_log, "TASK_ROWS", 7)
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 5)
    ds = load([REAL / p if p.endswith(".log") else REAL / p / "logs" for p in paths])
    whole = task_view(ds)
    ds.keep_on_disk()
    assert ds._view is not None and len(ds._view) == len(whole)
    if len(paths) == 2 and paths[1].endswith(".log"):
        assert whole["call_id"].isna().any() and whole["call_id"].notna().any()
    pd.testing.assert_frame_equal(ds._view.read(), whole)


def test_columns_read_each_column_when_asked_and_show_only_those_given() -> None:
    calls = _ds("before").matches.calls.reset_index(drop=True)
    st = store.StoredTable(calls)
    cols = store.Columns(st, ["call_id", "task_id", "no such column"])
    assert list(cols.columns) == ["call_id", "task_id"] and len(cols) == len(calls)
    assert "task_id" in cols and "purpose" not in cols and cols.index.equals(pd.RangeIndex(len(calls)))
    pd.testing.assert_series_equal(cols["task_id"], calls["task_id"])
    with pytest.raises(KeyError):
        cols["purpose"]  # (in the table, not among the columns given)
    assert st._built is None  # nothing read whole


def test_a_column_writer_refuses_a_column_of_another_length_and_removes_its_files(monkeypatch, tmp_path) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    w = store.ColumnWriter("calls")
    w.add("a", pd.Series([1, 2, 3]))
    with pytest.raises(ValueError, match="has 2 rows, not 3"):
        w.add("b", pd.Series([1.0, 2.0]))
    w.discard()
    assert list(tmp_path.iterdir()) == []
    w = store.ColumnWriter("calls")
    w.add("a", pd.Series([1, 2, 3]))
    w.add("b", pd.Series(["x", None, "z"], dtype="string"))
    t = w.done(["b", "a"])
    pd.testing.assert_frame_equal(t.read(), pd.DataFrame({"b": pd.Series(["x", None, "z"], dtype="string"), "a": [1, 2, 3]}))


def test_a_stored_column_taken_as_it_is_reads_back_as_written(monkeypatch) -> None:
    """A column of a table written a column at a time is taken by its file, not read: it reads
    back (whole, by rows, a batch at a time) as if written again; a table whose stored batches
    are not those (written in parts) is refused, nothing written."""
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 3)
    df = pd.DataFrame({"id": pd.Series(["a", None, "c", "d", "e", "f", "g"], dtype="string"),
                       "at": pd.to_datetime(np.arange(7) * 10**6, unit="us", utc=True),
                       "n": pd.array([1, None, 3, 4, 5, 6, 7], dtype="Int64"),
                       "kind": pd.Series(list("xyxyxyx"), dtype="category")})
    src = store.StoredTable(df, "calls")
    w = store.ColumnWriter("matched")
    w.add("x", pd.Series(np.arange(7.0)))
    assert all(w.add_stored(src, c) for c in ("kind", "id", "at", "n"))
    with pytest.raises(ValueError, match="written twice"):
        w.add_stored(src, "id")
    got = w.done()
    want = df[["kind", "id", "at", "n"]].assign(x=np.arange(7.0))[["x", "kind", "id", "at", "n"]]
    pd.testing.assert_frame_equal(got.read(), want)
    pd.testing.assert_frame_equal(pd.concat(list(got.batches())), want)
    pd.testing.assert_frame_equal(got.take(np.array([5, 1, 6])), want.take([5, 1, 6]).reset_index(drop=True))
    src.discard()  # (the taken files stay)
    pd.testing.assert_frame_equal(got.read(["id"]), want[["id"]])
    parts = store.StoredTable.of_parts([df.iloc[:2], df.iloc[2:]], "parts")
    w = store.ColumnWriter("matched")
    assert not w.add_stored(parts, "id")
    assert not w.files
    got.discard()
    parts.discard()
    w.discard()


def test_a_spool_gives_back_what_a_pass_answered_in_order_and_removes_its_file() -> None:
    """A question's per-part answers (frames, numpy arrays, None for a failed part) wait on
    disk and come back as they were, in the order added."""
    tasks = load([str(REAL / "before" / "logs")]).server.tasks
    answers = [tasks.iloc[:5], tasks["task_id"].to_numpy()[:3], None, tasks.iloc[5:9]]
    spool = store.Spool("answers")
    for a in answers:
        spool.append(a)
    path = spool._file.name
    got = spool.read()
    pd.testing.assert_frame_equal(got[0], answers[0])
    np.testing.assert_array_equal(got[1], answers[1])
    assert got[2] is None
    pd.testing.assert_frame_equal(got[3], answers[3])
    spool.discard()
    assert not os.path.exists(path) and spool.read() == []


def test_buckets_read_back_each_part_sorted_by_row_whatever_went_to_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows added in any order, some spilled and some held, read back per part sorted by row
    with their dtypes; a part with no rows reads back empty."""
    tasks = load([str(REAL / "before" / "logs")]).server.tasks[["task_id", "slot", "n_gen"]]
    rng = np.random.default_rng(0)
    part = rng.integers(0, 3, len(tasks))  # (part 3 gets nothing)
    row = rng.permutation(len(tasks))
    monkeypatch.setattr(store.Buckets, "HELD_BYTES", 1)  # every add goes to disk
    b = store.Buckets(4, ["tasks"])
    for lo in range(0, len(tasks), 7):
        b.add("tasks", tasks.iloc[row[lo:lo + 7]], part[row[lo:lo + 7]], extra={"row": row[lo:lo + 7]})
    b.done()
    for k in range(4):
        got = b.part(k)["tasks"]
        want = tasks.iloc[np.flatnonzero(part == k)]
        assert got["row"].tolist() == list(np.flatnonzero(part == k))
        pd.testing.assert_frame_equal(got.drop(columns="row"), want.reset_index(drop=True))
    b.discard()


@pytest.mark.parametrize("command", ["analyze", "whatif"])
def test_temporary_files_go_without_a_warning(command: str, tmp_path: "os.PathLike[str]") -> None:
    """The tables a run keeps on disk are removed at its end, silently, even in Python's
    development mode (which shows the ResourceWarning a TemporaryDirectory gives there), and
    nothing is left in TMPDIR."""
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-X", "dev", "-W", "always::ResourceWarning", "-m", "slotscope", command,
                        str(REAL / "before" / "logs")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "ResourceWarning" not in r.stderr
    assert os.listdir(tmp_path) == []
