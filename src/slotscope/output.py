"""DataFrame -> table | csv | json | parquet, chosen in one place.

stdout carries data only. ``table`` is a rich table for a terminal; when stdout is piped and no
format is given, CSV is written instead (rich would cut rows to 80 columns). The format is
guessed from ``-o FILE``'s extension; binary Parquet is refused on a terminal.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from typing import IO, Literal

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table

from .errors import SlotscopeError

Format = Literal["table", "csv", "json", "parquet"]
FORMATS = ("table", "csv", "json", "parquet")
_EXT = {".csv": "csv", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".txt": "table"}


class UsageError(SlotscopeError):
    """A combination of options that cannot work (exit code 2)."""


def is_terminal(stream: IO[str]) -> bool:
    """Whether a stream is an interactive terminal (tests replace this)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def choose_format(fmt: str | None, out: str | None, stdout_is_tty: bool) -> Format:
    """The format to write: explicit, else from the output file's extension, else by terminal."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UsageError(None, None, f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        chosen: Format = fmt  # type: ignore[assignment]
    elif out is not None and out != "-":
        chosen = _EXT.get(Path(out).suffix.lower(), "csv")  # type: ignore[assignment]
    else:
        chosen = "table" if stdout_is_tty else "csv"
    if chosen == "parquet" and (out is None or out == "-") and stdout_is_tty:
        raise UsageError(None, None, "refusing to write binary Parquet to a terminal; use -o FILE.parquet or pipe it")
    return chosen


def iso(col: pd.Series) -> pd.Series:
    """ISO-8601 text of a datetime column, exactly as ``Timestamp.isoformat()`` writes it.

    Column-wise for UTC (every time slotscope produces); other zones fall back to per value.
    """
    if str(getattr(col.dt, "tz", None)) in ("UTC", "UTC+00:00"):
        text = col.dt.strftime("%Y-%m-%dT%H:%M:%S.%f").str.replace(r"\.000000$", "", regex=True) + "+00:00"
        return text.where(col.notna(), "")
    return col.map(lambda x: x.isoformat() if not pd.isna(x) else "")


def for_text(df: pd.DataFrame) -> pd.DataFrame:
    """Datetimes as ISO-8601 with offset, everything else as is (for CSV and tables).

    Only the datetime columns are replaced; the table itself is not copied (a million-row
    task table would be).
    """
    dt = {c: iso(df[c]) for c in df.columns
          if isinstance(df[c].dtype, pd.DatetimeTZDtype) or pd.api.types.is_datetime64_any_dtype(df[c])}
    return df.assign(**dt) if dt else df


def _cell(v: object) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        a = abs(v)
        if a >= 1e15:
            return f"{v:g}"
        if a >= 100 or v == int(v):
            return f"{v:,.0f}"
        return f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    if isinstance(v, pd.Timestamp):
        return v.isoformat(timespec="milliseconds")
    return str(v)


def rich_table(df: pd.DataFrame, title: str | None = None, max_rows: int | None = None) -> Table:
    """A rich Table of a DataFrame (numbers right-aligned, blanks for missing values)."""
    table = Table(title=title, title_justify="left", show_lines=False, pad_edge=False, header_style="bold",
                  box=box.SIMPLE_HEAD, collapse_padding=True)
    rows = df if max_rows is None else df.head(max_rows)
    cells = [[_cell(v) for v in rows[c].tolist()] for c in rows.columns]
    for c, col_cells in zip(df.columns, cells):
        numeric = pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
        # Values keep their width; long headers wrap instead.
        width = min(max((len(x) for x in col_cells), default=0), 24)
        table.add_column(str(c).replace("_", " "), justify="right" if numeric else "left", overflow="fold", min_width=width)
    for rec in zip(*cells):
        table.add_row(*rec)
    if max_rows is not None and len(df) > max_rows:
        table.caption = f"{len(df) - max_rows:,} more rows; use --format csv for all"
    return table


def write(
    df: pd.DataFrame,
    fmt: str | None = None,
    out: str | None = None,
    *,
    title: str | None = None,
    stdout: IO[str] | None = None,
    table_columns: list[str] | None = None,
) -> Format:
    """Write one table to ``out`` (a path, ``-`` or None = stdout) in the chosen format.

    ``table_columns`` narrows what a terminal table shows (every format else has all columns).
    """
    stream = stdout if stdout is not None else sys.stdout
    to_stdout = out is None or out == "-"
    chosen = choose_format(fmt, out, to_stdout and is_terminal(stream))
    if chosen == "parquet":
        target = sys.stdout.buffer if to_stdout else out
        df.to_parquet(target, index=False)  # type: ignore[arg-type]
        return chosen
    if chosen == "table":
        console = Console(file=stream if to_stdout else open(out, "w"), soft_wrap=False)  # type: ignore[arg-type]
        shown = df
        if table_columns is not None:
            shown = df[[c for c in table_columns if c in df.columns]]
        # A key that is the same on every row goes into the title instead of a column.
        for key in ("source", "session", "port"):
            if key in shown.columns and len(shown) and shown[key].nunique(dropna=False) == 1:
                title = f"{title} ({key} {shown[key].iloc[0]})" if title else f"{key} {shown[key].iloc[0]}"
                shown = shown.drop(columns=[key])
        table = rich_table(shown, title=title)
        hidden = len(df.columns) - len(shown.columns)
        if hidden:
            table.caption = f"{hidden} more columns: --format csv shows all"
        console.print(table)
        return chosen
    text = for_text(df)
    buf: IO[str] = stream if to_stdout else open(out, "w", newline="")  # type: ignore[arg-type]
    try:
        if chosen == "csv":
            text.to_csv(buf, index=False)
        else:
            text.to_json(buf, orient="records", force_ascii=False)
            buf.write("\n")
    finally:
        if not to_stdout:
            buf.close()
    return chosen


def render_text(df: pd.DataFrame, fmt: Format) -> str:
    """The table as a string in a text format (used by tests and the report)."""
    buf = io.StringIO()
    if fmt == "csv":
        for_text(df).to_csv(buf, index=False)
    elif fmt == "json":
        for_text(df).to_json(buf, orient="records", force_ascii=False)
    else:
        Console(file=buf, width=100, soft_wrap=False).print(rich_table(df))
    return buf.getvalue()
