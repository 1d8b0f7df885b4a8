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

from .. import timeline as tl
from ..dataset import Dataset, task_view
from . import Options, register
from .cache import SUMMARY, shared_pairs, slim_calls, turn_pairs
from .turns import needs_app_log

CAUSES = ["first_of_day", "first_of_session", "summary", "after_summary", "cache_miss", "other"]
UNLOGGED = "(unlogged)"
COLUMNS = ["by", "value", "count", "new_tokens_total", "seconds_total", "few_samples", "note"]


def _call_key(df: pd.DataFrame) -> pd.Index:
    """Which app call a row is: its file and line (ids may repeat across app logs)."""
    return pd.MultiIndex.from_arrays([df["call_file"].astype("string"), df["call_line"].astype("Int64")])


_KEY = ["call_file", "call_line"]


def _rows_in(calls: pd.DataFrame, rows: pd.DataFrame) -> np.ndarray:
    """For each row of ``rows``, the position in ``calls`` of the call with its file and line
    (-1: none). Integer codes, not an index of (text, number) tuples per call."""
    ccode, rcode = tl.key_codes([calls[_KEY], rows[_KEY]], _KEY)
    found = tl.by_code(ccode, np.arange(len(ccode), dtype=np.int64), rcode, -1)
    # a key with a missing part names no call (as a lookup by (file, line) finds none)
    return np.where(rows["call_file"].isna().to_numpy() | rows["call_line"].isna().to_numpy(), -1, found)


def _sorted_causes(calls: pd.DataFrame, opts: Options, pairs: pd.DataFrame | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The cause of each app call's prompt, calls by user and start: (their positions in
    ``calls``, their causes)."""
    c = calls[["user", "start_at", "purpose"]].copy()
    c["pos"] = np.arange(len(c))
    c["user"] = c["user"].astype("string")
    c["session"] = calls["app_session"].astype("string") if "app_session" in calls else pd.Series(pd.NA, index=c.index, dtype="string")
    c = c.sort_values(["user", "start_at"], kind="stable")
    # The calendar day (UTC) as a timestamp: the same groups as dates, without a date object per call.
    day = (c["start_at"].dt.tz_convert("UTC") if c["start_at"].dt.tz is not None else c["start_at"]).dt.floor("D")
    first_of_day = c.groupby([c["user"], day], sort=False, dropna=False, observed=True).cumcount() == 0
    first_of_session = c["session"].notna() & (c.groupby([c["user"], c["session"]], sort=False, dropna=False, observed=True).cumcount() == 0)
    prev_purpose = c.groupby("user", sort=False, dropna=False, observed=True)["purpose"].shift(1).astype("string")
    after_summary = (prev_purpose == SUMMARY).fillna(False)
    pairs = turn_pairs(slim_calls(calls), opts) if pairs is None else pairs
    order = c["pos"].to_numpy()
    missed = np.zeros(len(calls), dtype=bool)
    hit = _rows_in(calls, pairs.loc[pairs["miss"].to_numpy(), _KEY])
    missed[hit[hit >= 0]] = True
    summary = (c["purpose"].astype("string") == SUMMARY).fillna(False)
    # Each cause as its place in CAUSES (one byte a call, not a text)
    cause = np.select([first_of_day, first_of_session, summary, after_summary, missed[order]],
                      list(range(len(CAUSES) - 1)), default=len(CAUSES) - 1).astype(np.int8)
    return order, cause


def call_causes(calls: pd.DataFrame, opts: Options, pairs: pd.DataFrame | None = None) -> pd.Series:
    """The cause of each app call's prompt (one of :data:`CAUSES`), indexed by the call's
    (file, line). ``pairs``: :func:`.cache.turn_pairs` of these calls, if already made."""
    order, cause = _sorted_causes(calls, opts, pairs)
    return pd.Series(np.asarray(CAUSES, dtype=object)[cause], index=_call_key(calls.iloc[order]), name="cause")


@register("prefills")
def prefills(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Count, new tokens and prefill seconds of the big prefills, by purpose and by cause."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    tv = task_view(ds)
    # Only the columns read here, of the big prefills (the task view has ~40).
    big = tv.loc[(tv["prompt_tokens_new"] >= opts.big_prefill_tokens).fillna(False).to_numpy(),
                 ["task_id", "purpose", "prompt_tokens_new", "prompt_eval_ms"] + _KEY]
    del tv
    calls = ds.matches.calls
    order, cause = _sorted_causes(calls, opts, shared_pairs(ds, opts))
    by_row = np.empty(len(calls), dtype=np.int8)
    by_row[order] = cause
    del order, cause
    at = _rows_in(calls, big)
    names = np.asarray(CAUSES + [None], dtype=object)  # (-1: no call: the last)
    big["cause"] = pd.array(names[np.where(at >= 0, by_row[np.maximum(at, 0)], -1)], dtype="string").fillna(UNLOGGED)
    big["purpose"] = big["purpose"].astype("string").fillna(UNLOGGED)
    label = f">= {opts.big_prefill_tokens:,} new tokens"
    big["all"] = label
    big["seconds"] = big["prompt_eval_ms"] / 1000

    # Every cause gets its row, zero or not: "none after a summary" is a finding too.
    rows = {"all": [label], "cause": CAUSES + ([UNLOGGED] if (big["cause"] == UNLOGGED).any() else [])}
    parts = []
    for by in ("all", "purpose", "cause"):
        g = big.groupby(by, sort=False, observed=True).agg(
            count=("task_id", "size"), new_tokens_total=("prompt_tokens_new", "sum"), seconds_total=("seconds", "sum"))
        g = g.reindex(rows[by]) if by in rows else g.sort_values("count", ascending=False, kind="stable")
        parts.append(g.rename_axis("value").reset_index().assign(by=by))
    table = pd.concat(parts, ignore_index=True)
    table["count"] = table["count"].fillna(0).astype("int64")
    table["new_tokens_total"] = table["new_tokens_total"].fillna(0).astype("int64")
    table["seconds_total"] = table["seconds_total"].astype("float64").fillna(0.0).round(3)
    table["few_samples"] = table["count"] < opts.min_samples
    table["note"] = ""
    if "app_session" not in ds.matches.calls or ds.matches.calls["app_session"].isna().all():
        table.loc[table["value"] == "first_of_session", "note"] = "the app log names no sessions"
    return table[COLUMNS]
