"""How busy the server was: share of time with 0, 1, 2, ... tasks running.

The observed span of a session is its first launch to its last release (idle time included);
a task runs from its launch to its release (:func:`slotscope.timeline.concurrency`). Rows are
``overall`` and, where wall times exist, one scope per UTC day.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, task_view
from . import Options, register

LOAD_COLUMNS = ["scope", "running", "seconds", "share", "scope_seconds", "max_running", "n_slots"]
_DAY_US = 86_400 * 1_000_000


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
    return d.groupby(tl.GROUP, dropna=False)["offset_us"].median().reset_index()


def _share_rows(steps: pd.DataFrame, scope: pd.Series | str) -> pd.DataFrame:
    s = pd.DataFrame({"running": steps["running"], "seconds": steps["end_s"] - steps["start_s"]}).assign(scope=scope)
    g = s.groupby(["scope", "running"])["seconds"].sum().reset_index()
    tot = g.groupby("scope")["seconds"].transform("sum")
    g["share"] = g["seconds"] / tot
    g["scope_seconds"] = tot
    g["max_running"] = g.groupby("scope")["running"].transform("max")
    return g


@register("load")
def load_table(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Seconds and share of the observed span with each number of tasks running, overall and
    per UTC day; ``max_running`` is the scope's highest concurrency, ``n_slots`` the most slots
    any session had."""
    tv = task_view(ds)
    steps = tl.concurrency(tv, ds.server.sessions)
    if steps.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in LOAD_COLUMNS})
    rows = [_share_rows(steps, "overall")]
    off = _wall_offsets(tv)
    if len(off):
        w = steps[tl.GROUP + ["start_s", "end_s", "running"]].merge(off, on=tl.GROUP, how="inner")
        a = w["offset_us"].to_numpy() + w["start_s"].to_numpy() * 1e6
        z = w["offset_us"].to_numpy() + w["end_s"].to_numpy() * 1e6
        # Cut steps at UTC midnights: one piece per day each step touches.
        d0 = np.floor(a / _DAY_US).astype(np.int64)
        d1 = np.floor(np.nextafter(z, -np.inf) / _DAY_US).astype(np.int64)
        n = np.maximum(d1 - d0 + 1, 1)
        rep = np.repeat(np.arange(len(w)), n)
        day = d0[rep] + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
        pa = np.maximum(a[rep], day * _DAY_US)
        pz = np.minimum(z[rep], (day + 1) * _DAY_US)
        pieces = pd.DataFrame({"running": w["running"].to_numpy()[rep], "start_s": pa / 1e6, "end_s": pz / 1e6})
        days, which = np.unique(day, return_inverse=True)  # a date formatted once per day, not per piece
        names = np.asarray(pd.to_datetime(days * _DAY_US, unit="us", utc=True).strftime("%Y-%m-%d"), dtype=object)
        label = pd.Series(names[which])
        rows.append(_share_rows(pieces, label))
    out = pd.concat(rows, ignore_index=True)
    n_slots = pd.to_numeric(ds.server.sessions["n_slots"], errors="coerce").max() if len(ds.server.sessions) else np.nan
    out["n_slots"] = pd.array([n_slots] * len(out), dtype="Int64") if pd.notna(n_slots) else pd.array([pd.NA] * len(out), dtype="Int64")
    out["seconds"] = out["seconds"].round(3)
    out["scope_seconds"] = out["scope_seconds"].round(3)
    out["share"] = out["share"].round(6)
    return out[LOAD_COLUMNS]
