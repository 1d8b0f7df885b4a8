"""turns: call duration and time to first token per purpose, checked against the app log and the client's truth."""

from __future__ import annotations

import json
import statistics
from collections import Counter

import pandas as pd
import pytest

from slotscope.analyze import Options
from slotscope.analyze.turns import NEEDS_APP_LOG, is_chat_turn, turns
from slotscope.dataset import load

from .conftest import REAL, load_truth


def _app(scenario: str) -> list[dict]:
    return [json.loads(line) for line in (REAL / scenario / "logs" / "app.jsonl").read_text().splitlines() if line.strip()]


def _ok(rec: dict) -> bool:
    return rec["status"] == 200 and rec["error"] is None


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    return {s: turns(load([REAL / s / "logs"]), Options()) for s in ("before", "after", "restart")}


def _purpose_rows(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["by"] == "purpose"].set_index("group")


@pytest.mark.parametrize("scenario", ["before", "after", "restart"])
def test_counts_are_the_successful_calls_per_purpose(tables: dict[str, pd.DataFrame], scenario: str) -> None:
    expected = Counter(r["purpose"] for r in _app(scenario) if _ok(r))
    got = _purpose_rows(tables[scenario])["count"].to_dict()
    assert got == dict(expected)


@pytest.mark.parametrize("scenario", ["before", "after"])
def test_ttft_medians_agree_with_the_client(tables: dict[str, pd.DataFrame], scenario: str) -> None:
    by_purpose: dict[str, list[float]] = {}
    for r in load_truth(scenario):
        if r["status"] == 200 and r["error"] is None:
            by_purpose.setdefault(r["purpose"], []).append(r["first_token_ms"] / 1000)
    rows = _purpose_rows(tables[scenario])
    for purpose, values in by_purpose.items():
        assert rows.loc[purpose, "ttft_count"] == len(values)
        assert rows.loc[purpose, "ttft_median_s"] == pytest.approx(statistics.median(values), rel=0.05), purpose


def test_total_max_is_the_longest_call(tables: dict[str, pd.DataFrame]) -> None:
    longest: dict[str, float] = {}
    for r in _app("before"):
        longest[r["purpose"]] = max(longest.get(r["purpose"], 0.0), r["duration_ms"] / 1000)
    rows = _purpose_rows(tables["before"])
    assert rows["total_max_s"].to_dict() == pytest.approx(longest, abs=0.001)


def test_chat_subsets_follow_the_app_counts(tables: dict[str, pd.DataFrame]) -> None:
    chat = [r for r in _app("before") if _ok(r) and (r["purpose"] == "chat" or r["purpose"].startswith("chat_"))]
    rows = tables["before"][tables["before"]["by"] == "chat turns"].set_index("group")["count"]
    assert rows["all"] == len(chat) == 37
    assert rows["cache rate >= 95%"] == sum(r["cached_tokens"] >= 0.95 * r["prompt_tokens"] for r in chat)
    assert rows[">= 5,000 new tokens"] == sum(r["prompt_tokens"] - r["cached_tokens"] >= 5000 for r in chat) == 8


def test_subset_thresholds_are_options() -> None:
    table = turns(load([REAL / "before" / "logs"]), Options(cache_rate=0.8, uncached_tokens=10_000))
    groups = set(table.loc[table["by"] == "chat turns", "group"])
    assert groups == {"all", "cache rate >= 80%", ">= 10,000 new tokens"}
    chat = [r for r in _app("before") if r["purpose"].startswith("chat")]
    n = table.set_index("group").loc[">= 10,000 new tokens", "count"]
    assert n == sum(r["prompt_tokens"] - r["cached_tokens"] >= 10_000 for r in chat)


def test_failed_call_is_left_out_and_said_so(tables: dict[str, pd.DataFrame]) -> None:
    table = tables["restart"]
    left = table[table["by"] == "left out"]
    assert left["group"].tolist() == ["call failed"]
    assert left["count"].tolist() == [sum(not _ok(r) for r in _app("restart"))] == [1]
    assert left["total_median_s"].isna().all()
    assert "failed" in left["note"].iloc[0]
    # The two counts add up to every call in the app log.
    assert table.loc[table["by"] == "purpose", "count"].sum() + left["count"].sum() == len(_app("restart"))


def test_few_samples_marks_small_groups(tables: dict[str, pd.DataFrame]) -> None:
    table = tables["before"]
    assert (table["few_samples"] == (table["count"] < Options().min_samples)).all()


def test_without_app_log_only_the_note() -> None:
    table = turns(load([REAL / "before" / "logs" / "llama-server.log"]), Options())
    assert table["note"].tolist() == [NEEDS_APP_LOG]
    assert table.drop(columns="note").isna().all().all()


def test_chat_turns_are_chat_and_chat_underscore() -> None:
    purposes = pd.Series(["chat", "chat_first_of_day", "chatter", "summary", None], dtype="string")
    assert is_chat_turn(purposes).tolist() == [True, True, False, False, False]


def _turns_by_texts(calls: pd.DataFrame, opts: Options) -> pd.DataFrame:
    """The turns table as it was made on each call's purpose as text (before it was made on
    the purposes' codes), for the comparison below."""
    import numpy as np

    from slotscope.analyze.turns import _stats, measured_calls

    ok = measured_calls(calls)
    used = calls.loc[ok]
    total = used["total_ms"].to_numpy(dtype="float64", na_value=np.nan) / 1000
    ttft = used["ttft_ms"].to_numpy(dtype="float64", na_value=np.nan) / 1000
    purpose = used["purpose"].astype("string").fillna("(no purpose)")
    subsets = [("purpose", p, total[m], ttft[m]) for p in purpose.value_counts(sort=True).index
               for m in [(purpose == p).to_numpy(dtype=bool)]]
    chat = is_chat_turn(used["purpose"].astype("string")).to_numpy()
    cached = used["prompt_tokens_cached"].astype("float64").to_numpy(na_value=np.nan)
    new = used["prompt_tokens_new"].astype("float64").to_numpy(na_value=np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = cached / np.where(cached + new > 0, cached + new, np.nan)
    for label, m in (("all", chat), (f"cache rate >= {opts.cache_rate:.0%}", chat & (rate >= opts.cache_rate)),
                     (f">= {opts.uncached_tokens:,} new tokens", chat & (new >= opts.uncached_tokens))):
        subsets.append(("chat turns", label, total[m], ttft[m]))
    table = _stats(subsets, opts.min_samples)
    table.loc[(table["by"] == "chat turns") & (table["group"] == "all"), "note"] = "purposes chat and chat_*"
    left = calls.loc[~ok]
    if len(left):
        failed = ~left["ok"].fillna(False).astype(bool).to_numpy()
        method = left["match_method"].astype("string").fillna("unmatched").to_numpy()
        rows = pd.DataFrame({
            "group": np.where(failed, "call failed", "no server task matched"),
            "note": np.where(failed, "not in the times above: the app log marks the call failed",
                             np.char.add("not in the times above: ", method.astype(str))),
        }).groupby(["group", "note"], sort=True, observed=True).size().rename("count").reset_index()
        table = pd.concat([table, rows.assign(by="left out", ttft_count=0, few_samples=False)], ignore_index=True)
    return table[table.columns]


@pytest.mark.parametrize("case", ["as read", "many purposes, tied", "missing and '(no purpose)'", "texts", "none measured"])
def test_purposes_by_code_as_by_text(case: str) -> None:
    """The purposes counted by their category codes give the table the per-call texts gave:
    with the counts tied among more purposes than an insertion sort orders (their order is the
    texts' sort's), missing purposes next to a purpose named "(no purpose)", purposes as
    plain text, and no call measured."""
    import numpy as np

    ds = load([REAL / "restart" / "logs"])
    calls = ds.matches.calls.copy()
    rng = np.random.default_rng(5)
    n = len(calls)
    if case == "many purposes, tied":  # 40 purposes, ~8 calls each (ties everywhere)
        calls = pd.concat([calls] * 8, ignore_index=True)
        n = len(calls)
        names = np.array([f"p{i:02d}" for i in range(38)] + ["chat_x", "chat"], dtype=object)
        calls["purpose"] = pd.Categorical(names[rng.integers(0, len(names), n)], categories=sorted(names, reverse=True))
    elif case == "missing and '(no purpose)'":
        p = calls["purpose"].astype("object")
        p[rng.random(n) < 0.2] = None
        p[rng.random(n) < 0.1] = "(no purpose)"
        calls["purpose"] = p.astype("category")
    elif case == "texts":
        p = calls["purpose"].astype("string")
        p[rng.random(n) < 0.2] = pd.NA
        calls["purpose"] = p
    elif case == "none measured":
        calls["ok"] = False
    ds.matches.calls = calls
    pd.testing.assert_frame_equal(turns(ds, Options()), _turns_by_texts(calls, Options()))
