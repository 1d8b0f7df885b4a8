"""Findings + tables -> the rendered incident report.

The report is computed once (:func:`slotscope.analyze.run`) and rendered here as text for a
terminal or a pipe; any single table can be exported instead with ``--table NAME``.
"""

from __future__ import annotations

from typing import IO

import pandas as pd
from rich.console import Console
from rich.rule import Rule

from .dataset import Dataset, calls_of, tasks_of
from .match import Matches
from .output import print_table

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
    "ruled-out": "What wasn't the cause: each hypothesis against its figure.",
    "findings": "What the numbers show.",
    "ollama": "Ollama: the parallel setting against the concurrency seen, queue times, model loads, 503s, aborts.",
    "ollama-calls": "Each [GIN] call with its runner task: queue = latency - the task's launch..release (times good to ~1 s).",
    "ollama-findings": "What Ollama's lines show.",
}
# The columns a terminal report shows per table (CSV/JSON exports keep every column).
REPORT_COLUMNS = {
    "turns": ["by", "group", "count", "total_median_s", "total_p95_s", "total_max_s", "ttft_median_s", "ttft_p95_s",
              "ttft_max_s", "few_samples"],
    "load": ["scope", "running", "seconds", "share"],
    "breakdown": ["purpose", "component", "seconds", "share", "tasks", "few_samples"],
    "stalls": ["class", "samples", "median_tg_3s_tps", "p10_tg_3s_tps", "tokens", "seconds", "tok_per_s_pooled", "few_samples"],
    "stalls-worst": ["class", "tok_per_s", "tokens", "seconds", "task_id", "purpose", "user", "line", "cause_task_id",
                     "cause_purpose", "cause_prompt_tokens_new", "cause_line"],
    "waits": ["cause", "count", "total_s", "max_s", "median_s", "few_samples"],
    "waits-worst": ["wait_s", "cause", "task_id", "purpose", "lora", "line", "holder_task_id", "holder_purpose",
                    "holder_lora", "holder_line"],
    "prefills": ["by", "value", "count", "new_tokens_total", "seconds_total", "few_samples"],
    "prefill-speed": ["step_tokens", "steps", "median_tps", "median_step_tokens", "few_samples"],
    "context": ["basis", "context_tokens", "samples", "tasks", "median_tg_3s_tps", "few_samples"],
    "cache": ["user", "consecutive_turns", "misses", "miss_share", "misses_on_other_slot", "few_samples"],
    "cache-misses": ["user", "call_id", "purpose", "slot", "task_id", "prev_call_id", "prev_slot", "gap_s",
                     "prev_left_tokens", "cached_tokens"],
    "lora-switch": ["setting", "count", "prefill_median_ms", "alone_count", "alone_prefill_median_ms", "few_samples"],
}
# Columns whose single value is said once under the table instead of on every row.
FOOTNOTE_COLUMNS = ["note", "basis", "solo_gen_basis", "solo_prefill_basis", "effective_chunk_tokens", "max_running",
                    "n_slots", "solo_gen_tps", "solo_gen_n", "solo_prefill_tps", "solo_prefill_n"]
APP_LOG_ADDS = (
    "No app call log was given: purpose, user, LoRA and queue time are unknown, so `turns`, "
    "`prefills`, `cache`, `lora-switch` and the LoRA classes of `waits` are empty. Add the app's "
    "call log (JSONL/CSV with start time and token counts) to the same folder or command line."
)


def setup_line(sessions: pd.DataFrame) -> str:
    """What the sessions' start-up lines say: the model file(s), the build, slots x context."""
    parts = []
    for col, label in (("model", "model"), ("build", "build")):
        v = sorted(set(sessions[col].dropna().astype(str))) if col in sessions.columns and len(sessions) else []
        if v:
            parts.append(f"{label} {', '.join(v)}")
    if "n_slots" in sessions.columns and len(sessions):
        pairs = sorted({(int(a), int(b)) for a, b in zip(sessions["n_slots"], sessions["n_ctx_slot"]) if pd.notna(a) and pd.notna(b)})
        if pairs:
            parts.append(", ".join(f"{a} slots x {b:,} tokens of context" for a, b in pairs))
    return "server: " + "; ".join(parts) if parts else ""


def clock_lines(ds: Dataset) -> list[str]:
    """What the alignment found: when each session's server started on the app's clock, how."""
    lines = []
    for r in ds.matches.aligned.itertuples(index=False) if ds.matches is not None else ():
        at = r.server_start_at.isoformat(timespec="milliseconds") if not pd.isna(r.server_start_at) else "unknown"
        spread = f", spread {r.spread_ms:.0f} ms" if r.spread_ms == r.spread_ms else ""
        skew = f", app clock {r.app_clock_skew_s:+.3f} s vs wrapper stamps" if r.app_clock_skew_s == r.app_clock_skew_s else ""
        lines.append(f"clock: {r.source} session {r.session}: server started {at} ({r.method}, {r.support} supporting pairs{spread}{skew})")
        if r.warning:
            lines.append(f"warning: {r.source} session {r.session}: {r.warning}")
    return lines


def match_lines(matches: Matches) -> list[str]:
    """How many calls found their task, the server's busy time no call explains, and why the
    others found none."""
    m, un = matches.calls, matches.unlogged
    n_ok = int(m["ok"].fillna(False).sum()) if "ok" in m else len(m)
    busy = float(un["busy_s"].sum()) if len(un) else 0.0
    lines = [f"matched {int(m['task_id'].notna().sum()):,} of {len(m):,} calls ({n_ok:,} successful); "
             f"{len(un):,} server tasks no call explains ({busy:,.1f} s busy)"]
    reasons = m.loc[m["task_id"].isna(), "match_method"].astype(str).value_counts()
    return lines + [f"  {reason}: {n}" for reason, n in reasons.items()]


def gin_match_lines(calls: pd.DataFrame, unmatched_tasks: int) -> list[str]:
    """The same for Ollama's [GIN] calls, joined to the runner's tasks."""
    lines = [f"matched {int(calls['task_id'].notna().sum()):,} of {len(calls):,} [GIN] calls to runner tasks by end "
             f"time and duration (times good to about 1 s); {unmatched_tasks:,} runner tasks no call explains"]
    reasons = calls.loc[calls["task_id"].isna(), "match_method"].astype(str).value_counts()
    return lines + [f"  {reason}: {n}" for reason, n in reasons.items()]


def render(ds: Dataset, tables: dict[str, pd.DataFrame], file: IO[str] | None = None, width: int | None = None,
           max_rows: int = 12) -> None:
    """Print the whole report: alignment, findings first, then every table with its caption."""
    console = Console(file=file, width=width, soft_wrap=False, highlight=False)
    if not _header(console, ds):
        return
    for name in sorted(tables, key=lambda n: n != "findings"):  # findings first, the rest in order
        if name.startswith("ollama") and getattr(ds.server, "ollama", None) is None:
            continue  # (Ollama's sections, for Ollama's logs only)
        console.print()
        console.print(Rule(name, align="left"))
        if name in CAPTIONS:
            console.print(CAPTIONS[name], markup=False)
        _section(console, name, tables[name], max_rows)


def _header(console: Console, ds: Dataset) -> bool:
    """The report's first lines: what was read, the server, the clock alignment. False where
    there is nothing more to report (a server log without tasks)."""
    # Only the column read here (the tables may wait on disk); the distinct sources made text.
    servers = [f for f in ds.server.accounting.files if f.kind == "server"]
    src = ", ".join(sorted(set(map(str, pd.unique(tasks_of(ds, ["source"])["source"]))))) if ds.n_tasks else \
        ", ".join(f.path for f in servers) or "(no server log)"
    console.print(Rule(f"slotscope report: {src}", align="left"))
    matched = calls_of(ds, ["task_id"])["task_id"] if ds.matches is not None else None
    console.print(f"{ds.n_tasks:,} server tasks in {len(ds.server.sessions)} session(s)"
                  + (f"; {len(matched):,} app calls, {int(matched.notna().sum()):,} matched"
                     if matched is not None else ""), markup=False)
    setup = setup_line(ds.server.sessions)
    if setup:
        console.print(setup, markup=False)
    if ds.matches is not None:
        for r in ds.matches.aligned.itertuples(index=False):
            at = r.server_start_at.isoformat(timespec="seconds") if not pd.isna(r.server_start_at) else "unknown"
            console.print(f"session {r.session}: server clock zero at {at} ({r.method}, {r.support} supporting calls)"
                          + (f"; {r.warning}" if r.warning else ""), markup=False)
    else:
        console.print(APP_LOG_ADDS, markup=False)
    if servers and not ds.n_tasks:
        console.print(f"No task in the server log ({sum(f.lines for f in servers):,} lines): it has no `slot launch_slot_` "
                      "line, only start-up and other lines, so there is nothing to report. A log that began before the "
                      "first request, or a server that was never asked, looks like this.", markup=False)
        return False
    return True


def _section(console: Console, name: str, df: pd.DataFrame, max_rows: int) -> None:
    """One table of the report: sentences (findings, ruled-out), a note, or the table."""
    if name in ("findings", "ollama-findings"):
        for text in df.get("finding", pd.Series(dtype=str)):
            console.print(f"- {text}", markup=False)
    elif name == "ruled-out" and "hypothesis" in df.columns:
        for r in df.itertuples(index=False):
            console.print(f"- {r.hypothesis}: {r.verdict}. {r.figure} ({r.samples:,} samples)", markup=False)
    elif "note" in df.columns and df.drop(columns=["note"]).dropna(how="all").empty:
        for note in df["note"].dropna().unique():
            console.print(str(note), markup=False)
    elif df.empty:
        console.print("(no rows)", markup=False)
    else:
        print_table(console, _readable(name, df), max_rows=max_rows)
        for text in _footnotes(df):
            console.print(f"  {text}", markup=False)


def _readable(name: str, df: pd.DataFrame) -> pd.DataFrame:
    """The columns worth a terminal's width; per-day load rows only when there are several days."""
    if name == "load" and "scope" in df.columns:
        days = [s for s in df["scope"].unique() if s != "overall"]
        if len(days) <= 1:
            df = df[df["scope"] == "overall"]
    cols = REPORT_COLUMNS.get(name)
    if cols is None:
        drop = [c for c in df.columns if c in ("source", "port", "file") or c in FOOTNOTE_COLUMNS]
        return df.drop(columns=drop)
    return df[[c for c in cols if c in df.columns]]


def _footnotes(df: pd.DataFrame) -> list[str]:
    """``name: value`` for bookkeeping columns that hold one value (or a few) for the whole table."""
    out = []
    for c in FOOTNOTE_COLUMNS:
        if c not in df.columns:
            continue
        vals = [v for v in df[c].dropna().unique().tolist() if v != ""]
        if 1 <= len(vals) <= 3:
            shown = "; ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in vals)
            out.append(f"{c.replace('_', ' ')}: {shown}")
    return out
