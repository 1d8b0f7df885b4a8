"""What wasn't the cause (the `ruled-out` table), asked of the real captures."""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from slotscope import analyze
from slotscope.dataset import Dataset, load

from .conftest import REAL


@lru_cache(maxsize=None)
def _report(scenario: str) -> tuple[Dataset, dict[str, pd.DataFrame]]:
    ds = load([REAL / scenario / "logs"])
    return ds, analyze.run(ds, names=["ruled-out", "cache", "load"], strict=True)


def _row(scenario: str, hypothesis: str) -> pd.Series:
    t = _report(scenario)[1]["ruled-out"]
    assert list(t.columns) == ["hypothesis", "figure", "samples", "verdict"]
    return t.set_index("hypothesis").loc[hypothesis]


def _busy_share(tasks: pd.DataFrame, k: int) -> float:
    """The share of the observed time with at least k tasks between launch and release, by a
    sweep over the task table itself."""
    lo, hi = tasks["launch_s"].to_numpy(float), tasks["release_s"].to_numpy(float)
    t = np.r_[lo, hi]
    step = np.r_[np.ones(len(lo)), -np.ones(len(hi))]
    order = np.lexsort((step, t))  # (a release before a launch at the same instant)
    t, running = t[order], np.cumsum(step[order])
    return float(np.sum(np.diff(t)[running[:-1] >= k]) / (t[-1] - t[0]))


@pytest.mark.parametrize("scenario", ["before", "after"])
def test_capacity_is_judged_by_the_time_every_slot_was_taken(scenario: str) -> None:
    """Was the server simply too small? The figure gives the time with all slots taken, which a
    sweep over the tasks' launch..release confirms; the verdict follows it."""
    ds, _ = _report(scenario)
    r = _row(scenario, "not enough capacity")
    slots = int(ds.server.sessions["n_slots"].max())
    m = re.search(rf"all {slots} slots taken ([\d.]+)%", r["figure"])
    assert m, r["figure"]
    assert float(m.group(1)) == pytest.approx(100 * _busy_share(ds.server.tasks, slots), abs=1)
    assert r["samples"] == len(ds.server.tasks)
    assert r["verdict"] == ("ruled out" if float(m.group(1)) < 5 else "not ruled out")


def test_slots_fought_over_in_before_but_not_after() -> None:
    """Consecutive turns of one user that found their cache gone: 9 of 26 in `before` (mixed
    LoRA settings), none of 27 in `after`. The counts are the cache table's."""
    for scenario, verdict in (("before", "not ruled out"), ("after", "ruled out")):
        r = _row(scenario, "users fighting over slots")
        every = _report(scenario)[1]["cache"].set_index("user").loc["all"]
        assert r["samples"] == every["consecutive_turns"]
        assert r["figure"].startswith(f"{every['misses']} cache misses in {every['consecutive_turns']} consecutive turns")
        assert r["verdict"] == verdict


def test_background_work_counts_the_summaries_task_time() -> None:
    """The app's summaries and unlogged tasks, against all task time: the summaries' seconds
    are those of the matched calls the app log marks `summary`."""
    ds, _ = _report("before")
    r = _row("before", "background work")
    calls = ds.matches.calls
    tasks = ds.server.tasks.merge(calls.loc[calls["task_id"].notna(), ["session", "task_id", "purpose"]], on=["session", "task_id"])
    want = float((tasks["release_s"] - tasks["launch_s"])[tasks["purpose"] == "summary"].sum())
    got = float(re.search(r"summaries took ([\d,]+) s", r["figure"]).group(1).replace(",", ""))
    assert got == pytest.approx(want, abs=1)
    assert "0 unlogged tasks" in r["figure"]


def test_without_an_app_log_the_hypotheses_it_needs_are_unknown() -> None:
    ds = load([REAL / "before" / "logs" / "llama-server.log"])
    t = analyze.run(ds, names=["ruled-out"], strict=True)["ruled-out"].set_index("hypothesis")
    assert t.loc["users fighting over slots", "verdict"] == "unknown"
    assert t.loc["background work", "verdict"] == "unknown"
    assert t.loc["not enough capacity", "verdict"] in ("ruled out", "not ruled out")


@pytest.mark.parametrize("scenario", ["before", "after"])
def test_the_findings_and_ruled_out_say_the_same_idle_share(scenario: str) -> None:
    """Both the finding and the ruled-out figure print the idle share a sweep over the tasks
    gives; before was idle a fraction of a percent, which reads as such, never "idle 0%"."""
    ds = load([REAL / scenario / "logs"])
    idle = 1 - _busy_share(ds.tasks, 1)
    said = re.search(r"idle ([0-9.]+)%", _row(scenario, "not enough capacity")["figure"])
    finding = analyze.run(ds, names=["findings"], strict=True)["findings"]["finding"]
    told = [float(m.group(1)) for m in (re.search(r"was idle ([0-9.]+)%", f) for f in finding) if m]
    assert said and told == [float(said.group(1))]
    assert told[0] == pytest.approx(100 * idle, abs=0.05 if idle < 0.01 else 0.5)
    assert told[0] > 0
