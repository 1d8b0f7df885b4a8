"""What every analyzer shares: the report's options, and a question asked of each busy period
with the one pass that answers a list of them (:func:`answer`). The analyzers import this
module, and the package imports the analyzers: the package's ``__init__`` only plans a report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

from ..dataset import Dataset
from ..periods import Part
from ..workers import beside, default_jobs


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


def percent(share: float) -> str:
    """A share (0-1) as the findings' prose prints it: whole percents, but one decimal near 0 and
    100%, so that "idle 0%" means none, as the tables' three digits do."""
    p = 100 * share
    return f"{p:.0f}%" if p in (0, 100) or 1 <= p <= 99 else f"{p:.1f}%"


def failure_note(name: str, e: Exception) -> pd.DataFrame:
    """What a table that failed on unusual input shows instead, when the report goes on."""
    return pd.DataFrame({"note": [f"could not compute {name}: {type(e).__name__}: {e}"]})


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
        # Each question's answers wait on disk: a merge holds its own question's alone. The
        # parts are answered by workers, each reading its own, where there are cores for it.
        answers = [periods.spool(f"the answers for {q.tables[0]}") for q in questions]
        jobs = default_jobs()
        shared = (periods, questions, opts, prepared, set(failed))
        for got in beside(_part_answers, shared, range(periods.n_parts),
                          min(jobs, periods.n_parts) if jobs >= 2 and periods.n_parts >= 2 else 0):
            for i, (ok, value) in enumerate(got):
                if not ok and i not in failed:
                    if strict:
                        raise value
                    failed[i] = value
                answers[i].append(None if i in failed else value)
        for i, q in enumerate(questions):
            for name in q.tables:
                if on_table is not None:
                    on_table(name)
            tables = attempt(i, lambda: q.merge(answers[i].read(), opts, ds))
            answers[i].discard()
            ds.unload()  # what the merge read
            if i in failed:
                e = failed[i]
                tables = {n: failure_note(n, e) for n in q.tables}
            out.update(tables)
    return out


def _part_answers(shared: tuple[Any, list[Question], Options, dict[int, Any], set[int]], k: int) -> list[tuple[bool, Any]]:
    """Every question's answer for part ``k`` (:func:`answer`'s second pass): ``(True, answer)``,
    or ``(False, the exception it raised)``; the questions that failed before are skipped."""
    periods, questions, opts, prepared, failed = shared
    part = periods.part(k)
    out: list[tuple[bool, Any]] = []
    for i, q in enumerate(questions):
        if i in failed:
            out.append((True, None))
            continue
        try:
            out.append((True, q.per_part(*((part, opts, prepared[i]) if i in prepared else (part, opts)))))
        except Exception as e:  # noqa: BLE001 - (answer() decides: raised, or the question's failure note)
            out.append((False, e))
    return out


def register(name: str) -> Callable[[Analyzer], Analyzer]:
    """Decorator: make an analyzer of the whole dataset available under its stable table name."""

    def deco(fn: Analyzer) -> Analyzer:
        TABLES[name] = fn
        return fn

    return deco
