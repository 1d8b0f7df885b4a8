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
from ..dataset import Dataset, calls_of, task_view
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


def _text_rank(col: pd.Series) -> np.ndarray:
    """Integer codes that sort as the column's values do as text, missing values last (the
    order of ``sort_values`` on the column made text; a category's codes are ranked, not
    each call's text made)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        texts = np.asarray(col.cat.categories.astype(str), dtype=object)
        codes = col.cat.codes.to_numpy()
    else:
        codes, uniq = pd.factorize(col, use_na_sentinel=True)
        texts = np.asarray(pd.Index(uniq).astype(str), dtype=object)
    rank = np.unique(texts, return_inverse=True)[1].reshape(-1) if len(texts) else np.zeros(0, np.int64)
    return np.where(codes < 0, len(texts), rank[np.maximum(codes, 0)] if len(texts) else 0).astype(np.int64)


def _is(col: pd.Series, text: str) -> np.ndarray:
    """Whether each value is ``text`` (missing: no)."""
    return col.eq(text).to_numpy(dtype=bool, na_value=False)


def _sorted_causes(calls: pd.DataFrame, opts: Options, pairs: pd.DataFrame | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The cause of each app call's prompt, calls by user and start: (their positions in
    ``calls``, their causes). On integer codes per call (users as text took 40 MB at 1 GB)."""
    user = _text_rank(calls["user"])
    start = calls["start_at"]
    at_us = start.dt.tz_convert("UTC") if start.dt.tz is not None else start
    us = at_us.astype("datetime64[us, UTC]" if start.dt.tz is not None else "datetime64[us]").astype("int64").to_numpy()
    nat = start.isna().to_numpy()
    # By user, then start (stable; missing users and times last), as sort_values orders them.
    order = np.lexsort((np.where(nat, np.iinfo(np.int64).max, us), nat, user))
    u = user[order]
    new_user = np.r_[True, u[1:] != u[:-1]] if len(u) else np.zeros(0, dtype=bool)
    # The calendar day (UTC): its number; the user's first call of a day starts a run of them.
    day = np.where(nat, np.iinfo(np.int64).min, us // 86_400_000_000)[order]
    first_of_day = new_user | np.r_[True, day[1:] != day[:-1]] if len(u) else new_user
    if "app_session" in calls:
        sess = pd.factorize(calls["app_session"], use_na_sentinel=True)[0][order]
        pair = u * (int(sess.max(initial=0)) + 2) + (sess + 1)
        first_of_session = np.zeros(len(u), dtype=bool)
        first_of_session[np.unique(pair, return_index=True)[1]] = True
        first_of_session &= sess >= 0
    else:
        first_of_session = np.zeros(len(u), dtype=bool)
    summary = _is(calls["purpose"], SUMMARY)[order]
    after_summary = np.r_[False, summary[:-1]] & ~new_user if len(u) else new_user
    pairs = turn_pairs(slim_calls(calls), opts) if pairs is None else pairs
    missed = np.zeros(len(calls), dtype=bool)
    hit = _rows_in(calls, pairs.loc[pairs["miss"].to_numpy(), _KEY])
    missed[hit[hit >= 0]] = True
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
    # Only the columns read here (the task view has ~50, the calls ~40), the task view's of the big prefills.
    tv = task_view(ds, ["task_id", "purpose", "prompt_tokens_new", "prompt_eval_ms"] + _KEY)
    big = tv.loc[(tv["prompt_tokens_new"] >= opts.big_prefill_tokens).fillna(False).to_numpy(),
                 ["task_id", "purpose", "prompt_tokens_new", "prompt_eval_ms"] + _KEY]
    del tv
    calls = calls_of(ds, ["user", "start_at", "app_session", "purpose"] + _KEY)
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
    if "app_session" not in calls or calls["app_session"].isna().all():
        table.loc[table["value"] == "first_of_session", "note"] = "the app log names no sessions"
    return table[COLUMNS]
