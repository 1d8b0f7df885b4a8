"""Generation speed by what the other slots did meanwhile (the field report's tg_3s table).

A heartbeat's ``tg_3s`` covers its whole window, which often mixes stalled and normal time,
and slots under 100 generated tokens print none (research/stalls.md). Instead each task's
generation is cut into *segments* with exact token counts: between consecutive heartbeats
(Δn_gen over the window), and the tail from the last heartbeat (or the first token) to the
release. Each segment is then split at what the other slots did:

* ``long_prefill``: time when another slot's prefill of >= ``opts.long_prefill_tokens`` new
  tokens was actually running (pauses in its progress lines removed, see
  :func:`slotscope.timeline.prefill_steps`);
* ``other_prefill``: time when only shorter prefills of other slots ran;
* the rest: ``generation_only`` if another slot generated at any time during the segment,
  else ``alone``.

A stall yields one token per server pass, not a share of the window: a prefill piece gets one
token per pass end of the prefilling slot inside it, at most the segment's exact count; the
last piece gets the remainder. Pieces shorter than ``MIN_PIECE_S`` (a piece of one stalled
pass reads 0 or 1 token) are left out of the medians but kept in the pooled sums; pieces
under ``EPS_S`` are dropped.

A segment that runs across a cut of a busy period is measured in each part over the part's
share of it and split in the merge. A prefill without progress lines of its own is read with
its session's typical step, which needs the whole session's lines: :func:`line_steps` of
every part, folded by :func:`typical_of`, is what :func:`per_part` takes as ``typical``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, task_view
from ..periods import Part
from .questions import Options, Question, ask, concat_rows

CLASSES = ["long_prefill", "other_prefill", "generation_only", "alone"]
STALL_COLUMNS = [
    "class", "samples", "median_tg_3s_tps", "p10_tg_3s_tps", "tokens", "seconds", "tok_per_s_pooled",
    "split_samples", "tasks", "few_samples", "basis",
]
MIN_PIECE_S = 2.0
# Pieces shorter than this are treated as absent when the segment's tokens are shared out.
EPS_S = 0.2
WORST_MIN_S = 3.0

KEYS = tl.GROUP + ["task_id"]
_WHO = ["slot", "purpose", "user", "lora", "line", "file"]
# What the merge reads of a segment measured in several parts (one row per part's share).
_MEASURES = ["cov_long", "cov_any", "p_all", "p_long", "others_gen"]


def _segments(tasks: pd.DataFrame, gen: pd.DataFrame | None) -> pd.DataFrame:
    """One row per segment: ``row`` (of ``tasks``), ``hb`` (of ``gen``, -1 for a tail),
    ``start_s``, ``end_s``, ``tokens``, ``session`` (a code); by session, start and slot."""
    first_token, n_gen = tl.floats(tasks["first_token_s"]), tl.floats(tasks["n_gen"])
    gen = gen if gen is not None and len(gen) else None
    last_t, last_n = np.full(len(tasks), np.nan), np.full(len(tasks), np.nan)
    parts = []
    if gen is not None:
        h, r = tl.join_tasks(gen, tasks)  # each heartbeat with its task's row
        t, n = tl.floats(gen["t_s"])[h], tl.floats(gen["n_gen"])[h]
        order = np.lexsort((t, r))  # by task, then time
        h, r, t, n = h[order], r[order], t[order], n[order]
        same = np.r_[False, r[1:] == r[:-1]]
        parts.append(pd.DataFrame({"row": r, "hb": h, "start_s": np.where(same, np.r_[np.nan, t[:-1]], first_token[r]),
                                   "end_s": t, "tokens": np.where(same, n - np.r_[np.nan, n[:-1]], n - 1)}))
        last = pd.DataFrame({"r": r, "t": t, "n": n}).groupby("r").last()  # (each task's last heartbeat)
        last_t[last.index], last_n[last.index] = last["t"].to_numpy(), last["n"].to_numpy()
    d = n_gen - last_n
    parts.append(pd.DataFrame({"row": np.arange(len(tasks)), "hb": -1, "start_s": np.where(np.isnan(last_t), first_token, last_t),
                               "end_s": tl.floats(tasks["release_s"]), "tokens": np.where(np.isnan(d), n_gen - 1, d)}))
    seg = pd.concat(parts, ignore_index=True)
    seg = seg[(seg["end_s"] > seg["start_s"]) & (seg["tokens"] >= 0)]
    row, hb = seg["row"].to_numpy(), seg["hb"].to_numpy()
    gcode, tcode = tl.key_codes([gen if gen is not None else tasks.iloc[:0], tasks], tl.GROUP)
    session = np.where(hb >= 0, gcode[np.maximum(hb, 0)] if len(gcode) else 0, tcode[row])
    slot = pd.factorize(tasks["slot"], sort=True, use_na_sentinel=False)[0][row]
    seg = seg.assign(session=session).iloc[np.lexsort((slot, seg["start_s"].to_numpy(), session))]
    return seg.reset_index(drop=True)


def _segment_keys(tasks: pd.DataFrame, gen: pd.DataFrame | None, seg: pd.DataFrame) -> pd.DataFrame:
    """Each segment's task keys: the heartbeat's where its key columns' types differ from the
    task view's (as a join of the two gives them), else the task's."""
    row, hb = seg["row"].to_numpy(), seg["hb"].to_numpy()
    if gen is None or not len(gen) or all(gen[c].dtype == tasks[c].dtype for c in KEYS):
        return tasks[KEYS].iloc[row].reset_index(drop=True)
    is_hb = np.flatnonzero(hb >= 0)
    tails = np.flatnonzero(hb < 0)
    both = pd.concat([gen[KEYS].iloc[hb[is_hb]], tasks[KEYS].iloc[row[tails]]], ignore_index=True)
    return both.iloc[np.argsort(np.r_[is_hb, tails], kind="stable")].reset_index(drop=True)


def _hb_column(gen: pd.DataFrame | None, hb: np.ndarray, name: str, dtype: str) -> Any:
    """A column of the segments' heartbeats (``line`` or ``file``), NA for tails."""
    if gen is None or not len(gen) or name not in gen.columns:
        return pd.array([pd.NA] * len(hb), dtype=dtype)
    col = gen[name]
    if isinstance(col.dtype, pd.CategoricalDtype):  # (its few categories converted, not every row)
        codes = col.cat.codes.to_numpy()
        return pd.array(col.cat.categories, dtype=dtype).take(np.where(hb >= 0, codes[np.maximum(hb, 0)], -1),
                                                              allow_fill=True)
    return pd.array(col.array.take(hb, allow_fill=True), dtype=dtype)


def generation_segments(ds: Dataset, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each task's generation cut at its heartbeats: one row per window with its exact tokens
    (task keys, slot, ``start_s``, ``end_s``, ``tokens``, ``kind``: ``heartbeat`` or ``tail``,
    ``hb_line``, ``tg_3s_tps`` as logged, ``hb_file``). The first window starts at the first
    token, which the prefill's last pass produced, so it counts ``n_gen - 1`` tokens."""
    tv = task_view(ds) if tv is None else tv
    gen = ds.server.gen_samples
    seg = _segments(tv, gen)
    hb = seg["hb"].to_numpy()
    out = _shown(tv, gen, seg, np.arange(len(tv))).rename(columns={"seg_start_s": "start_s", "seg_end_s": "end_s", "seg_tokens": "tokens"})
    out["kind"] = np.where(hb >= 0, "heartbeat", "tail").astype(object)
    tg = np.full(len(seg), np.nan)
    if gen is not None and len(gen):
        tg[hb >= 0] = tl.floats(gen["tg_3s_tps"])[hb[hb >= 0]]
    out["tg_3s_tps"] = tg
    return out[KEYS + ["slot", "start_s", "end_s", "tokens", "kind", "hb_line", "tg_3s_tps", "hb_file"]]


def _measure(tasks: pd.DataFrame, prefill: pd.DataFrame | None, seg: pd.DataFrame, opts: Options,
             typical: pd.DataFrame | None, window: tuple[float, float], causes: bool = True) -> pd.DataFrame:
    """What the other slots did during each segment's share of ``window`` (the part's stretch):
    seconds under long prefills (``cov_long``) and under any (``cov_any``), server passes
    ending in it (``p_all``, ``p_long``: of a long prefill; a pass ending within SAME_PASS_S of
    the segment's start made its first token, one at its end its last), another slot
    generating (``others_gen``), and the largest long and short prefill (``*_new``, the task's
    row ``*_cause``, -1: none; all -1 unless ``causes``)."""
    t0, t1 = window
    active, steps, info = tl.prefill_steps(tasks, prefill, typical)
    acode, tcode, icode = tl.key_codes([active, tasks, info], tl.GROUP)
    row = seg["row"].to_numpy()
    scode = tcode[row]
    start, end = seg["start_s"].to_numpy(), seg["end_s"].to_numpy()
    qs, qe = np.maximum(start, t0), np.minimum(end, t1)
    new, a_start, a_end = tl.floats(active["prompt_tokens_new"]), tl.floats(active["start_s"]), tl.floats(active["end_s"])
    a_row = np.full(len(active), -1)
    if len(active):
        hit, task = tl.join_tasks(active, tasks)
        a_row[hit] = task
    out = pd.DataFrame(index=seg.index)
    is_long = new >= opts.long_prefill_tokens
    for name, sel, need in (("long", is_long, ("covered",)), ("short", ~is_long, ())):
        if not causes:  # (the largest prefill is the costly query: skipped where no cause is shown)
            if name == "long":
                out["cov_long"] = tl.overlap_arrays(scode, qs, qe, acode[sel], a_start[sel], a_end[sel], need=need)[0]
            out[f"{name}_new"], out[f"{name}_cause"] = np.nan, -1
            continue
        cov, _, _, pos = tl.overlap_arrays(scode, qs, qe, acode[sel], a_start[sel], a_end[sel], vals=new[sel], need=need)
        if name == "long":
            out["cov_long"] = cov
        found = pos >= 0
        out[f"{name}_new"] = np.where(found, new[sel][np.maximum(pos, 0)] if sel.any() else np.nan, np.nan)
        out[f"{name}_cause"] = np.where(found, a_row[sel][np.maximum(pos, 0)] if sel.any() else -1, -1)
    out["cov_any"] = tl.overlap_arrays(scode, qs, qe, acode, a_start, a_end, need=("covered",))[0]
    ft, rel = tl.floats(tasks["first_token_s"]), tl.floats(tasks["release_s"])
    gen = np.flatnonzero(~np.isnan(ft) & ~np.isnan(rel) & (rel >= ft))
    out["others_gen"] = tl.overlap_arrays(scode, qs, qe, tcode[gen], ft[gen], rel[gen], own_start=ft, own_end=rel,
                                          own_rows=row, need=("max_count",))[1] >= 1
    pid, t = tl.pass_ends(steps)
    sp_code, sp_t, sp_new = tl.server_pass_arrays(icode[pid], t, tl.floats(info["prompt_tokens_new"])[pid])
    a = np.maximum(start + tl.SAME_PASS_S, t0)
    z = np.maximum(np.where(end <= t1, end + tl.SAME_PASS_S, t1), a)
    big = sp_new >= opts.long_prefill_tokens
    out["p_all"] = tl.count_point_arrays(scode, a, z, sp_code, sp_t)
    out["p_long"] = tl.count_point_arrays(scode, a, z, sp_code[big], sp_t[big])
    return out


def _split(seg: pd.DataFrame) -> pd.DataFrame:
    """The pieces of measured segments, by class (long prefill, other prefill, the rest), each
    in segment order: ``seg`` (row of ``seg``), ``cls`` (of :data:`CLASSES`), ``seconds``,
    ``tokens``, ``tok_per_s``, ``split`` and ``cause`` (task row of the largest other-slot
    prefill; -1: none)."""
    dur = seg["end_s"].to_numpy() - seg["start_s"].to_numpy()
    k = seg["tokens"].to_numpy()
    p_all, p_long = seg["p_all"].to_numpy(), seg["p_long"].to_numpy()
    s_long = np.minimum(seg["cov_long"].to_numpy().round(6), dur)
    s_other = np.clip(seg["cov_any"].to_numpy().round(6) - s_long, 0, None)
    s_rest = np.clip(dur - s_long - s_other, 0, None)
    has = [s >= EPS_S for s in (s_long, s_other, s_rest)]
    # Pieces under EPS_S are dropped (the other pieces share the tokens); a segment made only
    # of such pieces keeps its largest one.
    none = ~(has[0] | has[1] | has[2])
    has[2] = has[2] | (none & (s_rest >= s_long) & (s_rest >= s_other))
    has[0] = has[0] | (none & ~has[2] & (s_long >= s_other))
    has[1] = has[1] | (none & ~has[2] & ~has[0])
    tok_long = np.where(has[0], np.where(has[0] & ~has[1] & ~has[2], k, np.minimum(k, p_long)), 0.0)
    rem = k - tok_long
    tok_other = np.where(has[1], np.where(has[1] & ~has[2], rem, np.minimum(rem, p_all - p_long)), 0.0)
    split = (has[0].astype(np.int8) + has[1] + has[2]) > 1
    rest_cls = np.where(seg["others_gen"].to_numpy(), CLASSES.index("generation_only"), CLASSES.index("alone"))
    no_cause = np.full(len(seg), -1)
    pieces = []
    for c, secs, toks, cause in ((0, s_long, tok_long, seg["long_cause"].to_numpy()),
                                 (1, s_other, tok_other, seg["short_cause"].to_numpy()),
                                 (2, s_rest, rem - tok_other, no_cause)):
        i = np.flatnonzero(has[c])
        pieces.append(pd.DataFrame({"seg": i, "cls": rest_cls[i] if c == 2 else c, "seconds": secs[i],
                                    "tokens": toks[i], "split": split[i], "cause": cause[i]}))
    out = pd.concat(pieces, ignore_index=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["tok_per_s"] = out["tokens"] / out["seconds"]
    return out


def _shown(tasks: pd.DataFrame, gen: pd.DataFrame | None, seg: pd.DataFrame, rows: np.ndarray) -> pd.DataFrame:
    """What the rows of pieces show of their segments: task keys, slot, ``hb_line``, ``hb_file``,
    ``seg_start_s``, ``seg_end_s``, ``seg_tokens``, ``task`` (its row in the view: ``rows``),
    ``tail``."""
    hb = seg["hb"].to_numpy()
    out = _segment_keys(tasks, gen, seg)
    out["slot"] = tasks["slot"].array.take(seg["row"].to_numpy())
    out["hb_line"] = _hb_column(gen, hb, "line", "Int64")
    out["hb_file"] = _hb_column(gen, hb, "file", "string")
    out["seg_start_s"], out["seg_end_s"], out["seg_tokens"] = (seg[c].to_numpy() for c in ("start_s", "end_s", "tokens"))
    out["task"], out["tail"] = rows[seg["row"].to_numpy()], hb < 0
    return out


def _measured(tasks: pd.DataFrame, gen: pd.DataFrame | None, prefill: pd.DataFrame | None, rows: np.ndarray,
              opts: Options, typical: pd.DataFrame | None, window: tuple[float, float], causes: bool = True) -> pd.DataFrame:
    """Every segment of ``tasks`` with its :func:`_measure` over ``window``; causes as rows of
    the view (``rows``: each task's)."""
    seg = _segments(tasks, gen)
    m = _measure(tasks, prefill, seg, opts, typical, window, causes)
    for c in ("long_cause", "short_cause"):
        r = m[c].to_numpy()
        m[c] = np.where(r >= 0, rows[np.maximum(r, 0)] if len(rows) else -1, -1)
    return pd.concat([seg, m], axis=1)


def _with_shown(pieces: pd.DataFrame, shown: pd.DataFrame) -> pd.DataFrame:
    """Pieces (:func:`_split`'s) as rows: their segments' ``shown`` columns (one row per
    segment) and their own."""
    out = shown.iloc[pieces["seg"].to_numpy()].reset_index(drop=True)
    for c in ("split", "cls", "seconds", "tokens", "cause", "tok_per_s"):
        out[c] = pieces[c].to_numpy()
    return out


def task_pieces(ds: Dataset, opts: Options, tv: pd.DataFrame) -> pd.DataFrame:
    """The pieces of :func:`segment_pieces` with only what a statistic of them needs: ``task``
    (the row of ``tv`` whose generation it is), ``class``, ``seconds``, ``tokens``, ``tok_per_s``."""
    tv = tv.reset_index(drop=True)
    seg = _measured(tv, ds.server.gen_samples, ds.server.prefill_samples, np.arange(len(tv)), opts, None, (-np.inf, np.inf),
                    causes=False)
    p = _split(seg)
    return pd.DataFrame({"task": seg["row"].to_numpy()[p["seg"].to_numpy()],
                         "class": pd.Categorical.from_codes(p["cls"].to_numpy(), categories=CLASSES),
                         "seconds": p["seconds"].to_numpy(), "tokens": p["tokens"].to_numpy(),
                         "tok_per_s": p["tok_per_s"].to_numpy()})


def segment_pieces(ds: Dataset, opts: Options, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Generation segments split by what the other slots did: one row per (segment, class),
    with the segment's columns and ``cause_task_id`` (the largest other-slot prefill running
    during a prefill piece; NA for the rest). ``tv``: the tasks (default: the whole view)."""
    tv = task_view(ds) if tv is None else tv.reset_index(drop=True)
    rows, gen = np.arange(len(tv)), ds.server.gen_samples
    seg = _measured(tv, gen, ds.server.prefill_samples, rows, opts, None, (-np.inf, np.inf))
    p = _with_shown(_split(seg), _shown(tv, gen, seg, rows))
    cause = p.pop("cause").to_numpy()
    ids = tv["task_id"].to_numpy(dtype=np.int64)[np.maximum(cause, 0)] if len(tv) else np.zeros(len(cause), np.int64)
    p.insert(p.columns.get_loc("tok_per_s"), "cause_task_id", pd.arrays.IntegerArray(ids, cause < 0))
    p.insert(p.columns.get_loc("seconds"), "class", pd.Categorical.from_codes(p.pop("cls").to_numpy(), categories=CLASSES))
    return p.drop(columns=["task", "tail"])


def line_steps(part: Part, opts: Options) -> pd.DataFrame:
    """The steps of the progress lines inside the prefills of the tasks the part counts
    (:func:`slotscope.timeline.line_steps`)."""
    tasks = part.tasks.iloc[np.flatnonzero(part.counted)]
    return tl.line_steps(*tl.progress_lines(tasks, part.prefill))


def typical_of(steps: list[pd.DataFrame]) -> pd.DataFrame:
    """The sessions' typical steps (:func:`slotscope.timeline.typical_steps`) of every part's
    :func:`line_steps`."""
    both = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame(columns=tl.GROUP + ["step_tokens", "step_s"])
    return tl.typical_steps(both)


@dataclass
class Folded:
    """Per class, what the tables read of the pieces: the tok/s of those of at least
    ``MIN_PIECE_S``, how many were split and their tasks; all pieces' tokens and seconds; and
    the slowest pieces of at least ``WORST_MIN_S`` (``worst``)."""

    speeds: list[np.ndarray]
    split: np.ndarray
    tasks: list[np.ndarray]
    tokens: np.ndarray
    seconds: np.ndarray
    worst: pd.DataFrame


@dataclass
class PartAnswer:
    """A part's share of the stalls tables: its own pieces, :class:`Folded`; the segments
    across its ends, measured over its share of them (``across``); and the task-view rows
    those name (``info``)."""

    folded: Folded
    across: pd.DataFrame
    info: pd.DataFrame


def _fold(seg: pd.DataFrame, task: np.ndarray, opts: Options) -> Folded:
    """Split measured segments (``task``: each one's row in the view) and keep what the tables
    read of the pieces."""
    p = _split(seg)
    cls, secs = p["cls"].to_numpy(), p["seconds"].to_numpy()
    enough = secs >= MIN_PIECE_S
    speeds, tasks = [], []
    for k in range(len(CLASSES)):
        mine = enough & (cls == k)
        speeds.append(p["tok_per_s"].to_numpy()[mine])
        tasks.append(np.unique(task[p["seg"].to_numpy()[mine]]))
    split = np.bincount(cls[enough & p["split"].to_numpy()], minlength=len(CLASSES))
    tokens = np.bincount(cls, weights=p["tokens"], minlength=len(CLASSES)).astype(float)
    seconds = np.bincount(cls, weights=secs, minlength=len(CLASSES)).astype(float)
    cand = p[secs >= WORST_MIN_S]
    worst = cand.iloc[np.lexsort((-cand["seconds"].to_numpy(), cand["tok_per_s"].to_numpy()))][: opts.worst]
    return Folded(speeds, split, tasks, tokens, seconds, worst.reset_index(drop=True))


def _all_of(folded: list[Folded]) -> Folded:
    """Several parts' pieces as one's (the worst of each, one after another)."""
    n = range(len(CLASSES))
    return Folded([np.concatenate([f.speeds[k] for f in folded]) for k in n], np.sum([f.split for f in folded], axis=0),
                  [np.unique(np.concatenate([f.tasks[k] for f in folded])) for k in n],
                  np.sum([f.tokens for f in folded], axis=0), np.sum([f.seconds for f in folded], axis=0),
                  concat_rows([f.worst for f in folded]))


def per_part(part: Part, opts: Options, typical: pd.DataFrame | None = None) -> PartAnswer:
    """The stalls tables' share of one part (see :class:`PartAnswer`). ``typical``: the
    sessions' typical steps (:func:`typical_of`; default: those of the part's own lines)."""
    tasks, rows = part.tasks.reset_index(drop=True), np.asarray(part.rows, dtype=np.int64)
    t0, t1 = part.span if part.span is not None else (np.nan, np.nan)
    window = (-np.inf if np.isnan(t0) else t0, np.inf if np.isnan(t1) else t1)
    seg = _measured(tasks, part.gen, part.prefill, rows, opts, typical, window)
    start, end = seg["start_s"].to_numpy(), seg["end_s"].to_numpy()
    inside = (start >= window[0]) & (end <= window[1])
    share = ~inside & (np.minimum(end, window[1]) > np.maximum(start, window[0]))
    own = seg[inside].reset_index(drop=True)
    folded = _fold(own, rows[own["row"].to_numpy()], opts)
    folded.worst = worst = _with_shown(folded.worst, _shown(tasks, part.gen, own, rows))
    across = seg[share].reset_index(drop=True)
    across = pd.concat([_shown(tasks, part.gen, across, rows), across[_MEASURES + ["long_new", "long_cause", "short_new", "short_cause"]]],
                       axis=1)
    named = np.r_[worst["task"], worst["cause"], across["task"], across["long_cause"], across["short_cause"]]
    at = np.flatnonzero(np.isin(rows, named))
    info = tasks[KEYS + _WHO + ["prompt_tokens_new"]].iloc[at].assign(row=rows[at]).reset_index(drop=True)
    return PartAnswer(folded, across, info)


def _joined(across: pd.DataFrame) -> pd.DataFrame:
    """Segments measured in several parts as one each (rows in part order): the shares'
    seconds and pass ends added up, another slot generating in any, the largest prefill of
    the shares (a tie: the earlier share's)."""
    by = [across["task"], across["seg_start_s"], across["tail"]]
    g = across.groupby(by, sort=False)
    seg = g.first()
    for c in ("cov_long", "cov_any", "p_all", "p_long"):
        seg[c] = g[c].sum()
    seg["others_gen"] = g["others_gen"].any()
    for c in ("long", "short"):
        best = across[f"{c}_new"].fillna(-np.inf).groupby(by, sort=False).idxmax().to_numpy()
        seg[f"{c}_cause"] = across[f"{c}_cause"].to_numpy()[best]
    seg = seg.reset_index()
    return seg.assign(start_s=seg["seg_start_s"], end_s=seg["seg_end_s"], tokens=seg["seg_tokens"])


def merge(answers: list[PartAnswer], opts: Options, ds: Dataset) -> dict[str, pd.DataFrame]:
    """The ``stalls`` and ``stalls-worst`` tables of every part's answer."""
    if not answers:  # (no tasks: the tables of an empty part)
        answers = [per_part(_whole(ds, task_view(ds).iloc[:0]), opts)]
    folded = [a.folded for a in answers]
    across = [a.across for a in answers if len(a.across)]
    if across:
        joined = _joined(pd.concat(across, ignore_index=True))
        f = _fold(joined, joined["task"].to_numpy(), opts)
        f.worst = _with_shown(f.worst, joined)
        folded.append(f)
    every = _all_of(folded)
    info = concat_rows([a.info for a in answers]).drop_duplicates("row")
    return {"stalls": _stalls_table(every, opts), "stalls-worst": _worst_table(every.worst, info, opts)}


def _stalls_table(pieces: Folded, opts: Options) -> pd.DataFrame:
    """Median generation speed per class of what the other slots did (see the module doc).

    ``median_tg_3s_tps``/``p10_tg_3s_tps`` keep their historical names; they are of the pieces'
    tokens/seconds (pieces >= ``MIN_PIECE_S``). ``basis``: exact segment counts, pass-cadence
    splits, or both."""
    stats = np.array([tl.median_and_quantile(v, 0.1) if len(v) else (np.nan, np.nan) for v in pieces.speeds])
    out = pd.DataFrame({
        "class": CLASSES,
        "samples": np.array([len(v) for v in pieces.speeds], dtype=np.int64),
        "median_tg_3s_tps": stats[:, 0],
        "p10_tg_3s_tps": stats[:, 1],
        "split_samples": pieces.split.astype(np.int64),
        "tasks": np.array([len(t) for t in pieces.tasks], dtype=np.int64),
        "tokens": pieces.tokens.round().astype("int64"),
        "seconds": pieces.seconds.round(3),
    })
    with np.errstate(divide="ignore", invalid="ignore"):
        out["tok_per_s_pooled"] = np.where(out["seconds"] > 0, out["tokens"] / out["seconds"], np.nan)
    out["few_samples"] = out["samples"] < opts.min_samples
    out["basis"] = np.select(
        [out["samples"] == 0, out["split_samples"] == 0, out["split_samples"] == out["samples"]],
        ["none", "exact", "split"], "exact+split")
    for c in ("median_tg_3s_tps", "p10_tg_3s_tps", "tok_per_s_pooled"):
        out[c] = out[c].astype("float64").round(3)
    return out[STALL_COLUMNS]


def _worst_table(cand: pd.DataFrame, info: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """The slowest pieces of generation at least ``WORST_MIN_S`` long, with the stalled task and
    the largest other-slot prefill running during it (``cause_*``, NA when no prefill ran);
    ties in the order of the pieces (class, session, start, slot)."""
    order = cand.assign(_tps=cand["tok_per_s"], _s=-cand["seconds"], _g=np.minimum(cand["cls"], 2))
    order = order.sort_values(["_tps", "_s", "_g"] + tl.GROUP + ["seg_start_s", "slot", "tail"], kind="stable", na_position="last")
    p = order.head(opts.worst).reset_index(drop=True)
    ids = info.set_index("row")["task_id"]
    cause_row = p["cause"].to_numpy()
    p["cause_task_id"] = pd.array(ids.reindex(cause_row).to_numpy(dtype=float, na_value=np.nan), dtype="Int64") \
        if len(p) else pd.array([], dtype="Int64")
    ckeys = p[tl.GROUP + ["cause_task_id"]].rename(columns={"cause_task_id": "task_id"})
    stalled = p[KEYS].merge(info[KEYS + _WHO], on=KEYS, how="left").drop(columns="slot")
    cause_cols = ["slot", "purpose", "user", "lora", "prompt_tokens_new", "line", "file"]
    cause = ckeys.merge(info[KEYS + cause_cols].astype({"task_id": "Int64"}), on=KEYS, how="left")
    out = pd.DataFrame({
        "class": np.array(CLASSES, dtype=object)[p["cls"].to_numpy(dtype=np.int64)],
        "tok_per_s": p["tok_per_s"].round(3).to_numpy(),
        "tokens": p["tokens"].round().astype("int64").to_numpy(),
        "seconds": p["seconds"].round(3).to_numpy(),
        "basis": np.where(p["split"].to_numpy(dtype=bool), "split", "exact"),
        "session": p["session"].to_numpy(),
        "seg_start_s": p["seg_start_s"].round(3).to_numpy(),
        "seg_end_s": p["seg_end_s"].round(3).to_numpy(),
        "slot": p["slot"].to_numpy(),
        "task_id": p["task_id"].to_numpy(),
        **{c: stalled[c].to_numpy() for c in ("purpose", "user", "lora", "line")},
        "hb_line": p["hb_line"].to_numpy(),
        "cause_task_id": p["cause_task_id"].to_numpy(),
        **{"cause_" + c: cause[c].to_numpy() for c in cause_cols if c != "file"},
    })
    for c in ("cause_task_id", "cause_slot", "cause_prompt_tokens_new", "cause_line"):
        out[c] = pd.array(pd.to_numeric(out[c], errors="coerce"), dtype="Int64")
    # where to find the lines: the server log (source, port), the files of line, cause_line and
    # hb_line (a task's heartbeats may span a rotation)
    for name, col in (("source", p["source"]), ("port", p["port"]), ("file", stalled["file"]), ("cause_file", cause["file"]),
                      ("hb_file", p["hb_file"])):
        out[name] = col.to_numpy()
    return out


QUESTION = ask(Question(("stalls", "stalls-worst"), per_part, merge, prepare=(line_steps, typical_of),
                        prepare_columns=tuple(tl.PROGRESS_TASK_COLUMNS)))


def _whole(ds: Dataset, tv: pd.DataFrame | None = None) -> Part:
    """The whole log (or the tasks ``tv`` of it) as one part."""
    tv = task_view(ds) if tv is None else tv.reset_index(drop=True)
    return Part(tasks=tv, counted=np.ones(len(tv), dtype=bool), rows=np.arange(len(tv)), gen=ds.server.gen_samples,
                prefill=ds.server.prefill_samples, sessions=ds.server.sessions)


def worst_stalls(ds: Dataset, opts: Options) -> pd.DataFrame:
    """The ``stalls-worst`` table, of the whole log as one part (see :func:`_worst_table`)."""
    return merge([per_part(_whole(ds), opts)], opts, ds)["stalls-worst"]
