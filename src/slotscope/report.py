"""Findings + tables -> the rendered incident report.

The report is computed once (:func:`slotscope.analyze.run`) and rendered here as text for a
terminal or a pipe; any single table can be exported instead with ``--table NAME``.
"""

from __future__ import annotations

from typing import IO

import pandas as pd
from rich.console import Console
from rich.rule import Rule

from .dataset import Dataset
from .output import rich_table

# One-line explanations printed above each table.
CAPTIONS = {
    "turns": "Time per call by purpose: total and time to first token (includes queue and wait before prefill).",
    "load": "Share of time with 0, 1, 2, ... tasks running.",
    "breakdown": "Where processing time went: own generation and prefill at solo speed, contention, waits, queue.",
    "stalls": "Generation speed of a slot by what the other slots did meanwhile (segments between heartbeats).",
    "stalls-worst": "The slowest generation stretches and the task that caused them.",
    "waits": "Waits of 1 s or more before a prefill started, by what ran meanwhile.",
    "waits-worst": "The longest waits before prefill and the task that held the batch.",
    "prefills": "Long prefills (5,000+ new tokens) by purpose and by cause.",
    "prefill-speed": "Prefill speed by tokens advanced per step; the common step is the effective batch.",
    "context": "Generation speed by context length.",
    "cache": "Prompt-cache misses among consecutive turns of one user.",
    "cache-misses": "The misses.",
    "lora-switch": "Prefill time of short prompts right after a LoRA change vs the same setting.",
    "findings": "What the numbers show.",
}
APP_LOG_ADDS = (
    "No app call log was given: purpose, user, LoRA and queue time are unknown, so `turns`, "
    "`prefills`, `cache`, `lora-switch` and the LoRA classes of `waits` are empty. Add the app's "
    "call log (JSONL/CSV with start time and token counts) to the same folder or command line."
)


def render(ds: Dataset, tables: dict[str, pd.DataFrame], file: IO[str] | None = None, width: int | None = None,
           max_rows: int = 12) -> None:
    """Print the whole report: alignment, findings first, then every table with its caption."""
    console = Console(file=file, width=width, soft_wrap=False, highlight=False)
    src = ", ".join(sorted(set(ds.tasks["source"].astype(str)))) if len(ds.tasks) else "(no server log)"
    console.print(Rule(f"slotscope report: {src}", align="left"))
    console.print(f"{len(ds.tasks):,} server tasks in {len(ds.server.sessions)} session(s)"
                  + (f"; {len(ds.matches.calls):,} app calls, {int(ds.matches.calls['task_id'].notna().sum()):,} matched"
                     if ds.matches is not None else ""), markup=False)
    if ds.matches is not None:
        for r in ds.matches.aligned.itertuples(index=False):
            at = r.server_start_at.isoformat(timespec="seconds") if not pd.isna(r.server_start_at) else "unknown"
            console.print(f"session {r.session}: server clock zero at {at} ({r.method}, {r.support} supporting calls)"
                          + (f"; {r.warning}" if r.warning else ""), markup=False)
    else:
        console.print(APP_LOG_ADDS, markup=False)
    order = ["findings"] + [n for n in tables if n != "findings"]
    for name in order:
        if name not in tables:
            continue
        df = tables[name]
        console.print()
        console.print(Rule(name, align="left"))
        if name in CAPTIONS:
            console.print(CAPTIONS[name], markup=False)
        if name == "findings":
            for text in df.get("finding", pd.Series(dtype=str)):
                console.print(f"- {text}", markup=False)
            continue
        if "note" in df.columns and df.drop(columns=["note"]).dropna(how="all").empty:
            for note in df["note"].dropna().unique():
                console.print(str(note), markup=False)
            continue
        if df.empty:
            console.print("(no rows)", markup=False)
            continue
        console.print(rich_table(_readable(df), max_rows=max_rows))


def _readable(df: pd.DataFrame) -> pd.DataFrame:
    """Drop bookkeeping columns that only make a terminal table wider."""
    drop = [c for c in df.columns if c in ("source", "port", "file", "note") or c.endswith("_line") and c != "line"]
    return df.drop(columns=drop)
