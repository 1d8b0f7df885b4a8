"""How busy the server was: share of time with 0, 1, 2, ... tasks running.

The observed span of a session is its first launch to its last release (idle time included);
a task runs from its launch to its end (:func:`slotscope.timeline.task_ends`). Rows are
``overall`` and, where wall times exist, one scope per calendar day in ``opts.tz`` (``--tz``;
UTC by default; a day with a daylight-saving change is 23 or 25 hours long).

Each busy period gives its seconds per running count from the step function of its tasks; the
idle time between periods lies in no period, so the merge adds it from where each part's
stretch of a session begins and ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..dataset import Dataset
from ..periods import Part
from ..timeline import GROUP, floats, key_codes, step_levels, within_ranges
from .questions import Options, Question, ask

LOAD_COLUMNS = ["scope", "running", "seconds", "share", "scope_seconds", "max_running", "n_slots"]
OVERALL = "overall"


@dataclass
class Steps:
    """A step function of running counts, each session's steps in time order: ``session`` (a
    code of the session, its place in an array of offsets), ``start``/``end`` (s, session
    clock) and ``running``."""

    session: np.ndarray
    start: np.ndarray
    end: np.ndarray
    running: np.ndarray


def _clipped(steps: Steps, span: tuple[float, float] | None) -> Steps:
    """The steps inside a cut period's piece (``span``, NaN: open end)."""
    if span is None:
        return steps
    lo, hi = np.nan_to_num(span, nan=-np.inf)[0], np.nan_to_num(span, nan=np.inf)[1]
    start, end = np.maximum(steps.start, lo), np.minimum(steps.end, hi)
    keep = end > start
    return Steps(steps.session[keep], start[keep], end[keep], steps.running[keep])


def _offsets_us(tv: pd.DataFrame, code: np.ndarray, n_codes: int) -> np.ndarray:
    """Per session code: wall time (µs since epoch) of its clock's zero, the median over its
    tasks with a wall launch time (NaN: none)."""
    out = np.full(n_codes, np.nan)
    if "launch_at" not in tv.columns:
        return out
    launch_s = floats(tv["launch_s"])
    ok = tv["launch_at"].notna().to_numpy() & ~np.isnan(launch_s)
    if not ok.any():
        return out
    at = tv["launch_at"] if ok.all() else tv["launch_at"][ok]
    us = at.dt.tz_convert("UTC").astype("datetime64[us, UTC]").astype("int64").to_numpy()
    d = pd.Series(us - launch_s[ok] * 1e6).groupby(code[ok]).median()
    out[d.index.to_numpy()] = d.to_numpy()
    return out


def _midnights(first_us: float, last_us: float, tz: str) -> tuple[np.ndarray, np.ndarray]:
    """Epoch µs of each midnight in ``tz`` from the day of ``first_us`` to the one after the day
    of ``last_us`` (a midnight a clock change skips: the first instant after it; one it repeats:
    the first), and each day's date as text (one fewer)."""
    def local_date(us: float) -> pd.Timestamp:
        return pd.Timestamp(int(us), unit="us", tz="UTC").tz_convert(tz).tz_localize(None).normalize()

    dates = pd.date_range(local_date(first_us), local_date(np.nextafter(last_us, -np.inf)) + pd.Timedelta(days=1), freq="D")
    at = dates.tz_localize(tz, ambiguous=True, nonexistent="shift_forward").tz_convert("UTC")
    return at.as_unit("us").asi8.astype(np.int64), np.asarray(dates[:-1].strftime("%Y-%m-%d"), dtype=object)


def _seconds(steps: Steps, offset_us: np.ndarray, tz: str) -> pd.DataFrame:
    """Seconds per (scope, running) of the steps: ``overall``, and per calendar day in ``tz`` for
    the sessions with a wall offset (a step across midnight: a piece on each side)."""
    out = [_summed(np.zeros(len(steps.start), np.int64), steps.running, steps.end - steps.start, np.array([OVERALL], dtype=object))]
    o = offset_us[steps.session] if len(steps.session) else np.zeros(0)
    dated = ~np.isnan(o)
    if dated.any():
        a, z = o[dated] + steps.start[dated] * 1e6, o[dated] + steps.end[dated] * 1e6
        starts, names = _midnights(a.min(), z.max(), tz)
        d0 = np.searchsorted(starts, a, side="right") - 1
        n = np.maximum(np.searchsorted(starts, np.nextafter(z, -np.inf), side="right") - d0, 1)
        rep = np.repeat(np.arange(len(a)), n)
        day = d0[rep] + within_ranges(n)
        secs = np.minimum(z[rep], starts[day + 1]) / 1e6 - np.maximum(a[rep], starts[day]) / 1e6
        out.append(_summed(day, steps.running[dated][rep], secs, names))
    return pd.concat(out, ignore_index=True)


def _summed(scope: np.ndarray, running: np.ndarray, seconds: np.ndarray, names: np.ndarray) -> pd.DataFrame:
    """Seconds summed per (scope, running), scopes given as positions in ``names``."""
    width = int(running.max(initial=0)) + 1
    # (the keys as a categorical's codes: grouped as integers are, without factorizing them)
    by = pd.Categorical.from_codes(scope * width + running, categories=np.arange(len(names) * width))
    g = pd.Series(seconds).groupby(by, observed=True).sum()
    key = np.asarray(g.index.categories)[g.index.codes]
    return pd.DataFrame({"scope": names[key // width], "running": key % width, "seconds": g.to_numpy()})


@dataclass
class PartLoad:
    """One part's load: its seconds per (scope, running) and, per session it holds, its
    stretch of the session's clock (``lo``, ``hi``) and wall offset."""

    seconds: pd.DataFrame
    stretches: pd.DataFrame


def load_of_part(part: Part, opts: Options) -> PartLoad:
    """Seconds per running count within one part (only inside its span where it is a piece
    of a cut period), overall and per day."""
    tv = part.tasks
    code, _, session, start, end, levels = step_levels(tv, part.sessions)  # (code: each task's session)
    steps = _clipped(Steps(session, start, end, levels[0]), part.span)
    n_codes = int(code.max(initial=-1)) + 1
    offset = _offsets_us(tv, code, n_codes)
    # (steps are in session order, each session's in time order)
    sessions, first = np.unique(steps.session, return_index=True)
    last = np.r_[first[1:], len(steps.session)][:len(first)] - 1
    codes, row = np.unique(code, return_index=True)
    stretches = tv[GROUP].iloc[row[np.searchsorted(codes, sessions)]].reset_index(drop=True)
    stretches["lo"], stretches["hi"] = steps.start[first], steps.end[last]
    stretches["offset_us"] = offset[sessions]
    return PartLoad(_seconds(steps, offset, opts.tz), stretches)


def _idle_between_parts(stretches: pd.DataFrame, tz: str) -> pd.DataFrame:
    """Seconds per (scope, 0) of each session's idle time between the stretches of its parts."""
    code = key_codes([stretches], GROUP)[0] if len(stretches) else np.zeros(0, np.int64)
    order = np.lexsort((stretches["lo"].to_numpy(), code))
    s = stretches.iloc[order].reset_index(drop=True)
    c = code[order]
    lo, hi = s["lo"].to_numpy(), s["hi"].to_numpy()
    gap = np.flatnonzero((c[1:] == c[:-1]) & (lo[1:] > hi[:-1]))
    steps = Steps(gap, hi[gap], lo[gap + 1], np.zeros(len(gap), dtype=np.int64))
    return _seconds(steps, s["offset_us"].to_numpy(dtype="float64", na_value=np.nan), tz)


def merge_load(answers: list[PartLoad], opts: Options, ds: Dataset) -> dict[str, pd.DataFrame]:
    """The load table from every part's seconds and the idle time between parts."""
    stretches = pd.concat([a.stretches for a in answers], ignore_index=True) if answers else pd.DataFrame()
    if not len(stretches):
        return {"load": pd.DataFrame({c: pd.Series(dtype="float64") for c in LOAD_COLUMNS})}
    rows = pd.concat([a.seconds for a in answers] + [_idle_between_parts(stretches, opts.tz)], ignore_index=True)
    g = rows.groupby(["scope", "running"], as_index=False)["seconds"].sum()
    # ``overall`` first, then the days in date order, each by running count.
    g = g.iloc[np.argsort(g["scope"].to_numpy() != OVERALL, kind="stable")].reset_index(drop=True)
    g["running"] = g["running"].astype("int64")
    tot = g.groupby("scope")["seconds"].transform("sum")
    g["share"] = (g["seconds"] / tot).round(6)
    g["scope_seconds"] = tot.round(3)
    g["max_running"] = g.groupby("scope")["running"].transform("max")
    g["seconds"] = g["seconds"].round(3)
    g["scope"] = g["scope"].to_numpy(dtype=object)
    n_slots = pd.to_numeric(ds.server.sessions["n_slots"], errors="coerce").max() if len(ds.server.sessions) else np.nan
    g["n_slots"] = pd.array([n_slots if pd.notna(n_slots) else pd.NA] * len(g), dtype="Int64")
    return {"load": g[LOAD_COLUMNS]}


ask(Question(("load",), load_of_part, merge_load))
