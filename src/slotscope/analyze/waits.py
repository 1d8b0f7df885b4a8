"""Waits the metrics do not show: before prefill (launched, not yet batched) and before launch.

A wait before prefill of at least ``opts.wait_threshold_s`` is classified by what ran (was
prefilling or generating) in other slots meanwhile: a task with another LoRA label →
``different_lora`` (llama-server batches only slots whose LoRA settings match); else one with
the same label → ``same_lora``; else ``nothing``. Where the app log gives no LoRA label for
the waiting task or for what ran, the wait is ``unknown_lora`` (that row appears only then).
What ran during a wait overlaps it, so it is in the wait's busy period: each part of the busy
periods classifies its waits, and a wait across a cut of a long period is covered a stretch
in each part it is in.

``deferred`` counts launches that came right after (<= ``DEFERRED_S``) another task's release
on a session whose slots were all busy just before it: requests the server queued without a
log line. Their time is the app's ``queue_ms`` when an app log gives it. The release can end
the busy period before the launch (on a one-slot server it always does), so the parts hand the
merge a few times per task and the deferred launches are found over the whole log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, task_view
from ..periods import Part
from .questions import Options, Question, answer, ask, concat_rows

CAUSES = ["different_lora", "same_lora", "nothing", "deferred"]
WAIT_COLUMNS = ["cause", "count", "total_s", "max_s", "median_s", "share", "few_samples", "basis"]
WORST_COLUMNS = [
    "wait_s", "cause", "session", "slot", "task_id", "purpose", "user", "lora", "line", "launch_s",
    "holder_task_id", "holder_slot", "holder_purpose", "holder_user", "holder_lora", "holder_prompt_tokens_new",
    "holder_line", "holder_overlap_s", "source", "port", "file", "holder_file",
]
DEFERRED_S = 0.005
COVERED = ["different_lora_s", "same_lora_s", "unknown_lora_s"]  # seconds of a wait covered by each
# What _times reads of the task view.
TIME_COLUMNS = tl.GROUP + ["task_id", "launch_s", "prefill_start_s", "first_token_s", "release_s", "queue_ms"]


class _Held(NamedTuple):
    """What holds the batch: each task from its prefill start (its launch where the log does not
    give one) to its end, with its session's code."""

    code: np.ndarray
    start: np.ndarray
    end: np.ndarray


def _held(tv: pd.DataFrame, sessions: pd.DataFrame | None) -> _Held:
    ps = tl.floats(tv["prefill_start_s"])
    return _Held(tl.key_codes([tv], tl.GROUP)[0], np.where(np.isnan(ps), tl.floats(tv["launch_s"]), ps),
                 tl.task_ends(tv, sessions))


def _wait_rows(tv: pd.DataFrame, opts: Options) -> np.ndarray:
    return tl.floats(tv["wait_before_prefill_ms"]) >= opts.wait_threshold_s * 1000


def _waits(tv: pd.DataFrame, at: np.ndarray) -> pd.DataFrame:
    """The rows ``at`` of ``tv`` as waits from launch to prefill start."""
    waits = tv.iloc[at].reset_index(drop=True)
    waits["start_s"] = waits["launch_s"]
    waits["end_s"] = waits["prefill_start_s"]
    waits["wait_s"] = waits["end_s"] - waits["start_s"]
    return waits


def _covered_by(tv: pd.DataFrame, held: _Held, waits: pd.DataFrame, at: np.ndarray,
                span: tuple[float, float] | None = None) -> pd.DataFrame:
    """:data:`COVERED`: the seconds of each of the ``waits`` (at rows ``at`` of ``tv``) covered
    by different-, same- and unknown-LoRA work, within ``span`` (NaN: an open end) if given."""
    ws, we = tl.floats(waits["start_s"]), tl.floats(waits["end_s"])
    if span is not None:
        ws, we = np.fmax(ws, span[0]), np.fmin(we, span[1])
    wl, rl = waits["lora"].astype("object"), tv["lora"]

    def covered(q: np.ndarray, ran: pd.Series | None) -> np.ndarray:
        start = held.start if ran is None else np.where(ran.to_numpy(), held.start, np.nan)
        return tl.overlap_arrays(held.code[at][q], ws[q], we[q], held.code, start, held.end, need=("covered",))[0]

    diff_s, same_s = np.zeros(len(waits)), np.zeros(len(waits))
    for label in pd.unique(wl.dropna()):
        q = (wl == label).to_numpy()
        diff_s[q] = covered(q, rl.notna() & (rl != label))
        same_s[q] = covered(q, rl == label)
    # Unknown: what ran had no label, or the waiting task has none (then anything that ran).
    every = np.ones(len(waits), dtype=bool)
    unk_s = np.where(wl.isna().to_numpy(), covered(every, None), covered(every, rl.isna()))
    return pd.DataFrame(dict(zip(COVERED, (diff_s, same_s, unk_s))))


def _with_cause(waits: pd.DataFrame) -> pd.DataFrame:
    """The waits with their :data:`COVERED` seconds rounded, and their ``cause``."""
    for c in COVERED:
        waits[c] = waits[c].round(6)
    diff_s, same_s, unk_s = (waits[c].to_numpy() for c in COVERED)
    causes = np.array(["different_lora", "unknown_lora", "same_lora", "nothing"], dtype=object)
    waits["cause"] = causes[np.select([diff_s > 0, unk_s > 0, same_s > 0], [0, 1, 2], 3)]
    return waits


def classify_waits(ds: Dataset, opts: Options, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Waits before prefill of at least ``opts.wait_threshold_s``, one row each, with ``cause``
    and the seconds of the wait covered by different-/same-/unknown-LoRA work."""
    tv = task_view(ds) if tv is None else tv
    at = np.flatnonzero(_wait_rows(tv, opts))
    waits = _waits(tv, at)
    return _with_cause(pd.concat([waits, _covered_by(tv, _held(tv, ds.server.sessions), waits, at)], axis=1))


def _holders(tv: pd.DataFrame, held: _Held, top: pd.DataFrame, at: np.ndarray) -> pd.DataFrame:
    """For each wait of ``top`` (at rows ``at`` of ``tv``) the task of ``tv`` that held the
    batch (``h``: its row in ``tv``) and what it is ranked by: the different-LoRA task that
    overlapped the wait most, else the largest prefill that ran during it, else whatever ran
    longest during it (``w``: the wait's row in ``top``; none where nothing ran)."""
    a, z = tl.floats(top["start_s"]), tl.floats(top["end_s"])
    tid = tv["task_id"].to_numpy()
    ran = [np.flatnonzero((held.code == held.code[i]) & (held.start < zz) & (held.end > aa) & (tid != tid[i]))
           for i, aa, zz in zip(at, a, z)]
    w = np.repeat(np.arange(len(top)), [len(r) for r in ran])
    h = np.concatenate(ran) if ran else np.zeros(0, dtype=np.int64)
    hs, he = held.start[h], held.end[h]
    overlap = np.minimum(z[w], he) - np.maximum(a[w], hs)
    ft = tl.floats(tv["first_token_s"])[h]
    prefill_ov = np.minimum(z[w], np.where(np.isnan(ft), he, ft)) - np.maximum(a[w], hs)
    wl = top["lora"].astype("object").iloc[w].reset_index(drop=True)
    hl = tv["lora"].astype("object").iloc[h].reset_index(drop=True)
    diff = (wl.notna() & hl.notna() & (wl != hl)).astype(int).to_numpy()
    prefill = np.where(prefill_ov > 0, tl.floats(tv["prompt_tokens_new"])[h], -1.0)
    # Among different-LoRA holders the longest overlap wins; among the others the largest prefill.
    pair = pd.DataFrame({"w": w, "h": h, "diff": diff, "key": np.where(diff == 1, overlap, prefill), "overlap_s": overlap})
    return _best(pair[overlap > 0], "w", "h")


def _best(pair: pd.DataFrame, wait: str, holder: str) -> pd.DataFrame:
    """The first pair of each wait by rank (ties: the holder first in the view)."""
    by = [wait, "diff", "key", "overlap_s", holder]
    return pair.sort_values(by, ascending=[True, False, False, False, True], kind="stable").drop_duplicates(wait)


def _worst(part: Part, held: _Held, waits: pd.DataFrame, at: np.ndarray, k: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``k`` longest of ``waits`` (at rows ``at`` of the part's tasks) with their columns of
    waits-worst (``_at``: the row in the view), and for each the task of the part that held the
    batch (``_h``)."""
    tv, rows = part.tasks, part.rows
    top = waits.assign(_at=rows[at], _counted=part.counted[at])
    top = top.sort_values(["wait_s", "_at"], ascending=[False, True], kind="stable").head(k)
    at = at[top.index.to_numpy()]
    top = top.reset_index(drop=True)
    best = _holders(tv, held, top, at)
    h = best["h"].to_numpy()
    hold = tv.iloc[h].reset_index(drop=True)
    holders = pd.DataFrame({
        "_at": top["_at"].to_numpy()[best["w"].to_numpy()], "_h": rows[h],
        **{c: best[c].to_numpy() for c in ("diff", "key", "overlap_s")},
        **{"h_" + c: hold[c] for c in ("task_id", "slot", "purpose", "user", "prompt_tokens_new", "line", "file")},
        "h_lora": pd.Series(hold["lora"].astype("object").to_numpy(), dtype=object),
    })
    listed = top[["session", "slot", "task_id", "purpose", "user", "lora", "line", "launch_s", "source", "port", "file",
                  "wait_s", "_at", "_counted"]].rename(columns={"wait_s": "_wait"})
    return listed, holders


def _times(tv: pd.DataFrame, sessions: pd.DataFrame) -> pd.DataFrame:
    """``row`` (position), ``session`` (its row among the sessions table's first rows),
    ``task_id``, ``launch_s``, ``release_s``, ``end_s`` and ``queue_ms`` of every task of
    ``tv`` whose session is in the sessions table (a task of another one, of no known slot
    count, is never deferred)."""
    first = sessions.drop_duplicates(tl.GROUP)
    scode, code = tl.key_codes([first, tv], tl.GROUP)
    session = tl.by_code(scode, np.arange(len(first)), code, -1)
    t = pd.DataFrame({"row": np.arange(len(tv)), "session": session, "task_id": tv["task_id"].to_numpy(),
                      "launch_s": tl.floats(tv["launch_s"]), "release_s": tl.floats(tv["release_s"]),
                      "end_s": tl.task_ends(tv, sessions), "queue_ms": tl.floats(tv["queue_ms"])})
    return t if (session >= 0).all() else t[session >= 0].reset_index(drop=True)


def _deferred(t: pd.DataFrame, n_slots: np.ndarray) -> pd.DataFrame:
    """Rows of :func:`_times` ``t`` (in the view's order) launched within ``DEFERRED_S`` after
    the release of another task of their session, the last at or before the launch, while the
    session's slots (``n_slots``, by session) were all busy just before it: ``row``,
    ``released_task_id``, ``release_s_before``, ``queue_ms``, in launch order."""
    launch = t.loc[t["launch_s"].notna(), ["row", "session", "task_id", "launch_s", "queue_ms"]].sort_values("launch_s")
    rel = (t.loc[t["release_s"].notna(), ["session", "task_id", "release_s"]].sort_values("release_s")
           .rename(columns={"task_id": "released_task_id", "release_s": "release_s_before"}))
    j = pd.merge_asof(launch, rel, left_on="launch_s", right_on="release_s_before", by="session",
                      direction="backward", tolerance=DEFERRED_S, allow_exact_matches=True)
    del launch, rel  # (a copy of every task's times each: the whole log's, at merge time)
    j = j[j["release_s_before"].notna() & (j["released_task_id"] != j["task_id"])]
    # Tasks running just before that release: launched before it, ending after it began.
    r = tl.floats(j["release_s_before"])
    busy = tl.overlap_arrays(j["session"].to_numpy(), r - 1e-6, r, t["session"].to_numpy(), tl.floats(t["launch_s"]),
                             tl.floats(t["end_s"]), need=("max_count",))[1]
    j = j[n_slots[j["session"].to_numpy()] <= busy]
    return j.astype({"released_task_id": "int64"})[["row", "released_task_id", "release_s_before", "queue_ms"]]


def deferred_launches(ds: Dataset, tv: pd.DataFrame | None = None) -> pd.DataFrame:
    """Tasks launched within ``DEFERRED_S`` after another task's release while every slot of
    their session was busy just before that release, with the release that let them in."""
    tv = task_view(ds) if tv is None else tv
    sessions = ds.server.sessions
    d = _deferred(_times(tv, sessions), tl.floats(sessions.drop_duplicates(tl.GROUP)["n_slots"]))
    out = tv.iloc[d["row"].to_numpy()].reset_index(drop=True)
    out["released_task_id"] = d["released_task_id"].to_numpy()
    out["release_s_before"] = d["release_s_before"].to_numpy()
    return out


@dataclass(frozen=True)
class PartWaits:
    """One part's answer: its waits (``row`` in the view, ``counted``, ``wait_s``, their
    :data:`COVERED` seconds within the part), its longest waits (``listed``) with their best
    holders in the part, and its tasks' LoRA labels."""

    waits: pd.DataFrame
    listed: pd.DataFrame
    holders: pd.DataFrame
    labels: np.ndarray


def per_part(part: Part, opts: Options) -> PartWaits:
    """The waits of the part's tasks, the seconds of each that the part's tasks covered, and
    the longest with the task that held the batch. A wait across a cut of a busy period is in
    the parts on both sides: each covers its own stretch (``part.span``) and offers its holders.
    """
    tv = part.tasks
    held = _held(tv, part.sessions)
    at = np.flatnonzero(_wait_rows(tv, opts))
    waits = _waits(tv, at)
    covered = _covered_by(tv, held, waits, at, part.span)
    listed, holders = _worst(part, held, waits, at, opts.worst)
    rows = pd.DataFrame({"row": part.rows[at], "counted": part.counted[at], "wait_s": waits["wait_s"].to_numpy()})
    return PartWaits(pd.concat([rows, covered], axis=1), listed, holders,
                     pd.unique(tv["lora"].astype("object").to_numpy()))


def merge(answers: list[PartWaits], opts: Options, ds: Dataset) -> dict[str, pd.DataFrame]:
    """The waits table (waits by cause, and the deferred launches) and waits-worst."""
    if not answers:  # (no task)
        none = pd.DataFrame({"cause": pd.Series(dtype=object), "wait_s": pd.Series(dtype=float)})
        return {"waits": _table(none, np.zeros(0), opts), "waits-worst": pd.DataFrame(columns=WORST_COLUMNS)}
    # Each counted wait, its seconds covered summed over the parts it is in, in the view's order.
    got = concat_rows([a.waits for a in answers])
    w = got[got["counted"]].sort_values("row", kind="stable").reset_index(drop=True)
    if len(w) < len(got):
        w[COVERED] = got.groupby("row", sort=True)[COVERED].sum().loc[w["row"]].to_numpy()
    w = _with_cause(w)
    # (the deferred launches are a question of each session's sequence of tasks: no periods)
    view = task_view(ds, TIME_COLUMNS + ["time_resolution_s"])
    coarse = int((tl.floats(view["time_resolution_s"]) >= 1).sum()) if "time_resolution_s" in view.columns else 0
    n_tasks = len(view)
    t = _times(view, ds.server.sessions)
    del view  # (the whole log's rows: only their times are needed now)
    d = _deferred(t, tl.floats(ds.server.sessions.drop_duplicates(tl.GROUP)["n_slots"]))
    del t
    labels = pd.unique(np.concatenate([a.labels for a in answers]))
    return {"waits": _table(w, d["queue_ms"].to_numpy() / 1000, opts, (coarse, n_tasks)),
            "waits-worst": _worst_table(answers, w, pd.Series(labels).dtype, opts.worst)}


def _worst_table(answers: list[PartWaits], w: pd.DataFrame, lora_type: object, k: int) -> pd.DataFrame:
    """The ``k`` longest counted waits, each with its best holder over the parts it is in."""
    listed = concat_rows([a.listed for a in answers])
    listed = listed[listed["_counted"]].sort_values(["_wait", "_at"], ascending=[False, True], kind="stable").head(k)
    holders = concat_rows([a.holders for a in answers])
    best = _best(holders[holders["_at"].isin(listed["_at"])], "_at", "_h")
    x = listed.merge(w[["row", "cause"]].rename(columns={"row": "_at"}), on="_at", how="left").merge(best, on="_at", how="left")
    return pd.DataFrame({
        "wait_s": x["_wait"].round(3), "cause": x["cause"], "session": x["session"], "slot": x["slot"],
        "task_id": x["task_id"], "purpose": x["purpose"], "user": x["user"], "lora": x["lora"],
        "line": x["line"], "launch_s": x["launch_s"].round(3),
        "holder_task_id": pd.array(x["h_task_id"], dtype="Int64"),
        "holder_slot": pd.array(pd.to_numeric(x["h_slot"], errors="coerce"), dtype="Int64"),
        "holder_purpose": x["h_purpose"], "holder_user": x["h_user"],
        # (typed as a column of every task's labels would be)
        "holder_lora": pd.Series(x["h_lora"].to_numpy(dtype=object), dtype=lora_type),
        "holder_prompt_tokens_new": pd.array(pd.to_numeric(x["h_prompt_tokens_new"], errors="coerce"), dtype="Int64"),
        "holder_line": pd.array(pd.to_numeric(x["h_line"], errors="coerce"), dtype="Int64"),
        "holder_overlap_s": x["overlap_s"].round(3),
        # where to find the lines: the server log (source, port) and the files of line and holder_line
        "source": x["source"], "port": x["port"], "file": x["file"], "holder_file": x["h_file"],
    })


def _table(w: pd.DataFrame, queue_s: np.ndarray, opts: Options, coarse: tuple[int, int] = (0, 0)) -> pd.DataFrame:
    """Count, total, longest and median wait per cause; ``share`` of all waits' seconds for the
    wait causes. ``deferred``'s seconds are the app's queue time (NA without an app log).
    ``coarse``: the tasks timed by whole-second stamps, of all: the basis says that their waits
    under a second read 0, since such stamps cannot show them."""
    causes = CAUSES[:3] + (["unknown_lora"] if (w["cause"] == "unknown_lora").any() else [])
    g = w.groupby("cause", observed=True)["wait_s"]
    stats = pd.DataFrame({"count": g.size(), "total_s": g.sum(), "max_s": g.max(), "median_s": g.median()}).reindex(causes)
    stats["count"] = stats["count"].fillna(0).astype("int64")
    stats["total_s"] = stats["total_s"].fillna(0.0)
    all_s = w["wait_s"].sum()
    stats["share"] = stats["total_s"] / all_s if all_s > 0 else np.nan
    stats["basis"] = f"wait before prefill >= {opts.wait_threshold_s:g} s" + (
        f"; {coarse[0]:,} of {coarse[1]:,} tasks timed by whole-second stamps: a wait under 1 s reads 0" if coarse[0] else "")
    qs = pd.Series(queue_s)
    has_q = qs.notna().any()
    stats.loc["deferred"] = {
        "count": len(qs), "total_s": qs.sum() if has_q else np.nan, "max_s": qs.max() if has_q else np.nan,
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


WAITS = ask(Question(("waits", "waits-worst"), per_part, merge))


def worst_waits(ds: Dataset, opts: Options) -> pd.DataFrame:
    """The longest waits before prefill, with the task that held the batch meanwhile: the
    different-LoRA task that overlapped the wait most, else the largest prefill that ran during
    it, else whatever ran longest during it (``holder_*``; NA when nothing ran)."""
    return answer([WAITS], ds, opts)["waits-worst"]
