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

from ..dataset import Dataset
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


def _stats(frame: pd.DataFrame, order: list[tuple[str, str]], min_samples: int) -> pd.DataFrame:
    g = frame.groupby(["by", "group"], sort=False, observed=True)
    out = pd.DataFrame({
        "count": g["total_s"].count(),
        "total_median_s": g["total_s"].median(),
        "total_p95_s": g["total_s"].quantile(0.95),
        "total_max_s": g["total_s"].max(),
        "ttft_count": g["ttft_s"].count(),
        "ttft_median_s": g["ttft_s"].median(),
        "ttft_p95_s": g["ttft_s"].quantile(0.95),
        "ttft_max_s": g["ttft_s"].max(),
    })
    # Empty subsets still get their row (count 0), so "none" is visible.
    out = out.reindex(pd.MultiIndex.from_tuples(order, names=["by", "group"]))
    out[["count", "ttft_count"]] = out[["count", "ttft_count"]].fillna(0).astype("int64")
    stat_cols = [c for c in out.columns if c.endswith("_s")]
    out[stat_cols] = out[stat_cols].astype("float64").round(3)
    out["few_samples"] = out["count"] < min_samples
    out["note"] = ""
    return out.reset_index()


@register("turns")
def turns(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Count, median, p95 and max of call duration and time to first token, per purpose and for chat turns."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    calls = ds.matches.calls
    ok = measured_calls(calls)
    # Only the columns read here are copied (the calls table has ~40).
    used = calls.loc[ok, ["purpose", "total_ms", "ttft_ms", "prompt_tokens_cached", "prompt_tokens_new"]].copy()
    used["total_s"] = used["total_ms"] / 1000
    used["ttft_s"] = used["ttft_ms"] / 1000
    purpose = used["purpose"].astype("string").fillna("(no purpose)")
    used["by"] = "purpose"
    used["group"] = purpose

    chat = used.loc[is_chat_turn(used["purpose"])].assign(by="chat turns")
    prompt = (chat["prompt_tokens_cached"] + chat["prompt_tokens_new"]).astype("float64")
    rate = chat["prompt_tokens_cached"].astype("float64") / prompt.where(prompt > 0)
    cached_label = f"cache rate >= {opts.cache_rate:.0%}"
    new_label = f">= {opts.uncached_tokens:,} new tokens"
    stacked = pd.concat([
        used,
        chat.assign(group="all"),
        chat.loc[(rate >= opts.cache_rate).fillna(False).to_numpy()].assign(group=cached_label),
        chat.loc[(chat["prompt_tokens_new"] >= opts.uncached_tokens).fillna(False).to_numpy()].assign(group=new_label),
    ], ignore_index=True)
    purposes = purpose.value_counts(sort=True)
    order = [("purpose", p) for p in purposes.index] + [
        ("chat turns", "all"), ("chat turns", cached_label), ("chat turns", new_label)]
    table = _stats(stacked, order, opts.min_samples)
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
