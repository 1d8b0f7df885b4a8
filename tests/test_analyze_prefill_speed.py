"""prefill-speed: tok/s per pass size and the effective chunk, recomputed from the raw progress lines."""

from __future__ import annotations

import re
from dataclasses import replace
import statistics

import pandas as pd
import pytest

from slotscope.analyze import Options
from slotscope.analyze.prefill_speed import LABELS, effective_chunk_tokens, prefill_speed
from slotscope.dataset import load

from .conftest import REAL

PROGRESS = re.compile(r"(\d+)\.(\d\d)\.(\d{3})\.(\d{3}) I slot print_timing: id +\d+ \| task (\d+) \| prompt processing, n_tokens = +(\d+)")
BOUNDS = [(1, 64), (64, 256), (256, 600), (600, 1500), (1500, 2100), (2100, float("inf"))]


def _raw_steps(scenario: str) -> list[tuple[int, float]]:
    """(tokens, seconds) between consecutive progress lines of one task, straight from the log text."""
    last: dict[str, tuple[int, float]] = {}
    steps = []
    for line in (REAL / scenario / "logs" / "llama-server.log").read_text().splitlines():
        m = PROGRESS.search(line)
        if not m:
            continue
        mi, s, ms, us, task, n = m.groups()
        t = int(mi) * 60 + int(s) + int(ms) / 1e3 + int(us) / 1e6
        if task in last:
            steps.append((int(n) - last[task][0], t - last[task][1]))
        last[task] = (int(n), t)
    return steps


@pytest.fixture(scope="module")
def datasets() -> dict:
    return {s: load([REAL / s / "logs"]) for s in ("before", "after", "b2048-unified", "wallclock")}


@pytest.mark.parametrize("scenario,low,high", [
    ("before", 2047, 2048), ("b2048-unified", 2047, 2048), ("after", 511, 512), ("wallclock", 511, 512)])
def test_effective_chunk_is_about_n_batch(datasets: dict, scenario: str, low: int, high: int) -> None:
    assert low <= effective_chunk_tokens(datasets[scenario]) <= high
    table = prefill_speed(datasets[scenario], Options())
    assert (table["effective_chunk_tokens"] == effective_chunk_tokens(datasets[scenario])).all()
    assert (table["chunk_steps"] >= 2).all()


def test_plain_mode_would_under_read_the_chunk() -> None:
    # Why the chunk is the largest recurring step: in `after` most passes also carry three generating slots.
    sizes = pd.Series([t for t, _ in _raw_steps("after") if t >= 64])
    assert sizes.mode().iloc[0] == 509


@pytest.mark.parametrize("scenario", ["before", "after"])
def test_bins_match_the_raw_progress_lines(datasets: dict, scenario: str) -> None:
    table = prefill_speed(datasets[scenario], Options()).set_index("step_tokens")
    assert list(table.index) == LABELS
    raw = _raw_steps(scenario)
    for label, (lo, hi) in zip(LABELS, BOUNDS):
        speeds = [n / s for n, s in raw if lo <= n < hi and s > 0]
        assert table.loc[label, "steps"] == len(speeds), label
        if speeds:
            assert table.loc[label, "median_tps"] == pytest.approx(statistics.median(speeds), abs=0.1), label
        else:
            assert pd.isna(table.loc[label, "median_tps"])
    assert table["steps"].sum() == len(raw)


def test_full_chunks_run_near_solo_prefill_speed(datasets: dict) -> None:
    # README: ~570-730 tok/s solo; shared passes pull the median a little below.
    full = prefill_speed(datasets["before"], Options()).set_index("step_tokens").loc["1500-2100"]
    assert full["steps"] >= 30 and not full["few_samples"]
    assert 450 <= full["median_tps"] <= 750


def test_needs_no_app_log(datasets: dict) -> None:
    alone = prefill_speed(load([REAL / "before" / "logs" / "llama-server.log"]), Options())
    pd.testing.assert_frame_equal(alone, prefill_speed(datasets["before"], Options()))


def test_no_progress_lines_no_chunk(datasets: dict) -> None:
    ds = datasets["before"]
    quiet = replace(ds, server=replace(ds.server, prefill_samples=ds.server.prefill_samples.iloc[0:0]))
    assert effective_chunk_tokens(quiet) is None
    table = prefill_speed(quiet, Options())
    assert (table["steps"] == 0).all() and table["effective_chunk_tokens"].isna().all()


@pytest.mark.parametrize("seed", range(4))
def test_pairs_counted_by_part_give_the_table_of_every_step(seed: int) -> None:
    """Steps counted as distinct (tokens, seconds) pairs a part at a time give the table the
    steps one by one gave (a groupby median per bin, value_counts for the chunk): with
    repeated and unique pairs, odd and even counts, empty bins, an empty part, steps that did
    not advance, and no recurring size (seed 3)."""
    import numpy as np

    from slotscope.analyze.prefill_speed import COLUMNS, EDGES, _add, _chunk, _pairs, _steps_of, _table

    rng = np.random.default_rng(seed)
    n = 3000
    sizes = np.array([1, 7, 63, 64, 300, 509, 510, 512, 2048]) if seed < 3 else np.arange(64, 64 + n)
    tokens = pd.array(rng.choice(sizes, n), dtype="Int64")
    tokens[rng.random(n) < 0.05] = 0  # (did not advance)
    seconds = np.round(rng.gamma(2, 0.3, n), 2 + seed % 3)  # (0.01 to 0.0001 apart)
    p = pd.DataFrame({"step_tokens": tokens, "step_s": seconds})
    counted = _pairs(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))
    for lo, hi in ((0, 0), (0, 1000), (1000, n)):
        counted = _add(counted, _steps_of(p.iloc[lo:hi]))
    # The table of every step, as it was made.
    t, s = p["step_tokens"].astype("float64").to_numpy(), p["step_s"].to_numpy()
    steps = pd.DataFrame({"tokens": t[(t >= 1) & (s > 0)], "seconds": s[(t >= 1) & (s > 0)]})
    large = steps.loc[steps["tokens"] >= 64, "tokens"].astype("int64")
    counts = large.value_counts()
    recurring = counts[(counts >= 2) & (counts >= 0.05 * len(large))]
    size = int(recurring.index.max()) if len(recurring) else int(counts[counts == counts.max()].index.max())
    assert _chunk(counted) == (size, int(counts[size]))
    steps = steps.assign(tps=steps["tokens"] / steps["seconds"], bin=pd.cut(steps["tokens"], EDGES, right=False, labels=LABELS))
    g = steps.groupby("bin", observed=False)
    want = pd.DataFrame({"steps": g["tps"].count().astype("int64"), "median_tps": g["tps"].median().round(1),
                         "median_step_tokens": g["tokens"].median()}).rename_axis("step_tokens").reset_index()
    want["step_tokens"] = want["step_tokens"].astype("string")
    want["effective_chunk_tokens"] = pd.array([size] * len(want), dtype="Int64")
    want["chunk_steps"] = int(counts[size])
    want["few_samples"] = want["steps"] < 10
    pd.testing.assert_frame_equal(_table(counted, Options()), want[COLUMNS])


def _rechunked(samples, rows: int, edit=None):
    """``samples`` (server_log.Samples) with each part's rows in stored chunks of ``rows``
    lines (``edit(columns)``: changed first)."""
    from dataclasses import replace as changed

    from slotscope.server_log import Samples
    from slotscope.tasks import FinishedRows

    parts = []
    for p in samples.parts:
        cols = {c: p.store.column(c) for c in p.store._names()}
        if edit is not None:
            edit(cols)
        store = FinishedRows(spill_rows=rows)
        for lo in range(0, len(cols["task"]), 3):
            store.append({c: v[lo:lo + 3] for c, v in cols.items()})
        store.close(on_disk=True)
        parts.append(changed(p, store=store))
    return Samples(parts, samples.columns)


@pytest.mark.parametrize("scenario", ["before", "after", "restart", "wallclock"])
@pytest.mark.parametrize("rows", [7, 20, 1 << 18])
def test_steps_as_read_chunk_by_chunk_equal_the_tables_parts(scenario: str, rows: int) -> None:
    """The steps from the lines as read, a stored chunk at a time (a task's lines across
    chunks), are those of the table's parts in task order; where a task's time goes back (the
    table sorts its lines by time) they are not made, and the table's parts count them."""
    import numpy as np

    from slotscope.analyze import prefill_speed as ps

    ds = load([REAL / scenario / "logs"])
    read = ds.server.on_disk("prefill_samples")
    assert read is not None
    want = ps._steps(replace(ds, server=replace(ds.server, prefill_samples=read.table().copy())))
    read.unload()
    lazy = _rechunked(read, rows)
    assert rows > 7 or len(lazy.parts[0].store._chunks) > 3
    got = ps._steps_as_read(lazy)
    pd.testing.assert_frame_equal(got, want)

    def back(cols: dict) -> None:  # a task's second line before its first
        ids, lines = np.unique(cols["task"], return_counts=True)
        same = np.flatnonzero(cols["task"] == ids[lines.argmax()])
        cols["ts_us"][same[1]] = cols["ts_us"][same[0]] - 1

    lazy = _rechunked(read, rows, back)
    assert ps._steps_as_read(lazy) is None
    ds.server.__dict__["_prefill_samples"] = lazy
    want = ps._steps(replace(ds, server=replace(ds.server, prefill_samples=lazy.table().copy())))
    pd.testing.assert_frame_equal(ps._steps(ds), want)
