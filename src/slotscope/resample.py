"""Bootstrap statistics: the values of units (sessions, prefill events, or each value alone)
resampled with replacement, a block of resamples at a time.

compare's intervals and whatif's come from here. A resample is a row of counts per unit; its
statistic is that of the sample the counts expand to, computed without expanding it.
"""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd

# Resample counts are drawn in blocks of at most this many cells: a block's few arrays of them
# stay a small share of the memory bound (and closer to the cache). The draws do not depend on it.
_BLOCK_CELLS = 1 << 20
RUN = 256  # sorted values per run of a quantile's search (see Resampled)
QUANTILES = {"median": 0.5, "p90": 0.9, "p95": 0.95}  # the quantile statistics' levels


class Resampled:
    """Sorted values ``xs`` with each one's unit (``codes``, of ``k``), and their statistic over
    resamples given as counts per unit (a row per resample).

    A quantile is found run by run, then within its run: the sorted positions are cut into runs
    of :data:`RUN` values, each held as the units in it and how many of its values each has, so
    a resample's weight per run costs one product per distinct (run, unit) pair rather than one
    per value (few sessions with many values: a few pairs per run). Quantiles match
    ``numpy.quantile`` (linear) on the sample the counts expand to."""

    def __init__(self, xs: np.ndarray, codes: np.ndarray, k: int) -> None:
        self.xs, self.codes, self.k = xs, codes, k

    @functools.cached_property
    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per distinct (run, unit) pair, in run order: the unit and its values in the run; and
        where each run's pairs begin."""
        n, k = len(self.xs), self.k
        pairs, values = np.unique(np.arange(n) // RUN * k + self.codes, return_counts=True)
        return pairs % k, values, np.searchsorted(pairs // k, np.arange(-(-n // RUN)))

    def cells(self, kind: str) -> int:
        """Cells a resample of the statistic costs (what the caller's blocks are sized by)."""
        return len(self.xs) if kind in ("sum", "max") else max(len(self.runs[0]), self.k, RUN)

    def stat(self, counts: np.ndarray, kind: str) -> np.ndarray:
        xs, codes = self.xs, self.codes
        if kind == "sum":
            return counts[:, codes] @ xs
        if kind == "max":
            w = counts[:, codes]
            return xs[w.shape[1] - 1 - np.argmax(w[:, ::-1] > 0, axis=1)]
        q = QUANTILES[kind]
        unit, values, first = self.runs
        per_run = np.add.reduceat(counts[:, unit] * values, first, axis=1)
        cum = np.cumsum(per_run, axis=1)
        m = cum[:, -1]
        h = (m - 1) * q
        lo = np.floor(h)
        i_lo, i_hi = self._first_past(counts, per_run, cum, lo), self._first_past(counts, per_run, cum, np.minimum(lo + 1, m - 1))
        return xs[i_lo] + (h - lo) * (xs[i_hi] - xs[i_lo])

    def _first_past(self, counts: np.ndarray, per_run: np.ndarray, cum: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Per resample, the first sorted position whose running count passes ``rank``."""
        b = np.arange(len(counts))
        run = np.argmax(cum > rank[:, None], axis=1)
        pos = run[:, None] * RUN + np.arange(RUN)
        inside = pos < len(self.xs)
        w = np.where(inside, counts[b[:, None], self.codes[np.minimum(pos, len(self.xs) - 1)]], 0)
        within = (cum[b, run] - per_run[b, run])[:, None] + np.cumsum(w, axis=1)
        return run * RUN + np.argmax(within > rank[:, None], axis=1)


def resampled_stats(values: np.ndarray, clusters: np.ndarray | None, kind: str, rng: np.random.Generator,
                    n_boot: int) -> np.ndarray:
    """``n_boot`` bootstrap values of the statistic; units (clusters, else values) are drawn with
    replacement as one 2-D array of indices per block."""
    order = np.argsort(values, kind="stable")
    xs = values[order]
    codes = pd.factorize(clusters[order])[0] if clusters is not None else np.arange(len(xs))
    k = int(codes.max()) + 1
    sample = Resampled(xs, codes, k)
    out = np.empty(n_boot)
    rows = max(1, _BLOCK_CELLS // sample.cells(kind))
    for b0 in range(0, n_boot, rows):
        b = min(rows, n_boot - b0)
        idx = rng.integers(0, k, size=(b, k))
        counts = np.bincount((idx + k * np.arange(b)[:, None]).ravel(), minlength=b * k).reshape(b, k)
        out[b0:b0 + b] = sample.stat(counts, kind)
    return out


def point(values: np.ndarray, kind: str) -> float:
    """The statistic of the values themselves (NaN: none), as a resample computes it."""
    if not len(values):
        return float("nan")
    xs = np.sort(values)
    return float(Resampled(xs, np.arange(len(xs)), len(xs)).stat(np.ones((1, len(xs)), dtype=np.int64), kind)[0])
