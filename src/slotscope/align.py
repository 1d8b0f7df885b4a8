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
from typing import Any, Iterator, Mapping

import numpy as np
import pandas as pd

from .timeline import by_code, kept_in_place, key_codes, narrow, rows_by_group, within_ranges

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


def _pair_arrays(tasks: pd.DataFrame, calls: pd.DataFrame, tcode: np.ndarray | None = None,
                 task_of: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Call/task pairs whose counts agree: exact ``timings`` where the app kept them, else
    tokens. Per pair: its task (row position; ``task_of`` given: its value at that position,
    e.g. the task's session), the interval the task's clock offset must lie in (``lo_us`` =
    call start - launch, ``hi_us`` = call end - release; µs) and ``exact`` (no session columns
    repeated on every pair: ~5 pairs a call). ``tcode``: each task's session as a number
    (equal sessions, equal numbers), if the caller has it.

    A token key shared by many calls and tasks (retries, replays, fixed-size batch jobs) would
    make a quadratic join; for such keys the i-th call (by start) is paired only with the
    tasks of nearby rank (by launch) in each session, which keeps the candidates linear and
    still contains the true pairs when the log covers the calls.
    """
    # Row positions and numbers only: a token key and a session as one integer each, groups
    # counted and ranked with numpy (tables and merges of the keys would repeat the sessions'
    # texts on every task).
    # (positions as int32 where they fit: every pair-long array of them is half the size)
    # A complete task may still lack a count: with its eval line missing (no n_gen) or its
    # prompt eval line (no new tokens, so no prompt total). Like a call without counts, it has
    # no token key and pairs with none.
    counted = ((tasks["status"] == "complete").to_numpy(dtype=bool, na_value=False)
               & tasks["prompt_tokens"].notna().to_numpy() & tasks["n_gen"].notna().to_numpy())
    tr = _positions(np.flatnonzero(counted), len(tasks))
    del counted
    cr = _positions(np.flatnonzero((calls["prompt_tokens"].notna() & calls["completion_tokens"].notna()).to_numpy()), len(calls))
    # Each call's and task's token key (prompt tokens, generated tokens) as one number.
    key = dense_codes([np.concatenate([_ints(calls["prompt_tokens"], cr), _ints(tasks["prompt_tokens"], tr)]),
                       np.concatenate([_ints(calls["completion_tokens"], cr), _ints(tasks["n_gen"], tr)])])
    kc, kt = key[:len(cr)], key[len(cr):]
    del key
    if tcode is None:
        tcode = key_codes([tasks], SESSION_KEY)[0]
    group = dense_codes([kt, tcode[tr]])  # each task's (token key, session)
    # A group's candidates: its key's calls times its tasks (a group without calls has none).
    size = np.bincount(kc, minlength=int(kt.max(initial=-1)) + 1)[kt] * np.bincount(group)[group]
    small = size <= SMALL_KEY
    del size
    with_small = np.isin(kc, kt[small])  # (the calls of a key some small group has: the others pair with none there)
    joins = [(kc[with_small], 0, kt[small], cr[with_small], tr[small])]  # (left keys, added to them, right keys, left rows, right rows)
    del with_small
    if not small.all():
        # Tasks of the large groups by launch, each ranked in its group; the calls of their keys
        # by start, each ranked among its key's; a call is paired with the tasks of its key
        # ranked within two of it, in every session.
        bt = np.flatnonzero(~small)
        bt = bt[np.argsort(tasks["launch_s"].to_numpy(dtype=float)[tr[bt]], kind="stable")]
        rank_t = _ranks(group[bt])
        bc = np.flatnonzero(np.isin(kc, kt[bt]))
        bc = bc[np.argsort(calls["start_us"].to_numpy(dtype=float)[cr[bc]], kind="stable")]
        rank_c = _ranks(kc[bc])
        width = int(max(rank_t.max(initial=0), rank_c.max(initial=0))) + 5  # (ranks shifted by -2..2, plus 2)
        rk = kt[bt].astype(np.int64) * width + rank_t + 2
        lk = kc[bc].astype(np.int64) * width + rank_c
        lrows, rrows = cr[bc], tr[bt]
        joins += [(lk, d + 2, rk, lrows, rrows) for d in (-2, -1, 0, 1, 2)]
        del bt, bc, rank_t, rank_c, rk, lk, lrows, rrows
    del kc, kt, group, small
    # What the vote reads of each pair (no ids: a string per pair): its task, its offset
    # interval, whether exact; made a block of pairs at a time into arrays sized once (no
    # pair-long array of calls, no pair-long temporaries: there are several pairs a call).
    # A pair whose call kept the server's timings is kept only where
    # they are the task's (then it is exact).
    total = sum(_count_pairs(lk + shift, rk) for lk, shift, rk, _, _ in joins)
    ti = np.empty(total, dtype=tr.dtype if task_of is None else task_of.dtype)
    lo = np.empty(total, dtype=np.float64)
    hi = np.empty(total, dtype=np.float64)
    exact = np.zeros(total, dtype=bool)
    timed = (calls["timings_prompt_ms"].notna() & calls["timings_predicted_ms"].notna()).to_numpy()
    timings = None
    if timed.any():
        timings = [calls[k].to_numpy(dtype="float64", na_value=np.nan) for k in ("timings_prompt_ms", "timings_predicted_ms")] + \
            [tasks[k].to_numpy(dtype=float) for k in ("prompt_eval_ms", "eval_ms")]
    del timed

    def kept_pairs() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """The pairs kept, a block at a time: call rows, task rows, exact (None: no timings)."""
        for lk, shift, rk, lrows, rrows in joins:
            for ci, tb in _pair_blocks(lk + shift, rk, lrows, rrows):
                if timings is None:
                    yield ci, tb, None
                    continue
                prompt_ms, predicted_ms = timings[0][ci], timings[1][ci]
                has_timings = ~np.isnan(prompt_ms) & ~np.isnan(predicted_ms)
                ex = has_timings & (np.abs(prompt_ms - timings[2][tb]) < 0.006) & (np.abs(predicted_ms - timings[3][tb]) < 0.006)
                keep = ~has_timings | ex
                yield ci[keep], tb[keep], ex[keep]

    # Twice over the pairs: their starts, then their ends (each pass reads two columns, and
    # ``hi`` is untouched until the second).
    start, launch = calls["start_us"].to_numpy(dtype=float), tasks["launch_s"].to_numpy(dtype=float)
    k = 0
    for ci, tb, ex in kept_pairs():
        m = len(ci)
        if ex is not None:
            exact[k:k + m] = ex
        ti[k:k + m] = tb if task_of is None else task_of[tb]
        lo[k:k + m] = start[ci] - launch[tb] * 1e6
        k += m
    del start, launch
    end, release = calls["end_us"].to_numpy(dtype="float64", na_value=np.nan), tasks["release_s"].to_numpy(dtype=float)
    k = 0
    for ci, tb, _ in kept_pairs():
        hi[k:k + len(ci)] = end[ci] - release[tb] * 1e6
        k += len(ci)
    del end, release
    return ti[:k], lo[:k], hi[:k], exact[:k]


def dense_codes(cols: list[np.ndarray]) -> np.ndarray:
    """One integer per row for its tuple of values in ``cols`` (integer arrays of one length):
    equal tuples, equal codes, 0..n-1 in the tuples' sort order. (Any range of values: a sort,
    no packing into one integer that could overflow.)"""
    if not len(cols[0]):
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort(cols[::-1])
    new = np.zeros(len(order), dtype=bool)
    for c in cols:
        v = c[order]
        new[1:] |= v[1:] != v[:-1]
        del v
    code = np.empty(len(order), dtype=np.int64)
    code[order] = np.cumsum(new)
    return code


def _ranks(group: np.ndarray) -> np.ndarray:
    """Each row's place among the rows of its group before it."""
    return pd.Series(group).groupby(group).cumcount().to_numpy(dtype=np.int64)


def _positions(rows: np.ndarray, n: int) -> np.ndarray:
    return rows.astype(np.int32) if n < 1 << 31 else rows


PAIR_BLOCK = 1 << 16  # left rows whose pairs are made at a time


def _count_pairs(lk: np.ndarray, rk: np.ndarray) -> int:
    """How many pairs :func:`same_key_pairs` makes of these keys."""
    rs, ls = np.sort(rk), np.sort(lk)  # (keys looked up in order: numpy's search then starts where the last ended)
    return int((np.searchsorted(rs, ls, "right") - np.searchsorted(rs, ls, "left")).sum())


def _pair_blocks(lk: np.ndarray, rk: np.ndarray, lrows: np.ndarray, rrows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`same_key_pairs`, a block of :data:`PAIR_BLOCK` left rows at a time."""
    ro = _positions(np.argsort(rk, kind="stable"), len(rk))
    rs = rk[ro]
    for b in range(0, len(lk), PAIR_BLOCK):  # (each block's keys looked up as it comes: two fewer key-long arrays)
        at = np.searchsorted(rs, lk[b:b + PAIR_BLOCK], "left")
        nb = np.searchsorted(rs, lk[b:b + PAIR_BLOCK], "right") - at
        yield np.repeat(lrows[b:b + PAIR_BLOCK], nb), rrows[ro[np.repeat(at, nb) + within_ranges(nb)]]


def same_key_pairs(lk: np.ndarray, rk: np.ndarray, lrows: np.ndarray, rrows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lrows[i], rrows[j])`` for every ``lk[i] == rk[j]``: the left rows in their order, each
    with the right rows of its key in theirs (pandas 3's order of an inner merge; 2.2's groups
    the left rows by key). No hash table of the keys: a sort of the right ones, a block of
    left rows at a time (:func:`_pair_blocks`: align reads the pairs so, never whole)."""
    blocks = list(_pair_blocks(lk, rk, lrows, rrows))
    return (np.concatenate([b[0] for b in blocks]) if blocks else lrows[:0].copy(),
            np.concatenate([b[1] for b in blocks]) if blocks else rrows[:0].copy())


def _ints(col: pd.Series, rows: np.ndarray) -> np.ndarray:
    """``col`` at ``rows`` (counts, none missing there: the callers keep only those) as int64."""
    return col.to_numpy(dtype="float64", na_value=np.nan)[rows].astype("int64")


def align(
    tasks: pd.DataFrame,
    sessions: pd.DataFrame,
    calls: pd.DataFrame | None,
    *,
    server_start: pd.Timestamp | None = None,
) -> pd.DataFrame:
    """One row per server session: its clock offset (µs since the epoch, app clock) and how it was found."""
    votes = _app_votes(tasks, sessions, calls)
    # (a handful of sessions, not a hot path)
    rows = [_session_row(s, *votes[i], server_start) for i, (_, s) in enumerate(sessions.iterrows())]
    out = pd.DataFrame(rows, columns=[c for c in ALIGN_COLUMNS if c != "server_start_at"])
    out["server_start_at"] = pd.to_datetime(out["offset_us"].round().astype("Int64"), unit="us", utc=True)
    _warn_overlaps(out, sessions)
    return out[ALIGN_COLUMNS]


def _app_votes(tasks: pd.DataFrame, sessions: pd.DataFrame, calls: pd.DataFrame | None) -> list[tuple[Vote | None, bool]]:
    """Per session (row of ``sessions``): the app calls' vote on its clock offset (None: no
    usable pair), and whether it came from exact pairs (the app kept the server's timings)."""
    votes: list[tuple[Vote | None, bool]] = [(None, False)] * len(sessions)
    if calls is None or not len(calls) or not len(tasks):
        return votes
    tcode, scode = key_codes([tasks, sessions], SESSION_KEY)
    tcode = narrow(tcode)  # (a byte a task where sessions are few: it is held under the pairs)
    # Each pair's session (a byte a pair where they are few), not its task.
    pcode, lo, hi, exact = _pair_arrays(tasks, calls, tcode, task_of=tcode)
    usable = _usable(lo, hi)
    by_session: Mapping[int, np.ndarray | None]  # each session's pairs (None: all of them)
    if len(pcode) and (tcode == tcode[0]).all():  # one session (the usual case): no row lists
        by_session = {int(tcode[0]): None}
    else:
        by_session = rows_by_group(pcode, np.ones(len(pcode), dtype=bool))
    del pcode, tcode
    for i, code in enumerate(scode.tolist()):
        if code in by_session:
            votes[i] = _session_vote(by_session[code], lo, hi, exact, usable)
    return votes


def _session_vote(p: np.ndarray | None, lo: np.ndarray, hi: np.ndarray, exact: np.ndarray,
                  usable: np.ndarray) -> tuple[Vote | None, bool]:
    """The vote of one session's pairs (rows ``p`` of the pair arrays; None: all of them), on
    its exact pairs alone where it has some; and whether it had."""
    timed = bool((exact if p is None else exact[p]).any())
    if timed:
        p = np.flatnonzero(exact) if p is None else p[exact[p]]
    keep = usable if p is None else usable[p]
    if p is None:  # the only session's pairs: voted on as they are (the unusable dropped)
        if not keep.all():
            lo, hi = kept_in_place(lo, keep, PAIR_BLOCK), kept_in_place(hi, keep, PAIR_BLOCK)
        return _vote(lo, hi), timed
    return _vote(lo[p[keep]], hi[p[keep]]), timed


def _session_row(s: pd.Series, vote: Vote | None, timed: bool, server_start: pd.Timestamp | None) -> dict[str, Any]:
    """One session's row of :func:`align`: the offset from the first anchor that holds (the
    user's ``server_start``, the app's vote with enough support, the wrapper's stamps)."""
    wrapper = s.get("wall_offset_us")
    wrapper = None if wrapper is None or pd.isna(wrapper) else float(wrapper)
    row = dict(zip(SESSION_KEY, (s["source"], s["port"], s["session"])), method="none", offset_us=np.nan, support=0,
               spread_ms=np.nan, wrapper_offset_us=wrapper, app_clock_skew_s=np.nan, warning="")
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
        row["warning"] = ("no clock anchor: no wrapper stamps and no app call whose token counts match a task; "
                          "--server-start gives the wall time of the server's clock zero")
    return row


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
    (A lookup by session code: a merge would copy the key columns of every row.)"""
    fcode, acode = key_codes([frame, aligned], SESSION_KEY)
    return by_code(acode, aligned["offset_us"].to_numpy(dtype=np.float64, na_value=np.nan), fcode, np.nan)


def app_clock_us(tasks: pd.DataFrame, aligned: pd.DataFrame) -> dict[str, np.ndarray]:
    """The tasks' times on the app's clock (epoch µs; NaN where unaligned), as arrays:
    ``launch_us``, ``prefill_start_us``, ``first_token_us``, ``release_us``."""
    off = app_clock_offsets(tasks, aligned)
    return {c[:-2] + "_us": off + tasks[c].to_numpy(dtype=float) * 1e6
            for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s")}

