"""lora-switch: short prefills right after a LoRA change vs after the same setting, recounted task by task."""

from __future__ import annotations

import statistics

import pytest

from slotscope.analyze import Options
from slotscope.analyze.lora_switch import lora_switch
from slotscope.analyze.turns import NEEDS_APP_LOG
from slotscope.dataset import load, task_view

from .conftest import REAL, load_truth


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
    return {s: load([REAL / s / "logs"]) for s in ("before", "after", "restart")}


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


def _lora_switch_by_texts(ds, opts: Options):
    """The table as it was made: the task view sorted whole, the labels as text, a groupby
    shift and a groupby on (change, label). The reference for the edge cases below."""
    import pandas as pd

    from slotscope.analyze.context import SESSION, tasks_during
    from slotscope.analyze.lora_switch import COLUMNS, SHORT_PROMPT_TOKENS
    from slotscope.dataset import tasks_of

    tv = task_view(ds).sort_values(SESSION + ["launch_s", "task_id"], kind="stable").reset_index(drop=True)
    tv["lora"] = tv["lora"].astype("string")
    tv["prev_lora"] = tv.groupby(SESSION, sort=False, observed=True)["lora"].shift(1)
    tv["others"] = tasks_during(tasks_of(ds, SESSION + ["launch_s", "release_s"]), tv, "prefill_start_s", "first_token_s") - 1
    short = (tv["prompt_tokens_new"] < SHORT_PROMPT_TOKENS).fillna(False) & tv["prompt_eval_ms"].notna()
    t = tv.loc[(short & tv["lora"].notna() & tv["prev_lora"].notna()).to_numpy()].copy()
    t["change"] = (t["lora"] != t["prev_lora"]).map({True: "to", False: "same"})
    t["alone_ms"] = t["prompt_eval_ms"].where(t["others"] <= 0)
    g = t.groupby(["change", "lora"], sort=True, observed=True)
    table = pd.DataFrame({"count": g["prompt_eval_ms"].count(), "prefill_median_ms": g["prompt_eval_ms"].median(),
                          "alone_count": g["alone_ms"].count(), "alone_prefill_median_ms": g["alone_ms"].median()}).reset_index()
    table = table.sort_values(["change", "lora"], ascending=[False, True], kind="stable").reset_index(drop=True)
    table["setting"] = table["change"] + " " + table["lora"]
    table[["count", "alone_count"]] = table[["count", "alone_count"]].astype("int64")
    table[["prefill_median_ms", "alone_prefill_median_ms"]] = table[["prefill_median_ms", "alone_prefill_median_ms"]].round(1)
    table["few_samples"] = table["count"] < opts.min_samples
    return table[COLUMNS]


@pytest.mark.parametrize("case", ["labels shuffled", "labels as text", "launch ties and gaps", "no known label"])
@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_on_codes_as_on_texts(scenario: str, case: str) -> None:
    """Sorted, shifted and grouped on integer codes, the table is the one the texts gave: with
    labels shuffled among four (some missing, categories out of text order), labels as plain
    text, tasks launched at one time or with no launch time, and no task with both labels."""
    import numpy as np
    import pandas as pd

    ds = load([REAL / scenario / "logs"])
    calls, tasks = ds.matches.calls.copy(), ds.server.tasks.copy()
    rng = np.random.default_rng(len(case))
    n = len(calls)
    names = np.array(["none", "style-a@1.0", "Style-b@0.5", "ä@1"], dtype=object)
    lora = pd.Series(names[rng.integers(0, len(names), n)], dtype=object)
    lora[rng.random(n) < 0.15] = None
    if case == "labels shuffled":
        calls["lora"] = pd.Categorical(lora, categories=["ä@1", "none", "Style-b@0.5", "style-a@1.0"])
    elif case == "labels as text":
        calls["lora"] = lora.astype("string")
    elif case == "launch ties and gaps":
        calls["lora"] = lora.astype("category")
        tasks = tasks.sample(frac=1, random_state=1).reset_index(drop=True)  # (ties: by task id, not row)
        tasks["launch_s"] = tasks["launch_s"].round(-1)
        tasks.loc[rng.random(len(tasks)) < 0.1, "launch_s"] = np.nan
    else:
        calls["lora"] = pd.Categorical([None] * n, categories=["none"])
    ds.matches.calls, ds.server.tasks = calls, tasks
    pd.testing.assert_frame_equal(lora_switch(ds, Options()), _lora_switch_by_texts(ds, Options()))


@pytest.mark.parametrize("scenario", ["before", "restart"])
@pytest.mark.parametrize("rows", [7, 1 << 16])
def test_slots_held_counted_a_part_of_the_tasks_at_a_time_equal_the_counts_of_all(
        scenario: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """_holding_during, the tasks read in parts of ``rows`` (several sessions, windows with gaps,
    tasks never released, a window in no known session), counts what TasksDuring of every
    task counts."""
    import numpy as np
    import pandas as pd

    from slotscope import store, timeline as tl
    from slotscope.analyze import lora_switch as ls
    from slotscope.analyze.context import SESSION, TasksDuring
    from slotscope.dataset import tasks_of

    monkeypatch.setattr(store, "ROWS_PER_BATCH", 5)
    monkeypatch.setattr(ls, "TASK_ROWS", rows)
    ds = load([REAL / scenario / "logs"])
    ds.keep_on_disk()
    tasks = tasks_of(ds, SESSION + ["launch_s", "release_s"])
    assert len(tasks) > 3 * 7 and (rows > 7 or tasks["session"].nunique() > 1 or scenario == "before")
    rng = np.random.default_rng(0)
    at = tasks[SESSION].sample(200, replace=True, random_state=1).reset_index(drop=True)
    lo, hi = float(tasks["launch_s"].min()), float(tasks["release_s"].max())
    at["a"] = rng.uniform(lo - 5, hi + 5, len(at))
    at["b"] = at["a"] + rng.exponential(20, len(at))
    at.loc[at.index[::17], "a"] = np.nan
    at.loc[at.index[::23], "b"] = np.nan
    at.loc[at.index[5], "port"] = 1  # (a session with no task)
    want = TasksDuring(tasks).count(at, "a", "b")
    code = tl.key_codes([at], SESSION)[0]  # (each window's session: a row of sessions)
    sessions = at[SESSION].iloc[np.unique(code, return_index=True)[1]].reset_index(drop=True)
    code = np.where(at[SESSION].notna().all(axis=1).to_numpy(), code, -1)
    got = ls._holding_during(ds, sessions, code, at["a"].to_numpy(), at["b"].to_numpy())
    assert (want > 1).any()
    np.testing.assert_array_equal(got, want)
    pd.testing.assert_frame_equal(lora_switch(ds, Options()), lora_switch(load([REAL / scenario / "logs"]), Options()))
