"""What wasn't the cause: the field report's other hypotheses, each with the figure that
rules it out or not (the report's "What wasn't the cause" table).

Made from the report's other tables, as the findings are: one row per hypothesis with its
figure, the samples the figure rests on, and a verdict: ``ruled out``, ``not ruled out``,
``too few samples`` (fewer than ``opts.min_samples``), or ``unknown`` where the logs lack what
the figure needs (most need an app log).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..dataset import Dataset, task_view
from .questions import Options, percent

RULED_OUT_COLUMNS = ["hypothesis", "figure", "samples", "verdict"]
# Below these shares a hypothesis cannot explain a slow server.
ALL_BUSY_SHARE = 0.05  # time with every slot taken
MISS_SHARE = 0.10  # cache misses among a user's consecutive turns
BACKGROUND_SHARE = 0.10  # unlogged tasks and summaries, of all task time
CONTEXT_RATIO = 0.8  # generation speed at the longest contexts against the shortest


def _verdict(out: bool, samples: int, opts: Options) -> str:
    if samples < opts.min_samples:
        return "too few samples"
    return "ruled out" if out else "not ruled out"


def _capacity(load: pd.DataFrame | None, ds: Dataset, opts: Options) -> dict:
    """Not enough capacity: the server idle most of the time, its slots rarely all taken."""
    hyp = "not enough capacity"
    if load is None or "scope" not in load.columns or not (load["scope"] == "overall").any():
        return {"hypothesis": hyp, "figure": "no task ran", "samples": ds.n_tasks, "verdict": "unknown"}
    o = load[load["scope"] == "overall"]
    share = dict(zip(o["running"].astype(int), o["share"].astype(float)))
    slots = int(o["n_slots"].max()) if o["n_slots"].notna().any() else int(o["max_running"].max())
    full = sum(v for k, v in share.items() if k >= slots)
    hours = float(o["scope_seconds"].iloc[0]) / 3600
    figure = (f"idle {percent(share.get(0, 0.0))}, 2+ tasks running {percent(sum(v for k, v in share.items() if k >= 2))}, "
              f"all {slots} slots taken {percent(full)} of {hours:.2f} h")
    return {"hypothesis": hyp, "figure": figure, "samples": ds.n_tasks, "verdict": _verdict(full < ALL_BUSY_SHARE, ds.n_tasks, opts)}


def _slots(cache: pd.DataFrame | None, opts: Options) -> dict:
    """Users fighting over slots: a user's next turn finds its cache gone."""
    hyp = "users fighting over slots"
    row = cache[cache["user"] == "all"] if cache is not None and "user" in cache.columns else None
    if row is None or row.empty:
        return {"hypothesis": hyp, "figure": "needs an app log (users and turns)", "samples": 0, "verdict": "unknown"}
    r = row.iloc[0]
    turns, misses = int(r["consecutive_turns"]), int(r["misses"])
    figure = (f"{misses} cache misses in {turns} consecutive turns within {opts.cache_window_s / 60:g} min "
              f"({int(r['misses_on_other_slot'])} on another slot)")
    return {"hypothesis": hyp, "figure": figure, "samples": turns, "verdict": _verdict(misses < MISS_SHARE * turns, turns, opts)}


def _background(ds: Dataset, opts: Options) -> dict:
    """Background work: tasks no call of the app explains, and the app's summaries."""
    hyp = "background work"
    if ds.matches is None:
        return {"hypothesis": hyp, "figure": "needs an app log (which tasks are the app's)", "samples": ds.n_tasks,
                "verdict": "unknown"}
    tv = task_view(ds, ["launch_s", "release_s", "call_id", "purpose"])
    seconds = (tv["release_s"].astype(float) - tv["launch_s"].astype(float)).clip(lower=0).fillna(0).to_numpy()
    unlogged = tv["call_id"].isna().to_numpy()
    summary = (tv["purpose"].astype("object") == "summary").fillna(False).to_numpy(dtype=bool)
    total = float(seconds.sum())
    share = float(seconds[unlogged | summary].sum()) / total if total else 0.0
    figure = (f"{int(unlogged.sum())} unlogged tasks took {seconds[unlogged].sum():,.0f} s; summaries took "
              f"{seconds[summary].sum():,.0f} s; together {percent(share)} of {total:,.0f} s of task time")
    return {"hypothesis": hyp, "figure": figure, "samples": len(tv), "verdict": _verdict(share < BACKGROUND_SHARE, len(tv), opts)}


def _context(context: pd.DataFrame | None, opts: Options) -> dict:
    """Long context slowing generation: speed at the longest contexts against the shortest,
    among the sizes with enough samples, with no other slot prefilling."""
    hyp = "long context slowing generation"
    if context is None or "basis" not in context.columns:
        return {"hypothesis": hyp, "figure": "no generation heartbeats", "samples": 0, "verdict": "unknown"}
    c = context[(context["basis"] == "no_prefill") & (context["samples"] >= opts.min_samples)]
    n = int(context.loc[context["basis"] == "no_prefill", "samples"].sum())
    if len(c) < 2:
        return {"hypothesis": hyp, "figure": f"fewer than two context sizes with {opts.min_samples}+ heartbeats",
                "samples": n, "verdict": "too few samples"}
    first, last = c.iloc[0], c.iloc[-1]
    ratio = float(last["median_tg_3s_tps"]) / float(first["median_tg_3s_tps"])
    figure = (f"{float(last['median_tg_3s_tps']):.1f} tok/s at {last['context_tokens']} tokens of context "
              f"({int(last['samples'])} heartbeats) against {float(first['median_tg_3s_tps']):.1f} at "
              f"{first['context_tokens']} ({int(first['samples'])})")
    return {"hypothesis": hyp, "figure": figure, "samples": n, "verdict": _verdict(ratio >= CONTEXT_RATIO, n, opts)}


def _gate() -> dict:
    """An app concurrency limit: waits at the app's own gate, before a call is sent. The app
    call logs slotscope reads record no such wait (only when the call was sent)."""
    return {"hypothesis": "an app concurrency limit", "figure": "the app log records no wait of its own before a call is sent",
            "samples": 0, "verdict": "unknown"}


def ruled_out(ds: Dataset, opts: Options, tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The ``ruled-out`` table (see the module)."""
    rows = [_capacity(tables.get("load"), ds, opts), _slots(tables.get("cache"), opts), _background(ds, opts),
            _context(tables.get("context"), opts), _gate()]
    out = pd.DataFrame(rows, columns=RULED_OUT_COLUMNS)
    out["samples"] = out["samples"].astype(np.int64)
    return out
