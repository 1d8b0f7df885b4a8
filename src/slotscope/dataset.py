"""Everything one run reads: server logs, app logs, the clock alignment and the join.

A notebook user calls :func:`load` once and hands the result to the analyzers; the CLI does
the same. Each stage stays importable on its own.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import pandas as pd

from .accounting import Accounting, FileAccount
from .align import TASK_COLUMNS as ALIGN_TASK_COLUMNS, align, app_clock_us
from .app_log import AppLog, read_app_log_stream
from .periods import PART_TASKS, Part, PartStore
from .match import TASK_COLUMNS as MATCH_TASK_COLUMNS, Matches, match
from .server_log import ServerLogs, read_server_logs
from .sources import STDIN, Inputs, collect, reopen
from . import store
from .store import release_memory
from .timeline import join_tasks, within_ranges
from .workers import Pool


@dataclass
class Dataset:
    """Server tables, app calls (if any app log was given), alignment and matches."""

    server: ServerLogs
    app: AppLog | None
    matches: Matches | None
    accounting: Accounting
    # The task view on disk (see :meth:`keep_on_disk`); not carried to a dataclasses.replace copy.
    _view: store.StoredTable | None = field(default=None, init=False, repr=False, compare=False)

    def keep_on_disk(self) -> None:
        """Move the big tables to disk: the tasks, the calls and the task view (built here).

        They read as before (a field read builds its table, kept until :meth:`unload`), but
        :func:`task_view` with ``columns``, :func:`tasks_of` and :func:`calls_of` read only
        the columns asked for: a report table then holds those, not every table whole.
        """
        # The calls first (the view reads a few of their columns), the view then (the tasks whole
        # and the calls' columns it adds), the tasks last: no two of them whole at once.
        moved = [store.keep_on_disk(self.matches, "calls", "calls") if self.matches is not None else False,
                 store.keep_on_disk(self.app, "calls", "app calls") if self.app is not None else False,
                 store.keep_on_disk(self.server, "tasks", "tasks")]
        self.unload()
        if any(moved):  # (small tables stay held: nothing was freed)
            gc.collect()  # (pandas objects hold one another in cycles: the tables wait for the collector)
            release_memory()
        if self._view is None:
            self._view = _task_view(self)
            self.unload()

    def unload(self) -> None:
        """Free the tables built from disk by reading a field (built again when read)."""
        freed = [store.unload(self.server, "tasks"),
                 self.matches is not None and store.unload(self.matches, "calls"),
                 self.app is not None and store.unload(self.app, "calls"),
                 self._view is not None and self._view.unload()]
        if any(freed):
            release_memory()

    @contextmanager
    def periods(self, part_tasks: int | None = None) -> Iterator[PartStore]:
        """The task view and the samples cut into busy periods (:mod:`slotscope.periods`),
        read a part at a time (as often as asked) until the block ends."""
        view = _task_view(self)
        samples = [self.server.on_disk(k) or getattr(self.server, k) for k in ("gen_samples", "prefill_samples")]
        parts = PartStore(view, samples[0], samples[1], self.server.sessions, part_tasks or PART_TASKS)
        try:
            yield parts
        finally:
            parts.discard()

    def parts(self, part_tasks: int | None = None) -> Iterator[Part]:
        """The busy periods' parts, in order (see :meth:`periods`)."""
        with self.periods(part_tasks) as periods:
            yield from periods.parts()

    @property
    def n_tasks(self) -> int:
        """Rows of the task table (not read from disk)."""
        return len(store.raw(self.server, "tasks"))

    @property
    def tasks(self) -> pd.DataFrame:
        return self.server.tasks

    @property
    def calls(self) -> pd.DataFrame | None:
        return self.matches.calls if self.matches is not None else None


def read_app(inputs: Inputs, *, columns: dict[str, str] | None = None, tz: str = "UTC",
             on_disk: bool = False) -> tuple[AppLog | None, list[FileAccount]]:
    """Read the app logs found among the inputs, with their line accounting. ``on_disk``: one
    app log's calls go to ``$TMPDIR`` a column at a time as they are made (several logs' calls
    are joined in memory)."""
    if not inputs.app:
        return None, []
    logs = []
    accounts = []
    with Pool() as pool:  # plain JSONL files are read in parts by worker processes
        for lf in inputs.app:
            stream = reopen(lf, inputs)
            try:
                log = read_app_log_stream(lf.path if lf.path != STDIN else "<stdin>", stream, columns=columns, tz=tz,
                                          pool=pool, on_disk=on_disk and len(inputs.app) == 1)
            finally:
                if lf.path != STDIN:
                    stream.close()
            logs.append(log)
            a = log.accounting
            # Rows loaded are used (a bad field becomes NA and is reported); dropped rows are the
            # unrecognized ones; empty lines and a CSV header are known and ignored. (A JSON
            # array may hold many records on a line: a line counts once, used before dropped.)
            used = min(a.rows_loaded, a.lines_read)
            dropped = min(a.rows_dropped, a.lines_read - used)
            accounts.append(FileAccount(path=lf.path, kind="app", lines=a.lines_read, used=used,
                                        ignored=a.lines_read - used - dropped, unrecognized=dropped,
                                        examples=[(p.line, p.reason) for p in a.problems][:5], notes=list(a.notes)))
    if len(logs) == 1:
        return logs[0], accounts
    calls = pd.concat([lg.calls for lg in logs], ignore_index=True).sort_values("start_us", kind="stable")
    for c in ("purpose", "user", "lora", "file", "session"):  # (text repeated per call: categories, as each log has them)
        if c in calls:
            calls[c] = calls[c].astype("category")
    return AppLog(calls=calls.reset_index(drop=True), accounting=logs[0].accounting), accounts


def read_ollama_calls(inputs: Inputs, *, tz: str = "UTC") -> tuple[pd.DataFrame, Accounting] | None:
    """The [GIN] calls of the Ollama logs among the inputs (in Ollama's zone), with the line
    accounting of all their lines (the runner's are read too); None: no Ollama log."""
    if not inputs.ollama:
        return None
    server = read_server_logs([], keep_samples=False, tz=tz, inputs=dataclasses.replace(inputs, server=[], app=[]))
    assert server.ollama is not None
    return server.ollama.in_zone(server.ollama.calls), server.accounting


def load(
    paths: Sequence[str | os.PathLike[str]],
    *,
    app_columns: dict[str, str] | None = None,
    tz: str = "UTC",
    server_start: pd.Timestamp | None = None,
    keep_samples: bool = True,
    progress: Callable[[int], None] | None = None,
    stage: Callable[[str], None] | None = None,
) -> Dataset:
    """Read every log under ``paths``, align each server session's clock and join calls to tasks.

    The samples (``ds.server.gen_samples``, ``prefill_samples``) wait in ``$TMPDIR`` until
    read (see :class:`slotscope.server_log.ServerLogs`); ``keep_samples=False`` drops them.
    With an app log the task table waits there too (``ds.server.tasks`` reads it back whole,
    kept until :meth:`Dataset.unload`; see :mod:`slotscope.store`).

    ``progress(n)``: n more server-log bytes read; ``stage(text)``: what runs next (for a
    status line on long runs).
    """
    say = stage or (lambda text: None)
    inputs = collect(paths, app_columns)
    say("reading server logs")
    # The tasks and samples wait on disk as they are finished, until an analyzer reads them.
    server = read_server_logs(paths, keep_samples=keep_samples, tz=tz, progress=progress, inputs=inputs)
    if inputs.app:
        store.keep_on_disk(server, "tasks", "tasks")  # (not held while the app log is read)
        say("reading app logs")
    app, app_accounts = read_app(inputs, columns=app_columns, tz=tz, on_disk=True)
    gc.collect()  # (the chunks' tables, in pandas' cycles)
    release_memory()  # the records parsed from JSON
    acc = server.accounting
    acc.files.extend(app_accounts)
    matches = None
    if app is not None:
        say("aligning clocks and matching calls to tasks")
        # The calls on disk are read a column at a time, as align and match ask for them.
        calls = store.stored(app, "calls")
        app_calls = store.Columns(calls) if calls is not None else app.calls
        # Of the tasks on disk, the columns align and match read (a column at a time), and all
        # of the unlogged ones'.
        stored = store.stored(server, "tasks")
        aligned = align(store.Columns(stored, ALIGN_TASK_COLUMNS) if stored is not None else server.tasks,  # type: ignore[arg-type]
                        server.sessions, app_calls, server_start=server_start)
        release_memory()  # the candidate pairs, before match makes its own
        matches = match(app_calls, store.Columns(stored, MATCH_TASK_COLUMNS) if stored is not None else server.tasks, aligned,  # type: ignore[arg-type]
                        server.sessions, unlogged_rows=stored.take if stored is not None else None, on_disk=True)
        del stored, calls, app_calls
        release_memory()  # what match made on the way
    return Dataset(server=server, app=app, matches=matches, accounting=acc)


TASK_VIEW_EXTRA = ["call_id", "purpose", "user", "lora", "call_start_at", "queue_ms", "ttft_ms", "call_total_ms", "match_method",
                   "call_file", "call_line"]  # a call is (file, line): ids may repeat across app logs


def task_view(ds: Dataset, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """Tasks with what the app says about them (purpose, user, LoRA, queue wait) where matched.

    Times stay in seconds on each session's server clock (``*_s``); where the session's clock
    is aligned, ``*_at`` columns give wall times (app clock when an app log aligned it, else the
    wrapper's). Unlogged tasks keep NA in the app columns.

    ``columns``: only those of them the view has (in its order); after
    :meth:`Dataset.keep_on_disk` only they are read.
    """
    return _task_view(ds).read(columns)


def task_view_rows(ds: Dataset, rows: np.ndarray, columns: Sequence[str]) -> pd.DataFrame:
    """Those of ``columns`` the task view has, at its row positions ``rows`` (index 0..); after
    :meth:`Dataset.keep_on_disk` only those rows' stored batches are read."""
    return _task_view(ds).take(rows, columns)


def tasks_of(ds: Dataset, columns: Sequence[str]) -> pd.DataFrame:
    """Those of ``columns`` the task table has (only they are read from disk)."""
    return store.columns_of(ds.server, "tasks", columns)


def calls_of(ds: Dataset, columns: Sequence[str]) -> pd.DataFrame:
    """Those of ``columns`` the matched calls have (only they are read from disk); needs an app log."""
    assert ds.matches is not None
    return store.columns_of(ds.matches, "calls", columns)


def calls_at(ds: Dataset, rows: np.ndarray, columns: Sequence[str]) -> pd.DataFrame:
    """Those of ``columns`` the matched calls have, at row positions ``rows`` (index 0..)."""
    assert ds.matches is not None
    return store.rows_of(ds.matches, "calls", rows, columns)


# pandas >= 3 copies on write: a shallow copy is a private table. Before that it shares values.
_COPY_ON_WRITE = int(pd.__version__.split(".")[0]) >= 3 or pd.options.mode.copy_on_write is True


def own_copy(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of a shared table that its receiver may change freely (cheap with copy-on-write)."""
    return df.copy(deep=not _COPY_ON_WRITE)


def _task_view_parts(ds: Dataset) -> Iterator[pd.DataFrame]:
    """The task view a batch of stored tasks at a time (joined: its table), reading of the
    calls only the columns it adds. A task with two calls has a row per call, as a left merge
    of the tasks and calls gives them; every batch's added columns get the NA and dtype that
    merge gives them."""
    tasks = store.raw(ds.server, "tasks")
    stored = isinstance(tasks, store.StoredTable)
    batches = tasks.batches() if stored and len(tasks) else [store.columns_of(ds.server, "tasks", list(tasks.columns))]
    if ds.matches is None:
        yield from (own_copy(t).assign(**{c: pd.NA for c in TASK_VIEW_EXTRA}).reset_index(drop=True) for t in batches)
        return
    keys = ["source", "port", "session", "task_id"]
    # Each task's rows among the calls, found by the keys alone (packed keys: no hash of every
    # task id); then the other columns, read a batch of tasks at a time.
    call_keys = store.columns_of(ds.matches, "calls", keys)
    matched = np.flatnonzero(call_keys["task_id"].notna().to_numpy())
    ti, ci = join_tasks(store.columns_of(ds.server, "tasks", keys), call_keys.iloc[matched])
    del call_keys
    counts = np.bincount(ti, minlength=ds.n_tasks)
    reps = np.maximum(counts, 1)  # (a row per call, one for a task without)
    start = np.cumsum(reps) - reps
    order = np.lexsort((ci, ti))  # (a task's calls in their order)
    row = np.full(int(reps.sum()), -1, dtype=np.int64)
    row[start[ti[order]] + within_ranges(counts[counts > 0])] = matched[ci[order]]
    del ti, ci, matched, order
    release_memory()  # the keys' join, before the first batch
    named = {"call_start_at": "start_at", "call_total_ms": "total_ms"}  # (the calls' names of two of them)
    columns = store.raw(ds.matches, "calls").columns
    extra = [c for c in TASK_VIEW_EXTRA if named.get(c, c) in columns]
    names = [named.get(c, c) for c in extra]
    missing = bool((row < 0).any())
    for t in batches:
        lo, hi = (int(t.index[0]), int(t.index[-1]) + 1) if len(t) else (0, 0)
        r = row[start[lo]:start[hi - 1] + reps[hi - 1]] if hi else row[:0]
        t = own_copy(t.reset_index(drop=True))
        if len(r) > len(t):
            t = t.take(np.repeat(np.arange(len(t)), reps[lo:hi])).reset_index(drop=True)
        got = store.rows_of(ds.matches, "calls", r[r >= 0], names)  # (the stored batches of the same times, mostly)
        if missing:
            pos = np.full(len(r) + 1, -1, dtype=np.int64)
            pos[:-1][r >= 0] = np.arange(len(got))
            got = got.reindex(pos).iloc[:-1]
        for c in extra:
            t[c] = got[named.get(c, c)].array
        del got
        for c, us in app_clock_us(t, ds.matches.aligned).items():  # the ``*_at`` columns: times on the app's clock
            t[c[:-3] + "_at"] = pd.to_datetime(pd.Series(us).round().astype("Int64"), unit="us", utc=True).array
        yield t


def _task_view(ds: Dataset) -> store.StoredTable:
    """The task view: the one kept on disk (:meth:`Dataset.keep_on_disk`), else made now."""
    return ds._view if ds._view is not None else store.StoredTable.of_parts(_task_view_parts(ds), "task view")
