"""Analyzers: one module per question of the field report, each returning a DataFrame.

Every analyzer has the signature ``fn(ds: Dataset, opts: Options) -> pd.DataFrame`` and is
registered in :data:`TABLES` under its stable table name. Each statistic comes with its sample
count; rows resting on fewer than ``opts.min_samples`` samples say so (``few_samples``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

from ..dataset import Dataset
from ..periods import Part


@dataclass(frozen=True)
class Options:
    """Thresholds of the report (each a CLI option of ``slotscope analyze``)."""

    long_prefill_tokens: int = 15_000  # "long prefill" for stalls
    big_prefill_tokens: int = 5_000  # "5,000+ new tokens" for prefills / same-conditions
    wait_threshold_s: float = 1.0  # waits before prefill worth listing
    cache_rate: float = 0.95  # turns subset: prompt cache rate at or above this
    uncached_tokens: int = 5_000  # turns subset: at least this many new (uncached) tokens
    solo_gen_tps: float | None = None  # breakdown: override the estimated solo generation speed
    solo_prefill_tps: float | None = None  # breakdown: override the estimated solo prefill speed
    cache_window_s: float = 300.0  # cache: consecutive turns of one user within this
    min_samples: int = 10  # below this a class is marked, never stated as a finding
    worst: int = 10  # rows in "worst" listings
    tz: str = "UTC"  # load: the zone whose calendar days are the per-day scopes


Analyzer = Callable[[Dataset, Options], pd.DataFrame]
TABLES: dict[str, Analyzer] = {}
# The tables an app call log answers alone, from its own times (no server log given).
APP_LOG_ALONE = ["turns"]


def percent(share: float) -> str:
    """A share (0-1) as the findings' prose prints it: whole percents, but one decimal near 0 and
    100%, so that "idle 0%" means none, as the tables' three digits do."""
    p = 100 * share
    return f"{p:.0f}%" if p in (0, 100) or 1 <= p <= 99 else f"{p:.1f}%"


def has_server_log(ds: Dataset) -> bool:
    """Whether any llama-server log was read (with tasks or not)."""
    return any(f.is_server_log for f in ds.accounting.files)


@dataclass(frozen=True)
class Question:
    """A question asked of every busy period: ``per_part(part, opts)`` answers it for one
    :class:`slotscope.periods.Part` (any value: rows, or what the merge needs), and
    ``merge(answers, opts, ds)`` makes the tables named ``tables`` of every part's answer, in
    part order. ``ds`` gives what is not in the periods: the sessions, the app's calls.

    ``prepare``: for a question that needs something of every period first (a session's
    typical step), ``(of_part, combine)``: ``of_part(part, opts)`` per part (whose ``gen``
    table, the heartbeats, is left empty), ``combine`` of all of them, handed to
    ``per_part(part, opts, prepared)`` in a second pass. ``prepare_columns``: the task columns
    ``of_part`` reads (the first pass reads only those; None: all).
    """

    tables: tuple[str, ...]
    per_part: Callable[..., Any]
    merge: Callable[[list[Any], Options, Dataset], dict[str, pd.DataFrame]]
    prepare: tuple[Callable[[Part, Options], Any], Callable[[list[Any]], Any]] | None = None
    prepare_columns: tuple[str, ...] | None = None


QUESTIONS: dict[str, Question] = {}  # by table name


def ask(q: Question) -> Question:
    """Make the question's tables available under their stable names."""
    for name in q.tables:
        QUESTIONS[name] = q
        TABLES[name] = _asked_alone(q, name)
    return q


def _asked_alone(q: Question, name: str) -> Analyzer:
    """The table as an analyzer of the whole dataset (its periods read for it alone)."""
    def table(ds: Dataset, opts: Options) -> pd.DataFrame:
        return answer([q], ds, opts)[name]

    table.__module__ = q.per_part.__module__
    table.__name__ = name
    return table


def answer(questions: list[Question], ds: Dataset, opts: Options, part_tasks: int | None = None, *,
           strict: bool = True, on_table: Callable[[str], None] | None = None) -> dict[str, pd.DataFrame]:
    """Every table of ``questions``, from one pass over the dataset's busy periods (two where
    a question needs a first one, :attr:`Question.prepare`). Unless ``strict``, a question
    that fails gives each of its tables a one-row note and the others go on.
    ``on_table(name)``: the table is made next."""
    failed: dict[int, Exception] = {}

    def attempt(i: int, fn: Callable[[], Any]) -> Any:
        if i in failed:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one broken question must not hide the rest
            if strict:
                raise
            failed[i] = e
            return None

    prepared: dict[int, Any] = {}
    out: dict[str, pd.DataFrame] = {}
    with ds.periods(part_tasks) as periods:
        early = [i for i, q in enumerate(questions) if q.prepare is not None]
        if early:
            firsts: dict[int, list[Any]] = {i: [] for i in early}
            wanted = [questions[i].prepare_columns for i in early]
            columns = None if None in wanted else sorted({c for cols in wanted for c in cols or ()})
            for part in periods.parts(heartbeats=False, columns=columns):  # (what a first pass asks needs no heartbeats)
                for i in early:
                    firsts[i].append(attempt(i, lambda: questions[i].prepare[0](part, opts)))  # type: ignore[index]
            prepared = {i: attempt(i, lambda: questions[i].prepare[1](firsts[i])) for i in early}  # type: ignore[index]
            del firsts  # (what the first pass gave is folded: the second holds only that)
        # Each question's answers wait on disk: a merge holds its own question's alone.
        answers = [periods.spool(f"the answers for {q.tables[0]}") for q in questions]
        for part in periods.parts():
            for i, q in enumerate(questions):
                args = (part, opts, prepared[i]) if i in prepared else (part, opts)
                answers[i].append(attempt(i, lambda: q.per_part(*args)))
        del part
        for i, q in enumerate(questions):
            for name in q.tables:
                if on_table is not None:
                    on_table(name)
            tables = attempt(i, lambda: q.merge(answers[i].read(), opts, ds))
            answers[i].discard()
            ds.unload()  # what the merge read
            if i in failed:
                e = failed[i]
                tables = {n: pd.DataFrame({"note": [f"could not compute {n}: {type(e).__name__}: {e}"]}) for n in q.tables}
            out.update(tables)
    return out


def register(name: str) -> Callable[[Analyzer], Analyzer]:
    """Decorator: make an analyzer of the whole dataset available under its stable table name."""

    def deco(fn: Analyzer) -> Analyzer:
        TABLES[name] = fn
        return fn

    return deco


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
        return pd.DataFrame({"note": [f"could not compute {name}: {type(e).__name__}: {e}"]})
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
