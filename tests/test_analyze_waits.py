"""The waits table: waits before prefill by what held the batch, and deferred launches."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from slotscope import timeline as tl
from slotscope.analyze import TABLES, Options
from slotscope.analyze.waits import CAUSES, WAIT_COLUMNS, classify_waits, deferred_launches, waits, worst_waits
from slotscope.dataset import Dataset, load, task_view

from .conftest import REAL


@lru_cache(maxsize=None)
def _ds(path: str) -> Dataset:
    return load([REAL / path])


def _count(df: pd.DataFrame, cause: str) -> int:
    return int(df.loc[df["cause"] == cause, "count"].iloc[0])


def test_stable_columns_and_causes() -> None:
    df = TABLES["waits"](_ds("before/logs"), Options())
    assert list(df.columns) == WAIT_COLUMNS
    assert df["cause"].tolist() == CAUSES


def test_before_mixed_lora_waits_behind_the_other_setting() -> None:
    df = waits(_ds("before/logs"), Options())
    assert _count(df, "different_lora") >= 1
    # README lab check: 31 waits over 1 s, 29 of them with a different-LoRA task active.
    w = df[df["cause"] != "deferred"]
    assert w["count"].sum() == 31
    assert _count(df, "different_lora") == 29
    assert w["share"].sum() == 1.0


def test_after_one_lora_setting_has_no_lora_waits() -> None:
    df = waits(_ds("after/logs"), Options())
    assert _count(df, "different_lora") == 0
    assert _count(df, "same_lora") == 6


def test_wait_threshold_option() -> None:
    few = classify_waits(_ds("before/logs"), Options(wait_threshold_s=20.0))
    assert len(few) == 15 and (few["wait_s"] >= 20).all()


def test_deferred_launches_on_a_full_two_slot_server() -> None:
    ds = _ds("wallclock/logs")
    d = deferred_launches(ds)
    assert len(d) >= 1
    tv = task_view(ds)
    rel = tv.set_index("task_id")["release_s"]
    gap = d["launch_s"].to_numpy() - rel.loc[d["released_task_id"]].to_numpy()
    assert ((gap >= 0) & (gap <= 0.005)).all()
    # The app saw those requests wait before launch.
    assert (d["queue_ms"] > 0).all()
    row = waits(ds, Options()).set_index("cause").loc["deferred"]
    assert row["count"] == len(d)
    assert row["total_s"] == round(d["queue_ms"].sum() / 1000, 3)


def test_worst_waits_name_the_task_holding_the_batch() -> None:
    w = worst_waits(_ds("before/logs"), Options())
    assert len(w) == Options().worst
    assert w["wait_s"].is_monotonic_decreasing
    top = w.iloc[0]
    assert top["cause"] == "different_lora"
    assert top["holder_lora"] != top["lora"]
    assert pd.notna(top["holder_line"]) and top["holder_line"] != top["line"]


def test_works_without_app_log() -> None:
    ds = _ds("before/logs/llama-server.log")
    df = waits(ds, Options())
    assert df["cause"].tolist() == CAUSES + ["unknown_lora"]
    assert _count(df, "unknown_lora") == 31
    assert pd.isna(df.set_index("cause").loc["deferred", "total_s"])
    w = worst_waits(ds, Options())
    assert w["holder_task_id"].notna().all()


def _deferred_by_merge(ds: Dataset, tv: pd.DataFrame) -> pd.DataFrame:
    """deferred_launches as a backward as-of merge by session (how it was first written)."""
    keys = tl.GROUP + ["task_id"]
    launch = tv[keys + ["launch_s"]].dropna(subset=["launch_s"]).assign(_row=lambda d: d.index).sort_values("launch_s")
    rel = tv[keys + ["release_s"]].dropna(subset=["release_s"]).rename(columns={"task_id": "released_task_id"}).sort_values("release_s")
    j = pd.merge_asof(launch, rel, left_on="launch_s", right_on="release_s", by=tl.GROUP,
                      direction="backward", tolerance=0.005, allow_exact_matches=True)
    j = j[j["release_s"].notna() & (j["released_task_id"] != j["task_id"])]
    iv = tv[tl.GROUP].assign(start_s=tv["launch_s"].astype(float), end_s=tl.task_ends(tv, ds.server.sessions))
    q = j[tl.GROUP].assign(start_s=j["release_s"] - 1e-6, end_s=j["release_s"])
    running = tl.overlaps(q, iv)["max_count"].to_numpy()
    slots = ds.server.sessions.drop_duplicates(tl.GROUP).set_index(tl.GROUP)["n_slots"].astype(float)
    n_slots = np.array([slots.get(tuple(k), np.nan) for k in j[tl.GROUP].itertuples(index=False)])
    j = j[n_slots <= running]
    out = tv.loc[j["_row"].to_numpy()].copy()
    out["released_task_id"] = j["released_task_id"].to_numpy()
    out["release_s_before"] = j["release_s"].to_numpy()
    return out.reset_index(drop=True)


@pytest.mark.parametrize("scenario", ["before/logs", "restart/logs", "wallclock/logs"])
def test_deferred_launches_agree_with_an_asof_merge(scenario: str) -> None:
    ds = _ds(scenario)
    tv = task_view(ds)
    pd.testing.assert_frame_equal(deferred_launches(ds, tv), _deferred_by_merge(ds, tv))
    # Crowded: launches moved onto releases of other tasks (ties, exact matches, within and
    # beyond the tolerance), in two sessions.
    rng = np.random.default_rng(7)
    busy = tv.copy()
    rel = busy["release_s"].dropna().to_numpy()
    pick = rng.random(len(busy)) < 0.5
    shift = rng.choice([0.0, 0.001, 0.005, 0.0051, -0.001], len(busy))
    moved = rng.choice(rel, len(busy)) + shift
    busy["launch_s"] = np.where(pick, moved, busy["launch_s"].to_numpy())
    got = deferred_launches(ds, busy)
    pd.testing.assert_frame_equal(got, _deferred_by_merge(ds, busy))
    assert len(got) > len(deferred_launches(ds, tv))


@pytest.mark.parametrize("sessions", ["all", "one_missing"])
def test_task_ends_read_a_column_at_a_time_equal_timeline_task_ends(sessions: str) -> None:
    """The waits table's task ends (the view's times read one at a time, sessions by code) are
    timeline.task_ends': a task cut by a restart ends at its session's last line, or where the
    sessions table lacks its session, at the latest time of its session's tasks."""
    from slotscope.analyze.waits import _Sessions

    ds = load([REAL / "restart" / "logs"])
    if sessions == "one_missing":
        ds.server.sessions = ds.server.sessions.iloc[1:].reset_index(drop=True)
    tv = task_view(ds)
    release = tv["release_s"].to_numpy(dtype=float, na_value=np.nan)
    assert np.isnan(release).any() and tv[tl.GROUP].drop_duplicates().shape[0] == 2
    got = _Sessions(ds, tv[tl.GROUP]).ends(ds, release)
    np.testing.assert_array_equal(got, tl.task_ends(tv, ds.server.sessions))
