"""The load table: share of time with 0, 1, 2, ... tasks running."""

from __future__ import annotations

import pandas as pd
import pytest

from slotscope.analyze import TABLES, Options
import slotscope.analyze.load as load_mod
from slotscope.analyze.load import LOAD_COLUMNS, load_table
from slotscope.dataset import load

from .conftest import REAL


def _check(df: pd.DataFrame, n_slots: int) -> None:
    assert list(df.columns) == LOAD_COLUMNS
    for _, g in df.groupby("scope"):
        assert g["share"].sum() == pytest.approx(1.0, abs=1e-5)
        assert g["seconds"].sum() == pytest.approx(g["scope_seconds"].iloc[0], abs=1e-2)
        assert g["running"].max() == g["max_running"].iloc[0]
    assert df["running"].max() <= n_slots
    assert (df["n_slots"] == n_slots).all()


def test_before_is_busy_and_covers_first_launch_to_last_release() -> None:
    ds = load([REAL / "before" / "logs"])
    df = TABLES["load"](ds, Options())
    _check(df, 4)
    overall = df[df["scope"] == "overall"]
    span = ds.tasks["release_s"].max() - ds.tasks["launch_s"].min()
    assert overall["scope_seconds"].iloc[0] == pytest.approx(span, abs=1e-3)
    assert overall["max_running"].iloc[0] == 4
    # The app log dates the run: one day, same numbers as overall.
    day = df[df["scope"] == "2026-11-29"]
    assert day["seconds"].tolist() == overall["seconds"].tolist()


def test_two_slot_server_with_wrapper_timestamps_only() -> None:
    df = load_table(load([REAL / "wallclock" / "logs" / "llama-server.log"]), Options())
    _check(df, 2)
    assert set(df["scope"]) == {"overall", "2026-11-29"}


def test_restart_sums_both_server_processes() -> None:
    ds = load([REAL / "restart" / "logs"])
    df = load_table(ds, Options())
    _check(df, 4)
    assert ds.server.sessions["session"].nunique() == 2


def test_works_without_app_log_and_without_wall_clock() -> None:
    df = load_table(load([REAL / "before" / "logs" / "llama-server.log"]), Options())
    _check(df, 4)
    assert set(df["scope"]) == {"overall"}


def test_days_are_calendar_days_of_the_given_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run placed (with --server-start) across midnight in Berlin on the night the clocks
    go back: two Berlin days, cut at Berlin's midnight, summing to the whole; in UTC the same
    run falls on one day (Berlin's midnight is 23:00 UTC)."""
    base = load([REAL / "before" / "logs"])
    mid_s = (base.tasks["launch_s"].min() + base.tasks["release_s"].max()) / 2
    midnight = pd.Timestamp("2026-10-26 00:00", tz="Europe/Berlin")
    ds = load([REAL / "before" / "logs"], server_start=(midnight - pd.Timedelta(seconds=mid_s)).tz_convert("UTC"))
    utc = load_table(ds, Options())
    berlin = load_table(ds, Options(tz="Europe/Berlin"))
    _check(berlin, 4)
    assert set(utc["scope"]) == {"overall", "2026-10-25"}
    assert set(berlin["scope"]) == {"overall", "2026-10-25", "2026-10-26"}
    secs = berlin.groupby("scope")["seconds"].sum()
    assert secs["2026-10-25"] + secs["2026-10-26"] == pytest.approx(secs["overall"], abs=1e-3)
    # the cut is Berlin's midnight: the first day holds the run's first half
    first = ds.tasks["launch_s"].min()
    assert secs["2026-10-25"] == pytest.approx(mid_s - first, abs=1e-3)
    # steps cut at midnights a few at a time (one block holds the step across it): the same table
    monkeypatch.setattr(load_mod, "STEP_BLOCK", 7)
    pd.testing.assert_frame_equal(load_table(ds, Options(tz="Europe/Berlin")), berlin)
