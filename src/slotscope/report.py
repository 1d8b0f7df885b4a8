"""Findings + tables -> the rendered incident report.

The report is computed once (:func:`slotscope.analyze.run`) and rendered here as text for a
terminal or a pipe; any single table can be exported instead with ``--table NAME``.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import pandas as pd
from rich.console import Console
from rich.rule import Rule

from .analyze import Options, has_server_log
from .dataset import Dataset, calls_of, tasks_of
from .errors import InputError, UsageError
from .glossary import REPORT_COLUMNS, TABLES, TERMS, caption, label
from .match import Matches
from .output import print_table, write


def captions(opts: Options | None = None) -> dict[str, str]:
    """Each table's caption, with the thresholds of ``opts`` (default: Options' own): the
    glossary's line, which `slotscope explain` prints; ``calls``, the section of an app log given alone."""
    values = dict(vars(opts)) if opts is not None else None
    return {**{n: caption(n, values) for n in TABLES}, "calls": TERMS["calls"]}


# Columns whose single value is said once under the table instead of on every row.
FOOTNOTE_COLUMNS = ["note", "basis", "solo_gen_basis", "solo_prefill_basis", "effective_chunk_tokens", "max_running",
                    "n_slots", "solo_gen_tps", "solo_gen_n", "solo_prefill_tps", "solo_prefill_n"]
APP_LOG_ADDS = (
    "No app call log was given: purpose, user, LoRA and queue time are unknown, so `turns`, "
    "`prefills`, `cache`, `lora-switch` and the LoRA classes of `waits` are empty. Add the app's "
    "call log (JSONL/CSV with start time and token counts) to the same folder or command line."
)
SERVER_LOG_ADDS = (
    "No llama-server log was given: only the app's own times are known, so `turns` gives each purpose's call "
    "duration. The server log would add time to first token, the queue and the wait before prefill, prefill and "
    "generation times, stalls, load and prompt-cache reuse: add llama-server's log (`--log-timestamps "
    "--log-prefix`) to the same folder or command line."
)


def setup_line(sessions: pd.DataFrame) -> str:
    """What the sessions' start-up lines say: the model file(s), the build, slots x context."""
    parts = []
    for col in ("model", "build"):
        v = sorted(set(sessions[col].dropna().astype(str))) if col in sessions.columns and len(sessions) else []
        if v:
            parts.append(f"{col} {', '.join(v)}")
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
           max_rows: int = 12, opts: Options | None = None) -> None:
    """Print the whole report: alignment, findings first, then every table with its caption
    (naming the thresholds of ``opts``, the options the tables were made with)."""
    said_as = captions(opts)
    console = Console(file=file, width=width, soft_wrap=False, highlight=False)
    title, lines, has_tasks = _header(ds)
    if len(title) + 4 <= console.width:
        console.print(Rule(title, align="left"))
    else:  # a rule would cut the paths: each on a line of its own, whole
        console.print(Rule())
        for text in _title_lines(title):
            console.print(text, markup=False, soft_wrap=True)
    for line in lines:
        console.print(line, markup=False)
    if not has_tasks:
        return
    if ds.matches is not None and not has_server_log(ds):  # an app log alone: its calls, as read
        tables = {**tables, "calls": _calls(ds)}
    for name in _sections(ds, tables):
        console.print()
        console.print(Rule(name, align="left"))
        if name in said_as:
            console.print(said_as[name], markup=False)
        _section(console, name, tables[name], max_rows)


def _calls(ds: Dataset) -> pd.DataFrame:
    """The calls as the report lists them: start times to the millisecond, in UTC (a full ISO
    stamp would fold over two lines)."""
    calls = calls_of(ds, REPORT_COLUMNS["calls"])
    at = pd.to_datetime(calls["start_at"], utc=True)
    calls["start_at"] = at.dt.strftime("%Y-%m-%d %H:%M:%S.%f").str[:-3] + "Z"
    return calls


def _title_lines(title: str) -> list[str]:
    """A title too long for the page: its head, then each source it names on a line."""
    head, _, sources = title.partition(": ")
    return [f"{head}:", *(f"  {src}" for src in sources.split(", "))]


def _sections(ds: Dataset, tables: dict[str, pd.DataFrame]) -> list[str]:
    """The tables the report prints: findings first, the rest in the order they were made
    (report order); Ollama's for Ollama's logs only."""
    ollama = getattr(ds.server, "ollama", None) is not None
    return [n for n in sorted(tables, key=lambda n: n != "findings") if ollama or not n.startswith("ollama")]


def markdown(ds: Dataset, tables: dict[str, pd.DataFrame], files: dict[str, str] | None = None,
             opts: Options | None = None) -> str:
    """The report's header and its sentences (findings, what wasn't the cause) as Markdown, then
    each table's caption and, with ``files``, the file that holds it (``findings.md`` of
    ``slotscope analyze -o DIR/``)."""
    title, lines, _ = _header(ds)
    said_as = captions(opts)
    out = [f"# {title}", "", *(f"{line}  " for line in lines), ""]
    for name in _sections(ds, tables):
        said = _sentences(name, tables[name])
        if said is not None:
            out += [f"## {name}", "", said_as.get(name, ""), "", *(f"- {text}" for text in said), ""]
    if files:
        out += ["## tables", ""]
        out += [f"- [`{files[n]}`]({files[n]}): {said_as.get(n, '')}" for n in tables if n in files]
        out.append("")
    return "\n".join(out)


def export_format(fmt: str | None) -> str:
    """The format of a directory of tables (``--format``; csv when not given), checked."""
    if fmt not in (None, "csv", "json", "parquet"):
        raise UsageError(None, None, f"a directory of tables is written as csv, json or parquet, not {fmt}")
    return fmt or "csv"


def export(ds: Dataset, tables: dict[str, pd.DataFrame], directory: str, fmt: str = "csv", raw_csv: bool = False,
           opts: Options | None = None) -> list[Path]:
    """Write each table to ``directory/NAME.csv`` (or ``.json``, ``.parquet``: ``fmt``), the
    bytes ``--table NAME`` writes, and ``findings.md`` (:func:`markdown`); the directory is made
    if need be. The paths written, ``findings.md`` last."""
    fmt = export_format(fmt)
    where = Path(directory)
    try:
        where.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError(directory, None, "is not a directory: cannot write the tables into it") from None
    except OSError as e:
        raise InputError(directory, None, f"cannot make the directory: {e.strerror}") from None
    files = {name: f"{name}.{fmt}" for name in tables}
    written = []
    try:
        for name, df in tables.items():
            write(df, fmt, str(where / files[name]), title=name, raw_csv=raw_csv)
            written.append(where / files[name])
        (where / "findings.md").write_text(markdown(ds, tables, files, opts), encoding="utf-8")
    except OSError as e:
        raise InputError(e.filename or directory, None, f"cannot write: {e.strerror}") from None
    return written + [where / "findings.md"]


def _header(ds: Dataset) -> tuple[str, list[str], bool]:
    """The report's title and first lines: what was read, the server, the clock alignment; and
    whether there is more to report (False: a server log without tasks)."""
    # Only the column read here (the tables may wait on disk); the distinct sources made text.
    servers = [f for f in ds.server.accounting.files if f.is_server_log]
    src = ", ".join(sorted(set(map(str, pd.unique(tasks_of(ds, ["source"])["source"]))))) if ds.n_tasks else \
        ", ".join(f.path for f in servers) or ", ".join(f.path for f in ds.accounting.files) or "(no server log)"
    lines = []
    matched = calls_of(ds, ["task_id"])["task_id"] if ds.matches is not None else None
    lines.append(f"{ds.n_tasks:,} server tasks in {len(ds.server.sessions)} session(s)"
                 + (f"; {len(matched):,} app calls, {int(matched.notna().sum()):,} matched"
                    if matched is not None else ""))
    setup = setup_line(ds.server.sessions)
    if setup:
        lines.append(setup)
    if ds.matches is not None:
        for r in ds.matches.aligned.itertuples(index=False):
            at = r.server_start_at.isoformat(timespec="seconds") if not pd.isna(r.server_start_at) else "unknown"
            lines.append(f"session {r.session}: server clock zero at {at} ({r.method}, {r.support} supporting calls)"
                         + (f"; {r.warning}" if r.warning else ""))
    else:
        lines.append(APP_LOG_ADDS)
    if not servers and ds.matches is not None:
        lines.append(SERVER_LOG_ADDS)
    empty = bool(servers) and not ds.n_tasks
    if empty:
        n = {k: sum(getattr(f, k) for f in servers) for k in ("lines", "used", "ignored", "unrecognized")}
        lines.append(f"No task in the server log ({n['lines']:,} lines: {n['used']:,} used, {n['ignored']:,} known and "
                     f"ignored, {n['unrecognized']:,} unrecognized): it has no `slot launch_slot_` line, so there is "
                     "nothing to report. A log that began before the first request, or a server that was never "
                     "asked, looks like this; unrecognized lines are from another program or format (the summary "
                     "shows some).")
    return f"slotscope report: {src}", lines, not empty

def _sentences(name: str, df: pd.DataFrame) -> list[str] | None:
    """A table the report gives as sentences (findings, ruled-out), as them; None for the others."""
    if name in ("findings", "ollama-findings"):
        return [str(text) for text in df.get("finding", pd.Series(dtype=str))]
    if name == "ruled-out" and "hypothesis" in df.columns:
        return [f"{r.hypothesis}: {r.verdict}. {r.figure} ({r.samples:,} samples)" for r in df.itertuples(index=False)]
    return None


def _section(console: Console, name: str, df: pd.DataFrame, max_rows: int) -> None:
    """One table of the report: sentences (findings, ruled-out), a note, or the table."""
    said = _sentences(name, df)
    if said is not None:
        for text in said:
            console.print(f"- {text}", markup=False)
    elif "note" in df.columns and df.drop(columns=["note"]).dropna(how="all").empty:
        for note in df["note"].dropna().unique():
            console.print(str(note), markup=False)
    elif df.empty:
        console.print("(no rows)", markup=False)
    else:
        shown = _readable(name, df)
        print_table(console, shown, max_rows=max_rows)
        for text in _footnotes(df, str(shown.columns[0]) if len(shown.columns) else None):
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


def _footnotes(df: pd.DataFrame, key: str | None = None) -> list[str]:
    """``name: value`` for bookkeeping columns that hold one value (or a few) for the whole table;
    where they hold a few and ``key`` names each row once, each value with the rows it is of."""
    out = []
    for c in FOOTNOTE_COLUMNS:
        if c not in df.columns:
            continue
        vals = [v for v in df[c].dropna().unique().tolist() if v != ""]
        if 1 <= len(vals) <= 3:
            texts = [f"{v:g}" if isinstance(v, float) else str(v) for v in vals]
            if len(vals) > 1 and key not in (None, c) and key in df.columns and df[key].is_unique:
                texts = [f"{t} ({', '.join(map(str, df.loc[df[c] == v, key]))})" for t, v in zip(texts, vals)]
            out.append(f"{label(c)}: {'; '.join(texts)}")
    return out
