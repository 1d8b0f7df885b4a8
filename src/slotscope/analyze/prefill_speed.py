"""Prefill speed by how many tokens a task advanced in one batch pass, and the effective chunk size.

llama-server prints a ``prompt processing`` progress line once per batch pass after a prefill
has run 3 s. Between two lines of one task, ``step_tokens`` tokens went through in ``step_s``
seconds: one pass. Its speed, ``step_tokens / step_s``, is the task's share of the pass: a pass
shared with another prefill (or with generating slots) takes longer than this task's tokens
alone would, so shared steps read slow. The first progress line of a task has no step (it
covers every pass of the first 3 s) and is left out.

Bins are left-closed: ``64-256`` holds 64 <= step_tokens < 256.

The *effective chunk* is how many prompt tokens one pass takes from one slot: ``n_batch`` minus
one token per slot generating in the same pass. It is read as the largest step size that
recurs (seen at least twice and in at least 5% of the steps of 64+ tokens), falling back to the
most common step when none recurs. The plain mode would under-read it: with three slots
generating, most passes of a ``-b 512`` server advance a prefill by 509 tokens.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..dataset import Dataset
from . import Options, register

EDGES = [1, 64, 256, 600, 1500, 2100, np.inf]
LABELS = ["1-64", "64-256", "256-600", "600-1500", "1500-2100", "2100+"]
LARGE_STEP = 64
RECUR_SHARE = 0.05
COLUMNS = ["step_tokens", "steps", "median_tps", "median_step_tokens", "effective_chunk_tokens", "chunk_steps", "few_samples"]


def _steps(ds: Dataset) -> pd.DataFrame:
    """Every progress step that advanced: ``tokens``, ``seconds``."""
    # The samples a part at a time where they wait on disk (the table is never built).
    lazy = ds.server.on_disk("prefill_samples")
    parts = [_steps_of(p) for p in lazy.batches()] if lazy is not None else []
    return pd.concat(parts, ignore_index=True) if parts else _steps_of(ds.server.prefill_samples)


def _steps_of(p: pd.DataFrame) -> pd.DataFrame:
    tokens, seconds = p["step_tokens"].astype("float64").to_numpy(), p["step_s"].astype("float64").to_numpy()
    keep = (tokens >= 1) & (seconds > 0)
    return pd.DataFrame({"tokens": tokens[keep], "seconds": seconds[keep]})


def _chunk(steps: pd.DataFrame) -> tuple[int | None, int]:
    large = steps.loc[steps["tokens"] >= LARGE_STEP, "tokens"].astype("int64")
    if large.empty:
        return None, 0
    counts = large.value_counts()
    recurring = counts[(counts >= 2) & (counts >= RECUR_SHARE * len(large))]
    if len(recurring):
        size = int(recurring.index.max())
    else:
        size = int(counts[counts == counts.max()].index.max())
    return size, int(counts[size])


def effective_chunk_tokens(ds: Dataset) -> int | None:
    """Prompt tokens one batch pass takes from one slot (about ``n_batch``), or None without progress lines."""
    return _chunk(_steps(ds))[0]


@register("prefill-speed")
def prefill_speed(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Median prefill tok/s per bin of tokens advanced in one pass, with the effective chunk size."""
    steps = _steps(ds)
    chunk, chunk_steps = _chunk(steps)
    steps = steps.assign(
        tps=steps["tokens"] / steps["seconds"],
        bin=pd.cut(steps["tokens"], EDGES, right=False, labels=LABELS),
    )
    g = steps.groupby("bin", observed=False)
    table = pd.DataFrame({
        "steps": g["tps"].count().astype("int64"),
        "median_tps": g["tps"].median().round(1),
        "median_step_tokens": g["tokens"].median(),
    }).rename_axis("step_tokens").reset_index()
    table["step_tokens"] = table["step_tokens"].astype("string")
    table["effective_chunk_tokens"] = pd.array([chunk] * len(table), dtype="Int64")
    table["chunk_steps"] = chunk_steps
    table["few_samples"] = table["steps"] < opts.min_samples
    return table[COLUMNS]
