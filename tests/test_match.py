"""Calls joined to tasks on every real scenario, checked against the client's ground truth."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from slotscope.dataset import load

from .conftest import REAL, SCENARIOS, load_meta, load_truth


def _timing_equal(task: pd.Series, tm: dict) -> bool:
    return abs(task["prompt_eval_ms"] - round(tm["prompt_ms"], 2)) < 0.006 and abs(task["eval_ms"] - round(tm["predicted_ms"], 2)) < 0.006


def _check(ds, truth: dict[str, dict], *, min_rate: float) -> pd.DataFrame:
    m = ds.matches.calls
    ok = m[m["ok"].fillna(False).astype(bool)]
    matched = ok[ok["task_id"].notna()]
    assert len(matched) >= min_rate * len(ok)
    tasks = ds.tasks.set_index(["source", "session", "task_id"])
    for r in matched.itertuples(index=False):
        task = tasks.loc[(r.source, r.session, r.task_id)]
        correct = _timing_equal(task, truth[r.call_id]["timings"])
        if r.confidence >= 0.9:
            assert correct, (r.call_id, r.task_id)
    assert not m.dropna(subset=["task_id"]).duplicated(["source", "session", "task_id"]).any()
    return matched


@pytest.mark.parametrize("name", SCENARIOS)
def test_match_rate_and_no_wrong_confident_match(name: str) -> None:
    ds = load([REAL / name / "logs"])
    truth = {c["id"]: c for c in load_truth(name)}
    matched = _check(ds, truth, min_rate=0.99)
    # The launch, on the aligned clock, lies between the client's send and first token.
    for r in matched.itertuples(index=False):
        c = truth[r.call_id]
        send = c["t_send"]
        first = send + c["first_token_ms"] / 1000
        assert send - 0.02 <= r.launch_at.timestamp() <= first + 0.02, r.call_id
    # queue + wait before prefill + prefill reproduces the client's time to first token.
    err = [abs(r.queue_ms + r.wait_before_prefill_ms + r.prefill_ms - truth[r.call_id]["first_token_ms"]) for r in matched.itertuples(index=False)]
    good = sum(1 for e, r in zip(err, matched.itertuples(index=False)) if e <= 100 or e <= 0.05 * truth[r.call_id]["first_token_ms"])
    assert good >= 0.95 * len(matched)


@pytest.mark.parametrize("name", SCENARIOS)
def test_offset_matches_the_server_start(name: str) -> None:
    ds = load([REAL / name / "logs"])
    starts = [s["popen_wall"] for s in load_meta(name)["server_starts"]]
    aligned = ds.matches.aligned.sort_values("session")
    assert len(aligned) == len(starts)
    for off, start in zip(aligned["offset_us"], starts):
        assert abs(off / 1e6 - start) < 0.1


def _write_app(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _app_records(name: str) -> list[dict]:
    return [json.loads(line) for line in (REAL / name / "logs" / "app.jsonl").read_text().splitlines()]


def test_app_log_with_timings_matches_everything_exactly(tmp_path: Path) -> None:
    truth = {c["id"]: c for c in load_truth("before")}
    recs = [dict(r, timings=truth[r["id"]]["timings"]) for r in _app_records("before")]
    (tmp_path / "llama-server.log").write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    _write_app(tmp_path / "app.jsonl", recs)
    ds = load([tmp_path])
    m = ds.matches.calls
    assert (m["match_method"] == "timings").all()
    _check(ds, truth, min_rate=1.0)
    assert ds.matches.aligned["method"].iloc[0] == "app-timings"


@pytest.mark.parametrize("shift", [pd.Timedelta(minutes=7), pd.Timedelta(hours=-5)])
def test_shifted_app_clock_still_aligns_and_says_by_how_much(tmp_path: Path, shift: pd.Timedelta) -> None:
    """+7 minutes, and an app that wrote local time (UTC-5) with a UTC offset: both align."""
    recs = _app_records("wallclock")
    for r in recs:
        for k in ("start", "end"):
            r[k] = (pd.Timestamp(r[k]) + shift).isoformat()
    (tmp_path / "llama-server.log").write_bytes((REAL / "wallclock" / "logs" / "llama-server.log").read_bytes())
    _write_app(tmp_path / "app.jsonl", recs)
    ds = load([tmp_path])
    truth = {c["id"]: c for c in load_truth("wallclock")}
    _check(ds, truth, min_rate=0.99)
    row = ds.matches.aligned.iloc[0]
    assert abs(row["app_clock_skew_s"] - shift.total_seconds()) < 0.1
    assert "off the server's wall clock" in row["warning"]


def test_restart_sessions_align_separately_and_calls_without_server_log_are_named(tmp_path: Path) -> None:
    recs = _app_records("restart")
    # Calls an hour later, when no server log was kept.
    extra = []
    for r in recs[:3]:
        e = dict(r, id=r["id"] + "-late")
        for k in ("start", "end"):
            e[k] = (pd.Timestamp(r[k]) + pd.Timedelta(hours=1)).isoformat()
        extra.append(e)
    (tmp_path / "llama-server.log").write_bytes((REAL / "restart" / "logs" / "llama-server.log").read_bytes())
    _write_app(tmp_path / "app.jsonl", recs + extra)
    ds = load([tmp_path])
    m = ds.matches.calls.set_index("call_id")
    for e in extra:
        assert m.loc[e["id"], "match_method"] == "unmatched:no_server_log"
        assert pd.isna(m.loc[e["id"], "task_id"])
    assert sorted(ds.matches.aligned["session"]) == [1, 2]
    assert (ds.matches.aligned["support"] >= 3).all()


def test_unlogged_tasks_are_counted(tmp_path: Path) -> None:
    recs = _app_records("before")
    kept = recs[::2]
    (tmp_path / "llama-server.log").write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    _write_app(tmp_path / "app.jsonl", kept)
    ds = load([tmp_path])
    assert len(ds.matches.unlogged) == len(recs) - len(kept)
    assert (ds.matches.unlogged["busy_s"] > 0).all()
    # load matched on the columns match reads of the tasks waiting on disk, and took the
    # unlogged ones whole from there: as a match on the whole task table.
    from slotscope import store
    from slotscope.match import match

    assert store.stored(ds.server, "tasks") is not None
    whole = match(ds.app.calls, ds.server.tasks, ds.matches.aligned, ds.server.sessions)
    assert list(ds.matches.unlogged.columns) == list(whole.unlogged.columns)
    pd.testing.assert_frame_equal(ds.matches.unlogged, whole.unlogged)
    pd.testing.assert_frame_equal(ds.matches.calls, whole.calls)


@pytest.mark.parametrize("block", [2, 3, 1 << 18])
def test_best_interval_is_the_most_covered_point_range(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vote's range against a count at every point: its support is the most intervals
    covering any point (ends included), its low the first point so covered, and every point up
    to its high covered as much; on 3,000 random sets with ties, zero-length, reversed and NaN
    intervals. The same whatever the block of starts counted at a time."""
    import numpy as np

    from slotscope import align
    from slotscope.align import best_interval

    monkeypatch.setattr(align, "VOTE_BLOCK", block)
    rng = np.random.default_rng(7)
    for _ in range(3000):
        n = int(rng.integers(1, 10))
        lo = rng.integers(0, 8, n).astype(float)
        hi = lo + rng.integers(-1, 5, n)
        lo[rng.random(n) < 0.1] = np.nan
        usable = ~np.isnan(lo) & (hi >= lo)
        vote = best_interval(lo, hi)
        if not usable.any():
            assert vote is None
            continue
        points = np.arange(-1, 14, 0.5)
        cover = np.array([int(((lo <= x) & (x <= hi) & usable).sum()) for x in points])
        assert vote.support == cover.max()
        assert vote.low == points[np.argmax(cover)]
        assert vote.high >= vote.low
        inside = (points >= vote.low) & (points <= vote.high)
        assert (cover[inside] == vote.support).all()


@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_calls_a_block_at_a_time_give_the_same_matches(scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch-window pairs are made a block of calls at a time: any block size gives the
    same matched calls and unlogged tasks."""
    from slotscope import match as match_module

    whole = load([REAL / scenario / "logs"]).matches
    monkeypatch.setattr(match_module, "CALL_BLOCK", 3)
    blocked = load([REAL / scenario / "logs"]).matches
    assert len(whole.calls) > 3 * 3
    pd.testing.assert_frame_equal(whole.calls, blocked.calls)
    pd.testing.assert_frame_equal(whole.unlogged, blocked.unlogged)


@pytest.mark.parametrize("block", [1, 3, 1 << 16])
def test_same_key_pairs_are_the_inner_merge_in_its_order(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """align pairs calls and tasks of equal token counts on one key code (any range of counts),
    without a merge: the merge's pairs, in the order of a loop over the calls and, in each,
    over the tasks (pandas 3's merge order; 2.2's groups the calls by key)."""
    import numpy as np

    from slotscope import align

    monkeypatch.setattr(align, "PAIR_BLOCK", block)
    rng = np.random.default_rng(3)
    for wide in [False] * 200 + [True] * 20:
        nc, nt = int(rng.integers(0, 40)), int(rng.integers(0, 40))
        scale = 2**40 if wide else 1  # (too wide to pack into one integer)
        calls = pd.DataFrame({"p": rng.integers(0, 4, nc) * scale, "n": rng.integers(-2, 3, nc) * scale,
                              "_ci": rng.permutation(100)[:nc].astype(np.int32)})
        tasks = pd.DataFrame({"p": rng.integers(0, 4, nt) * scale, "n": rng.integers(-2, 3, nt) * scale,
                              "_ti": rng.permutation(100)[:nt].astype(np.int32)})
        loop = [(c.ci, t.ti) for c in calls.rename(columns={"_ci": "ci"}).itertuples()
                for t in tasks.rename(columns={"_ti": "ti"}).itertuples() if (c.p, c.n) == (t.p, t.n)]
        merged = calls.merge(tasks, on=["p", "n"])
        code = align.dense_codes([np.concatenate([calls[k].to_numpy(), tasks[k].to_numpy()]) for k in ("p", "n")])
        ci, ti = align.same_key_pairs(code[:nc], code[nc:], calls["_ci"].to_numpy(), tasks["_ti"].to_numpy())
        assert list(zip(ci.tolist(), ti.tolist())) == loop
        assert sorted(loop) == sorted(zip(merged["_ci"].tolist(), merged["_ti"].tolist()))


def _pairs_by_merges(tasks: pd.DataFrame, calls: pd.DataFrame, small_key: int) -> tuple:
    """align's candidate pairs as it made them with tables and merges (before its keys were
    codes and its pairs made a block at a time): ``(ti, lo, hi, exact)``, in its order."""
    import numpy as np

    from slotscope.align import SESSION_KEY

    def ints(col: pd.Series, rows: np.ndarray) -> np.ndarray:
        return col.to_numpy(dtype="float64", na_value=np.nan)[rows].astype("int64")

    def join(left: pd.DataFrame, right: pd.DataFrame, on: list[str]) -> tuple:
        rows = [(a, b) for a, lv in zip(left["_ci"], left[on].itertuples(index=False))
                for b, rv in zip(right["_ti"], right[on].itertuples(index=False)) if tuple(lv) == tuple(rv)]
        return np.array([a for a, _ in rows], dtype=np.int64), np.array([b for _, b in rows], dtype=np.int64)

    tr = np.flatnonzero((tasks["status"] == "complete").to_numpy(dtype=bool, na_value=False))
    cr = np.flatnonzero((calls["prompt_tokens"].notna() & calls["completion_tokens"].notna()).to_numpy())
    key = ["prompt_tokens", "n_gen"]
    c = pd.DataFrame({"prompt_tokens": ints(calls["prompt_tokens"], cr), "n_gen": ints(calls["completion_tokens"], cr), "_ci": cr})
    t = pd.DataFrame({**{k: tasks[k].array.take(tr) for k in SESSION_KEY}, "prompt_tokens": ints(tasks["prompt_tokens"], tr),
                      "n_gen": ints(tasks["n_gen"], tr), "_ti": tr})
    m = c.groupby(key, observed=True).size().rename("_m")
    n = t.groupby(SESSION_KEY + key, observed=True).size().rename("_n").reset_index().merge(m.reset_index(), on=key)
    big = n[n["_m"] * n["_n"] > small_key]
    parts = [join(c, t.merge(n[n["_m"] * n["_n"] <= small_key][SESSION_KEY + key], on=SESSION_KEY + key), key)]
    if len(big):
        bt = t.merge(big[SESSION_KEY + key], on=SESSION_KEY + key)
        bt = bt.iloc[np.argsort(tasks["launch_s"].to_numpy(dtype=float)[bt["_ti"].to_numpy()], kind="stable")]
        bt["_rank"] = bt.groupby(SESSION_KEY + key, observed=True).cumcount()
        bc = c.merge(big[key].drop_duplicates(), on=key)
        bc = bc.iloc[np.argsort(calls["start_us"].to_numpy(dtype=float)[bc["_ci"].to_numpy()], kind="stable")]
        bc["_rank"] = bc.groupby(key, observed=True).cumcount()
        parts += [join(bc.assign(_rank=bc["_rank"] + d), bt, key + ["_rank"]) for d in (-2, -1, 0, 1, 2)]
    ci, ti = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    prompt_ms, predicted_ms = (calls[k].to_numpy(dtype="float64", na_value=np.nan)[ci] for k in ("timings_prompt_ms", "timings_predicted_ms"))
    has = ~np.isnan(prompt_ms) & ~np.isnan(predicted_ms)
    exact = has & (np.abs(prompt_ms - tasks["prompt_eval_ms"].to_numpy(dtype=float)[ti]) < 0.006) & (
        np.abs(predicted_ms - tasks["eval_ms"].to_numpy(dtype=float)[ti]) < 0.006)
    keep = ~has | exact
    ci, ti, exact = ci[keep], ti[keep], exact[keep]
    lo = calls["start_us"].to_numpy(dtype=float)[ci] - tasks["launch_s"].to_numpy(dtype=float)[ti] * 1e6
    hi = calls["end_us"].to_numpy(dtype="float64", na_value=np.nan)[ci] - tasks["release_s"].to_numpy(dtype=float)[ti] * 1e6
    return ti, lo, hi, exact


@pytest.mark.parametrize("small_key", [0, 2, 256])
@pytest.mark.parametrize("block", [1, 3, 1 << 16])
def test_candidate_pairs_made_from_codes_a_block_at_a_time_are_those_of_merges(
        small_key: int, block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token keys and sessions as codes, groups counted and ranked with numpy, pairs written a
    block at a time: the same pairs, in the same order, as the tables and merges made them,
    with sessions of several servers, keys shared by many (ranked) and few, and timings."""
    import numpy as np

    from slotscope import align

    monkeypatch.setattr(align, "SMALL_KEY", small_key)
    monkeypatch.setattr(align, "PAIR_BLOCK", block)
    rng = np.random.default_rng(11)
    for _ in range(60):
        nt, nc, tokens = int(rng.integers(0, 50)), int(rng.integers(0, 50)), int(rng.integers(1, 6))
        tasks = pd.DataFrame({
            "source": pd.Series(rng.choice(["a.log", "b.log"], nt)), "port": rng.integers(0, 2, nt),
            "session": rng.integers(1, 3, nt), "status": pd.Series(rng.choice(["complete", "complete", "cancelled"], nt)),
            "prompt_tokens": pd.array(rng.integers(0, tokens, nt), dtype="Int64"), "n_gen": pd.array(rng.integers(0, 3, nt), dtype="Int64"),
            "launch_s": rng.integers(0, 100, nt) / 4, "release_s": rng.random(nt) * 100 + 100,
            "prompt_eval_ms": rng.integers(0, 3, nt).astype(float), "eval_ms": rng.integers(0, 3, nt).astype(float)})
        prompt = pd.array(rng.integers(0, tokens, nc), dtype="Int64")
        prompt[rng.random(nc) < 0.1] = pd.NA
        timed = rng.random(nc) < 0.3
        calls = pd.DataFrame({
            "prompt_tokens": prompt, "completion_tokens": pd.array(rng.integers(0, 3, nc), dtype="Int64"),
            "start_us": rng.integers(0, 10, nc) * 10**8, "end_us": pd.array(rng.integers(10**9, 2 * 10**9, nc), dtype="Int64"),
            "timings_prompt_ms": np.where(timed, rng.integers(0, 3, nc), np.nan),
            "timings_predicted_ms": np.where(timed, rng.integers(0, 3, nc), np.nan)})
        want = _pairs_by_merges(tasks, calls, small_key)
        got = align._pair_arrays(tasks, calls)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w)
        sessions = align.key_codes([tasks], align.SESSION_KEY)[0]
        by_session = align._pair_arrays(tasks, calls, task_of=sessions)
        np.testing.assert_array_equal(by_session[0], sessions[want[0]])


def test_a_complete_task_missing_a_count_has_no_token_key(tmp_path: Path) -> None:
    """The before capture without task 3370's eval line (no n_gen, so no prompt total either)
    and task 5851's prompt eval line (no new tokens): both still complete, released with
    timings. Neither is given a token key (its NaN counts cast to int64 were a RuntimeWarning
    and a platform's garbage, 0 on some CPUs, which a call of 0 tokens would share): every
    other task pairs with the calls as in the whole capture, and the two calls still match
    their tasks by time."""
    import warnings

    import numpy as np

    from slotscope import align

    logs = REAL / "before" / "logs"
    lines = (logs / "llama-server.log").read_bytes().splitlines(keepends=True)
    dropped = [ln for ln in lines if b"| task 3370 |        eval time =" in ln or b"| task 5851 | prompt eval time =" in ln]
    assert len(dropped) == 2
    (tmp_path / "llama-server.log").write_bytes(b"".join(ln for ln in lines if ln not in dropped))
    (tmp_path / "app.jsonl").write_bytes((logs / "app.jsonl").read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ds = load([tmp_path])
    whole = load([logs])
    tasks = ds.server.tasks
    cut = np.flatnonzero(tasks["task_id"].isin([3370, 5851]).to_numpy())
    assert tasks["status"].iloc[cut].tolist() == ["complete", "complete"]
    assert tasks["prompt_tokens"].iloc[cut].isna().all()
    got = align._pair_arrays(tasks, ds.app.calls)
    want = align._pair_arrays(whole.server.tasks, whole.app.calls)
    others = ~np.isin(want[0], cut)
    assert not others.all()  # (the whole capture pairs the two tasks by tokens)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w[others])
    calls = ds.matches.calls.set_index("call_id")
    assert calls.loc[["c-00015", "c-00026"], "task_id"].tolist() == [3370, 5851]
    assert calls.loc[["c-00015", "c-00026"], "match_method"].tolist() == ["time", "time"]


@pytest.mark.parametrize("reverse", [False, True])
def test_calls_read_from_disk_and_matched_to_disk_equal_a_match_in_memory(reverse: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """match(Columns of the stored calls, on_disk=True), as load runs it, gives the calls and
    unlogged tasks of a match in memory; calls out of time order are sorted either way."""
    from slotscope import store
    from slotscope.match import match

    monkeypatch.setattr(store, "ROWS_PER_BATCH", 6)
    ds = load([REAL / "restart" / "logs"])
    calls = ds.app.calls
    if reverse:
        calls = calls.iloc[::-1].reset_index(drop=True)
    tasks, aligned, sessions = ds.server.tasks, ds.matches.aligned, ds.server.sessions
    whole = match(calls, tasks, aligned, sessions)
    assert store.stored(whole, "calls") is None
    disk = match(store.Columns(store.StoredTable(calls)), tasks, aligned, sessions, on_disk=True)
    assert store.stored(disk, "calls") is not None
    assert whole.calls["task_id"].notna().sum() > 30
    pd.testing.assert_frame_equal(disk.calls, whole.calls)
    pd.testing.assert_frame_equal(disk.unlogged, whole.unlogged)


def test_a_call_cut_off_mid_stream_gets_its_first_token_from_the_heartbeats() -> None:
    """In `restart` one call failed mid-stream ("stream ended without final chunk"): its task
    has no timings (cancelled), yet the client saw tokens. The first heartbeat's tg is the
    speed since the first token: the call's TTFT, from it, is within 10 ms of the client's."""
    truth = {c["id"]: c for c in load_truth("restart")}
    calls = load([REAL / "restart" / "logs"]).matches.calls
    cut = calls[(calls["task_status"] == "cancelled") & calls["task_id"].notna()]
    assert len(cut) >= 1
    for r in cut.itertuples(index=False):
        want = truth[r.call_id]
        assert want["error"] == "stream ended without final chunk" and want["first_token_ms"] is not None
        assert abs(r.ttft_ms - want["first_token_ms"]) <= 10


def test_calls_with_only_a_start_say_why_and_match_by_it_with_a_server_start(tmp_path: Path) -> None:
    """An app log with start times alone (no end, no counts): nothing aligns the clocks, and the
    calls say so (no_clock, not no_server_log); with --server-start each takes the task launched
    soonest after its start, flagged ambiguous, and the truth says which are right."""
    truth = {c["id"]: c for c in load_truth("before")}
    recs = [{k: r[k] for k in ("id", "start", "purpose", "user")} for r in _app_records("before")]
    (tmp_path / "llama-server.log").write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    _write_app(tmp_path / "app.jsonl", recs)
    calls = load([tmp_path]).matches.calls
    assert (calls["match_method"] == "unmatched:no_clock").all()
    start = pd.Timestamp(load_meta("before")["server_start_wall_iso"])
    ds = load([tmp_path], server_start=start)
    calls = ds.matches.calls
    assert (calls["match_method"] == "start:ambiguous").all() and (calls["confidence"] < 0.5).all()
    tasks = ds.tasks.set_index(["source", "session", "task_id"])
    right = sum(_timing_equal(tasks.loc[(r.source, r.session, r.task_id)], truth[r.call_id]["timings"])
                for r in calls.itertuples(index=False))
    assert right >= 0.9 * len(calls)  # (41 of 45: two pairs of calls sent within a second swap)
