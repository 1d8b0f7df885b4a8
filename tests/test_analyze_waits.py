"""The waits tables: waits before prefill by what held the batch, and deferred launches."""

from __future__ import annotations

from functools import lru_cache

import pandas as pd
import pytest

from slotscope import analyze
from slotscope.analyze import TABLES, Options
from slotscope.analyze.waits import CAUSES, WAIT_COLUMNS, WAITS, classify_waits, deferred_launches, worst_waits
from slotscope.dataset import Dataset, load, task_view
from slotscope.periods import partition

from .conftest import REAL


@lru_cache(maxsize=None)
def _ds(path: str) -> Dataset:
    return load([REAL / path])


def _waits(ds: Dataset, opts: Options | None = None) -> pd.DataFrame:
    return TABLES["waits"](ds, opts or Options()).set_index("cause")


def test_stable_columns_and_causes() -> None:
    df = TABLES["waits"](_ds("before/logs"), Options())
    assert list(df.columns) == WAIT_COLUMNS
    assert df["cause"].tolist() == CAUSES


def test_calls_with_another_lora_setting_wait_before_their_prefill() -> None:
    df = _waits(_ds("before/logs"))
    # README lab check: 31 waits over 1 s, 29 of them with a different-LoRA task active.
    lora = df.loc["different_lora"]
    assert lora["count"] == 29 and not lora["few_samples"]
    assert lora["max_s"] >= lora["median_s"] >= 1.0 and lora["total_s"] >= 29 * 1.0
    assert df.loc["same_lora", "count"] == 2 and df.loc["nothing", "count"] == 0
    assert df.loc[["different_lora", "same_lora", "nothing"], "share"].sum() == 1.0
    # Each of them overlapped a task with another label; the waiting call had one.
    w = classify_waits(_ds("before/logs"), Options())
    lora_waits = w[w["cause"] == "different_lora"]
    assert len(lora_waits) == 29 and (lora_waits["different_lora_s"] > 0).all() and lora_waits["lora"].notna().all()
    assert (w["wait_s"] >= 1.0).all()


def test_one_lora_setting_has_no_waits_behind_another() -> None:
    df = _waits(_ds("after/logs"))
    assert df.loc["different_lora", "count"] == 0
    assert df.loc["different_lora", "total_s"] == 0.0 and pd.isna(df.loc["different_lora", "max_s"])
    assert df.loc["same_lora", "count"] == 6


def test_wait_threshold_option() -> None:
    few = classify_waits(_ds("before/logs"), Options(wait_threshold_s=20.0))
    assert len(few) == 15 and (few["wait_s"] >= 20).all()
    assert _waits(_ds("before/logs"), Options(wait_threshold_s=20.0)).loc[["different_lora", "same_lora", "nothing"], "count"].sum() == 15


def test_deferred_launches_on_a_full_two_slot_server() -> None:
    ds = _ds("wallclock/logs")
    d = deferred_launches(ds)
    assert len(d) >= 1
    rel = task_view(ds).set_index("task_id")["release_s"]
    gap = d["launch_s"].to_numpy() - rel.loc[d["released_task_id"]].to_numpy()
    assert ((gap >= 0) & (gap <= 0.005)).all()
    # The app saw those requests wait before launch.
    assert (d["queue_ms"] > 0).all()
    row = _waits(ds).loc["deferred"]
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
    assert 0 < top["holder_overlap_s"] <= top["wait_s"]


def test_works_without_app_log() -> None:
    ds = _ds("before/logs/llama-server.log")
    df = TABLES["waits"](ds, Options())
    assert df["cause"].tolist() == CAUSES + ["unknown_lora"]
    assert df.set_index("cause").loc["unknown_lora", "count"] == 31
    assert pd.isna(df.set_index("cause").loc["deferred", "total_s"])
    w = worst_waits(ds, Options())
    assert w["holder_task_id"].notna().all()


@pytest.mark.parametrize("scenario", ["before", "restart", "wallclock"])
@pytest.mark.parametrize("part_tasks", [2, 5])
def test_the_answer_does_not_depend_on_the_part_size(scenario: str, part_tasks: int) -> None:
    """Small parts cut the busy periods: waits run across the cuts, their holders start in the
    next part, and deferred launches come right after a release of the part before."""
    ds = _ds(f"{scenario}/logs")
    whole = analyze.answer([WAITS], ds, Options())
    cut = analyze.answer([WAITS], ds, Options(), part_tasks=part_tasks)
    assert partition(task_view(ds), ds.server.sessions, part_tasks).n_parts > 5
    for name in WAITS.tables:
        pd.testing.assert_frame_equal(cut[name], whole[name], check_exact=True)
