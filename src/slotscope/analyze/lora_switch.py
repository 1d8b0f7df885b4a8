"""What a LoRA change costs a short prefill: right after a switch vs after the same setting.

A task *follows a switch* when the task launched before it on the same server session had a
different LoRA label (``none`` = no LoRA); it *follows the same setting* when that task had the
same label. Only short prompts count (fewer than :data:`SHORT_PROMPT_TOKENS` new tokens), so
that the prefill is small next to a switch. Tasks whose own or previous label is unknown (no
app log line, or the first task of a session) are left out.

``prompt eval time`` of a task on a busy server is mostly other slots' work in the same passes,
so beside all such tasks the table gives the ones whose prefill ran with no other task holding a
slot (``alone_*``): the field report's measurement ("while the production model was idle").
"""

from __future__ import annotations

import pandas as pd

import numpy as np

from .. import store, timeline as tl
from ..dataset import Dataset, release_memory, task_view, tasks_of
from . import Options, register
from .context import SESSION
from .turns import needs_app_log, text_codes

SHORT_PROMPT_TOKENS = 1_000
COLUMNS = [
    "setting", "change", "lora", "count", "prefill_median_ms", "alone_count", "alone_prefill_median_ms",
    "few_samples",
]


TASK_ROWS = 1 << 16  # tasks read at a time (see _holding_during)


def _holding_during(ds: Dataset, sessions: pd.DataFrame, session: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For each window [``start``, ``end``] of server session ``session`` (a row of ``sessions``,
    its keys; -1: none), how many tasks of that session held a slot during it: what
    :class:`.context.TasksDuring` counts, the task table read :data:`TASK_ROWS` tasks at a time
    (every task's session and times, sorted per session at once, were the table's peak at 1 GB
    of log: +47/+49 MB). The tasks begun before a window ends and those ended before it starts
    are sums over parts of the tasks: each part's counts add up to them."""
    out = np.zeros(len(session), dtype=np.int64)
    rows_of = tl.rows_by_group(session, session >= 0)  # (the windows of each session)
    if not rows_of:
        return out
    stored = store.stored(ds.server, "tasks")
    n = len(stored) if stored is not None else 0
    parts = ((stored.take(np.arange(lo, min(lo + TASK_ROWS, n)), SESSION + ["launch_s", "release_s"])
              for lo in range(0, n, TASK_ROWS)) if stored is not None
             else [tasks_of(ds, SESSION + ["launch_s", "release_s"])])
    for part in parts:
        ok = part[SESSION].notna().all(axis=1).to_numpy() & part["launch_s"].notna().to_numpy()
        since = part["launch_s"].to_numpy(dtype=float, na_value=np.nan)
        until = part["release_s"].to_numpy(dtype=float, na_value=np.inf)
        known, pcode = tl.key_codes([sessions, part], SESSION)
        for code, tasks in tl.rows_by_group(pcode, ok).items():
            j = np.flatnonzero(known == code)
            if not len(j) or int(j[0]) not in rows_of:
                continue
            rows = rows_of[int(j[0])]
            # Begun before the window ends, minus ended before it starts.
            out[rows] += (np.searchsorted(np.sort(since[tasks]), end[rows], side="left")
                          - np.searchsorted(np.sort(until[tasks]), start[rows], side="right"))
    return out


@register("lora-switch")
def lora_switch(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Median prefill time of short prompts right after a LoRA change and after the same setting, by target setting."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    # On integer codes, a column of the task view read at a time: each task's session, its
    # place in the session's launch order, its LoRA label's code. (The ten columns sorted
    # whole, the labels as text and a groupby shift on them took +156 MB at 1 GB of log.)
    def column(name: str) -> pd.Series:
        return task_view(ds, [name])[name]

    short = ((column("prompt_tokens_new") < SHORT_PROMPT_TOKENS).fillna(False) & column("prompt_eval_ms").notna()).to_numpy()
    keys = task_view(ds, SESSION)
    session = tl.narrow(tl.key_codes([keys], SESSION)[0])
    no_session = keys.isna().any(axis=1).to_numpy()  # (no session: no previous task, as a groupby drops it)
    sessions = keys.iloc[np.unique(session, return_index=True)[1]].reset_index(drop=True)  # (one row a code, in code order)
    del keys
    task_id = column("task_id")
    # (ids as codes that sort as they do, gaps last, where a gap makes them not numbers)
    task = task_id.to_numpy(dtype=np.int64) if not task_id.isna().any() else tl.key_codes([task_id.to_frame()], ["task_id"])[0]
    order = np.lexsort((task, column("launch_s").to_numpy(dtype=float, na_value=np.nan), session))  # (NaN last, as sort_values)
    del task_id, task
    lora, texts = text_codes(column("lora"))
    lora, same = lora[order], session[order]
    first = np.r_[True, same[1:] != same[:-1]] if len(same) else np.zeros(0, dtype=bool)
    prev = np.where(first | no_session[order], -1, np.r_[-1, lora[:-1]] if len(lora) else lora)
    del same, first
    known = short[order] & (lora >= 0) & (prev >= 0)
    rows, lora, prev = order[known], lora[known], prev[known]  # (the short tasks with both labels, in launch order)
    del order, short, known
    at_session = np.where(no_session[rows], -1, session[rows])
    del session, no_session
    release_memory()  # (the columns read whole)

    # Their prefills' company, their times, and their group: (change, label), as sorted text.
    others = _holding_during(ds, sessions, at_session, *(column(c).to_numpy(dtype=float, na_value=np.nan)[rows]
                                                         for c in ("prefill_start_s", "first_token_s"))) - 1
    del at_session
    ms = column("prompt_eval_ms").to_numpy(dtype=float, na_value=np.nan)[rows]
    rank = np.argsort(np.argsort(np.asarray(texts.astype(object), dtype=object), kind="stable"), kind="stable")
    group = (lora != prev).astype(np.int64) * (len(texts) + 1) + rank[lora]  # ("same" before "to", labels as text)
    # Per group (a few), its count and median, as a groupby gives them, on arrays (the
    # groupby of the 273k windows at 1 GB of log was the table's peak).
    codes = np.unique(group)
    stats = []
    for k in codes:
        v = ms[group == k]
        alone = v[others[group == k] <= 0]
        stats.append((int((~np.isnan(v)).sum()), tl.median(v), int((~np.isnan(alone)).sum()), tl.median(alone)))
    table = pd.DataFrame(stats, columns=["count", "prefill_median_ms", "alone_count", "alone_prefill_median_ms"], index=codes)
    table[["prefill_median_ms", "alone_prefill_median_ms"]] = table[["prefill_median_ms", "alone_prefill_median_ms"]].astype("float64")
    code = table.index.to_numpy()
    label = np.argsort(rank)[code % (len(texts) + 1)] if len(code) else code
    table.insert(0, "change", pd.Series(code >= len(texts) + 1).map({True: "to", False: "same"}).array)
    table.insert(1, "lora", texts.iloc[label].array)
    table = table.reset_index(drop=True)
    # Switches first, then the same-setting baselines.
    table = table.sort_values(["change", "lora"], ascending=[False, True], kind="stable").reset_index(drop=True)
    table["setting"] = table["change"] + " " + table["lora"]
    table[["count", "alone_count"]] = table[["count", "alone_count"]].astype("int64")
    table[["prefill_median_ms", "alone_prefill_median_ms"]] = table[["prefill_median_ms", "alone_prefill_median_ms"]].round(1)
    table["few_samples"] = table["count"] < opts.min_samples
    return table[COLUMNS]
