"""Analyzers: one module per question of the field report, each returning a DataFrame.

Every analyzer has the signature ``fn(ds: Dataset, opts: Options) -> pd.DataFrame`` and is
registered in :data:`TABLES` under its stable table name. Each statistic comes with its sample
count; rows resting on fewer than ``opts.min_samples`` samples say so (``few_samples``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd

from ..dataset import Dataset


@dataclass(frozen=True)
class Options:
    """Thresholds of the report (each a CLI option of ``slotscope analyze``)."""

    long_prefill_tokens: int = 15_000  # "long prefill" for stalls
    big_prefill_tokens: int = 5_000  # "5,000+ new tokens" for prefills / same-conditions
    wait_threshold_s: float = 1.0  # waits before prefill worth listing
    cache_rate: float = 0.95  # turns subset: prompt cache rate at or above this
    uncached_tokens: int = 5_000  # turns subset: at least this many new (uncached) tokens
    solo_gen_tps: float | None = None  # breakdown: override the estimated solo generation speed
    solo_prefill_tps: float | None = None  # breakdown: override the estimated solo prefill speed
    cache_window_s: float = 300.0  # cache: consecutive turns of one user within this
    min_samples: int = 10  # below this a class is marked, never stated as a finding
    worst: int = 10  # rows in "worst" listings


Analyzer = Callable[[Dataset, Options], pd.DataFrame]
TABLES: dict[str, Analyzer] = {}


def register(name: str) -> Callable[[Analyzer], Analyzer]:
    """Decorator: make an analyzer available under its stable table name."""

    def deco(fn: Analyzer) -> Analyzer:
        TABLES[name] = fn
        return fn

    return deco
