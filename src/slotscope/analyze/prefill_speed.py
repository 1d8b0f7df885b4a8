"""Prefill speed by how many tokens a task advanced in one batch pass, and the effective chunk size.

llama-server prints a ``prompt processing`` progress line once per batch pass after a prefill
has run 3 s. Between two lines of one task, ``step_tokens`` tokens went through in ``step_s``
seconds: one pass. Its speed, ``step_tokens / step_s``, is the task's share of the pass: a pass
shared with another prefill (or with generating slots) takes longer than this task's tokens
alone would, so shared steps read slow. The first progress line of a task has no step (it
covers every pass of the first 3 s) and is left out.

Bins are left-closed: ``64-256`` holds 64 <= step_tokens < 256.

The *effective chunk* is how many prompt tokens one pass takes from one slot: ``n_batch`` minus
one token per slot generating in the same pass. It is read as the largest step size that
recurs (seen at least twice and in at least 5% of the steps of 64+ tokens), falling back to the
most common step when none recurs. The plain mode would under-read it: with three slots
generating, most passes of a ``-b 512`` server advance a prefill by 509 tokens.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, release_memory
from ..server_log import Samples
from . import Options, register
from .context import median_of_counts

EDGES = [1, 64, 256, 600, 1500, 2100, np.inf]
LABELS = ["1-64", "64-256", "256-600", "600-1500", "1500-2100", "2100+"]
LARGE_STEP = 64
RECUR_SHARE = 0.05
PART_ROWS = 1 << 17  # samples a part (at 1 << 18 a part and its gathering were the peak)
COLUMNS = ["step_tokens", "steps", "median_tps", "median_step_tokens", "effective_chunk_tokens", "chunk_steps", "few_samples"]


def _steps(ds: Dataset) -> pd.DataFrame:
    """Every progress step that advanced, as each distinct (``tokens``, ``seconds``) pair and
    how many steps had it (``steps``), sorted. The steps' numbers repeat: tokens are the chunk
    sizes, seconds have six decimals (at 1 GB of log 1.3M lines: 21 sizes, 478 durations)."""
    lazy = ds.server.on_disk("prefill_samples")
    if lazy is not None:
        steps = _steps_as_read(lazy)
        if steps is not None:
            return steps
    # The samples a part at a time where they wait on disk (the table is never built), each
    # part's pairs counted and the part dropped (every step kept took ~+15 MB at 1 GB of log).
    if lazy is not None:  # the samples' index by task first: its making does not stack on a part
        for part in lazy.parts:
            part.index()
        release_memory()
    counted = _pairs(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
    n_parts = 0
    for p in (lazy.batches(PART_ROWS) if lazy is not None else []):
        counted = _add(counted, _steps_of(p))
        n_parts += 1
    return counted if n_parts else _add(counted, _steps_of(ds.server.prefill_samples))


def _steps_as_read(lazy: Samples) -> pd.DataFrame | None:
    """:func:`_steps` from the progress lines as read (log order), five of their columns read
    a stored chunk at a time and taken :data:`SLICE_ROWS` lines at a time, without the table's
    order by task or its other columns: each line's step is from its task's line before it, in
    the slice or, for a task's first line in it, the task's last line of the slices before.
    None where that is not the table's step (a task's time going back, or keys out of range:
    the table sorts those lines by time)."""
    # (The table's parts of 1 << 17 rows, every column, with the samples' index by task, were
    # the table's peak at 1 GB of log: +46 MB; whole chunks of 1 << 18 lines here, +44.)
    counted = _pairs(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
    for part in lazy.parts:
        last = _Last()
        for port, session, task, us, n in part.store.by_chunk("port", "session", "task", "ts_us", "v1"):
            for lo in range(0, len(task), SLICE_ROWS):
                at = slice(lo, lo + SLICE_ROWS)
                pairs = _slice_steps(tl.packed_task_keys(port[at], session[at], task[at]), us[at], n[at], last)
                if pairs is None:
                    return None
                counted = _add(counted, pairs)
            del port, session, task, us, n
            release_memory()  # (a chunk's columns: the next chunk's, a few lines longer, did not fit where they were)
    return counted


SLICE_ROWS = 1 << 16  # progress lines a slice (see _steps_as_read)


class _Last:
    """Each task's last progress line so far: its key (sorted), time (µs) and tokens, in
    arrays with room to grow. A new task's key mostly comes after every key seen (task ids
    grow): appended, not merged (not three arrays of every task seen made anew for each
    slice: at 1 GB of log 183k tasks, 21 slices)."""

    def __init__(self) -> None:
        self.size = 0
        self.key, self.us, self.n = np.zeros(1024, dtype=np.int64), np.zeros(1024, dtype=np.int64), np.zeros(1024)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each of ``keys`` is (an index into the arrays) and whether it is there."""
        if not self.size:
            return np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=bool)
        at = np.minimum(np.searchsorted(self.key[:self.size], keys), self.size - 1)
        return at, self.key[at] == keys

    def set(self, keys: np.ndarray, us: np.ndarray, n: np.ndarray) -> None:
        """These tasks' last lines (``keys`` sorted, distinct) are these."""
        at, hit = self.find(keys)
        self.us[at[hit]], self.n[at[hit]] = us[hit], n[hit]
        new = ~hit
        if not new.any():
            return
        keys, us, n = keys[new], us[new], n[new]
        if self.size and keys[0] < self.key[self.size - 1]:  # (not all after: merged, sorted anew)
            keys, us, n = (np.r_[v[:self.size], w] for v, w in ((self.key, keys), (self.us, us), (self.n, n)))
            order = np.argsort(keys, kind="stable")
            keys, us, n = keys[order], us[order], n[order]
            self.size = 0
        end = self.size + len(keys)
        if end > len(self.key):
            room = max(end, 2 * len(self.key))
            self.key, self.us, self.n = (np.resize(v[:self.size], room) for v in (self.key, self.us, self.n))
        self.key[self.size:end], self.us[self.size:end], self.n[self.size:end] = keys, us, n
        self.size = end


def _slice_steps(key: np.ndarray, us: np.ndarray, n: np.ndarray, last: _Last) -> pd.DataFrame | None:
    """The steps of lines with these task keys, times and tokens (in log order) as
    :func:`_pairs`, ``last`` set to each task's last line after them; None where a key is out
    of range or a task's time goes back."""
    if (key < 0).any():
        return None
    order = np.argsort(key, kind="stable")  # (by task, then as read)
    key, us, n = key[order], us[order].astype(np.int64), n[order].astype(np.float64)
    del order
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, dtype=np.int64)
    prev_us, prev_n = np.r_[np.int64(0), us[:-1]], np.r_[np.nan, n[:-1]]
    has_prev = np.ones(len(key), dtype=bool)
    seen, hit = last.find(key[first])
    prev_us[first] = np.where(hit, last.us[seen], 0)
    prev_n[first] = np.where(hit, last.n[seen], np.nan)
    has_prev[first] = hit
    if (us[has_prev] < prev_us[has_prev]).any():
        return None
    # (as the table computes them: seconds from µs, NaN for a missing time)
    tokens = np.where(has_prev, n - prev_n, np.nan)
    seconds = np.where(has_prev, np.round(_seconds(us) - _seconds(prev_us), 6), np.nan)
    keep = (tokens >= 1) & (seconds > 0)
    ends = np.r_[first[1:] - 1, len(key) - 1] if len(key) else first
    last.set(key[ends], us[ends], n[ends])
    return _pairs(tokens[keep], seconds[keep], np.ones(int(keep.sum()), dtype=np.int64))


def _seconds(us: np.ndarray) -> np.ndarray:
    """Times in µs as the samples table has them in seconds (a negative time: missing, NaN)."""
    v = us.astype(np.float64)
    return np.where(v >= 0, v, np.nan) / 1e6


def _steps_of(p: pd.DataFrame) -> pd.DataFrame:
    tokens, seconds = p["step_tokens"].astype("float64").to_numpy(), p["step_s"].astype("float64").to_numpy()
    keep = (tokens >= 1) & (seconds > 0)
    return _pairs(tokens[keep], seconds[keep], np.ones(int(keep.sum()), dtype=np.int64))


def _pairs(tokens: np.ndarray, seconds: np.ndarray, steps: np.ndarray) -> pd.DataFrame:
    """Each distinct (tokens, seconds) pair, sorted, with the sum of its ``steps``."""
    # (as complex numbers: numpy sorts them by real part, then imaginary, and fast)
    pair, at = np.unique(tokens + 1j * seconds, return_inverse=True)
    return pd.DataFrame({"tokens": pair.real.copy(), "seconds": pair.imag.copy(),
                         "steps": np.bincount(at.reshape(-1), steps, minlength=len(pair)).astype(np.int64)})


def _add(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    return _pairs(*(np.r_[a[c].to_numpy(), b[c].to_numpy()] for c in ("tokens", "seconds", "steps")))


def _chunk(steps: pd.DataFrame) -> tuple[int | None, int]:
    """The effective chunk and how many steps had it: of the steps of 64+ tokens, the largest
    size seen at least twice and in 5% of them, else the largest of the most common sizes."""
    large = steps.loc[steps["tokens"] >= LARGE_STEP]
    if not large["steps"].sum():
        return None, 0
    counts = large.groupby(large["tokens"].astype("int64").to_numpy())["steps"].sum()  # (steps per size)
    recurring = counts[(counts >= 2) & (counts >= RECUR_SHARE * counts.sum())]
    if len(recurring):
        size = int(recurring.index.max())
    else:
        size = int(counts[counts == counts.max()].index.max())
    return size, int(counts[size])


def effective_chunk_tokens(ds: Dataset) -> int | None:
    """Prompt tokens one batch pass takes from one slot (about ``n_batch``), or None without progress lines."""
    return _chunk(_steps(ds))[0]


@register("prefill-speed")
def prefill_speed(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Median prefill tok/s per bin of tokens advanced in one pass, with the effective chunk size."""
    return _table(_steps(ds), opts)


def _table(steps: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """The table of the steps as :func:`_steps` counts them."""
    chunk, chunk_steps = _chunk(steps)
    # Per bin, the steps and the medians of their speeds and sizes, read off each pair's count.
    tps = (steps["tokens"] / steps["seconds"]).to_numpy()
    bins = pd.cut(steps["tokens"], EDGES, right=False, labels=LABELS).cat.codes.to_numpy()
    n, median_tps, median_tokens = [], [], []
    for k in range(len(LABELS)):
        at, count = bins == k, steps["steps"].to_numpy()[bins == k]
        by_tps = np.argsort(tps[at], kind="stable")
        n.append(int(count.sum()))
        median_tps.append(median_of_counts(tps[at][by_tps], count[by_tps]))
        median_tokens.append(median_of_counts(steps["tokens"].to_numpy()[at], count))  # (pairs sorted by tokens)
    table = pd.DataFrame({
        "step_tokens": pd.Categorical(LABELS, categories=LABELS, ordered=True),
        "steps": np.asarray(n, dtype=np.int64),
        "median_tps": pd.Series(median_tps, dtype="float64").round(1),
        "median_step_tokens": pd.Series(median_tokens, dtype="float64"),
    })
    table["step_tokens"] = table["step_tokens"].astype("string")
    table["effective_chunk_tokens"] = pd.array([chunk] * len(table), dtype="Int64")
    table["chunk_steps"] = chunk_steps
    table["few_samples"] = table["steps"] < opts.min_samples
    return table[COLUMNS]
