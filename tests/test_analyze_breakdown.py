"""The breakdown table: own generation, own prefill, contention, waits and queue."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from slotscope import analyze
from slotscope.analyze import QUESTIONS, TABLES, Options
from slotscope.analyze.breakdown import BREAKDOWN_COLUMNS, ran_alone
from slotscope.dataset import Dataset, load, task_view

from .conftest import REAL


@lru_cache(maxsize=None)
def _ds(path: str) -> Dataset:
    return load([REAL / path])


def breakdown(ds: Dataset, opts: Options, part_tasks: int | None = None) -> pd.DataFrame:
    return analyze.answer([QUESTIONS["breakdown"]], ds, opts, part_tasks=part_tasks)["breakdown"]


def _components_sum_to_total(df: pd.DataFrame) -> None:
    for _, g in df.groupby("purpose"):
        parts = g[g["component"] != "total"]
        total = g[g["component"] == "total"]
        assert len(total) == 1
        assert parts["seconds"].sum() == pytest.approx(total["seconds"].iloc[0], abs=0.01)
        assert parts["share"].sum() == pytest.approx(1.0, abs=1e-3)
        assert (parts["seconds"] >= 0).all()


def test_components_sum_to_the_total_overall_and_per_purpose() -> None:
    ds = _ds("before/logs")
    df = TABLES["breakdown"](ds, Options())
    assert list(df.columns) == BREAKDOWN_COLUMNS
    _components_sum_to_total(df)
    tv = task_view(ds)
    total = df[(df["purpose"] == "all") & (df["component"] == "total")]["seconds"].iloc[0]
    expected = (tv["release_s"] - tv["launch_s"]).sum() + tv["queue_ms"].sum() / 1000
    assert total == pytest.approx(expected, abs=0.01)
    per_purpose = df[(df["purpose"] != "all") & (df["component"] == "total")]["seconds"].sum()
    assert per_purpose == pytest.approx(total, abs=0.01)
    assert set(df["purpose"]) == {"all", *tv["purpose"].dropna().astype(str)}
    assert {"own_generation", "own_prefill", "contention", "wait", "queue", "total"} <= set(df["component"])


def test_chat_turns_lose_time_to_the_other_slots() -> None:
    """In `before` four slots share the server: part of the chat turns' prefill and generation
    time is contention (the other slots' prefills and generation), beside their own work."""
    df = breakdown(_ds("before/logs"), Options())
    chat = df[df["purpose"] == "chat"].set_index("component")
    assert chat.loc["contention", "share"] > 0.2
    assert chat.loc["own_generation", "share"] > 0.1 and chat.loc["own_prefill", "share"] > 0.01
    # a turn's contention is its prefill and generation beyond its own time at the solo speeds
    assert chat.loc["contention", "seconds"] < chat.loc["total", "seconds"] - chat.loc["wait", "seconds"]


@pytest.mark.parametrize("scenario", ["before", "after", "restart"])
def test_the_table_does_not_depend_on_the_part_size(scenario: str) -> None:
    """Solo speeds are medians over the whole log, a task across a cut ran alone only if it
    did on both sides, and the sums run in the task view's order: parts of a few tasks give
    the table of the whole log, to the bit."""
    ds = _ds(f"{scenario}/logs")
    whole = breakdown(ds, Options())
    pd.testing.assert_frame_equal(breakdown(ds, Options(), part_tasks=5), whole, check_exact=True)
    pd.testing.assert_frame_equal(breakdown(ds, Options(), part_tasks=2), whole, check_exact=True)


def test_solo_speeds_come_from_tasks_that_ran_alone() -> None:
    ds = _ds("before/logs")
    tv = task_view(ds)
    alone = ran_alone(tv)
    df = breakdown(ds, Options())
    row = df.iloc[0]
    assert row["solo_gen_n"] == alone["alone_generation"].sum() > 0
    assert row["solo_prefill_n"] == alone["alone_prefill"].sum() > 0
    # README: ~49 tok/s generation and ~570-730 tok/s prefill alone on this CPU.
    assert 40 < row["solo_gen_tps"] < 55
    assert 500 < row["solo_prefill_tps"] < 800


def test_busy_server_takes_solo_generation_from_stretches_alone() -> None:
    # In `after` no task generated alone from first token to release.
    df = breakdown(_ds("after/logs"), Options())
    row = df.iloc[0]
    assert row["solo_gen_basis"] == "median of stretches alone"
    assert 40 < row["solo_gen_tps"] < 55
    _components_sum_to_total(df)


def test_solo_speed_options_override_the_estimate() -> None:
    df = breakdown(_ds("before/logs"), Options(solo_gen_tps=52.0, solo_prefill_tps=800.0))
    assert (df["solo_gen_tps"] == 52.0).all() and (df["solo_gen_basis"] == "option").all()
    assert df["solo_gen_n"].isna().all()
    _components_sum_to_total(df)


def test_works_without_app_log() -> None:
    ds = _ds("before/logs/llama-server.log")
    df = breakdown(ds, Options())
    _components_sum_to_total(df)
    assert set(df["purpose"]) == {"all", "unknown"}
    assert "queue" not in set(df["component"])


def test_restart_cancelled_task_without_release_is_left_out() -> None:
    ds = _ds("restart/logs")
    df = breakdown(ds, Options())
    _components_sum_to_total(df)
    assert df[df["purpose"] == "all"]["tasks"].iloc[0] == ds.tasks["release_s"].notna().sum()


def _alone_by_brute_force(tv: pd.DataFrame) -> pd.DataFrame:
    """ran_alone by its definition: per task and phase, another task's prefill or generation
    (of positive length, in the same session) overlapping the phase for a positive time."""
    def f(c: str) -> np.ndarray:
        return pd.to_numeric(tv[c], errors="coerce").to_numpy(dtype=float, na_value=np.nan)

    ps, ft, rel = f("prefill_start_s"), f("first_token_s"), f("release_s")
    sess = tv[["source", "port", "session"]].astype(str).agg("|".join, axis=1).to_numpy()
    iv = [(i, a, z) for i in range(len(tv)) for a, z in ((ps[i], ft[i]), (ft[i], rel[i])) if z > a]
    out = {}
    for name, qa, qz in (("alone_prefill", ps, ft), ("alone_generation", ft, rel)):
        alone = np.zeros(len(tv), dtype=bool)
        for q in range(len(tv)):
            if not qz[q] > qa[q]:
                continue
            own = (ps[q], rel[q]) if not (np.isnan(ps[q]) or np.isnan(rel[q])) else None
            hit = False
            for i, a, z in iv:
                if sess[i] != sess[q] or not (min(z, qz[q]) > max(a, qa[q])):
                    continue
                if own is not None and i == q and a >= own[0] and z <= own[1]:
                    continue  # (the task's own phases, inside its own span)
                hit = True
                break
            alone[q] = not hit
        out[name] = alone
    return pd.DataFrame(out, index=tv.index)


@pytest.mark.parametrize("scenario", ["before", "restart", "b2048-unified"])
def test_ran_alone_agrees_with_brute_force(scenario: str) -> None:
    # One interval per task (its prefill and generation joined) must give what the two
    # phases as separate intervals give, cut tasks (no release, no prefill) included.
    tv = task_view(_ds(f"{scenario}/logs"))
    tv = tv.iloc[:400].reset_index(drop=True)
    pd.testing.assert_frame_equal(ran_alone(tv), _alone_by_brute_force(tv))


def test_ran_alone_agrees_with_brute_force_on_random_tasks() -> None:
    rng = np.random.default_rng(3)
    n = 300
    ps = np.round(rng.uniform(0, 2000, n), 1)
    ft = ps + np.round(rng.choice([0.0, 0.5, 2.0, 5.0], n), 1)
    rel = ft + np.round(rng.choice([0.0, 1.0, 4.0, 9.0], n), 1)
    ps[rng.random(n) < 0.1] = np.nan
    rel[rng.random(n) < 0.1] = np.nan
    swap = rng.random(n) < 0.05
    rel[swap] = ft[swap] - 1  # (a release before the first token: no generation phase)
    tv = pd.DataFrame({"source": "x", "port": -1, "session": rng.integers(1, 3, n), "launch_s": ps - 1,
                       "prefill_start_s": ps, "first_token_s": ft, "release_s": rel})
    got = ran_alone(tv)
    pd.testing.assert_frame_equal(got, _alone_by_brute_force(tv))
    assert got.to_numpy().any() and not got.to_numpy().all()
