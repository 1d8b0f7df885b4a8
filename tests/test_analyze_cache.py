"""cache / cache-misses: consecutive chat turns of one user, recounted straight from app.jsonl."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from slotscope.analyze import Options
from slotscope.analyze.cache import cache, cache_misses
from slotscope.analyze.turns import NEEDS_APP_LOG
from slotscope.dataset import load

from .conftest import REAL


def _app(scenario: str) -> list[dict]:
    recs = [json.loads(l) for l in (REAL / scenario / "logs" / "app.jsonl").read_text().splitlines() if l.strip()]
    return sorted(recs, key=lambda r: datetime.fromisoformat(r["start"]))


def _pairs_by_loops(scenario: str, window_s: float = 300.0) -> list[tuple[str, str, bool]]:
    """(call id, previous turn's id, miss) for each consecutive chat turn, as the module docstring defines it."""
    out = []
    prev: dict[str, dict] = {}
    summary_at: dict[str, datetime] = {}
    for r in _app(scenario):
        start = datetime.fromisoformat(r["start"])
        if r["purpose"] == "summary":
            summary_at[r["user"]] = start
        ok = r["status"] == 200 and r["error"] is None
        if not (ok and (r["purpose"] == "chat" or r["purpose"].startswith("chat_"))):
            continue
        p = prev.get(r["user"])
        if p is not None:
            gap = (start - datetime.fromisoformat(p["end"])).total_seconds()
            folded = r["user"] in summary_at and summary_at[r["user"]] > datetime.fromisoformat(p["start"])
            if gap <= window_s and p["session"] == r["session"] and not folded:
                out.append((r["id"], p["id"], r["cached_tokens"] < 0.5 * (p["prompt_tokens"] + p["completion_tokens"])))
        prev[r["user"]] = r
    return out


@pytest.fixture(scope="module")
def datasets() -> dict:
    return {s: load([REAL / s / "logs"]) for s in ("before", "after", "restart", "wallclock")}


@pytest.mark.parametrize("scenario", ["before", "after", "restart", "wallclock"])
def test_counts_follow_the_definition(datasets: dict, scenario: str) -> None:
    pairs = _pairs_by_loops(scenario)
    table = cache(datasets[scenario], Options()).set_index("user")
    assert table.loc["all", "consecutive_turns"] == len(pairs)
    assert table.loc["all", "misses"] == sum(m for _, _, m in pairs)
    assert table.drop(index="all")["consecutive_turns"].sum() == len(pairs)
    misses = cache_misses(datasets[scenario], Options())
    assert list(zip(misses["call_id"], misses["prev_call_id"])) == [(c, p) for c, p, m in pairs if m]


def test_mixed_lora_misses_single_setting_does_not(datasets: dict) -> None:
    before = cache(datasets["before"], Options()).set_index("user").loc["all"]
    after = cache(datasets["after"], Options()).set_index("user").loc["all"]
    assert (before["consecutive_turns"], before["misses"]) == (26, 9)
    assert (after["consecutive_turns"], after["misses"]) == (27, 0)
    assert before["miss_share"] == pytest.approx(9 / 26, abs=0.001)


def test_miss_rows_show_what_was_lost(datasets: dict) -> None:
    misses = cache_misses(datasets["before"], Options())
    assert (misses["cached_tokens"] < 0.5 * misses["prev_left_tokens"]).all()
    assert (misses["new_tokens"] + misses["cached_tokens"] == misses["prompt_tokens"]).all()
    assert misses["start_at"].is_monotonic_increasing
    assert ((misses["slot"] != misses["prev_slot"]) == (misses["note"] != "")).all()


def test_window_is_an_option(datasets: dict) -> None:
    short = cache(datasets["before"], Options(cache_window_s=30.0)).set_index("user").loc["all"]
    assert short["consecutive_turns"] == len(_pairs_by_loops("before", 30.0))
    assert short["consecutive_turns"] < 26


def test_without_app_log_only_the_note() -> None:
    ds = load([REAL / "before" / "logs" / "llama-server.log"])
    for fn in (cache, cache_misses):
        table = fn(ds, Options())
        assert table["note"].tolist() == [NEEDS_APP_LOG]
        assert table.drop(columns="note").isna().all().all()
