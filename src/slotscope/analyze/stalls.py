"""Generation speed by what the other slots did meanwhile (the field report's tg_3s table).

A heartbeat's ``tg_3s`` covers its whole window (3 s, or tens of seconds in a stall), which
usually mixes stalled and normal time, and slots under 100 generated tokens print none, so a
median of ``tg_3s`` values can be ten times off (research/stalls.md). Instead each task's
generation is cut into *segments* with exact token counts: between consecutive heartbeats
(Δn_gen over the window), and the tail from the last heartbeat (or the first token) to the
release. Each segment is then split at what the other slots did:

* ``long_prefill``: time when another slot's prefill of >= ``opts.long_prefill_tokens`` new
  tokens was actually running (pauses in its progress lines removed, see
  :func:`slotscope.timeline.prefill_activity`);
* ``other_prefill``: time when only shorter prefills of other slots ran;
* the rest: ``generation_only`` if another slot was generating during the segment, else
  ``alone``.

Tokens are not apportioned by time (a stall yields one token per server pass, not a share of
the window): a prefill piece gets one token per pass end of the prefilling slot inside it
(its progress lines, one per pass), at most the segment's exact count; the last piece gets
the remainder. A segment that is not split keeps its exact count. Checked against the clients'
chunk times (truth.jsonl), the split pieces' counts are right to within one token. Pieces
shorter than ``MIN_PIECE_S`` are left out of the medians (one stalled pass is ~3.7 s at
n_batch 2048, so a shorter piece reads 0 or 1 token) but kept in the pooled sums; pieces
under ``EPS_S`` are dropped.

The rest of a split segment is ``generation_only`` when another slot generated at any time
during the whole segment, a slight bias away from ``alone``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import store, timeline as tl
from ..dataset import Dataset, release_memory, task_view
from ..errors import SlotscopeError
from ..server_log import Samples
from . import Options, register

CLASSES = ["long_prefill", "other_prefill", "generation_only", "alone"]
STALL_COLUMNS = [
    "class", "samples", "median_tg_3s_tps", "p10_tg_3s_tps", "tokens", "seconds", "tok_per_s_pooled",
    "split_samples", "tasks", "few_samples", "basis",
]
MIN_PIECE_S = 2.0
# Pieces shorter than this are treated as absent when the segment's tokens are shared out.
EPS_S = 0.2
WORST_MIN_S = 3.0

_TASK_KEYS = tl.GROUP + ["task_id"]
# The task view's columns the pieces read (its segments, prefills and blocks).
_VIEW = _TASK_KEYS + ["slot", "line", "n_gen", "prompt_tokens_new"] + tl.TIMES
_SEGMENT_COLUMNS = _TASK_KEYS + ["slot", "start_s", "end_s", "tokens", "kind", "hb_line", "tg_3s_tps", "hb_file"]


_f = tl._f  # (a float64 column's own values, not a copy)


def _positions(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


@dataclass
class _Segments:
    """Generation segments as arrays, in the order of :func:`generation_segments`' rows:
    ``row`` (the task's row in the task view), ``hb`` (the heartbeat's row in ``gen_samples``,
    -1 for tails), ``start``/``end`` (s) and ``tokens``."""

    row: np.ndarray
    hb: np.ndarray
    start: np.ndarray
    end: np.ndarray
    tokens: np.ndarray


def _last_valid(values: np.ndarray, code: np.ndarray, n_codes: int) -> np.ndarray:
    """Per code, the last non-NaN value in row order (NaN where none): a groupby's ``last``."""
    out = np.full(n_codes, np.nan)
    ok = np.flatnonzero(~np.isnan(values))
    out[code[ok]] = values[ok]  # later rows overwrite earlier ones
    return out


def _inner_join(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row pairs ``(l, r)`` with ``left[l] == right[r]``, in left order (as an inner merge):
    a sorted search when the right keys are unique (task keys are), else a merge."""
    order = np.argsort(right, kind="stable")
    sr = right[order]
    if len(sr) < 2 or bool((sr[1:] != sr[:-1]).all()):
        at = np.minimum(np.searchsorted(sr, left), max(len(sr) - 1, 0))
        hit = np.flatnonzero(sr[at] == left) if len(sr) else np.zeros(0, dtype=np.int64)
        return hit, order[at[hit]]
    pairs = pd.DataFrame({"k": left, "l": np.arange(len(left))}).merge(
        pd.DataFrame({"k": right, "r": np.arange(len(right))}), on="k", how="inner")
    return pairs["l"].to_numpy(), pairs["r"].to_numpy()


def _segments(ds: Dataset, tv: pd.DataFrame) -> _Segments:
    """The work of :func:`generation_segments`, kept as arrays (one row per segment)."""
    n_tasks = len(tv)
    first_token = _f(tv["first_token_s"])
    n_gen = pd.to_numeric(tv["n_gen"], errors="coerce").astype("float64").to_numpy(na_value=np.nan)
    gs = ds.server.gen_samples
    n_hb = len(gs) if gs is not None else 0
    idx = _positions(max(n_tasks, n_hb) + 1)
    last_t = np.full(n_tasks, np.nan)
    last_n = np.full(n_tasks, np.nan)
    # Heartbeat windows (each from the previous heartbeat, or the first token, to this one),
    # then tails (from the last heartbeat, or the first token, to the release): as parts.
    parts: list[dict[str, np.ndarray]] = []
    if n_hb:
        gcode, tcode = tl.key_codes([gs, tv], _TASK_KEYS)
        h, r = _inner_join(gcode, tcode)  # each heartbeat with the row of its task
        t_s = _f(gs["t_s"])
        order = np.lexsort((t_s[h], gcode[h]))  # by task, then time
        h, r = h[order].astype(idx), r[order].astype(idx)
        del order
        k, t = gcode[h], t_s[h]
        del gcode, t_s
        n = pd.to_numeric(gs["n_gen"], errors="coerce").astype("float64").to_numpy(na_value=np.nan)[h]
        same = np.zeros(len(h), dtype=bool)
        same[1:] = k[1:] == k[:-1]
        start = np.where(same, np.r_[np.nan, t[:-1]], first_token[r])
        tokens = np.where(same, n - np.r_[np.nan, n[:-1]], n - 1)
        # The last heartbeat of each task: where its tail starts.
        n_codes = int(max(k.max(initial=-1), tcode.max(initial=-1))) + 1
        last_t = _last_valid(t, k, n_codes)[tcode]
        last_n = _last_valid(n, k, n_codes)[tcode]
        del k, n, same, tcode
        parts.append({"row": r, "hb": h, "start": start, "end": t, "tokens": tokens})
        del r, h, start, t, tokens
    d = n_gen - last_n
    parts.append({"row": np.arange(n_tasks, dtype=idx), "hb": np.full(n_tasks, -1, dtype=idx),
                  "start": np.where(np.isnan(last_t), first_token, last_t), "end": _f(tv["release_s"]),
                  "tokens": np.where(np.isnan(d), n_gen - 1, d)})
    del d, last_t, last_n
    # Kept: a positive span and a token count; one column gathered at a time.
    for p in parts:
        ok = np.flatnonzero((p["end"] > p["start"]) & ~np.isnan(p["tokens"]) & (p["tokens"] >= 0))
        for c in p:
            p[c] = p[c][ok]
    col = {c: np.concatenate([p.pop(c) for p in parts]) for c in ("row", "hb", "start")}
    # Session, then start, then slot (NA last); ties keep heartbeats before tails.
    grp = _group_of(ds, tv, col["row"], col["hb"])
    slot = pd.factorize(tv["slot"], sort=True, use_na_sentinel=False)[0][col["row"]]
    order = np.lexsort((slot, col["start"], grp))
    del grp, slot
    out = {c: v[order] for c, v in col.items()}
    del col
    for c in ("end", "tokens"):
        out[c] = np.concatenate([p.pop(c) for p in parts])[order]
    return _Segments(**out)


def _group_of(ds: Dataset, tv: pd.DataFrame, row: np.ndarray, hb: np.ndarray) -> np.ndarray:
    """Sort-order code of each segment's session (the heartbeat's keys, else the task's)."""
    gs = ds.server.gen_samples
    if _keys_from_tasks(ds, tv):
        return tl.key_codes([tv], tl.GROUP)[0][row]
    gcode, tcode = tl.key_codes([gs, tv], tl.GROUP)
    return np.where(hb >= 0, gcode[np.maximum(hb, 0)], tcode[row])


def _segment_frame(ds: Dataset, tv: pd.DataFrame, sg: _Segments) -> pd.DataFrame:
    """:func:`generation_segments`' table from its arrays."""
    gs = ds.server.gen_samples
    is_hb = sg.hb >= 0
    if _keys_from_tasks(ds, tv):  # the heartbeat's keys equal its task's
        out = tv[_TASK_KEYS].iloc[sg.row].reset_index(drop=True)
    else:  # keys as a join of differently typed columns gives them
        hb_rows, tail_rows = np.flatnonzero(is_hb), np.flatnonzero(~is_hb)
        both = pd.concat([gs[_TASK_KEYS].iloc[sg.hb[hb_rows]], tv[_TASK_KEYS].iloc[sg.row[tail_rows]]], ignore_index=True)
        out = both.iloc[np.argsort(np.r_[hb_rows, tail_rows], kind="stable")].reset_index(drop=True)
    out["slot"] = tv["slot"].iloc[sg.row].array
    out["start_s"] = sg.start
    out["end_s"] = sg.end
    out["tokens"] = sg.tokens
    out["kind"] = pd.Series(np.array(["tail", "heartbeat"], dtype=object)[is_hb.astype(np.int8)])
    tg = np.full(len(sg.hb), np.nan)
    if gs is not None and len(gs):
        tg[is_hb] = _f(gs["tg_3s_tps"])[sg.hb[is_hb]]
    out["hb_line"] = _hb_lines(gs, sg.hb)
    out["tg_3s_tps"] = tg
    out["hb_file"] = _hb_files(gs, sg.hb)
    return out[_SEGMENT_COLUMNS]


def _hb_lines(gs: pd.DataFrame | None, hb: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """The heartbeats' lines (Int64), NA where ``hb`` is -1 (a tail)."""
    if gs is None or not len(gs):
        return pd.array([pd.NA] * len(hb), dtype="Int64")
    return gs["line"].astype("Int64").array.take(hb.astype(np.int64), allow_fill=True)


def _hb_files(gs: pd.DataFrame | None, hb: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """The files of the heartbeats' lines (rotated logs number lines per file), NA for tails."""
    if gs is None or not len(gs) or "file" not in gs.columns:
        return pd.array([pd.NA] * len(hb), dtype="string")
    return gs["file"].array.take(hb.astype(np.int64), allow_fill=True)


def generation_segments(ds: Dataset, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each task's generation cut at its heartbeats: one row per window with its exact tokens.

    Columns: task keys, slot, ``start_s``, ``end_s``, ``tokens``, ``kind`` (``heartbeat`` or
    ``tail``), ``hb_line`` (the heartbeat's line; NA for tails), ``tg_3s_tps`` (the logged
    value, for comparison), ``hb_file`` (the file of ``hb_line``: rotated logs number lines per
    file). The first window starts at the first token, which the prefill's last
    pass produced, so it counts ``n_gen - 1`` tokens.
    """
    tv = task_view(ds) if tv is None else tv
    return _segment_frame(ds, tv, _segments(ds, tv))


@dataclass
class _Pieces:
    """Segment pieces as arrays, in :func:`segment_pieces`' row order (every ``long_prefill``
    piece, then every ``other_prefill`` one, then the rest): ``seg`` (row in the segments),
    ``cls`` (index into :data:`CLASSES`), ``seconds``, ``tokens``, ``cause`` (task id of the
    largest other-slot prefill, meaningful where ``has_cause``); per segment ``split``."""

    segments: _Segments
    seg: np.ndarray
    cls: np.ndarray
    seconds: np.ndarray
    tokens: np.ndarray
    cause: np.ndarray
    has_cause: np.ndarray
    split: np.ndarray

    @property
    def tok_per_s(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.tokens / self.seconds


SEGMENT_BLOCK = 1 << 18  # segments split into pieces at a time (bounds the temporaries)


def _pieces(ds: Dataset, opts: Options, tv: pd.DataFrame, typical: pd.DataFrame | None = None) -> _Pieces:
    """The work of :func:`segment_pieces`, kept as arrays.

    Each measure of the segments is one array as long as the log's heartbeats: they are kept
    narrow (positions int32, flags bool) and dropped as soon as read, and memory freed by each
    step is handed back before the next (on the 1 GB bench they are 3.5M segments). ``typical``:
    the sessions' :func:`slotscope.timeline.typical_steps` when ``tv`` is a part of the log.
    """
    sg = _segments(ds, tv)
    release_memory()
    active, steps, info = tl.prefill_steps(tv, ds.server.prefill_samples, typical)
    release_memory()
    thr = opts.long_prefill_tokens
    acode, tcode, icode = tl.key_codes([active, tv, info], tl.GROUP)
    scode = tcode[sg.row].astype(_positions(len(tcode)))  # a segment's session is its task's
    new = _f(active["prompt_tokens_new"])
    a_start, a_end = _f(active["start_s"]), _f(active["end_s"])
    a_task = active["task_id"].to_numpy(dtype=np.int64) if len(active) else np.zeros(0, dtype=np.int64)
    del active
    is_long = new >= thr
    lg, sh = np.flatnonzero(is_long), np.flatnonzero(~is_long)
    qs, qe = sg.start, sg.end

    # Seconds of the segment under long prefills (and the largest one), under any prefill, and
    # the largest short prefill during it (positions in lg / sh; -1: none).
    cov_long, _, _, pos = tl.overlap_arrays(scode, qs, qe, acode[lg], a_start[lg], a_end[lg], vals=new[lg],
                                            need=("covered",))
    pos_long = pos.astype(np.int32)
    cov_any = tl.overlap_arrays(scode, qs, qe, acode, a_start, a_end, need=("covered",))[0]
    pos = tl.overlap_arrays(scode, qs, qe, acode[sh], a_start[sh], a_end[sh], vals=new[sh], need=())[3]
    pos_short = pos.astype(np.int32)
    del pos, acode, a_start, a_end, new
    task_long, task_short = a_task[lg], a_task[sh]
    del a_task, lg, sh
    release_memory()
    # Another slot generating at any time of the segment (its own task's generation left out).
    ft, rel = _f(tv["first_token_s"]), _f(tv["release_s"])
    gen = np.flatnonzero(~np.isnan(ft) & ~np.isnan(rel) & (rel >= ft))
    others_gen = tl.overlap_arrays(scode, qs, qe, tcode[gen], ft[gen], rel[gen], own_start=ft, own_end=rel,
                                   own_rows=sg.row, need=("max_count",))[1] >= 1
    del ft, rel, gen, tcode
    # Server passes (pass ends of all prefills within SAME_PASS_S merged). A pass ending within
    # SAME_PASS_S of the segment's start made its first token; one at its end made the last.
    pid, t = tl.pass_ends(steps)
    del steps
    sp_code, sp_t, sp_new = tl.server_pass_arrays(icode[pid], t, _f(info["prompt_tokens_new"])[pid])
    del pid, t, icode, info
    a, z = qs + tl.SAME_PASS_S, qe + tl.SAME_PASS_S
    p_all = tl.count_point_arrays(scode, a, z, sp_code, sp_t).astype(np.int32)
    sp_long = sp_new >= thr
    p_long = tl.count_point_arrays(scode, a, z, sp_code[sp_long], sp_t[sp_long]).astype(np.int32)
    del scode, sp_code, sp_t, sp_new, sp_long, a, z
    release_memory()

    parts: list[list[list[np.ndarray]]] = []
    split = np.zeros(len(qs), dtype=bool)
    for at in range(0, len(qs), SEGMENT_BLOCK):
        b = slice(at, at + SEGMENT_BLOCK)
        parts.append(_split_segments(at, qe[b] - qs[b], sg.tokens[b], cov_long[b], cov_any[b], p_all[b], p_long[b],
                                     others_gen[b], pos_long[b], task_long, pos_short[b], task_short, split[b]))
    del cov_long, cov_any, p_all, p_long, others_gen, pos_long, pos_short
    # Every long_prefill piece, then every other_prefill one, then the rest (segment order in each).
    col = [np.concatenate([p[c][k] for c in range(3) for p in parts]) if parts else np.zeros(0) for k in range(6)]
    return _Pieces(segments=sg, seg=col[0].astype(_positions(len(qs))), cls=col[1].astype(np.int8), seconds=col[2],
                   tokens=col[3], cause=col[4].astype(np.int64), has_cause=col[5].astype(bool), split=split)


def _split_segments(
    offset: int, dur: np.ndarray, k: np.ndarray, cov_long: np.ndarray, cov_any: np.ndarray, p_all: np.ndarray,
    p_long: np.ndarray, others_gen: np.ndarray, pos_long: np.ndarray, task_long: np.ndarray, pos_short: np.ndarray,
    task_short: np.ndarray, split: np.ndarray,
) -> list[list[np.ndarray]]:
    """Pieces of a block of segments (``offset``: its first segment), per class (long prefill,
    other prefill, rest): ``[segment, class, seconds, tokens, cause, has_cause]``. Fills ``split``.
    The cause of a prefill piece is the task (``task_*``) at the segment's ``pos_*`` (-1: none)."""
    has_long_cause, has_short_cause = pos_long >= 0, pos_short >= 0
    cause_long = task_long[np.maximum(pos_long, 0)] if len(task_long) else np.zeros(len(k), np.int64)
    cause_short = task_short[np.maximum(pos_short, 0)] if len(task_short) else np.zeros(len(k), np.int64)
    s_long = np.minimum(cov_long.round(6), dur)
    s_other = np.clip(cov_any.round(6) - s_long, 0, None)
    s_rest = np.clip(dur - s_long - s_other, 0, None)
    has = [s >= EPS_S for s in (s_long, s_other, s_rest)]
    # Pieces under EPS_S are dropped (the other pieces share the tokens); a segment made only
    # of such pieces keeps its largest one.
    none = ~(has[0] | has[1] | has[2])
    has[2] = has[2] | (none & (s_rest >= s_long) & (s_rest >= s_other))
    has[0] = has[0] | (none & ~has[2] & (s_long >= s_other))
    has[1] = has[1] | (none & ~has[2] & ~has[0])
    last_long = has[0] & ~has[1] & ~has[2]
    last_other = has[1] & ~has[2]
    tok_long = np.where(has[0], np.where(last_long, k, np.minimum(k, p_long)), 0.0)
    rem = k - tok_long
    tok_other = np.where(has[1], np.where(last_other, rem, np.minimum(rem, p_all - p_long)), 0.0)
    tok_rest = np.where(has[2], rem - tok_other, 0.0)
    split[:] = (has[0].astype(np.int8) + has[1] + has[2]) > 1
    rest_cls = np.where(others_gen, CLASSES.index("generation_only"), CLASSES.index("alone")).astype(np.int8)
    out = []
    for c, (secs, toks, cause, has_cause) in enumerate((
        (s_long, tok_long, cause_long, has_long_cause),
        (s_other, tok_other, cause_short, has_short_cause),
        (s_rest, tok_rest, np.zeros(len(k), np.int64), np.zeros(len(k), bool)),
    )):
        i = np.flatnonzero(has[c])
        cls = rest_cls[i] if c == 2 else np.full(len(i), c, np.int8)
        out.append([i + offset, cls, secs[i], toks[i], cause[i], has_cause[i]])
    return out


BLOCK_TASKS = 1 << 14  # tasks whose generation is split into pieces at a time (bounds memory)
# A block ends only where nothing of its session ran for this long: no segment, prefill or
# pass end of one block then reaches into another, so a block's pieces are the whole log's.
QUIET_S = 5.0


def _task_blocks(ds: Dataset, tv: pd.DataFrame | Callable[[list[str]], pd.DataFrame]) -> list[np.ndarray]:
    """The task view's rows in blocks of at least :data:`BLOCK_TASKS` tasks (the last may be
    smaller), each block whole quiet-separated stretches of one session (:data:`QUIET_S`), in
    session and time order; each block's rows ascending. One block when the log is small, or
    when task keys repeat (their heartbeats could not be told apart).

    ``tv``: the view (task keys and times), or what reads those of its columns it is given
    (the view on disk: read a few columns at a time, folded into each task's start and end;
    at 1 GB of log the view's keys and four times, and their copies, were +98 MB on +31)."""
    columns = (lambda names: tv[names]) if isinstance(tv, pd.DataFrame) else tv
    keys = columns(_TASK_KEYS)
    n = len(keys)
    if n <= BLOCK_TASKS or tl.task_keys_repeat(keys):
        return [np.arange(n)]
    session = tl.narrow(tl.key_codes([keys], tl.GROUP)[0])
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    for kind in ("gen_samples", "prefill_samples"):  # a task's lines may outlast its known times
        lo, hi = _sample_spans(ds, kind, keys)
        np.fmin(start, lo, out=start)
        np.fmax(end, hi, out=end)
        del lo, hi
    del keys
    for c in tl.TIMES:
        t = _f(columns([c])[c])
        np.fmin(start, t, out=start)
        np.fmax(end, t, out=end)
        del t
    timeless = np.isnan(start)
    start[timeless] = -np.inf  # (they yield no pieces: kept with their session's first block)
    np.copyto(end, start, where=np.isnan(end))
    order = np.lexsort((start, session))
    s_start, s_end, s_session = start[order], end[order], session[order]
    del start, end, session
    # The latest end so far in the session (ends have no gaps: a running maximum per session,
    # each a stretch of the order; a groupby's cummax held ~20 MB more at 1 GB of log).
    reach = s_end  # (in place: the ends are not read again)
    bounds = np.r_[0, np.flatnonzero(s_session[1:] != s_session[:-1]) + 1, n]
    for a, b in zip(bounds[:-1], bounds[1:]):
        np.maximum.accumulate(s_end[a:b], out=reach[a:b])
    cut = np.ones(n, dtype=bool)
    cut[1:] = (s_session[1:] != s_session[:-1]) | (s_start[1:] > reach[:-1] + QUIET_S)
    del s_start, s_end, reach, s_session
    blocks, at = [], 0
    for b in np.flatnonzero(cut)[1:]:
        if b - at >= BLOCK_TASKS:
            blocks.append(np.sort(order[at:b]))
            at = b
    blocks.append(np.sort(order[at:]))
    return blocks


SPAN_ROWS = 1 << 16  # tasks whose sample spans are looked up at a time (at 1 GB of log all at once: +36 MB)


def _sample_spans(ds: Dataset, kind: str, tv: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each task's first and last sample time of ``kind`` (NaN: none), from the samples on
    disk if they are there."""
    lo, hi = np.full(len(tv), np.nan), np.full(len(tv), np.nan)
    lazy = ds.server.on_disk(kind)
    if lazy is not None and lazy.indexed:  # (looked up 64k tasks at a time: their keys' copies)
        for a in range(0, len(tv), SPAN_ROWS):
            lo[a:a + SPAN_ROWS], hi[a:a + SPAN_ROWS] = lazy.spans(tv.iloc[a:a + SPAN_ROWS])
        return lo, hi
    samples = getattr(ds.server, kind)
    if samples is not None and len(samples):
        scode, tc = tl.key_codes([samples, tv], _TASK_KEYS)
        t = pd.Series(_f(samples["t_s"])).groupby(scode).agg(["min", "max"])
        at = np.searchsorted(t.index.to_numpy(), tc)
        hit = at < len(t)
        hit[hit] = t.index.to_numpy()[at[hit]] == tc[hit]
        lo[hit], hi[hit] = t["min"].to_numpy()[at[hit]], t["max"].to_numpy()[at[hit]]
    return lo, hi


def _rows_of(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(order, sorted codes)``: to find every row of some codes by :func:`_rows_with`."""
    order = np.argsort(code, kind="stable")
    return order, code[order]


def _rows_with(index: tuple[np.ndarray, np.ndarray], codes: np.ndarray) -> np.ndarray:
    """The rows (ascending) whose code is one of ``codes`` (distinct)."""
    order, sorted_codes = index
    lo, hi = np.searchsorted(sorted_codes, codes, "left"), np.searchsorted(sorted_codes, codes, "right")
    cnt = hi - lo
    return np.sort(order[np.repeat(lo, cnt) + tl.within_ranges(cnt)])


def _blockwise(ds: Dataset, tv: pd.DataFrame, blocks: list[np.ndarray],
               block_view: Callable[[np.ndarray], pd.DataFrame] | None = None) -> Iterator[tuple[np.ndarray, Dataset, pd.DataFrame]]:
    """Per block of :func:`_task_blocks`: its rows in the task view, a dataset of only its
    samples, and its part of the view (``block_view(rows)``; default ``tv.iloc[rows]``, then
    ``tv`` has every column the pieces read, else the task keys at least). One block: the
    dataset and ``tv`` themselves."""
    if len(blocks) == 1:
        yield blocks[0], ds, tv
        return
    server = ds.server
    # Each block's samples: read from disk for its tasks where they wait there (the whole
    # table is never built), else taken from the table.
    found = []
    for kind in ("gen_samples", "prefill_samples"):
        lazy = server.on_disk(kind)
        if lazy is not None and lazy.indexed:
            found.append((lazy, None, None))
            continue
        samples = getattr(server, kind)
        if samples is not None and len(samples):
            scode, tcode = tl.key_codes([samples, tv], _TASK_KEYS)
            found.append((samples, _rows_of(scode), tcode))
        else:
            found.append((samples, None, None))
    for rows in blocks:
        part = []
        tvb = tv.iloc[rows] if block_view is None else block_view(rows)
        for samples, index, tcode in found:
            if isinstance(samples, Samples):
                part.append(samples.of_tasks(tvb))
            else:
                part.append(samples if index is None else samples.iloc[_rows_with(index, np.unique(tcode[rows]))])
        sub = dataclasses.replace(ds, server=dataclasses.replace(server, tasks=store.raw(server, "tasks"),  # (not built)
                                                                 gen_samples=part[0], prefill_samples=part[1]))
        yield rows, sub, tvb


class _PieceParts:
    """The long-enough pieces' class, tok/s, split flag and task (its row in the task view), a
    block's at a time in files of a temporary directory, read back a few columns at a time (at
    1 GB of log 3.1M pieces, 44 MB, were held under the later blocks' work)."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="slotscope-")
        self.paths: list[str] = []

    def add(self, cls: np.ndarray, tok_per_s: np.ndarray, split: np.ndarray, task: np.ndarray) -> None:
        path = os.path.join(self._tmp.name, f"{len(self.paths)}.npz")
        try:
            np.savez(path, cls=cls, tok_per_s=tok_per_s, split=split, task=task)
        except OSError as e:
            raise SlotscopeError(getattr(e, "filename", None) or tempfile.gettempdir(), None,
                                 f"cannot write the stalls' pieces to the temporary directory ({e.strerror or e}); "
                                 "set TMPDIR to a directory with room") from None
        self.paths.append(path)

    def columns(self, *names: str) -> Iterator[tuple[np.ndarray, ...]]:
        """These columns of each block's pieces, a block at a time."""
        for path in self.paths:
            with np.load(path) as z:
                yield tuple(z[n] for n in names)


@dataclass
class _Summary:
    """What the stalls tables read of the pieces, gathered block by block: per piece of at
    least ``MIN_PIECE_S``, its class, tok/s, split flag and task (:class:`_PieceParts`; tasks
    are rows of a view of ``n_tasks``); per class, the tokens and seconds of all pieces; the
    slowest pieces of at least ``WORST_MIN_S`` (rows as :func:`_pieces_frame` gives them)."""

    pieces: _PieceParts
    n_tasks: int
    tokens: np.ndarray
    seconds: np.ndarray
    worst: pd.DataFrame


# What the sessions' typical prefill steps are read from (:func:`slotscope.timeline.typical_steps`).
_PREFILL_VIEW = _TASK_KEYS + ["prefill_start_s", "first_token_s"]
TYPICAL_ROWS = 1 << 16  # prefill samples read at a time for the typical steps (a part: ~10 MB)


def _summary(ds: Dataset, opts: Options) -> _Summary:
    view = ds._view  # (after Dataset.keep_on_disk: columns and rows read as needed)
    typical = None  # a prefill without progress lines is read with its whole session's typical step
    if view is not None:
        # One step at a time, each on little else: the prefill samples' index, the sessions'
        # typical steps (wanted where the log may make several blocks; equal to what one block
        # finds by itself), the gen samples' index, and then the view's columns the blocks
        # are cut by (at 1 GB of log, with the view whole and both indexes under each: ~450 MB).
        lazy = ds.server.on_disk("prefill_samples")  # (then read in parts, not built)
        if lazy is not None:
            lazy.indexed
            release_memory()
        if ds.n_tasks > BLOCK_TASKS:
            pre = tl.PrefillKeys.of(task_view(ds, _PREFILL_VIEW))
            release_memory()  # (the view's columns: ~24 MB at 1 GB of log, not under the lines)
            typical = tl.typical_steps(pre if pre is not None else task_view(ds, _PREFILL_VIEW),
                                       lazy.batches(TYPICAL_ROWS) if lazy is not None else ds.server.prefill_samples)
            del pre
            release_memory()
        lazy = ds.server.on_disk("gen_samples")
        if lazy is not None:
            lazy.indexed
            release_memory()
    if view is not None:  # (the columns the blocks are cut by read a few at a time)
        n_tasks = len(view)
        blocks = _task_blocks(ds, lambda names: view.read(names))
    else:
        tv = task_view(ds, _VIEW)
        n_tasks = len(tv)
        blocks = _task_blocks(ds, tv)
    release_memory()
    block_view = None
    if len(blocks) > 1:
        # Several blocks (task keys unique): a task is its row in the view. Where the view is
        # on disk each block reads its rows of it; the whole view is never held.
        task_code = None
        if view is not None:
            block_view = lambda rows: view.take(rows, _VIEW).set_axis(pd.Index(rows))  # noqa: E731
            indexed = all(ds.server.on_disk(k) is not None and ds.server.on_disk(k).indexed or not len(getattr(ds.server, k))
                          for k in ("gen_samples", "prefill_samples"))  # (else _blockwise looks samples up by key)
            tv = view.take(np.zeros(0, dtype=np.int64), _TASK_KEYS) if indexed else view.read(_TASK_KEYS)
        else:
            lazy = ds.server.on_disk("prefill_samples")  # (then read in parts, not built)
            typical = tl.typical_steps(tv, lazy.batches(TYPICAL_ROWS) if lazy is not None else ds.server.prefill_samples)
            release_memory()
    else:
        tv = task_view(ds, _VIEW) if view is not None else tv
        task_code = tl.key_codes([tv], _TASK_KEYS)[0]
    long_enough = _PieceParts()
    tokens, seconds = np.zeros(len(CLASSES)), np.zeros(len(CLASSES))
    worst, keys = [], []
    group = np.array([0, 1, 2, 2])  # pieces are listed long_prefill, other_prefill, then the rest
    for b, (rows, sub, tvb) in enumerate(_blockwise(ds, tv, blocks, block_view)):
        pc = _pieces(sub, opts, tvb, typical)
        sel = np.flatnonzero(pc.seconds >= MIN_PIECE_S)
        seg = pc.seg[sel]
        task = rows[pc.segments.row[seg]]
        long_enough.add(pc.cls[sel], pc.tok_per_s[sel], pc.split[seg],
                        (task if task_code is None else task_code[task]).astype(_positions(n_tasks)))
        tokens += np.bincount(pc.cls, weights=pc.tokens, minlength=len(CLASSES))
        seconds += np.bincount(pc.cls, weights=pc.seconds, minlength=len(CLASSES))
        # This block's slowest long-enough pieces (tok/s up, seconds down, then piece order).
        cand = np.flatnonzero(pc.seconds >= WORST_MIN_S)
        cand = cand[np.lexsort((-pc.seconds[cand], pc.tok_per_s[cand]))][: opts.worst]
        worst.append(_pieces_frame(sub, tvb, pc, cand))
        keys.append(np.c_[pc.tok_per_s[cand], -pc.seconds[cand], group[pc.cls[cand]], np.full(len(cand), b), cand])
        del pc, sel, seg, cand
        release_memory()
    key = np.concatenate(keys)
    # Over all blocks: the slowest, ties in the whole log's piece order (class group, then block).
    top = np.lexsort(key.T[::-1])[: opts.worst]
    w = pd.concat(worst, ignore_index=True).iloc[top].reset_index(drop=True) if len(worst) > 1 else worst[0]
    return _Summary(pieces=long_enough, n_tasks=n_tasks if task_code is None else int(task_code.max(initial=-1)) + 1,
                    tokens=tokens, seconds=seconds, worst=w)


def _shared_summary(ds: Dataset, opts: Options) -> _Summary:
    """The pieces' summary, computed once for the tables that read it."""
    return ds.memo((__name__, "summary", opts.long_prefill_tokens, opts.worst), lambda: _summary(ds, opts))


def _shared_pieces(ds: Dataset, opts: Options) -> _Pieces:
    """The pieces of the task view, computed once for the tables that read them."""
    return ds.memo((__name__, "pieces", opts.long_prefill_tokens), lambda: _pieces(ds, opts, task_view(ds, _VIEW)))


def _pieces_frame(ds: Dataset, tv: pd.DataFrame, pc: _Pieces, rows: np.ndarray | None = None) -> pd.DataFrame:
    """:func:`segment_pieces`' table (``rows``: only those pieces, in that order)."""
    rows = np.arange(len(pc.seg)) if rows is None else rows
    sg = pc.segments
    seg = pc.seg[rows]
    task = sg.row[seg]
    base = tv[_TASK_KEYS].iloc[task].reset_index(drop=True) if _keys_from_tasks(ds, tv) \
        else _segment_frame(ds, tv, sg)[_TASK_KEYS].iloc[seg].reset_index(drop=True)
    base["slot"] = tv["slot"].iloc[task].array
    base["hb_line"] = _hb_lines(ds.server.gen_samples, sg.hb[seg])
    base["hb_file"] = _hb_files(ds.server.gen_samples, sg.hb[seg])
    base["seg_start_s"] = sg.start[seg]
    base["seg_end_s"] = sg.end[seg]
    base["seg_tokens"] = sg.tokens[seg]
    base["split"] = pc.split[seg]
    base["class"] = pd.Categorical.from_codes(pc.cls[rows], categories=CLASSES)
    base["seconds"] = pc.seconds[rows]
    base["tokens"] = pc.tokens[rows]
    base["cause_task_id"] = pd.arrays.IntegerArray(pc.cause[rows], ~pc.has_cause[rows])
    base["tok_per_s"] = base["tokens"] / base["seconds"]
    return base


def _keys_from_tasks(ds: Dataset, tv: pd.DataFrame) -> bool:
    gs = ds.server.gen_samples
    return gs is None or not len(gs) or all(gs[c].dtype == tv[c].dtype for c in _TASK_KEYS)


def segment_pieces(ds: Dataset, opts: Options, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Generation segments split by what the other slots did: one row per (segment, class).

    Columns: task keys, slot, ``class``, ``seconds``, ``tokens``, ``tok_per_s``, ``split``
    (the segment had more than one piece), ``seg_start_s``, ``seg_end_s``, ``seg_tokens``,
    ``hb_line``, ``hb_file``, and ``cause_task_id`` (the largest other-slot prefill running during a
    prefill piece; NA for the rest).
    """
    if tv is None:
        tv = task_view(ds)
        return _pieces_frame(ds, tv, _shared_pieces(ds, opts))
    return _pieces_frame(ds, tv, _pieces(ds, opts, tv))


@register("stalls")
def stalls(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Median generation speed per class of what the other slots did (see the module doc).

    Computed block by block (:func:`_task_blocks`): memory holds one block's segments and
    pieces, and of all pieces only what the statistics read.

    ``median_tg_3s_tps``/``p10_tg_3s_tps`` keep their historical names; they are the median and
    10th percentile of the pieces' tokens/seconds (pieces >= ``MIN_PIECE_S``), ``samples`` their
    number. ``tok_per_s_pooled`` is all tokens over all seconds of the class. ``basis`` says
    whether the class rests on exact segment counts, pass-cadence splits, or both.
    """
    sm = _shared_summary(ds, opts)
    gc.collect()
    release_memory()  # what making the summary left: not under the statistics
    n = len(CLASSES)
    samples, split = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for cls, sp in sm.pieces.columns("cls", "split"):
        samples += np.bincount(cls, minlength=n)
        split += np.bincount(cls[sp], minlength=n)
    # Median and 10th percentile a class at a time, on arrays (a groupby of every piece held
    # ~50 bytes a piece: 146 MB at 1 GB); equal to a groupby's (timeline.median, .quantile).
    # Distinct tasks a class at a time, a byte per task (timeline.distinct_per_group).
    median, p10 = np.full(n, np.nan), np.full(n, np.nan)
    tasks = np.zeros(n, dtype=np.int64)
    for k in np.flatnonzero(samples):
        v = np.concatenate([t[c == k] for c, t in sm.pieces.columns("cls", "tok_per_s")])
        median[k], p10[k] = tl.median_and_quantile(v, 0.1)  # (sorts v)
        del v
        seen = np.zeros(sm.n_tasks, dtype=bool)
        for c, t in sm.pieces.columns("cls", "task"):
            seen[t[c == k]] = True
        tasks[k] = np.count_nonzero(seen)
    stats = pd.DataFrame({
        "samples": samples,
        "median_tg_3s_tps": median,
        "p10_tg_3s_tps": p10,
        "split_samples": split,
        "tasks": tasks,
    }, index=pd.Index(CLASSES, name="class"))
    sums = pd.DataFrame({"tokens": sm.tokens, "seconds": sm.seconds}, index=pd.CategoricalIndex(CLASSES, categories=CLASSES, name="class"))
    out = stats.join(sums).reset_index(names="class")
    out["samples"] = out["samples"].fillna(0).astype("int64")
    out["split_samples"] = out["split_samples"].fillna(0).astype("int64")
    out["tasks"] = out["tasks"].fillna(0).astype("int64")
    out["tokens"] = out["tokens"].fillna(0).round().astype("int64")
    out["seconds"] = out["seconds"].fillna(0).round(3)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["tok_per_s_pooled"] = np.where(out["seconds"] > 0, out["tokens"] / out["seconds"], np.nan)
    out["few_samples"] = out["samples"] < opts.min_samples
    out["basis"] = np.select(
        [out["samples"] == 0, out["split_samples"] == 0, out["split_samples"] == out["samples"]],
        ["none", "exact", "split"], "exact+split")
    for c in ("median_tg_3s_tps", "p10_tg_3s_tps", "tok_per_s_pooled"):
        out[c] = out[c].astype("float64").round(3)
    return out[STALL_COLUMNS]


def _rows_of_tasks(ds: Dataset, keys: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """The task view's ``columns`` of the rows whose task keys are in one of ``keys`` (in the
    view's order): what a left merge of those keys with the view finds. Read from disk
    where the view is there, the view's keys a stored batch at a time (read whole, with their
    join, they were stalls-worst's peak at 1 GB of log: +31 MB)."""
    view = ds._view
    n = len(view) if view is not None else 0
    parts = ((lo, view.take(np.arange(lo, min(lo + store.ROWS_PER_BATCH, n)), _TASK_KEYS))
             for lo in range(0, n, store.ROWS_PER_BATCH)) if view is not None else [(0, task_view(ds, _TASK_KEYS))]
    found = [lo + tl.join_tasks(k[k["task_id"].notna().to_numpy()].astype({"task_id": tk["task_id"].dtype}), tk)[1]
             for lo, tk in parts for k in keys if len(k)]
    rows = np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)
    if ds._view is not None:
        return ds._view.take_scattered(rows, columns)
    return task_view(ds, columns).iloc[rows].reset_index(drop=True)


@register("stalls-worst")
def worst_stalls(ds: Dataset, opts: Options) -> pd.DataFrame:
    """The slowest pieces of generation at least ``WORST_MIN_S`` long, with the stalled task and
    the largest other-slot prefill running during it (``cause_*``, NA when no prefill ran)."""
    who = ["slot", "purpose", "user", "lora", "line", "file"]
    p = _shared_summary(ds, opts).worst
    ckeys = p[tl.GROUP + ["cause_task_id"]].rename(columns={"cause_task_id": "task_id"})
    # Only the view's rows of these tasks (a merge on the whole view copied its columns).
    tv = _rows_of_tasks(ds, [p[_TASK_KEYS], ckeys], _TASK_KEYS + who + ["prompt_tokens_new"])
    stalled = p[_TASK_KEYS].merge(tv[_TASK_KEYS + who], on=_TASK_KEYS, how="left").drop(columns="slot")
    cause_cols = ["slot", "purpose", "user", "lora", "prompt_tokens_new", "line", "file"]
    cinfo = tv[_TASK_KEYS + cause_cols].astype({"task_id": "Int64"})
    cause = ckeys.merge(cinfo, on=_TASK_KEYS, how="left")
    out = pd.DataFrame({
        "class": p["class"].astype(str).to_numpy(),
        "tok_per_s": p["tok_per_s"].round(3).to_numpy(),
        "tokens": p["tokens"].round().astype("int64").to_numpy(),
        "seconds": p["seconds"].round(3).to_numpy(),
        "basis": np.where(p["split"], "split", "exact"),
        "session": p["session"].to_numpy(),
        "seg_start_s": p["seg_start_s"].round(3).to_numpy(),
        "seg_end_s": p["seg_end_s"].round(3).to_numpy(),
        "slot": p["slot"].to_numpy(),
        "task_id": p["task_id"].to_numpy(),
        "purpose": stalled["purpose"].to_numpy(),
        "user": stalled["user"].to_numpy(),
        "lora": stalled["lora"].to_numpy(),
        "line": stalled["line"].to_numpy(),
        "hb_line": p["hb_line"].to_numpy(),
    })
    out["cause_task_id"] = p["cause_task_id"].to_numpy()
    for c in cause_cols:
        out["cause_" + c] = cause[c].to_numpy()
    for c in ("cause_task_id", "cause_slot", "cause_prompt_tokens_new", "cause_line"):
        out[c] = pd.array(pd.to_numeric(out[c], errors="coerce"), dtype="Int64")
    # where to find the lines: the server log (source, port) and the files of line and cause_line
    out["source"] = p["source"].to_numpy()
    out["port"] = p["port"].to_numpy()
    out["file"] = stalled["file"].to_numpy()
    out["cause_file"] = out.pop("cause_file")
    out["hb_file"] = p["hb_file"].to_numpy()  # hb_line's (a task's heartbeats may span a rotation)
    return out.reset_index(drop=True)
