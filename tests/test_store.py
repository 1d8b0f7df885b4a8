"""Tables on disk (slotscope.store) read back as they were: whole, by columns, and as
dataclass fields that build them only when read whole."""

from __future__ import annotations

from functools import lru_cache

import pandas as pd
import pytest

from slotscope import store
from slotscope.dataset import Dataset, load, task_view

from .conftest import REAL


@lru_cache(maxsize=None)
def _ds(scenario: str) -> Dataset:
    return load([REAL / scenario / "logs"])


@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_real_tables_read_back_equal_whole_and_by_columns(scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task table, the matched calls and the task view (categories, nullable integers,
    wall times, texts) come back equal, written in slices of 7 rows."""
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 7)
    ds = _ds(scenario)
    for df in (ds.server.tasks, ds.matches.calls, task_view(ds)):
        st = store.StoredTable(df)
        assert len(st) == len(df)
        pd.testing.assert_frame_equal(st.read(), df.reset_index(drop=True))
        some = [c for c in df.columns[::3]]
        pd.testing.assert_frame_equal(st.read(some + ["no such column"]), df[some].reset_index(drop=True))
        assert list(st.read([]).columns) == [] and len(st.read([])) == len(df)


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
