"""The waits table: waits before prefill by what held the batch, and deferred launches."""

from __future__ import annotations

from functools import lru_cache

import pandas as pd

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
