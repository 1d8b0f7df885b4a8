"""The load table: share of time with 0, 1, 2, ... tasks running."""

from __future__ import annotations

from functools import lru_cache

import pandas as pd
import pytest

from slotscope import analyze
from slotscope.analyze import QUESTIONS, TABLES, Options
from slotscope.analyze.load import LOAD_COLUMNS
from slotscope.dataset import Dataset, load
from slotscope.timeline import task_ends

from .conftest import REAL


@lru_cache(maxsize=None)
def _ds(path: str) -> Dataset:
    return load([REAL / path])


def _load(ds: Dataset, opts: Options | None = None, part_tasks: int | None = None) -> pd.DataFrame:
    return analyze.answer([QUESTIONS["load"]], ds, opts or Options(), part_tasks=part_tasks)["load"]


def _check(df: pd.DataFrame, n_slots: int) -> None:
    assert list(df.columns) == LOAD_COLUMNS
    for _, g in df.groupby("scope"):
        assert g["share"].sum() == pytest.approx(1.0, abs=1e-5)
        assert g["seconds"].sum() == pytest.approx(g["scope_seconds"].iloc[0], abs=1e-2)
        assert g["running"].max() == g["max_running"].iloc[0]
    assert df["running"].max() <= n_slots
    assert (df["n_slots"] == n_slots).all()


def test_before_is_busy_from_first_launch_to_last_release() -> None:
    ds = _ds("before/logs")
    df = TABLES["load"](ds, Options())
    _check(df, 4)
    overall = df[df["scope"] == "overall"]
    span = ds.tasks["release_s"].max() - ds.tasks["launch_s"].min()
    assert overall["scope_seconds"].iloc[0] == pytest.approx(span, abs=1e-3)
    assert overall["max_running"].iloc[0] == 4
    # Two or more tasks ran most of the time; the server was idle a little.
    assert overall.loc[overall["running"] >= 2, "share"].sum() > 0.5
    assert 0 < overall.loc[overall["running"] == 0, "share"].sum() < 0.01
    # The app log dates the run: one day, same numbers as overall.
    day = df[df["scope"] == "2026-11-29"]
    assert day["seconds"].tolist() == overall["seconds"].tolist()


def test_the_table_does_not_depend_on_the_part_size() -> None:
    """Busy periods cut into pieces of a few tasks (each counting only its own stretch) and
    the idle time between parts added by the merge give the whole log's table."""
    for path in ("before/logs", "restart/logs", "after/logs"):
        ds = _ds(path)
        pd.testing.assert_frame_equal(_load(ds, part_tasks=5), _load(ds))
        pd.testing.assert_frame_equal(_load(ds, part_tasks=2), _load(ds))


def test_two_slot_server_with_wrapper_timestamps_only() -> None:
    df = _load(_ds("wallclock/logs/llama-server.log"))
    _check(df, 2)
    assert set(df["scope"]) == {"overall", "2026-11-29"}


def test_restart_sums_both_server_processes() -> None:
    ds = _ds("restart/logs")
    df = _load(ds)
    _check(df, 4)
    assert ds.server.sessions["session"].nunique() == 2
    # Each process's own span, to the end of the task the restart cut (it had no release).
    ends = ds.tasks.assign(end_s=task_ends(ds.tasks, ds.server.sessions)).groupby("session")
    spans = (ends["end_s"].max() - ends["launch_s"].min()).sum()
    assert spans > (ends["release_s"].max() - ends["launch_s"].min()).sum()
    assert df.loc[df["scope"] == "overall", "scope_seconds"].iloc[0] == pytest.approx(spans, abs=1e-3)


def test_works_without_app_log_and_without_wall_clock() -> None:
    df = _load(_ds("before/logs/llama-server.log"))
    _check(df, 4)
    assert set(df["scope"]) == {"overall"}


def test_days_are_calendar_days_of_the_given_zone() -> None:
    """The run placed (with --server-start) across midnight in Berlin on the night the clocks
    go back: two Berlin days, cut at Berlin's midnight, summing to the whole; in UTC the same
    run falls on one day (Berlin's midnight is 23:00 UTC)."""
    base = _ds("before/logs")
    mid_s = (base.tasks["launch_s"].min() + base.tasks["release_s"].max()) / 2
    midnight = pd.Timestamp("2026-10-26 00:00", tz="Europe/Berlin")
    ds = load([REAL / "before" / "logs"], server_start=(midnight - pd.Timedelta(seconds=mid_s)).tz_convert("UTC"))
    utc = _load(ds)
    berlin = _load(ds, Options(tz="Europe/Berlin"))
    _check(berlin, 4)
    assert set(utc["scope"]) == {"overall", "2026-10-25"}
    assert set(berlin["scope"]) == {"overall", "2026-10-25", "2026-10-26"}
    secs = berlin.groupby("scope")["seconds"].sum()
    assert secs["2026-10-25"] + secs["2026-10-26"] == pytest.approx(secs["overall"], abs=1e-3)
    # the cut is Berlin's midnight: the first day holds the run's first half
    first = ds.tasks["launch_s"].min()
    assert secs["2026-10-25"] == pytest.approx(mid_s - first, abs=1e-3)
    # a part that ends before midnight and the next after it: the same days
    pd.testing.assert_frame_equal(_load(ds, Options(tz="Europe/Berlin"), part_tasks=3), berlin)
