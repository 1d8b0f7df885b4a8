"""Busy periods: the seam the report's analyses of the server's load are cut at.

Tasks of one server process overlap only inside a *busy period*, a stretch in which at least one
of them runs, and every question the report asks about the load ("what did the other slots do
while this one generated?") is answered inside one. So the task view and the samples are
partitioned into :class:`Part` objects, each a few whole busy periods (of one or several
sessions) as ordinary DataFrames, and an analyzer is a plain function of one part. The parts
are made from compact per-task columns (keys and times); the rows wait on disk, a bucket of
parts per file, in :mod:`slotscope.store`, so what a part holds is bounded whatever the log's
length.

A busy period with more tasks than a part may hold is cut at the moment the fewest tasks run;
the tasks that run across the cut are in both parts, as context in the later one
(``counted`` False there), and are counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import pandas as pd

from . import store
from .events import HEARTBEAT, PROGRESS
from .tasks import Samples, SampleSource, empty_samples, source_column as _source_column
from .timeline import GROUP, by_code, key_codes, task_ends, within_ranges

TASK_KEYS = GROUP + ["task_id"]
# Tasks a part holds: large enough that the analyzers' per-call overhead is small next to
# their work, small enough that a part's frames stay a few MB.
PART_TASKS = 1 << 14


@dataclass(frozen=True)
class Part:
    """Some whole busy periods, or one piece of a long one, as plain frames.

    ``tasks``: the task view's rows of every task that runs in the part, in the view's order;
    ``counted``: per row, whether the part counts the task (False for a task that started
    before a cut, there as context); ``rows``: each row's position in the whole task view.
    ``gen`` and ``prefill``: the heartbeats and progress lines of those tasks, in log order.
    ``sessions``: the whole sessions table. ``span``: for a piece of a cut period, the part's
    stretch of that session's clock ``(from_s, to_s)``, with NaN for an open end; None for
    whole periods.
    """

    tasks: pd.DataFrame
    counted: np.ndarray
    rows: np.ndarray
    gen: pd.DataFrame
    prefill: pd.DataFrame
    sessions: pd.DataFrame
    span: tuple[float, float] | None = None
    index: int = 0


def task_spans(tasks: pd.DataFrame, sessions: pd.DataFrame | None) -> tuple[np.ndarray, np.ndarray]:
    """Each task's running stretch on its session clock: from its first known time (launch,
    else prefill start, else first token) to its end (:func:`slotscope.timeline.task_ends`)."""
    start = np.full(len(tasks), np.nan)
    for c in ("release_s", "first_token_s", "prefill_start_s", "launch_s"):
        if c in tasks:
            v = pd.to_numeric(tasks[c], errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
            start = np.where(np.isnan(v), start, v)
    end = task_ends(tasks, sessions)
    return start, np.fmax(end, start)


@dataclass
class Partition:
    """Which part each task is in: ``part`` and ``counted`` per (task row, part) pair, the
    pairs in part order, and each part's ``span`` (None: whole periods)."""

    task_row: np.ndarray
    part: np.ndarray
    counted: np.ndarray
    spans: list[tuple[float, float] | None] = field(default_factory=list)

    @property
    def n_parts(self) -> int:
        return len(self.spans)


def partition(tasks: pd.DataFrame, sessions: pd.DataFrame | None, part_tasks: int = PART_TASKS) -> Partition:
    """Cut the tasks (keys and times of the task view) into parts of whole busy periods, in the
    order of their sessions and times; a period of more than ``part_tasks`` tasks into pieces.

    A task with no time at all is a period of its own.
    """
    n = len(tasks)
    if not n:
        return Partition(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool), [])
    group = key_codes([tasks], GROUP)[0]
    start, end = task_spans(tasks, sessions)
    untimed = np.isnan(start)
    order = np.lexsort((np.arange(n), np.where(untimed, np.inf, start), group))
    g, s, e = group[order], start[order], end[order]
    # A period starts where a task starts after every earlier task of its session has ended.
    new_group = np.r_[True, g[1:] != g[:-1]]
    # (the running maximum must restart per session: take it within each session)
    reach = pd.Series(np.where(np.isnan(e), s, e)).groupby(g).cummax().to_numpy()
    new_period = new_group | np.r_[True, s[1:] > reach[:-1]] | np.isnan(s)
    period_start = np.flatnonzero(new_period)
    sizes = np.diff(np.r_[period_start, n])
    pieces: list[tuple[np.ndarray, np.ndarray, int]] = []  # (task rows, counted, part)
    spans: list[tuple[float, float] | None] = []  # (one a part: the part being filled is the last)
    filled = part_tasks  # (tasks in the part being filled: start a new one at once)
    for at, size in zip(period_start.tolist(), sizes.tolist()):
        if size > part_tasks:
            for piece_rows, piece_counted, span in _cut(order[at:at + size], s[at:at + size], e[at:at + size], part_tasks):
                spans.append(span)
                pieces.append((piece_rows, piece_counted, len(spans) - 1))
            filled = part_tasks
            continue
        if filled + size > part_tasks:
            spans.append(None)
            filled = 0
        pieces.append((order[at:at + size], np.ones(size, bool), len(spans) - 1))
        filled += size
    task_row = np.concatenate([r for r, _, _ in pieces])
    part_of = np.concatenate([np.full(len(r), k) for r, _, k in pieces])
    # Within a part, tasks in the view's order.
    by = np.lexsort((task_row, part_of))
    return Partition(task_row[by], part_of[by], np.concatenate([c for _, c, _ in pieces])[by], spans)


def _cut(rows: np.ndarray, start: np.ndarray, end: np.ndarray, part_tasks: int
         ) -> Iterator[tuple[np.ndarray, np.ndarray, tuple[float, float]]]:
    """Pieces of one long period (its rows sorted by start): each cut at the start of a task,
    where the fewest tasks run, within the second half of a piece's room."""
    n = len(rows)
    ends = np.sort(end)
    # Tasks running at each task's start: started before it and not yet ended.
    running = np.arange(n) - np.searchsorted(ends, start, side="right")
    cuts = []
    at = 0
    while n - at > part_tasks:
        lo = at + max(part_tasks // 2, 1)
        hi = max(at + part_tasks, lo + 1)
        i = lo + int(np.argmin(running[lo:hi]))
        while i > at + 1 and start[i] == start[i - 1]:  # (a cut between two tasks that start together)
            i -= 1
        cuts.append(i)
        at = i
    bounds = [0] + cuts + [n]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        t0 = start[a] if k else np.nan
        t1 = start[b] if b < n else np.nan
        # The piece's own tasks, and as context the earlier ones still running at its start.
        context = np.flatnonzero(end[:a] > start[a]) if k else np.zeros(0, np.int64)
        yield (np.r_[rows[context], rows[a:b]], np.r_[np.zeros(len(context), bool), np.ones(b - a, bool)],
               (float(t0), float(t1)))


class _TaskIndex:
    """Where each task of the view is: its key packed in one int64 (session code, then id),
    sorted, and its (task row, part) pairs of the partition by task row. Built once, so that
    a chunk of samples finds its tasks' parts by binary search alone
    (:func:`slotscope.timeline.join_tasks` would sort the view's keys again for each chunk)."""

    def __init__(self, tasks: pd.DataFrame, pt: Partition) -> None:
        self.tasks = tasks
        gcode = key_codes([tasks], GROUP)[0]
        first = np.unique(gcode, return_index=True)[1]
        self.groups = tasks[GROUP].iloc[first].reset_index(drop=True)  # (row i: code i)
        ids = tasks["task_id"].to_numpy(dtype=np.int64)
        self.lo = int(ids.min()) if len(ids) else 0
        self.span = int(ids.max()) - self.lo + 1 if len(ids) else 1
        packed = gcode * self.span + (ids - self.lo)
        self.order = np.argsort(packed, kind="stable")
        self.packed = packed[self.order]
        self.by_task = np.argsort(pt.task_row, kind="stable")
        rows = np.arange(len(tasks))
        self.first = np.searchsorted(pt.task_row[self.by_task], rows, "left")
        self.last = np.searchsorted(pt.task_row[self.by_task], rows, "right")
        self.part = pt.part

    def task_rows(self, samples: pd.DataFrame) -> np.ndarray:
        """Each sample's task row in the view (-1: its task is not there)."""
        scode, gcode = key_codes([samples, self.groups], GROUP)
        g = by_code(gcode, np.arange(len(gcode)), scode, -1)
        ids = samples["task_id"].to_numpy(dtype=np.int64) - self.lo
        q = g * self.span + ids
        at = np.minimum(np.searchsorted(self.packed, q), max(len(self.packed) - 1, 0))
        found = (g >= 0) & (ids >= 0) & (ids < self.span)
        found &= (self.packed[at] == q) if len(self.packed) else False
        return np.where(found, self.order[at], -1)

    def sample_parts(self, samples: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """(sample row, part) pairs: each sample in every part its task is in; a sample of no
        task in the view goes with the part of the latest task of its session started before it."""
        if not len(samples):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        task = self.task_rows(samples)
        lost = task < 0
        if lost.any():
            task[lost] = _nearest_task(samples[lost], self.tasks, lost, task)
        t = np.maximum(task, 0)
        n_in = np.where(task >= 0, self.last[t] - self.first[t], 0)
        sample_row = np.repeat(np.arange(len(samples)), n_in)
        offs = np.repeat(self.first[t], n_in) + within_ranges(n_in)
        return sample_row, self.part[self.by_task[offs]]


def _nearest_task(lost: pd.DataFrame, tasks: pd.DataFrame, mask: np.ndarray, task: np.ndarray) -> np.ndarray:
    """For samples whose task is not in the view: the task of their session launched last
    before them (-1: none)."""
    out = np.full(len(mask), -1, dtype=np.int64)
    lcode, tcode = key_codes([lost, tasks], GROUP)
    t_start, _ = task_spans(tasks, None)
    lt = pd.to_numeric(lost["t_s"], errors="coerce").to_numpy(dtype="float64", na_value=np.nan)
    order = np.lexsort((np.where(np.isnan(t_start), -np.inf, t_start), tcode))
    keyed = tcode[order].astype(np.float64) * 1e12 + np.nan_to_num(t_start[order], nan=-1e11)
    q = lcode.astype(np.float64) * 1e12 + np.nan_to_num(lt, nan=-1e11)
    at = np.searchsorted(keyed, q, side="right") - 1
    ok = (at >= 0) & (tcode[order][np.maximum(at, 0)] == lcode)
    out[np.flatnonzero(mask)] = np.where(ok, order[np.maximum(at, 0)], -1)
    return out[mask]


class PartStore:
    """The task view and the samples, cut into :class:`Part` objects and kept on disk until
    read (:meth:`parts`, in order)."""

    def __init__(self, view: store.StoredTable, gen: object, prefill: object,
                 sessions: pd.DataFrame, part_tasks: int = PART_TASKS) -> None:
        self.sessions = sessions
        self._spools: list[store.Spool] = []
        keys = view.read(TASK_KEYS + ["launch_s", "prefill_start_s", "first_token_s", "release_s"])
        self.partition = pt = partition(keys, sessions, part_tasks)
        self._whole: Part | None = None
        if pt.n_parts <= 1:  # the log is one part: its tables as they are
            whole = view.read()
            self._whole = Part(tasks=whole, counted=np.ones(len(whole), bool), rows=np.arange(len(whole)),
                               gen=_table(gen, "gen"), prefill=_table(prefill, "prefill"), sessions=sessions)
            return
        self._buckets = store.Buckets(pt.n_parts, ("tasks", "gen", "prefill"))
        index = _TaskIndex(keys, pt)
        by_task = index.by_task
        del keys
        store.release_memory()  # (what sorted the tasks into periods)
        # The task view's rows, a stored batch at a time, each into the buckets of its parts.
        for lo, batch in _batches(view):
            sel = (pt.task_row[by_task] >= lo) & (pt.task_row[by_task] < lo + len(batch))
            pairs = by_task[sel]
            self._buckets.add("tasks", batch.iloc[pt.task_row[pairs] - lo],
                              pt.part[pairs], extra={"row": pt.task_row[pairs], "counted": pt.counted[pairs]})
        store.release_memory()  # (the view's batches)
        self._streams: dict[str, list[SampleSource]] = {}
        for kind, samples in (("gen", gen), ("prefill", prefill)):
            if isinstance(samples, Samples):  # as the parse stored them: their table is made per part
                self._streams[kind] = samples.parts
                self._add_stored(kind, samples, index)
                continue
            for lo, batch in _batches(samples):
                rows, parts = index.sample_parts(batch)
                self._buckets.add(kind, batch.iloc[rows], parts, extra={"row": lo + rows})
        self._buckets.done()
        store.release_memory()  # (what sorted the rows into parts)

    @property
    def n_parts(self) -> int:
        return 1 if self._whole is not None else self.partition.n_parts

    def parts(self, heartbeats: bool = True, columns: Sequence[str] | None = None) -> Iterator[Part]:
        """Every part, in order; without ``heartbeats``, their ``gen`` table empty (not read);
        with ``columns``, their tasks only those of them (all: None)."""
        for k in range(self.n_parts):
            yield self.part(k, heartbeats, columns)
        if self._whole is None:
            store.release_memory()

    def part(self, k: int, heartbeats: bool = True, columns: Sequence[str] | None = None) -> Part:
        """Part ``k`` alone (see :meth:`parts`), in any order."""
        if self._whole is not None:
            return self._whole
        store.release_memory()  # (what the last part read here was made of, and what was asked of it)
        kinds = ("gen", "prefill") if heartbeats else ("prefill",)
        frames = self._buckets.part(k, ("tasks",) + kinds,
                                    {"tasks": [*columns, "row", "counted"]} if columns is not None else None)
        tasks = frames["tasks"]
        rows = tasks.pop("row").to_numpy()
        counted = tasks.pop("counted").to_numpy()
        gen = self._samples("gen", frames["gen"]) if heartbeats else empty_samples(HEARTBEAT)
        prefill = self._samples("prefill", frames["prefill"])
        return Part(tasks=tasks, counted=counted, rows=rows, gen=gen, prefill=prefill,
                    sessions=self.sessions, span=self.partition.spans[k], index=k)

    def spool(self, what: str) -> store.Spool:
        """A place on disk for what a pass over the parts answers, until the store is discarded."""
        self._spools.append(store.Spool(what))
        return self._spools[-1]

    def discard(self) -> None:
        for s in self._spools:
            s.discard()
        if self._whole is None:
            self._buckets.discard()

    def _add_stored(self, kind: str, samples: Samples, index: _TaskIndex) -> None:
        """The samples' rows as the parse stored them (a chunk at a time, in the order read),
        each into the buckets of its task's parts, with its stream and place in that order."""
        seq = 0
        for stream, src in enumerate(samples.parts):
            for whole in src.store.chunks():
                # (a batch of rows at a time: what sorts them into parts is a few times their size)
                for lo in range(0, len(whole["task"]), store.ROWS_PER_BATCH):
                    chunk = {c: v[lo:lo + store.ROWS_PER_BATCH] for c, v in whole.items()}
                    keys = pd.DataFrame({"source": _source_column(src.source, len(chunk["task"])), "port": chunk["port"],
                                         "session": chunk["session"], "task_id": chunk["task"], "t_s": chunk["ts_us"] / 1e6})
                    rows, parts = index.sample_parts(keys)
                    del keys
                    self._buckets.add(kind, {c: v[rows] for c, v in chunk.items()}, parts,
                                      extra={"row": seq + rows, "_stream": np.full(len(rows), stream, np.int16)})
                    seq += len(chunk["task"])

    def _samples(self, kind: str, rows: pd.DataFrame) -> pd.DataFrame:
        """A part's samples table from its bucketed rows: as stored (``row`` their place), or
        as the parse stored them, then made into the table the whole log's would be."""
        streams = self._streams.get(kind)
        if streams is None:
            return rows.drop(columns="row")
        frames = []
        for stream, src in enumerate(streams):
            mine = rows[rows["_stream"].to_numpy() == stream] if len(streams) > 1 else rows
            cols = {c: mine[c].to_numpy() for c in mine.columns if c not in ("row", "_stream")}
            if cols:
                # The table's order: by task, then time (ties: as read).
                order = np.lexsort((mine["row"].to_numpy(), cols["ts_us"], cols["task"], cols["session"], cols["port"]))
                cols = {c: v[order] for c, v in cols.items()}
            frames.append(src.table_of(cols) if cols and len(cols["task"]) else empty_samples(src.kind))
        return _joined(frames, streams)


def _batches(table: object) -> Iterator[tuple[int, pd.DataFrame]]:
    """(first row, rows) of a table in memory or on disk, a stored batch at a time."""
    if table is None:
        return
    if isinstance(table, pd.DataFrame):
        yield 0, table.reset_index(drop=True)
        return
    lo = 0
    for b in table.batches():  # type: ignore[attr-defined]
        yield lo, b.reset_index(drop=True)
        lo += len(b)


def _joined(frames: list[pd.DataFrame], streams: list[SampleSource]) -> pd.DataFrame:
    """A part's samples of each stream as one table, with the dtypes of the whole log's table
    (:class:`slotscope.tasks.Samples`): with samples in two or more streams, ``source``
    and ``file`` take every such stream's names as categories, sorted."""
    used = [src for src in streams if len(src.store)]
    if len(used) < 2:
        at = streams.index(used[0]) if used else 0
        return frames[at]
    cats = {"source": sorted({src.source for src in used}), "file": sorted(set().union(*(src.files for src in used)))}
    frames = [f.assign(**{c: f[c].cat.set_categories(v) for c, v in cats.items()}) for f in frames if len(f)]
    if not frames:
        return empty_samples(used[0].kind).astype({c: pd.CategoricalDtype(v) for c, v in cats.items()})
    return pd.concat(frames, ignore_index=True)


def _table(samples: object, kind: str) -> pd.DataFrame:
    """A samples table whole (as stored, or as the parse stored it)."""
    table = samples.table() if isinstance(samples, Samples) else samples
    if not isinstance(table, pd.DataFrame) or not len(table):  # (every column of the table, as a log with samples has)
        return empty_samples(HEARTBEAT if kind == "gen" else PROGRESS)
    return table
