"""Prompt-cache misses between consecutive chat turns of one user.

A *consecutive turn* is a successful chat turn (see :func:`.turns.is_chat_turn`) whose user's
previous successful chat turn ended at most ``opts.cache_window_s`` before it started, in the
same app session when the app log names sessions (a new session is a new conversation), and
with no summary call of that user started in between (a summary folds the history, so the next
prompt is meant to differ: those turns are the ``after_summary`` prefills, not cache misses).
Calls of other purposes between the two turns (a translation, say) do not break the pair: the
conversation's prefix should still be reusable.

The previous turn leaves ``prompt_tokens + completion_tokens`` tokens in its slot; the next
turn's prompt starts with them. A turn is a *miss* when fewer than :data:`MISS_SHARE` of those
tokens were reused (``prompt_tokens_cached`` of its task, else the app's ``cached_tokens``).
A reused prefix is normally 95-100% of what was left, a miss near 0%, so the threshold is not
delicate.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..dataset import Dataset, calls_of, own_copy
from . import SHARED, Options, register
from .turns import is_chat_turn, measured_calls, needs_app_log

MISS_SHARE = 0.5
SUMMARY = "summary"
COLUMNS = ["user", "consecutive_turns", "misses", "miss_share", "misses_on_other_slot", "few_samples", "note"]
MISS_COLUMNS = [
    "user", "call_id", "start_at", "purpose", "slot", "task_id", "prev_call_id", "prev_slot", "gap_s",
    "prev_left_tokens", "cached_tokens", "prompt_tokens", "new_tokens", "note",
    # where to find each turn: its app-log line, the previous turn's, and its task's server-log line
    "call_file", "call_line", "prev_call_file", "prev_call_line", "source", "port", "task_file", "task_line",
]


# The columns of the calls table that turn_pairs and the tables built on it read.
PAIR_COLUMNS = [
    "call_id", "start_at", "end_at", "purpose", "user", "slot", "task_id", "ok", "prompt_tokens", "completion_tokens",
    "cached_tokens", "prompt_tokens_cached", "prompt_tokens_new", "app_session", "call_file", "call_line",
    "source", "port", "task_file", "task_line",
]


def turn_pairs(calls: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of one user (one row per later turn) with its ``miss`` flag.

    The turns are paired on a narrow table (each turn's position in ``calls``, user, times,
    session, tokens left); the calls' own columns are taken once, for the pairs alone. (Copied
    whole through the sorts and the as-of merge, the 560k calls of the 1 GB bench, several of
    their columns text, peaked ~750 MB above the loaded data.)
    """
    chat_rows = np.flatnonzero((measured_calls(calls) & is_chat_turn(calls["purpose"])).to_numpy())
    narrow = ["user", "start_at"] + [c for c in ("end_at", "app_session") if c in calls.columns]
    chat = calls[narrow + ["prompt_tokens", "completion_tokens"]].iloc[chat_rows]
    chat.insert(0, "pos", chat_rows)
    chat["user"] = chat["user"].astype("string")
    chat = chat.loc[chat["user"].notna()].sort_values(["user", "start_at"], kind="stable")
    end = chat["end_at"].fillna(chat["start_at"]) if "end_at" in chat else chat["start_at"]
    left = (chat.pop("prompt_tokens").astype("Float64") + chat.pop("completion_tokens").astype("Float64"))
    by_user = chat["user"]
    chat["session"] = chat["app_session"].astype("string") if "app_session" in chat else pd.Series(pd.NA, index=chat.index, dtype="string")
    g = chat.groupby("user", sort=False, observed=True)
    chat["prev_pos"] = g["pos"].shift(1)
    chat["prev_start_at"] = g["start_at"].shift(1)
    chat["prev_end_at"] = end.groupby(by_user, sort=False, observed=True).shift(1)
    chat["prev_left_tokens"] = left.groupby(by_user, sort=False, observed=True).shift(1)
    chat["prev_session"] = g["session"].shift(1)
    chat["gap_s"] = ((chat["start_at"] - chat["prev_end_at"]).dt.total_seconds()).round(3)
    del end, left, by_user, g

    # The latest summary of the same user started before each turn.
    summaries = calls.loc[calls["purpose"].astype("string") == SUMMARY, ["user", "start_at"]].copy()
    summaries["user"] = summaries["user"].astype("string")
    summaries = summaries.dropna().rename(columns={"start_at": "summary_at"}).sort_values("summary_at")
    chat = chat.sort_values("start_at", kind="stable")
    chat = pd.merge_asof(chat, summaries, left_on="start_at", right_on="summary_at", by="user",
                         direction="backward", allow_exact_matches=False)

    same_session = (chat["session"] == chat["prev_session"]).fillna(True)  # unknown session: by time alone
    folded = chat["summary_at"].notna() & (chat["summary_at"] > chat["prev_start_at"])
    pair = chat["prev_pos"].notna() & (chat["gap_s"] <= opts.cache_window_s) & same_session & ~folded
    chat = chat.loc[pair.fillna(False).to_numpy()].reset_index(drop=True)
    at = chat["pos"].to_numpy()
    before = chat["prev_pos"].to_numpy(dtype=np.int64)
    pairs = calls.iloc[at].reset_index(drop=True)  # in start order: the as-of merge keeps it
    pairs["user"] = chat["user"]
    # The previous turn's own columns are taken from the calls by its position (as a shift
    # within the user's turns gives them); the rest were made on the narrow table.
    of_previous = {"prev_call_id": "call_id", "prev_slot": "slot", "prev_call_file": "call_file",
                   "prev_call_line": "call_line"}
    for name in ("prev_call_id", "prev_start_at", "prev_end_at", "prev_slot", "prev_call_file", "prev_call_line",
                 "prev_left_tokens", "session", "prev_session", "gap_s", "summary_at"):
        pairs[name] = _shifted(calls[of_previous[name]], before) if name in of_previous else chat[name]
    cached = pairs["prompt_tokens_cached"].astype("Float64").fillna(pairs["cached_tokens"].astype("Float64"))
    pairs["cached"] = cached
    pairs["miss"] = (cached < MISS_SHARE * pairs["prev_left_tokens"]).fillna(False).astype(bool)
    return pairs


def _shifted(col: pd.Series, rows: np.ndarray) -> pd.Series:
    """``col`` at ``rows`` (every one a row), as a shift within groups gives it: in the dtype
    that holds the missing value a shift brings in (int64 -> float64, the others as they are)."""
    taken = col.iloc[rows].reset_index(drop=True)
    dtype = col.iloc[:1].shift(1).dtype if len(col) else col.dtype
    return taken if taken.dtype == dtype else taken.astype(dtype)


def slim_calls(calls: pd.DataFrame) -> pd.DataFrame:
    """The calls table cut to :data:`PAIR_COLUMNS` (what :func:`turn_pairs` copies, several times)."""
    return calls[[c for c in PAIR_COLUMNS if c in calls.columns]]


def shared_pairs(ds: Dataset, opts: Options) -> pd.DataFrame:
    """The turn pairs of the matched calls, computed once for the tables that read them (cache,
    cache-misses, prefills' causes); each caller gets its own copy."""
    assert ds.matches is not None
    pairs = ds.memo((SHARED, "turn pairs", opts.cache_window_s), lambda: turn_pairs(calls_of(ds, PAIR_COLUMNS), opts))
    return own_copy(pairs)


@register("cache")
def cache(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of each user within the cache window, and how many missed the prompt cache."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    pairs = shared_pairs(ds, opts)
    pairs["other_slot"] = pairs["miss"] & (pairs["slot"] != pairs["prev_slot"]).fillna(False)
    by_user = pairs.groupby("user", sort=True, observed=True).agg(
        consecutive_turns=("miss", "size"), misses=("miss", "sum"), misses_on_other_slot=("other_slot", "sum"))
    total = pd.DataFrame({
        "consecutive_turns": [len(pairs)], "misses": [int(pairs["miss"].sum())],
        "misses_on_other_slot": [int(pairs["other_slot"].sum())]}, index=pd.Index(["all"], name="user"))
    table = pd.concat([by_user, total]).reset_index(names="user")
    table[["consecutive_turns", "misses", "misses_on_other_slot"]] = table[
        ["consecutive_turns", "misses", "misses_on_other_slot"]].astype("int64")
    table["miss_share"] = (table["misses"] / table["consecutive_turns"].where(table["consecutive_turns"] > 0)).round(3)
    table["few_samples"] = table["consecutive_turns"] < opts.min_samples
    table["note"] = ""
    table.loc[table["user"] == "all", "note"] = (
        f"chat turns <= {opts.cache_window_s:g} s after the user's previous one; "
        f"miss = reused < {MISS_SHARE:.0%} of what the previous turn left")
    return table[COLUMNS]


@register("cache-misses")
def cache_misses(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Each consecutive chat turn that missed the prompt cache, with the turn before it."""
    if ds.matches is None:
        return needs_app_log(MISS_COLUMNS)
    pairs = shared_pairs(ds, opts)
    m = pairs.loc[pairs["miss"]].copy()
    m["cached_tokens"] = m["cached"].astype("Int64")
    m["prev_left_tokens"] = m["prev_left_tokens"].astype("Int64")
    m["new_tokens"] = m["prompt_tokens_new"].astype("Int64")
    m["prev_slot"] = m["prev_slot"].astype("Int64")
    for c in ("prev_call_line", "task_line", "port"):
        m[c] = m[c].astype("Int64")
    for c in ("call_file", "prev_call_file"):  # (categories in the calls: few rows here)
        m[c] = m[c].astype("string")
    m["note"] = (m["slot"] != m["prev_slot"]).fillna(False).map({True: "other slot than the previous turn", False: ""})
    return m[MISS_COLUMNS].reset_index(drop=True)
