"""Waits the metrics do not show: before prefill (launched, not yet batched) and before launch.

A wait before prefill of at least ``opts.wait_threshold_s`` is classified by what ran (was
prefilling or generating) in other slots meanwhile: a task with another LoRA label →
``different_lora`` (llama-server batches only slots whose LoRA settings match); else one with
the same label → ``same_lora``; else ``nothing``. Where the app log gives no LoRA label for
the waiting task or for what ran, the wait is ``unknown_lora`` (that row appears only then).

``deferred`` counts launches that came right after (<= ``DEFERRED_S``) another task's release
on a session whose slots were all busy just before it: requests the server queued without a
log line. Their time is the app's ``queue_ms`` when an app log gives it.
"""

from __future__ import annotations

import functools
import gc
from typing import Any, Callable

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, own_copy, release_memory, task_view
from . import Options, register

CAUSES = ["different_lora", "same_lora", "nothing", "deferred"]
WAIT_COLUMNS = ["cause", "count", "total_s", "max_s", "median_s", "share", "few_samples", "basis"]
DEFERRED_S = 0.005
_KEYS = tl.GROUP + ["task_id"]


def _free() -> None:
    """Free the frames just dropped now, not at the next table: pandas objects hold one another
    in cycles (their arrays wait for the collector), and the Arrow pool and glibc keep freed
    pages (see :func:`release_memory`)."""
    gc.collect(1)  # (the young generations: the frames were made in this table; a full collection took ~0.1 s)
    release_memory()


_f = tl._f


# What a holder of the batch shows of its task (``worst_waits``; ``_row`` rows of the view).
_HOLDER = _KEYS + ["slot", "purpose", "user", "prompt_tokens_new", "line", "file", "first_token_s"]


def _running(tv: pd.DataFrame, sessions: pd.DataFrame | None) -> pd.DataFrame:
    """What holds the batch: each task from its prefill start to its release. A task whose
    prefill start the log does not give (cut off) counts from its launch. Its row in ``tv``
    (``_row``), ``start_s``, ``end_s`` and ``lora`` (the view's column: categories, compared as
    the labels are): the rest of its columns (``_HOLDER``) are read for the few that
    :func:`worst_waits` lists (at 1 GB of log a copy of them for every task rose ~25 MB, held by
    both waits tables; a column of its labels as text ~20 MB)."""
    return _running_of(tl.task_ends(tv, sessions), _f(tv["prefill_start_s"]), _f(tv["launch_s"]), tv)


def _running_of(end: np.ndarray, ps: np.ndarray, launch: np.ndarray, tv: pd.DataFrame) -> pd.DataFrame:
    """:func:`_running` of the tasks' ends, prefill starts and launches (``tv``: their ``lora``, if any)."""
    start = np.where(np.isnan(ps), launch, ps)
    keep = np.flatnonzero(end > start)
    lora = tv["lora"] if "lora" in tv.columns else pd.Series(pd.NA, index=tv.index, dtype="object")
    return pd.DataFrame({"_row": keep.astype(np.int32) if len(end) < 2**31 else keep, "start_s": start[keep], "end_s": end[keep],
                         "lora": lora.iloc[keep].reset_index(drop=True)})


def _lora_type(tv: pd.DataFrame) -> Any:
    """The type of a column of every task's LoRA label as a Python object (what the holders'
    labels had: inferred from the distinct values, the same values give the same type)."""
    lora = tv["lora"].astype("object") if "lora" in tv.columns else pd.Series(pd.NA, index=tv.index, dtype="object")
    return pd.Series(pd.unique(lora.to_numpy())).dtype


def _holders(ds: Dataset, run: pd.DataFrame, lora_type: Any) -> pd.DataFrame:
    """Rows of :func:`_running` with their tasks' columns (``_HOLDER``), read for those rows
    alone where the task view is on disk (a column at a time, not ``_HOLDER`` of every task)."""
    at = run["_row"].to_numpy()
    rows = ds._view.take(at, _HOLDER) if ds._view is not None else task_view(ds, _HOLDER).iloc[at].reset_index(drop=True)
    lora = pd.Series(run["lora"].astype("object").to_numpy(), dtype=lora_type)
    return rows.assign(start_s=run["start_s"].to_numpy(), end_s=run["end_s"].to_numpy(), lora=lora)


def classify_waits(ds: Dataset, opts: Options, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Waits before prefill of at least ``opts.wait_threshold_s``, one row each, with ``cause``
    and the seconds of the wait covered by different-/same-/unknown-LoRA work."""
    tv = task_view(ds) if tv is None else tv
    run = _running(tv, ds.server.sessions)
    is_wait, tcode = _wait_rows(tv, opts)
    return _classify(_waits(tv, is_wait), tcode[is_wait], tcode[run["_row"].to_numpy()], run)


def _shared(ds: Dataset, opts: Options) -> tuple[pd.DataFrame, pd.DataFrame, Any]:
    """What ran, the classified waits and the type of the holders' labels, computed once for
    the waits tables."""
    def make() -> tuple[pd.DataFrame, pd.DataFrame, Any]:
        # What the waits are chosen and classified by first, a column at a time (at 1 GB of log
        # the nine read at once were ~37 MB), then the waits' own columns for their rows.
        sessions = _Sessions(ds, task_view(ds, tl.GROUP))
        tcode = sessions.code
        lora = task_view(ds, ["lora"])
        run = _running_of(sessions.ends(ds, _f(task_view(ds, ["release_s"])["release_s"])),
                          *(_f(task_view(ds, [c])[c]) for c in ("prefill_start_s", "launch_s")), lora)
        lora_type = _lora_type(lora)
        del sessions, lora
        is_wait = _f(task_view(ds, ["wait_before_prefill_ms"])["wait_before_prefill_ms"]) >= opts.wait_threshold_s * 1000
        _free()
        # The waits' own columns for their rows alone where the view is on disk (a column at a
        # time: at 1 GB of log the columns of every task rose ~45 MB).
        rows = np.flatnonzero(is_wait)
        waits = _waits(ds._view.take(rows, _TABLE_COLUMNS) if ds._view is not None else task_view(ds, _TABLE_COLUMNS).iloc[rows],
                       np.ones(len(rows), dtype=bool), _TABLE_COLUMNS)
        del rows
        _free()  # (the columns read, before the overlap queries)
        # Each one's session code, for waits-worst's pairs (not the session keys of every task).
        run["_code"] = tcode[run["_row"].to_numpy()]
        waits = _classify(waits, tcode[is_wait], run["_code"].to_numpy(), run)
        waits["_code"] = tcode[is_wait]
        return run, waits, lora_type

    run, w, lora_type = ds.memo((__name__, "classified", opts.wait_threshold_s), make)
    return own_copy(run), own_copy(w), lora_type


def _wait_rows(tv: pd.DataFrame, opts: Options) -> tuple[np.ndarray, np.ndarray]:
    """Which tasks waited at least ``opts.wait_threshold_s`` before prefill, and every task's
    session code (in a byte, with one session)."""
    return _f(tv["wait_before_prefill_ms"]) >= opts.wait_threshold_s * 1000, tl.narrow(tl.key_codes([tv], tl.GROUP)[0])


def _waits(tv: pd.DataFrame, is_wait: np.ndarray, columns: list[str] | None = None) -> pd.DataFrame:
    """The waits to classify (``columns``: only those of the task view, else all)."""
    waits = tv.loc[is_wait, [c for c in tv.columns if columns is None or c in columns]]
    waits["start_s"] = waits["launch_s"]
    waits["end_s"] = waits["prefill_start_s"]
    waits["wait_s"] = waits["end_s"] - waits["start_s"]
    return waits.reset_index(drop=True)


def _covered(wcode: np.ndarray, ws: np.ndarray, we: np.ndarray, rcode: np.ndarray, rs: np.ndarray, re_: np.ndarray,
             sel: np.ndarray | None) -> np.ndarray:
    """Seconds of each wait [ws, we] covered by the ``sel`` rows of what ran (None: all), as
    :func:`tl.overlaps`' ``covered_s``."""
    if sel is not None:  # (the others' starts missing: no interval, as if left out; not three copies of the rows kept)
        rs = np.where(sel, rs, np.nan)
    return tl.overlap_arrays(wcode, ws, we, rcode, rs, re_, need=("covered",))[0].round(6)


# The waits' own columns that the waits tables read (the task view has ~50).
_TABLE_COLUMNS = _KEYS + ["slot", "purpose", "user", "lora", "line", "file", "launch_s", "prefill_start_s"]


def _classify(waits: pd.DataFrame, wcode: np.ndarray, rcode: np.ndarray, run: pd.DataFrame) -> pd.DataFrame:
    """:func:`classify_waits` of the :func:`_waits` (``wcode``, ``rcode``: the session codes of
    them and of ``run``)."""
    wl = waits["lora"].astype("object") if "lora" in waits.columns else pd.Series(pd.NA, index=waits.index, dtype="object")
    rl = run["lora"]
    # On arrays, not on a table of the waits per label (each held until the collector ran).
    ws, we, rs, re_ = _f(waits["start_s"]), _f(waits["end_s"]), _f(run["start_s"]), _f(run["end_s"])
    diff_s = np.zeros(len(waits))
    same_s = np.zeros(len(waits))
    for label in pd.unique(wl.dropna()):
        q = (wl == label).to_numpy()
        if not q.any():
            continue
        qi = np.flatnonzero(q)
        diff_s[q] = _covered(wcode[qi], ws[qi], we[qi], rcode, rs, re_, (rl.notna() & (rl != label)).to_numpy())
        same_s[q] = _covered(wcode[qi], ws[qi], we[qi], rcode, rs, re_, (rl == label).to_numpy())
    # Unknown: what ran had no label, or the waiting task has none (then anything that ran).
    unk_s = _covered(wcode, ws, we, rcode, rs, re_, rl.isna().to_numpy())
    any_s = _covered(wcode, ws, we, rcode, rs, re_, None)
    unk_s = np.where(wl.isna().to_numpy(), any_s, unk_s)
    waits["different_lora_s"] = diff_s
    waits["same_lora_s"] = same_s
    waits["unknown_lora_s"] = unk_s
    # (the causes as Python texts, not a numpy array of fixed-width text, 4 bytes a character)
    causes = np.array(["different_lora", "unknown_lora", "same_lora", "nothing"], dtype=object)
    waits["cause"] = causes[np.select([diff_s > 0, unk_s > 0, same_s > 0], [0, 1, 2], 3)]
    return waits


def deferred_launches(ds: Dataset, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Tasks launched within ``DEFERRED_S`` after another task's release while every slot of
    their session was busy just before that release, with the release that let them in."""
    tv = task_view(ds) if tv is None else tv
    sessions = _Sessions(ds, tv)
    got = _deferred_rows(sessions.code, _f(tv["launch_s"]), _f(tv["release_s"]), lambda: tv["task_id"].to_numpy(),
                         lambda: tl.task_ends(tv, ds.server.sessions), sessions.n_slots_at)
    if got is None:
        return tv.iloc[0:0].assign(released_task_id=pd.Series(dtype="int64"), release_s_before=pd.Series(dtype="float64"))
    rows, released, rel_t = got
    out = tv.loc[tv.index[rows]].copy()
    out["released_task_id"] = released
    out["release_s_before"] = rel_t
    return out.reset_index(drop=True)


class _Sessions:
    """Each task's session code (``tv``: its ``GROUP`` columns) and, by it, the slots and last
    time of its session (NaN: unknown), looked up by code (a merge on the session keys made
    the source's text of every row: at 1 GB of log the peak of the waits tables)."""

    def __init__(self, ds: Dataset, tv: pd.DataFrame) -> None:
        first = ds.server.sessions.drop_duplicates(tl.GROUP)  # (a session's first row)
        self.scode, code = tl.key_codes([first, tv], tl.GROUP)
        self.code = tl.narrow(code)
        self.n_slots = pd.to_numeric(first["n_slots"], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
        self.last_s = _f(first["last_s"]) if len(first) else np.zeros(0)

    def n_slots_at(self, rows: np.ndarray) -> np.ndarray:
        return tl.by_code(self.scode, self.n_slots, self.code[rows], np.nan)

    def ends(self, ds: Dataset, release_s: np.ndarray) -> np.ndarray:
        """:func:`slotscope.timeline.task_ends` of every task, whose releases these are, its
        other times read a column at a time, only when a task has no release (at 1 GB of log
        some have none: the view's seven columns for it were ~30 MB)."""
        if not np.isnan(release_s).any():
            return release_s
        fallback = tl.by_code(self.scode, self.last_s, self.code, np.nan)
        # The latest of a task's four times (NaN: none), a column at a time.
        t = np.fmax(_f(task_view(ds, ["launch_s"])["launch_s"]), _f(task_view(ds, ["prefill_start_s"])["prefill_start_s"]))
        np.fmax(t, _f(task_view(ds, ["first_token_s"])["first_token_s"]), out=t)
        np.fmax(t, release_s, out=t)
        code = self.code
        if not len(code) or (code == code[0]).all():  # (one session, the usual case: its latest, no groupby)
            latest = np.fmax.reduce(t) if len(t) else np.nan
        else:
            latest = pd.Series(t).groupby(code, observed=True).transform("max").to_numpy(dtype="float64", na_value=np.nan)
        del t
        fallback = np.where(np.isnan(fallback), latest, fallback)
        return np.where(np.isnan(release_s), fallback, release_s)


def _deferred_rows(code: np.ndarray, launch_s: np.ndarray, release_s: np.ndarray, task_id: Callable[[], np.ndarray],
                   task_ends: Callable[[], np.ndarray], n_slots_at: Callable[[np.ndarray], np.ndarray],
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`deferred_launches` on arrays (each task's session code, times, and what gives its
    task ids and ends when asked): the deferred tasks' rows (in launch order), the released
    task's id and the release's time; None when no task has a launch or none a release."""
    # Launches and releases in time order, as a sort of their rows by that column orders them
    # (numpy's default sort of the same values: ties in the same order).
    lrow = np.flatnonzero(~np.isnan(launch_s))
    rrow = np.flatnonzero(~np.isnan(release_s))
    if not len(lrow) or not len(rrow):
        return None
    lrow = lrow[np.argsort(launch_s[lrow], kind="quicksort")]
    rrow = rrow[np.argsort(release_s[rrow], kind="quicksort")]
    # Each launch's release: the last one of its session, in that order, at or before it and
    # at most DEFERRED_S before it (what a backward as-of merge by session picks), found by a
    # sorted search per session on arrays (the merge's tables of every launch and release,
    # and their sorted copies, rose ~70 MB at 1 GB of log).
    lt, rt = launch_s[lrow], release_s[rrow]
    lcode, rcode = code[lrow], code[rrow]
    if (lcode == lcode[0]).all() and (rcode == lcode[0]).all():  # (one session, the usual case)
        found = np.searchsorted(rt, lt, "right") - 1  # (a position in rrow; -1: none)
    else:
        found = np.full(len(lrow), -1, dtype=np.int64)
        for g in np.unique(lcode):
            li, ri = np.flatnonzero(lcode == g), np.flatnonzero(rcode == g)
            at = np.searchsorted(rt[ri], lt[li], "right") - 1
            found[li[at >= 0]] = ri[at[at >= 0]]
    del lcode, rcode, lt, rt
    hit = found >= 0
    rel_t = np.where(hit, release_s[rrow[np.maximum(found, 0)]], np.nan)
    hit &= ~(launch_s[lrow] - rel_t > DEFERRED_S)  # (the merge's tolerance)
    # The released task's id as the merge gives it (a numpy integer column with a launch left
    # unmatched becomes float64).
    ids = task_id()
    released = pd.api.extensions.take(ids, np.where(hit, rrow[np.maximum(found, 0)], -1), allow_fill=True)
    del rrow
    keep = hit & (released != ids[lrow])
    del found, hit, ids
    lrow, rel_t, released = lrow[keep], rel_t[keep], released[keep]
    # Tasks running just before that release: launched before it, ending at or after it.
    ends = task_ends()
    running_before = (tl.overlap_arrays(code[lrow], rel_t - 1e-6, rel_t, code, launch_s, ends, need=("max_count",))[1]
                      if len(lrow) else np.zeros(0, dtype=np.int64))
    del ends
    full = n_slots_at(lrow) <= running_before
    return lrow[full], released[full], rel_t[full]


@register("waits")
def waits(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Count, total, longest and median wait per cause; ``share`` of all waits' seconds for the
    wait causes. ``deferred``'s seconds are the app's queue time (NA without an app log)."""
    # The deferred launches first, from their own columns, before the classified waits are
    # made (or while they are not: only this table's arrays at once, not both).
    # Their columns a few at a time (at 1 GB of log the nine columns read at once were ~37 MB).
    sessions = _Sessions(ds, task_view(ds, tl.GROUP))
    launch_s, release_s = (_f(task_view(ds, [c])[c]) for c in ("launch_s", "release_s"))
    got = _deferred_rows(sessions.code, launch_s, release_s, lambda: task_view(ds, ["task_id"])["task_id"].to_numpy(),
                         functools.partial(sessions.ends, ds, release_s), sessions.n_slots_at)
    del sessions, launch_s, release_s
    rows = got[0] if got is not None else np.zeros(0, dtype=np.int64)
    del got
    queue = task_view(ds, ["queue_ms"])
    qs = pd.Series(_f(queue["queue_ms"])[rows] / 1000 if "queue_ms" in queue.columns else np.full(len(rows), np.nan))
    n_deferred = len(rows)
    del queue, rows
    _free()
    _, w, _ = _shared(ds, opts)
    causes = CAUSES[:3] + (["unknown_lora"] if (w["cause"] == "unknown_lora").any() else [])
    g = w.groupby("cause", observed=True)["wait_s"]
    stats = pd.DataFrame({"count": g.size(), "total_s": g.sum(), "max_s": g.max(), "median_s": g.median()}).reindex(causes)
    stats["count"] = stats["count"].fillna(0).astype("int64")
    stats["total_s"] = stats["total_s"].fillna(0.0)
    all_s = w["wait_s"].sum()
    stats["share"] = stats["total_s"] / all_s if all_s > 0 else np.nan
    stats["basis"] = f"wait before prefill >= {opts.wait_threshold_s:g} s"
    has_q = qs.notna().any()
    stats.loc["deferred"] = {
        "count": n_deferred, "total_s": qs.sum() if has_q else np.nan, "max_s": qs.max() if has_q else np.nan,
        "median_s": qs.median() if has_q else np.nan, "share": np.nan,
        "basis": "launch <= 5 ms after a release, all slots busy; seconds = app queue_ms" if has_q
        else "launch <= 5 ms after a release, all slots busy; no app queue time",
    }
    out = stats.reindex(causes[:3] + ["deferred"] + causes[3:]).reset_index(names="cause")
    out["count"] = out["count"].astype("int64")
    out["few_samples"] = out["count"] < opts.min_samples
    for c in ("total_s", "max_s", "median_s"):
        out[c] = out[c].astype("float64").round(3)
    out["share"] = out["share"].astype("float64").round(4)
    return out[WAIT_COLUMNS]


@register("waits-worst")
def worst_waits(ds: Dataset, opts: Options) -> pd.DataFrame:
    """The longest waits before prefill, with the task that held the batch meanwhile: the
    different-LoRA task that overlapped the wait most, else the largest prefill that ran during
    it, else whatever ran longest during it (``holder_*``; NA when nothing ran)."""
    run, w, lora_type = _shared(ds, opts)
    w = w.sort_values("wait_s", ascending=False, kind="stable").head(opts.worst).reset_index(drop=True)
    w["_w"] = np.arange(len(w))
    # Only the few listed waits are paired with the tasks of their session that overlap them
    # (a pair of every task would hold worst x tasks rows).
    rcode, rs, re_ = run["_code"].to_numpy(), _f(run["start_s"]), _f(run["end_s"])
    near = np.zeros(len(run), dtype=bool)
    for code, a, z in zip(w["_code"].to_numpy(), _f(w["start_s"]), _f(w["end_s"])):
        near |= (rcode == code) & (rs < z) & (re_ > a)
    run = _holders(ds, run[near], lora_type)
    pair = w[tl.GROUP + ["_w", "task_id", "start_s", "end_s", "lora"]].merge(
        run.rename(columns={c: "h_" + c for c in run.columns if c not in tl.GROUP}), on=tl.GROUP, how="inner")
    pair = pair[pair["h_task_id"] != pair["task_id"]]
    pair["overlap_s"] = np.minimum(pair["end_s"], pair["h_end_s"]) - np.maximum(pair["start_s"], pair["h_start_s"])
    pair = pair[pair["overlap_s"] > 0]
    ft = _f(pair["h_first_token_s"])
    prefill_ov = np.minimum(pair["end_s"], np.where(np.isnan(ft), pair["h_end_s"], ft)) - np.maximum(pair["start_s"], pair["h_start_s"])
    wl, hl = pair["lora"].astype("object"), pair["h_lora"].astype("object")
    pair["rank_diff"] = (wl.notna() & hl.notna() & (wl != hl)).astype(int)
    pair["rank_prefill"] = np.where(prefill_ov > 0, _f(pair["h_prompt_tokens_new"]), -1.0)
    pair = pair.sort_values(["_w", "rank_diff", "overlap_s"], ascending=[True, False, False], kind="stable")
    # Among non-different-LoRA holders the largest prefill wins; among different-LoRA ones the longest overlap.
    pair["key2"] = np.where(pair["rank_diff"] == 1, pair["overlap_s"], pair["rank_prefill"])
    pair = pair.sort_values(["_w", "rank_diff", "key2", "overlap_s"], ascending=[True, False, False, False], kind="stable")
    best = pair.drop_duplicates("_w")
    h = w[["_w"]].merge(best, on="_w", how="left")
    out = pd.DataFrame({
        "wait_s": w["wait_s"].round(3), "cause": w["cause"], "session": w["session"], "slot": w["slot"],
        "task_id": w["task_id"], "purpose": w.get("purpose"), "user": w.get("user"), "lora": w.get("lora"),
        "line": w["line"], "launch_s": w["launch_s"].round(3),
        "holder_task_id": pd.array(h["h_task_id"], dtype="Int64"), "holder_slot": pd.array(pd.to_numeric(h["h_slot"], errors="coerce"), dtype="Int64"),
        "holder_purpose": h["h_purpose"], "holder_user": h["h_user"], "holder_lora": h["h_lora"],
        "holder_prompt_tokens_new": pd.array(pd.to_numeric(h["h_prompt_tokens_new"], errors="coerce"), dtype="Int64"),
        "holder_line": pd.array(pd.to_numeric(h["h_line"], errors="coerce"), dtype="Int64"),
        "holder_overlap_s": h["overlap_s"].round(3),
        # where to find the lines: the server log (source, port) and the files of line and holder_line
        "source": w["source"], "port": w["port"], "file": w["file"], "holder_file": h["h_file"],
    })
    return out
