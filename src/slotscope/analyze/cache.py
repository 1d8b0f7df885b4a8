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

from ..dataset import Dataset, calls_of
from . import Options, register
from .turns import as_text, is_chat_turn, measured_calls, needs_app_log

MISS_SHARE = 0.5
SUMMARY = "summary"
COLUMNS = ["user", "consecutive_turns", "misses", "miss_share", "misses_on_other_slot", "few_samples", "note"]
MISS_COLUMNS = [
    "user", "call_id", "start_at", "purpose", "slot", "task_id", "prev_call_id", "prev_slot", "gap_s",
    "prev_left_tokens", "cached_tokens", "prompt_tokens", "new_tokens", "note",
    # where to find each turn: its app-log line, the previous turn's, and its task's server-log line
    "call_file", "call_line", "prev_call_file", "prev_call_line", "source", "port", "task_file", "task_line",
]
# The columns of the calls table that turn_pairs reads.
PAIR_COLUMNS = [
    "call_id", "start_at", "end_at", "purpose", "user", "slot", "task_id", "prompt_tokens", "completion_tokens",
    "cached_tokens", "prompt_tokens_cached", "prompt_tokens_new", "app_session", "call_file", "call_line",
    "source", "port", "task_file", "task_line",
]
# What turn_pairs reads of the calls table: the pairs' columns, and what picks the turns.
TURN_COLUMNS = PAIR_COLUMNS + ["ok"]


def by_user_and_start(user: pd.Series, start: pd.Series) -> np.ndarray:
    """Row positions in the order of ``sort_values([user, start], kind="stable")`` (users as
    text), sorted on integers: the users' places among their sorted texts and the times."""
    code, texts = pd.factorize(user, sort=True)
    code = np.where(code < 0, len(texts), code)  # (missing users last)
    at = np.where(start.isna().to_numpy(), np.iinfo(np.int64).max, start.array.asi8)  # (missing starts last)
    return np.lexsort((at, code))


def _latest_summary(calls: pd.DataFrame, turns: pd.DataFrame) -> pd.Series:
    """For each turn (``user`` as text, ``start_at``, in start order), when its user's latest
    summary call started before it (NaT: none)."""
    summaries = pd.DataFrame({"user": as_text(calls["user"]), "summary_at": calls["start_at"]})
    summaries = summaries.loc[(as_text(calls["purpose"]) == SUMMARY).fillna(False).to_numpy()]
    summaries = summaries.dropna().sort_values("summary_at", kind="stable")
    found = pd.merge_asof(turns[["user", "start_at"]], summaries, left_on="start_at", right_on="summary_at",
                          by="user", direction="backward", allow_exact_matches=False)
    return found["summary_at"]


def turn_pairs(calls: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of one user, one row per later turn, in start order: the turn's
    row in ``calls`` (``pos``) and its columns (:data:`PAIR_COLUMNS`, ``user`` as text), the
    previous turn's (``prev_*``), the gap between them, the tokens the previous one left and
    the ones this one reused (``cached``), and whether it missed the cache (``miss``)."""
    is_turn = (measured_calls(calls) & is_chat_turn(calls["purpose"])).to_numpy()
    # The pairs are found on a few columns of the turns; the rest are taken for the pairs alone.
    pos = np.flatnonzero(is_turn)
    turns = calls.iloc[pos]
    chat = pd.DataFrame({"pos": pos, "user": as_text(turns["user"]).array, "start_at": turns["start_at"].array,
                         "session": as_text(turns["app_session"]).array if "app_session" in turns
                         else pd.array([pd.NA] * len(pos), dtype="string")})
    chat["ended_at"] = turns["end_at"].fillna(turns["start_at"]).array if "end_at" in turns else chat["start_at"]
    chat["left_tokens"] = (turns["prompt_tokens"].astype("Float64") + turns["completion_tokens"].astype("Float64")).array
    del turns
    chat = chat.loc[chat["user"].notna().to_numpy()]
    chat = chat.iloc[by_user_and_start(chat["user"], chat["start_at"])]
    of_previous = ["pos", "start_at", "ended_at", "left_tokens", "session"]
    chat[["prev_" + c for c in of_previous]] = chat.groupby("user", sort=False)[of_previous].shift(1)
    chat["gap_s"] = (chat["start_at"] - chat["prev_ended_at"]).dt.total_seconds().round(3)
    chat = chat.sort_values("start_at", kind="stable").reset_index(drop=True)
    # A summary between the two turns folded the history: the next prompt is meant to differ.
    folded = (_latest_summary(calls, chat) > chat["prev_start_at"]).fillna(False)
    same_session = (chat["session"] == chat["prev_session"]).fillna(True)  # (unknown: by time alone)
    pair = chat["prev_pos"].notna() & (chat["gap_s"] <= opts.cache_window_s) & same_session & ~folded
    pairs = chat.loc[pair.to_numpy()].reset_index(drop=True)
    del chat
    shown = calls.iloc[pairs["pos"].to_numpy()].reset_index(drop=True)
    for c in PAIR_COLUMNS:
        if c in shown and c not in pairs:
            pairs[c] = shown[c]
    before = calls.iloc[pairs["prev_pos"].to_numpy(dtype=np.int64)].reset_index(drop=True)
    for c in ("call_id", "slot", "call_file", "call_line"):
        if c in before:
            pairs["prev_" + c] = before[c]
    pairs["cached"] = pairs["prompt_tokens_cached"].astype("Float64").fillna(pairs["cached_tokens"].astype("Float64"))
    pairs["miss"] = (pairs["cached"] < MISS_SHARE * pairs["prev_left_tokens"]).fillna(False).astype(bool)
    return pairs


@register("cache")
def cache(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Consecutive chat turns of each user within the cache window, and how many missed the prompt cache."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    pairs = turn_pairs(calls_of(ds, TURN_COLUMNS), opts)
    pairs["other_slot"] = pairs["miss"] & (pairs["slot"] != pairs["prev_slot"]).fillna(False)
    counts = ["consecutive_turns", "misses", "misses_on_other_slot"]
    by_user = pairs.groupby("user", sort=True).agg(
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
    m["cached_tokens"] = m["cached"].astype("Int64")
    m["new_tokens"] = m["prompt_tokens_new"]
    for c in ("prev_left_tokens", "new_tokens", "prev_slot", "prev_call_line", "task_line", "port"):
        m[c] = m[c].astype("Int64")
    for c in ("call_file", "prev_call_file"):
        m[c] = m[c].astype("string")
    m["note"] = (m["slot"] != m["prev_slot"]).fillna(False).map({True: "other slot than the previous turn", False: ""})
    return m[MISS_COLUMNS]
