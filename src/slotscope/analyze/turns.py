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

from typing import Sequence

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, calls_of
from . import Options, register

CHAT = "chat"
NEEDS_APP_LOG = "needs an app log (purpose/user/LoRA)"
COLUMNS = [
    "by", "group", "count", "total_median_s", "total_p95_s", "total_max_s",
    "ttft_count", "ttft_median_s", "ttft_p95_s", "ttft_max_s", "few_samples", "note",
]


def is_chat_turn(purpose: pd.Series) -> pd.Series:
    """Whether each purpose names a chat turn: ``chat`` itself or ``chat_<anything>``."""
    p = purpose.astype("string")
    return ((p == CHAT) | p.str.startswith(CHAT + "_")).fillna(False).astype(bool)


def needs_app_log(columns: Sequence[str]) -> pd.DataFrame:
    """The table an app-log analyzer returns without an app log: one row, only the note."""
    row = pd.DataFrame({c: pd.Series([pd.NA], dtype="object") for c in columns})
    row["note"] = NEEDS_APP_LOG
    return row


def measured_calls(calls: pd.DataFrame) -> pd.Series:
    """Calls that succeeded and were matched to a server task (the ones with times to report)."""
    return calls["ok"].fillna(False).astype(bool) & calls["task_id"].notna()


def _stats(subsets: list[tuple[str, str, np.ndarray, np.ndarray]], min_samples: int) -> pd.DataFrame:
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
    # Only the columns read here (the calls table has ~40; after Dataset.keep_on_disk only they are read).
    calls = calls_of(ds, ["ok", "task_id", "purpose", "total_ms", "ttft_ms", "prompt_tokens_cached",
                          "prompt_tokens_new", "match_method"])
    ok = measured_calls(calls)
    # Only the columns read here, of the measured calls (the calls table has ~40).
    used = calls.loc[ok, ["purpose", "total_ms", "ttft_ms", "prompt_tokens_cached", "prompt_tokens_new"]]
    total = used["total_ms"].to_numpy(dtype="float64", na_value=np.nan) / 1000
    ttft = used["ttft_ms"].to_numpy(dtype="float64", na_value=np.nan) / 1000
    purpose = used["purpose"].astype("string").fillna("(no purpose)")
    subsets = [("purpose", p, total[m], ttft[m]) for p in purpose.value_counts(sort=True).index
               for m in [(purpose == p).to_numpy(dtype=bool)]]

    chat = is_chat_turn(used["purpose"]).to_numpy()
    cached = used["prompt_tokens_cached"].astype("float64").to_numpy(na_value=np.nan)
    prompt = cached + used["prompt_tokens_new"].astype("float64").to_numpy(na_value=np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = cached / np.where(prompt > 0, prompt, np.nan)
    new = used["prompt_tokens_new"].astype("float64").to_numpy(na_value=np.nan)
    for label, m in (("all", chat), (f"cache rate >= {opts.cache_rate:.0%}", chat & (rate >= opts.cache_rate)),
                     (f">= {opts.uncached_tokens:,} new tokens", chat & (new >= opts.uncached_tokens))):
        subsets.append(("chat turns", label, total[m], ttft[m]))
    del used, total, ttft, purpose
    table = _stats(subsets, opts.min_samples)
    table.loc[(table["by"] == "chat turns") & (table["group"] == "all"), "note"] = "purposes chat and chat_*"

    left = calls.loc[~ok]
    if len(left):
        failed = ~left["ok"].fillna(False).astype(bool).to_numpy()
        method = left["match_method"].astype("string").fillna("unmatched").to_numpy()
        rows = pd.DataFrame({
            "group": np.where(failed, "call failed", "no server task matched"),
            "note": np.where(failed, "not in the times above: the app log marks the call failed",
                             np.char.add("not in the times above: ", method.astype(str))),
        }).groupby(["group", "note"], sort=True, observed=True).size().rename("count").reset_index()
        rows = rows.assign(by="left out", ttft_count=0, few_samples=False)
        table = pd.concat([table, rows], ignore_index=True)
    return table[COLUMNS]
