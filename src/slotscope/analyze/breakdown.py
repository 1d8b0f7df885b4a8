"""Where the processing time went: own generation, own prefill, contention, waits, queue.

Each task's time is its app-reported queue (where the app log gives it) plus launch..release.
Launch..release splits into the wait before prefill, the prefill and the generation; prefill
and generation split into what the task would have taken alone at the solo speeds
(``own_prefill`` = new tokens / solo prefill speed, ``own_generation`` = (n_gen - 1) / solo
generation speed, each capped at the time actually taken) and the rest, ``contention``.
Tasks with a release but no timings (cancelled) cannot be split: their time is ``unsplit``.

Solo speeds are the medians of ``prefill_tps`` / ``gen_tps`` over tasks that had no other task
prefilling or generating during their whole prefill / generation, unless
``opts.solo_prefill_tps`` / ``opts.solo_gen_tps`` set them. On a busy server no task may have
generated alone from start to end; the generation speed then comes from the stretches of
generation that ran alone (the ``alone`` class of :mod:`.stalls`), and failing those, as for
prefill, from the 90th percentile over all tasks (``solo_*_basis`` says which).

The solo speeds are medians over the whole log, so each busy period gives its tasks' raw
times and speeds, and the merge estimates the speeds and splits the times.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from ..dataset import Dataset, task_view
from ..periods import Part
from ..timeline import GROUP, clip_span, column, floats, key_codes
from .questions import Options, Question, ask

COMPONENTS = ["own_generation", "own_prefill", "contention", "wait", "queue", "unsplit"]
BREAKDOWN_COLUMNS = [
    "purpose", "component", "seconds", "share", "tasks", "few_samples",
    "solo_gen_tps", "solo_gen_n", "solo_gen_basis", "solo_prefill_tps", "solo_prefill_n", "solo_prefill_basis",
]
FLAGS = ["alone_prefill", "alone_generation"]


def ran_alone(tv: pd.DataFrame) -> pd.DataFrame:
    """Per task: whether no other task of its session was prefilling or generating during its
    whole prefill (``alone_prefill``) and its whole generation (``alone_generation``).

    A task is active from its prefill's start to its generation's end (each where the log gives
    it and it lasts); a phase ran alone when no active stretch but its task's own overlaps it,
    and the own one only inside the task's [prefill start, release]."""
    ps, ft, rel = (floats(tv[c]) for c in ("prefill_start_s", "first_token_s", "release_s"))
    pre = ~np.isnan(ps) & ~np.isnan(ft) & (ft > ps)
    gen = ~np.isnan(ft) & ~np.isnan(rel) & (rel > ft)
    s = np.where(pre, ps, np.where(gen, ft, np.nan))
    e = np.where(gen, rel, np.where(pre, ft, np.nan))
    active = ~np.isnan(s)
    # (session, time) pairs as one integer each (the time's rank among all times), so one
    # sorted search counts a session's stretches: the other sessions' cancel out.
    code = key_codes([tv], GROUP)[0] if len(tv) else np.zeros(0, np.int64)
    times = np.unique(np.concatenate([ps, ft, rel]))
    width = len(times) + 1

    def key(x: np.ndarray) -> np.ndarray:
        return code * width + np.searchsorted(times, x)

    starts, ends = np.sort(key(s)[active]), np.sort(key(e)[active])
    out = {}
    for name, a, z in (("alone_prefill", ps, ft), ("alone_generation", ft, rel)):
        overlapping = np.searchsorted(starts, key(z), "left") - np.searchsorted(ends, key(a), "right")
        own = active & (s < z) & (e > a)
        c0, c1 = clip_span(ps, rel, a, z)
        outside = own & ((np.maximum(s, a) < c0) | (np.minimum(e, z) > c1))
        out[name] = ~np.isnan(a) & ~np.isnan(z) & (z > a) & (overlapping - own == 0) & ~outside
    return pd.DataFrame(out, index=tv.index)


def alone_in_part(part: Part, opts: Options) -> pd.DataFrame:
    """Whether each of the part's tasks (``row`` in the task view) ran its phases alone here
    (:func:`ran_alone`): the only question of the breakdown that needs the busy period."""
    return ran_alone(part.tasks).assign(row=part.rows)[["row", *FLAGS]]


def raw_times(tv: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per task of ``tv``: purpose, whether it has a launch..release (``has``), the raw
    components the breakdown splits, and its speeds; columns, not a frame (that would copy
    them into one block)."""
    launch, ps, ft, rel = (floats(column(tv, c)) for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s"))
    has = ~np.isnan(launch) & ~np.isnan(rel) & (rel >= launch)
    split = has & ~np.isnan(ps) & ~np.isnan(ft) & (ps >= launch) & (ft >= ps) & (rel >= ft)
    queue = np.where(has, np.maximum(np.nan_to_num(floats(column(tv, "queue_ms")) / 1000), 0), 0.0)
    return {
        "purpose": tv["purpose"].array if "purpose" in tv.columns else pd.array([pd.NA] * len(tv), dtype="object"),
        "has": has,
        "generated": np.maximum(floats(column(tv, "n_gen")) - 1, 0),  # (the first token came with the prefill)
        "new": floats(column(tv, "prompt_tokens_new")),
        "prefill": np.where(split, ft - ps, 0.0),
        "generation": np.where(split, rel - ft, 0.0),
        "wait": np.where(split, ps - launch, 0.0),
        "queue": queue,
        "unsplit": np.where(has & ~split, rel - launch, 0.0),
        "gen_tps": floats(column(tv, "gen_tps")),
        "prefill_tps": floats(column(tv, "prefill_tps")),
    }


# What raw_times reads of the task view.
VIEW_COLUMNS = ["purpose", "launch_s", "prefill_start_s", "first_token_s", "release_s", "queue_ms", "n_gen",
                "prompt_tokens_new", "gen_tps", "prefill_tps"]


def _solo(speeds: np.ndarray, alone: np.ndarray, override: float | None,
          fallback: Callable[[], pd.Series] | None = None) -> tuple[float, object, str]:
    """A solo speed, its sample count and basis: the option, else the median over the tasks
    alone, else that of ``fallback()`` (stretches alone), else the 90th percentile of all."""
    v = pd.Series(speeds)
    if override is not None:
        return float(override), pd.NA, "option"
    positive = v.notna().to_numpy() & (v > 0).to_numpy()
    sample = v[alone & positive]
    if len(sample):
        return float(sample.median()), len(sample), "median of tasks alone"
    if fallback is not None and len(got := fallback()):
        return float(got.median()), len(got), "median of stretches alone"
    allv = v[positive]
    return (float(allv.quantile(0.9)) if len(allv) else np.nan), len(allv), "p90 of all tasks"


def _stretches_alone(ds: Dataset, opts: Options) -> pd.Series:
    """Speeds of the stretches of generation that ran alone, long enough for a median (from the
    pieces of :mod:`.stalls`)."""
    from .stalls import MIN_PIECE_S, segment_pieces

    p = segment_pieces(ds, opts)
    return p.loc[(p["class"] == "alone").to_numpy() & (p["seconds"] >= MIN_PIECE_S).to_numpy(), "tok_per_s"].reset_index(drop=True)


def _tasks_of(answers: list[pd.DataFrame], ds: Dataset) -> tuple[dict[str, np.ndarray], bool]:
    """Every task's :func:`raw_times`, in the task view's order, each phase alone only if it
    was in every part that holds the task (a task across a cut is in two); and whether any
    task has an app queue."""
    tv = task_view(ds, VIEW_COLUMNS)
    t = raw_times(tv)
    has_queue = "queue_ms" in tv.columns and bool(tv["queue_ms"].notna().any())
    n = len(tv)
    del tv
    flags = pd.concat(answers, ignore_index=True).groupby("row", sort=True)[FLAGS].all()
    for f in FLAGS:
        t[f] = flags[f].reindex(np.arange(n), fill_value=False).to_numpy(dtype=bool)
    return t, has_queue


def merge_breakdown(answers: list[pd.DataFrame], opts: Options, ds: Dataset) -> dict[str, pd.DataFrame]:
    """The breakdown table: solo speeds over every task, then each task's time split."""
    if not answers:
        return {"breakdown": pd.DataFrame({c: pd.Series(dtype="object") for c in BREAKDOWN_COLUMNS})}
    t, has_queue = _tasks_of(answers, ds)
    gen_tps, gen_n, gen_basis = _solo(t["gen_tps"], t["alone_generation"], opts.solo_gen_tps,
                                      lambda: _stretches_alone(ds, opts))
    pre_tps, pre_n, pre_basis = _solo(t["prefill_tps"], t["alone_prefill"], opts.solo_prefill_tps)
    has = t.pop("has")
    t = {name: v[has] for name, v in t.items()}  # (the tasks with a launch..release)
    own_gen = np.minimum(np.nan_to_num(t["generated"] / gen_tps), t["generation"])
    own_pre = np.minimum(np.nan_to_num(t["new"] / pre_tps), t["prefill"])
    components = {
        "own_generation": own_gen, "own_prefill": own_pre,
        "contention": t["prefill"] + t["generation"] - own_pre - own_gen,
        "wait": t["wait"], "queue": t["queue"], "unsplit": t["unsplit"],
    }
    fallback = "unlogged" if ds.app is not None else "unknown"
    purpose = pd.Series(t.pop("purpose")).astype("object")
    del t
    codes, names = pd.factorize(purpose.where(purpose.notna(), fallback).to_numpy(), sort=True)
    by = pd.Categorical.from_codes(codes, categories=np.arange(len(names)))
    per = pd.DataFrame({name: pd.Series(v).groupby(by, observed=True).sum().to_numpy() for name, v in components.items()},
                       index=pd.Index(names, name="purpose"), columns=COMPONENTS)
    per.loc["all"] = pd.Series({name: pd.Series(v).sum() for name, v in components.items()})
    tasks = pd.Series(np.bincount(codes, minlength=len(names)), index=names)
    tasks.loc["all"] = len(codes)
    long = _long(per, tasks, has_queue, opts)
    long["solo_gen_tps"] = round(gen_tps, 3)
    long["solo_gen_n"] = pd.array([gen_n] * len(long), dtype="Int64")
    long["solo_gen_basis"] = gen_basis
    long["solo_prefill_tps"] = round(pre_tps, 3)
    long["solo_prefill_n"] = pd.array([pre_n] * len(long), dtype="Int64")
    long["solo_prefill_basis"] = pre_basis
    return {"breakdown": long[BREAKDOWN_COLUMNS]}


def _long(per: pd.DataFrame, tasks: pd.Series, has_queue: bool, opts: Options) -> pd.DataFrame:
    """Seconds per purpose and component as rows with shares, a total per purpose, ``all``
    first; components no task has are left out (the four main ones, and the queue where the
    app gives one, always shown)."""
    long = per.reset_index(names="purpose").melt(id_vars="purpose", var_name="component", value_name="seconds")
    present = long.groupby("component", observed=True)["seconds"].transform("sum") > 0
    always = long["component"].isin(["own_generation", "own_prefill", "contention", "wait"])
    if has_queue:
        always |= long["component"] == "queue"
    long = long[always | present].copy()
    total = long.groupby("purpose", observed=True)["seconds"].transform("sum")
    long["share"] = np.where(total > 0, long["seconds"] / total, np.nan)
    tot_rows = long.groupby("purpose", as_index=False, observed=True)["seconds"].sum().assign(component="total", share=1.0)
    long = pd.concat([long, tot_rows], ignore_index=True)
    order = ["all"] + sorted(p for p in long["purpose"].unique() if p != "all")
    long["purpose"] = pd.Categorical(long["purpose"], categories=order)
    long["component"] = pd.Categorical(long["component"], categories=COMPONENTS + ["total"])
    long = long.sort_values(["purpose", "component"], ignore_index=True)
    long["purpose"] = long["purpose"].astype(str)
    long["component"] = long["component"].astype(str)
    long["tasks"] = long["purpose"].map(tasks).astype("int64")
    long["few_samples"] = long["tasks"] < opts.min_samples
    long["seconds"] = long["seconds"].round(3)
    long["share"] = long["share"].round(4)
    return long


ask(Question(("breakdown",), alone_in_part, merge_breakdown))
