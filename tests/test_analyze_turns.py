"""turns: call duration and time to first token per purpose, checked against the app log and the client's truth."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from slotscope.analyze import Options
from slotscope.analyze.turns import NEEDS_APP_LOG, NO_PURPOSE, is_chat_turn, turns
from slotscope.dataset import load

from .conftest import REAL, load_truth
from .test_analyze_cache import app_variant


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


def test_calls_without_a_purpose_are_counted_as_such(tmp_path: Path) -> None:
    """An app that logs no purpose for its translations: they are counted under "(no
    purpose)", in the order of the counts, and are no chat turns."""
    ds = app_variant(tmp_path, "before", lambda recs: [
        {k: v for k, v in r.items() if not (k == "purpose" and v == "translation")} for r in recs])
    table = turns(ds, Options())
    rows = _purpose_rows(table)
    assert rows.index.tolist() == ["chat", NO_PURPOSE, "chat_first_of_day", "summary", "chat_after_summary"]
    assert rows.loc[NO_PURPOSE, "count"] == 5
    assert table.set_index(["by", "group"]).loc[("chat turns", "all"), "count"] == 37


def test_no_call_measured_gives_empty_rows(tmp_path: Path) -> None:
    """Every call failed: the purposes have no rows, the chat subsets say 0 and the calls are
    left out as failed."""
    ds = app_variant(tmp_path, "before", lambda recs: [dict(r, status=500) for r in recs])
    table = turns(ds, Options())
    assert table["by"].tolist() == ["chat turns"] * 3 + ["left out"]
    assert table["count"].tolist() == [0, 0, 0, 45]
    assert table["total_median_s"].isna().all()


@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_an_app_log_alone_gives_each_purposes_call_duration(scenario: str) -> None:
    """No server log: every successful call is measured by the app's own times, and the
    counts, medians and maxima are the client's (truth.jsonl: end_ms of each call). Time to
    first token and the cache subsets come from the server's tasks: empty, and said so."""
    from slotscope import analyze

    ds = load([REAL / scenario / "logs" / "app.jsonl"])
    table = analyze.run(ds, strict=True)
    assert list(table) == ["turns"]
    got = _purpose_rows(table["turns"])
    truth = [t for t in load_truth(scenario) if t["status"] == 200 and t["error"] is None]
    ends: dict[str, list[float]] = {}
    for t in truth:
        ends.setdefault(t["purpose"], []).append(t["end_ms"] / 1000)
    assert set(got.index) == set(ends)
    for purpose, values in ends.items():
        row = got.loc[purpose]
        assert row["count"] == len(values)
        assert row["total_median_s"] == pytest.approx(statistics.median(values), abs=0.002)
        assert row["total_max_s"] == pytest.approx(max(values), abs=0.002)
        assert row["ttft_count"] == 0
    chat = table["turns"][table["turns"]["by"] == "chat turns"].set_index("group")
    assert chat.loc["all", "count"] == sum(len(v) for p, v in ends.items() if p == "chat" or p.startswith("chat_"))
    assert (chat.drop(index="all")["count"] == 0).all()
    assert chat.drop(index="all")["note"].str.startswith("needs the server log").all()
    assert (got["note"] == "call duration from the app log alone; the server log adds time to first token").all()
