"""prefills: the big prefills by purpose and by cause, checked against the client's record of each call."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from slotscope.analyze import Options
from slotscope.analyze.prefills import CAUSES, call_causes, prefills
from slotscope.analyze.turns import NEEDS_APP_LOG
from slotscope.dataset import load

from .conftest import REAL, load_truth
from .test_analyze_cache import app_records, app_variant


@pytest.fixture(scope="module")
def datasets() -> dict:
    return {s: load([REAL / s / "logs"]) for s in ("before", "after", "restart")}


def _big(scenario: str, threshold: int = 5000) -> list[dict]:
    return [r for r in load_truth(scenario) if r["timings"] and r["timings"]["prompt_n"] >= threshold]


@pytest.mark.parametrize("scenario", ["before", "after"])
def test_every_big_prefill_is_counted_once_per_view(datasets: dict, scenario: str) -> None:
    table = prefills(datasets[scenario], Options())
    big = _big(scenario)
    total = table[table["by"] == "all"].iloc[0]
    assert total["count"] == len(big)
    assert total["new_tokens_total"] == sum(r["timings"]["prompt_n"] for r in big)
    assert total["seconds_total"] == pytest.approx(sum(r["timings"]["prompt_ms"] for r in big) / 1000, abs=0.01)
    for by in ("purpose", "cause"):
        rows = table[table["by"] == by]
        assert rows["count"].sum() == total["count"]
        assert rows["new_tokens_total"].sum() == total["new_tokens_total"]
    purposes = table[table["by"] == "purpose"].set_index("value")["count"].to_dict()
    assert purposes == {p: sum(r["purpose"] == p for r in big) for p in {r["purpose"] for r in big}}


def test_before_causes(datasets: dict) -> None:
    table = prefills(datasets["before"], Options())
    causes = table[table["by"] == "cause"].set_index("value")["count"]
    assert list(causes.index) == CAUSES  # every cause has its row, zeros included
    # u03 and u00 open the log with their long first-of-day turns; u04 and u01 return later.
    assert causes["first_of_day"] == 2
    assert causes["first_of_session"] == 2
    assert causes["summary"] == sum(r["purpose"] == "summary" for r in _big("before")) == 3
    # The folded prompt after a summary is short here (persona + summary + last exchange).
    assert causes["after_summary"] == 0
    assert causes["cache_miss"] == 4
    assert causes["other"] == 0


def test_no_cache_miss_prefills_with_one_lora_setting(datasets: dict) -> None:
    table = prefills(datasets["after"], Options())
    assert table.set_index(["by", "value"]).loc[("cause", "cache_miss"), "count"] == 0


def test_causes_of_calls(datasets: dict) -> None:
    calls = datasets["before"].matches.calls
    cause = pd.Series(call_causes(calls, Options()).to_numpy(), index=calls["call_id"].to_numpy())
    assert len(cause) == len(calls)
    first = calls.sort_values("start_at").groupby("user", observed=True)["call_id"].first()
    assert set(cause[cause == "first_of_day"].index) == set(first)
    # After each summary, that user's next call.
    app = app_records("before")
    after = set()
    for i, r in enumerate(app):
        if r["purpose"] == "summary":
            nxt = [x for x in app[i + 1:] if x["user"] == r["user"]]
            if nxt:
                after.add(nxt[0]["id"])
    assert set(cause[cause == "after_summary"].index) == after
    assert {calls.set_index("call_id").loc[c, "purpose"] for c in after} == {"chat_after_summary"}
    # u04's and u01's returns later in the day, in new app sessions.
    assert set(cause[cause == "first_of_session"].index) == {"c-00037", "c-00045", "c-00024", "c-00039"}


def test_a_return_without_app_sessions_counts_as_a_cache_miss(tmp_path: Path) -> None:
    """An app log that names no sessions: u04's and u01's long first turns of a resumed
    conversation are consecutive turns that missed the cache, and the table says why no
    prefill is first of a session."""
    ds = app_variant(tmp_path, "before", lambda recs: [{k: v for k, v in r.items() if k != "session"} for r in recs])
    causes = prefills(ds, Options()).query("by == 'cause'").set_index("value")
    assert causes.loc["first_of_session", ["count", "note"]].tolist() == [0, "the app log names no sessions"]
    assert causes.loc["cache_miss", "count"] == 4 + 2


def test_a_big_prefill_the_app_log_does_not_name_is_unlogged(tmp_path: Path) -> None:
    """u03's summary (c-00009) missing from the app log: its big prefill still counts, under
    "(unlogged)" as purpose and cause."""
    ds = app_variant(tmp_path, "before", lambda recs: [r for r in recs if r["id"] != "c-00009"])
    table = prefills(ds, Options()).set_index(["by", "value"])
    assert table.loc[("all", ">= 5,000 new tokens"), "count"] == 11
    assert table.loc[("purpose", "(unlogged)"), "count"] == table.loc[("cause", "(unlogged)"), "count"] == 1
    assert table.loc[("cause", "summary"), "count"] == 2
    assert table.index[-1] == ("cause", "(unlogged)")  # after every cause's row


def test_threshold_is_an_option(datasets: dict) -> None:
    table = prefills(datasets["restart"], Options(big_prefill_tokens=10_000))
    assert table[table["by"] == "all"]["value"].tolist() == [">= 10,000 new tokens"]
    assert table[table["by"] == "all"]["count"].tolist() == [len(_big("restart", 10_000))]


def test_without_app_log_only_the_note() -> None:
    table = prefills(load([REAL / "before" / "logs" / "llama-server.log"]), Options())
    assert table["note"].tolist() == [NEEDS_APP_LOG]
    assert isinstance(table, pd.DataFrame) and len(table) == 1


def test_call_ids_repeated_across_app_logs(tmp_path: Path) -> None:
    """Two app logs whose ids repeat (an app restarted its counter): calls are told apart by
    file and line, and the table is the one the unique ids give."""
    logs = REAL / "before" / "logs"
    lines = (logs / "app.jsonl").read_text().splitlines()
    half = len(lines) // 2
    first = lines[:half]
    second = []
    for i, line in enumerate(lines[half:]):
        rec = json.loads(line)
        rec["id"] = json.loads(first[i % half])["id"]
        second.append(json.dumps(rec))
    (tmp_path / "llama-server.log").write_bytes((logs / "llama-server.log").read_bytes())
    (tmp_path / "app-1.jsonl").write_text("\n".join(first) + "\n")
    (tmp_path / "app-2.jsonl").write_text("\n".join(second) + "\n")
    got = prefills(load([tmp_path]), Options())
    want = prefills(load([logs]), Options())
    pd.testing.assert_frame_equal(got, want)
