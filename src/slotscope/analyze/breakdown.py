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

import numpy as np
import pandas as pd

from .. import timeline as tl
from ..dataset import Dataset, task_view
from . import Options, register

COMPONENTS = ["own_generation", "own_prefill", "contention", "wait", "queue", "unsplit"]
BREAKDOWN_COLUMNS = [
    "purpose", "component", "seconds", "share", "tasks", "few_samples",
    "solo_gen_tps", "solo_gen_n", "solo_gen_basis", "solo_prefill_tps", "solo_prefill_n", "solo_prefill_basis",
]
_KEYS = tl.GROUP + ["task_id"]


def _f(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)


def ran_alone(tv: pd.DataFrame) -> pd.DataFrame:
    """Per task: whether no other task was prefilling or generating during its whole prefill
    (``alone_prefill``) and its whole generation (``alone_generation``)."""
    ps, ft, rel = _f(tv["prefill_start_s"]), _f(tv["first_token_s"]), _f(tv["release_s"])
    code = tl.key_codes([tv], tl.GROUP)[0]
    # Every task's prefill and generation (its phases), as intervals of its session.
    pre = np.flatnonzero(~np.isnan(ps) & ~np.isnan(ft) & (ft >= ps))
    gen = np.flatnonzero(~np.isnan(ft) & ~np.isnan(rel) & (rel >= ft))
    icode = np.concatenate([code[pre], code[gen]])
    ivs, ive = np.concatenate([ps[pre], ft[gen]]), np.concatenate([ft[pre], rel[gen]])
    out = pd.DataFrame(index=tv.index)
    for name, a, z in (("alone_prefill", ps, ft), ("alone_generation", ft, rel)):
        # The task's own active span [prefill start, release] is among the intervals: leave it out.
        others = tl.overlap_arrays(code, a, z, icode, ivs, ive, own_start=ps, own_end=rel, need=("max_count",))[1]
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
        v = pd.Series(_f(tv[col]), index=tv.index)
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


@register("breakdown")
def breakdown(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Seconds and share of each component, for all tasks (``purpose`` = ``all``) and per purpose
    (``unlogged`` for tasks no app call matched; ``unknown`` when there is no app log)."""
    tv = task_view(ds, _KEYS + tl.TIMES + ["prompt_tokens_new", "n_gen", "gen_tps", "prefill_tps", "queue_ms", "purpose"])
    solo = solo_speeds(ds, tv, opts, tv_is_task_view=True)
    gen_tps, gen_n, gen_basis = solo["gen"]  # type: ignore[misc]
    pre_tps, pre_n, pre_basis = solo["prefill"]  # type: ignore[misc]
    launch, ps, ft, rel = (_f(tv[c]) for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s"))
    has = ~np.isnan(launch) & ~np.isnan(rel) & (rel >= launch)
    split = has & ~np.isnan(ps) & ~np.isnan(ft) & (ps >= launch) & (ft >= ps) & (rel >= ft)
    prefill = np.where(split, ft - ps, 0.0)
    generation = np.where(split, rel - ft, 0.0)
    new = _f(tv["prompt_tokens_new"])
    n_gen = _f(tv["n_gen"])
    own_pre = np.minimum(np.nan_to_num(new / pre_tps), prefill)
    own_gen = np.minimum(np.nan_to_num(np.maximum(n_gen - 1, 0) / gen_tps), generation)
    queue = np.nan_to_num(_f(tv["queue_ms"]) / 1000) if "queue_ms" in tv.columns else np.zeros(len(tv))
    queue = np.where(has, np.maximum(queue, 0), 0.0)
    comp = pd.DataFrame({
        "own_generation": own_gen,
        "own_prefill": own_pre,
        "contention": prefill + generation - own_pre - own_gen,
        "wait": np.where(split, ps - launch, 0.0),
        "queue": queue,
        "unsplit": np.where(has & ~split, rel - launch, 0.0),
    })
    fallback = "unlogged" if ds.app is not None else "unknown"
    purpose = tv["purpose"].astype("object").where(tv["purpose"].notna(), fallback) if "purpose" in tv.columns else pd.Series(fallback, index=tv.index)
    comp["purpose"] = purpose.to_numpy()
    comp = comp[has]
    per = comp.groupby("purpose", sort=True, observed=True)[COMPONENTS].sum()
    per.loc["all"] = comp[COMPONENTS].sum()
    tasks = comp.groupby("purpose", observed=True).size()
    tasks.loc["all"] = len(comp)
    long = per.reset_index(names="purpose").melt(id_vars="purpose", var_name="component", value_name="seconds")
    present = long.groupby("component", observed=True)["seconds"].transform("sum") > 0
    always = long["component"].isin(["own_generation", "own_prefill", "contention", "wait"])
    if "queue_ms" in tv.columns and tv["queue_ms"].notna().any():
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
