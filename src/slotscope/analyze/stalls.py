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

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, task_view
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


def generation_segments(ds: Dataset, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each task's generation cut at its heartbeats: one row per window with its exact tokens.

    Columns: task keys, slot, ``start_s``, ``end_s``, ``tokens``, ``kind`` (``heartbeat`` or
    ``tail``), ``hb_line`` (the heartbeat's line; NA for tails), ``tg_3s_tps`` (the logged
    value, for comparison). The first window starts at the first token, which the prefill's last
    pass produced, so it counts ``n_gen - 1`` tokens.
    """
    tv = task_view(ds) if tv is None else tv
    t = tv[_TASK_KEYS + ["slot", "first_token_s", "release_s", "n_gen"]].copy()
    t["n_gen"] = pd.to_numeric(t["n_gen"], errors="coerce").astype("float64")
    gs = ds.server.gen_samples
    if gs is not None and len(gs):
        hb = gs[_TASK_KEYS + ["t_s", "n_gen", "tg_3s_tps", "line"]].merge(t[_TASK_KEYS + ["slot", "first_token_s"]], on=_TASK_KEYS, how="inner")
        hb = hb.sort_values(_TASK_KEYS + ["t_s"], kind="stable").reset_index(drop=True)
        same = (hb[_TASK_KEYS] == hb[_TASK_KEYS].shift(1)).all(axis=1)
        n = hb["n_gen"].astype("float64")
        hb_seg = pd.DataFrame({
            **{c: hb[c] for c in _TASK_KEYS + ["slot"]},
            "start_s": hb["t_s"].shift(1).where(same, hb["first_token_s"]),
            "end_s": hb["t_s"],
            "tokens": (n - n.shift(1)).where(same, n - 1),
            "kind": "heartbeat", "hb_line": hb["line"].astype("Int64"), "tg_3s_tps": hb["tg_3s_tps"],
        })
        last = hb.groupby(_TASK_KEYS, dropna=False).agg(last_t=("t_s", "last"), last_n=("n_gen", "last")).reset_index()
        t = t.merge(last, on=_TASK_KEYS, how="left")
    else:
        hb_seg = None
        t["last_t"], t["last_n"] = np.nan, np.nan
    last_n = pd.to_numeric(t["last_n"], errors="coerce").astype("float64")
    tail = pd.DataFrame({
        **{c: t[c] for c in _TASK_KEYS + ["slot"]},
        "start_s": t["last_t"].fillna(t["first_token_s"]),
        "end_s": t["release_s"],
        "tokens": (t["n_gen"] - last_n).fillna(t["n_gen"] - 1),
        "kind": "tail", "hb_line": pd.array([pd.NA] * len(t), dtype="Int64"), "tg_3s_tps": np.nan,
    })
    seg = pd.concat([x for x in (hb_seg, tail) if x is not None], ignore_index=True)
    seg = seg[(seg["end_s"] > seg["start_s"]) & seg["tokens"].notna() & (seg["tokens"] >= 0)]
    return seg.sort_values(tl.GROUP + ["start_s", "slot"], kind="stable", ignore_index=True)


def segment_pieces(ds: Dataset, opts: Options, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Generation segments split by what the other slots did: one row per (segment, class).

    Columns: task keys, slot, ``class``, ``seconds``, ``tokens``, ``tok_per_s``, ``split``
    (the segment had more than one piece), ``seg_start_s``, ``seg_end_s``, ``seg_tokens``,
    ``hb_line``, and ``cause_task_id`` (the largest other-slot prefill running during a
    prefill piece; NA for the rest).
    """
    tv = task_view(ds) if tv is None else tv
    seg = generation_segments(ds, tv)
    active, passes = tl.prefill_activity(tv, ds.server.prefill_samples)
    thr = opts.long_prefill_tokens
    new = pd.to_numeric(active["prompt_tokens_new"], errors="coerce").astype("float64")
    long_act = active[new >= thr]
    cov_long = tl.overlaps(seg, long_act, value="prompt_tokens_new")
    cov_any = tl.overlaps(seg, active)
    short_act = active[~(new >= thr)]
    cov_short = tl.overlaps(seg, short_act, value="prompt_tokens_new")
    gen = tl.phases(tv)
    gen = gen[gen["phase"] == "generation"]
    # The segment lies inside its own task's generation; leave that one out.
    own = seg[_TASK_KEYS].merge(tv[_TASK_KEYS + ["first_token_s", "release_s"]], on=_TASK_KEYS, how="left")
    cov_gen = tl.overlaps(seg, gen, own_start=own["first_token_s"].to_numpy(dtype=float), own_end=own["release_s"].to_numpy(dtype=float))
    sp = tl.server_passes(passes)
    sp_new = pd.to_numeric(sp["prompt_tokens_new"], errors="coerce").astype("float64")
    # A pass ending within SAME_PASS_S of the segment's start made its first token; one at its end made the last.
    shifted = seg[tl.GROUP].assign(start_s=seg["start_s"] + tl.SAME_PASS_S, end_s=seg["end_s"] + tl.SAME_PASS_S)
    p_all = tl.count_points(shifted, sp)
    p_long = tl.count_points(shifted, sp[sp_new >= thr])

    dur = (seg["end_s"] - seg["start_s"]).to_numpy()
    k = seg["tokens"].to_numpy(dtype=float)
    s_long = np.minimum(cov_long["covered_s"].to_numpy(), dur)
    s_other = np.clip(cov_any["covered_s"].to_numpy() - s_long, 0, None)
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
    n_pieces = has[0].astype(int) + has[1] + has[2]
    rest_class = np.where(cov_gen["max_count"].to_numpy() >= 1, "generation_only", "alone")

    base = seg[_TASK_KEYS + ["slot", "hb_line"]].reset_index(drop=True)
    base["seg_start_s"] = seg["start_s"].to_numpy()
    base["seg_end_s"] = seg["end_s"].to_numpy()
    base["seg_tokens"] = k
    base["split"] = n_pieces > 1
    cause_long = _cause_task(long_act, cov_long)
    cause_short = _cause_task(short_act, cov_short)
    parts = []
    for cls, secs, toks, mask, cause in (
        ("long_prefill", s_long, tok_long, has[0], cause_long),
        ("other_prefill", s_other, tok_other, has[1], cause_short),
        (None, s_rest, tok_rest, has[2], pd.array([pd.NA] * len(seg), dtype="Int64")),
    ):
        p = base[mask].copy()
        p["class"] = cls if cls is not None else rest_class[mask]
        p["seconds"] = secs[mask]
        p["tokens"] = toks[mask]
        p["cause_task_id"] = cause[mask]
        parts.append(p)
    pieces = pd.concat(parts, ignore_index=True)
    pieces["tok_per_s"] = pieces["tokens"] / pieces["seconds"]
    pieces["class"] = pd.Categorical(pieces["class"], categories=CLASSES)
    return pieces


def _cause_task(prefills: pd.DataFrame, cov: pd.DataFrame) -> pd.arrays.IntegerArray:
    """Task id of the prefill :func:`tl.overlaps` found largest (``max_pos``), NA where none."""
    pos = cov["max_pos"].to_numpy()
    ids = pd.array(np.zeros(len(pos), dtype=np.int64), dtype="Int64")
    if len(prefills):
        ids[:] = prefills["task_id"].to_numpy(dtype=np.int64)[np.maximum(pos, 0)]
    ids[pos < 0] = pd.NA
    return ids


@register("stalls")
def stalls(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Median generation speed per class of what the other slots did (see the module doc).

    ``median_tg_3s_tps``/``p10_tg_3s_tps`` keep their historical names; they are the median and
    10th percentile of the pieces' tokens/seconds (pieces >= ``MIN_PIECE_S``), ``samples`` their
    number. ``tok_per_s_pooled`` is all tokens over all seconds of the class. ``basis`` says
    whether the class rests on exact segment counts, pass-cadence splits, or both.
    """
    pieces = segment_pieces(ds, opts)
    long_enough = pieces[pieces["seconds"] >= MIN_PIECE_S]
    g = long_enough.groupby("class", observed=False)
    stats = pd.DataFrame({
        "samples": g.size(),
        "median_tg_3s_tps": g["tok_per_s"].median(),
        "p10_tg_3s_tps": g["tok_per_s"].quantile(0.1),
        "split_samples": g["split"].sum(),
        "tasks": long_enough[["class"] + _TASK_KEYS].drop_duplicates().groupby("class", observed=False).size(),
    }).reindex(CLASSES)
    sums = pieces.groupby("class", observed=False)[["tokens", "seconds"]].sum().reindex(CLASSES)
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


@register("stalls-worst")
def worst_stalls(ds: Dataset, opts: Options) -> pd.DataFrame:
    """The slowest pieces of generation at least ``WORST_MIN_S`` long, with the stalled task and
    the largest other-slot prefill running during it (``cause_*``, NA when no prefill ran)."""
    tv = task_view(ds)
    pieces = segment_pieces(ds, opts, tv)
    p = pieces[pieces["seconds"] >= WORST_MIN_S].sort_values(["tok_per_s", "seconds"], ascending=[True, False], kind="stable").head(opts.worst)
    who = ["slot", "purpose", "user", "lora", "line"]
    stalled = p[_TASK_KEYS].merge(tv[_TASK_KEYS + who], on=_TASK_KEYS, how="left").drop(columns="slot")
    cause_cols = ["slot", "purpose", "user", "lora", "prompt_tokens_new", "line"]
    ckeys = p[tl.GROUP + ["cause_task_id"]].rename(columns={"cause_task_id": "task_id"})
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
    return out.reset_index(drop=True)
