"""Where the big prefills come from: prefills of ``opts.big_prefill_tokens``+ new tokens, by purpose and by cause.

Every server task with that many new (uncached) prompt tokens is counted once in the ``all``
row, once under its call's purpose and once under its cause. Causes, first match wins:

``first_of_day``      the user's first call of that calendar day (UTC) in the app log. A log
                      that starts mid-day makes every user's first call in it one of these.
``first_of_session``  the user's first call of an app session (only when the app log names
                      sessions): a conversation resumed later the same day
``summary``           the call is itself a ``summary`` (the transcript it folds is read anew)
``after_summary``     the user's previous call was a ``summary`` (the history was just folded)
``cache_miss``        a consecutive chat turn that did not reuse what its previous turn left
                      (see :mod:`.cache`)
``other``             anything else (translations, ...)

Tasks no call explains are counted as ``(unlogged)``. ``seconds_total`` is the sum of the
tasks' ``prompt eval time``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..dataset import Dataset, calls_of, task_view
from ..timeline import aggregate
from .questions import Options, register
from .cache import SUMMARY, TURN_COLUMNS, by_user_and_start, turn_pairs
from .turns import as_text, is_text, needs_app_log, text_codes

CAUSES = ["first_of_day", "first_of_session", "summary", "after_summary", "cache_miss", "other"]
UNLOGGED = "(unlogged)"
COLUMNS = ["by", "value", "count", "new_tokens_total", "seconds_total", "few_samples", "note"]
KEY = ["call_file", "call_line"]  # which app call a task's is (ids may repeat across app logs)


def call_causes(calls: pd.DataFrame, opts: Options) -> pd.Series:
    """The cause of each app call's prompt (one of :data:`CAUSES`), in the calls' order."""
    missed = np.zeros(len(calls), dtype=bool)
    pairs = turn_pairs(calls, opts)
    missed[pairs.loc[pairs["miss"].to_numpy(), "pos"].to_numpy()] = True
    del pairs
    # Users and sessions as codes that sort as their texts do (the same groups and order).
    c = pd.DataFrame({
        "user": text_codes(calls["user"]),
        "start_at": calls["start_at"].array,
        "summary": is_text(calls["purpose"], SUMMARY),
        "session": text_codes(calls["app_session"]) if "app_session" in calls else np.nan,
    })
    c = c.iloc[by_user_and_start(c["user"], c["start_at"])]
    # The calendar day (UTC) as a timestamp: the same groups as dates, without a date object per call.
    day = (c["start_at"].dt.tz_convert("UTC") if c["start_at"].dt.tz is not None else c["start_at"]).dt.floor("D")
    first_of_day = c.groupby([c["user"], day], sort=False, dropna=False).cumcount() == 0
    first_of_session = c["session"].notna() & (c.groupby(["user", "session"], sort=False, dropna=False).cumcount() == 0)
    summary = c["summary"]
    after_summary = c.groupby("user", sort=False, dropna=False)["summary"].shift(1, fill_value=False)
    holds = [first_of_day, first_of_session, summary, after_summary, pd.Series(missed[c.index], index=c.index)]
    cause = np.empty(len(calls), dtype=np.int8)  # (each call's place in CAUSES, in the calls' order)
    cause[c.index.to_numpy()] = np.select([h.to_numpy(dtype=bool) for h in holds], range(len(holds)), default=len(holds))
    return pd.Series(pd.Categorical.from_codes(cause, categories=CAUSES), index=calls.index, name="cause")


@register("prefills")
def prefills(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Count, new tokens and prefill seconds of the big prefills, by purpose and by cause."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    calls = calls_of(ds, TURN_COLUMNS)
    cause = call_causes(calls, opts)
    no_sessions = "app_session" not in calls or calls["app_session"].isna().all()
    del calls
    # Each big prefill's call by its key (a key with a missing part names no call; of calls
    # with one key, the last).
    causes = calls_of(ds, KEY).assign(cause=cause).dropna(subset=KEY).drop_duplicates(KEY, keep="last")
    del cause
    tv = task_view(ds, ["task_id", "purpose", "prompt_tokens_new", "prompt_eval_ms"] + KEY)
    big = tv.loc[(tv["prompt_tokens_new"] >= opts.big_prefill_tokens).fillna(False).to_numpy()]
    del tv
    big = big.merge(causes, on=KEY, how="left")
    big["cause"] = big["cause"].astype("string").fillna(UNLOGGED)
    big["purpose"] = as_text(big["purpose"]).fillna(UNLOGGED)
    label = f">= {opts.big_prefill_tokens:,} new tokens"
    big["all"] = label
    big["seconds"] = big["prompt_eval_ms"] / 1000

    # Every cause gets its row, zero or not: "none after a summary" is a finding too.
    rows = {"all": [label], "cause": CAUSES + ([UNLOGGED] if (big["cause"] == UNLOGGED).any() else [])}
    parts = []
    for by in ("all", "purpose", "cause"):
        g = aggregate(big.groupby(by, sort=False),
                      count=("task_id", "size"), new_tokens_total=("prompt_tokens_new", "sum"), seconds_total=("seconds", "sum"))
        g = g.reindex(rows[by]) if by in rows else g.sort_values("count", ascending=False, kind="stable")
        parts.append(g.rename_axis("value").reset_index().assign(by=by))
    table = pd.concat(parts, ignore_index=True)
    table["count"] = table["count"].fillna(0).astype("int64")
    table["new_tokens_total"] = table["new_tokens_total"].fillna(0).astype("int64")
    table["seconds_total"] = table["seconds_total"].astype("float64").fillna(0.0).round(3)
    table["few_samples"] = table["count"] < opts.min_samples
    table["note"] = ""
    if no_sessions:
        table.loc[table["value"] == "first_of_session", "note"] = "the app log names no sessions"
    return table[COLUMNS]
