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

from .. import timeline as tl
from ..dataset import Dataset
from ..periods import Part
from .questions import Options, Question, ask
from .context import counted_at, median_of_counts

EDGES = [1, 64, 256, 600, 1500, 2100, np.inf]
LABELS = ["1-64", "64-256", "256-600", "600-1500", "1500-2100", "2100+"]
LARGE_STEP = 64
RECUR_SHARE = 0.05
COLUMNS = ["step_tokens", "steps", "median_tps", "median_step_tokens", "effective_chunk_tokens", "chunk_steps", "few_samples"]


def steps_of(samples: pd.DataFrame) -> pd.DataFrame:
    """The progress steps of ``samples`` that advanced, as each distinct (``tokens``,
    ``seconds``) pair with how many steps had it (``steps``), sorted: the steps' numbers
    repeat (tokens are the chunk sizes, seconds have six decimals)."""
    if "step_s" not in samples:  # (a log without progress lines: its table lacks the step's seconds)
        return _pairs(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
    tokens, seconds = tl.floats(samples["step_tokens"]), tl.floats(samples["step_s"])
    keep = (tokens >= 1) & (seconds > 0)
    return _pairs(tokens[keep], seconds[keep], np.ones(int(keep.sum()), dtype=np.int64))


def _pairs(tokens: np.ndarray, seconds: np.ndarray, steps: np.ndarray) -> pd.DataFrame:
    """Each distinct (tokens, seconds) pair, sorted, with the sum of its ``steps``."""
    # (as complex numbers: numpy sorts them by real part, then imaginary, and fast)
    pair, at = np.unique(tokens + 1j * seconds, return_inverse=True)
    return pd.DataFrame({"tokens": pair.real.copy(), "seconds": pair.imag.copy(),
                         "steps": np.bincount(at.reshape(-1), steps, minlength=len(pair)).astype(np.int64)})


def part_steps(part: Part, opts: Options) -> pd.DataFrame:
    """:func:`steps_of` the progress lines the part counts."""
    return steps_of(part.prefill[counted_at(part, part.prefill["t_s"])])


def merge_steps(answers: list[pd.DataFrame], opts: Options, ds: Dataset) -> dict[str, pd.DataFrame]:
    """The table of every part's steps."""
    steps = pd.concat(answers) if answers else steps_of(pd.DataFrame({"step_tokens": [], "step_s": []}))
    return {"prefill-speed": _table(_pairs(*(steps[c].to_numpy() for c in ("tokens", "seconds", "steps"))), opts)}


def _chunk(steps: pd.DataFrame) -> tuple[int | None, int]:
    """The effective chunk and how many steps had it: of the steps of 64+ tokens, the largest
    size seen at least twice and in 5% of them, else the largest of the most common sizes."""
    large = steps.loc[steps["tokens"] >= LARGE_STEP]
    if not large["steps"].sum():
        return None, 0
    counts = large.groupby(large["tokens"].astype("int64").to_numpy())["steps"].sum()  # (steps per size)
    recurring = counts[(counts >= 2) & (counts >= RECUR_SHARE * counts.sum())]
    if len(recurring):
        size = int(recurring.index.max())
    else:
        size = int(counts[counts == counts.max()].index.max())
    return size, int(counts[size])


def effective_chunk_tokens(ds: Dataset) -> int | None:
    """Prompt tokens one batch pass takes from one slot (about ``n_batch``), or None without
    progress lines; of the dataset's progress lines table as it is (``compare`` gives each
    window's own)."""
    return _chunk(steps_of(ds.server.prefill_samples))[0]


QUESTION = ask(Question(("prefill-speed",), part_steps, merge_steps))


def _table(steps: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """The table of the steps as :func:`steps_of` counts them."""
    chunk, chunk_steps = _chunk(steps)
    # Per bin, the steps and the medians of their speeds and sizes, read off each pair's count.
    tps = (steps["tokens"] / steps["seconds"]).to_numpy()
    bins = pd.cut(steps["tokens"], EDGES, right=False, labels=LABELS).cat.codes.to_numpy()
    n, median_tps, median_tokens = [], [], []
    for k in range(len(LABELS)):
        at, count = bins == k, steps["steps"].to_numpy()[bins == k]
        by_tps = np.argsort(tps[at], kind="stable")
        n.append(int(count.sum()))
        median_tps.append(median_of_counts(tps[at][by_tps], count[by_tps]))
        median_tokens.append(median_of_counts(steps["tokens"].to_numpy()[at], count))  # (pairs sorted by tokens)
    table = pd.DataFrame({
        "step_tokens": pd.Categorical(LABELS, categories=LABELS, ordered=True),
        "steps": np.asarray(n, dtype=np.int64),
        "median_tps": pd.Series(median_tps, dtype="float64").round(1),
        "median_step_tokens": pd.Series(median_tokens, dtype="float64"),
    })
    table["step_tokens"] = table["step_tokens"].astype("string")
    table["effective_chunk_tokens"] = pd.array([chunk] * len(table), dtype="Int64")
    table["chunk_steps"] = chunk_steps
    table["few_samples"] = table["steps"] < opts.min_samples
    return table[COLUMNS]
