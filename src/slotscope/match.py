"""Calls <-> tasks: a one-to-one join by token counts and time, with a method and a confidence.

Evidence, strongest first:

``timings``      the app kept the server's ``timings``; prompt/predicted counts and ms equal one task's
``tokens+time``  prompt tokens = cached + new tokens of the task, completion tokens = n_gen, and the
                 launch lies inside [call start, call end] on the aligned clock
``time``         no token agreement possible (e.g. a call cut off by a restart): the launch lies
                 inside the call and the release is at the call's end
``start``        a call logged without an end or counts: the task launched soonest after its start

Pairs that are unique both ways are confident. When a call has several candidates (or a task
several calls), ties are resolved by time (the earliest launch after the call's start) and
the match is flagged ``:ambiguous`` with a lower confidence. A task is never assigned twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from .align import SESSION_KEY, app_clock_us
from .store import ColumnWriter, Columns, StoredField, StoredTable
from .timeline import floats, within_ranges

MATCH_COLUMNS = [
    "call_id", "start_at", "purpose", "user", "lora", "prompt_tokens", "completion_tokens", "source",
    "session", "task_id", "slot", "match_method", "confidence", "queue_ms", "wait_before_prefill_ms",
    "prefill_ms", "generation_ms", "ttft_ms", "total_ms",
]
TOLERANCE_MS = 50.0  # app clocks log ms; wrappers and HTTP add a few ms


@dataclass
class Matches:
    """The joined calls, the server tasks no call explains, and the alignment used."""

    calls: pd.DataFrame = StoredField()  # type: ignore[assignment]
    unlogged: pd.DataFrame  # type: ignore[misc]  # (StoredField above is no default: its __get__ raises on the class)
    aligned: pd.DataFrame  # type: ignore[misc]


def _window_pairs(cl: pd.DataFrame, launch: np.ndarray, release: np.ndarray, tol_us: float) -> tuple[np.ndarray, np.ndarray]:
    """Every (call, task) with the task launched inside the call's span (± tolerance) and
    released by its end (± tolerance), as row positions ``(ci, ti)`` in ``cl`` and in the
    tasks' ``launch``/``release`` times (app clock, µs; launch finite).

    A sorted sweep (``searchsorted``): the pairs grow with calls × concurrency, never with
    calls × tasks. A call without an end is given ten minutes.
    """
    order = np.argsort(launch, kind="stable")
    sorted_launch = launch[order]
    start = cl["start_us"].to_numpy(dtype=float)
    end = cl["end_us"].astype("float64").fillna(cl["start_us"].astype("float64") + 600e6).to_numpy()
    lo = np.searchsorted(sorted_launch, start - tol_us, side="left")
    hi = np.searchsorted(sorted_launch, end + tol_us, side="right")
    cnt = np.maximum(hi - lo, 0)
    del start, hi
    # A block of calls at a time: the pairs of the launch window (~2x those kept) and their
    # temporaries are held for one block, not for all calls (several pairs a call).
    parts = []
    for a in range(0, len(cl), CALL_BLOCK):
        n = cnt[a:a + CALL_BLOCK]
        ci = np.repeat(np.arange(a, a + len(n)), n)
        ti = order[np.repeat(lo[a:a + CALL_BLOCK], n) + within_ranges(n)]
        rel = release[ti]
        release_ok = np.isnan(rel) | (rel <= end[ci] + tol_us)
        parts.append((ci[release_ok], ti[release_ok]))
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


CALL_BLOCK = 1 << 16  # calls whose launch-window pairs are made at a time


class _Pairs:
    """Window pairs with the columns the evidence reads, fetched one at a time (a table of all
    of them would hold ~20 columns per pair: calls x concurrency rows), as numpy floats (nullable
    columns taken per pair and compared as pandas compares them would be held twice, with their
    masks). ``ci``/``ti``: rows of ``cl`` and ``tk``; ``us``: the tasks' app-clock times
    (:func:`slotscope.align.app_clock_us`)."""

    def __init__(self, cl: pd.DataFrame, tk: pd.DataFrame, us: dict[str, np.ndarray], ci: np.ndarray, ti: np.ndarray) -> None:
        self.cl, self.tk, self.us, self.ci, self.ti = cl, tk, us, ci, ti

    def call(self, c: str) -> np.ndarray:
        """The pairs' calls' column ``c`` as numbers (NaN: missing or not a number)."""
        return floats(self.cl[c])[self.ci]

    def task(self, c: str) -> np.ndarray:
        """The pairs' tasks' column ``c`` as numbers (NaN: missing or not a number)."""
        return self.us[c][self.ti] if c in self.us else floats(self.tk[c])[self.ti]

    def frame(self, mask: pd.Series | np.ndarray, taken_c: np.ndarray, taken_t: np.ndarray) -> pd.DataFrame:
        """The pairs under ``mask`` whose call and task are not taken yet (those :func:`_assign`
        keeps: the time test's pairs, most of them taken by then, would be match's peak) as
        it reads them: ``_ci``, ``_ti``, ``start_us``, ``launch_us``."""
        m = np.asarray(mask, dtype=bool) & ~taken_c[self.ci] & ~taken_t[self.ti]
        ci, ti = self.ci[m], self.ti[m]
        return pd.DataFrame({"_ci": ci, "_ti": ti, "start_us": self.cl["start_us"].array.take(ci),
                             "launch_us": self.us["launch_us"][ti]})


def _assign(p: pd.DataFrame, method: str, confidence: float, taken_c: np.ndarray, taken_t: np.ndarray) -> list[_Found]:
    """Unique-both-ways pairs are confident; the rest are resolved by time and flagged.

    ``p``: pairs whose call and task are not matched yet (:meth:`_Pairs.frame`);
    ``taken_c``/``taken_t``: which calls and tasks (by ``_ci``/``_ti``) are matched, updated.
    Returns the new pairs (``_ci``, ``_ti``, ``match_method``, ``confidence``)."""
    if p.empty:
        return []
    n_c = p.groupby("_ci", observed=True)["_ti"].transform("size")
    n_t = p.groupby("_ti", observed=True)["_ci"].transform("size")
    unique = ((n_c == 1) & (n_t == 1)).to_numpy()
    ci, ti = p["_ci"].to_numpy()[unique], p["_ti"].to_numpy()[unique]
    taken_c[ci] = True
    taken_t[ti] = True
    out = [_pairs(ci, ti, method, confidence)]
    rest = p[~unique].assign(_lag=lambda d: (d["launch_us"] - d["start_us"]).abs())
    # Ties by time: the pair with the shortest send->launch gap first. Few rows; sequential by nature.
    ambiguous = []
    for c, t in rest.sort_values("_lag")[["_ci", "_ti"]].itertuples(index=False, name=None):
        if taken_c[c] or taken_t[t]:
            continue
        ambiguous.append((c, t))
        taken_c[c] = True
        taken_t[t] = True
    if ambiguous:
        ci, ti = np.array(ambiguous, dtype=np.int64).T
        out.append(_pairs(ci, ti, method + ":ambiguous", round(confidence * 0.6, 2)))
    return out


_Found = tuple[np.ndarray, np.ndarray, str, float]  # calls, their tasks, method, confidence


def _pairs(ci: np.ndarray, ti: np.ndarray, method: str, confidence: float) -> _Found:
    return ci.astype(np.int64), ti.astype(np.int64), method, confidence


def _pairs_table(found: list[_Found]) -> pd.DataFrame:
    """The matched pairs as one table, typed as a table of (call, task, method, confidence) rows is."""
    sizes = [len(f[0]) for f in found]
    if not sum(sizes):
        return pd.DataFrame([], columns=["_ci", "_ti", "match_method", "confidence"])
    return pd.DataFrame({
        "_ci": np.concatenate([f[0] for f in found]), "_ti": np.concatenate([f[1] for f in found]),
        "match_method": [f[2] for f, n in zip(found, sizes) for _ in range(n)],
        "confidence": np.repeat([float(f[3]) for f in found], sizes),
    })


# What match reads of the tasks, beside the unlogged ones' rows (see ``unlogged_rows``).
TASK_COLUMNS = SESSION_KEY + ["task_id", "slot", "status", "file", "line", "prompt_tokens", "prompt_tokens_new",
                              "prompt_tokens_cached", "n_gen", "wait_before_prefill_ms", "prompt_eval_ms", "eval_ms",
                              "launch_s", "prefill_start_s", "first_token_s", "release_s"]


def match(calls: pd.DataFrame | Columns, tasks: pd.DataFrame, aligned: pd.DataFrame, sessions: pd.DataFrame,
          *, tolerance_ms: float = TOLERANCE_MS,
          unlogged_rows: Callable[[np.ndarray], pd.DataFrame] | None = None, on_disk: bool = False) -> Matches:
    """Join every call to at most one task (and every task to at most one call).

    ``calls``: a table, or the columns of one on disk (:class:`slotscope.store.Columns`:
    read as they are needed). ``unlogged_rows(positions)``: the task table's rows at these
    positions, all its columns, where ``tasks`` holds only :data:`TASK_COLUMNS` of it (a
    table waiting on disk). ``on_disk``: the matched calls go to disk as they are made."""
    tol = tolerance_ms * 1000
    # Rows are addressed by position; neither table is copied (both grow with the log).
    tk, cl = _positional(tasks), _positional(calls)
    us = app_clock_us(tk, aligned)
    taken_c = np.zeros(len(cl), dtype=bool)
    taken_t = np.zeros(len(tk), dtype=bool)
    found: list[_Found] = []
    known = np.flatnonzero(np.isfinite(us["launch_us"]))
    ci, ki = _window_pairs(cl, us["launch_us"][known], us["release_us"][known], tol)
    p = _Pairs(cl, tk, us, ci, known[ki])
    del ci, ki, known

    # Each test a column at a time, as numbers per pair (one pair-long array of them at once);
    # a missing number (NaN) equals nothing.
    if "timings_prompt_ms" in cl and not np.isnan(p.call("timings_prompt_ms")).all():
        exact = p.call("timings_prompt_n") == p.task("prompt_tokens_new")
        exact &= p.call("timings_predicted_n") == p.task("n_gen")
        exact &= np.abs(p.call("timings_prompt_ms") - p.task("prompt_eval_ms")) < 0.006
        exact &= np.abs(p.call("timings_predicted_ms") - p.task("eval_ms")) < 0.006
        found += _assign(p.frame(exact, taken_c, taken_t), "timings", 1.0, taken_c, taken_t)
        del exact

    prompt_call, prompt_task = p.call("prompt_tokens"), p.task("prompt_tokens")
    same_prompt = prompt_call == prompt_task
    # Time alone, for calls whose counts cannot agree (cut off, failed, or counted differently).
    agree = np.isnan(prompt_call) | np.isnan(prompt_task) | same_prompt
    del prompt_call, prompt_task
    tokens = same_prompt & (p.call("completion_tokens") == p.task("n_gen"))
    found += _assign(p.frame(tokens, taken_c, taken_t), "tokens+time", 0.99, taken_c, taken_t)
    del tokens, same_prompt
    release, end = p.task("release_us"), p.call("end_us")
    no_end = np.isnan(end)
    at_end = agree & (np.isnan(release) | (np.abs(end - release) < 1e6))
    del release, end
    found += _assign(p.frame(at_end, taken_c, taken_t), "time", 0.5, taken_c, taken_t)
    # A call the app logged with neither an end nor counts: only its start says which task is
    # its own, the one launched soonest after it (one to one, in order of that gap).
    found += _assign(p.frame(agree & no_end, taken_c, taken_t), "start", 0.3, taken_c, taken_t)
    del p, agree, at_end, no_end

    joined = _Joined(cl, tk, us, _pairs_table(found))
    joined.fill_method(_unmatched_reason(cl, np.flatnonzero(~taken_c), us["launch_us"], taken_t, aligned, sessions, tol))
    out = _derive(joined, on_disk)
    rows = np.flatnonzero(~taken_t)
    unlogged = (tk.iloc[rows] if unlogged_rows is None else unlogged_rows(rows)).reset_index(drop=True)
    for c, v in us.items():
        unlogged[c] = v[rows]
    unlogged["busy_s"] = (unlogged["release_s"] - unlogged["launch_s"]).round(6)
    return Matches(calls=out, unlogged=unlogged, aligned=aligned)


def _positional(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with the index 0..n-1 (itself when it has it: no copy)."""
    ix = df.index
    if isinstance(ix, pd.RangeIndex) and ix.start == 0 and ix.step == 1:
        return df
    return df.reset_index(drop=True)


class _Joined:
    """Each call with its task's columns, as ``cl.merge(pairs).merge(tasks)`` (left joins on
    the call) would give them, built a column at a time when read: a task column that is also
    a call column is ``<name>_task``; a task column of calls without a task is missing (NaN,
    and upcast, as a merge fills it)."""

    def __init__(self, cl: pd.DataFrame, tk: pd.DataFrame, us: dict[str, np.ndarray], pairs: pd.DataFrame) -> None:
        self.cl, self.tk, self.us = cl, tk, us
        self.index = cl.index
        ci = pairs["_ci"].to_numpy(dtype=np.int64)
        rows = np.int32 if max(len(tk), len(pairs)) < 2**31 else np.int64  # (a row per call: half the size)
        self._task_row: np.ndarray = np.full(len(cl), -1, dtype=rows)
        self._task_row[ci] = pairs["_ti"].to_numpy(dtype=np.int64)
        self._pair_row = np.full(len(cl), -1, dtype=rows)
        self._pair_row[ci] = np.arange(len(pairs))
        self._pairs = pairs

    def fill_method(self, reasons: pd.Series) -> None:
        """Calls without a task: ``match_method`` is why (``reasons``, one per call)."""
        self._method = self._from(self._pairs["match_method"], self._pair_row).fillna(reasons)

    def _from(self, col: pd.Series, rows: np.ndarray) -> pd.Series:
        return col.reset_index(drop=True).reindex(rows).set_axis(self.index)

    def _task_column(self, c: str) -> pd.Series:
        if c in self.us:
            v = self.us[c]
            r = self._task_row
            return pd.Series(np.where(r >= 0, v[np.maximum(r, 0)] if len(v) else np.nan, np.nan), index=self.index)
        return self._from(self.tk[c], self._task_row)

    def __contains__(self, name: str) -> bool:
        return self._where(name)[0] is not None

    def _where(self, name: str) -> tuple[str | None, str]:
        """Which side has ``name`` ("pair", "call", "task" or None), and its column there."""
        if name == "match_method" or name == "confidence":
            return "pair", name
        if name in self.cl.columns:
            return "call", name
        task = name[:-5] if name.endswith("_task") and name[:-5] in self.cl.columns else name
        return ("task" if task in self.tk.columns or task in self.us else None), task

    def __getitem__(self, name: str) -> pd.Series:
        where, column = self._where(name)
        if where == "call":
            return self.cl[column]
        if where == "task":
            return self._task_column(column)
        if name == "match_method":
            return self._method
        if name == "confidence":
            return self._from(self._pairs["confidence"], self._pair_row)
        raise KeyError(name)

    def get(self, name: str) -> pd.Series | None:
        return self[name] if name in self else None


def _unmatched_reason(cl: pd.DataFrame, rows: np.ndarray, launch_us: np.ndarray, taken_t: np.ndarray, aligned: pd.DataFrame,
                      sessions: pd.DataFrame, tol: float) -> pd.Series:
    """Why each call at ``rows`` (the unmatched ones) found no task, indexed as ``cl`` is (only
    these calls: done for every call, this would be the peak of matching)."""
    span = sessions[SESSION_KEY + ["first_s", "last_s"]].merge(aligned[SESSION_KEY + ["offset_us"]], on=SESSION_KEY)
    a = (span["offset_us"] + span["first_s"] * 1e6).to_numpy(dtype=float)
    b = (span["offset_us"] + span["last_s"] * 1e6).to_numpy(dtype=float)
    start = cl["start_us"].to_numpy(dtype=float)[rows]
    covered = ((start[:, None] >= a[None, :] - tol) & (start[:, None] <= b[None, :] + tol)).any(axis=1) if len(a) else np.zeros(len(rows), bool)
    launches = np.sort(launch_us[~taken_t])
    end = cl["end_us"].to_numpy(dtype="float64", na_value=np.nan)[rows]
    end = np.where(np.isnan(end), start, end)
    i0 = np.searchsorted(launches, start - tol)
    i1 = np.searchsorted(launches, end + tol, side="right")
    in_window = i1 > i0
    failed = ~cl["ok"].to_numpy(dtype=bool)[rows] if "ok" in cl else np.zeros(len(rows), bool)
    # A reason's place in _REASONS per call (the texts themselves as numpy strings would
    # take ~100 bytes a call, twice).
    # A server session the clocks could not be aligned for (the app log gave neither counts nor
    # end times to align on, and no --server-start): its tasks have no time on the app's clock.
    no_clock = len(span) < len(sessions) or not np.isfinite(span["offset_us"].to_numpy(dtype=float)).all()
    code = np.select([~covered & no_clock, ~covered, failed, in_window], [4, 0, 1, 2], 3)
    return pd.Series(np.asarray(_REASONS, dtype=object)[code], index=cl.index[rows])


_REASONS = ["unmatched:no_server_log", "unmatched:call_failed", "unmatched:token_mismatch", "unmatched:no_task_in_window",
            "unmatched:no_clock"]


def _ms(us: pd.Series) -> pd.Series:
    return (us / 1000).round(3)


def _derive(j: _Joined, on_disk: bool = False) -> pd.DataFrame | StoredTable:
    """The matched calls table. ``on_disk``: each column goes to disk as it is made (a
    :class:`slotscope.store.StoredTable`: the table grows with the calls), unless the
    calls are not in time order (then it is sorted whole first)."""
    in_order = "start_at" not in j or j["start_at"].is_monotonic_increasing  # app logs are read in time order
    writer = ColumnWriter("calls") if on_disk and in_order else None
    out = pd.DataFrame(index=j.index)

    def put(c: str, col: object) -> None:
        if writer is None:
            out[c] = col
        else:
            writer.add(c, col if isinstance(col, pd.Series) else pd.Series(col, index=j.index))

    def task(name: str) -> pd.Series:
        return j[f"{name}_task"] if f"{name}_task" in j else j[name]

    def put_call(c: str) -> None:
        """A call's column as it is: on disk already, its file is taken, not read."""
        if writer is None or not isinstance(j.cl, Columns) or c not in j.cl.columns or not writer.add_stored(j.cl.table, c):
            put(c, j.get(c))

    for c in ("call_id", "start_at", "purpose", "user", "lora", "prompt_tokens", "completion_tokens", "source"):
        if j._where(c)[0] == "call":
            put_call(c)
        else:
            put(c, j[c] if c in j else pd.NA)
    put("session", task("session").astype("Int64"))
    put("task_id", j["task_id"].astype("Int64"))
    put("slot", j["slot"].astype("Int64"))
    put("match_method", j["match_method"].astype("category"))  # (a few texts, one per call)
    put("confidence", j["confidence"])
    start = j["start_us"].astype("float64")
    put("queue_ms", _ms(j["launch_us"] - start))
    put("wait_before_prefill_ms", j["wait_before_prefill_ms"])
    put("prefill_ms", j["prompt_eval_ms"])
    put("generation_ms", j["eval_ms"])
    put("ttft_ms", _ms(j["first_token_us"] - start))
    dur = j["duration_ms"] if "duration_ms" in j else pd.Series(np.nan, index=j.index)
    put("total_ms", dur.fillna(_ms(j["release_us"] - start)))
    # More than the stable set: enough to trace every figure back to both logs.
    for c in ("end_at", "cached_tokens", "status", "ok"):
        put_call(c)
    for c in ("prompt_tokens_new", "prompt_tokens_cached", "n_gen"):
        put(c, j[c])
    put("port", j["port"].astype("Int64"))
    put("task_status", task("status").astype("category"))
    for c in ("launch", "first_token", "release"):
        put(f"{c}_at", pd.to_datetime(j[f"{c}_us"].round().astype("Int64"), unit="us", utc=True))
    put("end_lag_ms", _ms(j["end_us"].astype("float64") - j["release_us"]))
    put("call_file", j["file"])
    put("call_line", j["line"])
    put("task_file", task("file"))
    put("task_line", task("line").astype("Int64"))
    if "session" in j and "session_task" in j:
        put("app_session", j["session"])
    if writer is not None:
        return writer.done()
    if not in_order:
        out = out.sort_values("start_at", kind="stable").reset_index(drop=True)
    return StoredTable(out, "calls") if on_disk else out
