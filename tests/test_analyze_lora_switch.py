"""lora-switch: short prefills right after a LoRA change vs after the same setting, recounted task by task."""

from __future__ import annotations

import statistics

import pandas as pd
import pytest

from slotscope.analyze import TABLES, Options, answer
from slotscope.analyze.lora_switch import QUESTION
from slotscope.analyze.turns import NEEDS_APP_LOG
from slotscope.dataset import load, task_view

from .conftest import REAL, load_truth

lora_switch = TABLES["lora-switch"]


def _label(rec: dict) -> str:
    lora = rec["lora"]
    return "none" if lora is None else f"{lora['name']}@{lora['scale']}"


def _by_loops(scenario: str, ds) -> dict[str, list[float]]:
    """Prefill ms of short tasks by setting; labels from truth.jsonl, launch order from the server log."""
    label = {r["id"]: _label(r) for r in load_truth(scenario)}
    tv = task_view(ds).sort_values("launch_s")
    out: dict[str, list[float]] = {}
    prev = None
    for t in tv.to_dict("records"):
        cur = label.get(t["call_id"]) if isinstance(t["call_id"], str) else None
        if cur is not None and prev is not None and t["prompt_tokens_new"] < 1000:
            key = ("same " if cur == prev else "to ") + cur
            out.setdefault(key, []).append(t["prompt_eval_ms"])
        prev = cur
    return out


@pytest.fixture(scope="module")
def datasets() -> dict:
    return {s: load([REAL / s / "logs"]) for s in ("before", "after", "restart", "wallclock")}


@pytest.mark.parametrize("scenario", ["before", "after"])
def test_settings_counts_and_medians(datasets: dict, scenario: str) -> None:
    table = lora_switch(datasets[scenario], Options()).set_index("setting")
    expected = _by_loops(scenario, datasets[scenario])
    assert set(table.index) == set(expected)
    for setting, values in expected.items():
        assert table.loc[setting, "count"] == len(values)
        assert table.loc[setting, "prefill_median_ms"] == pytest.approx(statistics.median(values), abs=0.05)
    assert (table["alone_count"] <= table["count"]).all()


def test_before_has_both_directions_and_both_baselines(datasets: dict) -> None:
    table = lora_switch(datasets["before"], Options())
    assert table["setting"].tolist() == ["to none", "to style-a@1.0", "same none", "same style-a@1.0"]
    assert table["few_samples"].all()  # 19 short tasks in 9 minutes: a hint, not a finding


def _alone_by_loops(ds) -> dict[str, int]:
    """Short prefills per setting during which no other task held a slot (was launched and not
    yet released), task by task."""
    tv = task_view(ds).sort_values("launch_s")
    out: dict[str, int] = {}
    prev = None
    for t in tv.to_dict("records"):
        cur = t["lora"] if isinstance(t["lora"], str) else None
        if cur is not None and prev is not None and t["prompt_tokens_new"] < 1000:
            others = [u for u in tv.to_dict("records") if u["task_id"] != t["task_id"]
                      and u["launch_s"] < t["first_token_s"] and not u["release_s"] <= t["prefill_start_s"]]
            key = ("same " if cur == prev else "to ") + cur
            out[key] = out.get(key, 0) + (not others)
        prev = cur
    return out


def test_alone_is_a_prefill_while_no_other_slot_was_held(datasets: dict) -> None:
    """In `before`, 3 of the 14 short prefills right after a switch ran with the server
    otherwise idle."""
    table = lora_switch(datasets["before"], Options()).set_index("setting")
    assert table["alone_count"].to_dict() == _alone_by_loops(datasets["before"])
    assert table.loc[["to none", "to style-a@1.0"], "alone_count"].sum() == 3
    assert table["alone_prefill_median_ms"].isna().tolist() == (table["alone_count"] == 0).tolist()


@pytest.mark.parametrize("scenario", ["before", "restart", "wallclock"])
@pytest.mark.parametrize("part_tasks", [2, 3, 8])
def test_busy_periods_cut_into_small_parts_give_the_same_table(datasets: dict, scenario: str, part_tasks: int) -> None:
    """The slots held during a prefill that runs across a cut of a busy period are counted once."""
    ds = datasets[scenario]
    got = answer([QUESTION], ds, Options(), part_tasks=part_tasks)
    whole = lora_switch(ds, Options())
    pd.testing.assert_frame_equal(got["lora-switch"], whole)


def test_one_setting_has_no_switches(datasets: dict) -> None:
    table = lora_switch(datasets["after"], Options())
    assert table["setting"].tolist() == ["same none"]
    assert not table["few_samples"].iloc[0]


def test_sessions_do_not_chain_across_a_restart(datasets: dict) -> None:
    ds = datasets["restart"]
    table = lora_switch(ds, Options())
    tv = task_view(ds)
    short_known = tv[(tv["prompt_tokens_new"] < 1000) & tv["lora"].notna() & tv["prompt_eval_ms"].notna()]
    assert tv["session"].nunique() == 2
    firsts = tv.sort_values("launch_s").groupby("session").head(1)
    key = ["session", "task_id"]
    first_short = len(firsts[key].merge(short_known[key]))
    assert table["count"].sum() == len(short_known) - first_short


def test_without_app_log_only_the_note() -> None:
    table = lora_switch(load([REAL / "before" / "logs" / "llama-server.log"]), Options())
    assert table["note"].tolist() == [NEEDS_APP_LOG]
