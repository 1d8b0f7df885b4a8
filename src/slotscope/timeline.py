"""Intervals per task (queue, wait, prefill, generation), concurrency, and overlap queries.

Everything here works on :func:`slotscope.dataset.task_view` rows and stays on each session's
server clock (seconds, ``*_s``); a session is one ``(source, port, session)`` group. The overlap
questions the analyzers ask ("what did the other slots do while this ran?") are answered by
:func:`overlaps` with step functions and sorted searches, never by pairing every query with
every interval.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pandas as pd

GROUP = ["source", "port", "session"]
PHASES = ("queue", "wait", "prefill", "generation")
PHASE_COLUMNS = [
    "source", "port", "session", "slot", "task_id", "phase", "start_s", "end_s",
    "purpose", "user", "lora", "prompt_tokens_new", "line",
]
CONCURRENCY_COLUMNS = ["source", "port", "session", "start_s", "end_s", "running", "prefilling", "generating", "waiting"]
# Two progress lines (pass ends) of different slots closer than this are the same server pass.
SAME_PASS_S = 0.02
# A step between progress lines longer than this many typical passes hides a pause of the slot.
PAUSE_FACTOR = 1.5
QUERY_BLOCK = 1 << 16  # overlap queries answered at a time (bounds their temporaries)
BLOCK_LEVELS = 4  # blocks of 16 elements in :class:`_BlockRange`


def column(tv: pd.DataFrame, name: str) -> pd.Series:
    """The column ``name`` of ``tv``, all NA where ``tv`` has none."""
    return tv[name] if name in tv.columns else pd.Series(pd.NA, index=tv.index, dtype="object")


def floats(s: pd.Series) -> np.ndarray:
    """A column as float64 (NaN for gaps and what is not a number); a float64 column's own
    values, not a copy."""
    if isinstance(s.dtype, np.dtype) and s.dtype == np.float64:
        return s.to_numpy()
    return pd.to_numeric(s, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)


def task_ends(tv: pd.DataFrame, sessions: pd.DataFrame | None = None) -> np.ndarray:
    """End of each task on its session clock: release, else the session's last line, else the
    latest time known in its session (a task cut by a restart or by the end of the log)."""
    end = floats(tv["release_s"])
    if not np.isnan(end).any():
        return end
    fallback = np.full(len(tv), np.nan)
    if sessions is not None and len(sessions):
        first = sessions.drop_duplicates(GROUP)
        code, scode = key_codes([tv, first], GROUP)
        fallback = by_code(scode, floats(first["last_s"]), code, np.nan)
    else:
        code = key_codes([tv], GROUP)[0]
    # The latest of a task's four times (NaN: none), a column at a time (not a stack of four).
    t = np.fmax(floats(tv["launch_s"]), floats(tv["prefill_start_s"]))
    np.fmax(t, floats(tv["first_token_s"]), out=t)
    np.fmax(t, end, out=t)
    latest = pd.Series(t).groupby(code, observed=True).transform("max").to_numpy(dtype="float64", na_value=np.nan)
    fallback = np.where(np.isnan(fallback), latest, fallback)
    return np.where(np.isnan(end), fallback, end)


def phases(tv: pd.DataFrame) -> pd.DataFrame:
    """One row per task phase: ``queue`` (only where the app gave ``queue_ms``: [launch - queue,
    launch]), ``wait`` ([launch, prefill start]), ``prefill`` ([prefill start, first token]) and
    ``generation`` ([first token, release]). Phases whose ends the log does not give (a task cut
    by a restart) are left out."""
    launch, ps, ft, rel = (floats(tv[c]) for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s"))
    queue = floats(column(tv, "queue_ms")) / 1000
    bounds = {
        "queue": (launch - queue, launch),
        "wait": (launch, ps),
        "prefill": (ps, ft),
        "generation": (ft, rel),
    }
    base = pd.DataFrame({c: column(tv, c) for c in PHASE_COLUMNS if c not in ("phase", "start_s", "end_s")})
    parts = []
    for name, (a, b) in bounds.items():
        ok = b >= a  # (False where an end is NaN)
        parts.append(base[ok].assign(phase=name, start_s=a[ok], end_s=b[ok]))
    out = pd.concat(parts, ignore_index=True)
    out["phase"] = pd.Categorical(out["phase"], categories=list(PHASES))
    out = out.sort_values(GROUP + ["start_s", "slot", "phase"], kind="stable", ignore_index=True)
    return out[PHASE_COLUMNS]


def within_ranges(counts: np.ndarray) -> np.ndarray:
    """For ranges of ``counts`` items laid end to end: each item's place in its range
    (``[0, 1, 0, 1, 2]`` for counts ``[2, 3]``), to expand ranges without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def key_codes(frames: Sequence[pd.DataFrame], by: Sequence[str]) -> list[np.ndarray]:
    """One integer per row of each frame for its ``by`` tuple: equal tuples (NA equal to NA)
    share a code across the frames, and codes follow the tuples' sort order (NA last), so
    sorting by the code sorts by the key columns. Linear (hashing), one column at a time."""
    sizes = [len(f) for f in frames]
    code = np.zeros(sum(sizes), dtype=np.int64)
    combined = False
    for c in by:
        if _one_value([f[c] for f in frames]):  # (one server, one session: the usual case) no code to add
            continue
        cols = [f[c] for f in frames if len(f)] or [frames[0][c]]  # (empty ones add no rows)
        col = pd.concat(cols, ignore_index=True) if len(cols) > 1 else cols[0]
        k, uniq = pd.factorize(col, sort=True, use_na_sentinel=False)
        if combined:
            code = pd.factorize(code * len(uniq) + k, sort=True)[0]  # back to 0..n-1: the next column cannot overflow
        else:
            code, combined = k.astype(np.int64, copy=False), True
    return np.split(code, np.cumsum(sizes)[:-1])


def narrow(code: np.ndarray) -> np.ndarray:
    """Non-negative integers (codes, counts) in the narrowest integer type that holds them."""
    top = int(code.max(initial=0))
    return code.astype(next(t for t in (np.int8, np.int16, np.int32, np.int64) if top <= np.iinfo(t).max))


def by_code(src: np.ndarray, values: np.ndarray, dst: np.ndarray, missing: Any) -> np.ndarray:
    """For each code of ``dst``, the value of the row of ``src`` with that code (``missing``
    where none; codes of one :func:`key_codes` call, unique in ``src``): a lookup by key
    through one array indexed by code."""
    table = np.full(int(max(src.max(initial=-1), dst.max(initial=-1))) + 1, missing, dtype=values.dtype)
    table[src] = values
    return table[dst]


def _one_value(cols: Sequence[pd.Series]) -> bool:
    """Whether these columns hold one value in all their rows, told cheaply for numbers,
    categories and texts (NA counts as a value of its own); False when not sure."""
    values = []
    for col in (c for c in cols if len(c)):
        if isinstance(col.dtype, pd.CategoricalDtype):
            codes = col.cat.codes.to_numpy()
            if codes[0] < 0 or not (codes == codes[0]).all():
                return False
            values.append(col.cat.categories[codes[0]])
        elif isinstance(col.dtype, np.dtype) and col.dtype.kind in "iu":
            v = col.to_numpy()
            if not (v == v[0]).all():
                return False
            values.append(v[0].item())
        elif col.dtype == object or isinstance(col.dtype, pd.StringDtype):  # (a text column, e.g. sessions' source)
            if not isinstance(col.iloc[0], str) or not bool((col == col.iloc[0]).fillna(False).all()):
                return False
            values.append(col.iloc[0])
        else:
            return False
    return all(type(v) is type(values[0]) and v == values[0] for v in values)


def step_levels(tv: pd.DataFrame, sessions: pd.DataFrame | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """The step function of :func:`concurrency` as arrays: each task's session code, whether
    it has an interval, and per step its session's code, ``start``, ``end`` and the ``running``, ``prefilling`` and
    ``generating`` counts; a step begins at each distinct time of a launch, end, prefill start,
    first token or release in the session; sessions in code order, each in time order."""
    launch, ps, ft, rel = (floats(tv[c]) for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s"))
    end = task_ends(tv, sessions)
    runs, pre, gen = (b >= a for a, b in ((launch, end), (ps, ft), (ft, rel)))  # (False where an end is NaN)
    code = key_codes([tv], GROUP)[0]
    # Events: +1 where an interval begins, -1 where it ends, in its count (the other counts: 0).
    picks = [(launch, runs, 0, 1), (end, runs, 0, -1), (ps, pre, 1, 1), (ft, pre, 1, -1), (ft, gen, 2, 1),
             (rel, gen, 2, -1)]
    t = np.concatenate([v[m] for v, m, _, _ in picks])
    g = np.concatenate([code[m] for _, m, _, _ in picks])
    which = np.concatenate([np.full(int(m.sum()), k, dtype=np.int8) for _, m, k, _ in picks])
    delta = np.concatenate([np.full(int(m.sum()), d, dtype=np.int64) for _, m, _, d in picks])
    order = np.lexsort((t, g))
    t, g, which, delta = t[order], g[order], which[order], delta[order]
    # Every session's begins and ends balance, so the running sums need no restart per session;
    # a time's count is the sum after its last event.
    last = np.r_[(t[1:] != t[:-1]) | (g[1:] != g[:-1]), True] if len(t) else np.zeros(0, bool)
    levels = [np.cumsum(np.where(which == k, delta, 0))[last] for k in range(3)]
    t, g = t[last], g[last]
    step = np.flatnonzero(g[1:] == g[:-1]) if len(t) else np.zeros(0, np.int64)
    return code, runs | pre | gen, g[step], t[step], t[step + 1], [v[step] for v in levels]


def concurrency(tv: pd.DataFrame, sessions: pd.DataFrame | None = None) -> pd.DataFrame:
    """Step function per session: how many tasks were ``running`` (launch..release), and of them
    ``prefilling``, ``generating`` and ``waiting`` (launched, prefill not started), over
    [start_s, end_s). It spans each session's first launch to its last release, idle time
    included. A task with no release runs to the session's end (see :func:`task_ends`)."""
    code, used, session, start, stop, levels = step_levels(tv, sessions)
    if not used.any():
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in CONCURRENCY_COLUMNS})
    codes, first = np.unique(code, return_index=True)
    step = tv[GROUP].iloc[first[np.searchsorted(codes, session)]].reset_index(drop=True)
    step["start_s"], step["end_s"] = start, stop
    step["running"], step["prefilling"], step["generating"] = levels
    step["waiting"] = step["running"] - step["prefilling"] - step["generating"]
    return step[CONCURRENCY_COLUMNS]


def kept_in_place(values: np.ndarray, keep: np.ndarray, block: int) -> np.ndarray:
    """``values[keep]``, written over the front of ``values`` a block at a time (a block's are
    written at or before where they were read, after it was read): no copy of ``values``."""
    w = 0
    for at in range(0, len(values), block):
        part = values[at:at + block][keep[at:at + block]]
        values[w:w + len(part)] = part
        w += len(part)
    return values[:w]


class _SparseTable:
    """Range picks (``pick``: max, or leftmost argmax) by sparse table: level k picks between two
    entries of level k-1 2**(k-1) apart, each level made when a range first needs it, and a
    range is answered from two overlapping power-of-two spans."""

    def __init__(self, base: np.ndarray, pick: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self.pick = pick
        self.levels = [base]

    def level(self, k: int) -> np.ndarray:
        while len(self.levels) <= k:
            prev, half = self.levels[-1], 1 << (len(self.levels) - 1)
            self.levels.append(self.pick(prev[:-half], prev[half:]))
        return self.levels[k]

    def pick_of(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The pick over [lo, hi] for ranges that are not empty (in the levels' type)."""
        k = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
        res = np.empty(len(lo), dtype=self.levels[0].dtype)
        for kk in np.unique(k):
            m = k == kk
            lev = self.level(int(kk))
            res[m] = self.pick(lev[lo[m]], lev[hi[m] - (1 << kk) + 1])
        return res


class _BlockRange:
    """Range picks in ~BLOCK_LEVELS + 2 entries per element, not a sparse table's log2(n): a
    sparse table of levels 0..BLOCK_LEVELS answers short ranges and the partial blocks at the
    ends of long ones, a sparse table over the blocks' picks the whole blocks between."""

    def __init__(self, base: np.ndarray, pick: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self.small = _SparseTable(base, pick)  # (asked only for levels 0..BLOCK_LEVELS)
        self.block = 1 << BLOCK_LEVELS
        self.pick = pick

    @cached_property
    def blocks(self) -> _SparseTable:
        """The sparse table over the blocks' picks, made when a long range first asks for it."""
        n = len(self.small.levels[0])
        first = np.arange(0, n, self.block)
        last = np.minimum(first + self.block - 1, n - 1)
        return _SparseTable(self.small.pick_of(first, last) if n else self.small.levels[0][:0], self.pick)

    def query(self, lo: np.ndarray, hi: np.ndarray, empty: int) -> np.ndarray:
        """The pick over [lo, hi] (inclusive); ``empty`` where the range is empty."""
        out = np.full(len(lo), empty, dtype=np.int64)
        length = hi - lo + 1
        short = (length >= 1) & (length < 2 * self.block)
        if short.any():
            out[short] = self.small.pick_of(lo[short], hi[short])
        long_ = length >= 2 * self.block
        if long_.any():
            lo_, hi_ = lo[long_], hi[long_]
            b0, b1 = lo_ // self.block, hi_ // self.block  # (b1 > b0; whole blocks between unless two blocks exactly)
            left = self.small.pick_of(lo_, (b0 + 1) * self.block - 1)
            mid = b1 - b0 >= 2
            if mid.any():
                left[mid] = self.pick(left[mid], self.blocks.pick_of(b0[mid] + 1, b1[mid] - 1))
            right = self.small.pick_of(b1 * self.block, hi_)
            out[long_] = self.pick(left, right)  # (left to right: ties keep the left one)
        return out


def _range_argmax(v: np.ndarray) -> _BlockRange:
    """Position of the maximum of ``v`` over ranges (ties: the left one); int32 positions."""
    return _BlockRange(np.arange(len(v), dtype=np.int32 if len(v) < 2**31 else np.int64),
                       lambda a, b: np.where(v[b] > v[a], b, a))


def rows_by_group(codes: np.ndarray, usable: np.ndarray) -> dict[int, np.ndarray]:
    """Row positions of the usable rows per code, each in row order (one sort, not one scan per group)."""
    idx = np.flatnonzero(usable)
    if len(idx) and (codes[idx] == codes[idx[0]]).all():  # one group (one server session): no sort
        return {int(codes[idx[0]]): idx}
    idx = idx[np.argsort(codes[idx], kind="stable")]
    c = codes[idx]
    cut = np.flatnonzero(np.diff(c)) + 1
    return {int(codes[part[0]]): part for part in np.split(idx, cut) if len(part)}


def overlaps(
    queries: pd.DataFrame,
    intervals: pd.DataFrame,
    *,
    value: str | None = None,
    own_start: np.ndarray | None = None,
    own_end: np.ndarray | None = None,
) -> pd.DataFrame:
    """For each query interval [start_s, end_s], what the ``intervals`` of its session (``GROUP``) did during it.

    Returns, aligned with ``queries``: ``covered_s`` (seconds inside the union of the
    intervals), ``overlap_frac`` (covered_s / query length), ``max_count`` (most intervals
    active at once during the query) and, with ``value``, ``max_value`` (largest ``value`` among
    the intervals overlapping the query) and ``max_pos`` (its row position in ``intervals``, -1
    when none). ``own_start``/``own_end`` name, per query, one member of ``intervals`` to leave
    out of ``covered_s`` and ``max_count`` (e.g. the query task's own running interval); the
    value columns never exclude anything, so pass only other slots' intervals when asking them.
    Zero-length overlaps (touching ends) do not count.
    """
    qs = floats(queries["start_s"])
    qe = floats(queries["end_s"])
    ivs = floats(intervals["start_s"]) if len(intervals) else np.empty(0)
    ive = floats(intervals["end_s"]) if len(intervals) else np.empty(0)
    vals = floats(intervals[value]) if (value is not None and len(intervals)) else None
    if len(queries) and len(intervals):
        qcode, icode = key_codes([queries, intervals], GROUP)
    else:
        qcode, icode = np.zeros(len(queries), dtype=np.int64), np.zeros(len(intervals), dtype=np.int64)
    covered, max_count, max_value, max_pos = overlap_arrays(qcode, qs, qe, icode, ivs, ive, vals=vals,
                                                            own_start=own_start, own_end=own_end,
                                                            need=("covered", "max_count", "max_value"))
    length = qe - qs
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(length > 0, covered / length, np.nan)
    out = pd.DataFrame({"covered_s": covered.round(6), "overlap_frac": np.clip(frac, 0, 1), "max_count": max_count}, index=queries.index)
    if value is not None:
        out["max_value"] = max_value
        out["max_pos"] = max_pos
    return out


_Places = tuple[np.ndarray, np.ndarray, np.ndarray]  # times, their "right" and "left" places among the breakpoints


class _Steps:
    """One group's intervals as a step function on breakpoints ``b``, with what queries ``need``."""

    def __init__(self, ivs: np.ndarray, ive: np.ndarray, grp: np.ndarray, vals: np.ndarray | None,
                 need: tuple[str, ...], has_own: bool) -> None:
        self.b = b = np.unique(np.concatenate([ivs[grp], ive[grp]]))
        # intervals begun by each breakpoint minus those ended by it
        count = np.searchsorted(np.sort(ivs[grp]), b[:-1], "right") - np.searchsorted(np.sort(ive[grp]), b[:-1], "right")
        if "covered" in need:
            # Seconds covered by at least one interval (f1) and, with an own interval to leave
            # out, by at least two (f2), from b[0] to each breakpoint.
            f = [np.concatenate([[0.0], np.cumsum((count >= least) * np.diff(b))]) for least in ((1, 2) if has_own else (1,))]
            self.f1, self.f2 = f[0], f[-1]
        if "max_count" in need:
            self.counts = _BlockRange(narrow(count), np.maximum)  # (counts in their narrowest type)
        del count
        if vals is not None:
            rows = np.flatnonzero(grp) if grp.dtype == bool else grp
            self.ev_val, self.ev_row = _largest_per_step(b, ivs[grp], ive[grp], vals[grp], rows)
            self.values = _range_argmax(self.ev_val)

    def places(self, x: np.ndarray) -> _Places:
        """``x`` with ``searchsorted(b, x)`` "right" and "left", from one search (b is unique)."""
        right = np.searchsorted(self.b, x, "right")
        return x, right, right - (self.b[np.maximum(right - 1, 0)] == x)

    def steps_in(self, a: _Places, z: _Places) -> tuple[np.ndarray, np.ndarray]:
        """The first and last step that (a, z) overlaps."""
        return np.maximum(a[1] - 1, 0), np.minimum(z[2] - 1, len(self.b) - 2)

    def cover(self, a: np.ndarray, z: np.ndarray, f: np.ndarray) -> np.ndarray:
        return np.interp(z, self.b, f) - np.interp(a, self.b, f)

    def covered(self, a: np.ndarray, z: np.ndarray, own: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """Seconds of (a, z) under the intervals, the own one (clipped to the query) left out."""
        if own is None:
            return self.cover(a, z, self.f1)
        c0, c1 = own
        return self.cover(a, z, self.f1) - self.cover(c0, c1, self.f1) + self.cover(c0, c1, self.f2)

    def most(self, a: _Places, z: _Places) -> np.ndarray:
        """Most intervals active at once in (a, z)."""
        lo, hi = self.steps_in(a, z)
        return self.counts.query(lo, np.where(z[0] > a[0], hi, -1), 0)

    def max_count(self, a: _Places, z: _Places, own: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """:meth:`most` in (a, z), the own interval (clipped to the query) left out."""
        if own is None:
            return self.most(a, z)
        p0, p1 = self.places(own[0]), self.places(own[1])
        inside = np.maximum(self.most(p0, p1) - 1, 0)
        return np.maximum.reduce([self.most(a, p0), inside, self.most(p1, z)])

    def largest(self, qi: np.ndarray, a: _Places, z: _Places, max_pos: np.ndarray, max_value: np.ndarray | None) -> None:
        """The row of the interval with the largest value in (a, z), and that value, written
        into the queries' places ``qi`` of ``max_pos`` and ``max_value``."""
        pos = self.values.query(*self.steps_in(a, z), -1)
        got = (pos >= 0) & (self.ev_row[np.maximum(pos, 0)] >= 0)
        max_pos[qi[got]] = self.ev_row[pos[got]]
        if max_value is not None:
            mv = self.ev_val[pos[got]]
            max_value[qi[got]] = np.where(np.isinf(mv), np.nan, mv)


def _both_by_group(qcode: np.ndarray, q_ok: np.ndarray, icode: np.ndarray, i_ok: np.ndarray,
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The usable queries and intervals of each group that has both: positions, or with one
    group (the usual case) masks, whose positions are taken when needed."""
    queries = {int(qcode[0]): q_ok} if bool((qcode == qcode[0]).all()) else rows_by_group(qcode, q_ok)
    one = bool((icode == icode[0]).all())
    for code, grp in ({int(icode[0]): i_ok} if one else rows_by_group(icode, i_ok)).items():
        if code in queries:
            yield queries[code], grp


def overlap_arrays(
    qcode: np.ndarray, qs: np.ndarray, qe: np.ndarray, icode: np.ndarray, ivs: np.ndarray, ive: np.ndarray, *,
    vals: np.ndarray | None = None, own_start: np.ndarray | None = None, own_end: np.ndarray | None = None,
    own_rows: np.ndarray | None = None,
    need: tuple[str, ...] = ("covered", "max_count"),
) -> tuple[Any, Any, Any, Any]:
    """:func:`overlaps` on arrays, groups given as integer codes (see :func:`key_codes`):
    ``(covered_s unrounded, max_count, max_value, max_pos)``, each only when ``need`` names it
    (``max_pos`` whenever ``vals`` is given), else None. ``own_rows``: the own intervals are
    ``own_start[own_rows]``/``own_end[own_rows]``, taken a block of queries at a time."""
    n = len(qs)
    covered = np.zeros(n) if "covered" in need else None
    max_count = np.zeros(n, dtype=np.int64) if "max_count" in need else None
    max_value = np.full(n, np.nan) if vals is not None and "max_value" in need else None
    max_pos = np.full(n, -1, dtype=np.int64) if vals is not None else None
    has_own = own_start is not None and own_end is not None
    os_, oe_ = (np.asarray(own_start, dtype="float64"), np.asarray(own_end, dtype="float64")) if has_own else (qs, qe)
    valid_iv = ive > ivs  # (False where an end is NaN)
    if not (n and valid_iv.any()):
        return covered, max_count, max_value, max_pos
    q_ok = qe > qs
    for q_all, grp in _both_by_group(qcode, q_ok, icode, valid_iv):
        g = _Steps(ivs, ive, grp, vals, need, has_own)
        del grp
        for at in range(0, len(q_all), QUERY_BLOCK):
            qi = np.flatnonzero(q_all[at:at + QUERY_BLOCK]) + at if q_all.dtype == bool else q_all[at:at + QUERY_BLOCK]
            a, z = qs[qi], qe[qi]
            own = None
            if has_own:
                rows = qi if own_rows is None else own_rows[qi]
                own = clip_span(os_[rows], oe_[rows], a, z)
            if covered is not None:
                covered[qi] = g.covered(a, z, own)
            if max_count is None and vals is None:
                continue
            pa, pz = g.places(a), g.places(z)
            if max_count is not None:
                max_count[qi] = g.max_count(pa, pz, own)
            if max_pos is not None:
                g.largest(qi, pa, pz, max_pos, max_value)
    return covered, max_count, max_value, max_pos


def clip_span(s: np.ndarray, e: np.ndarray, a: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The spans [s, e] clipped to [a, z]; empty (at ``z``) where one misses it or has a NaN end."""
    ok = ~np.isnan(s) & ~np.isnan(e)
    cs = np.where(ok, np.clip(s, a, z), z)
    ce = np.where(ok, np.clip(e, a, z), z)
    empty = ~(ce > cs)
    return np.where(empty, z, cs), np.where(empty, z, ce)


def _largest_per_step(b: np.ndarray, s: np.ndarray, e: np.ndarray, v: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step [b[i], b[i+1]) of a group: the largest value among the intervals [s, e) active
    in it (-inf where none or NaN) and the row (from ``rows``) of the one that has it (-1)."""
    j0 = np.searchsorted(b, s)
    lengths = np.searchsorted(b, e) - j0
    rep = np.repeat(np.arange(len(s)), lengths)
    jj = np.repeat(j0, lengths) + within_ranges(lengths)
    val = v[rep]
    val = np.where(np.isnan(val), -np.inf, val)
    o = np.lexsort((val, jj))
    last = np.flatnonzero(np.r_[jj[o][1:] != jj[o][:-1], True])
    ev_val = np.full(len(b) - 1, -np.inf)
    ev_row = np.full(len(b) - 1, -1, dtype=np.int64)
    ev_val[jj[o][last]] = val[o][last]
    ev_row[jj[o][last]] = rows[rep[o][last]]
    return ev_val, ev_row


def count_point_arrays(qcode: np.ndarray, qs: np.ndarray, qe: np.ndarray, pcode: np.ndarray, pt: np.ndarray) -> np.ndarray:
    """How many points (times ``pt``, groups ``pcode``) of each query's group lie inside its
    (``qs``, ``qe``], groups given as integer codes: one sorted search per group,
    :data:`QUERY_BLOCK` queries at a time."""
    out = np.zeros(len(qs), dtype=np.int64)
    points = rows_by_group(pcode, ~np.isnan(pt))
    for code, q_all in rows_by_group(qcode, ~np.isnan(qs) & ~np.isnan(qe)).items():
        p = points.get(code)
        if p is None:
            continue
        tp = np.sort(pt[p])
        for at in range(0, len(q_all), QUERY_BLOCK):
            qi = q_all[at:at + QUERY_BLOCK]
            out[qi] = np.searchsorted(tp, qe[qi], "right") - np.searchsorted(tp, qs[qi], "right")
    return out


PROGRESS_TASK_COLUMNS = GROUP + ["task_id", "slot", "prompt_tokens_new", "line", "prefill_start_s", "first_token_s"]


def progress_lines(tv: pd.DataFrame, prefill_samples: pd.DataFrame | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The prefills of ``tv`` (task keys, slot, ``prompt_tokens_new``, line, floats ``ps``,
    ``ft``, ``new``, ``pid`` = row) and their progress lines (``pid``, ``t_s``, ``n_tokens``,
    ``step_tokens``, ``step_s``; by prefill, then time). ``tv``: at least
    :data:`PROGRESS_TASK_COLUMNS`."""
    keys = GROUP + ["task_id"]
    pre = pd.DataFrame({c: column(tv, c) for c in PROGRESS_TASK_COLUMNS})
    pre["ps"], pre["ft"] = floats(pre["prefill_start_s"]), floats(pre["first_token_s"])
    pre["new"] = floats(pre["prompt_tokens_new"])
    pre = pre[(pre["ft"] > pre["ps"])].drop(columns=["prefill_start_s", "first_token_s"]).reset_index(drop=True)
    pre["pid"] = np.arange(len(pre))
    cols = ["t_s", "n_tokens", "step_tokens", "step_s"]
    samples = prefill_samples if prefill_samples is not None and len(prefill_samples) else pd.DataFrame(columns=keys + cols)
    # Each progress line with its prefill (an inner join on the task keys, in line order).
    at, pid = join_tasks(samples, pre)
    lines = pd.DataFrame({"pid": pid, **{c: floats(samples[c])[at] for c in cols}})
    del at, pid
    ps, ft = pre["ps"].to_numpy(), pre["ft"].to_numpy()
    inside = (lines["t_s"].to_numpy() >= ps[lines["pid"]]) & (lines["t_s"].to_numpy() <= ft[lines["pid"]] + SAME_PASS_S)
    lines = lines[inside]
    lines = lines.iloc[np.lexsort((lines["t_s"].to_numpy(), lines["pid"].to_numpy()))].reset_index(drop=True)
    return pre, lines


def line_steps(pre: pd.DataFrame, lines: pd.DataFrame) -> pd.DataFrame:
    """The steps (``step_tokens``, ``step_s``) of :func:`progress_lines`' ``lines``, with the
    session keys of their prefills in ``pre``."""
    steps = pre[GROUP].iloc[lines["pid"].to_numpy()].reset_index(drop=True)
    steps["step_tokens"], steps["step_s"] = lines["step_tokens"].to_numpy(dtype=float), lines["step_s"].to_numpy(dtype=float)
    return steps


def typical_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """Per session of :func:`line_steps`' ``steps``: the median ``step_tokens`` (``s_chunk``)
    and ``step_s`` (``s_pass``)."""
    g = steps.groupby(GROUP, dropna=False, observed=True, sort=False)
    return aggregate(g, s_chunk=("step_tokens", "median"), s_pass=("step_s", "median")).reset_index()


def aggregate(g: Any, **named: tuple[str, str]) -> pd.DataFrame:
    """``g.agg(**named)`` of a DataFrameGroupBy (``name=(column, function)``), the same frame,
    made a column at a time: pandas' named aggregation builds and factorizes an index of the
    (column, function) pairs on every call, more work than a small table's sums."""
    return pd.DataFrame({name: getattr(g[col], how)() for name, (col, how) in named.items()})


def median(v: np.ndarray) -> float:
    """The median of the values that are not NaN (NaN: none), as a groupby's median (to the
    bit: numpy's median is; its quantiles are not, hence :func:`quantile`)."""
    v = v[~np.isnan(v)]
    return float(np.median(v)) if len(v) else np.nan


def quantile(v: np.ndarray, q: float) -> float:
    """The ``q`` quantile of the values that are not NaN (NaN: none), equal to the bit to
    pandas' groupby quantile."""
    return median_and_quantile(v.copy(), q)[1]


def median_and_quantile(v: np.ndarray, q: float) -> tuple[float, float]:
    """:func:`median` and :func:`quantile` of ``v`` (the same floats) from one sort of ``v``
    itself, which is changed: the caller's own copy. The quantile is linear between the two
    nearest ranks."""
    if np.isnan(v).any():
        v = v[~np.isnan(v)]
    v.sort()
    n = len(v)
    if not n:
        return np.nan, np.nan
    h = n // 2
    med = float(v[h]) if n % 2 else float(np.mean(v[h - 1:h + 1]))  # (as np.median takes the middle two)
    i, frac = int(q * (n - 1)), q * (n - 1) % 1
    return med, float(v[i]) if frac == 0.0 else float(v[i] + (v[i + 1] - v[i]) * frac)


def prefill_steps(tv: pd.DataFrame, prefill_samples: pd.DataFrame | None,
                  typical: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """When each prefill actually ran, as stretches of server passes.

    The server prints a prefilling slot's progress line once per pass (after its first 3 s),
    so the lines' spacing is the pass length, and a co-running slot that shares the batch gets
    one token per pass. A step much longer than the slot's typical pass (``PAUSE_FACTOR``) means
    the slot was left out of batches for a while (another LoRA setting, or a lower slot's prompt
    filled them): only the last typical pass of such a step counts as active. The unlogged head
    (before the first line) and tail (after the last) get ``round(tokens / chunk)`` passes spread
    evenly, ``chunk`` being the slot's usual step (else the session's, else 2048).

    Returns ``(active, steps, info)``: one row per active stretch (task keys, slot, ``start_s``,
    ``end_s``, ``prompt_tokens_new``, ``line``), per stretch of ``p`` passes (``pid``, ``a``,
    ``z``, ``p``, ``pass_s``), and per prefill (task keys, ``pid`` = row, slot,
    ``prompt_tokens_new``, line). ``typical``: :func:`typical_steps` (default: of ``tv``'s lines).
    """
    keys = GROUP + ["task_id"]
    pre, lines = progress_lines(tv, prefill_samples)
    ps, ft = pre["ps"].to_numpy(), pre["ft"].to_numpy()
    # Typical chunk and pass length: the task's own, else its session's, else defaults.
    own = aggregate(lines.groupby("pid", observed=True), chunk=("step_tokens", "median"), pass_s=("step_s", "median"),
                    first_t=("t_s", "first"), first_n=("n_tokens", "first"), last_t=("t_s", "last"), last_n=("n_tokens", "last"))
    sess = typical_steps(line_steps(pre, lines)) if typical is None else typical
    pre = pre.merge(own, left_on="pid", right_index=True, how="left").merge(sess, on=GROUP, how="left")
    del own, sess
    pre["chunk"] = pre["chunk"].fillna(pre["s_chunk"]).fillna(2048.0).clip(lower=1)
    pre["pass_s"] = pre["pass_s"].fillna(pre["s_pass"])

    # Steps: (from, to, passes) — head, one per logged pass, tail; or the whole prefill.
    logged = pre["first_t"].notna().to_numpy()
    prow = pre["pid"].to_numpy()
    first_t, last_t, new, chunk = (pre[c].to_numpy(dtype=float) for c in ("first_t", "last_t", "new", "chunk"))
    first_n, last_n = pre["first_n"].to_numpy(dtype=float), pre["last_n"].to_numpy(dtype=float)
    mid = lines["step_s"].notna().to_numpy()
    m_pid, m_t, m_step = lines["pid"].to_numpy()[mid], lines["t_s"].to_numpy()[mid], lines["step_s"].to_numpy()[mid]
    del lines
    pid = np.concatenate([prow[logged], m_pid, prow[logged], prow[~logged]])
    a = np.concatenate([ps[logged], m_t - m_step, last_t[logged], ps[~logged]])
    z = np.concatenate([first_t[logged], m_t, ft[logged], ft[~logged]])
    p = np.concatenate([
        np.maximum(1, np.round(first_n / chunk))[logged], np.ones(len(m_pid)),
        np.ceil(np.maximum(0, new - last_n) / chunk)[logged],
        np.maximum(1, np.ceil(np.where(np.isnan(new), 1, new) / chunk))[~logged],
    ])
    del m_pid, m_t, m_step
    ok = (z > a) & (p > 0)
    pid, a, z, p = pid[ok], a[ok], z[ok], p[ok]
    pass_s = pre["pass_s"].to_numpy(dtype=float)[pid]
    expected = p * pass_s
    paused = ~np.isnan(expected) & ((z - a) > PAUSE_FACTOR * expected)
    a = np.where(paused, z - expected, a)
    order = np.lexsort((a, pid))
    steps = pd.DataFrame({"pid": pid[order], "a": a[order], "z": z[order], "p": p[order], "pass_s": pass_s[order]})
    del pid, a, z, p, pass_s, expected, paused, order

    # Active stretches: adjacent active steps merged.
    sp, sa, sz = steps["pid"].to_numpy(), steps["a"].to_numpy(), steps["z"].to_numpy()
    new_run = np.ones(len(sp), dtype=bool)
    new_run[1:] = (sp[1:] != sp[:-1]) | (sa[1:] > sz[:-1] + 1e-6)
    run = np.flatnonzero(new_run)
    info = pre[keys + ["pid", "slot", "prompt_tokens_new", "line"]]
    active = info[keys + ["slot"]].iloc[sp[run]].reset_index(drop=True)
    active["start_s"] = np.minimum.reduceat(sa, run) if len(run) else np.zeros(0)
    active["end_s"] = np.maximum.reduceat(sz, run) if len(run) else np.zeros(0)
    active["prompt_tokens_new"] = info["prompt_tokens_new"].array.take(sp[run])
    active["line"] = info["line"].array.take(sp[run])
    return active, steps, info


def _packed(frames: Sequence[pd.DataFrame]) -> list[np.ndarray] | None:
    """One int64 per row of each frame for its (port, session, task_id), sorting as the triple
    does, if the frames have one source and every key fits; else None."""
    if not _one_value([f["source"] for f in frames]):
        return None
    packed = []
    for f in frames:
        cols = [f[c] for c in ("port", "session", "task_id")]
        if any(getattr(c.dtype, "kind", "") not in ("i", "u") or c.isna().any() for c in cols):  # (integers without gaps)
            return None
        port, session, task = (c.to_numpy(dtype=np.int64) for c in cols)
        if not ((port >= -1) & (port <= 65535) & (session >= 0) & (session < 1 << 14) & (task >= 0) & (task < 1 << 32)).all():
            return None
        packed.append(((port + 1) << 46) | (session << 32) | task)
    return packed


def join_tasks(left: pd.DataFrame, right: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Row pairs ``(l, r)`` of ``left`` and ``right`` with equal task keys (``GROUP`` +
    ``task_id``), in left order: an inner merge, on packed int64 keys where they fit (the
    usual case), else on :func:`key_codes`."""
    return _join_unique(*(_packed([left, right]) or key_codes([left, right], GROUP + ["task_id"])))


def _join_unique(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row pairs ``(l, r)`` with ``left[l] == right[r]``, in left order (an inner merge), by a
    sorted search when the right keys are unique, else by a merge."""
    order = np.argsort(right, kind="stable")
    sr = right[order]
    if len(sr) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if len(sr) < 2 or bool((sr[1:] != sr[:-1]).all()):
        at = np.minimum(np.searchsorted(sr, left), len(sr) - 1)
        hit = np.flatnonzero(sr[at] == left)
        return hit, order[at[hit]]
    pairs = pd.DataFrame({"k": left, "l": np.arange(len(left))}).merge(
        pd.DataFrame({"k": right, "r": np.arange(len(right))}), on="k", how="inner")
    return pairs["l"].to_numpy(), pairs["r"].to_numpy()


def pass_ends(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Pass ends of :func:`prefill_steps`' steps, as ``(pid, t_s)`` arrays: ``p`` per step,
    evenly spaced over its active part, the last at its end."""
    p = steps["p"].to_numpy(dtype=np.int64)
    rep = np.repeat(np.arange(len(steps)), p)
    k = within_ranges(p)
    a, z = steps["a"].to_numpy()[rep], steps["z"].to_numpy()[rep]
    pp = p[rep]
    del p
    t = z - (pp - 1 - k) * (z - a) / pp
    return steps["pid"].to_numpy()[rep], t


def server_pass_arrays(code: np.ndarray, t: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pass ends (``code``: each one's session) merged into server passes (ends within
    ``SAME_PASS_S`` are one pass): ``(code, t_s, largest prompt_tokens_new)`` of each pass, in
    session and time order."""
    order = np.lexsort((t, code))
    c, tt, nn = code[order], t[order], new[order]
    del order
    first = np.ones(len(c), dtype=bool)
    first[1:] = (c[1:] != c[:-1]) | (np.diff(tt) > SAME_PASS_S)
    start = np.flatnonzero(first)
    last = np.r_[start[1:] - 1, len(c) - 1] if len(start) else start
    big = np.fmax.reduceat(nn, start) if len(start) else np.zeros(0)
    return c[start], tt[last], big

