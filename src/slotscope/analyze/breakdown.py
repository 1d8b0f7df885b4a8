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
from typing import Callable, Iterator

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
    code = tl.narrow(tl.key_codes([tv], tl.GROUP)[0])
    flags = _alone_flags(code, *(_f(tv[c]) for c in ("prefill_start_s", "first_token_s", "release_s")))
    return pd.DataFrame(flags, index=tv.index)


TASK_BLOCK = 1 << 16  # tasks looked at a time (bounds the temporaries of their searches and sums)


def _alone_flags(code: np.ndarray, ps: np.ndarray, ft: np.ndarray, rel: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`ran_alone` on arrays: each task's session code and times."""
    out = {name: np.zeros(len(ps), dtype=bool) for name in ("alone_prefill", "alone_generation")}
    one = not len(code) or bool((code == code[0]).all())  # (one session, the usual case: no positions per session)
    for rows in [None] if one else tl.rows_by_group(code, np.ones(len(code), dtype=bool)).values():
        # The session's intervals' starts and ends, each sorted (at 1 GB of log 560k of each).
        starts, ends = _activity(ps, ft, rel) if rows is None else _activity(ps[rows], ft[rows], rel[rows])
        starts, ends = np.sort(starts[~np.isnan(starts)]), np.sort(ends[~np.isnan(ends)])
        for at in range(0, len(ps) if rows is None else len(rows), TASK_BLOCK):
            q = slice(at, at + TASK_BLOCK) if rows is None else rows[at:at + TASK_BLOCK]
            s, e = _activity(ps[q], ft[q], rel[q])
            for name, a, z in (("alone_prefill", ps[q], ft[q]), ("alone_generation", ft[q], rel[q])):
                # Alone: no interval but the task's own overlaps the phase, and its own only
                # inside the task's span [prefill start, release], which is left out (the span,
                # where the log gives it, lies in the interval, as does a phase that lasts).
                # By two sorted searches per phase, not a step function of the session and
                # range-maximum queries on it (at 1 GB of log ~25 MB more, 2x the time).
                n = np.searchsorted(starts, z, "left") - np.searchsorted(ends, a, "right")  # (intervals overlapping (a, z))
                own = ~np.isnan(s) & (s < z) & (e > a)
                c0, c1 = tl._clip_own(ps[q], rel[q], a, z)
                outside = own & ((np.maximum(s, a) < c0) | (np.minimum(e, z) > c1))
                out[name][q] = ~np.isnan(a) & ~np.isnan(z) & (z > a) & (n - own == 0) & ~outside
    return out


def _activity(ps: np.ndarray, ft: np.ndarray, rel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each task's prefill [ps, ft) and generation [ft, rel) (each where the log gives it and it
    lasts) as one interval, from the first's start to the last's end (NaN: neither): the two
    touch at ft, so it is active whenever one of them is (at 1 GB of log 560k intervals, not
    1.1M)."""
    pre = ~np.isnan(ps) & ~np.isnan(ft) & (ft > ps)
    gen = ~np.isnan(ft) & ~np.isnan(rel) & (rel > ft)
    return np.where(pre, ps, np.where(gen, ft, np.nan)), np.where(gen, rel, np.where(pre, ft, np.nan))


def solo_speeds(ds: Dataset, tv: pd.DataFrame, opts: Options, *, tv_is_task_view: bool = False) -> dict[str, object]:
    """Solo prefill and generation speeds with their sample counts and basis.

    ``tv_is_task_view`` says ``tv`` is ``task_view(ds)``: the stretches alone (a fallback) are
    then the ones the ``stalls`` tables share instead of being computed anew.
    """
    return _solo_speeds(ran_alone(tv), opts, lambda col: _f(tv[col]) if col in tv.columns or not tv_is_task_view
                        else _f(task_view(ds, [col])[col]), lambda: _alone_stretches(ds, tv, opts, tv_is_task_view))


def _solo_speeds(alone: pd.DataFrame | dict[str, np.ndarray], opts: Options, speeds: Callable[[str], np.ndarray],
                 stretches: Callable[[], pd.Series]) -> dict[str, object]:
    """:func:`solo_speeds` of the tasks' ``alone`` flags (:func:`ran_alone`), each task's speeds
    (``speeds(column)``) and the stretches of generation alone (``stretches()``, the fallback)."""
    res: dict[str, object] = {}
    for kind, col, flag, override in (
        ("gen", "gen_tps", "alone_generation", opts.solo_gen_tps),
        ("prefill", "prefill_tps", "alone_prefill", opts.solo_prefill_tps),
    ):
        v = pd.Series(speeds(col))
        sample = v[np.asarray(alone[flag]) & v.notna().to_numpy() & (v > 0).to_numpy()]
        if override is not None:
            res[kind] = (float(override), pd.NA, "option")
        elif len(sample):
            res[kind] = (float(sample.median()), len(sample), "median of tasks alone")
        elif kind == "gen" and len(got := stretches()):
            res[kind] = (float(got.median()), len(got), "median of stretches alone")
        else:
            allv = v[v.notna() & (v > 0)]
            res[kind] = (float(allv.quantile(0.9)) if len(allv) else np.nan, len(allv), "p90 of all tasks")
    return res


def _alone_stretches(ds: Dataset, tv: pd.DataFrame | None, opts: Options, tv_is_task_view: bool) -> pd.Series:
    """The stretches of generation alone (:mod:`.stalls`): the ones its tables share when ``tv``
    is the task view (None: it is), else those of ``tv``."""
    from .stalls import CLASSES, MIN_PIECE_S, _pieces, _shared_pieces

    p = _shared_pieces(ds, opts) if tv_is_task_view else _pieces(ds, opts, tv)
    return pd.Series(p.tok_per_s[(p.cls == CLASSES.index("alone")) & (p.seconds >= MIN_PIECE_S)])


def _components(column: Callable[[str], pd.Series | None], launch: np.ndarray, ps: np.ndarray, ft: np.ndarray,
                rel: np.ndarray, has: np.ndarray, split: np.ndarray, pre_tps: float, gen_tps: float) -> Iterator[tuple[str, np.ndarray]]:
    """Each component's seconds per task (``COMPONENTS``, in order), one array at a time, each
    made :data:`TASK_BLOCK` tasks at a time (six arrays as long as the tasks, a table of them
    and its copy for the tasks kept rose ~70 MB at 1 GB of log; the expressions' temporaries
    for every task ~20 MB more), the columns besides the times read as they are used
    (``column(name)``: None where the tasks do not have it)."""
    n = len(launch)

    def blockwise(f: Callable[..., np.ndarray], *cols: pd.Series | np.ndarray) -> np.ndarray:
        """``f(block, *cols' values in it as floats)`` for each block of tasks, joined."""
        out = np.empty(n)
        for at in range(0, n, TASK_BLOCK):
            b = slice(at, at + TASK_BLOCK)
            out[b] = f(b, *(_f(c.iloc[b]) if isinstance(c, pd.Series) else c[b] for c in cols))
        return out

    def prefill(b: slice) -> np.ndarray:
        return np.where(split[b], ft[b] - ps[b], 0.0)

    def generation(b: slice) -> np.ndarray:
        return np.where(split[b], rel[b] - ft[b], 0.0)

    own_gen = blockwise(lambda b, g: np.minimum(np.nan_to_num(np.maximum(g - 1, 0) / gen_tps), generation(b)), column("n_gen"))
    yield "own_generation", own_gen
    own_pre = blockwise(lambda b, new: np.minimum(np.nan_to_num(new / pre_tps), prefill(b)), column("prompt_tokens_new"))
    yield "own_prefill", own_pre
    yield "contention", blockwise(lambda b, p, g: prefill(b) + generation(b) - p - g, own_pre, own_gen)
    del own_pre, own_gen
    yield "wait", blockwise(lambda b: np.where(split[b], ps[b] - launch[b], 0.0))
    queue = column("queue_ms")
    yield "queue", (blockwise(lambda b, q: np.where(has[b], np.maximum(np.nan_to_num(q / 1000), 0), 0.0), queue)
                    if queue is not None else np.zeros(n))
    del queue
    yield "unsplit", blockwise(lambda b: np.where(has[b] & ~split[b], rel[b] - launch[b], 0.0))


def _purposes(tv: pd.DataFrame, has: np.ndarray, fallback: str) -> tuple[np.ndarray, np.ndarray]:
    """The ``has`` tasks' purposes (``fallback`` where none) factorized, sorted: each one's code
    and the names. From the categories' codes where the purposes are categories of texts (the
    task view's: a column of their texts, one per task, was ~48 MB at 1 GB of log)."""
    col = tv["purpose"] if "purpose" in tv.columns else pd.Series(fallback, index=tv.index)
    if not isinstance(col.dtype, pd.CategoricalDtype) or not all(isinstance(c, str) for c in col.cat.categories):
        return pd.factorize(col.astype("object").where(col.notna(), fallback).to_numpy()[has], sort=True)
    labels = [*col.cat.categories, fallback]
    k = col.cat.codes.to_numpy()[has].astype(np.int64)
    k[k < 0] = len(labels) - 1
    present = np.unique(k)
    names = sorted({labels[i] for i in present})  # (pd.factorize sorts texts as Python does)
    to_name = np.zeros(len(labels), dtype=np.int64)
    to_name[present] = [names.index(labels[i]) for i in present]
    return to_name[k], np.array(names, dtype=object)


@register("breakdown")
def breakdown(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Seconds and share of each component, for all tasks (``purpose`` = ``all``) and per purpose
    (``unlogged`` for tasks no app call matched; ``unknown`` when there is no app log)."""
    # Read in two rounds, each only its columns: what the solo speeds ask (ran_alone's
    # overlap queries), then what the components ask, the first dropped before the second is read.
    # The sessions' codes first, their key columns dropped before the times are read.
    code = tl.narrow(tl.key_codes([task_view(ds, tl.GROUP)], tl.GROUP)[0])
    alone = _alone_flags(code, *(_f(task_view(ds, [c])[c]) for c in ("prefill_start_s", "first_token_s", "release_s")))
    del code
    solo = _solo_speeds(alone, opts, lambda col: _f(task_view(ds, [col])[col]), lambda: _alone_stretches(ds, None, opts, True))
    del alone
    gen_tps, gen_n, gen_basis = solo["gen"]  # type: ignore[misc]
    pre_tps, pre_n, pre_basis = solo["prefill"]  # type: ignore[misc]
    _free()
    tv = task_view(ds, tl.TIMES + ["purpose"])
    launch, ps, ft, rel = (_f(tv[c]) for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s"))
    has = ~np.isnan(launch) & ~np.isnan(rel) & (rel >= launch)
    split = has & ~np.isnan(ps) & ~np.isnan(ft) & (ps >= launch) & (ft >= ps) & (rel >= ft)
    fallback = "unlogged" if ds.app is not None else "unknown"
    codes, names = _purposes(tv, has, fallback)
    codes = tl.narrow(codes)
    # (the codes as a categorical's: the groupby sums as it sums integer keys, without factorizing them)
    by = pd.Categorical.from_codes(codes, categories=np.arange(len(names)))
    queue = task_view(ds, ["queue_ms"])
    has_queue = "queue_ms" in queue.columns and bool(queue["queue_ms"].notna().any())
    del queue

    def column(name: str) -> pd.Series | None:
        got = task_view(ds, [name])
        return got[name] if name in got.columns else None

    # Per purpose (groupby sums: the same sums, to the bit, as the groupby of a table of all
    # six) and over all tasks kept, one component at a time.
    per_purpose, overall = {}, {}
    for name, v in _components(column, launch, ps, ft, rel, has, split, pre_tps, gen_tps):
        v = pd.Series(v[has])
        per_purpose[name] = v.groupby(by, observed=True).sum().to_numpy()
        overall[name] = v.sum()
        del v
        release_memory()  # (the last component's arrays: freed pages glibc would keep under the next)
    del tv, launch, ps, ft, rel, by
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
