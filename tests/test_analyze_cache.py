"""cache / cache-misses: consecutive chat turns of one user and the ones that missed the prompt cache."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest

from slotscope.analyze import Options
from slotscope.analyze.cache import cache, cache_misses, turn_pairs
from slotscope.analyze.turns import NEEDS_APP_LOG
from slotscope.dataset import Dataset, load

from .conftest import REAL


def app_records(scenario: str) -> list[dict]:
    """The app log of a real scenario, one record per call, in start order."""
    recs = [json.loads(l) for l in (REAL / scenario / "logs" / "app.jsonl").read_text().splitlines() if l.strip()]
    return sorted(recs, key=lambda r: datetime.fromisoformat(r["start"]))


def app_variant(tmp_path: Path, scenario: str, edit: Callable[[list[dict]], list[dict]]) -> Dataset:
    """A real scenario's server log with its app log's records changed by ``edit``."""
    logs = REAL / scenario / "logs"
    (tmp_path / "llama-server.log").write_bytes((logs / "llama-server.log").read_bytes())
    (tmp_path / "app.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edit(app_records(scenario))))
    return load([tmp_path])


def _pairs_by_definition(scenario: str, window_s: float = 300.0) -> list[tuple[str, str, bool]]:
    """(call id, previous turn's id, miss) of each consecutive chat turn, recounted from the
    app log as the module docstring defines them."""
    out = []
    prev: dict[str, dict] = {}
    summary_at: dict[str, datetime] = {}
    for r in app_records(scenario):
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
    pairs = _pairs_by_definition(scenario)
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


def test_a_turn_that_moved_to_another_slot_lost_all_it_had_cached(datasets: dict) -> None:
    """In `before`, u04's second turn began 29 s after its first ended, on slot 3 where the
    first ran on slot 0: none of the 2,591 tokens the first left was reused."""
    misses = cache_misses(datasets["before"], Options()).set_index("call_id")
    row = misses.loc["c-00007"]
    assert (row["user"], row["prev_call_id"], row["slot"], row["prev_slot"]) == ("u04", "c-00004", 3, 0)
    assert (row["gap_s"], row["prev_left_tokens"], row["cached_tokens"]) == (28.637, 2591, 0)
    assert row["note"] == "other slot than the previous turn"
    assert (row["call_line"], row["prev_call_line"]) == (7, 2)  # where to read them in app.jsonl
    # u02 missed on the slot its previous turn used: the slot's cache was taken by another prompt.
    assert misses.loc["c-00018", ["slot", "prev_slot", "note"]].tolist() == [0, 0, ""]
    table = cache(datasets["before"], Options()).set_index("user")
    assert table.loc["all", "misses_on_other_slot"] == (misses["note"] != "").sum() == 5


def test_miss_rows_show_what_was_lost(datasets: dict) -> None:
    misses = cache_misses(datasets["before"], Options())
    assert (misses["cached_tokens"] < 0.5 * misses["prev_left_tokens"]).all()
    assert (misses["new_tokens"] + misses["cached_tokens"] == misses["prompt_tokens"]).all()
    assert misses["start_at"].is_monotonic_increasing
    assert ((misses["slot"] != misses["prev_slot"]) == (misses["note"] != "")).all()


def _with_ids(calls: pd.DataFrame) -> pd.DataFrame:
    """The turn pairs, with each turn's call id and the previous turn's."""
    pairs = turn_pairs(calls, Options())
    ids = calls["call_id"].to_numpy()
    return pairs.assign(call_id=ids[pairs["pos"].to_numpy()], prev_call_id=ids[pairs["prev_pos"].to_numpy()])


def test_a_summary_folds_the_history_so_the_next_turn_is_no_miss(datasets: dict) -> None:
    """u00's and u03's turns after their summaries (c-00013, c-00015) reused nothing, as
    expected: they pair with no earlier turn; the turns after them pair again."""
    pairs = _with_ids(datasets["before"].matches.calls)
    assert not {"c-00013", "c-00015"} & set(pairs["call_id"])
    assert pairs.set_index("call_id").loc[["c-00017", "c-00021"], "prev_call_id"].tolist() == ["c-00013", "c-00015"]


def test_a_new_app_session_is_a_new_conversation(datasets: dict, tmp_path: Path) -> None:
    """u02's first turn of session u02-s2 started 16 s after its last turn of u02-s1 ended:
    no pair. Without sessions in the app log the two are paired by time alone."""
    pairs = _with_ids(datasets["before"].matches.calls)
    assert "c-00024" not in set(pairs["call_id"])
    no_sessions = app_variant(tmp_path, "before", lambda recs: [{k: v for k, v in r.items() if k != "session"} for r in recs])
    pairs = _with_ids(no_sessions.matches.calls).set_index("call_id")
    assert pairs.loc["c-00024", ["prev_call_id", "gap_s"]].tolist() == ["c-00018", 16.086]


def test_window_is_an_option(datasets: dict) -> None:
    short = cache(datasets["before"], Options(cache_window_s=30.0)).set_index("user").loc["all"]
    assert short["consecutive_turns"] == len(_pairs_by_definition("before", 30.0))
    assert short["consecutive_turns"] < 26


def test_no_chat_turns_no_pairs(tmp_path: Path) -> None:
    """An app whose calls are all translations has no consecutive turns: the table says 0."""
    ds = app_variant(tmp_path, "before", lambda recs: [dict(r, purpose="translation") for r in recs])
    table = cache(ds, Options())
    assert table["user"].tolist() == ["all"]
    assert table[["consecutive_turns", "misses", "misses_on_other_slot"]].iloc[0].tolist() == [0, 0, 0]
    assert cache_misses(ds, Options()).empty


def test_without_app_log_only_the_note() -> None:
    ds = load([REAL / "before" / "logs" / "llama-server.log"])
    for fn in (cache, cache_misses):
        table = fn(ds, Options())
        assert table["note"].tolist() == [NEEDS_APP_LOG]
        assert table.drop(columns="note").isna().all().all()
