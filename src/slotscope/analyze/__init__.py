"""Analyzers: one module per question of the field report, each returning a DataFrame.

Every analyzer has the signature ``fn(ds: Dataset, opts: Options) -> pd.DataFrame`` and is
registered in :data:`TABLES` under its stable table name. Each statistic comes with its sample
count; rows resting on fewer than ``opts.min_samples`` samples say so (``few_samples``).
"""

from __future__ import annotations

from typing import Callable

import pandas as pd

from ..dataset import Dataset
from .questions import (QUESTIONS, TABLES, Analyzer, Options, Question, answer, ask, failure_note,
                        has_server_log, percent, register)

__all__ = ["APP_LOG_ALONE", "QUESTIONS", "TABLES", "Analyzer", "Options", "Question", "answer", "ask",
           "has_server_log", "percent", "register", "REPORT_ORDER", "DERIVED", "table_names", "run"]

# The tables an app call log answers alone, from its own times (no server log given).
APP_LOG_ALONE = ["turns"]


REPORT_ORDER = [
    "turns", "load", "breakdown", "stalls", "stalls-worst", "waits", "waits-worst", "prefills",
    "prefill-speed", "context", "cache", "cache-misses", "lora-switch", "ruled-out", "findings",
]
# Tables made of the others (after them): what each reads (None: every table).
DERIVED: dict[str, list[str] | None] = {"ruled-out": ["load", "cache", "context"], "findings": None}
_MODULES = ["turns", "load", "breakdown", "stalls", "waits", "prefills", "prefill_speed", "context", "cache",
            "lora_switch", "ruled_out", "findings", "ollama"]


def _import_all() -> None:
    import importlib

    for m in _MODULES:
        importlib.import_module(f"{__name__}.{m}")


def table_names() -> list[str]:
    """Every table the report can compute, in report order."""
    _import_all()
    names = [n for n in REPORT_ORDER if n in TABLES or n in DERIVED]
    return names + [n for n in TABLES if n not in REPORT_ORDER]


def _plan(names: list[str] | None) -> tuple[list[str], list[Question], list[str], list[str]]:
    """For the tables asked for (all: None): those wanted, the questions of the busy periods
    that make them, the tables of the per-call table, and the order they are made in."""
    wanted = table_names() if names is None else names
    unknown = [n for n in wanted if n not in TABLES and n not in DERIVED]
    if unknown:
        raise KeyError(f"unknown table(s) {', '.join(unknown)}; tables: {', '.join(table_names())}")
    reads = [n for d in wanted if d in DERIVED for n in (DERIVED[d] or table_names())]
    needed = [n for n in dict.fromkeys([*wanted, *reads]) if n not in DERIVED]
    asked = list({id(QUESTIONS[n]): QUESTIONS[n] for n in needed if n in QUESTIONS}.values())
    plain = [n for n in needed if n not in QUESTIONS]
    order = [n for q in asked for n in q.tables if n in needed] + plain + [d for d in DERIVED if d in wanted]
    return wanted, asked, plain, order


def _plain_table(name: str, ds: Dataset, opts: Options, strict: bool) -> pd.DataFrame:
    """A table of the per-call table; of one that fails, unless ``strict``, a one-row note."""
    try:
        return TABLES[name](ds, opts)
    except Exception as e:  # noqa: BLE001 - one broken table must not hide the rest
        if strict:
            raise
        return failure_note(name, e)
    finally:
        ds.unload()  # a table it read whole


def run(ds: Dataset, opts: Options | None = None, names: list[str] | None = None, *, strict: bool = False,
        on_table: Callable[[str, int, int], None] | None = None) -> dict[str, pd.DataFrame]:
    """Compute the report's tables (all, or ``names``; of an app log alone, by default
    :data:`APP_LOG_ALONE`) in report order.

    The questions of the busy periods are answered together, in one pass over them (two where
    one needs a first); the tables of the per-call table after them. ``findings`` is computed
    from the other tables, so asking for it computes them too. A table that fails on unusual
    input becomes a one-row note instead of ending the report, unless ``strict`` (tests and
    ``--debug``) asks for the error. ``on_table(name, i, n)``: the i-th of n tables is made
    next (for a status line on long runs).
    """
    opts = opts or Options()
    _import_all()
    if names is None and ds.matches is not None and not has_server_log(ds):
        names = APP_LOG_ALONE
    wanted, asked, plain, order = _plan(names)

    def said(name: str) -> None:
        if on_table is not None and name in order:
            on_table(name, order.index(name) + 1, len(order))

    ds.keep_on_disk()  # the tasks, calls and task view wait on disk; each table reads its columns
    out: dict[str, pd.DataFrame] = {}
    if asked:
        out.update({n: t for n, t in answer(asked, ds, opts, strict=strict, on_table=said).items() if n in order})
    for name in plain:
        said(name)
        out[name] = _plain_table(name, ds, opts, strict)
    from .findings import findings
    from .ruled_out import ruled_out

    for name, make in (("ruled-out", ruled_out), ("findings", findings)):
        if name in wanted:
            said(name)
            out[name] = make(ds, opts, out)
    return {n: out[n] for n in wanted if n in out}
