"""How busy the server was: share of time with 0, 1, 2, ... tasks running.

The observed span of a session is its first launch to its last release (idle time included);
a task runs from its launch to its release (:func:`slotscope.timeline.concurrency`). Rows are
``overall`` and, where wall times exist, one scope per calendar day in ``opts.tz`` (``--tz``;
UTC by default; a day with a daylight-saving change is 23 or 25 hours long).
"""

from __future__ import annotations

import gc

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, release_memory, task_view
from . import Options, register

LOAD_COLUMNS = ["scope", "running", "seconds", "share", "scope_seconds", "max_running", "n_slots"]


def _free() -> None:
    """Free the frames just dropped now, not at the next table: pandas objects hold one another
    in cycles (their arrays wait for the collector), and the Arrow pool and glibc keep freed
    pages (see :func:`release_memory`)."""
    gc.collect(1)  # (the young generations: the frames were made in this table; a full collection took ~0.1 s)
    release_memory()


def _wall_offsets(tv: pd.DataFrame) -> pd.DataFrame:
    """Per session: wall time (µs since epoch) of server-clock zero, where tasks carry wall times."""
    if "launch_at" not in tv.columns:
        return pd.DataFrame(columns=tl.GROUP + ["offset_us"])
    at = tv["launch_at"]
    ok = at.notna() & tv["launch_s"].notna()
    if not ok.any():
        return pd.DataFrame(columns=tl.GROUP + ["offset_us"])
    us = at[ok].dt.tz_convert("UTC").astype("datetime64[us, UTC]").astype("int64").to_numpy()
    d = tv.loc[ok, tl.GROUP].assign(offset_us=us - tv.loc[ok, "launch_s"].to_numpy() * 1e6)
    return d.groupby(tl.GROUP, dropna=False, observed=True)["offset_us"].median().reset_index()


def _share_rows(key: np.ndarray, seconds: np.ndarray, width: int, names: np.ndarray) -> pd.DataFrame:
    """Seconds per (scope, running), each row's pair given as one integer ``scope * width +
    running``, scopes as codes into ``names`` (in their sort order): grouped by one integer per
    row, not by a text per step (a 1 GB log has 2.2M steps) nor by two keys (whose group index
    costs several arrays as long as the steps more), and not copied into a table first. The
    integers are the codes of a categorical (in their narrowest type): the groupby sums them
    as it sums integer keys (the same sums, in the same order) without factorizing them (at
    2.2M steps, as many as at 1 GB of log, an integer key's groupby rose ~50 MB, this one ~19 MB):
    codes of the integers that occur (the groupby recodes others into a copy as wide as a position)."""
    n_keys = len(names) * width
    codes = key.astype(next(t for t in (np.int8, np.int16, np.int32, np.int64) if n_keys <= np.iinfo(t).max), copy=False)
    seen = np.unique(codes)
    if len(seen) < n_keys:
        rank = np.zeros(n_keys, dtype=codes.dtype)
        rank[seen] = np.arange(len(seen))
        codes = np.concatenate([rank[codes[at:at + STEP_BLOCK]] for at in range(0, len(codes), STEP_BLOCK)] or [codes])
    by = pd.Categorical.from_codes(codes, categories=seen.astype(np.int64))
    del codes
    g = pd.Series(seconds, copy=False).groupby(by, observed=True).sum()
    del by
    key = np.asarray(g.index.categories)[g.index.codes]
    g = g.rename("seconds").reset_index(drop=True).to_frame()
    g.insert(0, "scope", key // width)
    g.insert(1, "running", key % width)
    tot = g.groupby("scope", observed=True)["seconds"].transform("sum")
    g["share"] = g["seconds"] / tot
    g["scope_seconds"] = tot
    g["max_running"] = g.groupby("scope", observed=True)["running"].transform("max")
    g["scope"] = names[g["scope"].to_numpy()]
    return g


def _midnights(first_us: float, last_us: float, tz: str) -> tuple[np.ndarray, np.ndarray]:
    """Epoch µs of each midnight in ``tz`` from the day of ``first_us`` to the one after the day
    of ``last_us`` (a midnight a clock change skips: the first instant after it; one it repeats:
    the first), and each day's date as text (one fewer)."""
    def local_date(us: float) -> pd.Timestamp:
        return pd.Timestamp(int(us), unit="us", tz="UTC").tz_convert(tz).tz_localize(None).normalize()

    dates = pd.date_range(local_date(first_us), local_date(np.nextafter(last_us, -np.inf)) + pd.Timedelta(days=1), freq="D")
    at = dates.tz_localize(tz, ambiguous=True, nonexistent="shift_forward").tz_convert("UTC")
    starts = at.as_unit("us").asi8.astype(np.int64)
    return starts, np.asarray(dates[:-1].strftime("%Y-%m-%d"), dtype=object)


STEP_BLOCK = 1 << 16  # steps cut at midnights at a time


def _day_pieces(a: np.ndarray, z: np.ndarray, running: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps from ``a`` to ``z`` (epoch µs) cut at the midnights ``starts``: each piece's
    running count, seconds and day (index into ``starts``), in step order."""
    d0 = np.searchsorted(starts, a, side="right") - 1
    d1 = np.searchsorted(starts, np.nextafter(z, -np.inf), side="right") - 1
    n = np.maximum(d1 - d0 + 1, 1)
    del d1
    if (n == 1).all():  # no step spans a midnight (the usual case): one piece per step
        return running, np.minimum(z, starts[d0 + 1]) / 1e6 - np.maximum(a, starts[d0]) / 1e6, d0
    rep = np.repeat(np.arange(len(a)), n)
    day = d0[rep] + tl.within_ranges(n)
    pa = np.maximum(a[rep], starts[day])
    pz = np.minimum(z[rep], starts[day + 1])
    return running[rep], pz / 1e6 - pa / 1e6, day


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays end to end (one: itself, not a copy)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _day_keys(o: float, t: np.ndarray, running: np.ndarray, starts: np.ndarray, width: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_day_pieces` of a session's steps (``t``, on its clock; ``o`` its offset in µs), a
    block of steps at a time (their temporaries stay bounded), written into two arrays: each
    piece's ``day * width + running`` (in ``dtype``) and seconds, in step order. Steps tile
    the session's time, so each midnight cuts at most one of them: there are at most as many
    pieces as steps and midnights (a list of blocks and its concatenation were twice that)."""
    n = len(t) - 1
    keys = np.empty(n + len(starts), dtype=dtype)
    seconds = np.empty(n + len(starts))
    at = 0
    for i in range(0, n, STEP_BLOCK):
        j = min(i + STEP_BLOCK, n)
        run, secs, day = _day_pieces(o + t[i:j] * 1e6, o + t[i + 1:j + 1] * 1e6, running[i:j], starts)
        k = len(secs)
        keys[at:at + k] = day.astype(np.int64) * width + run
        seconds[at:at + k] = secs
        at += k
    return keys[:at], seconds[:at]


@register("load")
def load_table(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Seconds and share of the observed span with each number of tasks running, overall and
    per calendar day (in ``opts.tz``); ``max_running`` is the scope's highest concurrency, ``n_slots`` the most slots
    any session had."""
    tv = task_view(ds, tl.GROUP + tl.TIMES)
    # A session at a time (its steps' arrays, not ones as long as all steps for the session of
    # each step and its offset): only the running count is read here.
    parts = list(tl.concurrency_parts(tv, ds.server.sessions, running_only=True))
    if not sum(len(t) - 1 for _, t, _ in parts):
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in LOAD_COLUMNS})
    width = max(int(levels[0].max(initial=0)) for _, _, levels in parts) + 1
    # (the running counts in the narrowest type that holds them: a byte or two a step)
    parts = [(row, t, tl.narrow(levels[0])) for row, t, levels in parts]
    for c in tl.TIMES[1:]:  # (what the wall offsets read stays, and the wall times join it)
        del tv[c]
    wall = task_view(ds, ["launch_at"])
    if "launch_at" in wall.columns:
        tv["launch_at"] = wall["launch_at"]
    del wall
    off = _wall_offsets(tv)
    if len(off):
        # Each session's offset (NaN: none; its steps have no calendar day).
        tcode, ocode = tl.key_codes([tv, off], tl.GROUP)
        offset = tl.by_code(ocode, off["offset_us"].to_numpy(dtype=np.float64), tcode[[row for row, _, _ in parts]], np.nan)
        del tcode, ocode
        dated = [(o, t, running) for o, (_, t, running) in zip(offset, parts) if not np.isnan(o) and len(t) > 1]
    else:
        dated = []
    del tv, off
    _free()  # (the view's columns, before the steps are summed)
    seconds = _cat([t[1:] - t[:-1] for _, t, _ in parts])
    rows = [_share_rows(_cat([running for _, _, running in parts]), seconds, width, np.array(["overall"], dtype=object))]
    del seconds, parts
    if dated:
        # Cut steps at midnights: one piece per day each step touches; the pieces, in step
        # order, summed at once. (Steps are in time order: a session's first and last bound them.)
        starts, names = _midnights(min(o + t[0] * 1e6 for o, t, _ in dated), max(o + t[-1] * 1e6 for o, t, _ in dated), opts.tz)
        dtype = next(t for t in (np.int8, np.int16, np.int32, np.int64) if len(names) * width <= np.iinfo(t).max)
        pieces = [_day_keys(o, t, running, starts, width, dtype) for o, t, running in dated]
        del dated
        rows.append(_share_rows(_cat([k for k, _ in pieces]), _cat([v for _, v in pieces]), width, names))
    out = pd.concat(rows, ignore_index=True)
    n_slots = pd.to_numeric(ds.server.sessions["n_slots"], errors="coerce").max() if len(ds.server.sessions) else np.nan
    out["n_slots"] = pd.array([n_slots] * len(out), dtype="Int64") if pd.notna(n_slots) else pd.array([pd.NA] * len(out), dtype="Int64")
    out["seconds"] = out["seconds"].round(3)
    out["scope_seconds"] = out["scope_seconds"].round(3)
    out["share"] = out["share"].round(6)
    return out[LOAD_COLUMNS]
