"""prefill-speed: how fast does a prefill go per batch pass, and how big is a pass (n_batch)?"""

from __future__ import annotations

import re
from dataclasses import replace
import statistics

import pandas as pd
import pytest

from slotscope.analyze import TABLES, Options
from slotscope.analyze.prefill_speed import LABELS, effective_chunk_tokens
from slotscope.dataset import load

from .conftest import REAL

prefill_speed = TABLES["prefill-speed"]

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


def test_a_2048_batch_prefills_in_full_chunks_a_512_one_in_small_ones(datasets: dict) -> None:
    """`before` ran -b 2048, `after` -b 512: the same prompts go through in passes of ~2048
    tokens there, of ~509 here (three slots generating take a token each), each at about the
    solo prefill speed; the smaller passes only cost a little speed each."""
    before = prefill_speed(datasets["before"], Options()).set_index("step_tokens")
    after = prefill_speed(datasets["after"], Options()).set_index("step_tokens")
    assert before["steps"].idxmax() == "1500-2100" and after["steps"].idxmax() == "256-600"
    assert before.loc["1500-2100", "median_step_tokens"] == 2047 and after.loc["256-600", "median_step_tokens"] == 509
    assert after.loc["256-600", "median_tps"] < before.loc["1500-2100", "median_tps"] < 1.1 * after.loc["256-600", "median_tps"]
    assert before["effective_chunk_tokens"].iloc[0] == 2048 and after["effective_chunk_tokens"].iloc[0] == 511


@pytest.mark.parametrize("scenario", ["before", "after", "restart"])
@pytest.mark.parametrize("part_tasks", [2, 5])
def test_the_steps_do_not_depend_on_how_the_busy_periods_are_cut(scenario: str, part_tasks: int) -> None:
    """A task prefilling across a cut is in both pieces; each of its progress lines counts once."""
    from slotscope import analyze
    from slotscope.analyze.prefill_speed import QUESTION

    ds = load([REAL / scenario / "logs"])
    assert sum(p.span is not None for p in ds.parts(part_tasks)) > 3  # (the periods were cut)
    whole = analyze.answer([QUESTION], ds, Options())["prefill-speed"]
    assert whole["steps"].sum() > 0
    pd.testing.assert_frame_equal(analyze.answer([QUESTION], ds, Options(), part_tasks=part_tasks)["prefill-speed"],
                                  whole, check_exact=True)
