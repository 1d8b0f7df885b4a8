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
"""

from __future__ import annotations

import gc
from typing import Iterator

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, release_memory, task_view
from . import Options, register

COMPONENTS = ["own_generation", "own_prefill", "contention", "wait", "queue", "unsplit"]
BREAKDOWN_COLUMNS = [
    "purpose", "component", "seconds", "share", "tasks", "few_samples",
    "solo_gen_tps", "solo_gen_n", "solo_gen_basis", "solo_prefill_tps", "solo_prefill_n", "solo_prefill_basis",
]
_KEYS = tl.GROUP + ["task_id"]


def _free() -> None:
    """Free the frames just dropped now, not at the next table: pandas objects hold one another
    in cycles (their arrays wait for the collector), and the Arrow pool and glibc keep freed
    pages (see :func:`release_memory`)."""
    gc.collect(1)  # (the young generations: the frames were made in this table; a full collection took ~0.1 s)
    release_memory()


_f = tl._f  # (a float64 column's own values, not a copy)

def ran_alone(tv: pd.DataFrame) -> pd.DataFrame:
    """Per task: whether no other task was prefilling or generating during its whole prefill
    (``alone_prefill``) and its whole generation (``alone_generation``)."""
    ps, ft, rel = (_f(tv[c]) for c in ("prefill_start_s", "first_token_s", "release_s"))
    code = tl.narrow(tl.key_codes([tv], tl.GROUP)[0])
    # Every task's prefill [ps, ft) and generation [ft, rel) (each where the log gives it and
    # it lasts), as intervals of its session; the two touch at ft, so one interval per task
    # from the first's start to the last's end has the same number active at every moment,
    # hence the same counts (at 1 GB of log 560k intervals, not 1.1M and their steps).
    pre = ~np.isnan(ps) & ~np.isnan(ft) & (ft > ps)
    gen = ~np.isnan(ft) & ~np.isnan(rel) & (rel > ft)
    ivs = np.where(pre, ps, np.where(gen, ft, np.nan))
    ive = np.where(gen, rel, np.where(pre, ft, np.nan))
    del pre, gen
    out = pd.DataFrame(index=tv.index)
    for name, a, z in (("alone_prefill", ps, ft), ("alone_generation", ft, rel)):
        # The task's own active span [prefill start, release] is among the intervals: leave it out.
        others = tl.overlap_arrays(code, a, z, code, ivs, ive, own_start=ps, own_end=rel, need=("max_count",))[1]
        out[name] = (~np.isnan(a) & ~np.isnan(z) & (z > a)) & (others == 0)
    return out


def solo_speeds(ds: Dataset, tv: pd.DataFrame, opts: Options, *, tv_is_task_view: bool = False) -> dict[str, object]:
    """Solo prefill and generation speeds with their sample counts and basis.

    ``tv_is_task_view`` says ``tv`` is ``task_view(ds)``: the stretches alone (a fallback) are
    then the ones the ``stalls`` tables share instead of being computed anew.
    """
    alone = ran_alone(tv)
    res: dict[str, object] = {}
    for kind, col, flag, override in (
        ("gen", "gen_tps", "alone_generation", opts.solo_gen_tps),
        ("prefill", "prefill_tps", "alone_prefill", opts.solo_prefill_tps),
    ):
        v = pd.Series(_f(tv[col] if col in tv.columns or not tv_is_task_view else task_view(ds, [col])[col]), index=tv.index)
        sample = v[alone[flag] & v.notna() & (v > 0)]
        if override is not None:
            res[kind] = (float(override), pd.NA, "option")
        elif len(sample):
            res[kind] = (float(sample.median()), len(sample), "median of tasks alone")
        elif kind == "gen" and len(stretches := _alone_stretches(ds, tv, opts, tv_is_task_view)):
            res[kind] = (float(stretches.median()), len(stretches), "median of stretches alone")
        else:
            allv = v[v.notna() & (v > 0)]
            res[kind] = (float(allv.quantile(0.9)) if len(allv) else np.nan, len(allv), "p90 of all tasks")
    return res


def _alone_stretches(ds: Dataset, tv: pd.DataFrame, opts: Options, tv_is_task_view: bool) -> pd.Series:
    from .stalls import CLASSES, MIN_PIECE_S, _pieces, _shared_pieces

    p = _shared_pieces(ds, opts) if tv_is_task_view else _pieces(ds, opts, tv)
    return pd.Series(p.tok_per_s[(p.cls == CLASSES.index("alone")) & (p.seconds >= MIN_PIECE_S)])


def _components(tv: pd.DataFrame, launch: np.ndarray, ps: np.ndarray, ft: np.ndarray, rel: np.ndarray,
                has: np.ndarray, split: np.ndarray, pre_tps: float, gen_tps: float) -> Iterator[tuple[str, np.ndarray]]:
    """Each component's seconds per task (``COMPONENTS``, in order), one array at a time (six
    arrays as long as the tasks, a table of them and its copy for the tasks kept rose ~70 MB
    at 1 GB of log)."""
    prefill = np.where(split, ft - ps, 0.0)
    generation = np.where(split, rel - ft, 0.0)
    own_pre = np.minimum(np.nan_to_num(_f(tv["prompt_tokens_new"]) / pre_tps), prefill)
    own_gen = np.minimum(np.nan_to_num(np.maximum(_f(tv["n_gen"]) - 1, 0) / gen_tps), generation)
    yield "own_generation", own_gen
    yield "own_prefill", own_pre
    yield "contention", prefill + generation - own_pre - own_gen
    del prefill, generation, own_pre, own_gen
    yield "wait", np.where(split, ps - launch, 0.0)
    queue = np.nan_to_num(_f(tv["queue_ms"]) / 1000) if "queue_ms" in tv.columns else np.zeros(len(tv))
    yield "queue", np.where(has, np.maximum(queue, 0), 0.0)
    del queue
    yield "unsplit", np.where(has & ~split, rel - launch, 0.0)


@register("breakdown")
def breakdown(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Seconds and share of each component, for all tasks (``purpose`` = ``all``) and per purpose
    (``unlogged`` for tasks no app call matched; ``unknown`` when there is no app log)."""
    # Read in two rounds, each only its columns: what the solo speeds ask (ran_alone's
    # overlap queries), then what the components ask, the first dropped before the second is read.
    solo = solo_speeds(ds, task_view(ds, tl.GROUP + tl.TIMES[1:]), opts, tv_is_task_view=True)
    gen_tps, gen_n, gen_basis = solo["gen"]  # type: ignore[misc]
    pre_tps, pre_n, pre_basis = solo["prefill"]  # type: ignore[misc]
    _free()
    tv = task_view(ds, tl.TIMES + ["prompt_tokens_new", "n_gen", "queue_ms", "purpose"])
    launch, ps, ft, rel = (_f(tv[c]) for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s"))
    has = ~np.isnan(launch) & ~np.isnan(rel) & (rel >= launch)
    split = has & ~np.isnan(ps) & ~np.isnan(ft) & (ps >= launch) & (ft >= ps) & (rel >= ft)
    has_queue = "queue_ms" in tv.columns and bool(tv["queue_ms"].notna().any())
    fallback = "unlogged" if ds.app is not None else "unknown"
    purpose = tv["purpose"].astype("object").where(tv["purpose"].notna(), fallback) if "purpose" in tv.columns else pd.Series(fallback, index=tv.index)
    codes, names = pd.factorize(purpose.to_numpy()[has], sort=True)
    del purpose

    # Per purpose (groupby sums: the same sums, to the bit, as the groupby of a table of all
    # six) and over all tasks kept, one component at a time.
    per_purpose, overall = {}, {}
    for name, v in _components(tv, launch, ps, ft, rel, has, split, pre_tps, gen_tps):
        v = pd.Series(v[has])
        per_purpose[name] = v.groupby(codes).sum().to_numpy()
        overall[name] = v.sum()
    del tv, launch, ps, ft, rel
    per = pd.DataFrame(per_purpose, index=pd.Index(names, name="purpose"), columns=COMPONENTS)
    per.loc["all"] = pd.Series(overall)
    tasks = pd.Series(np.bincount(codes, minlength=len(names)), index=names)
    tasks.loc["all"] = len(codes)
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
    long["solo_gen_tps"] = round(gen_tps, 3)
    long["solo_gen_n"] = pd.array([gen_n] * len(long), dtype="Int64")
    long["solo_gen_basis"] = gen_basis
    long["solo_prefill_tps"] = round(pre_tps, 3)
    long["solo_prefill_n"] = pd.array([pre_n] * len(long), dtype="Int64")
    long["solo_prefill_basis"] = pre_basis
    return long[BREAKDOWN_COLUMNS]
