"""--since/--until: time windows on server-clock seconds or on wall-clock times."""

from __future__ import annotations

import re

import pandas as pd

from .output import UsageError


class WindowError(UsageError):
    """A --since/--until/--where value that cannot be read or applied (a usage error, exit 2)."""


_LLAMA_TS = re.compile(r"^(\d+)\.(\d\d)\.(\d{3})\.(\d{3})$")


def parse_when(value: str | None) -> float | pd.Timestamp | None:
    """Seconds on the server clock (``120``, ``2.00.000.000``) or a wall time (ISO-8601, a date).

    A wall time without a zone is read as UTC.
    """
    if value is None or value == "":
        return None
    v = value.strip()
    m = _LLAMA_TS.match(v)
    if m:
        mi, s, ms, us = (int(x) for x in m.groups())
        return mi * 60 + s + ms / 1e3 + us / 1e6
    try:
        return float(v)
    except ValueError:
        pass
    if re.fullmatch(r"\d{1,2}:\d\d(?::\d\d(?:\.\d+)?)?", v):
        raise WindowError(None, None, f"time {value!r} has no date: give a date too (e.g. 2026-11-29T{v}), "
                          "or server-clock seconds")
    try:
        ts = pd.Timestamp(v)
    except (ValueError, TypeError):
        raise WindowError(None, None, f"cannot read time {value!r}: give server-clock seconds, M.SS.mmm.uuu, or an ISO time") from None
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts


def window(
    df: pd.DataFrame,
    since: float | pd.Timestamp | None,
    until: float | pd.Timestamp | None,
    *,
    time_col: str,
    wall_col: str | None = None,
) -> pd.DataFrame:
    """Rows whose time lies in [since, until). Wall times need a wall-clock column."""
    if since is None and until is None:
        return df
    wall_col = wall_col or (time_col[:-2] + "_at" if time_col.endswith("_s") else None)
    keep = pd.Series(True, index=df.index)
    for bound, is_since in ((since, True), (until, False)):
        if bound is None:
            continue
        if isinstance(bound, pd.Timestamp):
            if wall_col is None or wall_col not in df.columns:
                raise WindowError(None, None, "a wall-clock --since/--until needs wall-clock times: a wrapper "
                                  "stamp on the server lines (journald, docker -t, ts) or an app log to align with; "
                                  "or give server-clock seconds")
            col = df[wall_col]
        else:
            col = df[time_col]
        keep &= (col >= bound) if is_since else (col < bound)
    return df[keep.fillna(False).astype(bool)]


def where(df: pd.DataFrame, expr: str | None) -> pd.DataFrame:
    """Rows matching a pandas query over the table's columns, e.g. ``wait_before_prefill_ms >= 1000``."""
    if not expr:
        return df
    try:
        return df.query(expr, engine="python")
    except Exception as e:  # noqa: BLE001 - any bad expression is the user's to fix
        raise WindowError(None, None, f"--where {expr!r}: {type(e).__name__}: {e}; columns: {', '.join(map(str, df.columns))}") from None
