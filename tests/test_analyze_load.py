"""The load table: share of time with 0, 1, 2, ... tasks running."""

from __future__ import annotations

import pandas as pd
import pytest

from slotscope.analyze import TABLES, Options
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
