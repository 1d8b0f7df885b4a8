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

from typing import Callable

import numpy as np
import pandas as pd

from .. import store
from ..dataset import Dataset, calls_of, own_copy, release_memory
from . import SHARED, Options, register
from .turns import is_chat_turn, measured_calls, needs_app_log, text_codes

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


# What the tables read of the pairs (one row per later turn, in start order): each turn's
# and the previous turn's row in the calls, the gap between them, the tokens the previous one
# left and the ones this one reused, the miss flag, and the latest summary before the turn.
CORE = ["pos", "prev_pos", "gap_s", "prev_left_tokens", "cached", "miss", "summary_at"]


def _text_rank(col: pd.Series) -> np.ndarray:
    """Each value's text as a code that sorts as the texts do (-1: missing): a category
    column's codes, ranked (no text per call)."""
    codes, texts = text_codes(col)
    rank = np.argsort(np.argsort(np.asarray(texts.astype(object), dtype=object), kind="stable"), kind="stable")
    return np.where(codes < 0, -1, rank[np.maximum(codes, 0)] if len(rank) else -1)


def _us(col: pd.Series) -> np.ndarray:
    """Wall times as integers in the column's unit (NaT: the smallest int64)."""
    return col.array.asi8 if hasattr(col.array, "asi8") else pd.to_datetime(col).array.asi8


def pair_core(column: Callable[[str], pd.Series | None], opts: Options) -> pd.DataFrame:
    """The consecutive chat turns as :data:`CORE` (pairs in start order), from the calls'
    columns as ``column(name)`` gives them (None: the calls have no such column).

    Paired on integer codes and positions, a column read at a time: users and sessions as
    their categories' codes, the previous turn by position. (As a sort and an as-of merge of
    a narrow table of text users and sessions, the 1 GB bench's pairs and their table took
    +258 MB.)
    """
    purpose = column("purpose")
    chat_rows = np.flatnonzero((measured_calls(pd.DataFrame({"ok": column("ok"), "task_id": column("task_id")}))
                                & is_chat_turn(purpose)).to_numpy())
    pcode, ptexts = text_codes(purpose)
    summary_text = np.flatnonzero((ptexts == SUMMARY).to_numpy(dtype=bool, na_value=False))
    is_summary = np.isin(pcode, summary_text)
    del purpose, pcode
    user = _text_rank(column("user"))
    start_col = column("start_at")
    start = _us(start_col)
    nat = start_col.isna().to_numpy()
    # Chat turns of a known user, by user and start (stable: ties as in the calls).
    chat_rows = chat_rows[user[chat_rows] >= 0]
    if nat[chat_rows].any():  # (as the as-of merge on start times refused them)
        raise ValueError("Merge keys contain null values on left side")
    turn = chat_rows[np.lexsort((start[chat_rows], user[chat_rows]))]
    del chat_rows
    u = user[turn]
    has_prev = np.r_[False, u[1:] == u[:-1]] if len(u) else np.zeros(0, dtype=bool)
    prev = np.r_[-1, turn[:-1]] if len(turn) else turn
    prev = np.where(has_prev, prev, -1)

    # The latest summary of the same user started before each turn. A summary's key is its
    # user and the rank of its time among the summaries' times; a turn's, its user and how many
    # of those times are before its start: the summaries before a turn are the keys below its
    # key, of its user. (Summaries and turns sorted together by user and time took ~20 MB more.)
    sums = np.flatnonzero(is_summary & (user >= 0) & ~nat)
    del is_summary
    times = np.unique(start[sums])
    width = len(times) + 1
    sum_key = user[sums].astype(np.int64) * width + np.searchsorted(times, start[sums])
    by = np.argsort(sum_key, kind="stable")
    sums, sum_key = sums[by], sum_key[by]
    turn_key = u.astype(np.int64) * width + np.searchsorted(times, start[turn])  # (the times before the turn)
    found = np.searchsorted(sum_key, turn_key) - 1  # the last key below the turn's (-1: none)
    found[(found >= 0) & (sum_key[np.maximum(found, 0)] < u.astype(np.int64) * width)] = -1  # (another user's)
    del turn_key, by, times, user, u
    summary_us = np.where(found >= 0, start[sums[np.maximum(found, 0)]] if len(sums) else 0, 0)
    folded = (found >= 0) & has_prev & (summary_us > np.where(has_prev, start[np.maximum(prev, 0)], 0))
    del summary_us
    release_memory()  # (the heap the sorts and searches left: the next stages' peak does not stack on it)

    # Same session, where both are known (an unknown one: by time alone).
    sess_col = column("app_session")
    if sess_col is not None:
        sess = text_codes(sess_col)[0]
        s_now, s_prev = sess[turn], sess[np.maximum(prev, 0)]
        same_session = (s_now < 0) | (s_prev < 0) | (s_now == s_prev)
        del sess, sess_col
    else:
        same_session = np.ones(len(turn), dtype=bool)
    # The gap from the previous turn's end (its start where none) to this one's start.
    # (the previous turns' ends taken, then filled: no filled copy of the whole column)
    at, before = turn[has_prev], prev[has_prev]
    end_col = column("end_at")
    start_before = start_col.iloc[before].reset_index(drop=True)
    end = end_col.iloc[before].reset_index(drop=True).fillna(start_before) if end_col is not None else start_before
    del end_col, start_before
    gap = np.full(len(turn), np.nan)
    gap[has_prev] = (start_col.iloc[at].reset_index(drop=True) - end).dt.total_seconds().round(3).to_numpy(dtype=float, na_value=np.nan)
    del end, at, before
    with np.errstate(invalid="ignore"):
        pair = has_prev & (gap <= opts.cache_window_s) & same_session & ~folded
    # In start order (stable: ties by user, then as in the calls), as the as-of merge left them.
    keep = np.flatnonzero(pair)
    keep = keep[np.argsort(start[turn[keep]], kind="stable")]
    core = pd.DataFrame({"pos": turn[keep], "prev_pos": prev[keep], "gap_s": gap[keep]})
    summary_row = np.full(len(keep), -1, dtype=np.int64)  # (-1: none, NaT)
    has_summary = found[keep] >= 0
    summary_row[has_summary] = sums[found[keep][has_summary]]
    core["summary_at"] = start_col.array.take(summary_row, allow_fill=True)
    del start_col, start, nat, turn, prev, has_prev, found, folded, same_session, gap, pair, keep, sums, sum_key
    release_memory()
    # The tokens, of the pairs' rows alone (taken, then made Float64: the same values).
    at, before = core["pos"].to_numpy(), core["prev_pos"].to_numpy()

    def taken(name: str, rows: np.ndarray) -> pd.Series:
        return column(name).iloc[rows].reset_index(drop=True).astype("Float64")

    core["prev_left_tokens"] = (taken("prompt_tokens", before) + taken("completion_tokens", before)).array
    cached = taken("prompt_tokens_cached", at).fillna(taken("cached_tokens", at))
    core["cached"] = cached.array
    core["miss"] = (cached < MISS_SHARE * core["prev_left_tokens"]).fillna(False).astype(bool).to_numpy()
    return core[CORE]


def turn_pairs(calls: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of one user (one row per later turn, in start order) with its
    ``miss`` flag: the calls' columns of the turn, ``user`` as text, the previous turn's
    (``prev_*``), the gap, the sessions, the latest summary before it and what was reused."""
    core = pair_core(lambda c: calls[c] if c in calls.columns else None, opts)
    at, before = core["pos"].to_numpy(), core["prev_pos"].to_numpy()
    pairs = calls.iloc[at].reset_index(drop=True)
    pairs["user"] = calls["user"].iloc[at].astype("string").reset_index(drop=True)
    end = calls["end_at"].fillna(calls["start_at"]) if "end_at" in calls.columns else calls["start_at"]
    session = calls["app_session"].astype("string") if "app_session" in calls.columns else \
        pd.Series(pd.NA, index=calls.index, dtype="string")
    # The previous turn's columns taken from the calls by its position (as a shift within the
    # user's turns gives them).
    of_previous = {"prev_call_id": calls["call_id"], "prev_start_at": calls["start_at"], "prev_end_at": end,
                   "prev_slot": calls["slot"], "prev_call_file": calls["call_file"], "prev_call_line": calls["call_line"]}
    for name in ("prev_call_id", "prev_start_at", "prev_end_at", "prev_slot", "prev_call_file", "prev_call_line"):
        pairs[name] = _shifted(of_previous[name], before)
    pairs["prev_left_tokens"] = core["prev_left_tokens"]
    pairs["session"] = session.iloc[at].reset_index(drop=True)
    pairs["prev_session"] = session.iloc[before].reset_index(drop=True)
    for name in ("gap_s", "summary_at", "cached", "miss"):
        pairs[name] = core[name]
    return pairs


def _shifted(col: pd.Series, rows: np.ndarray) -> pd.Series:
    """``col`` at ``rows`` (every one a row), as a shift within groups gives it: in the dtype
    that holds the missing value a shift brings in (int64 -> float64, the others as they are)."""
    taken = col.iloc[rows].reset_index(drop=True)
    dtype = col.iloc[:1].shift(1).dtype if len(col) else col.dtype
    return taken if taken.dtype == dtype else taken.astype(dtype)


def _calls_at(ds: Dataset, rows: np.ndarray, name: str) -> pd.Series:
    """Column ``name`` of the matched calls at ``rows``, read from disk only over the stored
    batches that hold them."""
    assert ds.matches is not None
    stored = store.stored(ds.matches, "calls")
    if stored is None:
        return calls_of(ds, [name])[name].iloc[rows].reset_index(drop=True)
    return stored.take_scattered(rows, [name])[name]


def _as_shifted(taken: pd.Series, one_row: Callable[[], pd.Series]) -> pd.Series:
    """:func:`_shifted` of rows already taken: in the dtype a shift gives the column (read
    off ``one_row()``, its first row if it has one, when none was taken)."""
    sample = taken if len(taken) else one_row()
    if not len(sample):
        return taken
    dtype = sample.iloc[:1].shift(1).dtype
    return taken if taken.dtype == dtype else taken.astype(dtype)


def slim_calls(calls: pd.DataFrame) -> pd.DataFrame:
    """The calls table cut to :data:`PAIR_COLUMNS` (what :func:`turn_pairs` reads)."""
    return calls[[c for c in PAIR_COLUMNS if c in calls.columns]]


def _column_of(ds: Dataset) -> Callable[[str], pd.Series | None]:
    """A reader of the matched calls' columns, one at a time (None: no such column)."""
    def column(name: str) -> pd.Series | None:
        got = calls_of(ds, [name])
        return got[name] if name in got.columns else None
    return column


def shared_pairs(ds: Dataset, opts: Options) -> pd.DataFrame:
    """The :func:`pair_core` of the matched calls, computed once for the tables that read it
    (cache, cache-misses, prefills' causes); each caller gets its own copy. The tables take
    the calls' columns they show by the pairs' positions."""
    assert ds.matches is not None
    pairs = ds.memo((SHARED, "turn pairs", opts.cache_window_s), lambda: pair_core(_column_of(ds), opts))
    return own_copy(pairs)


@register("cache")
def cache(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of each user within the cache window, and how many missed the prompt cache."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    core = shared_pairs(ds, opts)
    at, before = core["pos"].to_numpy(), core["prev_pos"].to_numpy()
    calls = calls_of(ds, ["user", "slot"])
    pairs = pd.DataFrame({"miss": core["miss"]})
    del core
    slot, prev_slot = calls["slot"].iloc[at].reset_index(drop=True), _shifted(calls["slot"], before)
    pairs["other_slot"] = pairs["miss"] & (slot != prev_slot).fillna(False)
    # By user: their codes ranked as their texts sort, the texts put back on the few rows (a
    # text per pair and a groupby on them took 3-4x the time).
    codes, texts = text_codes(calls["user"])
    del calls
    by_text = np.argsort(np.asarray(texts.astype(object), dtype=object), kind="stable")
    rank = np.empty(len(texts), dtype=np.int64)
    rank[by_text] = np.arange(len(texts))
    # Counted per user's rank, the users present in rank order, as a sorted groupby gives them
    # (the groupby of the 332k pairs at 1 GB of log was the table's peak).
    user = rank[codes[at]]  # (the pairs' users are never missing)
    present = np.unique(user)
    by_user = pd.DataFrame({
        "consecutive_turns": np.bincount(user, minlength=len(texts))[present],
        "misses": np.bincount(user, pairs["miss"].to_numpy(dtype=np.int64), minlength=len(texts))[present],
        "misses_on_other_slot": np.bincount(user, pairs["other_slot"].to_numpy(dtype=np.int64), minlength=len(texts))[present],
    }, index=pd.Index(texts.iloc[by_text[present]].array, name="user"))
    del user
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
    core = shared_pairs(ds, opts)
    m = core.loc[core["miss"].to_numpy(), ["gap_s", "prev_left_tokens", "cached"]].reset_index(drop=True)
    at, before = (core[c].to_numpy()[core["miss"].to_numpy()] for c in ("pos", "prev_pos"))
    del core
    # The calls' columns of the misses and of their previous turns, a column at a time, read
    # only over the stored batches that hold them (at 1 GB of log 52k misses of 560k calls).
    both = np.r_[at, before]
    first = np.zeros(min(len(calls_of(ds, [])), 1), dtype=np.int64)  # (the first call, if any)
    for c in ("user", "call_id", "start_at", "purpose", "slot", "task_id", "prompt_tokens", "prompt_tokens_new", "call_file",
              "call_line", "source", "port", "task_file", "task_line"):
        previous = c in ("call_id", "slot", "call_file", "call_line")
        col = _calls_at(ds, both if previous else at, c)
        m[c] = col.iloc[:len(at)].reset_index(drop=True)
        if previous:
            m["prev_" + c] = _as_shifted(col.iloc[len(at):].reset_index(drop=True), lambda: _calls_at(ds, first, c))
        del col
    m["user"] = m["user"].astype("string")
    m["cached_tokens"] = m["cached"].astype("Int64")
    m["prev_left_tokens"] = m["prev_left_tokens"].astype("Int64")
    m["new_tokens"] = m["prompt_tokens_new"].astype("Int64")
    m["prev_slot"] = m["prev_slot"].astype("Int64")
    for c in ("prev_call_line", "task_line", "port"):
        m[c] = m[c].astype("Int64")
    for c in ("call_file", "prev_call_file"):  # (categories in the calls: few rows here)
        m[c] = m[c].astype("string")
    m["note"] = (m["slot"] != m["prev_slot"]).fillna(False).map({True: "other slot than the previous turn", False: ""})
    return m[MISS_COLUMNS]  # (m's index is 0..n-1 already: no second copy of the table)
