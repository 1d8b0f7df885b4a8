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
from ..dataset import Dataset, calls_of, release_memory, task_view
from . import Options, register
from .cache import SUMMARY, shared_pairs, slim_calls, turn_pairs
from .turns import fill_missing, needs_app_log, text_codes

CAUSES = ["first_of_day", "first_of_session", "summary", "after_summary", "cache_miss", "other"]
UNLOGGED = "(unlogged)"
COLUMNS = ["by", "value", "count", "new_tokens_total", "seconds_total", "few_samples", "note"]


def _call_key(df: pd.DataFrame) -> pd.Index:
    """Which app call a row is: its file and line (ids may repeat across app logs)."""
    return pd.MultiIndex.from_arrays([df["call_file"].astype("string"), df["call_line"].astype("Int64")])


_KEY = ["call_file", "call_line"]


def _rows_in(calls: pd.DataFrame, rows: pd.DataFrame) -> np.ndarray:
    """For each row of ``rows``, the position in ``calls`` of the call with its file and line
    (-1: none; of calls with one key, the last). Integer codes, not an index of (text, number)
    tuples per call."""
    keys = _packed_keys(calls, rows)
    if keys is None:
        ccode, rcode = tl.key_codes([calls[_KEY], rows[_KEY]], _KEY)
        found = tl.by_code(ccode, np.arange(len(ccode), dtype=np.int64), rcode, -1)
    else:  # (a sorted search: at 1 GB of log the key codes' factorizing took ~38 MB more)
        ccode, rcode = keys
        order = np.argsort(ccode, kind="stable")
        ccode = ccode[order]
        at = np.maximum(np.searchsorted(ccode, rcode, side="right") - 1, 0)  # (the last of equal keys)
        found = np.where((ccode[at] == rcode) if len(ccode) else False, order[at] if len(ccode) else -1, -1)
    # a key with a missing part names no call (as a lookup by (file, line) finds none)
    return np.where(rows["call_file"].isna().to_numpy() | rows["call_line"].isna().to_numpy(), -1, found)


def _packed_keys(calls: pd.DataFrame, rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """(file, line) as one int64 per row of each (file: its place among both columns' text
    categories; a missing part: a number of its own), or None when the columns are not text
    categories and integer lines, or the numbers would not fit."""
    files, lines = [f["call_file"] for f in (calls, rows)], [f["call_line"] for f in (calls, rows)]
    if not all(isinstance(f.dtype, pd.CategoricalDtype) and pd.api.types.is_string_dtype(f.cat.categories) for f in files):
        return None
    if not all(getattr(c.dtype, "kind", "") in "iu" for c in lines):
        return None
    cats = [f.cat.categories.to_numpy(dtype=object) for f in files]
    union = pd.factorize(np.concatenate(cats))[0]
    file_codes = [np.append(union[:len(cats[0])], -1), np.append(union[len(cats[0]):], -1)]  # (-1: missing)
    file = [fc[f.cat.codes.to_numpy()] for fc, f in zip(file_codes, files)]
    line = [c.to_numpy(dtype=np.int64, na_value=0) for c in lines]
    if any(bool(v.min(initial=0) < 0) for v in line):
        return None  # (no line is negative; were one, not packed)
    top = max([int(v.max(initial=0)) for v in line]) + 1  # (a missing line: this one, equal to no other)
    if (top + 1) * (int(union.max(initial=0)) + 2) >= 1 << 62:
        return None
    line = [np.where(c.isna().to_numpy(), top, v) for c, v in zip(lines, line)]
    return file[0] * (top + 1) + line[0], file[1] * (top + 1) + line[1]


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
    return np.where(codes < 0, len(texts), rank[np.maximum(codes, 0)] if len(texts) else 0).astype(np.int32)


def _is(col: pd.Series, text: str) -> np.ndarray:
    """Whether each value is ``text`` (missing: no)."""
    return col.eq(text).to_numpy(dtype=bool, na_value=False)


def _sorted_causes(calls: pd.DataFrame, opts: Options, pairs: pd.DataFrame | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The cause of each app call's prompt, calls by user and start: (their positions in
    ``calls``, their causes). On integer codes per call (users as text took 40 MB at 1 GB),
    each array dropped once read (at 1 GB of log held to the end they were prefills' peak)."""
    user = _text_rank(calls["user"])
    start = calls["start_at"]
    at_us = start.dt.tz_convert("UTC") if start.dt.tz is not None else start
    us = at_us.astype("datetime64[us, UTC]" if start.dt.tz is not None else "datetime64[us]").astype("int64").to_numpy()
    nat = start.isna().to_numpy()
    # By user, then start (stable; missing users and times last), as sort_values orders them.
    order = np.lexsort((np.where(nat, np.iinfo(np.int64).max, us), nat, user))
    u = user[order]
    del user
    new_user = np.r_[True, u[1:] != u[:-1]] if len(u) else np.zeros(0, dtype=bool)
    # The calendar day (UTC): its number; the user's first call of a day starts a run of them.
    day = us // 86_400_000_000
    del us
    day[nat] = np.iinfo(np.int64).min
    day = day[order]
    first_of_day = new_user | np.r_[True, day[1:] != day[:-1]] if len(u) else new_user
    del day
    if "app_session" in calls:
        sess = pd.factorize(calls["app_session"], use_na_sentinel=True)[0][order]
        pair = u.astype(np.int64) * (int(sess.max(initial=0)) + 2) + (sess + 1)
        first_of_session = np.zeros(len(u), dtype=bool)
        n_pairs = int(pair.max(initial=-1)) + 1
        if n_pairs <= len(pair):  # (few users and sessions: each pair's first place in a table of them)
            first = np.full(n_pairs, len(pair), dtype=np.int64)
            np.minimum.at(first, pair, np.arange(len(pair)))
            first_of_session[first[first < len(pair)]] = True
            del first
        else:  # (np.unique's sort of every call's pair: at 1 GB of log 14.6 MB, the most of the table's heap at its peak)
            first_of_session[np.unique(pair, return_index=True)[1]] = True
        del pair
        first_of_session &= sess >= 0
        del sess
    else:
        first_of_session = np.zeros(len(u), dtype=bool)
    del u
    summary = _is(calls["purpose"], SUMMARY)[order]
    after_summary = np.r_[False, summary[:-1]] & ~new_user if len(summary) else new_user
    pairs = turn_pairs(slim_calls(calls), opts) if pairs is None else pairs
    missed = np.zeros(len(calls), dtype=bool)
    hit = _rows_in(calls, pairs.loc[pairs["miss"].to_numpy(), _KEY])
    missed[hit[hit >= 0]] = True
    # Each cause as its place in CAUSES (one byte a call, not a text): the first that holds,
    # as np.select picks it (set last to first: the first one set last).
    cause = np.full(len(order), len(CAUSES) - 1, dtype=np.int8)
    for k, holds in reversed(list(enumerate([first_of_day, first_of_session, summary, after_summary, missed[order]]))):
        cause[holds] = k
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
    # The turn pairs first (shared with the cache tables), then the task view's columns, of the
    # big prefills alone, and the calls' columns read here: the pairs' making does not stack
    # on them, nor the view's columns whole on each other.
    core = shared_pairs(ds, opts)
    release_memory()  # (what the pairs' making dropped: at 1 GB of log ~80 MB of heap)
    new = task_view(ds, ["prompt_tokens_new"])["prompt_tokens_new"]
    is_big = (new >= opts.big_prefill_tokens).fillna(False).to_numpy()
    big = pd.DataFrame({c: task_view(ds, [c])[c][is_big] for c in ["purpose", "prompt_tokens_new", "prompt_eval_ms"] + _KEY})
    del new, is_big
    calls = calls_of(ds, ["user", "start_at", "app_session", "purpose"] + _KEY)
    no_sessions = "app_session" not in calls or bool(calls["app_session"].isna().all())
    release_memory()  # (the columns read whole to take the big prefills' rows)
    # The turn pairs' misses, by their calls' rows (the pairs hold positions in the calls).
    missed = calls[_KEY].iloc[core["pos"].to_numpy()[core["miss"].to_numpy()]].assign(miss=True)
    del core
    order, cause = _sorted_causes(calls, opts, missed)
    del missed
    by_row = np.empty(len(calls), dtype=np.int8)
    by_row[order] = cause
    del order, cause
    at = _rows_in(calls, big)
    del calls

    # Each big prefill's group in each view as an integer code, its label kept once: the
    # groups are summed as on the labels (in row order, groups first seen first), without a
    # text per prefill and view (at 1 GB of log 116k prefills: the labels were the peak).
    label = f">= {opts.big_prefill_tokens:,} new tokens"
    unlogged = len(CAUSES)
    cause_code = np.where(at >= 0, by_row[np.maximum(at, 0)], unlogged).astype(np.int64)
    del at, by_row
    purpose_code, purposes = fill_missing(*text_codes(big.pop("purpose")), UNLOGGED)
    codes = {"all": np.zeros(len(big), dtype=np.int64), "purpose": purpose_code, "cause": cause_code}
    labels = {"all": pd.Index([label]), "purpose": pd.Index(purposes.array), "cause": pd.Index(CAUSES + [UNLOGGED])}
    sums = pd.DataFrame({"prompt_tokens_new": big["prompt_tokens_new"], "seconds": big["prompt_eval_ms"] / 1000})
    del big

    # Every cause gets its row, zero or not: "none after a summary" is a finding too.
    rows = {"all": [label], "cause": CAUSES + ([UNLOGGED] if (cause_code == unlogged).any() else [])}
    parts = []
    for by in ("all", "purpose", "cause"):
        g = sums.groupby(codes[by], sort=False).agg(
            count=("prompt_tokens_new", "size"), new_tokens_total=("prompt_tokens_new", "sum"), seconds_total=("seconds", "sum"))
        g.index = labels[by][g.index.to_numpy()]
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
