"""The incident as a picture: one lane per slot, every task's phases, each slot's generation speed.

A lane's upper half holds the tasks as bars split into queue, wait, prefill and generation,
under a strip in the colour of the task's LoRA setting; its lower half is the slot's generation
speed, each heartbeat window (and the tail after the last) drawn at its exact tokens/seconds:
the logged ``tg_3s`` covers only a window's last 3 s and would hide a stall inside it. The
worst stalls are outlined with the prefill that caused them, the longest waits with the task
that held the batch. The chart is a Vega-Lite spec (altair); vl-convert inlines the JavaScript
into a page that opens offline, and draws PNG and SVG without a browser. A long log stays
light: past ``DETAIL_MAX_TASKS`` tasks the zoomed-out view is time bins per lane.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypeAlias

import numpy as np
import pandas as pd

from . import timeline as tl
from .dataset import Dataset, task_view
from .errors import SlotscopeError
from .filters import parse_when, window
from .timeline import floats as _f

KEYS = tl.GROUP + ["task_id"]
PHASE_COLORS = {"queue": "#bab0ac", "wait": "#e45756", "prefill": "#4c78a8", "generation": "#54a24b"}
LORA_COLORS = ["#b279a2", "#f58518", "#72b7b2", "#9d755d", "#eeca3b", "#ff9da6"]
NO_LORA_COLOR = "#d9d9d9"
STALL_COLOR = "#d62728"
WAIT_COLOR = "#7b3294"
SPEED_COLOR = "#9ecae9"
# Above this many heartbeat windows they are merged per lane into time bins (slowest kept).
MAX_SPEED_ROWS = 20_000
# Above this many tasks the zoomed-out view shows time bins per lane (busiest phase, slowest
# window) and single tasks appear once the visible span holds about this many.
DETAIL_MAX_TASKS = 1_500
OVERVIEW_BINS = 400
# Above this many drawn marks (and always for a long log) the page draws on a canvas instead of
# SVG: faster to redraw while zooming, but no DOM element per mark.
SVG_MAX_MARKS = 2_500
# A window slower than this share of the lanes' typical top speed is drawn as a stall.
STALL_FRAC = 0.1
# Stalls and waits marked: at least this many, more in a long log (one per 50 tasks, at most 100).
MARKED = 12
LANE_PX = 84
WIDTH_PX = 1100
# Vertical layout of a lane (lane i spans [i, i+1], top to bottom).
QUEUE_Y = (0.015, 0.05)
STRIP_Y = 0.075
TASK_Y = (0.10, 0.46)
SPEED_BASE = 0.96
SPEED_H = 0.40
_EPOCH = pd.Timestamp(0, tz="UTC")
When: TypeAlias = str | float | pd.Timestamp | None  # a --since/--until bound: server-clock seconds or a wall time
PathArg: TypeAlias = str | os.PathLike[str]


class PlotExtraMissing(SlotscopeError):
    """The plotting libraries (the ``timeline`` extra) are not installed."""


class NothingToDraw(SlotscopeError):
    """No task of the logs falls in the requested window."""


@dataclass
class TimelineData:
    """What the timeline draws, one table per layer, x already on the chosen clock.

    ``wall``: x values are epoch milliseconds (UTC) if True, else server-clock seconds.
    ``overview``/``overview_speed`` (only for long logs, else None): per lane and time bin, the
    phase that took most of the bin and the bin's generation speed, drawn while the visible
    span is wider than ``detail_span``; single tasks are drawn below it.
    """

    lanes: pd.DataFrame
    tasks: pd.DataFrame
    speed: pd.DataFrame
    stalls: pd.DataFrame
    waits: pd.DataFrame
    wall: bool
    speed_top: float
    domain: tuple[float, float]
    title: str
    overview: pd.DataFrame | None = None
    overview_speed: pd.DataFrame | None = None
    detail_span: float | None = None
    notes: list[str] = field(default_factory=list)

    def marks(self) -> int:
        """Roughly how many marks the first (zoomed-out) view draws."""
        fixed = 5 * (len(self.stalls) + len(self.waits)) + len(self.lanes)
        if self.overview is not None and self.overview_speed is not None:
            return fixed + len(self.overview) + len(self.overview_speed)
        return fixed + 6 * len(self.tasks) + len(self.speed)


def _require() -> tuple[Any, Any]:
    try:
        import altair as alt
        import vl_convert as vlc
    except ImportError as e:
        raise PlotExtraMissing(None, None, f"the timeline needs the plotting extra ({e.name} is missing): "
                               "pip install 'slotscope[timeline]'") from None
    return alt, vlc


def _vl_version() -> str:
    """The Vega-Lite version altair writes specs for (e.g. ``6.4``): the JS inlined must match."""
    alt, _ = _require()
    return ".".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])


def _bound(value: When) -> float | pd.Timestamp | None:
    return parse_when(value) if isinstance(value, str) else value


def _offsets(tv: pd.DataFrame) -> pd.DataFrame:
    """Each aligned session's wall time of server-clock zero, in microseconds since the epoch."""
    if "launch_at" not in tv.columns:
        return pd.DataFrame(columns=tl.GROUP + ["offset_us"])
    ok = tv["launch_at"].notna() & tv["launch_s"].notna()
    at_us = (tv.loc[ok, "launch_at"] - _EPOCH) / pd.Timedelta(microseconds=1)
    off = (at_us - (tv.loc[ok, "launch_s"] * 1e6).round()).rename("offset_us")
    return pd.concat([tv.loc[ok, tl.GROUP], off], axis=1).groupby(tl.GROUP, dropna=False, observed=True)["offset_us"].median().reset_index()


@dataclass(frozen=True)
class _Clock:
    """Session seconds -> chart x: epoch ms on the wall clock, or server seconds as they are."""

    offsets: pd.DataFrame
    wall: bool

    def __call__(self, df: pd.DataFrame, *cols: str) -> dict[str, Any]:
        if not self.wall:
            return {c: pd.array(np.round(_f(df[c]), 3), dtype="Float64") for c in cols}
        off = _f(df[tl.GROUP].merge(self.offsets, on=tl.GROUP, how="left")["offset_us"])
        # Whole milliseconds: the JSON stays short and 1 ms is finer than any bar on screen.
        return {c: pd.array(np.round((off + _f(df[c]) * 1e6) / 1e3), dtype="Int64") for c in cols}


def _lanes(tv: pd.DataFrame, sessions: pd.DataFrame) -> pd.DataFrame:
    """One lane per slot of each session (every slot the session has, busy or not)."""
    used = tv[tl.GROUP + ["slot"]].assign(slot=_f(tv["slot"]))
    parts = [used]
    if len(sessions) and "n_slots" in sessions.columns:
        seen = used[tl.GROUP].drop_duplicates()
        s = sessions.merge(seen, on=tl.GROUP, how="inner")
        n = _f(s["n_slots"])
        ok = ~np.isnan(n)
        s, n = s[ok], n[ok].astype(np.int64)
        rep = s.loc[s.index.repeat(n), tl.GROUP].reset_index(drop=True)
        rep["slot"] = tl.within_ranges(n)
        if len(rep):  # (an empty part would set the dtypes of the join: deprecated in pandas 2.x)
            parts.append(rep)
    lanes = pd.concat(parts, ignore_index=True)
    lanes["slot"] = lanes["slot"].fillna(-1)
    lanes = lanes.drop_duplicates(tl.GROUP + ["slot"]).sort_values(tl.GROUP + ["slot"], kind="stable", ignore_index=True)
    lanes["lane"] = np.arange(len(lanes))
    label = "slot " + lanes["slot"].astype(np.int64).astype(str).replace("-1", "?")
    if len(lanes[tl.GROUP].drop_duplicates()) > 1:
        label = "s" + lanes["session"].astype(str) + " " + label
    if len(lanes[["source", "port"]].drop_duplicates()) > 1:
        src = lanes["source"].astype(str).map(os.path.basename)
        port = lanes["port"].astype(np.int64)
        label = src.where(port < 0, src + ":" + port.astype(str)) + " " + label
    lanes["label"] = label
    return lanes


def _lane_of(df: pd.DataFrame, lanes: pd.DataFrame) -> np.ndarray:
    key = df[tl.GROUP].assign(slot=_f(df["slot"])).fillna({"slot": -1})
    return _f(key.merge(lanes[tl.GROUP + ["slot", "lane"]], on=tl.GROUP + ["slot"], how="left")["lane"])


def _where(file: pd.Series, line: pd.Series) -> np.ndarray:
    """``name:line`` of each log line (``?`` for a line not known)."""
    ln = pd.to_numeric(line, errors="coerce").astype("Int64").astype("string").fillna("?")
    # (a task cut at the log's start has no launch line, so no file)
    name = file.map(lambda f: os.path.basename(str(f)), na_action="ignore").astype("string").fillna("?")
    return (name + ":" + ln).astype(object).to_numpy()


def _either(first: pd.Series, other: pd.Series) -> pd.Series:
    """``first`` where it is there, else ``other`` (as objects: the two may be categories)."""
    return first.astype(object).where(first.notna(), other.astype(object))


def _text(v: pd.Series) -> pd.Series:
    return v.astype("object").where(v.notna(), None)


def _task_table(tv: pd.DataFrame, lanes: pd.DataFrame, clock: _Clock, ends: np.ndarray) -> pd.DataFrame:
    """One row per task: lane, its times on the chart clock, and what the tooltip shows.

    The phases are drawn between consecutive times (queue ``q``..``l``, wait ``l``..``p``,
    prefill ``p``..``f``, generation ``f``..``r``) where both ends are known, as in
    :func:`slotscope.timeline.phases` (the queue starts the app's ``queue_ms`` before launch).
    """
    launch, queue_s = _f(tv["launch_s"]), _f(tv["queue_ms"]) / 1e3
    queued = launch - queue_s
    t = tv.assign(queue_start_s=np.where(queued <= launch, queued, np.nan), end_s=ends)
    x = clock(t, "queue_start_s", "launch_s", "prefill_start_s", "first_token_s", "release_s", "end_s")
    out = pd.DataFrame({
        "lane": _lane_of(t, lanes),
        "session": t["session"].to_numpy(),
        "slot": pd.array(t["slot"], dtype="Int64"),
        "task": t["task_id"].to_numpy(),
        "call": _text(t["call_id"]).to_numpy(),
        "purpose": _text(t["purpose"]).to_numpy(),
        "user": _text(t["user"]).to_numpy(),
        "lora": _text(t["lora"]).to_numpy(),
        "new": pd.array(t["prompt_tokens_new"], dtype="Int64"),
        "cached": pd.array(t["prompt_tokens_cached"], dtype="Int64"),
        "gen": pd.array(t["n_gen"], dtype="Int64"),
        "status": t["status"].astype(str).to_numpy(),
        "where": _where(t["file"], t["line"]),
        "q": x["queue_start_s"], "l": x["launch_s"], "p": x["prefill_start_s"], "f": x["first_token_s"],
        "r": x["release_s"], "e": x["end_s"],
        "queue_s": np.round(queue_s, 3),
        "wait_s": np.round(_f(t["wait_before_prefill_ms"]) / 1e3, 3),
        "prefill_s": np.round(_f(t["prompt_eval_ms"]) / 1e3, 3),
        "gen_s": np.round(_f(t["eval_ms"]) / 1e3, 3),
        "gen_tps": np.round(_f(t["gen_tps"]), 2),
    })
    return out[~np.isnan(out["lane"].to_numpy())].reset_index(drop=True)


def _speed_table(ds: Dataset, tv: pd.DataFrame, lanes: pd.DataFrame, clock: _Clock) -> pd.DataFrame:
    """Each lane's generation windows (heartbeat windows and the tail after the last) with their
    exact speed: tokens over the seconds the window covers."""
    from .analyze.stalls import generation_segments

    seg = generation_segments(ds, tv)
    seg = seg.merge(tv[KEYS + ["file"]], on=KEYS, how="left")
    secs = _f(seg["end_s"]) - _f(seg["start_s"])
    x = clock(seg, "start_s", "end_s")
    sp = pd.DataFrame({
        "lane": _lane_of(seg, lanes), "task": seg["task_id"].to_numpy(),
        "a": x["start_s"], "b": x["end_s"], "sec": np.round(secs, 3),
        "n": _f(seg["tokens"]), "v": np.round(_f(seg["tokens"]) / secs, 2),
        "tg3": np.round(_f(seg["tg_3s_tps"]), 2),
        "where": np.where(seg["kind"] == "heartbeat", _where(_either(seg["hb_file"], seg["file"]), seg["hb_line"]),
                          "(after the last heartbeat)"),
        "windows": 1,
    })
    return sp[~np.isnan(sp["lane"].to_numpy()) & (sp["sec"] > 0)].reset_index(drop=True)


def _bin_speed(sp: pd.DataFrame, lo: float, width: float, pooled: bool = False) -> pd.DataFrame:
    """Windows merged per lane into time bins of ``width`` (by window start), each at its slowest
    window's speed so that a stall inside a bin still shows as a dip; or, ``pooled``, at all its
    tokens over all its seconds (bins of minutes nearly always hold one slow window)."""
    if not len(sp):
        return sp
    k = np.floor((_f(sp["a"]) - lo) / width).astype(np.int64)
    t = sp.assign(bin=k).sort_values(["lane", "bin", "v"], kind="stable")
    g = t.groupby(["lane", "bin"], sort=False, observed=True)
    agg = g.agg(task=("task", "first"), a=("a", "min"), b=("b", "max"), sec=("sec", "sum"), n=("n", "sum"),
                v=("v", "first"), tg3=("tg3", "min"), where=("where", "first"), windows=("v", "size")).reset_index()
    if pooled:
        agg["v"] = np.round(agg["n"] / agg["sec"], 2)
    return agg.drop(columns="bin")


def _busy_bins(tasks: pd.DataFrame, lo: float, width: float, n_bins: int, per_s: float) -> pd.DataFrame:
    """Per lane and time bin: seconds of wait, prefill and generation, the phase that took most,
    and the busy share of the bin (the zoomed-out view of a long log). ``per_s``: chart units per
    second (1000 on the wall clock, 1 on the server clock)."""
    parts = []
    for phase, a, b in (("wait", "l", "p"), ("prefill", "p", "f"), ("generation", "f", "r")):
        s, e = _f(tasks[a]), _f(tasks[b])
        ok = ~np.isnan(s) & ~np.isnan(e) & (e > s)
        parts.append(pd.DataFrame({"lane": _f(tasks["lane"])[ok], "phase": phase, "s": s[ok], "e": e[ok]}))
    iv = pd.concat(parts, ignore_index=True)
    k0 = np.clip(np.floor((iv["s"].to_numpy() - lo) / width), 0, n_bins - 1).astype(np.int64)
    k1 = np.clip(np.floor((iv["e"].to_numpy() - lo) / width), 0, n_bins - 1).astype(np.int64)
    n = k1 - k0 + 1
    rep = np.repeat(np.arange(len(iv)), n)
    k = np.repeat(k0, n) + tl.within_ranges(n)
    edge = lo + k * width
    cover = np.minimum(iv["e"].to_numpy()[rep], edge + width) - np.maximum(iv["s"].to_numpy()[rep], edge)
    pieces = pd.DataFrame({"lane": iv["lane"].to_numpy()[rep], "bin": k, "phase": iv["phase"].to_numpy()[rep], "t": np.clip(cover, 0, None)})
    wide = pieces.pivot_table(index=["lane", "bin"], columns="phase", values="t", aggfunc="sum", fill_value=0.0)
    wide = wide.reindex(columns=["wait", "prefill", "generation"], fill_value=0.0).reset_index()
    phases = wide[["wait", "prefill", "generation"]].to_numpy()
    out = pd.DataFrame({
        "lane": wide["lane"], "a": lo + wide["bin"] * width, "b": lo + (wide["bin"] + 1) * width,
        "phase": np.array(["wait", "prefill", "generation"])[phases.argmax(axis=1)],
        "busy": np.round(np.clip(phases.sum(axis=1) / width, 0, 1), 3),
        "wait_s": np.round(wide["wait"] / per_s, 1), "prefill_s": np.round(wide["prefill"] / per_s, 1),
        "gen_s": np.round(wide["generation"] / per_s, 1),
    })
    return out[out["busy"] > 0].reset_index(drop=True)


def _stall_table(ds: Dataset, tv: pd.DataFrame, keep: pd.DataFrame, lanes: pd.DataFrame, clock: _Clock, opts: Any,
                 slower_than: float, marked: int) -> pd.DataFrame:
    """The worst stalls whose stalled task is in view, with the prefill that caused each.

    The pieces of :func:`worst_stalls` that one prefill cut out of one task's generation (often
    several heartbeat windows in a row) are one stall here: their tokens over their seconds.
    Only stalls slower than ``slower_than`` tokens/s are kept, the slowest first.
    """
    from .analyze.stalls import worst_stalls

    w = worst_stalls(ds, dataclasses.replace(opts, worst=10**9))
    w = w[w["cause_task_id"].notna()].merge(keep, on=KEYS, how="inner")
    by = tl.GROUP + ["task_id", "cause_task_id"]
    g = w.groupby(by, sort=False, dropna=False, observed=True)
    sums = g.agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"), a=("seg_start_s", "min"), b=("seg_end_s", "max"))
    w = g.first().drop(columns=["tokens", "seconds"]).join(sums).reset_index()
    w["v"] = w["tokens"] / w["seconds"]
    w = w[w["v"] < slower_than].sort_values(["v", "seconds"], ascending=[True, False], kind="stable").reset_index(drop=True)
    # Two prefills that overlapped one stall: keep the stall once, with the slower (first) cause.
    w["_rank"] = np.arange(len(w))
    pair = w[by[:-1] + ["_rank", "a", "b"]].merge(w[by[:-1] + ["_rank", "a", "b"]], on=by[:-1], suffixes=("", "_o"))
    shadowed = pair[(pair["_rank_o"] < pair["_rank"]) & (pair["a_o"] < pair["b"]) & (pair["a"] < pair["b_o"])]["_rank"]
    w = w[~w["_rank"].isin(shadowed)].drop(columns="_rank").head(marked).reset_index(drop=True)
    cause = w[tl.GROUP].assign(task_id=w["cause_task_id"].astype("int64")).merge(
        tv[KEYS + ["slot", "prefill_start_s", "first_token_s"]], on=KEYS, how="left")
    mid_s = (np.fmax(_f(w["a"]), _f(cause["prefill_start_s"])) + np.fmin(_f(w["b"]), _f(cause["first_token_s"]))) / 2
    seg = clock(w.assign(mid=mid_s), "a", "b", "mid")
    cx = clock(cause, "prefill_start_s", "first_token_s")
    out = pd.DataFrame({
        "rank": np.arange(1, len(w) + 1), "lane": _lane_of(w, lanes), "task": w["task_id"].to_numpy(),
        "a": seg["a"], "b": seg["b"], "v": np.round(w["v"].to_numpy(dtype=float), 3),
        "tokens": w["tokens"].to_numpy(), "sec": np.round(w["seconds"].to_numpy(dtype=float), 2), "class": w["class"].to_numpy(),
        "purpose": _text(w["purpose"]).to_numpy(), "user": _text(w["user"]).to_numpy(),
        "clane": _lane_of(cause, lanes), "ctask": w["cause_task_id"].astype("int64").to_numpy(),
        "ca": cx["prefill_start_s"], "cb": cx["first_token_s"], "cx": seg["mid"],
        "cnew": pd.array(w["cause_prompt_tokens_new"], dtype="Int64"),
        "cpurpose": _text(w["cause_purpose"]).to_numpy(), "cuser": _text(w["cause_user"]).to_numpy(),
        "where": _where(_either(w["hb_file"], w["file"]), w["hb_line"]),
        "cwhere": _where(_either(w["cause_file"], w["source"]), w["cause_line"]),
    })
    out["label"] = [f"stall #{r}: {v:.2f} tok/s" for r, v in zip(out["rank"], out["v"])]
    out["clabel"] = [f"prefill of task {t} ({n:,} new tokens)" if n is not pd.NA else f"prefill of task {t}"
                     for t, n in zip(out["ctask"], out["cnew"])]
    return out


def _wait_table(ds: Dataset, tv: pd.DataFrame, keep: pd.DataFrame, lanes: pd.DataFrame, clock: _Clock, opts: Any,
                marked: int, windowed: bool) -> pd.DataFrame:
    """The longest waits before prefill in view, with the task that held the batch meanwhile."""
    from .analyze.waits import worst_waits

    # worst_waits pairs each listed wait with its session's tasks: ask for a bounded number.
    w = worst_waits(ds, dataclasses.replace(opts, worst=marked * (20 if windowed else 1)))
    w = w.merge(keep, on=KEYS, how="inner").head(marked).reset_index(drop=True)
    start = _f(w["launch_s"])
    end = start + _f(w["wait_s"])
    held = w[tl.GROUP].assign(task_id=w["holder_task_id"]).merge(
        tv[KEYS + ["slot", "prefill_start_s", "launch_s", "release_s"]].astype({"task_id": "Int64"}), on=KEYS, how="left")
    hs = np.where(np.isnan(_f(held["prefill_start_s"])), _f(held["launch_s"]), _f(held["prefill_start_s"]))
    he = np.where(np.isnan(_f(held["release_s"])), end, _f(held["release_s"]))
    mid = (np.fmax(start, hs) + np.fmin(end, he)) / 2
    mid = np.where(np.isnan(mid), (start + end) / 2, mid)
    x = clock(w.assign(a=start, b=end, mid=mid), "a", "b", "mid")
    out = pd.DataFrame({
        "rank": np.arange(1, len(w) + 1), "lane": _lane_of(w, lanes), "task": w["task_id"].to_numpy(),
        "a": x["a"], "b": x["b"], "hx": x["mid"], "wait_s": w["wait_s"].to_numpy(), "cause": w["cause"].astype(str).to_numpy(),
        "purpose": _text(w["purpose"]).to_numpy(), "user": _text(w["user"]).to_numpy(), "lora": _text(w["lora"]).to_numpy(),
        "hlane": _lane_of(held, lanes), "htask": pd.array(w["holder_task_id"], dtype="Int64"),
        "hpurpose": _text(w["holder_purpose"]).to_numpy(), "hlora": _text(w["holder_lora"]).to_numpy(),
        "hnew": pd.array(w["holder_prompt_tokens_new"], dtype="Int64"),
        "where": _where(w["source"], w["line"]),
    })
    out["label"] = [f"wait {s:.0f} s" + (f" (held by task {h})" if h is not pd.NA else "") for s, h in zip(out["wait_s"], out["htask"])]
    return out


def _launched_in(tv: pd.DataFrame, since: When, until: When) -> pd.DataFrame:
    """The tasks launched in [since, until); :class:`NothingToDraw` if a window is given and none was."""
    kept = window(tv, _bound(since), _bound(until), time_col="launch_s").reset_index(drop=True)
    if not len(kept) and (since is not None or until is not None):
        asked = " ".join(f"--{k} {v}" for k, v in (("since", since), ("until", until)) if v is not None)
        raise NothingToDraw(None, None, f"no task was launched in the window ({asked}); "
                            "give server-clock seconds or ISO times within the logs")
    return kept


def timeline_data(ds: Dataset, since: When = None, until: When = None, opts: Any = None) -> TimelineData:
    """Everything the timeline draws for the tasks launched in [since, until) (all by default).

    ``since``/``until`` take the forms of ``--since``: server-clock seconds or a wall time.
    ``opts`` are the report's :class:`slotscope.analyze.Options` (thresholds of stalls and waits).
    """
    from .analyze import Options

    opts = opts or Options()
    tv_all = task_view(ds)
    tv = _launched_in(tv_all, since, until)
    wall = bool(len(tv)) and "launch_at" in tv.columns and bool(tv["launch_at"].notna().all())
    per_s = 1e3 if wall else 1.0  # chart units per second
    clock = _Clock(_offsets(tv), wall)
    lanes = _lanes(tv, ds.server.sessions)
    tasks = _task_table(tv, lanes, clock, tl.task_ends(tv, ds.server.sessions))
    speed = _speed_table(ds, tv, lanes, clock)
    xs = np.concatenate([_f(tasks[c]) for c in ("q", "l", "e")] + [_f(speed["b"])]) if len(tasks) else np.zeros(1)
    # (tasks with no time at all, e.g. lines without llama's stamps: an empty axis, no warning)
    lo, hi = (float(np.nanmin(xs)), float(np.nanmax(xs))) if np.isfinite(xs).any() else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    notes = []
    if len(speed) > MAX_SPEED_ROWS:
        width = (hi - lo) * max(1, speed["lane"].nunique()) / MAX_SPEED_ROWS
        n_windows = len(speed)
        speed = _bin_speed(speed, lo, width)
        notes.append(f"{n_windows:,} generation windows merged into {len(speed):,} bins of {width / per_s:,.1f} s "
                     "per slot, each at its slowest window (narrow --since/--until to see every window)")
    v = speed["v"].to_numpy(dtype=float) if len(speed) else np.empty(0)
    top = max(float(np.nanpercentile(v, 95)) if len(v) and np.isfinite(v).any() else 1.0, 1e-3)
    marked = max(MARKED, min(100, len(tasks) // 50))
    keep = tv[KEYS]
    stalls = _stall_table(ds, tv_all, keep, lanes, clock, opts, STALL_FRAC * top, marked) if len(tv) else pd.DataFrame()
    waits = _wait_table(ds, tv_all, keep, lanes, clock, opts, marked, since is not None or until is not None) if len(tv) else pd.DataFrame()
    overview = overview_speed = detail_span = None
    if len(tasks) > DETAIL_MAX_TASKS:
        width = (hi - lo) / OVERVIEW_BINS
        overview = _busy_bins(tasks, lo, width, OVERVIEW_BINS, per_s)
        overview_speed = _bin_speed(speed, lo, width, pooled=True)
        detail_span = (hi - lo) * DETAIL_MAX_TASKS / len(tasks)
        notes.append(f"{len(tasks):,} tasks: each lane shows bins of {width / per_s:,.0f} s (colour: the phase that took most of the bin, "
                     "faded: idle; speed: tokens over seconds of the bin)")
    srcs = sorted({os.path.basename(str(s)) for s in tv["source"]}) if len(tv) else []
    title = f"slotscope timeline: {', '.join(srcs) or '(no tasks)'}"
    if not wall:
        sessions = tv[tl.GROUP].drop_duplicates().shape[0]
        notes.append("times are server-clock seconds" + (" (each session's own clock: lanes of different sessions "
                     "overlap in time)" if sessions > 1 else "") + "; an app log or wrapper time stamps put them on the wall clock")
    return TimelineData(lanes=lanes, tasks=tasks, speed=speed, stalls=stalls, waits=waits, wall=wall, speed_top=top,
                        domain=(lo, hi), title=title, overview=overview, overview_speed=overview_speed,
                        detail_span=detail_span, notes=notes)


# ---------------------------------------------------------------------------------------------
# The chart


def timeline_spec(data: TimelineData, *, width: int = WIDTH_PX, interactive: bool = True) -> tuple[dict[str, Any], dict[str, pd.DataFrame]]:
    """The Vega-Lite spec of the timeline and the named datasets it reads (``lanes``, ``tasks``,
    ``speed``, ``stalls``, ``waits``, and for a long log ``overview``, ``overview_speed``).

    Interactive: the x scale zooms (wheel) and pans (drag); in a long log the single-task layers
    draw only while the visible span is below ``data.detail_span``, and only what is in view.
    """
    alt, _ = _require()
    n = max(len(data.lanes), 1)
    # The whole span, fixed: layers filtered empty at this zoom must not move it. As an
    # expression: a list of numbers on a temporal scale is merged twice by Vega-Lite 6 (a warning).
    domain = alt.ExprRef(expr=f"[{data.domain[0]:.13g}, {data.domain[1]:.13g}]")
    if data.wall:
        xtype, xaxis = "T", alt.Axis(title="wall clock (UTC)", format="%H:%M:%S", labelFlush=False)
        xscale = alt.Scale(type="utc", domain=domain)
        tfmt = "utcFormat(datum.{f}, '%H:%M:%S.%L')"
    else:
        xtype, xaxis = "Q", alt.Axis(title="server clock (s)")
        xscale = alt.Scale(zero=False, nice=False, domain=domain)
        tfmt = "format(datum.{f}, ',.3f') + ' s'"

    def X(f: str) -> Any:
        return alt.X(f"{f}:{xtype}", scale=xscale, axis=xaxis)

    def tt(f: str, title: str, **kw: Any) -> Any:
        return alt.Tooltip(f, title=title, **kw)

    def times(*fields: str) -> dict[str, str]:
        # Tooltip times as text (a temporal tooltip with formatType "utc" renders NaN in Vega-Lite 6).
        return {f"{f}_t": f"isValid(datum.{f}) ? {tfmt.format(f=f)} : ''" for f in fields}

    labels = json.dumps(list(data.lanes["label"])) if len(data.lanes) else "[]"
    yscale = alt.Scale(domain=[-0.15, n], reverse=True, nice=False, zero=False)
    yaxis = alt.Axis(values=[i + 0.5 for i in range(n)], labelExpr=f"{labels}[floor(datum.value)] || ''", title=None,
                     grid=False, ticks=False, domain=False, labelFontSize=12, labelFontWeight="bold", labelPadding=6)

    def Y(f: str) -> Any:
        return alt.Y(f"{f}:Q", scale=yscale, axis=yaxis)

    def fits(a: str, b: str, text: str = "datum.label", always: str = "false") -> Any:
        # Text only where its mark is wide enough on screen (or it is the first of its kind).
        return alt.condition(f"({always}) || scale('x', datum.{b}) - scale('x', datum.{a}) > 6.5 * length({text}) + 6",
                             alt.value(1), alt.value(0))

    def at(name: str) -> Any:
        return alt.Chart(alt.NamedData(name=name))

    # Level of detail: which layers draw at the current zoom (constant in a static image).
    long_log = data.overview is not None and data.detail_span is not None
    if long_log and interactive:
        detail_only = f"(isObject(zoom) && isArray(zoom.a) && time(zoom.a[1]) - time(zoom.a[0]) <= {data.detail_span:.10g})"
        view = detail_only + " && datum.{b} >= time(zoom.a[0]) && datum.{a} <= time(zoom.a[1])"  # (a, b: the mark's x fields)
    else:
        detail_only = view = "false" if long_log else "true"
    overview_only = f"!({detail_only})"

    def in_view(a: str, b: str) -> str:
        return view.format(a=a, b=b)

    lane_bg = at("lanes").mark_rect().encode(
        y=Y("y0"), y2="y1:Q",
        fill=alt.condition("datum.lane % 2 == 0", alt.value("#f7f7f7"), alt.value("#ffffff")),
    ).transform_calculate(y0="datum.lane", y1="datum.lane + 1")
    stall_v = STALL_FRAC * data.speed_top
    speed_tt = [tt("task:Q", "task"), tt("v:Q", "tokens/s (tokens / seconds)", format=",.2f"),
                tt("tg3:Q", "tg_3s logged", format=",.2f"), tt("n:Q", "tokens"), tt("sec:Q", "seconds", format=",.2f"),
                tt("a_t:N", "from"), tt("b_t:N", "to"), tt("windows:Q", "windows"), tt("where:N", "log")]

    def speed_layer(name: str, show: str) -> Any:
        return at(name).mark_rect().encode(
            x=X("a"), x2="b", y=Y("y0"), y2="y1:Q",
            fill=alt.condition(f"datum.v < {stall_v:.4g}", alt.value(STALL_COLOR), alt.value(SPEED_COLOR)),
            tooltip=speed_tt,
        ).transform_filter(show).transform_calculate(**times("a", "b"),
            y0=f"datum.lane + {SPEED_BASE}",
            y1=f"datum.lane + {SPEED_BASE} - {SPEED_H} * max(0.12, min(1, datum.v / {data.speed_top:.6g}))",
        )

    speed = speed_layer("speed", in_view("a", "b"))
    if interactive:
        # On a layer with an x field: the zoom is an interval on x, bound to the scale.
        speed = speed.add_params(alt.selection_interval(bind="scales", encodings=["x"], name="zoom"))
    layers = [lane_bg, speed]

    phase_scale = alt.Scale(domain=list(PHASE_COLORS), range=list(PHASE_COLORS.values()))
    phase_fill = alt.Fill("phase:N", title="phase", scale=phase_scale, legend=alt.Legend(orient="top"))
    if long_log:
        ott = [tt("phase:N", "most of the bin"), tt("busy:Q", "busy", format=".0%"), tt("wait_s:Q", "wait s"),
               tt("prefill_s:Q", "prefill s"), tt("gen_s:Q", "generation s"), tt("a_t:N", "from"), tt("b_t:N", "to")]
        layers.append(at("overview").mark_rect().encode(
            x=X("a"), x2="b", y=Y("y0"), y2="y1:Q", fill=phase_fill,
            opacity=alt.Opacity("busy:Q", scale=alt.Scale(domain=[0, 1], range=[0.25, 1]), legend=None), tooltip=ott,
        ).transform_filter(overview_only).transform_calculate(
            y0=f"datum.lane + {TASK_Y[0]}", y1=f"datum.lane + {TASK_Y[1]}", **times("a", "b")))
        layers.append(speed_layer("overview_speed", overview_only))

    loras = sorted({str(v) for v in data.tasks["lora"].dropna()}) if len(data.tasks) else []
    lora_range = [NO_LORA_COLOR if v in ("none", "") else LORA_COLORS[i % len(LORA_COLORS)] for i, v in enumerate(loras)]
    if loras:
        layers.append(at("tasks").mark_rule(strokeWidth=3).encode(
            x=X("l"), x2="e", y=Y("y0"),
            color=alt.Color("lora:N", title="LoRA setting", scale=alt.Scale(domain=loras, range=lora_range),
                            legend=alt.Legend(orient="top", symbolType="stroke", symbolStrokeWidth=4)),
            tooltip=[tt("task:Q", "task"), tt("lora:N", "LoRA")],
        ).transform_filter(f"datum.lora != null && {in_view('l', 'e')}").transform_calculate(y0=f"datum.lane + {STRIP_Y}"))
    task_tt = [tt("task:Q", "task"), tt("session:Q", "session"), tt("slot:Q", "slot"), tt("call:N", "call"),
               tt("purpose:N", "purpose"), tt("user:N", "user"), tt("lora:N", "LoRA"),
               tt("new:Q", "new prompt tokens", format=","), tt("cached:Q", "cached prompt tokens", format=","),
               tt("gen:Q", "generated tokens", format=","), tt("queue_s:Q", "queue s", format=",.2f"),
               tt("wait_s:Q", "wait before prefill s", format=",.2f"), tt("prefill_s:Q", "prefill s", format=",.2f"),
               tt("gen_s:Q", "generation s", format=",.2f"), tt("gen_tps:Q", "generation tokens/s", format=",.1f"),
               tt("l_t:N", "launched"), tt("f_t:N", "first token"), tt("e_t:N", "ended"),
               tt("status:N", "status"), tt("where:N", "log")]
    # The queue (before the slot took the task) is a thin bar above: it may overlap the slot's previous task.
    for phase, a, b, ys in (("queue", "q", "l", QUEUE_Y), ("wait", "l", "p", TASK_Y), ("prefill", "p", "f", TASK_Y),
                            ("generation", "f", "r", TASK_Y)):
        layers.append(at("tasks").mark_rect(stroke="white", strokeWidth=0.3).encode(
            x=X(a), x2=b, y=Y("y0"), y2="y1:Q", fill=phase_fill, tooltip=task_tt,
        ).transform_filter(f"isValid(datum.{a}) && isValid(datum.{b}) && datum.{b} >= datum.{a} && {in_view(a, b)}").transform_calculate(
            y0=f"datum.lane + {ys[0]}", y1=f"datum.lane + {ys[1]}", phase=f"'{phase}'", **times("l", "f", "e")))
    # Purpose on the bar, only where the bar is wide enough on screen to hold it.
    layers.append(at("tasks").mark_text(align="left", baseline="middle", dx=3, fontSize=10, color="white", fontWeight="bold").encode(
        x=X("l"), y=Y("y0"), text="label:N", opacity=fits("l", "e"),
    ).transform_filter(f"datum.purpose != null && {in_view('l', 'e')}").transform_calculate(
        y0=f"datum.lane + {(TASK_Y[0] + TASK_Y[1]) / 2}", label="datum.purpose"))

    if len(data.waits):
        wtt = [tt("label:N", "longest wait"), tt("wait_s:Q", "waited s", format=",.1f"), tt("cause:N", "cause"),
               tt("task:Q", "task"), tt("purpose:N", "purpose"), tt("user:N", "user"), tt("lora:N", "LoRA"),
               tt("htask:Q", "held by task"), tt("hpurpose:N", "holder purpose"), tt("hlora:N", "holder LoRA"),
               tt("hnew:Q", "holder new tokens", format=","), tt("where:N", "log")]
        layers += [
            at("waits").mark_rect(fill=None, stroke=WAIT_COLOR, strokeWidth=2.5).encode(
                x=X("a"), x2="b", y=Y("y0"), y2="y1:Q", tooltip=wtt,
            ).transform_calculate(y0=f"datum.lane + {TASK_Y[0] - 0.03}", y1=f"datum.lane + {TASK_Y[1] + 0.03}"),
            at("waits").mark_rule(stroke=WAIT_COLOR, strokeWidth=1.5, strokeDash=[2, 2]).encode(
                x=X("hx"), y=Y("y0"), y2="y1:Q", tooltip=wtt,
            ).transform_filter("isValid(datum.hlane)").transform_calculate(
                y0=f"datum.lane + {TASK_Y[0]}", y1=f"datum.hlane + {(TASK_Y[0] + TASK_Y[1]) / 2}"),
            at("waits").mark_text(align="left", baseline="bottom", dx=2, fontSize=10, color=WAIT_COLOR, fontWeight="bold").encode(
                x=X("a"), y=Y("y0"), text="label:N", tooltip=wtt, opacity=fits("a", "b", always="datum.rank == 1"),
            ).transform_calculate(y0=f"datum.lane + {TASK_Y[0] - 0.03}"),
        ]
    if len(data.stalls):
        stt = [tt("label:N", "stall"), tt("task:Q", "stalled task"), tt("purpose:N", "purpose"), tt("user:N", "user"),
               tt("tokens:Q", "tokens"), tt("sec:Q", "seconds", format=",.1f"), tt("class:N", "class"),
               tt("ctask:Q", "caused by prefill of task"), tt("cnew:Q", "its new tokens", format=","),
               tt("cpurpose:N", "its purpose"), tt("cuser:N", "its user"), tt("where:N", "heartbeat log"),
               tt("cwhere:N", "prefill log")]
        layers += [
            at("stalls").mark_rect(fill=None, stroke=STALL_COLOR, strokeWidth=2).encode(
                x=X("a"), x2="b", y=Y("y0"), y2="y1:Q", tooltip=stt,
            ).transform_calculate(y0=f"datum.lane + {SPEED_BASE - SPEED_H - 0.04}", y1=f"datum.lane + {SPEED_BASE + 0.03}"),
            at("stalls").mark_rect(fill=None, stroke=STALL_COLOR, strokeWidth=2.5).encode(
                x=X("ca"), x2="cb", y=Y("y0"), y2="y1:Q", tooltip=stt,
            ).transform_filter("isValid(datum.clane) && isValid(datum.ca)").transform_calculate(
                y0=f"datum.clane + {TASK_Y[0] - 0.05}", y1=f"datum.clane + {TASK_Y[1] + 0.05}"),
            at("stalls").mark_rule(stroke=STALL_COLOR, strokeWidth=1.5, strokeDash=[5, 3]).encode(
                x=X("cx"), y=Y("y0"), y2="y1:Q", tooltip=stt,
            ).transform_filter("isValid(datum.clane) && isValid(datum.cx)").transform_calculate(
                y0=f"datum.clane + {TASK_Y[1] + 0.05}", y1=f"datum.lane + {SPEED_BASE - SPEED_H - 0.04}"),
            at("stalls").mark_text(align="left", baseline="top", dx=2, dy=2, fontSize=10, color=STALL_COLOR, fontWeight="bold").encode(
                x=X("a"), y=Y("y0"), text="label:N", tooltip=stt, opacity=fits("a", "b", always="datum.rank == 1"),
            ).transform_calculate(y0=f"datum.lane + {SPEED_BASE - SPEED_H - 0.02}"),
            at("stalls").mark_text(align="left", baseline="top", dx=2, fontSize=10, color=STALL_COLOR).encode(
                x=X("ca"), y=Y("y0"), text="clabel:N", tooltip=stt,
                opacity=fits("ca", "cb", text="datum.clabel", always="datum.rank == 1"),
            ).transform_filter("isValid(datum.clane) && isValid(datum.ca)").transform_calculate(
                y0=f"datum.clane + {TASK_Y[1] + 0.06}"),
        ]
    chart = alt.layer(*layers).properties(width=width, height=LANE_PX * n)
    sub = [f"{len(data.tasks):,} tasks in {len(data.lanes):,} slot lanes; lower half of each lane: generation speed "
           f"(full height = {data.speed_top:.3g} tokens/s; red below {stall_v:.2g})"]
    if interactive:
        sub.append("scroll to zoom in time, drag to pan, double-click to reset; hover for details")
    if long_log and data.detail_span is not None:
        unit = 60e3 if data.wall else 60.0
        sub.append(f"single tasks appear when zoomed to {data.detail_span / unit:,.0f} min or less" if interactive
                   else "narrow --since/--until for single tasks")
    chart = chart.properties(title=alt.Title(data.title, subtitle=sub + data.notes, anchor="start")).configure_view(stroke=None)
    spec = chart.to_dict(validate=True)
    datasets = {"lanes": data.lanes[["lane", "label"]], "tasks": data.tasks, "speed": data.speed,
                "stalls": data.stalls, "waits": data.waits}
    if data.overview is not None and data.overview_speed is not None:
        datasets.update(overview=data.overview, overview_speed=data.overview_speed)
    return spec, datasets


def _spec_and_datasets_json(data: TimelineData, orient: str, interactive: bool = True) -> tuple[str, str]:
    """The spec without its datasets, and the datasets, as JSON texts. ``orient``: ``records``
    (a list of records each, as Vega-Lite wants them) or ``split`` (column names + rows of values,
    which the page turns into records: the keys are not repeated on every row, which halves the
    file of a long log)."""
    spec, datasets = timeline_spec(data, interactive=interactive)
    spec.pop("datasets", None)
    rows = ",".join(f"{json.dumps(k)}:{df.to_json(orient=orient, index=False, force_ascii=False)}" for k, df in datasets.items())
    return json.dumps(spec, separators=(",", ":")), "{" + rows + "}"


def spec_json(data: TimelineData, *, interactive: bool = True) -> str:
    """The complete Vega-Lite spec with its data inlined, as JSON text (e.g. for vl-convert)."""
    spec, datasets = _spec_and_datasets_json(data, "records", interactive)
    return spec[:-1] + ',"datasets":' + datasets + "}"


# ---------------------------------------------------------------------------------------------
# Files

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px; color: #222; }}
h2 {{ font-size: 15px; margin: 18px 0 6px; }}
table {{ border-collapse: collapse; font-size: 12px; }}
td, th {{ border-bottom: 1px solid #e5e5e5; padding: 2px 8px; text-align: left; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
#error {{ color: #b00; font-weight: bold; }}
.note {{ color: #666; font-size: 12px; }}
</style>
<script>window.addEventListener("error", (e) => document.documentElement.setAttribute("data-error", String(e.message)));</script>
<script>{bundle}</script>
</head>
<body>
<div id="timeline"></div>
<div id="error"></div>
{after}
<script>
(function () {{
  const spec = {spec};
  const data = {data};
  spec.datasets = {{}};
  for (const [name, t] of Object.entries(data)) {{
    spec.datasets[name] = t.data.map((row) => {{ const o = {{}}; t.columns.forEach((c, i) => {{ o[c] = row[i]; }}); return o; }});
  }}
  const fail = (e) => {{
    document.getElementById("error").textContent = "The timeline could not be drawn: " + e;
    document.documentElement.setAttribute("data-error", String(e));
    console.error(e);
  }};
  vegaEmbed("#timeline", spec, {{renderer: "{renderer}", actions: {{export: true, source: false, compiled: false, editor: false}}}})
    .then((r) => {{ window.slotscopeView = r.view; document.body.setAttribute("data-rendered-ms", performance.now().toFixed(0)); }})
    .catch(fail);
}})();
</script>
</body>
</html>
"""


def _lists_html(data: TimelineData) -> str:
    """The marked stalls and waits as plain tables under the chart (readable without JS too)."""
    def lane(v: float) -> str:
        return html.escape("?" if v != v else str(data.lanes["label"].iloc[int(v)]))

    def head(r: Any) -> str:
        return f"<tr><td>#{r.rank}</td><td>{lane(r.lane)}</td><td>task {r.task}</td><td>{html.escape(str(r.purpose or ''))}</td>"

    stalls = "".join(
        f"{head(r)}<td class=n>{r.v:.2f} tok/s</td><td class=n>{r.tokens} tokens in {r.sec:.1f} s</td>"
        f"<td>while {html.escape(r.clabel)} ran in {lane(r.clane)}</td><td>{html.escape(r.cwhere)}</td></tr>"
        for r in data.stalls.itertuples(index=False))
    waits = "".join(
        f"{head(r)}<td class=n>{r.wait_s:.1f} s</td><td>{html.escape(r.cause)}</td>"
        f"<td>{'held by task ' + str(r.htask) + ' in ' + lane(r.hlane) if r.htask is not pd.NA else ''}</td>"
        f"<td>{html.escape(r.where)}</td></tr>"
        for r in data.waits.itertuples(index=False))
    lists = {"stalls": ("Worst generation stalls and the prefill that caused them", stalls),
             "waits": ("Longest waits before prefill and the task that held the batch", waits)}
    return "\n".join(f'<h2 id="{k}">{title}</h2><table>{rows}</table>' for k, (title, rows) in lists.items() if rows)


def page_html(data: TimelineData, after: str = "") -> str:
    """The self-contained HTML page of the timeline (``after``: more HTML under the chart)."""
    _, vlc = _require()
    spec, datasets = _spec_and_datasets_json(data, "split")
    renderer = "svg" if data.overview is None and data.marks() <= SVG_MAX_MARKS else "canvas"
    bundle = vlc.javascript_bundle(vl_version=_vl_version())
    # "</script" inside inline JS would end the <script> element early (the bundle holds no
    # "<!--" or "<script", which tests check).
    return _PAGE.format(title=html.escape(data.title), bundle=bundle.replace("</script", "<\\/script"),
                        spec=script_json(spec), data=script_json(datasets), renderer=renderer,
                        after=after + "\n" + _lists_html(data))


def script_json(text: str) -> str:
    """JSON text made safe to place inside an inline ``<script>``: every ``<`` written as
    ``\\u003c``. In a script element, ``</`` can end it and ``<!--`` followed by ``<script`` makes
    the parser take the rest of the page as script; JSON holds ``<`` only inside strings, where
    ``\\u003c`` reads back as the same character."""
    return text.replace("<", "\\u003c")


def timeline_html(ds: Dataset, path: PathArg, since: When = None, until: When = None) -> Path:
    """Write the interactive timeline of ``ds`` to ``path`` as one self-contained HTML file."""
    out = Path(path)
    out.write_text(page_html(timeline_data(ds, since, until)), encoding="utf-8")
    return out


def timeline_image(ds: Dataset, path: PathArg, since: When = None, until: When = None, *, scale: float = 1.5) -> Path:
    """Write a static PNG or SVG of the timeline (by ``path``'s extension), e.g. for an issue thread."""
    _, vlc = _require()
    spec = spec_json(timeline_data(ds, since, until), interactive=False)
    out = Path(path)
    if out.suffix.lower() == ".svg":
        out.write_text(vlc.vegalite_to_svg(spec, vl_version=_vl_version()), encoding="utf-8")
    else:
        out.write_bytes(vlc.vegalite_to_png(spec, vl_version=_vl_version(), scale=scale))
    return out


IMAGE_SUFFIXES = (".png", ".svg")


def write_timeline(ds: Dataset, path: PathArg, since: When = None, until: When = None) -> Path:
    """HTML, PNG or SVG by the extension of ``path`` (anything else is HTML)."""
    if Path(path).suffix.lower() in IMAGE_SUFFIXES:
        return timeline_image(ds, path, since, until)
    return timeline_html(ds, path, since, until)


def report_html(ds: Dataset, tables: Mapping[str, pd.DataFrame], path: PathArg, opts: Any = None) -> Path:
    """The report's findings and tables followed by the timeline, in one self-contained HTML file
    (the captions name the thresholds of ``opts``, the options the tables were made with)."""
    from .report import captions, setup_line

    said_as = captions(opts)
    setup = setup_line(ds.server.sessions)
    parts = [f'<p class="note">{html.escape(setup)}</p>'] if setup else []
    findings = tables.get("findings")
    if findings is not None and "finding" in findings.columns:
        items = "".join(f"<li>{html.escape(str(t))}</li>" for t in findings["finding"])
        parts.append(f"<h2>Findings</h2><ul>{items}</ul>")
    for name, df in tables.items():
        if name == "findings":
            continue
        cap = f'<p class="note">{html.escape(said_as[name])}</p>' if name in said_as else ""
        body = df.to_html(index=False, na_rep="", border=0, float_format=lambda v: f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}")
        parts.append(f'<h2 id="table-{html.escape(name)}">{html.escape(name)}</h2>{cap}{body}')
    out = Path(path)
    out.write_text(page_html(timeline_data(ds), after="\n".join(parts)), encoding="utf-8")
    return out
