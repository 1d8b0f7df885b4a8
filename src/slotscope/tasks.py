"""Events -> task records and sample tables, streaming: only still-open tasks are held.

Each chunk's task events and the partial rows of tasks still open are folded into one
partial row per task with a single stable sort and a few numpy reductions per column (the
first value of each kind, sums, maxima). Each of these is associative, so the rows are
those of one fold over all of a task's events in line order, wherever the blocks were cut.

A task is every line of its (port, session, task id). Closing it is only about memory: a
row is put aside when its release and timings (or cancellation) have been seen, when its
process restarts, or at the end of input. A line of a task put aside that comes later (a
line repeated, an id used again) starts a second row; at the end the rows of one task are
folded into one, in the order they were put aside, which is their lines' order. Closed rows
wait on disk as numeric columns (the file as an index into a short list); the task table is
derived from them a batch at a time, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import pandas as pd

from . import store
from .store import release_memory, table_itself
from .events import (
    BUILD, CANCEL, CONFIG, ERROR, EVAL, HEARTBEAT, LAUNCH, MODEL, PROGRESS, PROMPT_EVAL, RELEASE, TOTAL,
)

KEY = ["port", "session", "task"]

TASK_COLUMNS = [
    "source", "session", "slot", "task_id", "launch_s", "prefill_start_s", "first_token_s",
    "release_s", "wait_before_prefill_ms", "prompt_tokens_new", "prompt_tokens_cached", "n_gen",
    "prompt_eval_ms", "eval_ms", "prefill_tps", "gen_tps", "truncated", "status", "line",
]
GEN_COLUMNS = ["source", "session", "slot", "task_id", "t_s", "n_gen", "tg_tps", "tg_3s_tps", "window_s"]
PREFILL_COLUMNS = [
    "source", "session", "slot", "task_id", "t_s", "n_tokens", "progress", "elapsed_s", "tps", "step_tokens",
]

# A task's partial row: per event kind, (column, event field) from its first event of that
# kind (first non-missing value, per column), then flags combined by max, counts by sum, and
# its first line by min.
_FIRST_OF_KIND: dict[int, list[tuple[str, str]]] = {
    LAUNCH: [("slot_launch", "slot"), ("file", "file"), ("line", "line"), ("launch_us", "ts_us"), ("is_child", "v1")],
    PROMPT_EVAL: [("prompt_eval_ms", "v1"), ("prompt_tokens_new", "v2")],
    EVAL: [("eval_ms", "v1"), ("n_gen", "v2"), ("eval_us", "ts_us")],
    TOTAL: [("total_ms", "v1"), ("total_us", "ts_us")],
    RELEASE: [("release_us", "ts_us"), ("n_tokens_released", "v1"), ("truncated", "v2"), ("release_line", "line")],
    HEARTBEAT: [("heartbeat_us", "ts_us"), ("heartbeat_n_gen", "v1"), ("heartbeat_tps", "v2")],
}
_FIRSTS = [c for columns in _FIRST_OF_KIND.values() for c, _ in columns]
_MAX = {"cancelled": CANCEL, "error": ERROR}
_SUM = {"n_heartbeats": HEARTBEAT, "n_progress": PROGRESS}
_CORE = KEY + ["slot_any"] + list(_MAX) + list(_SUM) + ["first_line"]  # what every event row has
_SAMPLE = KEY + ["slot", "ts_us", "v1", "v2", "v3", "v4", "line"]
_SAMPLE_GEN = [c for c in _SAMPLE if c != "v4"]  # heartbeats have three values
SAMPLE_SPILL_ROWS = 1 << 18  # sample rows per chunk on disk, when finished rows spill


def _fold(
    open_rows: dict[str, np.ndarray] | None,
    events: dict[str, np.ndarray],
    kinds: list[tuple[np.ndarray, dict[str, np.ndarray]]],
) -> dict[str, np.ndarray]:
    """One partial row per task key, in key order.

    ``open_rows``: the open partial rows (every column); ``events``: one row per task event of
    the block, in line order (the columns of ``_CORE``); ``kinds``: per event kind, the rows of
    ``events`` of that kind and their values for that kind's first-of-kind columns. A column
    takes the first value that is there: an open row's, else its kind's first event's.
    """
    n_open = len(open_rows["task"]) if open_rows is not None else 0
    rows = _concat([open_rows, events], _CORE) if open_rows is not None else events
    order = np.lexsort((rows["task"], rows["session"], rows["port"]))  # stable: order kept per task
    key = {k: rows[k][order] for k in KEY}
    new = _new_run(*key.values())
    starts = np.flatnonzero(new)
    n_groups = len(starts)
    group_sorted = np.cumsum(new) - 1
    group = np.empty_like(group_sorted)
    group[order] = group_sorted  # the group of each row, rows in their own order
    out = {k: v[starts] for k, v in key.items()}

    def leads(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each group's first row among ``g`` (the rows' groups, in row order): (groups, rows)."""
        o = np.argsort(g, kind="stable")
        gs = g[o]
        lead = _new_run(gs)
        return gs[lead], o[lead]

    opened = np.arange(n_open)
    for at, values in kinds:
        rows_at = np.concatenate([opened, at + n_open]) if n_open else at
        every: tuple[np.ndarray, np.ndarray] | None = None  # the leads when no value is missing
        for c, v in values.items():
            if n_open:
                v = np.concatenate([open_rows[c], v])  # type: ignore[index]
            have = ~np.isnan(v)
            if have.all():
                if every is None:
                    every = leads(group[rows_at])
                g, i = every
            else:
                g, i = leads(group[rows_at[have]])
                v = v[have]
            res = np.full(n_groups, np.nan)
            res[g] = v[i]
            out[c] = res
    # slot_any over every row: first non-missing per group, walking the rows in key order
    v = rows["slot_any"][order]
    have = np.flatnonzero(~np.isnan(v))
    lead = have[_new_run(group_sorted[have])]
    out["slot_any"] = np.full(n_groups, np.nan)
    out["slot_any"][group_sorted[lead]] = v[lead]
    for names, ufunc, dtype in ((_MAX, np.maximum, np.int8), (_SUM, np.add, np.int64), (["first_line"], np.minimum, np.int64)):
        for c in names:
            out[c] = ufunc.reduceat(rows[c][order], starts) if n_groups else np.zeros(0, dtype)
    return out


def _refold(open_rows: dict[str, np.ndarray] | None, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`_fold` of partial rows (every column), with the open rows (None: none)."""
    return _fold(open_rows, rows, [(np.arange(len(rows["task"])), {c: rows[c] for c in _FIRSTS})])


def _new_run(*keys: np.ndarray) -> np.ndarray:
    """Whether each row's keys differ from the previous row's (the first row's do)."""
    new = np.ones(len(keys[0]), bool)
    new[1:] = np.logical_or.reduce([k[1:] != k[:-1] for k in keys])
    return new


def _concat(parts: list[dict[str, np.ndarray]], names: list[str]) -> dict[str, np.ndarray]:
    return {c: np.concatenate([p[c] for p in parts]) for c in names}


def _take(cols: dict[str, np.ndarray], sel: np.ndarray) -> dict[str, np.ndarray]:
    return {c: v[sel] for c, v in cols.items()}


class FinishedRows:
    """Finished partial rows in the order they finished, as numeric columns, on disk: every
    ``spill_rows`` rows go there as a chunk (:class:`slotscope.store.Chunks`), so the rows
    held in memory stay bounded whatever the input size; they are read back a column at a
    time, in output order (:meth:`gather`).
    """

    def __init__(self, spill_rows: int, what: str = "finished tasks", row_bytes: int = 300) -> None:
        self.spill_rows = spill_rows
        self._pending: list[dict[str, np.ndarray]] = []
        self._n_pending = 0
        self._names: list[str] = []
        self._sizes: list[int] = []  # each chunk's rows
        self._disk = store.Chunks(f"{what} (~{row_bytes} bytes per row)")

    def __len__(self) -> int:
        return sum(self._sizes) + self._n_pending

    def append(self, rows: dict[str, np.ndarray]) -> None:
        n = len(rows["task"])
        if not n:
            return
        self._pending.append(rows)
        self._n_pending += n
        if self._n_pending >= self.spill_rows:
            self.close()

    def close(self) -> None:
        """The rows not yet written (no more rows, or enough for a chunk) go to disk."""
        if not self._pending:
            return
        rows = {c: np.concatenate([p.pop(c) for p in self._pending]) for c in list(self._pending[0])}
        self._pending, self._n_pending = [], 0
        self._sizes.append(len(rows["task"]))
        self._names = list(rows)
        self._disk.write(rows)

    def chunks(self) -> Iterator[dict[str, np.ndarray]]:
        """Every column, a chunk at a time, in the order the rows finished."""
        for chunk in self._disk.paths:
            yield dict(zip(self._names, store.Chunks.read(chunk, self._names)))

    def column(self, c: str) -> np.ndarray:
        """One column over all rows."""
        paths = self._disk.paths
        return np.concatenate([store.Chunks.read(k, [c])[0] for k in paths]) if paths else np.zeros(0)

    def gather(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at these positions, in this order, read a chunk's column at a time."""
        starts = np.cumsum([0] + self._sizes)
        which = np.searchsorted(starts, idx, side="right") - 1
        out: dict[str, np.ndarray] = {}
        for k in np.unique(which).tolist():
            at = np.flatnonzero(which == k)
            src = idx[at] - starts[k]
            for c, v in zip(self._names, store.Chunks.read(self._disk.paths[k], self._names)):
                if c not in out:
                    out[c] = np.empty(len(idx), dtype=v.dtype)
                out[c][at] = v[src]
        return out

    def update(self, cols: dict[str, np.ndarray]) -> None:
        """Set these columns (a value per row, in the order the rows finished) on disk, in
        place of those of the same name or beside them."""
        self.close()
        starts = np.cumsum([0] + self._sizes)
        for k, path in enumerate(self._disk.paths):
            rows = dict(zip(self._names, store.Chunks.read(path, self._names)))
            rows.update({c: v[starts[k]:starts[k + 1]] for c, v in cols.items()})
            self._disk.rewrite(k, rows)
        self._names += [c for c in cols if c not in self._names]

    def discard(self) -> None:
        self._pending, self._sizes = [], []
        self._disk.discard()


@dataclass
class BlockTasks:
    """One block of events folded: one partial row per task, the samples, and one row per
    (port, session) with timed events (first/last line and time, wall offset, config, latest
    time). Sessions may be numbered from 0 within the block; the assembler shifts them."""

    rows: dict[str, np.ndarray]
    samples: dict[int, dict[str, np.ndarray]]  # HEARTBEAT / PROGRESS -> sample columns
    sessions: dict[str, np.ndarray]

    def shift_lines(self, n: int) -> None:
        """Line numbers of a block parsed on its own, moved to where the block starts."""
        for part, cols in ((self.rows, ("line", "release_line", "first_line")), (self.sessions, ("first_line",)),
                           *((s, ("line",)) for s in self.samples.values())):
            for c in cols:
                part[c] = part[c] + n


_SESSION_INFO = ["port", "session", "first_line", "first_us", "last_us", "now_us", "offset_us", "offset_hi_us",
                 "whole_s", "support", "n_slots", "n_ctx_slot", "model", "build"]
_SESSION_TEXT = {"model": MODEL, "build": BUILD}  # text per session: its first such line's


def fold_block(ev: pd.DataFrame | dict[str, np.ndarray], keep_samples: bool | int = True) -> BlockTasks:
    """Fold one block of events (``session`` assigned, or numbered within the block), with
    the samples of every kind (``keep_samples`` True), none (False) or the one kind given.

    Pure: it needs nothing from earlier blocks, so worker processes can run it.
    """
    cols = {c: np.asarray(ev[c]) for c in ("line", "kind", "port", "ts_us", "wall_us", "slot", "task", "v1", "v2",
                                           "v3", "v4", "session")}
    cols["file"] = np.zeros(len(cols["line"]))  # which file: the assembler knows
    kind = cols["kind"]
    samples = {}
    for code, names in ((HEARTBEAT, _SAMPLE_GEN), (PROGRESS, _SAMPLE)):
        keep = keep_samples is True or (keep_samples is not False and keep_samples == code)
        sel = np.flatnonzero(kind == code) if keep else ()
        if len(sel):
            samples[code] = {c: cols[c][sel] for c in names}
    task = cols["task"].astype(np.float64)
    sel = np.flatnonzero(task >= 0)  # NaN compares False
    k = kind[sel]
    events: dict[str, np.ndarray] = {
        "port": cols["port"][sel].astype(np.int64), "session": cols["session"][sel].astype(np.int64),
        "task": task[sel].astype(np.int64), "slot_any": cols["slot"][sel].astype(np.float64),
        "first_line": cols["line"][sel].astype(np.int64),
    }
    for c, code in {**_MAX, **_SUM}.items():
        events[c] = (k == code).astype(np.int8 if c in _MAX else np.int64)
    kinds = []
    for code, columns in _FIRST_OF_KIND.items():
        at = np.flatnonzero(k == code)
        kinds.append((at, {c: cols[f][sel[at]].astype(np.float64) for c, f in columns}))
    text = np.asarray(ev["text"]) if "text" in ev else None
    return BlockTasks(rows=_fold(None, events, kinds), samples=samples, sessions=_session_info(cols, text))


def _session_info(ev: dict[str, np.ndarray], text: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per (port, session) with timed events: what :meth:`TaskAssembler.merge` keeps of them.
    ``text``: the events' text (MODEL and BUILD rows), if the block has any."""
    ts = ev["ts_us"]
    timed = np.flatnonzero(ts >= 0)
    port, session = ev["port"][timed], ev["session"][timed]
    one = len(timed) and (port == port[0]).all() and (session == session[0]).all()
    pairs = [(port[0], session[0])] if one else pd.unique(pd.MultiIndex.from_arrays([port, session])).tolist()
    out: dict[str, list] = {c: [] for c in _SESSION_INFO}
    for p, s in pairs:
        idx = timed if one else timed[(port == p) & (session == s)]
        t, wall, kind = ts[idx], ev["wall_us"][idx], ev["kind"][idx]
        w = wall >= 0
        cfg = idx[kind == CONFIG]
        for c, v in (("port", p), ("session", s), ("first_line", ev["line"][idx[0]]), ("first_us", t[0]),
                     ("last_us", t[-1]), ("now_us", t.max()),
                     ("offset_us", (wall[w] - t[w]).min() if w.any() else -1),
                     ("offset_hi_us", (wall[w] - t[w]).max() if w.any() else -1),
                     ("whole_s", int((wall[w] % 1_000_000 == 0).all())), ("support", w.sum()),
                     ("n_slots", ev["v1"][cfg[0]] if len(cfg) else np.nan),
                     ("n_ctx_slot", ev["v2"][cfg[0]] if len(cfg) else np.nan)):
            out[c].append(v)
        for c, code in _SESSION_TEXT.items():
            at = idx[kind == code] if text is not None else idx[:0]
            out[c].append(text[at[0]] if text is not None and len(at) and isinstance(text[at[0]], str) else None)
    return {c: np.array(v, dtype=object if c in _SESSION_TEXT else np.float64 if c in ("n_slots", "n_ctx_slot") else np.int64)
            for c, v in out.items()}


def shifted_sessions(port: np.ndarray, session: np.ndarray, shift: dict[int, int]) -> np.ndarray:
    """Session numbers counted within a block, moved by each row's port's shift (every port
    of the block has one)."""
    out = session.astype(np.int64)
    for p, d in shift.items():
        out[port == p] += d
    return out


@dataclass
class TaskAssembler:
    """Folds blocks of one server-log stream, in order, into finished task rows and samples.

    Only tasks still open are held as partial rows; finished ones wait on disk (:class:`FinishedRows`).
    The rows do not depend on where the blocks were cut (see the module's note).
    """

    source: str
    keep_samples: bool | int = True  # True, False, or the one kind kept (HEARTBEAT or PROGRESS)
    _open: dict[str, np.ndarray] | None = None
    spill_rows: int = 1 << 15  # hold at most this many finished rows in memory
    _done: FinishedRows = field(init=False)
    _gen: FinishedRows = field(init=False)  # heartbeat rows, in the order their blocks came
    _prefill: FinishedRows = field(init=False)  # progress rows
    _files: dict[str, int] = field(default_factory=dict)  # file name -> index (the ``file`` column)
    # The same for the samples' ``file``; apart, so that the tasks' ``file`` categories stay
    # the files with launches (a file of heartbeats only would add an empty category).
    _sample_files: dict[str, int] = field(default_factory=dict)
    sessions: dict[tuple[int, int], dict] = field(default_factory=dict)
    _latest: dict[int, int] = field(default_factory=dict)  # each port's latest session

    def __post_init__(self) -> None:
        self._done = FinishedRows(self.spill_rows)
        # Samples are ~5x as many as tasks: they go to disk in larger chunks.
        self._gen = FinishedRows(SAMPLE_SPILL_ROWS, "heartbeat samples", 80)
        self._prefill = FinishedRows(SAMPLE_SPILL_ROWS, "prefill samples", 80)
        self.n_finished = 0  # set when the input ends
        self.has_wall_rows = False

    def add(self, ev: pd.DataFrame, file: str | None = None) -> None:
        """Fold one chunk of events (with ``session`` assigned) from ``file``."""
        if not ev.empty:
            self.merge(fold_block(ev, self.keep_samples), file=file)

    def merge(self, block: BlockTasks, shift: dict[int, int] | None = None, file: str | None = None) -> None:
        """Fold one folded block into the open tasks; ``shift``: per port, what to add to the
        block's session numbers (None: they are final)."""
        rows, info = block.rows, block.sessions
        samples = block.samples if self.keep_samples else {}
        if shift:
            for part in (rows, info, *samples.values()):
                part["session"] = shifted_sessions(part["port"], part["session"], shift)
        self._track_sessions(info, file)
        if samples:  # every sample line of the block is in its file
            at = self._sample_files.setdefault(file, len(self._sample_files))  # type: ignore[arg-type]
            for code, part in samples.items():
                part["file"] = np.full(len(part["task"]), at, dtype=np.int32)
                (self._gen if code == HEARTBEAT else self._prefill).append(part)
        if not len(rows["task"]):
            return
        rows["file"] = np.where(np.isnan(rows["file"]), np.nan, float(self._files.setdefault(file, len(self._files))))  # type: ignore[arg-type]
        open_rows = self._open if self._open is not None and len(self._open["task"]) else None
        if open_rows is None:  # the block's rows are one per task already
            self._open = self._close(rows, info)
            return
        # Only the rows of tasks that may be open (by task id: a superset) are folded with the
        # open rows; the others are one per task already. Row order is free here: the output
        # order is set once, at the end (finish_in_batches). A few dozen rows folded instead of thousands.
        maybe = np.isin(rows["task"], open_rows["task"])
        folded = _refold(open_rows, _take(rows, maybe))
        still = self._close(folded, info), self._close(_take(rows, ~maybe), info)
        self._open = _concat(list(still), list(folded))

    def _close(self, rows: dict[str, np.ndarray], info: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Hand the finished ones of these rows to the finished rows, in order; return the
        others, still open."""
        port, session = rows["port"], rows["session"]
        # The latest server time of each (port, session) in this block: "now" for stale releases.
        now = np.full(len(port), np.nan)
        current = np.full(len(port), np.nan)
        for p in np.unique(port):
            current[port == p] = self._latest.get(int(p), np.nan)
        for p, s, t in zip(info["port"], info["session"], info["now_us"]):
            now[(port == p) & (session == s)] = t
        release = rows["release_us"]
        has_release = ~np.isnan(release)
        has_total = ~np.isnan(rows["total_ms"])  # the last timing line
        cancelled = rows["cancelled"] > 0
        with np.errstate(invalid="ignore"):
            # Older builds print the release before the timings; wait a little for them.
            stale_release = has_release & ((now - release) > 5e6)
            old_session = session < current
        done = (has_release & (has_total | cancelled)) | stale_release | old_session
        if done.any():
            self._done.append(_take(rows, done))
        return _take(rows, ~done)

    def _track_sessions(self, info: dict[str, np.ndarray], file: str | None) -> None:
        """Each (port, session)'s row of the sessions table, with this block's in it (the
        first line, file, time and config are the first block's that has them, the last time
        the last block's)."""
        for i in range(len(info["port"])):
            key = (int(info["port"][i]), int(info["session"][i]))
            self._latest[key[0]] = max(self._latest.get(key[0], key[1]), key[1])
            row = self.sessions.setdefault(key, {
                "source": self.source, "port": key[0], "session": key[1], "file": file,
                "first_line": int(info["first_line"][i]), "first_s": int(info["first_us"][i]) / 1e6,
                "wall_offset_us": None, "wall_offset_support": 0, "n_slots": None, "n_ctx_slot": None,
                "model": None, "build": None, "_lo": np.inf, "_hi": -np.inf, "_whole": True,
            })
            row["last_s"] = int(info["last_us"][i]) / 1e6
            if info["support"][i]:
                row["_lo"] = min(int(info["offset_us"][i]), row["_lo"])
                row["_hi"] = max(int(info["offset_hi_us"][i]), row["_hi"])
                row["_whole"] = bool(info["whole_s"][i]) and row["_whole"]
                # A stamp is at or after the moment the line was written (a wrapper's lag): the
                # smallest stamp - server time is the offset. Stamps cut to the whole second are
                # up to 1 s before it: there the largest is (the closest bound from below).
                row["wall_offset_us"] = row["_hi"] if row["_whole"] else row["_lo"]
                row["wall_offset_support"] += int(info["support"][i])
            if row["n_slots"] is None and not np.isnan(info["n_slots"][i]):  # its first config line, as in a block
                row["n_slots"] = int(info["n_slots"][i])
                row["n_ctx_slot"] = int(info["n_ctx_slot"][i])
            for c in _SESSION_TEXT:  # the session's first such line (one per start-up)
                if row[c] is None:
                    row[c] = info[c][i]

    def samples_later(self, tasks: "pd.DataFrame | Callable[[], FirstTokens] | None") -> tuple["SampleSource", "SampleSource"]:
        """The gen and prefill samples as read (on disk), their tables built when asked. ``tasks``: the finished tasks' ``port``, ``session``, ``task_id``
        and ``first_token_s``, or what makes their :class:`FirstTokens` (None: no tasks), for
        the gen samples' first windows."""
        files = list(self._sample_files)
        self._gen.close()
        self._prefill.close()
        release_memory()  # (the last rows, just written: not under the first tokens' making)
        first = None
        if tasks is not None and len(self._gen):
            first = FirstTokens.of(tasks) if isinstance(tasks, pd.DataFrame) else tasks()
        return SampleSource(HEARTBEAT, self._gen, self.source, files, first), SampleSource(PROGRESS, self._prefill, self.source, files, None)

    def discard_samples(self) -> None:
        self._gen.discard()
        self._prefill.discard()

    def close(self) -> None:
        """Close every task still open (the input has ended)."""
        if self._open is not None:
            self._done.append(self._open)
        self._open = None
        self._done.close()

    def rows_of(self, which: str, names: list[str]) -> tuple[dict[str, np.ndarray], list[str]]:
        """Columns of every finished task row (``which`` "tasks", after :meth:`close`) or
        sample row ("gen", "prefill"), in the order they finished, and the files their
        ``file`` codes name."""
        rows = {"tasks": self._done, "gen": self._gen, "prefill": self._prefill}[which]
        rows.close()
        files = list(self._files if which == "tasks" else self._sample_files)
        return {c: rows.column(c) for c in names}, files

    def update(self, which: str, cols: dict[str, np.ndarray]) -> None:
        """Set columns of the rows :meth:`rows_of` gives (as :meth:`FinishedRows.update`)."""
        {"tasks": self._done, "gen": self._gen, "prefill": self._prefill}[which].update(cols)

    def finish_in_batches(self, rows: int = 1 << 15) -> tuple[list["TaskBatch"], pd.DataFrame]:
        """Close every task still open; return the task table as batches of ``rows`` rows in
        output order (none: no tasks), each built when asked (:meth:`TaskBatch.table`), and the
        sessions. Every finished row is on disk, so that a batch pickles small (for worker
        processes); :meth:`discard` removes them after use.
        """
        self.close()
        kept = self._fold_repeats()
        port, session = self._done.column("port"), self._done.column("session")
        # Output order: per process, by launch (tasks whose launch was never seen last), then line.
        order = np.lexsort((self._done.column("first_line"), self._done.column("launch_us"), session, port))
        if kept is not None:
            order = order[kept[order]]
            port, session = port[kept], session[kept]
        # A row in a session with wall-clock times: every row has ``*_at`` columns.
        walled = [k for k, row in self.sessions.items() if row["wall_offset_us"] is not None]
        with_wall = bool(walled) and bool(pd.MultiIndex.from_arrays([port, session]).isin(walled).any())
        self.n_finished, self.has_wall_rows = len(order), with_wall
        sessions = self._sessions_table()
        return [TaskBatch(self._done, order[i : i + rows], self.source, list(self._files), sessions, with_wall)
                for i in range(0, len(order), rows)], sessions

    def _fold_repeats(self) -> np.ndarray | None:
        """Fold the finished rows of one task (a task with lines after it was put aside) into
        one row, appended to the finished rows; which rows stand (None: every row)."""
        port, session, task = (self._done.column(c).astype(np.int64) for c in KEY)
        by_key = np.lexsort((task, session, port))  # stable: per task, the order rows finished in
        run = np.cumsum(_new_run(port[by_key], session[by_key], task[by_key])) - 1
        repeated = np.sort(by_key[np.bincount(run)[run] > 1]) if len(run) else by_key
        if not len(repeated):
            return None
        folded = _refold(None, self._done.gather(repeated))
        kept = np.ones(len(task) + len(folded["task"]), bool)
        kept[repeated] = False
        self._done.append(folded)
        self._done.close()
        return kept

    def discard(self) -> None:
        """Drop the finished rows (and their files on disk)."""
        self._done.discard()

    def _sessions_table(self) -> pd.DataFrame:
        df = pd.DataFrame([row for _, row in sorted(self.sessions.items())], columns=SESSION_COLUMNS)
        df["start_at"] = pd.to_datetime(df["wall_offset_us"].astype("Int64"), unit="us", utc=True)
        for c in _SESSION_TEXT:  # the model file and build its start-up lines name (NA: none seen)
            df[c] = df[c].astype("string")
        return df


SESSION_COLUMNS = ["source", "port", "session", "file", "first_line", "first_s", "last_s", "n_slots", "n_ctx_slot",
                   "wall_offset_us", "wall_offset_support", "start_at", "model", "build"]


def empty_task_table(source: str, sessions: pd.DataFrame, with_wall: bool) -> pd.DataFrame:
    """The task table of a log without tasks: every column, typed as a log with tasks has it
    (what the report's questions read of it is there, with no rows)."""
    ints = {**dict.fromkeys(KEY + list(_SUM) + ["first_line"], np.int64), **dict.fromkeys(_MAX, np.int8)}
    raw = {c: np.zeros(0, ints.get(c, np.float64)) for c in [*_CORE, *_FIRSTS, "slot_any"]}
    return _derive(raw, [], source, sessions.iloc[:0], with_wall)


@dataclass
class TaskBatch:
    """Some finished rows, by position in output order, and what deriving them needs.

    Picklable (a worker process can build the batch) when the rows are on disk.
    """

    rows: FinishedRows
    idx: np.ndarray
    source: str
    files: list[str]
    sessions: pd.DataFrame
    with_wall: bool

    def table(self) -> pd.DataFrame:
        return _derive(self.rows.gather(self.idx), self.files, self.source, self.sessions, self.with_wall)


def _derive(raw: dict[str, np.ndarray], files: list[str], source: str, sessions: pd.DataFrame,
            with_wall: bool) -> pd.DataFrame:
    """Timeline arithmetic of research/log-formats.md §1.3, column-wise, on finished partial
    rows (``raw``, in output order); ``with_wall``: with the ``*_at`` columns (a table written
    in batches decides once for all of them).

    ``raw`` is consumed, each column dropped after its last use, so that the partial rows and
    the task table are not both held whole (arrays, not a DataFrame: deleting a DataFrame's
    columns rebuilds its blocks). The arithmetic is numpy's (float64, NaN for missing).
    """
    def take(c: str) -> np.ndarray:
        return np.asarray(raw.pop(c), dtype=np.float64)

    def flags(v: np.ndarray) -> pd.arrays.BooleanArray:  # 1 -> True, 0 -> False, else missing
        return pd.arrays.BooleanArray(v == 1, ~((v == 1) | (v == 0)))

    out: dict[str, object] = {"source": source_column(source, len(raw["task"]))}
    session = np.asarray(raw.pop("session")).astype(np.int64)
    port = np.asarray(raw.pop("port")).astype(np.int64)
    out["session"] = session
    slot_launch, slot_any = take("slot_launch"), take("slot_any")  # the launch's, else any event's
    out["slot"] = _whole(np.where(np.isnan(slot_launch), slot_any, slot_launch))
    out["task_id"] = np.asarray(raw.pop("task")).astype(np.int64)
    launch_us, release_us = take("launch_us"), take("release_us")
    launch_s = _seconds(launch_us)
    anchor = timing_anchor_us(take("eval_us"), take("total_us"))
    total_ms, prompt_eval_ms, eval_ms = take("total_ms"), take("prompt_eval_ms"), take("eval_ms")
    prefill_start_s = prefill_start_us(anchor, total_ms, prompt_eval_ms, eval_ms) / 1e6
    # The stamps' resolution: whole seconds where the launch and the timing line's stamps are
    # (the 2024 JSON and text formats stamp unix seconds) or where the reader says so
    # (``resolution_us``: Ollama's runner lines), else llama.cpp's microseconds. A prefill
    # start derived from a stamp cut to the second can come out before the launch; it cannot
    # have been, and a wait shorter than the resolution is not measured: 0.
    said = np.asarray(raw.pop("resolution_us", np.zeros(len(launch_us))), dtype=np.float64)
    with np.errstate(invalid="ignore"):
        coarse = ((launch_us % 1_000_000 == 0) & (anchor % 1_000_000 == 0)) | (said >= 1_000_000)
        prefill_start_s = np.where(coarse & (prefill_start_s < launch_s), launch_s, prefill_start_s)
    del anchor
    first_token_s = prefill_start_s + prompt_eval_ms / 1000
    # A task without timings (cancelled, cut by a restart) whose client saw tokens: its first
    # heartbeat's tg is the speed since the first token, so that token came (n_gen - 1) / tg
    # before the heartbeat.
    hb_s, hb_n, hb_tps = _seconds(take("heartbeat_us")), take("heartbeat_n_gen"), take("heartbeat_tps")
    with np.errstate(divide="ignore", invalid="ignore"):
        from_hb = hb_s - (hb_n - 1) / hb_tps
    first_token_s = np.where(np.isnan(first_token_s) & np.isfinite(from_hb), from_hb, first_token_s)
    del hb_s, hb_n, hb_tps, from_hb
    release_s = _seconds(release_us)
    wait_ms = (prefill_start_s - launch_s) * 1000
    with np.errstate(invalid="ignore"):
        wait_ms = np.where(coarse & (wait_ms < 1000), 0.0, wait_ms)
    new, n_gen, released = take("prompt_tokens_new"), take("n_gen"), take("n_tokens_released")
    cached = released - n_gen + 1 - new
    with np.errstate(divide="ignore", invalid="ignore"):
        prefill_tps = new / (prompt_eval_ms / 1000)
        gen_tps = (n_gen - 1) / (eval_ms / 1000)
    prefill_tps[np.isinf(prefill_tps)] = np.nan
    gen_tps[np.isinf(gen_tps)] = np.nan
    # Log values have µs (times) and 10 µs (ms fields) resolution; do not print float noise.
    out["launch_s"] = np.round(launch_s, 6)
    out["prefill_start_s"] = np.round(prefill_start_s, 6)
    out["first_token_s"] = np.round(first_token_s, 6)
    out["release_s"] = np.round(release_s, 6)
    out["wait_before_prefill_ms"] = np.round(wait_ms, 3)
    out["prompt_tokens_new"] = _whole(new)
    out["prompt_tokens_cached"] = _whole(cached)
    out["n_gen"] = _whole(n_gen)
    out["prompt_eval_ms"] = prompt_eval_ms
    out["eval_ms"] = eval_ms
    out["prefill_tps"] = np.round(prefill_tps, 3)
    out["gen_tps"] = np.round(gen_tps, 3)
    out["truncated"] = flags(take("truncated"))
    has_release = ~np.isnan(release_us)
    has_timings = ~np.isnan(total_ms) | ~np.isnan(eval_ms)
    flagged = np.nan_to_num(take("cancelled")) > 0
    cancelled = flagged | (has_release & ~has_timings)
    # Complete needs the whole life in the log: a task whose launch came before the log's first
    # line (a log that starts mid-task) is cut at its start, even with its release and timings.
    line = take("line")
    launched = ~np.isnan(line)
    # Taken from the texts as pandas holds text (no numpy array of str to convert).
    out["status"] = _STATUS_TEXT.take(np.where(~launched, 3, np.where(has_release & has_timings & ~flagged, 0,
                                                                      np.where(cancelled, 1, 2))))
    out["line"] = _whole(line)
    # Columns beyond the stable set.
    code = take("file")  # one category per file instead of its path repeated on every row
    out["file"] = pd.Categorical.from_codes(np.where(np.isnan(code), -1, code).astype(np.int64),
                                            categories=pd.Index(files, dtype="str"))
    out["port"] = port
    out["release_line"] = _whole(take("release_line"))
    out["total_ms"] = total_ms
    out["n_tokens_released"] = _whole(released)
    out["prompt_tokens"] = _whole(cached + new)
    out["n_heartbeats"] = np.nan_to_num(take("n_heartbeats")).astype(np.int64)
    out["n_progress"] = np.nan_to_num(take("n_progress")).astype(np.int64)
    out["has_timings"] = has_timings
    out["has_release"] = has_release
    # Cut by a restart: never released, in a session its port's process left (a later one
    # has lines).
    out["cut_by_restart"] = ~has_release & (session < _last_sessions(sessions, port))
    out["time_resolution_s"] = np.where(np.isnan(launch_s), np.nan, np.where(coarse, 1.0, 1e-6))  # (no time: none)
    out["is_child"] = flags(take("is_child"))
    out["error"] = np.nan_to_num(take("error")).astype(bool)
    if with_wall:
        off = _wall_offsets(sessions, port, session)
        for name, us in (("launch_at", off + launch_us), ("release_at", off + release_us),
                         ("prefill_start_at", off + prefill_start_s * 1e6), ("first_token_at", off + first_token_s * 1e6)):
            out[name] = pd.to_datetime(pd.array(np.round(us), dtype="Int64"), unit="us", utc=True)
    return pd.DataFrame(out, copy=False)


def timing_anchor_us(eval_us: np.ndarray, total_us: np.ndarray) -> np.ndarray:
    """The time of a task's timing lines (its eval line's, else its total line's; NaN: none)."""
    with np.errstate(invalid="ignore"):
        anchor = np.where(eval_us >= 0, eval_us, total_us)
        return np.where(anchor >= 0, anchor, np.nan)


def prefill_start_us(anchor_us: np.ndarray, total_ms: np.ndarray, prompt_eval_ms: np.ndarray,
                     eval_ms: np.ndarray) -> np.ndarray:
    """A task's prefill start: its timing lines' time - ``total time`` (or prompt eval + eval)."""
    return anchor_us - np.where(np.isnan(total_ms), prompt_eval_ms + eval_ms, total_ms) * 1000


def _wall_offsets(sessions: pd.DataFrame, port: np.ndarray, session: np.ndarray) -> np.ndarray:
    """Each row's session's wall-clock offset (µs; NaN: none known), looked up among the
    sessions' sorted keys (a MultiIndex per batch took longer)."""
    if not len(sessions) or not len(port):
        return np.full(len(port), np.nan)
    keys = _pair(sessions["port"].to_numpy(dtype=np.int64), sessions["session"].to_numpy(dtype=np.int64))
    order = np.argsort(keys)
    at, hit = _place(keys[order], _pair(port, session))
    wall = sessions["wall_offset_us"].to_numpy(dtype="float64", na_value=np.nan)[order]
    return np.where(hit, wall[at], np.nan)


def _last_sessions(sessions: pd.DataFrame, port: np.ndarray) -> np.ndarray:
    """Each row's port's last session (-1: none known)."""
    out = np.full(len(port), -1, np.int64)
    if len(sessions):
        last = sessions.groupby("port")["session"].max()
        for p, s in zip(last.index.to_numpy(np.int64), last.to_numpy(np.int64)):
            out[port == p] = s
    return out


def _whole(v: np.ndarray) -> pd.arrays.IntegerArray:
    """Counts, slots and lines as nullable integers. A value a float cannot hold exactly
    (beyond 2**53, as a damaged line gives: ``n_tokens = 1e20``) or that is not whole reads as
    missing, not as a wrong number or an error."""
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(v) & (np.abs(v) <= 2.0**53) & (v == np.round(v))
    return pd.arrays.IntegerArray(np.where(ok, v, 0).astype(np.int64), ~ok)


_STATUS_TEXT = pd.Index(["complete", "cancelled", "incomplete", "cut_at_start"]).array  # the dtype pandas gives text


def source_column(source: str, n: int) -> pd.Categorical:
    """The source name as a one-category column (not a string repeated on every row)."""
    return pd.Categorical.from_codes(np.zeros(n, dtype=np.int8), categories=[source])


@dataclass
class SampleBatch:
    """Some sample rows, by position in output order (the first ``skip`` only as context: the
    sample before the batch), and each row's task's first-token time (gen samples).

    Picklable (a worker process can build the batch) when the rows are on disk.
    """

    kind: int
    rows: FinishedRows
    idx: np.ndarray
    skip: int
    first_token: np.ndarray | None
    source: str
    files: list[str]  # the ``file`` column's categories

    def table(self) -> pd.DataFrame:
        return _sample_table(self.kind, self.rows.gather(self.idx), self.source, self.files, self.first_token, self.skip)


@dataclass
class SampleSource:
    """One stream's samples of one kind as read (on disk when spilled): :meth:`table` builds
    the gen (``kind`` HEARTBEAT) or prefill samples table from them, each time it is asked."""

    kind: int
    store: FinishedRows
    source: str
    files: list[str]  # the ``file`` column's categories
    first_tokens: "FirstTokens | None"  # each task's first-token time (gen samples)

    def table(self) -> pd.DataFrame:
        if not len(self.store):
            return empty_samples(self.kind)
        return self.table_of(self.store.gather(self._keys_and_order()[-1]))

    def batches(self, rows: int) -> list["SampleBatch"]:
        """The table as batches of ``rows`` rows, in order (together: :meth:`table`); only the
        sort keys are held meanwhile."""
        if not len(self.store):
            return []
        port, session, task, order = self._keys_and_order()
        batches = []
        for a in range(0, len(order), rows):
            lo = max(a - 1, 0)  # one row of context: the previous sample of the same task
            idx = order[lo : a + rows]
            first_token = self._first_tokens(port[idx], session[idx], task[idx])
            batches.append(SampleBatch(self.kind, self.store, idx, a - lo, first_token, self.source, self.files))
        return batches

    def _keys_and_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each row's port, session and task, and the table's order: by task, then time (ties:
        as read)."""
        port, session, task = (self.store.column(c).astype(np.int64) for c in ("port", "session", "task"))
        return port, session, task, np.lexsort((self.store.column("ts_us"), task, session, port))

    def _first_tokens(self, port: np.ndarray, session: np.ndarray, task: np.ndarray) -> np.ndarray | None:
        """Gen samples: each row's task's first-token time (rows in table order); else None."""
        if self.kind != HEARTBEAT:
            return None
        if self.first_tokens is None:
            return np.full(len(port), np.nan)
        return self.first_tokens.at(port, session, task)

    def table_of(self, cols: dict[str, np.ndarray]) -> pd.DataFrame:
        """:func:`_sample_table` of rows gathered in table order."""
        first_token = self._first_tokens(*(cols[c].astype(np.int64) for c in ("port", "session", "task")))
        return _sample_table(self.kind, cols, self.source, self.files, first_token)


@dataclass
class FirstTokens:
    """Each task's ``first_token_s`` by (port, session, task_id), looked up with one sorted
    int64 key per task (smaller than a pandas MultiIndex): the session's place among
    the sessions, times the number of task ids, plus the task id's place among them."""

    sessions: np.ndarray  # sorted, distinct (port + 1) * 2**32 + session
    ids: np.ndarray  # sorted, distinct task ids
    keys: np.ndarray  # sorted
    values: np.ndarray

    @classmethod
    def of(cls, tasks: pd.DataFrame) -> "FirstTokens":
        port, session, task = (tasks[c].to_numpy(dtype=np.int64) for c in ("port", "session", "task_id"))
        first_token_s = tasks["first_token_s"].to_numpy(dtype=np.float64, na_value=np.nan)
        out = cls(np.unique(_pair(port, session)), np.unique(task), np.zeros(0, np.int64), np.zeros(0))
        keys = out._keys(port, session, task)
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        first = np.flatnonzero(_new_run(keys))  # a task twice: its first row
        out.keys, out.values = keys[first], first_token_s[order[first]]
        return out

    def _keys(self, port: np.ndarray, session: np.ndarray, task: np.ndarray) -> np.ndarray:
        """Each (port, session, task)'s key; -1 where no task of the table can have it."""
        s, s_ok = _place(self.sessions, _pair(port, session))
        t, t_ok = _place(self.ids, task)
        return np.where(s_ok & t_ok, s * len(self.ids) + t, -1)

    def at(self, port: np.ndarray, session: np.ndarray, task: np.ndarray) -> np.ndarray:
        """The first-token time of each (port, session, task) (NaN: no such task); rows of one
        task next to each other (as samples are) are looked up once."""
        new = _new_run(port, session, task)
        starts = np.flatnonzero(new)
        keys = self._keys(port[starts], session[starts], task[starts])
        at, hit = _place(self.keys, keys)
        return np.where(hit & (keys >= 0), self.values[at] if len(self.keys) else np.nan, np.nan)[np.cumsum(new) - 1]


def _pair(port: np.ndarray, session: np.ndarray) -> np.ndarray:
    return (port + 1) * (1 << 32) + session  # ports are -1 (none) to 65535


def _place(sorted_values: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's place in ``sorted_values``, and whether it is there at all."""
    if not len(sorted_values):
        return np.zeros(len(v), np.int64), np.zeros(len(v), bool)
    at = np.minimum(np.searchsorted(sorted_values, v), len(sorted_values) - 1)
    return at, sorted_values[at] == v


def _steps(v: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Each row's value minus the previous row's; NaN where ``new`` (a task's first row)."""
    out = np.full(len(v), np.nan)
    out[1:] = np.diff(v)
    out[new] = np.nan
    return out


def _seconds(us: np.ndarray) -> np.ndarray:
    v = us.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(v >= 0, v, np.nan) / 1e6


def empty_samples(kind: int) -> pd.DataFrame:
    extra = ["tokens", "window_start_s", "line", "port", "file"] if kind == HEARTBEAT else ["step_s", "line", "port", "file"]
    return pd.DataFrame({c: pd.Series(dtype="float64") for c in (GEN_COLUMNS if kind == HEARTBEAT else PREFILL_COLUMNS) + extra})


def _sample_table(kind: int, cols: dict[str, np.ndarray], source: str, files: list[str],
                  first_token: np.ndarray | None, skip: int = 0) -> pd.DataFrame:
    """Sample rows of one kind (``cols``, in output order) as the gen (``first_token``: each
    row's task's first-token time) or prefill samples table, without its first ``skip`` rows
    (context: the sample before a batch). ``file``: the file each sample's line is in (one
    category per file of ``files``; ``line`` counts from that file's start)."""
    port, session, task = (cols[c].astype(np.int64) for c in ("port", "session", "task"))
    new = _new_run(port, session, task)
    t_s = _seconds(cols["ts_us"])
    n = cols["v1"].astype(np.float64)
    step_s, step_n = _steps(t_s, new), _steps(n, new)
    out: dict[str, object] = {"source": None, "session": session, "slot": _whole(cols["slot"]),
                              "task_id": task, "t_s": t_s}
    if kind == HEARTBEAT:
        assert first_token is not None
        # The first heartbeat's window starts at the task's first token (t_print_last is reset there).
        window = np.round(np.where(np.isnan(step_s), t_s - first_token, step_s), 6)
        out.update({
            "n_gen": _whole(n), "tg_tps": cols["v2"].astype(np.float64),
            "tg_3s_tps": cols["v3"].astype(np.float64), "window_s": window,
            "tokens": _whole(np.where(np.isnan(step_n), n, step_n)),
            "window_start_s": np.round(t_s - window, 6)})
    else:
        out.update({
            "n_tokens": _whole(n), "progress": cols["v2"].astype(np.float64),
            "elapsed_s": cols["v3"].astype(np.float64), "tps": cols["v4"].astype(np.float64),
            "step_tokens": _whole(step_n), "step_s": np.round(step_s, 6)})
    out["line"] = cols["line"].astype(np.int64)
    out["port"] = port
    out["file"] = pd.Categorical.from_codes(cols["file"].astype(np.int64), categories=pd.Index(files, dtype="str"))
    if skip:
        out = {c: (v[skip:] if v is not None else None) for c, v in out.items()}  # type: ignore[index]
    out["source"] = source_column(source, len(t_s) - skip)
    return pd.DataFrame(out, copy=False)


def concat_tables(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """The non-empty frames joined, each column categorical in all of them (``source``,
    ``file``) given one set of categories, sorted (so the column sorts as its text does).

    pandas joins categoricals with different categories as text: with two or more server
    logs, ``source`` and ``file`` would become a string per row, and their dtype would
    depend on how many servers were read.
    """
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in columns})
    for c, cats in (joined_categories(frames) if len(frames) > 1 else {}).items():
        frames = [f.assign(**{c: f[c].cat.set_categories(cats)}) for f in frames]
    return pd.concat(frames, ignore_index=True)


def joined_categories(frames: list[pd.DataFrame]) -> dict[str, list[str]]:
    """Per column categorical in all the frames: every frame's categories, sorted."""
    return {c: sorted(set().union(*(f[c].cat.categories for f in frames))) for c in frames[0].columns
            if all(isinstance(f[c].dtype, pd.CategoricalDtype) for f in frames)}


class Samples:
    """A samples table kept as read, on disk, and built when first asked (:meth:`table`):
    the samples are ~5 rows per task, the larger part of a log's tables, and only a few
    analyzers read them."""

    def __init__(self, parts: list[SampleSource], columns: list[str]) -> None:
        self.parts, self.columns = parts, columns
        self._table: pd.DataFrame | None = None

    def table(self) -> pd.DataFrame:
        if self._table is None:
            tables = [p.table() for p in self.parts]
            # (None at all: the empty table with every column a table with rows has.)
            self._table = (concat_tables(tables, self.columns) if any(len(t) for t in tables)
                           else empty_samples(HEARTBEAT if self.columns == GEN_COLUMNS else PROGRESS))
        return self._table

    @property
    def built(self) -> bool:
        return self._table is not None

    def __reduce__(self) -> tuple:
        return table_itself, (self.table(),)  # pickled as its table: the files are this process'
