"""--since/--until: time windows on server-clock seconds or on wall-clock times."""

from __future__ import annotations

import ast
import re
from typing import NoReturn

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
) -> pd.DataFrame:
    """Rows whose time lies in [since, until). Wall times need ``time_col``'s ``*_at`` column."""
    if since is None and until is None:
        return df
    wall_col = time_col[:-2] + "_at" if time_col.endswith("_s") else None
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


# What a --where condition may hold: column names, literals, and operators. Anything else
# (attribute access, calls, subscripts, lambdas ...) would let the condition run code.
_ALLOWED = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd, ast.Invert,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.BitAnd, ast.BitOr,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.Name, ast.Load, ast.Constant, ast.List, ast.Tuple,
)
_REFUSED = {ast.Attribute: "attribute access", ast.Call: "a call", ast.Subscript: "a subscript"}
WHERE_USAGE = ("a condition holds column names, numbers, quoted strings, lists of them, and the operators "
               "== != < <= > >= in, not in, and or not, & | ~, + - * / // % **")


def _check_where(expr: str, columns: pd.Index, flag: str = "--where") -> None:
    """Refuse a --where condition that holds more than column names, literals and operators."""
    def refuse(what: str) -> NoReturn:
        raise WindowError(None, None, f"{flag} {expr!r}: {what}; {WHERE_USAGE}")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        refuse(f"not a condition ({e.msg})")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            what = _REFUSED.get(type(node), type(node).__name__)
            refuse(f"{what} ({ast.get_source_segment(expr.strip(), node) or type(node).__name__}) is not allowed")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (str, int, float, bool, type(None))):
            refuse(f"{node.value!r} is not a number or a string")
        if isinstance(node, ast.Name) and node.id not in columns:
            raise WindowError(None, None, f"{flag} {expr!r}: no column {node.id!r}; columns: {', '.join(map(str, columns))}")


def where(df: pd.DataFrame, expr: str | None) -> pd.DataFrame:
    """Rows matching a condition over the table's columns, e.g. ``wait_before_prefill_ms >= 1000``:
    column names, literals and operators only (see ``WHERE_USAGE``); rows :func:`matching` it."""
    if not expr:
        return df
    return df[matching(df, expr).to_numpy()]


def matching(df: pd.DataFrame, expr: str, flag: str = "--where") -> pd.Series:
    """Whether each row matches a condition of the --where form (a missing value matches not);
    ``flag`` names the option in an error."""
    _check_where(expr, df.columns, flag)
    try:
        hit = df.eval(expr.strip(), engine="python")
    except Exception as e:  # noqa: BLE001 - any bad expression is the user's to fix
        raise WindowError(None, None, f"{flag} {expr!r}: {type(e).__name__}: {e}; columns: {', '.join(map(str, df.columns))}") from None
    if not isinstance(hit, pd.Series) or len(hit) != len(df) or not pd.api.types.is_bool_dtype(hit.dtype):
        raise WindowError(None, None, f"{flag} {expr!r}: not a condition on each row; {WHERE_USAGE}")
    return hit.fillna(False).astype(bool)
