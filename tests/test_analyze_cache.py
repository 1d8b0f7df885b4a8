"""cache / cache-misses: consecutive chat turns of one user, recounted straight from app.jsonl."""

from __future__ import annotations

import json
from datetime import datetime

import pandas as pd
import pytest

from slotscope.analyze import Options
from slotscope.analyze.cache import cache, cache_misses
from slotscope.analyze.turns import NEEDS_APP_LOG
from slotscope import store
from slotscope.dataset import load

from .conftest import REAL


def _app(scenario: str) -> list[dict]:
    recs = [json.loads(l) for l in (REAL / scenario / "logs" / "app.jsonl").read_text().splitlines() if l.strip()]
    return sorted(recs, key=lambda r: datetime.fromisoformat(r["start"]))


def _pairs_by_loops(scenario: str, window_s: float = 300.0) -> list[tuple[str, str, bool]]:
    """(call id, previous turn's id, miss) for each consecutive chat turn, as the module docstring defines it."""
    out = []
    prev: dict[str, dict] = {}
    summary_at: dict[str, datetime] = {}
    for r in _app(scenario):
        start = datetime.fromisoformat(r["start"])
        if r["purpose"] == "summary":
            summary_at[r["user"]] = start
        ok = r["status"] == 200 and r["error"] is None
        if not (ok and (r["purpose"] == "chat" or r["purpose"].startswith("chat_"))):
            continue
        p = prev.get(r["user"])
        if p is not None:
            gap = (start - datetime.fromisoformat(p["end"])).total_seconds()
            folded = r["user"] in summary_at and summary_at[r["user"]] > datetime.fromisoformat(p["start"])
            if gap <= window_s and p["session"] == r["session"] and not folded:
                out.append((r["id"], p["id"], r["cached_tokens"] < 0.5 * (p["prompt_tokens"] + p["completion_tokens"])))
        prev[r["user"]] = r
    return out


@pytest.fixture(scope="module")
def datasets() -> dict:
    return {s: load([REAL / s / "logs"]) for s in ("before", "after", "restart", "wallclock")}


@pytest.mark.parametrize("scenario", ["before", "after", "restart", "wallclock"])
def test_counts_follow_the_definition(datasets: dict, scenario: str) -> None:
    pairs = _pairs_by_loops(scenario)
    table = cache(datasets[scenario], Options()).set_index("user")
    assert table.loc["all", "consecutive_turns"] == len(pairs)
    assert table.loc["all", "misses"] == sum(m for _, _, m in pairs)
    assert table.drop(index="all")["consecutive_turns"].sum() == len(pairs)
    misses = cache_misses(datasets[scenario], Options())
    assert list(zip(misses["call_id"], misses["prev_call_id"])) == [(c, p) for c, p, m in pairs if m]


def test_mixed_lora_misses_single_setting_does_not(datasets: dict) -> None:
    before = cache(datasets["before"], Options()).set_index("user").loc["all"]
    after = cache(datasets["after"], Options()).set_index("user").loc["all"]
    assert (before["consecutive_turns"], before["misses"]) == (26, 9)
    assert (after["consecutive_turns"], after["misses"]) == (27, 0)
    assert before["miss_share"] == pytest.approx(9 / 26, abs=0.001)


def test_miss_rows_show_what_was_lost(datasets: dict) -> None:
    misses = cache_misses(datasets["before"], Options())
    assert (misses["cached_tokens"] < 0.5 * misses["prev_left_tokens"]).all()
    assert (misses["new_tokens"] + misses["cached_tokens"] == misses["prompt_tokens"]).all()
    assert misses["start_at"].is_monotonic_increasing
    assert ((misses["slot"] != misses["prev_slot"]) == (misses["note"] != "")).all()


@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_misses_of_calls_on_disk_in_many_batches_equal_those_in_memory(scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls' columns read at the misses' rows a stored batch at a time (batches of 7
    calls) are the columns taken from the calls in memory, in the same dtypes."""
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 7)
    ds = load([REAL / scenario / "logs"])
    ds.matches.calls = ds.matches.calls.copy()  # (in memory)
    want = cache_misses(ds, Options(cache_window_s=1e9))
    ds.keep_on_disk()
    got = cache_misses(ds, Options(cache_window_s=1e9))
    assert len(got) > 1
    pd.testing.assert_frame_equal(got, want)


def test_window_is_an_option(datasets: dict) -> None:
    short = cache(datasets["before"], Options(cache_window_s=30.0)).set_index("user").loc["all"]
    assert short["consecutive_turns"] == len(_pairs_by_loops("before", 30.0))
    assert short["consecutive_turns"] < 26


def test_without_app_log_only_the_note() -> None:
    ds = load([REAL / "before" / "logs" / "llama-server.log"])
    for fn in (cache, cache_misses):
        table = fn(ds, Options())
        assert table["note"].tolist() == [NEEDS_APP_LOG]
        assert table.drop(columns="note").isna().all().all()


def _pairs_by_sort_and_merge(calls, opts: Options):
    """The turn pairs as they were made on a table of the turns (text users and sessions, a
    sort, group shifts and an as-of merge on the summaries), for the comparisons below."""
    import numpy as np
    import pandas as pd

    from slotscope.analyze.cache import MISS_SHARE, SUMMARY, _shifted
    from slotscope.analyze.turns import is_chat_turn, measured_calls

    chat_rows = np.flatnonzero((measured_calls(calls) & is_chat_turn(calls["purpose"].astype("string"))).to_numpy())
    narrow = ["user", "start_at"] + [c for c in ("end_at", "app_session") if c in calls.columns]
    chat = calls[narrow + ["prompt_tokens", "completion_tokens"]].iloc[chat_rows]
    chat.insert(0, "pos", chat_rows)
    chat["user"] = chat["user"].astype("string")
    chat = chat.loc[chat["user"].notna()].sort_values(["user", "start_at"], kind="stable")
    end = chat["end_at"].fillna(chat["start_at"]) if "end_at" in chat else chat["start_at"]
    left = chat.pop("prompt_tokens").astype("Float64") + chat.pop("completion_tokens").astype("Float64")
    chat["session"] = chat["app_session"].astype("string") if "app_session" in chat else pd.Series(pd.NA, index=chat.index, dtype="string")
    g = chat.groupby("user", sort=False)
    chat["prev_pos"] = g["pos"].shift(1)
    chat["prev_start_at"] = g["start_at"].shift(1)
    chat["prev_end_at"] = end.groupby(chat["user"], sort=False).shift(1)
    chat["prev_left_tokens"] = left.groupby(chat["user"], sort=False).shift(1)
    chat["prev_session"] = g["session"].shift(1)
    chat["gap_s"] = ((chat["start_at"] - chat["prev_end_at"]).dt.total_seconds()).round(3)
    summaries = calls.loc[calls["purpose"].astype("string") == SUMMARY, ["user", "start_at"]].copy()
    summaries["user"] = summaries["user"].astype("string")
    summaries = summaries.dropna().rename(columns={"start_at": "summary_at"}).sort_values("summary_at")
    chat = pd.merge_asof(chat.sort_values("start_at", kind="stable"), summaries, left_on="start_at", right_on="summary_at",
                         by="user", direction="backward", allow_exact_matches=False)
    same_session = (chat["session"] == chat["prev_session"]).fillna(True)
    folded = chat["summary_at"].notna() & (chat["summary_at"] > chat["prev_start_at"])
    pair = chat["prev_pos"].notna() & (chat["gap_s"] <= opts.cache_window_s) & same_session & ~folded
    chat = chat.loc[pair.fillna(False).to_numpy()].reset_index(drop=True)
    before = chat["prev_pos"].to_numpy(dtype=np.int64)
    pairs = calls.iloc[chat["pos"].to_numpy()].reset_index(drop=True)
    pairs["user"] = chat["user"]
    of_previous = {"prev_call_id": "call_id", "prev_slot": "slot", "prev_call_file": "call_file", "prev_call_line": "call_line"}
    for name in ("prev_call_id", "prev_start_at", "prev_end_at", "prev_slot", "prev_call_file", "prev_call_line",
                 "prev_left_tokens", "session", "prev_session", "gap_s", "summary_at"):
        pairs[name] = _shifted(calls[of_previous[name]], before) if name in of_previous else chat[name]
    pairs["cached"] = pairs["prompt_tokens_cached"].astype("Float64").fillna(pairs["cached_tokens"].astype("Float64"))
    pairs["miss"] = (pairs["cached"] < MISS_SHARE * pairs["prev_left_tokens"]).fillna(False).astype(bool)
    return pairs


def _harder_calls(calls, variant: int):
    """The real calls made harder: users and sessions shuffled, some missing, out of category
    order or as plain text; more summaries, missing purposes and end times; starts moved (ties
    from variant 3 on); from variant 5 on no sessions nor end times."""
    import numpy as np
    import pandas as pd

    calls = calls.copy()
    rng = np.random.default_rng(variant)
    n = len(calls)
    if variant >= 1:
        names = np.array(["zoe", "Émile", "bob", "alice10", "alice9"], dtype=object)
        user = pd.Series(names[rng.integers(0, len(names), n)], dtype="object")
        user[rng.random(n) < 0.1] = None
        calls["user"] = pd.Categorical(user, categories=["zoe", "bob", "Émile", "alice9", "alice10"]) if variant % 2 \
            else user.astype("string")
        calls["app_session"] = pd.Categorical(np.where(rng.random(n) < 0.3, None, rng.integers(0, 3, n).astype(str)))
        calls["start_at"] = calls["start_at"] + pd.to_timedelta(rng.integers(0, 3, n) * 60, unit="s")
        calls.loc[rng.random(n) < 0.05, "end_at"] = pd.NaT
        purpose = calls["purpose"].astype("object")
        purpose[rng.random(n) < 0.2] = "summary"
        purpose[rng.random(n) < 0.05] = None
        calls["purpose"] = purpose.astype("category") if variant % 2 else purpose.astype("string")
    if variant >= 3:
        calls["start_at"] = calls["start_at"].dt.floor("5min")
        calls.loc[rng.random(n) < 0.1, "prompt_tokens_cached"] = pd.NA
    if variant >= 5:
        calls = calls.drop(columns=["app_session", "end_at"])
    return calls


@pytest.mark.parametrize("variant", range(6))
@pytest.mark.parametrize("scenario", ["before", "restart", "wallclock"])
def test_pairs_on_codes_equal_the_sort_and_merge(datasets: dict, scenario: str, variant: int) -> None:
    """The turns paired on integer codes and positions give the pairs the sort and the as-of
    merge gave, column for column, and so the cache tables (users grouped by code, not text)."""
    import pandas as pd

    from slotscope.analyze.cache import slim_calls, turn_pairs

    calls = _harder_calls(datasets[scenario].matches.calls, variant)
    for window in (300.0, 30.0):
        expected = _pairs_by_sort_and_merge(slim_calls(calls), Options(cache_window_s=window))
        pd.testing.assert_frame_equal(turn_pairs(slim_calls(calls), Options(cache_window_s=window)), expected)
    ds = load([REAL / scenario / "logs"])
    ds.matches.calls = calls
    pairs = _pairs_by_sort_and_merge(slim_calls(calls), Options())
    misses = cache_misses(ds, Options())
    assert list(zip(misses["call_id"], misses["prev_call_id"])) == list(zip(*pairs.loc[pairs["miss"], ["call_id", "prev_call_id"]].T.to_numpy()))
    pd.testing.assert_frame_equal(cache(ds, Options()), _cache_by_texts(pairs, Options()))


def _cache_by_texts(pairs, opts: Options):
    """The cache table as it was made: a groupby on the pairs' users as text."""
    import pandas as pd

    from slotscope.analyze.cache import COLUMNS, MISS_SHARE

    pairs = pairs.assign(other_slot=pairs["miss"] & (pairs["slot"] != pairs["prev_slot"]).fillna(False))
    by_user = pairs.groupby("user", sort=True, observed=True).agg(
        consecutive_turns=("miss", "size"), misses=("miss", "sum"), misses_on_other_slot=("other_slot", "sum"))
    total = pd.DataFrame({"consecutive_turns": [len(pairs)], "misses": [int(pairs["miss"].sum())],
                          "misses_on_other_slot": [int(pairs["other_slot"].sum())]}, index=pd.Index(["all"], name="user"))
    table = pd.concat([by_user, total]).reset_index(names="user")
    counts = ["consecutive_turns", "misses", "misses_on_other_slot"]
    table[counts] = table[counts].astype("int64")
    table["miss_share"] = (table["misses"] / table["consecutive_turns"].where(table["consecutive_turns"] > 0)).round(3)
    table["few_samples"] = table["consecutive_turns"] < opts.min_samples
    table["note"] = ""
    table.loc[table["user"] == "all", "note"] = (
        f"chat turns <= {opts.cache_window_s:g} s after the user's previous one; "
        f"miss = reused < {MISS_SHARE:.0%} of what the previous turn left")
    return table[COLUMNS]


def test_pairs_of_no_turns_and_of_a_turn_with_no_start(datasets: dict) -> None:
    """No chat turn: no pairs (with the columns and dtypes of pairs); a chat turn with no start
    time is refused as the as-of merge refused it."""
    import pandas as pd

    from slotscope.analyze.cache import slim_calls, turn_pairs

    calls = datasets["before"].matches.calls.copy()
    none = calls.assign(purpose=pd.Categorical(["translation"] * len(calls)))
    pd.testing.assert_frame_equal(turn_pairs(slim_calls(none), Options()), _pairs_by_sort_and_merge(slim_calls(none), Options()))
    ds = load([REAL / "before" / "logs"])
    ds.matches.calls = none
    pd.testing.assert_frame_equal(cache(ds, Options()), _cache_by_texts(_pairs_by_sort_and_merge(slim_calls(none), Options()), Options()))
    calls.loc[calls.index[5], "start_at"] = pd.NaT
    for pair in (turn_pairs, _pairs_by_sort_and_merge):
        with pytest.raises(ValueError, match="null values on left"):
            pair(slim_calls(calls), Options())
