"""How long calls took, per purpose: call duration and time to first token.

This is the field report's first table ("Regular turns / cache rate 95%+ / 5,000+ uncached
tokens"), plus one row per purpose. Time to first token (``ttft``) runs from the call's start
to the task's first token: it includes the queue and the wait before prefill, which
``prompt eval time`` hides.

*Chat turns* are the calls whose purpose is ``chat`` or starts with ``chat_`` (``chat_first_of_day``,
``chat_after_summary``, ...): the user-facing turns of a conversation, whatever the app calls
its special cases. The report's 5,000+-uncached subset is made of exactly those special turns,
so they belong in the set. The two subsets are taken from all chat turns, each on its own:
cache rate (``prompt_tokens_cached / prompt_tokens``) at or above ``opts.cache_rate``, and at
least ``opts.uncached_tokens`` new tokens.

Only calls that succeeded and were matched to a server task are measured; the others are
counted in ``left out`` rows with the reason.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, calls_of, release_memory
from . import Options, register

CHAT = "chat"
NEEDS_APP_LOG = "needs an app log (purpose/user/LoRA)"
COLUMNS = [
    "by", "group", "count", "total_median_s", "total_p95_s", "total_max_s",
    "ttft_count", "ttft_median_s", "ttft_p95_s", "ttft_max_s", "few_samples", "note",
]


def is_chat_turn(purpose: pd.Series) -> pd.Series:
    """Whether each purpose names a chat turn: ``chat`` itself or ``chat_<anything>``.

    A category column is told by its categories: each call's text made was the turns table's
    peak at 1 GB of log."""
    if isinstance(purpose.dtype, pd.CategoricalDtype):
        per_text = is_chat_turn(pd.Series(purpose.cat.categories)).to_numpy()
        return pd.Series(np.append(per_text, False)[purpose.cat.codes.to_numpy()], index=purpose.index)  # (-1: none)
    p = purpose.astype("string")
    return ((p == CHAT) | p.str.startswith(CHAT + "_")).fillna(False).astype(bool)


def text_codes(col: pd.Series) -> tuple[np.ndarray, pd.Series]:
    """Each value as the place of its text (``astype("string")``) among the column's distinct
    texts (int32, -1: missing), and those texts in the order of their first category (of a
    category column) or first row. A category column's codes are reused: no text per row."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        codes, values = col.cat.codes.to_numpy(), pd.Series(col.cat.categories)
    else:
        codes, uniq = pd.factorize(col, use_na_sentinel=True)
        values = pd.Series(uniq)
    # Two values may read as one text (the categories 1 and "1"): one code for both.
    merged, texts = pd.factorize(values.astype("string"), use_na_sentinel=True)
    lookup = np.append(merged, -1).astype(np.int32)  # (code -1, missing: the last)
    return lookup[codes], pd.Series(texts, dtype="string")


NO_PURPOSE = "(no purpose)"


def fill_missing(codes: np.ndarray, texts: pd.Series, name: str) -> tuple[np.ndarray, pd.Series]:
    """:func:`text_codes` with the missing values named ``name`` (as ``fillna`` names them:
    one code with a value of that text, if there is one)."""
    if not (codes < 0).any():
        return codes, texts
    at = np.flatnonzero((texts == name).to_numpy(dtype=bool, na_value=False))
    if not len(at):
        at, texts = np.array([len(texts)]), pd.concat([texts, pd.Series([name], dtype=texts.dtype)], ignore_index=True)
    return np.where(codes < 0, int(at[0]), codes), texts


def _by_count(codes: np.ndarray, texts: pd.Series) -> list[tuple[int, str]]:
    """The codes present (none missing), with their texts, most common first, as
    ``value_counts`` of the texts orders them: first seen first, then sorted by count with that
    dtype's own sort (so ties fall as they did on the per-call texts), without those texts."""
    seen, first = np.unique(codes, return_index=True)
    seen = seen[np.argsort(first, kind="stable")]
    counts = np.bincount(codes, minlength=len(texts))[seen]
    dtype = texts.iloc[:0].value_counts().dtype  # (int64, Int64 or an Arrow integer: each sorts its own way)
    by = pd.Series(pd.array(counts, dtype=dtype), index=seen).sort_values(ascending=False)
    return [(int(k), texts.iloc[k]) for k in by.index]


def _left_out(left: pd.DataFrame) -> pd.DataFrame:
    """The ``left out`` rows of the calls not measured (``ok`` and ``match_method`` of each)."""
    failed = ~left["ok"].fillna(False).astype(bool).to_numpy()
    method = left["match_method"].astype("string").fillna("unmatched").to_numpy()
    rows = pd.DataFrame({
        "group": np.where(failed, "call failed", "no server task matched"),
        "note": np.where(failed, "not in the times above: the app log marks the call failed",
                         np.char.add("not in the times above: ", method.astype(str))),
    }).groupby(["group", "note"], sort=True, observed=True).size().rename("count").reset_index()
    return rows.assign(by="left out", ttft_count=0, few_samples=False)


def needs_app_log(columns: Sequence[str]) -> pd.DataFrame:
    """The table an app-log analyzer returns without an app log: one row, only the note."""
    row = pd.DataFrame({c: pd.Series([pd.NA], dtype="object") for c in columns})
    row["note"] = NEEDS_APP_LOG
    return row


def measured_calls(calls: pd.DataFrame) -> pd.Series:
    """Calls that succeeded and were matched to a server task (the ones with times to report)."""
    return calls["ok"].fillna(False).astype(bool) & calls["task_id"].notna()


def _stats(subsets: Iterable[tuple[str, str, np.ndarray, np.ndarray]], min_samples: int) -> pd.DataFrame:
    """One row per ``(by, group, total_s, ttft_s)`` subset, in their order: counts and median,
    p95 and max of each (empty subsets still get their row, count 0, so "none" is visible).
    On each subset's arrays, as a groupby of them stacked gives them (timeline.median,
    .quantile), without the stacked table (~150 MB at 1 GB of log)."""
    def stats(v: np.ndarray) -> tuple[int, float, float, float]:
        x = v[~np.isnan(v)]
        return len(x), tl.median(x), tl.quantile(x, 0.95), float(x.max()) if len(x) else np.nan

    rows = []
    for by, group, total, ttft in subsets:
        n, med, p95, top = stats(total)
        tn, tmed, tp95, ttop = stats(ttft)
        rows.append((by, group, n, med, p95, top, tn, tmed, tp95, ttop))
    out = pd.DataFrame(rows, columns=COLUMNS[:-2])
    out[["count", "ttft_count"]] = out[["count", "ttft_count"]].astype("int64")
    stat_cols = [c for c in out.columns if c.endswith("_s")]
    out[stat_cols] = out[stat_cols].astype("float64").round(3)
    out["few_samples"] = out["count"] < min_samples
    out["note"] = ""
    return out


@register("turns")
def turns(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Count, median, p95 and max of call duration and time to first token, per purpose and for chat turns."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    # A column at a time, cut to the measured calls at once (the calls table has ~40; after
    # Dataset.keep_on_disk only the column asked for is read): at 1 GB of log the eight columns
    # whole, their cut copies and the purposes as text took +146 MB.
    ok = measured_calls(calls_of(ds, ["ok", "task_id"])).to_numpy()
    left_out = _left_out(calls_of(ds, ["ok", "match_method"]).loc[~ok]) if not ok.all() else None

    def used(name: str) -> pd.Series:
        return calls_of(ds, [name])[name][ok]

    total = used("total_ms").to_numpy(dtype="float64", na_value=np.nan) / 1000
    ttft = used("ttft_ms").to_numpy(dtype="float64", na_value=np.nan) / 1000
    purpose = used("purpose")
    # Each purpose's text by its code ("(no purpose)" for none, as fillna would name it).
    codes, texts = text_codes(purpose)
    codes, texts = fill_missing(codes, texts, NO_PURPOSE)
    chat = is_chat_turn(purpose).to_numpy()
    del purpose
    cached = used("prompt_tokens_cached").astype("float64").to_numpy(na_value=np.nan)
    new = used("prompt_tokens_new").astype("float64").to_numpy(na_value=np.nan)
    prompt = cached + new
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = cached / np.where(prompt > 0, prompt, np.nan)
    del cached, prompt
    release_memory()  # (the columns read whole to cut them)

    def subsets() -> Iterator[tuple[str, str, np.ndarray, np.ndarray]]:
        """Each subset's times, taken as its statistics are made (not every subset's at once)."""
        for k, p in _by_count(codes, texts):
            m = codes == k
            yield "purpose", p, total[m], ttft[m]
        for label, m in (("all", chat), (f"cache rate >= {opts.cache_rate:.0%}", chat & (rate >= opts.cache_rate)),
                         (f">= {opts.uncached_tokens:,} new tokens", chat & (new >= opts.uncached_tokens))):
            yield "chat turns", label, total[m], ttft[m]

    table = _stats(subsets(), opts.min_samples)
    table.loc[(table["by"] == "chat turns") & (table["group"] == "all"), "note"] = "purposes chat and chat_*"
    if left_out is not None:
        table = pd.concat([table, left_out], ignore_index=True)
    return table[COLUMNS]
