"""Before/after comparison that survives changing traffic.

A change to the server (``-b 512``, one LoRA setting for every call) is judged on two stretches
of traffic, and traffic never repeats: the after window may be busier, or hold no 15K prefill.
So next to the time to first token (TTFT) of all turns and each side's load (``overall``), the
comparison gives TTFT among short chat turns that met the same conditions
(``same-conditions``), the mechanisms themselves, which depend much less on the traffic
(``indicators``), the settings each side's logs show (``changes``) and what limits the reading
(``cautions``).

Every difference is after minus before, with a 90% percentile-bootstrap interval seeded per row
(the same numbers whichever table is asked for), drawn as 2-D arrays of resample counts in
bounded blocks. Generation pieces are resampled by the long prefill that caused them (pieces
stalled by one prefill are not independent); everything else by turn or task. Load rows
describe what happened in each window: they are not estimates and get no interval.

Two sides are two datasets (two runs) or two wall-clock windows of one dataset (:func:`split`).
A window selects tasks by their wall-clock launch time; what ran around them is kept as context,
so a turn just after the window's start still sees the prefill that started before it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from dataclasses import dataclass
from typing import IO, Callable

import numpy as np
import pandas as pd
from rich.console import Console
from rich.rule import Rule

from . import store, timeline as tl
from .analyze import Options
from .analyze.prefill_speed import effective_chunk_tokens
from .analyze.stalls import MIN_PIECE_S, segment_pieces
from .analyze.turns import CONDITIONS, SHORT_TOKENS, is_chat_turn, turn_conditions
from .analyze.waits import classify_waits
from .dataset import Dataset, task_view
from .errors import SlotscopeError
from .output import UsageError, print_table
from .resample import point as _point, resampled_stats
from .timeline import floats as _f

TABLE_NAMES = ["overall", "same-conditions", "indicators", "changes"]
_ESTIMATE_COLUMNS = ["before", "after", "before_n", "after_n", "diff", "ci_low", "ci_high", "caution"]
OVERALL_COLUMNS = ["metric", *_ESTIMATE_COLUMNS]
SAME_COLUMNS = ["condition", "before_median_s", "before_p90_s", "before_n", "after_median_s", "after_p90_s", "after_n",
                "diff_median_s", "ci_low", "ci_high", "caution", "definition"]
INDICATOR_COLUMNS = ["indicator", *_ESTIMATE_COLUMNS]
CHANGE_COLUMNS = ["setting", "before", "after", "changed", "note"]
CAUTION_COLUMNS = ["about", "caution"]
LEVEL = 0.90
LOAD_RATIO = 1.25  # load differing by more than 25% between the sides is worth a caution
BUSY_TASKS = 4  # "4 or more tasks running at once" is a condition that matters
UNKNOWN = "unknown"
_Z = 1.6448536269514722  # two-sided 90%
# Clusters per side below which a cluster bootstrap's statistic takes only a handful of values:
# no interval, and no sample-size hint from its spread.
MIN_CLUSTERS = 5
Bounds = tuple[pd.Timestamp | None, pd.Timestamp | None]  # a wall-clock window [start, end), None: open


class CompareError(SlotscopeError):
    """Two sides that cannot be compared as asked (no wall clock for a window, an empty window)."""


@dataclass
class Window(Dataset):
    """One wall-clock window of a dataset: tasks launched in [start, end) are its subjects.

    The tables hold the subjects and the tasks that ran around them (context); ``start``/``end``
    are None for an open end.
    """

    start: pd.Timestamp | None = None
    end: pd.Timestamp | None = None
    unplaced: int = 0  # tasks of the whole dataset with no wall-clock time (left out)


def parse_window(value: str, tz: str = "UTC") -> Bounds:
    """``START..END`` (ISO times or dates, either side may be empty) -> bounds of [start, end).

    A time without a zone is read in ``tz``. A date alone as END includes that whole day (as a
    pandas date slice does): ``2026-11-28..2026-11-28`` is the 28th.
    """
    if ".." not in value:
        raise CompareError(None, None, f"a window is START..END, not {value!r}")
    a, b = value.split("..", 1)
    return _when(a, tz, is_end=False), _when(b, tz, is_end=True)


def _when(text: str, tz: str, *, is_end: bool) -> pd.Timestamp | None:
    t = text.strip()
    if not t:
        return None
    try:
        ts = pd.Timestamp(t)
    except (ValueError, TypeError):
        raise CompareError(None, None, f"cannot read {t!r} as a wall time; give an ISO time or date, "
                           "e.g. 2026-11-29T07:30..2026-11-29T08:00") from None
    if ts.tzinfo is None:
        ts = ts.tz_localize(tz)
    date_only = len(t) <= 10 and ":" not in t
    return ts + pd.Timedelta(days=1) if (is_end and date_only) else ts


def _us(ts: pd.Timestamp | None, default: float) -> float:
    return default if ts is None else ts.value / 1e3


def _wall_offsets(ds: Dataset) -> pd.DataFrame:
    """Per session: wall time (µs since epoch) of its clock's zero, from the app-log alignment,
    else from a wrapper's stamps; NaN where neither exists."""
    s = ds.server.sessions
    out = s[tl.GROUP].copy()
    off = _f(s["wall_offset_us"]) if "wall_offset_us" in s.columns else np.full(len(s), np.nan)
    if ds.matches is not None and len(ds.matches.aligned):
        al = out.merge(ds.matches.aligned[tl.GROUP + ["offset_us"]].drop_duplicates(tl.GROUP), on=tl.GROUP, how="left")
        app = _f(al["offset_us"])
        off = np.where(np.isnan(app), off, app)
    out["offset_us"] = off
    return out


def _wall(frame: pd.DataFrame, offsets: pd.DataFrame, col: str) -> np.ndarray:
    """Wall µs of a server-clock column (seconds) of rows carrying session keys."""
    off = frame[tl.GROUP].merge(offsets, on=tl.GROUP, how="left")["offset_us"].to_numpy(dtype="float64")
    return off + _f(frame[col]) * 1e6


def cut(ds: Dataset, start: pd.Timestamp | None, end: pd.Timestamp | None, *, tv: pd.DataFrame | None = None) -> Window:
    """The part of ``ds`` one window needs: tasks launched in [start, end) and their context."""
    tv = task_view(ds) if tv is None else tv
    offsets = _wall_offsets(ds)
    launch = _wall(tv, offsets, "launch_s")
    if np.isnan(launch).all():
        raise CompareError(None, None, "a time window needs wall-clock times: an app log to align the server "
                           "clock with, or wrapper stamps on the server lines (journald, docker -t, ts); "
                           "or compare two log sets with --before DIR --after DIR")
    lo, hi = _us(start, -np.inf), _us(end, np.inf)
    subject = (launch >= lo) & (launch < hi)
    if not subject.any():
        raise CompareError(None, None, f"no task was launched in the window {_span_text(start, end)}; "
                           f"the logs' tasks were launched {_ts(np.nanmin(launch))} to {_ts(np.nanmax(launch))}")
    ends = _wall(tv.assign(_end_s=tl.task_ends(tv, ds.server.sessions)), offsets, "_end_s")
    queue_us = np.nan_to_num(_f(tv["queue_ms"]) * 1e3 if "queue_ms" in tv.columns else np.zeros(len(tv)))
    begin = launch - queue_us
    ctx_lo = min(lo, float(np.nanmin(begin[subject])))
    ctx_hi = max(hi if np.isfinite(hi) else -np.inf, float(np.nanmax(ends[subject])))
    context = (begin < ctx_hi) & (ends > ctx_lo)
    keys = tv.loc[context, tl.GROUP + ["task_id"]]
    s = ds.server
    server = dataclasses.replace(s, tasks=_semi(s.tasks, keys), gen_samples=_semi(s.gen_samples, keys),
                                 prefill_samples=_semi(s.prefill_samples, keys),
                                 sessions=s.sessions.merge(keys[tl.GROUP].drop_duplicates(), on=tl.GROUP, how="inner"))
    matches, app = ds.matches, ds.app
    if matches is not None:
        calls = matches.calls
        start_us = calls["start_at"].astype("datetime64[us, UTC]").astype("int64").to_numpy(dtype="float64")
        by_task = calls[tl.GROUP + ["task_id"]].merge(keys.assign(_k=True), on=tl.GROUP + ["task_id"], how="left")["_k"]
        keep = by_task.notna().to_numpy() | (calls["task_id"].isna().to_numpy() & (start_us >= ctx_lo) & (start_us < ctx_hi))
        matches = dataclasses.replace(matches, calls=calls[keep].reset_index(drop=True),
                                      unlogged=_semi(matches.unlogged, keys))
        if app is not None:
            ids = set(matches.calls["call_id"].dropna())
            app = dataclasses.replace(app, calls=app.calls[app.calls["call_id"].isin(ids)].reset_index(drop=True))
    return Window(server=server, app=app, matches=matches, accounting=ds.accounting,
                  start=start, end=end, unplaced=int(np.isnan(launch).sum()))


def _semi(df: pd.DataFrame, keys: pd.DataFrame) -> pd.DataFrame:
    if df is None or not len(df) or "task_id" not in df.columns:
        return df
    return df.merge(keys.drop_duplicates(), on=tl.GROUP + ["task_id"], how="inner")


def split(ds: Dataset, before: Bounds, after: Bounds) -> tuple[Window, Window]:
    """Cut one dataset into a before and an after window (each ``(start, end)``, wall clock)."""
    tv = task_view(ds)
    return cut(ds, *before, tv=tv), cut(ds, *after, tv=tv)


def _ts(us: float) -> str:
    return pd.Timestamp(int(us), unit="us", tz="UTC").isoformat(timespec="seconds")


def _span_text(start: pd.Timestamp | None, end: pd.Timestamp | None) -> str:
    a = start.isoformat() if start is not None else "(start)"
    b = end.isoformat() if end is not None else "(end)"
    return f"{a}..{b}"


@dataclass(frozen=True)
class Side:
    """What one side contributes: per-row samples and the load of its window."""

    turns: pd.DataFrame  # chat turns with a TTFT: ttft_s, short, condition
    n_turns: int  # chat turns, measured or not
    tasks: pd.DataFrame  # subject tasks: wait_s, different_lora, prefill_tps, gen_tps, new tokens
    pieces: pd.DataFrame  # long_prefill generation pieces of subject tasks: tok_per_s, cluster
    observed_s: float
    busy2_s: float
    busy4_s: float
    max_running: float
    has_app: bool
    has_lora: bool
    settings: dict[str, str]
    lora_calls: str


def side(ds: Dataset, opts: Options, short_tokens: int = SHORT_TOKENS) -> Side:
    """Every sample the comparison needs from one dataset or window."""
    tv = task_view(ds)
    offsets = _wall_offsets(ds)
    window = isinstance(ds, Window)
    lo, hi = (_us(ds.start, -np.inf), _us(ds.end, np.inf)) if isinstance(ds, Window) else (-np.inf, np.inf)
    launch_us = _wall(tv, offsets, "launch_s")
    subj = (launch_us >= lo) & (launch_us < hi) if window else np.ones(len(tv), dtype=bool)
    keys = tl.GROUP + ["task_id"]

    # Tasks: waits, LoRA waits, speeds.
    waits = classify_waits(ds, opts, tv)
    diff_lora = tv[keys].merge(waits.loc[waits["cause"] == "different_lora", keys].assign(_d=True), on=keys, how="left")["_d"]
    tasks = pd.DataFrame({
        "wait_s": _f(tv["wait_before_prefill_ms"]) / 1000,
        "different_lora": diff_lora.notna().to_numpy(),
        "prompt_tokens_new": _f(tv["prompt_tokens_new"]),
        "prefill_tps": _f(tv["prefill_tps"]),
        "gen_tps": np.where(_f(tv["n_gen"]) >= 2, _f(tv["gen_tps"]), np.nan),
    })[subj].reset_index(drop=True)
    turns, n_turns = _turns(ds, tv, subj, opts, short_tokens, lo, hi)

    # Generation pieces during another slot's long prefill, resampled by that prefill.
    pieces = segment_pieces(ds, opts, tv)
    pieces = pieces[(pieces["class"] == "long_prefill") & (pieces["seconds"] >= MIN_PIECE_S)]
    pieces = pieces.merge(tv.loc[subj, keys], on=keys, how="inner")
    cluster = pieces.groupby(tl.GROUP + ["cause_task_id"], dropna=False, sort=False, observed=True).ngroup()
    pieces = pd.DataFrame({"tok_per_s": pieces["tok_per_s"].to_numpy(dtype="float64"),
                           "cluster": cluster.to_numpy(dtype=np.int64)})

    # Load within the window (or over the whole observed span of a dataset).
    steps = tl.concurrency(tv, ds.server.sessions)
    a, z = (_wall(steps, offsets, c) if window and len(steps) else _f(steps[c]) for c in ("start_s", "end_s"))
    secs = np.clip(np.minimum(z, hi) - np.maximum(a, lo), 0, None) / (1e6 if window else 1.0)
    run = steps["running"].to_numpy()
    settings, lora_calls = _settings(ds, tv, subj, lo, hi)
    return Side(turns=turns, n_turns=n_turns, tasks=tasks, pieces=pieces, observed_s=float(secs.sum()),
                busy2_s=float(secs[run >= 2].sum()), busy4_s=float(secs[run >= BUSY_TASKS].sum()),
                max_running=float(run[secs > 0].max()) if (secs > 0).any() else 0.0,
                has_app=ds.matches is not None,
                has_lora=ds.matches is not None and "lora" in tv.columns and bool(tv["lora"].notna().any()),
                settings=settings, lora_calls=lora_calls)


def _turns(ds: Dataset, tv: pd.DataFrame, subj: np.ndarray, opts: Options, short_tokens: int,
           lo: float, hi: float) -> tuple[pd.DataFrame, int]:
    """The chat turns with a TTFT, and how many chat turns there were: by their task's launch
    when matched, else by the call's start."""
    if ds.matches is None:
        return pd.DataFrame({"ttft_s": np.zeros(0), "short": np.zeros(0, dtype=bool), "condition": []}), 0
    keys = tl.GROUP + ["task_id"]
    calls = ds.matches.calls
    calls = calls[is_chat_turn(calls["purpose"]).to_numpy()]
    if np.isfinite(lo) or np.isfinite(hi):
        # A matched call belongs where its task does (a task outside the window may be context).
        in_task = calls[keys].merge(tv.loc[subj, keys].assign(_s=True), on=keys, how="left")["_s"].notna().to_numpy()
        calls = calls[np.where(calls["task_id"].notna().to_numpy(), in_task, _in_window(calls, lo, hi))]
    measured = (calls["ok"].fillna(False).astype(bool) & calls["task_id"].notna() & calls["ttft_ms"].notna()).to_numpy()
    t = calls.loc[measured, keys + ["ttft_ms"]].merge(
        tv[keys + ["launch_s", "first_token_s", "prompt_tokens_new", "queue_ms", "release_s", "prefill_start_s"]],
        on=keys, how="left")
    out = pd.DataFrame({"ttft_s": _f(t["ttft_ms"]) / 1000, "short": (_f(t["prompt_tokens_new"]) < short_tokens),
                        "condition": turn_conditions(t, tv, ds.server.sessions, opts.big_prefill_tokens)})
    return out, len(out) + int((~measured).sum())


def _in_window(calls: pd.DataFrame, lo: float, hi: float) -> np.ndarray:
    """Which calls were launched (else started: not matched) in [lo, hi) (wall µs)."""
    at = calls["launch_at"].where(calls["launch_at"].notna(), calls["start_at"]) if "launch_at" in calls.columns else calls["start_at"]
    at_us = at.astype("datetime64[us, UTC]").astype("int64").to_numpy(dtype="float64")
    return (at_us >= lo) & (at_us < hi) & at.notna().to_numpy()


def _settings(ds: Dataset, tv: pd.DataFrame, subj: np.ndarray, lo: float, hi: float) -> tuple[dict[str, str], str]:
    keys = tl.GROUP + ["task_id"]
    sess = ds.server.sessions.merge(tv.loc[subj, tl.GROUP].drop_duplicates(), on=tl.GROUP, how="inner")

    def listed(col: str, numbers: bool = False) -> str:
        v = sess[col].dropna() if col in sess.columns else pd.Series([], dtype=object)
        v = pd.to_numeric(v, errors="coerce").dropna().astype("int64") if numbers else v.astype(str)
        return ", ".join(str(x) for x in sorted(v.unique())) if len(v) else UNKNOWN

    ps = ds.server.prefill_samples
    own = dataclasses.replace(ds, server=dataclasses.replace(ds.server, tasks=store.raw(ds.server, "tasks"),  # (not built)
                                                             prefill_samples=_semi(ps, tv.loc[subj, keys])))
    chunk = effective_chunk_tokens(own) if ps is not None and len(ps) else None
    lora, mix = UNKNOWN, ""
    if ds.matches is not None and "lora" in ds.matches.calls.columns:
        calls = ds.matches.calls
        if np.isfinite(lo) or np.isfinite(hi):
            calls = calls[_in_window(calls, lo, hi)]
        labels = calls["lora"].astype("string").dropna()
        if len(labels):
            counts = labels.value_counts().sort_index()
            lora = ", ".join(counts.index)
            mix = ", ".join(f"{k} {v}" for k, v in counts.items())
    return {
        "n_slots": listed("n_slots", numbers=True),
        "n_ctx_slot": listed("n_ctx_slot", numbers=True),
        "chunk_tokens": str(chunk) if chunk is not None else UNKNOWN,
        # From the start-up lines of the sessions the window's tasks ran in: `loading model '...'`
        # (default verbosity) and the build line (verbosity 4 only).
        "model": listed("model"),
        "build": listed("build"),
        "lora": lora,
    }, mix


@dataclass(frozen=True)
class Estimate:
    """One statistic on both sides, the difference and its bootstrap interval."""

    before: float
    after: float
    before_n: int
    after_n: int
    diff: float
    ci_low: float
    ci_high: float
    se: float  # bootstrap standard deviation of the difference (NaN without an interval)
    # The units resampled per side (the clusters, else the samples) and the unit's name.
    before_units: int = 0
    after_units: int = 0
    unit: str = ""
    lumpy: bool = False  # an interval was left out: its resamples did not contain the estimate


def estimate(name: str, before: np.ndarray, after: np.ndarray, kind: str, *, seed: int = 0, n_boot: int = 2000,
             before_clusters: np.ndarray | None = None, after_clusters: np.ndarray | None = None) -> Estimate:
    """A statistic (``median``, ``p90``, ``p95``, ``sum``, ``max``) of each side, after - before,
    and the percentile-bootstrap 90% interval of the difference. The generator is seeded by
    ``seed`` and ``name``, so a row's interval does not depend on the other rows.

    With ``*_clusters``, the samples of one cluster (the stretches one prefill stalled) are
    drawn together: the cluster is the unit, and an interval needs :data:`MIN_CLUSTERS` of them
    per side (plain samples: two). An
    interval that does not hold its own estimate (a few lumpy clusters) is left out."""
    b_ok, a_ok = np.isfinite(before), np.isfinite(after)
    b, a = before[b_ok], after[a_ok]
    bc = before_clusters[b_ok] if before_clusters is not None else None
    ac = after_clusters[a_ok] if after_clusters is not None else None
    nb = len(np.unique(bc)) if bc is not None else len(b)
    na = len(np.unique(ac)) if ac is not None else len(a)
    pb, pa = _point(b, kind), _point(a, kind)
    lo = hi = se = float("nan")
    lumpy = False
    least = MIN_CLUSTERS if bc is not None or ac is not None else 2
    if nb >= least and na >= least and n_boot > 0:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        d = resampled_stats(a, ac, kind, rng, n_boot) - resampled_stats(b, bc, kind, rng, n_boot)
        lo, hi = (float(x) for x in np.quantile(d, [(1 - LEVEL) / 2, (1 + LEVEL) / 2]))
        se = float(np.std(d))
        if not lo - 1e-9 <= pa - pb <= hi + 1e-9:
            lo = hi = float("nan")
            lumpy = True
    return Estimate(pb, pa, len(b), len(a), pa - pb, lo, hi, se, nb, na, "clusters" if bc is not None else "", lumpy)


def needed_samples(e: Estimate, min_samples: int) -> int | None:
    """About how many samples per side would tell a difference of the observed size from noise
    (the 90% interval's half-width shrinking like 1/sqrt(n)), counted in the resampled unit;
    None when the spread says nothing."""
    n = min(e.before_units, e.after_units) if e.unit else min(e.before_n, e.after_n)
    if (e.unit and n < MIN_CLUSTERS) or not (
            n > 0 and math.isfinite(e.se) and e.se > 0 and math.isfinite(e.diff) and e.diff != 0):
        return None
    return max(min_samples, math.ceil(n * (_Z * e.se / abs(e.diff)) ** 2))


_SINGULAR = {"turns": "turn", "tasks": "task", "prefills": "prefill", "stretches of generation": "stretch of generation"}


def few_caution(e: Estimate, unit: str, min_samples: int, cluster_unit: str = "") -> str:
    """The plain-language caution for a side with fewer than ``min_samples`` samples ('' if none);
    ``cluster_unit``: what the samples' clusters are (the unit of the sample-size hint)."""
    small = [(n, s) for n, s in ((e.before_n, "before"), (e.after_n, "after")) if n < min_samples]
    lumpy = "its resamples did not hold the estimate: no interval" if e.lumpy else ""
    if not small:
        return lumpy
    empty = [s for n, s in small if n == 0]
    if empty:
        return f"no {unit} {' or '.join(empty)}: nothing to compare"
    what = " and ".join(f"{n} {_SINGULAR.get(unit, unit) if n == 1 else unit} {s}" for n, s in small)
    need = needed_samples(e, min_samples)
    per = f" {cluster_unit}" if e.unit and cluster_unit else ""
    if need is None or need <= min_samples:
        tail = f"at least {min_samples}{per} per side would be needed"
    elif need > 100_000:
        tail = "far more would be needed to tell a difference this small from noise"
    else:
        tail = f"about {need:,}{per} per side would be needed for a difference this size"
    return _join(f"only {what}: too few to call an effect; {tail}", lumpy)


def _differs(a: float, b: float, text: str) -> str:
    """``text`` when ``a`` and ``b`` differ by more than ``LOAD_RATIO`` (either not positive: when the other is)."""
    if not (math.isfinite(a) and math.isfinite(b)) or min(a, b) <= 0:
        return text if max(a, b) > 0 else ""
    return text if max(a, b) / min(a, b) > LOAD_RATIO else ""


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _row(label: str, e: Estimate, caution: str, name_col: str) -> dict[str, object]:
    return {name_col: label, **dataclasses.asdict(e), "caution": caution}


def _load_row(label: str, b: float, a: float, caution: str = "", n: tuple[int, int] | None = None) -> dict[str, object]:
    return {"metric": label, "before": b, "after": a, "before_n": n[0] if n else pd.NA, "after_n": n[1] if n else pd.NA,
            "diff": a - b, "ci_low": np.nan, "ci_high": np.nan, "caution": caution}


def _overall(b: Side, a: Side, opts: Options, seed: int, n_boot: int) -> pd.DataFrame:
    ms = opts.min_samples
    tb, ta = b.n_turns, a.n_turns
    tph_b, tph_a = (s.n_turns / (s.observed_s / 3600) if s.observed_s > 0 else np.nan for s in (b, a))
    share_b, share_a = (s.busy2_s / s.observed_s if s.observed_s > 0 else np.nan for s in (b, a))
    long_b, long_a = (int((s.tasks["prompt_tokens_new"] >= opts.long_prefill_tokens).sum()) for s in (b, a))
    load = f"load differs by more than {LOAD_RATIO - 1:.0%}: differences in time may come from the traffic"
    rows = [
        _load_row("turns", tb, ta, few_caution(Estimate(tb, ta, tb, ta, ta - tb, np.nan, np.nan, np.nan), "turns", ms)
                  if (b.has_app and a.has_app) else "needs an app log on both sides", (tb, ta)),
        _load_row("observed_s", b.observed_s, a.observed_s,
                  _differs(b.observed_s, a.observed_s, "windows of different length: compare rates, not counts")),
        _load_row("turns_per_hour", tph_b, tph_a, _differs(tph_b, tph_a, load), (tb, ta)),
        _load_row("time_2plus_running_s", b.busy2_s, a.busy2_s),
        _load_row("share_2plus_running", share_b, share_a, _differs(share_b, share_a, load)),
        _load_row(f"time_{BUSY_TASKS}plus_running_s", b.busy4_s, a.busy4_s,
                  _one_sided(b.busy4_s, a.busy4_s, f"{BUSY_TASKS}+ tasks running at once")),
        _load_row("max_concurrency", b.max_running, a.max_running),
        _load_row(f"prefills_{opts.long_prefill_tokens // 1000}k_plus", long_b, long_a,
                  _one_sided(long_b, long_a, f"prefills of {opts.long_prefill_tokens:,}+ new tokens")),
    ]
    for kind, label in (("median", "ttft_median_s"), ("p95", "ttft_p95_s")):
        e = estimate(label, b.turns["ttft_s"].to_numpy(dtype="float64"), a.turns["ttft_s"].to_numpy(dtype="float64"),
                     kind, seed=seed, n_boot=n_boot)
        rows.append(_row(label, e, few_caution(e, "turns", ms), "metric"))
    out = pd.DataFrame(rows)
    for c in ("before_n", "after_n"):
        out[c] = pd.array(out[c], dtype="Int64")
    return _rounded(out, OVERALL_COLUMNS)


def _one_sided(b: float, a: float, what: str) -> str:
    if (b > 0) == (a > 0):
        return ""
    where, other = ("before", "after") if b > 0 else ("after", "before")
    return f"{what} happened {where} but not {other}: the sides did not face the same conditions"


def _same_conditions(b: Side, a: Side, opts: Options, short_tokens: int, seed: int, n_boot: int) -> pd.DataFrame:
    big = f"{opts.big_prefill_tokens:,}+ new tokens"
    definitions = {
        "nothing_else_running": "no other task ran during the turn's queue, wait and prefill",
        "overlapping_another_task": f"other tasks ran meanwhile, none prefilling {big}",
        "overlapping_prefill_5k_plus": f"another task's prefill of {big} ran meanwhile",
    }
    rows = []
    for cond in CONDITIONS:
        vb, va = (s.turns.loc[s.turns["short"] & (s.turns["condition"] == cond), "ttft_s"].to_numpy(dtype="float64")
                  for s in (b, a))
        e = estimate(f"same-conditions:{cond}", vb, va, "median", seed=seed, n_boot=n_boot)
        caution = _join(_one_sided(len(vb), len(va), "this condition"), few_caution(e, "turns", opts.min_samples))
        if not (b.has_app and a.has_app):
            caution = "needs an app log on both sides (which calls are chat turns, their queue time)"
        rows.append({"condition": cond, "before_median_s": e.before, "before_p90_s": _point(vb[np.isfinite(vb)], "p90"),
                     "before_n": e.before_n, "after_median_s": e.after, "after_p90_s": _point(va[np.isfinite(va)], "p90"),
                     "after_n": e.after_n, "diff_median_s": e.diff, "ci_low": e.ci_low, "ci_high": e.ci_high,
                     "caution": caution, "definition": f"short turns (< {short_tokens:,} new tokens): {definitions[cond]}"})
    return _rounded(pd.DataFrame(rows), SAME_COLUMNS)


def _waits(s: Side) -> pd.DataFrame:
    """Subject tasks whose wait before prefill is known."""
    return s.tasks[np.isfinite(s.tasks["wait_s"])]


def _over(s: Side, o: Options) -> np.ndarray:
    """Each known wait of at least the threshold, the shorter ones as 0."""
    w = _waits(s)["wait_s"]
    return w.to_numpy() * (w >= o.wait_threshold_s).to_numpy()


# The indicators, in their order: statistic, the samples' unit (for cautions), one side's samples.
_INDICATOR_DEFS: dict[str, tuple[str, str, Callable[[Side, Options], np.ndarray]]] = {
    "gen_tps_during_long_prefill": ("median", "stretches of generation", lambda s, o: s.pieces["tok_per_s"].to_numpy()),
    "waits_over_1s_count": ("sum", "tasks", lambda s, o: (_waits(s)["wait_s"] >= o.wait_threshold_s).to_numpy(float)),
    "waits_over_1s_total_s": ("sum", "tasks", _over),
    "waits_over_1s_max_s": ("max", "tasks", _over),
    "waits_different_lora_count": ("sum", "tasks", lambda s, o: (
        _waits(s)["different_lora"] & (_waits(s)["wait_s"] >= o.wait_threshold_s)).to_numpy(float)),
    "prefill_tps_5k_plus": ("median", "prefills", lambda s, o: s.tasks.loc[
        s.tasks["prompt_tokens_new"] >= o.big_prefill_tokens, "prefill_tps"].to_numpy(dtype="float64")),
    "gen_tps_median": ("median", "tasks", lambda s, o: s.tasks["gen_tps"].to_numpy(dtype="float64")),
}
INDICATORS = list(_INDICATOR_DEFS)


def _indicators(b: Side, a: Side, opts: Options, seed: int, n_boot: int) -> pd.DataFrame:
    ms = opts.min_samples
    events = [(s.pieces["cluster"].nunique(), n) for s, n in ((b, "before"), (a, "after"))]
    few_events = ", ".join(f"{k} {name}" for k, name in events if 0 < k < ms)
    length = _differs(b.observed_s, a.observed_s, "counted over windows of different length")
    extra = {  # cautions besides too few samples
        "gen_tps_during_long_prefill":
            f"the stretches come from few long prefills ({few_events}): not independent samples"
            + (f", too few for an interval (at least {MIN_CLUSTERS} per side)" if any(k < MIN_CLUSTERS for k, _ in events) else "")
            if few_events else "",
        "waits_over_1s_count": length,
        "waits_over_1s_total_s": length,
    }
    rows = []
    for name, (kind, unit, samples) in _INDICATOR_DEFS.items():
        if name == "waits_different_lora_count" and not (b.has_lora and a.has_lora):
            rows.append(_row(name, Estimate(np.nan, np.nan, 0, 0, np.nan, np.nan, np.nan, np.nan),
                             "needs an app log with each call's LoRA setting on both sides", "indicator"))
            continue
        pieces = name == "gen_tps_during_long_prefill"  # resampled by the prefill that caused them
        e = estimate(name, samples(b, opts), samples(a, opts), kind, seed=seed, n_boot=n_boot,
                     before_clusters=b.pieces["cluster"].to_numpy() if pieces else None,
                     after_clusters=a.pieces["cluster"].to_numpy() if pieces else None)
        rows.append(_row(name, e, _join(few_caution(e, unit, ms, "long prefills" if pieces else ""), extra.get(name, "")),
                         "indicator"))
    return _rounded(pd.DataFrame(rows), INDICATOR_COLUMNS)


_HUMAN = {"chunk_tokens": "n_batch", "lora": "LoRA", "n_slots": "the slot count", "n_ctx_slot": "the context size",
          "model": "the model", "build": "the server build"}
_UNKNOWN_NOTES = {
    "model": "no `loading model` line in the sessions' logs (they start after it); compare the model files by hand",
    "build": "no build line (llama-server prints it at -lv 4 only); compare `llama-server --version` by hand",
    "lora": "needs an app log with each call's LoRA setting",
    "chunk_tokens": "no prefill progress lines (prefills under 3 s)",
}


def _changes(b: Side, a: Side) -> tuple[pd.DataFrame, str]:
    """The settings table, and the caution when several settings changed at once ('' if not)."""
    rows = []
    slots = max([int(x) for s in (b, a) for x in s.settings["n_slots"].split(", ") if x.isdigit()] or [0])
    changed: object
    for key in ("n_slots", "n_ctx_slot", "chunk_tokens", "model", "build", "lora"):
        vb, va = b.settings[key], a.settings[key]
        if UNKNOWN in (vb, va):
            changed, note = pd.NA, _UNKNOWN_NOTES.get(key, "")
        elif key == "chunk_tokens":
            # A pass takes n_batch minus one token per generating slot from a prefill.
            changed = abs(int(vb) - int(va)) > slots
            note = "prompt tokens one pass takes from a prefill (n_batch minus generating slots), from progress lines"
        else:
            changed, note = vb != va, (f"calls by setting: {b.lora_calls} -> {a.lora_calls}" if key == "lora" else "")
        rows.append({"setting": key, "before": vb, "after": va, "changed": changed, "note": note})
    out = pd.DataFrame(rows, columns=CHANGE_COLUMNS)
    out["changed"] = pd.array(out["changed"], dtype="boolean")
    changed_now = out["changed"].fillna(False).astype(bool)
    names = out.loc[changed_now, "setting"].tolist()
    if len(names) < 2:
        return out, ""
    out.loc[changed_now, "note"] = out["note"].where(out["note"] == "", out["note"] + "; ") \
        + "changed together with another setting"
    *first, last = [_HUMAN.get(n, n) for n in names]
    both = f"{', '.join(first)} and {last}"
    return out, (f"{len(names)} settings changed at once ({', '.join(names)}): the effects of {both} can't be "
                 f"separated by this comparison; compare runs that differ in one setting to tell them apart")


def _rounded(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    df = df[columns].copy()
    for c in df.columns:
        if pd.api.types.is_float_dtype(df[c]):
            df[c] = df[c].astype("float64").round(3)
    return df


def compare(before: Dataset, after: Dataset, opts: Options | None = None, *, seed: int = 0, n_boot: int = 2000,
            short_tokens: int = SHORT_TOKENS) -> dict[str, pd.DataFrame]:
    """The comparison's tables: ``overall``, ``same-conditions``, ``indicators``, ``changes`` and
    ``cautions`` (what limits the reading, one sentence a row). Differences are after - before."""
    opts = opts or Options()
    b, a = side(before, opts, short_tokens), side(after, opts, short_tokens)
    changes, multiple = _changes(b, a)
    tables = {
        "overall": _overall(b, a, opts, seed, n_boot),
        "same-conditions": _same_conditions(b, a, opts, short_tokens, seed, n_boot),
        "indicators": _indicators(b, a, opts, seed, n_boot),
        "changes": changes,
    }
    tables["cautions"] = _cautions(before, after, b, a, tables["overall"], multiple)
    return tables


def _cautions(before: Dataset, after: Dataset, b: Side, a: Side, overall: pd.DataFrame, multiple: str) -> pd.DataFrame:
    rows = [("changes", multiple)] if multiple else []
    ov = overall.set_index("metric")
    for metric in ("turns_per_hour", "share_2plus_running"):
        if ov.loc[metric, "caution"]:
            vb, va = ov.loc[metric, "before"], ov.loc[metric, "after"]
            rows.append(("load", f"load differs between the sides by more than {LOAD_RATIO - 1:.0%} ({metric} "
                                 f"{vb:,.3g} before, {va:,.3g} after): a difference in time may come from the traffic, "
                                 "not from the change; trust same-conditions and indicators over overall"))
    rows += [("conditions", str(c)) for c in ov["caution"] if c and "happened" in str(c)]
    if ov.loc["observed_s", "caution"]:
        rows.append(("windows", f"the sides cover {b.observed_s / 60:,.1f} and {a.observed_s / 60:,.1f} minutes: "
                                "counts and totals (turns, waits) are not comparable as they stand"))
    if isinstance(before, Window) and isinstance(after, Window):
        if _us(before.start, -np.inf) < _us(after.end, np.inf) and _us(after.start, -np.inf) < _us(before.end, np.inf):
            rows.append(("windows", "the windows overlap: the same turns count on both sides"))
        if before.unplaced:
            rows.append(("windows", f"{before.unplaced} task(s) have no wall-clock time and are in neither window"))
    if not (b.has_app and a.has_app):
        rows.append(("app log", "an app call log is missing on one side: turns, same-conditions and LoRA waits "
                                "need it (purpose, LoRA and queue time come from it)"))
    rows.append(("reading", "an interval that excludes 0 says the difference is larger than resampling noise in "
                            "these windows; it does not say the change caused it"))
    return pd.DataFrame(rows, columns=CAUTION_COLUMNS)


CAPTIONS = {
    "overall": "Traffic and load of each side, then time to first token (TTFT) of every chat turn, whatever "
               "ran meanwhile (read same-conditions before these). diff = after - before; ci = 90% bootstrap "
               "interval, given for estimates from samples only.",
    "same-conditions": "TTFT of short chat turns, compared only among turns that met the same conditions "
                       "(before/after: median / p90 in seconds; diff: of the medians).",
    "indicators": "The mechanisms: generation speed while another slot ran a long prefill, waits before prefill "
                  "(and those behind a different LoRA setting), prefill and generation speed.",
    "changes": "Settings each side's logs show.",
}


def render(tables: dict[str, pd.DataFrame], file: IO[str] | None = None, width: int | None = None,
           header: list[str] | None = None) -> None:
    """Print the four tables, each row's caution as a numbered note under its table, then the
    cautions that concern the whole comparison."""
    console = Console(file=file, width=width, soft_wrap=False, highlight=False)
    console.print(Rule("slotscope compare", align="left"))
    for line in header or []:
        console.print(line, markup=False)
    for name in TABLE_NAMES:
        df = tables[name]
        console.print()
        console.print(Rule(name, align="left"))
        console.print(CAPTIONS[name], markup=False)
        if "definition" in df.columns:
            for cond, text in zip(df.iloc[:, 0], df["definition"]):
                console.print(f"  {cond}: {text}", markup=False)
            df = df.drop(columns="definition")
        shown, notes = _with_notes(df)
        print_table(console, _compact(shown))
        for text in notes:
            console.print(f"- {text}", markup=False)
    cautions = tables.get("cautions")
    if cautions is not None and len(cautions):
        console.print()
        console.print(Rule("cautions", align="left"))
        for r in cautions.itertuples(index=False):
            console.print(f"- {r.about}: {r.caution}", markup=False)


def _with_notes(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Text columns (caution, note) leave the table and are listed under it by row, so the
    numbers keep their width."""
    text_cols = [c for c in ("caution", "note") if c in df.columns]
    notes = [f"{label}: {text}" for label, *cells in df[[df.columns[0]] + text_cols].itertuples(index=False)
             for text in cells if isinstance(text, str) and text]
    return df.drop(columns=text_cols), notes


def _compact(df: pd.DataFrame) -> pd.DataFrame:
    """Median / p90 in one cell per side, so same-conditions fits a 100-column terminal."""
    if "before_p90_s" not in df.columns:
        return df
    out = df[["condition"]].copy()
    for s in ("before", "after"):
        med, p90 = df[f"{s}_median_s"], df[f"{s}_p90_s"]
        out[s] = [f"{_num(m)} / {_num(p)}" if pd.notna(m) else "" for m, p in zip(med, p90)]
        out[f"n_{s}"] = df[f"{s}_n"]
    return pd.concat([out, df[["diff_median_s", "ci_low", "ci_high"]].rename(columns={"diff_median_s": "diff"})], axis=1)


def _num(v: float) -> str:
    return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"


@dataclass(frozen=True)
class Sides:
    """What ``--before``/``--after`` ask for: two windows of one set of logs, or two sets of logs."""

    before_window: Bounds | None = None
    after_window: Bounds | None = None
    before_paths: tuple[str, ...] = ()
    after_paths: tuple[str, ...] = ()

    @property
    def windows(self) -> bool:
        return self.before_window is not None


def read_sides(paths: list[str] | None, before: list[str] | None, after: list[str] | None, tz: str = "UTC") -> Sides:
    """Interpret ``--before``/``--after``: a value with ``..`` that is not an existing path is a
    window (``START..END``) of ``paths``; anything else names the logs of that side."""
    before, after, paths = list(before or []), list(after or []), list(paths or [])
    if not before or not after:
        raise UsageError(None, None, "give both --before and --after: two windows START..END of the logs, "
                         "or two sets of logs (--before DIR --after DIR)")

    kinds = {".." in v and not os.path.exists(v) for v in before + after}  # (a window, or logs)
    if kinds == {True}:
        if len(before) != 1 or len(after) != 1:
            raise UsageError(None, None, "give one window each: --before START..END --after START..END")
        if not paths:
            raise UsageError(None, None, "time windows need the logs to cut: slotscope compare PATHS --before "
                             "START..END --after START..END")
        return Sides(before_window=parse_window(before[0], tz), after_window=parse_window(after[0], tz))
    if kinds == {False}:
        if paths:
            raise UsageError(None, None, "with --before/--after naming logs, give no other paths (or use windows "
                             "START..END to cut PATHS)")
        for v in before + after:
            if not os.path.exists(v) and v != "-":
                raise UsageError(None, None, f"{v}: no such file or directory (a time window is START..END)")
        return Sides(before_paths=tuple(before), after_paths=tuple(after))
    raise UsageError(None, None, "--before and --after must both be windows (START..END) or both name logs")


def describe(ds: Dataset) -> str:
    """One line naming a side for the report's header: its window or its sources."""
    if isinstance(ds, Window):
        return f"tasks launched {_span_text(ds.start, ds.end)}"
    src = sorted(set(ds.tasks["source"].astype(str))) if len(ds.tasks) else []
    return ", ".join(src) or "(no server log)"
