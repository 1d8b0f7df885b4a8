"""Server clock -> wall clock, per server session.

llama-server stamps lines with time since its process started. To put tasks next to the app's
calls each session needs an offset (the wall time of its clock's zero), in the app's clock:

1. ``--server-start`` given by the user (manual override);
2. the app log: every call whose token counts agree with a task's gives an interval the offset
   must lie in, ``[call start - launch, call end - release]`` (the request is sent before the
   launch and the response ends after the release). The offset is the point covered by the most
   intervals (a sweep over sorted ends): correct pairs all contain it, chance pairs scatter.
   When the app kept the server's ``timings``, the pairs are exact;
3. a wall-clock prefix on the lines (journald, docker, ts): the minimum of stamp - relative
   time, since a wrapper only ever adds lag.

Where both the app log and a wrapper exist, the app's offset is used for matching (it is in the
app's clock) and the difference between the two is reported as the app clock's skew.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .timeline import by_code, key_codes, rows_by_group, within_ranges

SESSION_KEY = ["source", "port", "session"]
ALIGN_COLUMNS = [
    "source", "port", "session", "method", "offset_us", "server_start_at", "support", "spread_ms",
    "wrapper_offset_us", "app_clock_skew_s", "warning",
]
MIN_SUPPORT = 3
# What align reads of the tasks (a caller may pass only these).
TASK_COLUMNS = SESSION_KEY + ["status", "prompt_tokens", "n_gen", "launch_s", "release_s", "prompt_eval_ms", "eval_ms"]


@dataclass(frozen=True)
class Vote:
    """The best-supported offset interval from a set of candidate intervals."""

    low: float
    high: float
    support: int

    @property
    def offset(self) -> float:
        return (self.low + self.high) / 2


def best_interval(lo: np.ndarray, hi: np.ndarray) -> Vote | None:
    """The point range covered by the most ``[lo, hi]`` intervals (sweep over sorted ends)."""
    ok = _usable(lo, hi)
    return _vote(lo[ok], hi[ok])


def _usable(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.isfinite(lo) & np.isfinite(hi) & (hi >= lo)


def _vote(lo: np.ndarray, hi: np.ndarray) -> Vote | None:
    """:func:`best_interval` of usable intervals, sorting ``lo`` and ``hi`` in place."""
    if not len(lo):
        return None
    # Coverage peaks at a start: at a point p, the intervals begun by p and not ended before it.
    # The range runs from the first such p to the first end from p on (a start before that end
    # would cover more than the peak).
    lo.sort()
    hi.sort()
    # The coverage at each start, a block of starts at a time (millions of pairs: bounded
    # temporaries); the first start of the highest coverage.
    i, support = 0, -1
    for a in range(0, len(lo), VOTE_BLOCK):
        cover = np.searchsorted(lo, lo[a:a + VOTE_BLOCK], "right") - np.searchsorted(hi, lo[a:a + VOTE_BLOCK], "left")
        j = int(np.argmax(cover))
        if cover[j] > support:
            i, support = a + j, int(cover[j])
    p = lo[i]
    return Vote(low=float(p), high=float(hi[np.searchsorted(hi, p, "left")]), support=support)


VOTE_BLOCK = 1 << 18  # starts whose coverage is counted at a time


SMALL_KEY = 256  # calls x tasks sharing one token key, beyond which pairs are taken by rank


def candidate_pairs(tasks: pd.DataFrame, calls: pd.DataFrame) -> pd.DataFrame:
    """Call/task pairs whose counts agree: exact ``timings`` where the app kept them, else tokens.
    Per pair: the task's session (``SESSION_KEY``), the interval its clock offset must lie in
    (``lo_us`` = call start - launch, ``hi_us`` = call end - release; µs) and ``exact``.
    (:func:`align` reads them as arrays: :func:`_pair_arrays`.)
    """
    ti, lo, hi, exact = _pair_arrays(tasks, calls)
    return pd.DataFrame({**{k: tasks[k].array.take(ti) for k in SESSION_KEY}, "lo_us": lo, "hi_us": hi, "exact": exact})


def _pair_arrays(tasks: pd.DataFrame, calls: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`candidate_pairs` as arrays: each pair's task (row position), ``lo_us``, ``hi_us``
    and ``exact`` (no session columns repeated on every pair: ~5 pairs a call).

    A token key shared by many calls and tasks (retries, replays, fixed-size batch jobs) would
    make a quadratic join; for such keys the i-th call (by start) is paired only with the
    tasks of nearby rank (by launch) in each session, which keeps the candidates linear and
    still contains the true pairs when the log covers the calls.
    """
    # Row positions and keys only: the pairs (~5 per call where token counts repeat, as with
    # replays) get their columns once, at the end, not through a merge of wide tables per part.
    # (positions as int32 where they fit: every pair-long array of them is half the size)
    tr = _positions(np.flatnonzero((tasks["status"] == "complete").to_numpy(dtype=bool, na_value=False)), len(tasks))
    cr = _positions(np.flatnonzero((calls["prompt_tokens"].notna() & calls["completion_tokens"].notna()).to_numpy()), len(calls))
    key = ["prompt_tokens", "n_gen"]
    c = pd.DataFrame({"prompt_tokens": _ints(calls["prompt_tokens"], cr), "n_gen": _ints(calls["completion_tokens"], cr),
                      "_ci": cr})
    t = pd.DataFrame({**{k: tasks[k].array.take(tr) for k in SESSION_KEY}, "prompt_tokens": _ints(tasks["prompt_tokens"], tr),
                      "n_gen": _ints(tasks["n_gen"], tr), "_ti": tr})
    m = c.groupby(key, observed=True).size().rename("_m")
    n = t.groupby(SESSION_KEY + key, observed=True).size().rename("_n").reset_index()
    n = n.merge(m.reset_index(), on=key)
    big = n[n["_m"] * n["_n"] > SMALL_KEY]
    small_t = t.merge(n[n["_m"] * n["_n"] <= SMALL_KEY][SESSION_KEY + key], on=SESSION_KEY + key)
    parts = [_join(c, small_t[key + ["_ti"]], key)]
    del small_t
    if len(big):
        bt = t.merge(big[SESSION_KEY + key], on=SESSION_KEY + key)
        bt = bt.iloc[np.argsort(tasks["launch_s"].to_numpy(dtype=float)[bt["_ti"].to_numpy()], kind="stable")]
        bt["_rank"] = bt.groupby(SESSION_KEY + key, observed=True).cumcount()
        bt = bt[key + ["_rank", "_ti"]]
        bc = c.merge(big[key].drop_duplicates(), on=key)
        bc = bc.iloc[np.argsort(calls["start_us"].to_numpy(dtype=float)[bc["_ci"].to_numpy()], kind="stable")]
        bc["_rank"] = bc.groupby(key, observed=True).cumcount()
        for d in (-2, -1, 0, 1, 2):
            parts.append(_join(bc.assign(_rank=bc["_rank"] + d), bt, key + ["_rank"]))
        del bc, bt
    del c, t, n, big
    ci, ti = (parts[0][k] if len(parts) == 1 else np.concatenate([p[k] for p in parts]) for k in (0, 1))
    del parts
    # What the vote reads (no ids: a string per pair): each pair's offset interval. A pair whose
    # call kept the server's timings is kept only where they are the task's (then it is exact);
    # those arrays are made only when some call has timings (~5 pairs a call: 22 MB each at
    # 1 GB of log).
    timed = (calls["timings_prompt_ms"].notna() & calls["timings_predicted_ms"].notna()).to_numpy()
    if timed.any():
        prompt_ms, predicted_ms = (calls[k].to_numpy(dtype="float64", na_value=np.nan)[ci] for k in ("timings_prompt_ms", "timings_predicted_ms"))
        has_timings = ~np.isnan(prompt_ms) & ~np.isnan(predicted_ms)
        exact = has_timings & (np.abs(prompt_ms - tasks["prompt_eval_ms"].to_numpy(dtype=float)[ti]) < 0.006) & (
            np.abs(predicted_ms - tasks["eval_ms"].to_numpy(dtype=float)[ti]) < 0.006)
        keep = ~has_timings | exact
        del prompt_ms, predicted_ms, has_timings
        ci, ti, exact = ci[keep], ti[keep], exact[keep]
    else:
        exact = np.zeros(len(ci), dtype=bool)
    lo = calls["start_us"].to_numpy(dtype=float)[ci]
    lo -= _scaled(tasks["launch_s"].to_numpy(dtype=float), ti)
    hi = calls["end_us"].to_numpy(dtype="float64", na_value=np.nan)[ci]
    del ci
    hi -= _scaled(tasks["release_s"].to_numpy(dtype=float), ti)
    return ti, lo, hi, exact


def _positions(rows: np.ndarray, n: int) -> np.ndarray:
    return rows.astype(np.int32) if n < 1 << 31 else rows


def _join(calls: pd.DataFrame, tasks: pd.DataFrame, on: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The ``(_ci, _ti)`` pairs of ``calls.merge(tasks, on=on)``: on one packed integer key
    where the key columns' ranges allow it (:func:`same_key_pairs`), else by the merge. (Their
    order is the vote's no concern: it sorts.)"""
    packed = _packed([calls[k].to_numpy() for k in on], [tasks[k].to_numpy() for k in on])
    if packed is None:
        return _pairs_of(calls.merge(tasks, on=on))
    return same_key_pairs(packed[0], packed[1], calls["_ci"].to_numpy(), tasks["_ti"].to_numpy())


def _packed(left: list[np.ndarray], right: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """Each row's integers (one per column) as one int64, the same way on both sides (None
    where their ranges are too wide for one)."""
    if not (len(left[0]) and len(right[0])):  # no pairs either way
        return np.zeros(len(left[0]), dtype=np.int64), np.zeros(len(right[0]), dtype=np.int64)
    lk = np.zeros(len(left[0]), dtype=np.int64)
    rk = np.zeros(len(right[0]), dtype=np.int64)
    room = 1
    for a, b in zip(left, right):
        low = min(int(a.min()), int(b.min()))
        width = max(int(a.max()), int(b.max())) - low + 1
        room *= width
        if room >= 1 << 62:
            return None
        lk = lk * width + (a - low)
        rk = rk * width + (b - low)
    return lk, rk


PAIR_BLOCK = 1 << 16  # left rows whose pairs are made at a time


def same_key_pairs(lk: np.ndarray, rk: np.ndarray, lrows: np.ndarray, rrows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lrows[i], rrows[j])`` for every ``lk[i] == rk[j]``: the left rows in their order, each
    with the right rows of its key in theirs (pandas 3's order of an inner merge; 2.2's groups
    the left rows by key). Made a block of left rows at a time into arrays sized once: no hash
    table of the keys, no pair-long temporaries of the whole join (at 1 GB of log 2.8M pairs,
    whose merge peaked at 156 MB)."""
    ro = np.argsort(rk, kind="stable")
    rs = rk[ro]
    at = np.searchsorted(rs, lk, "left")
    n = np.searchsorted(rs, lk, "right") - at
    del rs
    li = np.empty(int(n.sum()), dtype=lrows.dtype)
    ri = np.empty(len(li), dtype=rrows.dtype)
    k = 0
    for b in range(0, len(lk), PAIR_BLOCK):
        nb = n[b:b + PAIR_BLOCK]
        m = int(nb.sum())
        li[k:k + m] = np.repeat(lrows[b:b + PAIR_BLOCK], nb)
        ri[k:k + m] = rrows[ro[np.repeat(at[b:b + PAIR_BLOCK], nb) + within_ranges(nb)]]
        k += m
    return li, ri


def _pairs_of(joined: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The call and task rows of a join's pairs, as arrays of their own (the join's other
    columns freed with it, not kept alive by a view of its block)."""
    return joined["_ci"].to_numpy(copy=True), joined["_ti"].to_numpy(copy=True)


def _scaled(seconds: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``seconds[rows] * 1e6`` (one array made, not two)."""
    out = seconds[rows]
    out *= 1e6
    return out


def _ints(col: pd.Series, rows: np.ndarray) -> np.ndarray:
    """``col`` at ``rows`` (counts, none missing there) as int64."""
    return col.to_numpy(dtype="float64", na_value=np.nan)[rows].astype("int64")


def align(
    tasks: pd.DataFrame,
    sessions: pd.DataFrame,
    calls: pd.DataFrame | None,
    *,
    server_start: pd.Timestamp | None = None,
) -> pd.DataFrame:
    """One row per server session: its clock offset (µs since the epoch, app clock) and how it was found."""
    rows = []
    by_session: dict[int, np.ndarray | None] = {}  # each session's pairs (None: all of them)
    scode = np.zeros(len(sessions), dtype=np.int64)
    if calls is not None and len(calls) and len(tasks):
        ti, lo, hi, exact = _pair_arrays(tasks, calls)
        usable = _usable(lo, hi)
        tcode, scode = key_codes([tasks, sessions], SESSION_KEY)
        pcode = tcode[ti]
        del ti, tcode
        if len(pcode) and (pcode == pcode[0]).all():  # one session (the usual case): no row lists
            by_session = {int(pcode[0]): None}
        else:
            by_session = rows_by_group(pcode, np.ones(len(pcode), dtype=bool))
        del pcode
    for i, (_, s) in enumerate(sessions.iterrows()):  # a handful of sessions, not a hot path
        key = (s["source"], s["port"], s["session"])
        wrapper = s.get("wall_offset_us")
        wrapper = None if wrapper is None or pd.isna(wrapper) else float(wrapper)
        row = dict(zip(SESSION_KEY, key), method="none", offset_us=np.nan, support=0, spread_ms=np.nan,
                   wrapper_offset_us=wrapper, app_clock_skew_s=np.nan, warning="")
        vote = None
        if int(scode[i]) in by_session:
            p = by_session[int(scode[i])]
            timed = bool((exact if p is None else exact[p]).any())
            if timed:  # the exact pairs alone
                p = np.flatnonzero(exact) if p is None else p[exact[p]]
            keep = usable if p is None else usable[p]
            if p is None:  # the only session's pairs: voted on as they are (the unusable dropped)
                if not keep.all():
                    lo = lo[keep]
                    hi = hi[keep]
                vote = _vote(lo, hi)
            else:
                vote = _vote(lo[p[keep]], hi[p[keep]])
            if vote is not None:
                row.update(method="app-timings" if timed else "app-tokens", offset_us=vote.offset,
                           support=vote.support, spread_ms=(vote.high - vote.low) / 1e3)
                if vote.support < MIN_SUPPORT:
                    row["warning"] = f"weak evidence: only {vote.support} call(s) agree on this clock offset"
        if server_start is not None:
            row.update(method="manual", offset_us=float(server_start.value // 1000), support=0, spread_ms=np.nan)
        elif (vote is None or vote.support < MIN_SUPPORT) and wrapper is not None:
            row.update(method="wrapper", offset_us=wrapper, support=int(s.get("wall_offset_support") or 0), spread_ms=np.nan,
                       warning="")
        if wrapper is not None and vote is not None and vote.support >= MIN_SUPPORT:
            skew = (vote.offset - wrapper) / 1e6
            row["app_clock_skew_s"] = round(skew, 3)
            if abs(skew) > 1:
                row["warning"] = f"the app's clock is {skew:+.1f} s off the server's wall clock; aligned by the app log"
        if row["method"] == "none":
            row["warning"] = "no clock anchor: no wrapper stamps and no app call whose token counts match a task"
        rows.append(row)
    out = pd.DataFrame(rows, columns=[c for c in ALIGN_COLUMNS if c != "server_start_at"])
    out["server_start_at"] = pd.to_datetime(out["offset_us"].round().astype("Int64"), unit="us", utc=True)
    _warn_overlaps(out, sessions)
    return out[ALIGN_COLUMNS]


def _warn_overlaps(aligned: pd.DataFrame, sessions: pd.DataFrame) -> None:
    """Two sessions of one source whose aligned spans overlap cannot both be right."""
    if len(aligned) < 2:
        return
    span = aligned.merge(sessions[SESSION_KEY + ["first_s", "last_s"]], on=SESSION_KEY)
    span["a"] = span["offset_us"] + span["first_s"] * 1e6
    span["b"] = span["offset_us"] + span["last_s"] * 1e6
    for (src, port), g in span.sort_values("a").groupby(["source", "port"], observed=True):
        prev_b = g["b"].shift(1)
        bad = g["a"] < prev_b - 1e6
        for idx in g.index[bad.to_numpy()]:
            i = aligned.index[(aligned["source"] == src) & (aligned["port"] == port) & (aligned["session"] == span.at[idx, "session"])]
            aligned.loc[i, "warning"] = (aligned.loc[i, "warning"] + "; " if aligned.loc[i, "warning"].any() else "") + "overlaps the previous session after alignment"


def app_clock_offsets(frame: pd.DataFrame, aligned: pd.DataFrame) -> np.ndarray:
    """Per row of ``frame``: its session's clock offset (µs, app clock; NaN where unaligned).
    (A lookup by session code: a merge copied the key columns of every row, 90 MB at 1 GB.)"""
    fcode, acode = key_codes([frame, aligned], SESSION_KEY)
    return by_code(acode, aligned["offset_us"].to_numpy(dtype=np.float64, na_value=np.nan), fcode, np.nan)


def app_clock_us(tasks: pd.DataFrame, aligned: pd.DataFrame) -> dict[str, np.ndarray]:
    """The tasks' times on the app's clock (epoch µs; NaN where unaligned), as arrays:
    ``launch_us``, ``prefill_start_us``, ``first_token_us``, ``release_us``."""
    off = app_clock_offsets(tasks, aligned)
    return {c[:-2] + "_us": off + tasks[c].to_numpy(dtype=float) * 1e6
            for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s")}


def to_app_clock(tasks: pd.DataFrame, aligned: pd.DataFrame) -> pd.DataFrame:
    """Tasks with ``*_us`` columns in the app's clock (epoch µs) for every server-clock time."""
    out = tasks.copy()
    for c, v in app_clock_us(tasks, aligned).items():
        out[c] = v
    return out
