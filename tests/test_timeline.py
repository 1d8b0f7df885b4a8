"""The interval layer: phases, the concurrency step function, overlap queries, prefill passes."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from slotscope import timeline as tl
from slotscope.dataset import Dataset, load, task_view

from .conftest import REAL, SCENARIOS


@lru_cache(maxsize=None)
def _ds(scenario: str) -> Dataset:
    return load([REAL / scenario / "logs"])


def test_phases_tile_each_task_from_launch_to_release() -> None:
    tv = task_view(_ds("before"))
    ph = tl.phases(tv)
    assert list(ph.columns) == tl.PHASE_COLUMNS
    assert set(ph["phase"].astype(str)) == {"queue", "wait", "prefill", "generation"}
    assert (ph["end_s"] >= ph["start_s"]).all()
    inside = ph[ph["phase"] != "queue"]
    span = inside.groupby("task_id").agg(a=("start_s", "min"), z=("end_s", "max"), s=("end_s", "sum"))
    tasks = tv.set_index("task_id")
    assert np.allclose(span["a"], tasks.loc[span.index, "launch_s"])
    assert np.allclose(span["z"], tasks.loc[span.index, "release_s"])
    lengths = (inside["end_s"] - inside["start_s"]).groupby(inside["task_id"]).sum()
    assert np.allclose(lengths, tasks.loc[lengths.index, "release_s"] - tasks.loc[lengths.index, "launch_s"])


def test_no_queue_phase_without_app_log() -> None:
    ds = load([REAL / "before" / "logs" / "llama-server.log"])
    ph = tl.phases(task_view(ds))
    assert "queue" not in set(ph["phase"].astype(str))
    assert len(ph) == 3 * len(ds.tasks)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_concurrency_never_exceeds_slots_and_shares_sum_to_one(scenario: str) -> None:
    ds = _ds(scenario)
    steps = tl.concurrency(task_view(ds), ds.server.sessions)
    assert list(steps.columns) == tl.CONCURRENCY_COLUMNS
    slots = steps.merge(ds.server.sessions[tl.GROUP + ["n_slots"]], on=tl.GROUP)
    assert len(slots) == len(steps)
    assert (slots["running"] <= slots["n_slots"]).all()
    assert (steps["running"] >= 0).all() and (steps["waiting"] >= 0).all()
    assert (steps["prefilling"] + steps["generating"] <= steps["running"]).all()
    sec = steps["end_s"] - steps["start_s"]
    assert (sec > 0).all()
    shares = sec.groupby(steps["running"]).sum() / sec.sum()
    assert shares.sum() == pytest.approx(1.0)
    # Steps of a session are contiguous from the first launch to the last task end.
    for _, g in steps.groupby(tl.GROUP, observed=True):
        assert np.allclose(g["start_s"].to_numpy()[1:], g["end_s"].to_numpy()[:-1])


def test_concurrency_keeps_a_task_cut_by_restart_running_to_its_session_end() -> None:
    ds = _ds("restart")
    tv = task_view(ds)
    cut = tv[tv["cut_by_restart"]]
    assert len(cut) == 1
    steps = tl.concurrency(tv, ds.server.sessions)
    s1 = steps[steps["session"] == cut["session"].iloc[0]]
    last_s = ds.server.sessions.set_index("session").loc[cut["session"].iloc[0], "last_s"]
    assert s1["end_s"].max() == pytest.approx(last_s)


def _brute(q: pd.Series, iv: pd.DataFrame) -> tuple[float, int]:
    sub = iv[(iv["start_s"] < q["end_s"]) & (iv["end_s"] > q["start_s"])]
    cuts = sorted({q["start_s"], q["end_s"], *[x for x in np.r_[sub["start_s"], sub["end_s"]] if q["start_s"] < x < q["end_s"]]})
    cov, mc = 0.0, 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        n = int(((sub["start_s"] <= a) & (sub["end_s"] >= b)).sum())
        cov += (b - a) if n else 0.0
        mc = max(mc, n)
    return cov, mc


def test_overlaps_agree_with_brute_force_and_exclude_the_own_interval() -> None:
    rng = np.random.default_rng(7)
    n = 60
    s = rng.uniform(0, 100, n)
    iv = pd.DataFrame({"source": "x", "port": -1, "session": rng.integers(1, 3, n), "start_s": s,
                       "end_s": s + rng.exponential(6, n), "v": rng.integers(0, 1000, n)})
    own = iv.sample(25, random_state=1)
    # Queries inside, across and outside their own interval.
    q = own[tl.GROUP].assign(start_s=own["start_s"] + rng.uniform(-3, 3, 25), end_s=own["end_s"] + rng.uniform(-3, 3, 25))
    q = q[q["end_s"] > q["start_s"]]
    own = own.loc[q.index]
    got = tl.overlaps(q, iv, value="v")
    got_own = tl.overlaps(q, iv, own_start=own["start_s"].to_numpy(), own_end=own["end_s"].to_numpy())
    for i, (idx, row) in enumerate(q.iterrows()):
        same = iv[iv["session"] == row["session"]]
        cov, mc = _brute(row, same)
        assert got["covered_s"].iloc[i] == pytest.approx(cov, abs=1e-5)
        assert got["max_count"].iloc[i] == mc
        hit = same[(same["start_s"] < row["end_s"]) & (same["end_s"] > row["start_s"])]
        assert got["max_value"].iloc[i] == hit["v"].max()
        assert iv["v"].iloc[got["max_pos"].iloc[i]] == hit["v"].max()
        cov_o, mc_o = _brute(row, same.drop(index=idx))
        assert got_own["covered_s"].iloc[i] == pytest.approx(cov_o, abs=1e-5)
        assert got_own["max_count"].iloc[i] == mc_o


def test_own_rows_pick_each_querys_own_interval_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``own_rows``: own intervals given once per interval row and picked per query (as the
    stalls table passes each segment's task), a few queries at a time: the same answers as own
    intervals given per query; and point counts in small blocks as in one."""
    rng = np.random.default_rng(11)
    n = 80
    s = rng.uniform(0, 100, n)
    iv = pd.DataFrame({"source": "x", "port": -1, "session": rng.integers(1, 3, n), "start_s": s,
                       "end_s": s + rng.exponential(6, n)})
    rows = rng.integers(0, n, 200)  # queries around intervals, several per interval
    q = iv.iloc[rows][tl.GROUP].reset_index(drop=True)
    q["start_s"] = iv["start_s"].to_numpy()[rows] + rng.uniform(-4, 4, len(rows))
    q["end_s"] = q["start_s"] + rng.exponential(8, len(rows))
    qcode, icode = tl.key_codes([q, iv], tl.GROUP)
    ivs, ive = iv["start_s"].to_numpy(), iv["end_s"].to_numpy()
    args = (qcode, q["start_s"].to_numpy(), q["end_s"].to_numpy(), icode, ivs, ive)
    per_query = tl.overlap_arrays(*args, own_start=ivs[rows], own_end=ive[rows])
    whole_points = tl.count_point_arrays(qcode, args[1], args[2], icode, ivs)
    monkeypatch.setattr(tl, "QUERY_BLOCK", 7)
    by_row = tl.overlap_arrays(*args, own_start=ivs, own_end=ive, own_rows=rows)
    no_own = tl.overlap_arrays(*args)
    np.testing.assert_array_equal(by_row[0], per_query[0])
    np.testing.assert_array_equal(by_row[1], per_query[1])
    assert (no_own[1] > by_row[1]).any()  # the own interval was left out
    np.testing.assert_array_equal(tl.count_point_arrays(qcode, args[1], args[2], icode, ivs), whole_points)


def _count_points(q: pd.DataFrame, pts: pd.DataFrame) -> list[int]:
    qcode, pcode = tl.key_codes([q, pts], tl.GROUP)
    return tl.count_point_arrays(qcode, q["start_s"].to_numpy(), q["end_s"].to_numpy(), pcode, pts["t_s"].to_numpy()).tolist()


def test_count_points_counts_half_open_windows_per_session() -> None:
    pts = pd.DataFrame({"source": "x", "port": -1, "session": [1, 1, 1, 2], "t_s": [1.0, 2.0, 3.0, 2.0]})
    q = pd.DataFrame({"source": "x", "port": -1, "session": [1, 1, 2, 3], "start_s": [1.0, 0.0, 0.0, 0.0], "end_s": [3.0, 0.5, 5.0, 9.0]})
    assert _count_points(q, pts) == [2, 0, 1, 0]


def test_count_points_is_exact_across_sessions() -> None:
    # Two sessions far apart in time: an offset trick would round (start, end] bounds.
    pts = pd.DataFrame({"source": "x", "port": -1, "session": [1, 2, 2], "t_s": [0.1, 1e7 + 0.3, 1e7 + 0.30000001]})
    q = pd.DataFrame({"source": "x", "port": -1, "session": [2, 2, 1], "start_s": [1e7 + 0.3, 1e7, 0.0],
                      "end_s": [1e7 + 0.30000001, 1e7 + 0.3, 0.1]})
    assert _count_points(q, pts) == [1, 1, 1]


def test_prefill_activity_drops_pauses_and_puts_one_pass_per_progress_line() -> None:
    ds = _ds("before")
    tv = task_view(ds)
    active, steps, info = tl.prefill_steps(tv, ds.server.prefill_samples)
    pid, t = tl.pass_ends(steps)
    passes = pd.DataFrame({"pid": pid, "t_s": t}).merge(info, on="pid", how="left")
    # Task 102 (17,306 tokens) printed nothing from 19.76 s to 31.41 s while a lower slot with
    # another LoRA setting held the batch: that stretch is not active prefill.
    a = active[active["task_id"] == 102].sort_values("start_s")
    assert len(a) == 2
    assert a["end_s"].iloc[0] == pytest.approx(19.761788)
    assert 25 < a["start_s"].iloc[1] < 31.4
    p = passes[passes["task_id"] == 102]
    lines = ds.server.prefill_samples
    logged = lines[lines["task_id"] == 102]["t_s"]
    assert set(np.round(logged, 6)) <= set(np.round(p["t_s"], 6))
    # Plus the unlogged first pass (4,096 tokens at the first line = 2 passes) and the last
    # pass (the 1,046 tokens after the last line), which ends at the first token.
    assert len(p) == len(logged) + 2
    assert p["t_s"].max() == pytest.approx(tv.set_index("task_id").loc[102, "first_token_s"])
    # Every pass end lies inside its prefill.
    j = passes.merge(tv[tl.GROUP + ["task_id", "prefill_start_s", "first_token_s"]], on=tl.GROUP + ["task_id"])
    assert ((j["t_s"] > j["prefill_start_s"]) & (j["t_s"] <= j["first_token_s"] + tl.SAME_PASS_S)).all()


def test_by_code_looks_values_up_by_key() -> None:
    """Keys of one frame found in another through key_codes: found rows give their value, keys
    the source lacks (NA keys included) give the missing value, whatever the codes' range."""
    src = pd.DataFrame({"source": ["a", "b", "c"], "port": [1, 1, 2], "session": [1, 2, 1]})
    dst = pd.DataFrame({"source": ["c", "z", "a", None, "b"], "port": [2, 9, 1, 1, 1], "session": [1, 1, 1, 1, 3]})
    scode, dcode = tl.key_codes([src, dst], tl.GROUP)
    got = tl.by_code(scode, np.array([10.0, 20.0, 30.0]), dcode, np.nan)
    np.testing.assert_array_equal(got, [30.0, np.nan, 10.0, np.nan, np.nan])
    rows = tl.by_code(scode, np.arange(3), dcode, -1)
    assert rows.tolist() == [2, -1, 0, -1, -1]


@pytest.mark.parametrize("keys", ["packed", "task ids past 2**32", "two sources"])
def test_task_joins_on_packed_keys_give_what_merges_give(keys: str) -> None:
    """``join_tasks`` is an inner merge on the task keys in left order, on real tasks with some
    listed twice: on packed keys where they fit, on key codes where they do not (task ids past
    2**32, two servers)."""
    tasks = _ds("restart").server.tasks[tl.GROUP + ["task_id", "prompt_tokens"]].reset_index(drop=True)
    if keys == "task ids past 2**32":
        tasks["task_id"] = tasks["task_id"] + 2**32
    if keys == "two sources":
        tasks["source"] = pd.Categorical(np.where(np.arange(len(tasks)) % 3 == 0, "a.log", "b.log"))
    twice = pd.concat([tasks, tasks.iloc[::7]], ignore_index=True)  # every 7th task listed twice, at the end
    k = tl.GROUP + ["task_id"]
    left = twice.sample(frac=1.0, random_state=5).reset_index(drop=True).iloc[::2].reset_index(drop=True)
    l_rows, r_rows = tl.join_tasks(left, tasks)
    want = left.reset_index().merge(tasks.reset_index(), on=k, how="inner", suffixes=("_l", "_r"))
    assert (l_rows == want["index_l"].to_numpy()).all() and (r_rows == want["index_r"].to_numpy()).all()
    assert len(l_rows) == len(left)


def test_median_and_quantile_on_arrays_equal_a_groupbys() -> None:
    """``median`` and ``quantile`` (the statistics computed on arrays to spare memory) equal
    pandas' groupby median and quantile to the bit, on 1,500 random groups with gaps, ties,
    single values and values of every size."""
    rng = np.random.default_rng(3)
    for _ in range(500):
        n = int(rng.integers(1, 300))
        v = rng.lognormal(2, 1.5, n) * (10.0 ** rng.integers(-3, 3))
        v[rng.random(n) < 0.1] = np.nan
        if rng.random() < 0.3:
            v = np.round(v, 1)  # ties
        g = rng.integers(0, 3, n)
        by = pd.Series(v).groupby(g)
        med, q10, q95 = by.median(), by.quantile(0.1), by.quantile(0.95)
        for k in med.index:
            x = v[g == k]
            for got, want in ((tl.median(x), med[k]), (tl.quantile(x, 0.1), q10[k]), (tl.quantile(x, 0.95), q95[k])):
                assert got == want or (np.isnan(got) and np.isnan(want))


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 100, 1000, 5000])
def test_block_range_max_and_argmax_agree_with_brute_force(n: int) -> None:
    # The O(n) range structure answers what a scan of each range gives: the maximum, and the
    # leftmost position of the maximum (ties are common: small counts, few distinct values).
    rng = np.random.default_rng(n)
    for values in (rng.integers(0, 4, n), rng.integers(0, 300, n), np.repeat(rng.integers(0, 9, n // 7 + 1), 7)[:n]):
        lo = np.concatenate([rng.integers(-2, n + 2, 3000), np.arange(n), np.zeros(n, dtype=np.int64)])
        hi = np.concatenate([lo[:3000] + rng.integers(-3, n + 1, 3000), np.arange(n), np.arange(n)])
        lo, hi = np.clip(lo, 0, n - 1), np.minimum(hi, n - 1)
        want_max = np.array([values[a:b + 1].max() if b >= a else 0 for a, b in zip(lo, hi)])
        want_pos = np.array([a + int(np.argmax(values[a:b + 1])) if b >= a else -1 for a, b in zip(lo, hi)])
        np.testing.assert_array_equal(tl._BlockRange(tl.narrow(values), np.maximum).query(lo, hi, 0), want_max)
        fv = values.astype(float)
        np.testing.assert_array_equal(tl._range_argmax(fv).query(lo, hi, -1), want_pos)


def test_median_and_quantile_from_one_sort_equal_median_and_quantile() -> None:
    import numpy as np

    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 3, 10, 11, 1000, 1001):
        for gaps in (False, True):
            v = rng.lognormal(2, 1, n).round(rng.integers(0, 4))  # (ties too)
            if gaps and n:
                v[rng.integers(0, n, max(1, n // 5))] = np.nan
            for q in (0.1, 0.5, 0.9):
                got = tl.median_and_quantile(v.copy(), q)
                want = (tl.median(v), tl.quantile(v, q))
                assert np.array_equal(got, want, equal_nan=True), (n, gaps, q, got, want)
