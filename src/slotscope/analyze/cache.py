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

from ..dataset import Dataset, calls_at, calls_of
from ..timeline import aggregate
from .questions import Options, register
from .turns import as_text, is_chat_turn, is_text, measured_calls, needs_app_log, text_codes

MISS_SHARE = 0.5
SUMMARY = "summary"
COLUMNS = ["user", "consecutive_turns", "misses", "miss_share", "misses_on_other_slot", "few_samples", "note"]
MISS_COLUMNS = [
    "user", "call_id", "start_at", "purpose", "slot", "task_id", "prev_call_id", "prev_slot", "gap_s",
    "prev_left_tokens", "cached_tokens", "prompt_tokens", "new_tokens", "note",
    # where to find each turn: its app-log line, the previous turn's, and its task's server-log line
    "call_file", "call_line", "prev_call_file", "prev_call_line", "source", "port", "task_file", "task_line",
]
# What turn_pairs reads of the calls table to find the pairs.
TURN_COLUMNS = [
    "ok", "task_id", "purpose", "user", "app_session", "start_at", "end_at", "prompt_tokens", "completion_tokens",
    "prompt_tokens_cached", "cached_tokens",
]
# What cache-misses shows of each missed turn, and of the turn before it.
SHOWN_COLUMNS = [
    "call_id", "purpose", "slot", "task_id", "prompt_tokens", "prompt_tokens_new", "call_file", "call_line",
    "source", "port", "task_file", "task_line",
]
PREV_COLUMNS = ["call_id", "slot", "call_file", "call_line"]


def by_user_and_start(user: pd.Series, start: pd.Series) -> np.ndarray:
    """Row positions in the order of ``sort_values([user, start], kind="stable")`` (users as
    text), sorted on integers: the users' places among their sorted texts and the times."""
    code, texts = pd.factorize(user, sort=True)
    code = np.where(code < 0, len(texts), code)  # (missing users last)
    at = np.where(start.isna().to_numpy(), np.iinfo(np.int64).max, start.array.asi8)  # (missing starts last)
    return np.lexsort((at, code))


def _latest_summary(calls: pd.DataFrame, user: np.ndarray, turns: pd.DataFrame) -> np.ndarray:
    """For each turn (``user`` code, ``start_at``, in start order), when its user's latest
    summary call started before it, in the start times' integer unit (the int64 minimum:
    none). ``user``: every call's code."""
    start = calls["start_at"].array
    summary = is_text(calls["purpose"], SUMMARY) & ~np.isnan(user) & ~np.asarray(start.isna())
    s_user, s_at = user[summary].astype(np.int64), start[summary].asi8
    t_user, t_at = turns["user"].to_numpy().astype(np.int64), turns["start_at"].array.asi8
    # One sortable key per (user, time): the user's code, then the time's rank among them all.
    times, rank = np.unique(np.concatenate([s_at, t_at]), return_inverse=True)
    key = np.concatenate([s_user, t_user]) * (len(times) + 1) + rank
    s_key, t_key = key[:len(s_at)], key[len(s_at):]
    order = np.argsort(s_key, kind="stable")
    s_key, s_user, s_at = s_key[order], s_user[order], s_at[order]
    # The summary just before each turn's key, if it is of the turn's user (strictly earlier).
    at = np.searchsorted(s_key, t_key, side="left") - 1
    found = (at >= 0) & (s_user[np.maximum(at, 0)] == t_user) if len(s_key) else np.zeros(len(t_key), dtype=bool)
    return np.where(found, s_at[np.maximum(at, 0)] if len(s_key) else 0, np.iinfo(np.int64).min)


def turn_pairs(calls: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of one user, one row per later turn, in start order: the turn's
    row in ``calls`` (``pos``) and the previous turn's (``prev_pos``), the ``user`` (as text),
    the turn's ``start_at``, the gap between them, the tokens the previous one left
    (``prev_left_tokens``) and the ones this one reused (``cached``), and whether it missed the
    cache (``miss``). ``calls``: at least :data:`TURN_COLUMNS`."""
    is_turn = (measured_calls(calls) & is_chat_turn(calls["purpose"])).to_numpy()
    # Users and sessions as codes that sort as their texts do: the same pairs, no string per call.
    user = text_codes(calls["user"])
    start = calls["start_at"].array
    turns = np.flatnonzero(is_turn & ~np.isnan(user))
    turns = turns[by_user_and_start(pd.Series(user[turns]), pd.Series(start.take(turns)))]
    # Every turn after its user's previous one is a candidate, taken in start order.
    later = np.flatnonzero(user[turns][1:] == user[turns][:-1]) + 1
    order = pd.Series(start.take(turns[later])).sort_values(kind="stable").index.to_numpy()
    pos, prev = turns[later][order], turns[later - 1][order]
    del turns, later, order
    t = pd.DataFrame({"pos": pos, "user": user[pos], "start_at": start.take(pos)})
    prev_ended = calls["end_at"].iloc[prev].fillna(calls["start_at"].iloc[prev]) if "end_at" in calls \
        else calls["start_at"].iloc[prev]
    t["gap_s"] = (t["start_at"] - prev_ended.set_axis(t.index)).dt.total_seconds().round(3)
    # A summary between the two turns folded the history: the next prompt is meant to differ.
    folded = _latest_summary(calls, user, t) > start.take(prev).asi8
    if "app_session" in calls:
        session = text_codes(calls["app_session"])
        s, s_prev = session[pos], session[prev]
        same_session = np.isnan(s) | np.isnan(s_prev) | (s == s_prev)  # (unknown: by time alone)
    else:
        same_session = np.ones(len(pos), dtype=bool)
    pair = (t["gap_s"] <= opts.cache_window_s).to_numpy() & same_session & ~folded
    pairs = t.loc[pair].reset_index(drop=True)
    pos, prev = pos[pair], prev[pair]
    pairs["user"] = as_text(calls["user"].iloc[pos]).array
    pairs["prev_pos"] = prev
    pairs["prev_left_tokens"] = (calls["prompt_tokens"].iloc[prev].astype("Float64")
                                 + calls["completion_tokens"].iloc[prev].astype("Float64")).array
    pairs["cached"] = (calls["prompt_tokens_cached"].iloc[pos].astype("Float64")
                       .fillna(calls["cached_tokens"].iloc[pos].astype("Float64")).array)
    pairs["miss"] = (pairs["cached"] < MISS_SHARE * pairs["prev_left_tokens"]).fillna(False).astype(bool)
    return pairs


@register("cache")
def cache(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of each user within the cache window, and how many missed the prompt cache."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    pairs = turn_pairs(calls_of(ds, TURN_COLUMNS), opts)
    slot = calls_of(ds, ["slot"])["slot"]
    other_slot = pd.Series(slot.iloc[pairs["pos"].to_numpy()].array != slot.iloc[pairs["prev_pos"].to_numpy()].array)
    pairs["other_slot"] = pairs["miss"] & other_slot.fillna(False)
    counts = ["consecutive_turns", "misses", "misses_on_other_slot"]
    by_user = aggregate(pairs.groupby("user", sort=True),
                        consecutive_turns=("miss", "size"), misses=("miss", "sum"), misses_on_other_slot=("other_slot", "sum"))
    total = pd.DataFrame({"consecutive_turns": [len(pairs)], "misses": [int(pairs["miss"].sum())],
                          "misses_on_other_slot": [int(pairs["other_slot"].sum())]}, index=pd.Index(["all"], name="user"))
    table = pd.concat([by_user, total]).reset_index(names="user")
    table[counts] = table[counts].astype("int64")
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
    pairs = turn_pairs(calls_of(ds, TURN_COLUMNS), opts)
    m = pairs.loc[pairs["miss"].to_numpy()].reset_index(drop=True)
    shown = calls_at(ds, m["pos"].to_numpy(), SHOWN_COLUMNS)
    before = calls_at(ds, m["prev_pos"].to_numpy(), PREV_COLUMNS).add_prefix("prev_")
    m = pd.concat([m, shown, before], axis=1)
    m["cached_tokens"] = m["cached"].astype("Int64")
    m["new_tokens"] = m["prompt_tokens_new"]
    for c in ("prev_left_tokens", "new_tokens", "prev_slot", "prev_call_line", "task_line", "port"):
        m[c] = m[c].astype("Int64")
    for c in ("call_file", "prev_call_file"):
        m[c] = m[c].astype("string")
    m["note"] = (m["slot"] != m["prev_slot"]).fillna(False).map({True: "other slot than the previous turn", False: ""})
    return m[MISS_COLUMNS]
