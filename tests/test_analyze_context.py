"""context: how fast does generation run at each context size, alone and beside other work?"""

from __future__ import annotations

import statistics

import numpy as np
import pandas as pd
import pytest

from slotscope import analyze, timeline as tl
from slotscope.analyze import TABLES, Options
from slotscope.analyze.context import LABELS, QUESTION, count_during
from slotscope.dataset import load

from .conftest import REAL

context = TABLES["context"]

EDGES = [0, 2000, 5000, 10000, 15000, float("inf")]


@pytest.fixture(scope="module")
def datasets() -> dict:
    return {s: load([REAL / s / "logs"]) for s in ("before", "wallclock")}


def _by_loops(ds) -> dict[tuple[str, str], list[float]]:
    tasks = ds.server.tasks.to_dict("records")
    out: dict[tuple[str, str], list[float]] = {}
    for hb in ds.server.gen_samples.to_dict("records"):
        if not 2.5 <= hb["window_s"] <= 4.0:
            continue
        a, b = hb["window_start_s"], hb["t_s"]
        own = [t for t in tasks if t["task_id"] == hb["task_id"] and t["session"] == hb["session"]][0]
        others = [t for t in tasks if t["session"] == hb["session"] and t["task_id"] != hb["task_id"]]
        holding = [t for t in others if t["launch_s"] < b and (pd.isna(t["release_s"]) or t["release_s"] > a)]
        prefilling = [t for t in others if t["prefill_start_s"] < b and t["first_token_s"] > a]
        ctx = own["prompt_tokens"] + hb["n_gen"]
        label = next(lab for lab, lo, hi in zip(LABELS, EDGES, EDGES[1:]) if lo <= ctx < hi)
        if not holding:
            out.setdefault(("alone", label), []).append(hb["tg_3s_tps"])
        if not prefilling:
            out.setdefault(("no_prefill", label), []).append(hb["tg_3s_tps"])
    return out


@pytest.mark.parametrize("scenario", ["before", "wallclock"])
def test_matches_a_window_by_window_count(datasets: dict, scenario: str) -> None:
    table = context(datasets[scenario], Options()).set_index(["basis", "context_tokens"])
    expected = _by_loops(datasets[scenario])
    for (basis, label), row in table.iterrows():
        values = expected.get((basis, label), [])
        assert row["samples"] == len(values), (basis, label)
        if values:
            assert row["median_tg_3s_tps"] == pytest.approx(statistics.median(values), abs=0.01)
        else:
            assert pd.isna(row["median_tg_3s_tps"])


def test_alone_is_a_subset_of_no_prefill(datasets: dict) -> None:
    table = context(datasets["before"], Options()).pivot(index="context_tokens", columns="basis", values="samples")
    assert (table["alone"] <= table["no_prefill"]).all()


def test_solo_generation_speed_is_the_readme_one(datasets: dict) -> None:
    # README: ~49 tok/s solo at short context, ~43 at 15K.
    table = context(datasets["wallclock"], Options())
    alone = table[(table["basis"] == "alone") & (table["samples"] > 0)]
    assert len(alone) >= 3
    assert alone["median_tg_3s_tps"].between(38, 52).all()
    assert (table["few_samples"] == (table["samples"] < 10)).all()


def test_needs_no_app_log(datasets: dict) -> None:
    alone = context(load([REAL / "before" / "logs" / "llama-server.log"]), Options())
    pd.testing.assert_frame_equal(alone, context(datasets["before"], Options()))


def test_count_during_counts_overlaps_per_session() -> None:
    tasks = pd.DataFrame({
        "source": "x", "port": -1, "session": [1, 1, 1, 2],
        "launch_s": [0.0, 5.0, 10.0, 0.0], "release_s": [6.0, 8.0, np.nan, 100.0],
    })
    at = pd.DataFrame({"source": "x", "port": -1, "session": [1, 1, 1, 1, 2, 3],
                       "a": [0.0, 6.0, 8.0, 20.0, 50.0, 0.0], "b": [1.0, 7.0, 9.0, 30.0, 60.0, 1.0]})
    # [0,1]: task 0. [6,7]: task 1 (task 0 released at 6). [8,9]: none. [20,30]: task 2, never released.
    tcode, acode = tl.key_codes([tasks, at], tl.GROUP)
    got = count_during(tcode, tasks["launch_s"].to_numpy(), tasks["release_s"].to_numpy(), acode, at["a"].to_numpy(), at["b"].to_numpy())
    assert got.tolist() == [1, 1, 0, 1, 1, 0]


@pytest.mark.parametrize("scenario", ["before", "restart", "wallclock"])
@pytest.mark.parametrize("part_tasks", [2, 5])
def test_the_speeds_do_not_depend_on_how_the_busy_periods_are_cut(scenario: str, part_tasks: int) -> None:
    """Parts of a few tasks cut the busy periods where windows of the tasks across the cut
    run beside tasks of the next piece; every window is counted once, beside every task."""
    ds = load([REAL / scenario / "logs"])
    spans = [p.span for p in ds.parts(part_tasks)]
    assert sum(s is not None for s in spans) > 3  # (the periods were cut)
    whole = analyze.answer([QUESTION], ds, Options())["context"]
    assert whole["samples"].sum() > 0
    pd.testing.assert_frame_equal(analyze.answer([QUESTION], ds, Options(), part_tasks=part_tasks)["context"], whole,
                                  check_exact=True)


def test_each_bucket_counts_its_windows_and_their_tasks(datasets: dict) -> None:
    """The table says how many windows and how many distinct tasks each speed rests on."""
    ds = datasets["before"]
    table = context(ds, Options()).set_index(["basis", "context_tokens"])
    hb = ds.server.gen_samples
    hb = hb[hb["window_s"].between(2.5, 4.0)].merge(ds.server.tasks[["session", "task_id", "prompt_tokens"]])
    label = pd.cut(hb["prompt_tokens"] + hb["n_gen"], EDGES, right=False, labels=LABELS)
    by_bucket = hb.groupby(label, observed=False)["task_id"]
    no_prefill = table.xs("no_prefill")
    size, tasks = (pd.Series(v.to_numpy(), index=v.index.astype(str)) for v in (by_bucket.size(), by_bucket.nunique()))
    labels = no_prefill.index.astype(str)
    assert (no_prefill["samples"].to_numpy() <= size.reindex(labels).to_numpy()).all()
    assert (no_prefill["tasks"].to_numpy() <= tasks.reindex(labels).to_numpy()).all()
    assert (table["tasks"] <= table["samples"]).all() and ((table["tasks"] > 0) == (table["samples"] > 0)).all()
    assert no_prefill.loc["15K+", "tasks"] >= 2
