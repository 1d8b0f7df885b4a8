"""What every analyzer shares: the report's options, and a question asked of each busy period
with the one pass that answers a list of them (:func:`answer`). The analyzers import this
module, and the package imports the analyzers: the package's ``__init__`` only plans a report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

from ..dataset import Dataset
from ..periods import Part, PartStore
from ..workers import beside, workers_for


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


def concat_rows(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The frames' rows one after another (the empty ones, whose columns may have other types,
    left out)."""
    rows = [f for f in frames if len(f)]
    return pd.concat(rows, ignore_index=True) if len(rows) > 1 else (rows or frames)[0].reset_index(drop=True)


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
    failed = _Failures(strict)
    out: dict[str, pd.DataFrame] = {}
    with ds.periods(part_tasks) as periods:
        prepared = _prepared(questions, periods, opts, failed)
        answers = _answers(questions, periods, opts, prepared, failed)
        for i, q in enumerate(questions):
            for name in q.tables:
                if on_table is not None:
                    on_table(name)
            tables = failed.attempt(i, lambda: q.merge(answers[i].read(), opts, ds))
            answers[i].discard()
            ds.unload()  # what the merge read
            if i in failed.of:
                e = failed.of[i]
                tables = {n: failure_note(n, e) for n in q.tables}
            out.update(tables)
    return out


class _Failures:
    """:func:`answer`'s questions that failed, and why (``strict``: raised instead)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.of: dict[int, Exception] = {}

    def attempt(self, i: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` for question ``i``, None once it has failed."""
        if i in self.of:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one broken question must not hide the rest
            return self.took(i, False, e)

    def took(self, i: int, ok: bool, value: Any) -> Any:
        """What question ``i`` gave (``ok``) or raised (:func:`_part_answers`): None once it
        has failed."""
        if not ok and i not in self.of:
            if self.strict:
                raise value
            self.of[i] = value
        return None if i in self.of else value


def _prepared(questions: list[Question], periods: PartStore, opts: Options, failed: _Failures) -> dict[int, Any]:
    """The first pass, of the questions that need one (:attr:`Question.prepare`): their
    folded answers, by question."""
    early = [i for i, q in enumerate(questions) if q.prepare is not None]
    if not early:
        return {}
    firsts: dict[int, list[Any]] = {i: [] for i in early}
    wanted = [questions[i].prepare_columns for i in early]
    columns = None if None in wanted else sorted({c for cols in wanted for c in cols or ()})
    for part in periods.parts(heartbeats=False, columns=columns):  # (what a first pass asks needs no heartbeats)
        for i in early:
            firsts[i].append(failed.attempt(i, lambda: questions[i].prepare[0](part, opts)))  # type: ignore[index]
    return {i: failed.attempt(i, lambda: questions[i].prepare[1](firsts[i])) for i in early}  # type: ignore[index]


def _answers(questions: list[Question], periods: PartStore, opts: Options, prepared: dict[int, Any],
             failed: _Failures) -> list[Any]:
    """The second pass: each question's answers of every part, in part order, waiting on disk
    (a merge holds its own question's alone). The parts are answered by workers, each reading
    its own, where there are cores for it."""
    answers = [periods.spool(f"the answers for {q.tables[0]}") for q in questions]
    n = periods.n_parts
    for got in beside(_part_answers, (periods, questions, opts, prepared, set(failed.of)), range(n), workers_for(n)):
        for i, (ok, value) in enumerate(got):
            answers[i].append(failed.took(i, ok, value))
    return answers


def _part_answers(shared: tuple[PartStore, list[Question], Options, dict[int, Any], set[int]], k: int) -> list[tuple[bool, Any]]:
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
