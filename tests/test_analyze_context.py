"""context: generation speed by context length, recomputed window by window with plain loops."""

from __future__ import annotations

import statistics

import numpy as np
import pandas as pd
import pytest

from slotscope.analyze import Options
from slotscope.analyze.context import LABELS, context, tasks_during
from slotscope.dataset import load

from .conftest import REAL

EDGES = [0, 2000, 5000, 10000, 15000, float("inf")]


@pytest.fixture(scope="module")
def datasets() -> dict:
    return {s: load([REAL / s / "logs"]) for s in ("before", "wallclock")}


def _by_loops(ds) -> dict[tuple[str, str], list[float]]:
    tasks = ds.server.tasks.to_dict("records")
    out: dict[tuple[str, str], list[float]] = {}
    for hb in ds.server.gen_samples.to_dict("records"):
        if not 2.5 <= hb["window_s"] <= 4.0:
            continue
        a, b = hb["window_start_s"], hb["t_s"]
        own = [t for t in tasks if t["task_id"] == hb["task_id"] and t["session"] == hb["session"]][0]
        others = [t for t in tasks if t["session"] == hb["session"] and t["task_id"] != hb["task_id"]]
        holding = [t for t in others if t["launch_s"] < b and (pd.isna(t["release_s"]) or t["release_s"] > a)]
        prefilling = [t for t in others if t["prefill_start_s"] < b and t["first_token_s"] > a]
        ctx = own["prompt_tokens"] + hb["n_gen"]
        label = next(lab for lab, lo, hi in zip(LABELS, EDGES, EDGES[1:]) if lo <= ctx < hi)
        if not holding:
            out.setdefault(("alone", label), []).append(hb["tg_3s_tps"])
        if not prefilling:
            out.setdefault(("no_prefill", label), []).append(hb["tg_3s_tps"])
    return out


@pytest.mark.parametrize("scenario", ["before", "wallclock"])
def test_matches_a_window_by_window_count(datasets: dict, scenario: str) -> None:
    table = context(datasets[scenario], Options()).set_index(["basis", "context_tokens"])
    expected = _by_loops(datasets[scenario])
    for (basis, label), row in table.iterrows():
        values = expected.get((basis, label), [])
        assert row["samples"] == len(values), (basis, label)
        if values:
            assert row["median_tg_3s_tps"] == pytest.approx(statistics.median(values), abs=0.01)
        else:
            assert pd.isna(row["median_tg_3s_tps"])


def test_alone_is_a_subset_of_no_prefill(datasets: dict) -> None:
    table = context(datasets["before"], Options()).pivot(index="context_tokens", columns="basis", values="samples")
    assert (table["alone"] <= table["no_prefill"]).all()


def test_solo_generation_speed_is_the_readme_one(datasets: dict) -> None:
    # README: ~49 tok/s solo at short context, ~43 at 15K.
    table = context(datasets["wallclock"], Options())
    alone = table[(table["basis"] == "alone") & (table["samples"] > 0)]
    assert len(alone) >= 3
    assert alone["median_tg_3s_tps"].between(38, 52).all()
    assert (table["few_samples"] == (table["samples"] < 10)).all()


def test_needs_no_app_log(datasets: dict) -> None:
    alone = context(load([REAL / "before" / "logs" / "llama-server.log"]), Options())
    pd.testing.assert_frame_equal(alone, context(datasets["before"], Options()))


def test_tasks_during_counts_overlaps_per_session() -> None:
    tasks = pd.DataFrame({
        "source": "x", "port": -1, "session": [1, 1, 1, 2],
        "launch_s": [0.0, 5.0, 10.0, 0.0], "release_s": [6.0, 8.0, np.nan, 100.0],
    })
    at = pd.DataFrame({"source": "x", "port": -1, "session": [1, 1, 1, 1, 2, 3],
                       "a": [0.0, 6.0, 8.0, 20.0, 50.0, 0.0], "b": [1.0, 7.0, 9.0, 30.0, 60.0, 1.0]})
    # [0,1]: task 0. [6,7]: task 1 (task 0 released at 6). [8,9]: none. [20,30]: task 2, never released.
    assert tasks_during(tasks, at, "a", "b").tolist() == [1, 1, 0, 1, 1, 0]


@pytest.mark.parametrize("seed", range(4))
def test_tally_by_part_equals_the_windows_kept_whole(seed: int) -> None:
    """The windows tallied a part at a time (counts, tasks, medians read off each value's
    count) give what the windows kept whole give: bincount, distinct tasks and the median of
    the values, to the bit; with repeated and missing speeds, odd and even counts, empty bins
    and parts, and windows of no bin."""
    from slotscope import timeline as tl
    from slotscope.analyze.context import BASES, _Tally

    rng = np.random.default_rng(seed)
    n, n_tasks = 5000, 300
    w = pd.DataFrame({
        "tg_3s_tps": np.round(rng.gamma(5, 8, n), 1 + seed % 3),  # (from 0.1 to 0.001 apart: many or few repeats)
        "alone": rng.random(n) < 0.3, "no_prefill": rng.random(n) < 0.7,
        "bin": rng.choice(np.array([-1, 0, 1, 2, 4], dtype=np.int8), n),  # (bin 3 empty, -1: no bin)
        "task": rng.integers(0, n_tasks, n)})
    w.loc[rng.random(n) < 0.05, "tg_3s_tps"] = np.nan
    tally = _Tally(n_tasks)
    for lo, hi in ((0, 0), (0, 1), (1, 1700), (1700, 1700), (1700, n)):  # (empty parts too)
        tally.add(w.iloc[lo:hi])
    for b in BASES:
        kept = w[w[b].to_numpy() & (w["bin"].to_numpy() >= 0)]
        c, v, task = kept["bin"].to_numpy().astype(np.int64), kept["tg_3s_tps"].to_numpy(), kept["task"].to_numpy()
        expected = pd.DataFrame({
            "samples": np.bincount(c[~np.isnan(v)], minlength=len(LABELS)),
            "tasks": tl.distinct_per_group(c, task, len(LABELS)),
            "median_tg_3s_tps": [tl.median(v[c == k]) for k in range(len(LABELS))],
        }, index=pd.Index(LABELS, name="bin"))
        pd.testing.assert_frame_equal(tally.table(b), expected)


@pytest.mark.parametrize("stored", ["as_read", "tasks_interleaved", "back_in_time"])
def test_windows_read_as_stored_equal_the_tables(monkeypatch, stored: str) -> None:
    """The heartbeats read as they were stored, a few rows at a time (each window started at
    its task's last heartbeat so far), give the table that reading them in the table's order
    gives, to the bit: with other tasks' rows stored in between, and, where a task's times go
    back in stored order (the table sorts them by time), by falling back to the table's order."""
    from slotscope import timeline as tl
    from slotscope.analyze import context as ctx
    from slotscope.tasks import FinishedRows

    ds = load([REAL / "before" / "logs"])
    part = ds.server.on_disk("gen_samples").parts[0]
    if stored != "as_read":
        rows = part.store.gather(np.arange(len(part.store)))
        key = tl.packed_task_keys(rows["port"], rows["session"], rows["task"])
        by_key = np.argsort(key, kind="stable")
        if stored == "tasks_interleaved":  # stored in a random order, each task's rows still in theirs
            task_at = key[np.random.default_rng(0).permutation(len(key))]  # (which task's row each place holds)
            order = np.empty(len(key), dtype=np.int64)
            order[np.argsort(task_at, kind="stable")] = by_key
        else:  # a task's two heartbeats stored the other way round
            k, ts = key[by_key], rows["ts_us"][by_key]
            i = np.flatnonzero((k[1:] == k[:-1]) & (ts[1:] > ts[:-1]))[0]
            order = np.arange(len(key))
            order[[by_key[i], by_key[i + 1]]] = order[[by_key[i + 1], by_key[i]]]
        store = FinishedRows()
        store.append({c: v[order] for c, v in rows.items()})
        store.close()
        part.store = store
        part.forget_index()
    monkeypatch.setattr(ctx, "HEARTBEAT_ROWS", 7)  # (parts that split tasks' heartbeats)
    by_table, real = [], ctx._tally_by_table
    monkeypatch.setattr(ctx, "_tally_by_table", lambda *a: (by_table.append(1), real(*a))[1])
    got = context(ds, Options())
    assert by_table == ([1] if stored == "back_in_time" else [])
    monkeypatch.setattr(ctx._InStoredOrder, "of", classmethod(lambda cls, ds, lazy: None))
    want = context(ds, Options())
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert want["samples"].sum() > 0
