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
counted in ``left out`` rows with the reason. Of an app log given alone (no server log), the
calls that succeeded are measured by the app's own times: their duration, and no time to
first token or prompt-cache subset (those come from the server's tasks).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, calls_of
from .questions import Options, has_server_log, register

CHAT = "chat"
NEEDS_APP_LOG = "needs an app log (purpose/user/LoRA)"
APP_TIMES = "call duration from the app log alone; the server log adds time to first token"
NEEDS_SERVER_LOG = "needs the server log (each task's cached and new prompt tokens)"
NO_PURPOSE = "(no purpose)"
COLUMNS = [
    "by", "group", "count", "total_median_s", "total_p95_s", "total_max_s",
    "ttft_count", "ttft_median_s", "ttft_p95_s", "ttft_max_s", "few_samples", "note",
]
# What the table reads of the calls table.
CALL_COLUMNS = ["ok", "task_id", "total_ms", "ttft_ms", "purpose", "prompt_tokens_cached", "prompt_tokens_new", "match_method"]


def as_text(col: pd.Series) -> pd.Series:
    """The column as ``astype("string")`` gives it; of a category column, its categories' texts
    taken by the codes (not a Python string per row made text again)."""
    if not isinstance(col.dtype, pd.CategoricalDtype):
        return col.astype("string")
    texts = pd.array(col.cat.categories.astype("string"), dtype="string")
    return pd.Series(texts.take(col.cat.codes.to_numpy(), allow_fill=True), index=col.index, name=col.name)


def text_codes(col: pd.Series) -> np.ndarray:
    """Each row's place among the column's texts (float, NaN for a gap): rows of equal text
    share it, and it sorts as the texts do. Of a category column, from its categories' texts
    (not a Python string per row)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        ranks = pd.factorize(col.cat.categories.astype("string"), sort=True)[0].astype("float64")
        codes = col.cat.codes.to_numpy()
        return np.where(codes >= 0, ranks[np.maximum(codes, 0)] if len(ranks) else np.nan, np.nan)
    codes = pd.factorize(col.astype("string"), sort=True)[0].astype("float64")
    return np.where(codes >= 0, codes, np.nan)


def is_text(col: pd.Series, text: str) -> np.ndarray:
    """Whether each row's text is ``text`` (False for a gap); of a category column, from its
    categories."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        hit = np.asarray(col.cat.categories.astype("string") == text, dtype=bool)
        codes = col.cat.codes.to_numpy()
        return np.where(codes >= 0, hit[np.maximum(codes, 0)] if len(hit) else False, False)
    return (col.astype("string") == text).fillna(False).to_numpy(dtype=bool)


def is_chat_turn(purpose: pd.Series) -> pd.Series:
    """Whether each purpose names a chat turn: ``chat`` itself or ``chat_<anything>``."""
    p = as_text(purpose)
    return ((p == CHAT) | p.str.startswith(CHAT + "_")).fillna(False).astype(bool)


def needs_app_log(columns: Sequence[str]) -> pd.DataFrame:
    """The table an app-log analyzer returns without an app log: one row, only the note."""
    row = pd.DataFrame({c: pd.Series([pd.NA], dtype="object") for c in columns})
    row["note"] = NEEDS_APP_LOG
    return row


def measured_calls(calls: pd.DataFrame) -> pd.Series:
    """Calls that succeeded and were matched to a server task (the ones with times to report)."""
    return calls["ok"].fillna(False).astype(bool) & calls["task_id"].notna()


def _stats(by: str, group: str, total: np.ndarray, ttft: np.ndarray) -> tuple:
    """One row of the table: count, median, p95 and max of each kind of time (NaN: none)."""
    row: tuple = (by, group)
    for v in (total, ttft):
        x = v[~np.isnan(v)]
        row += (len(x), tl.median(x), tl.quantile(x, 0.95), float(x.max()) if len(x) else np.nan)
    return row


def _left_out(left: pd.DataFrame) -> pd.DataFrame:
    """The ``left out`` rows: the calls not measured, counted by why."""
    failed = ~left["ok"].fillna(False).astype(bool).to_numpy()
    method = left["match_method"].astype("string").fillna("unmatched").to_numpy()
    rows = pd.DataFrame({
        "group": np.where(failed, "call failed", "no server task matched"),
        "note": np.where(failed, "not in the times above: the app log marks the call failed",
                         np.char.add("not in the times above: ", method.astype(str))),
    }).groupby(["group", "note"], sort=True, observed=True).size().rename("count").reset_index()
    return rows.assign(by="left out", ttft_count=0, few_samples=False)


@register("turns")
def turns(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Count, median, p95 and max of call duration and time to first token, per purpose and for chat turns."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    calls = calls_of(ds, CALL_COLUMNS)
    alone = not has_server_log(ds)
    ok = (calls["ok"].fillna(False).astype(bool) if alone else measured_calls(calls)).to_numpy()
    used = calls.loc[ok]
    total = tl.floats(used["total_ms"]) / 1000
    ttft = tl.floats(used["ttft_ms"]) / 1000
    purpose = as_text(used["purpose"]).fillna(NO_PURPOSE)
    chat = is_chat_turn(used["purpose"]).to_numpy()
    cached = tl.floats(used["prompt_tokens_cached"])
    new = tl.floats(used["prompt_tokens_new"])
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = cached / np.where(cached + new > 0, cached + new, np.nan)
    # Every subset gets its row, empty or not, so "none" is visible.
    subsets = [("purpose", p, (purpose == p).to_numpy(dtype=bool)) for p in purpose.value_counts(sort=True).index]
    subsets += [("chat turns", "all", chat),
                ("chat turns", f"cache rate >= {opts.cache_rate:.0%}", chat & (rate >= opts.cache_rate)),
                ("chat turns", f">= {opts.uncached_tokens:,} new tokens", chat & (new >= opts.uncached_tokens))]
    table = pd.DataFrame([_stats(by, group, total[m], ttft[m]) for by, group, m in subsets], columns=COLUMNS[:-2])
    table[["count", "ttft_count"]] = table[["count", "ttft_count"]].astype("int64")
    times = [c for c in table.columns if c.endswith("_s")]
    table[times] = table[times].astype("float64").round(3)
    table["few_samples"] = table["count"] < opts.min_samples
    table["note"] = APP_TIMES if alone else ""
    table.loc[(table["by"] == "chat turns") & (table["group"] == "all"), "note"] = "purposes chat and chat_*"
    if alone:
        table.loc[(table["by"] == "chat turns") & (table["group"] != "all"), "note"] = NEEDS_SERVER_LOG
    if not ok.all():
        table = pd.concat([table, _left_out(calls.loc[~ok])], ignore_index=True)
    return table[COLUMNS]


# compare's same-conditions classes of a chat turn, by what else ran from its send to its first token.
CONDITIONS = ["nothing_else_running", "overlapping_another_task", "overlapping_prefill_5k_plus"]
SHORT_TOKENS = 1_000  # a "short" turn has fewer new prompt tokens than this


def turn_conditions(t: pd.DataFrame, tv: pd.DataFrame, sessions: pd.DataFrame, big_prefill_tokens: int) -> np.ndarray:
    """The condition (of :data:`CONDITIONS`) each turn met from its send to its first token:
    ``t``, the turns' tasks (keys, ``launch_s``, ``queue_ms``, ``prefill_start_s``,
    ``first_token_s``, ``prompt_tokens_new``); ``tv``, the task view they ran among."""
    keys = tl.GROUP + ["task_id"]
    launch = tl.floats(t["launch_s"])
    span = t[tl.GROUP].assign(start_s=launch - np.nan_to_num(tl.floats(t["queue_ms"]) / 1000),
                              end_s=tl.floats(t["first_token_s"]))
    # What else ran: every task from launch to end, the turn's own left out.
    run = tv[tl.GROUP].assign(start_s=tl.floats(tv["launch_s"]), end_s=tl.task_ends(tv, sessions))
    own_end = t[keys].merge(tv[keys].assign(_e=run["end_s"].to_numpy()), on=keys, how="left")["_e"].to_numpy(dtype="float64")
    others = tl.overlaps(span, run, own_start=launch, own_end=own_end)["max_count"].to_numpy()
    ph = tl.phases(tv)
    big = ph[(ph["phase"] == "prefill") & (tl.floats(ph["prompt_tokens_new"]) >= big_prefill_tokens)]
    own_big = tl.floats(t["prompt_tokens_new"]) >= big_prefill_tokens  # (its own prefill is one of them: left out)
    big_cov = tl.overlaps(span, big, own_start=np.where(own_big, tl.floats(t["prefill_start_s"]), np.nan),
                          own_end=np.where(own_big, tl.floats(t["first_token_s"]), np.nan))["covered_s"].to_numpy()
    return np.select([big_cov > 0, others >= 1], CONDITIONS[:0:-1], CONDITIONS[0])
