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
    by_key = call_causes(calls, Options())
    assert len(by_key) == len(calls) and by_key.index.is_unique
    ids = pd.Series(calls["call_id"].to_numpy(),
                    index=pd.MultiIndex.from_arrays([calls["call_file"].astype("string"), calls["call_line"].astype("Int64")]))
    cause = pd.Series(by_key.to_numpy(), index=ids.loc[by_key.index].to_numpy())
    first = calls.sort_values("start_at").groupby("user", observed=True)["call_id"].first()
    assert set(cause[cause == "first_of_day"].index) == set(first)
    # After each summary, that user's next call.
    app = [json.loads(l) for l in (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()]
    app.sort(key=lambda r: r["start"])
    after = set()
    for i, r in enumerate(app):
        if r["purpose"] == "summary":
            nxt = [x for x in app[i + 1:] if x["user"] == r["user"]]
            if nxt:
                after.add(nxt[0]["id"])
    assert set(cause[cause == "after_summary"].index) == after
    assert {calls.set_index("call_id").loc[c, "purpose"] for c in after} == {"chat_after_summary"}


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


def _causes_by_sort_and_groupby(calls: pd.DataFrame, missed: set) -> list:
    """The causes as sort_values and groupby give them (the code before the integer rewrite):
    the reference for the edge cases the real logs lack."""
    import numpy as np

    c = calls[["user", "start_at", "purpose"]].copy()
    c["pos"] = np.arange(len(c))
    c["user"] = c["user"].astype("string")
    c["session"] = calls["app_session"].astype("string")
    c = c.sort_values(["user", "start_at"], kind="stable")
    day = c["start_at"].dt.tz_convert("UTC").dt.floor("D")
    first_of_day = c.groupby([c["user"], day], sort=False, dropna=False, observed=True).cumcount() == 0
    first_of_session = c["session"].notna() & (c.groupby([c["user"], c["session"]], sort=False, dropna=False, observed=True).cumcount() == 0)
    prev = c.groupby("user", sort=False, dropna=False, observed=True)["purpose"].shift(1).astype("string")
    after_summary = (prev == "summary").fillna(False)
    summary = (c["purpose"].astype("string") == "summary").fillna(False)
    miss = c["pos"].isin(list(missed))
    cause = np.select([first_of_day, first_of_session, summary, after_summary, miss], CAUSES[:-1], default=CAUSES[-1])
    return list(zip(c["pos"].to_numpy().tolist(), cause.tolist()))


@pytest.mark.parametrize("sessions", [4, 1000])
@pytest.mark.parametrize("users", ["categories", "texts"])
def test_causes_on_integer_codes_equal_a_sort_and_groupby(datasets: dict, users: str, sessions: int) -> None:
    """On the real calls made harder (users missing or out of category order, calls with no
    start time, sessions named and missing, a midnight crossed), each call's cause is what a
    sort by user and start and groupbys give; with few sessions (the users' first calls of
    each found in a table of the pairs) and with more than calls (found by a sort)."""
    import numpy as np

    from slotscope.analyze.cache import slim_calls, turn_pairs
    from slotscope.analyze.prefills import _sorted_causes

    calls = datasets["before"].matches.calls.copy()
    rng = np.random.default_rng(11)
    n = len(calls)
    names = np.array(["zoe", "Émile", "bob", "alice10", "alice9"], dtype=object)
    user = pd.Series(names[rng.integers(0, len(names), n)], dtype="object")
    user[rng.random(n) < 0.1] = None
    calls["user"] = pd.Categorical(user, categories=["zoe", "bob", "Émile", "alice9", "alice10"]) if users == "categories" \
        else user.astype("string")
    calls["app_session"] = pd.Categorical(np.where(rng.random(n) < 0.3, None, rng.integers(0, sessions, n).astype(str)))
    calls["start_at"] = calls["start_at"] + pd.to_timedelta(rng.integers(0, 3, n) * 10, unit="h")  # some past midnight
    calls.loc[rng.random(n) < 0.05, "start_at"] = pd.NaT
    calls["purpose"] = calls["purpose"].astype("string")
    calls.loc[rng.random(n) < 0.2, "purpose"] = "summary"
    calls.loc[rng.random(n) < 0.05, "purpose"] = None
    pairs = turn_pairs(slim_calls(calls.dropna(subset=["start_at"])), Options())
    order, cause = _sorted_causes(calls, Options(), pairs)
    missed_rows = {int(i) for i in np.flatnonzero(calls["call_line"].isin(pairs.loc[pairs["miss"], "call_line"]).to_numpy())}
    got = list(zip(order.tolist(), np.asarray(CAUSES, dtype=object)[cause].tolist()))
    assert got == _causes_by_sort_and_groupby(calls, missed_rows)
    assert {c for _, c in got} >= {"first_of_day", "first_of_session", "summary", "after_summary"}


def _prefills_by_texts(ds, opts: Options) -> pd.DataFrame:
    """The prefills table as it was made: each big prefill's cause and purpose as text, the
    calls found by key codes of (file, line), groupbys on the texts; the turn pairs by the sort
    and as-of merge. The reference for the edge cases the real logs lack."""
    import numpy as np

    from slotscope import timeline as tl
    from slotscope.analyze.cache import slim_calls
    from slotscope.analyze.prefills import UNLOGGED, _sorted_causes
    from slotscope.dataset import task_view

    from .test_analyze_cache import _pairs_by_sort_and_merge

    def rows_in(calls: pd.DataFrame, rows: pd.DataFrame) -> np.ndarray:
        ccode, rcode = tl.key_codes([calls[["call_file", "call_line"]], rows[["call_file", "call_line"]]], ["call_file", "call_line"])
        found = tl.by_code(ccode, np.arange(len(ccode), dtype=np.int64), rcode, -1)
        return np.where(rows["call_file"].isna().to_numpy() | rows["call_line"].isna().to_numpy(), -1, found)

    tv = task_view(ds)
    big = tv.loc[(tv["prompt_tokens_new"] >= opts.big_prefill_tokens).fillna(False).to_numpy(),
                 ["task_id", "purpose", "prompt_tokens_new", "prompt_eval_ms", "call_file", "call_line"]]
    calls = ds.matches.calls
    order, cause = _sorted_causes(calls, opts, _pairs_by_sort_and_merge(slim_calls(calls), opts))
    by_row = np.empty(len(calls), dtype=np.int8)
    by_row[order] = cause
    at = rows_in(calls, big)
    names = np.asarray(CAUSES + [None], dtype=object)
    big["cause"] = pd.array(names[np.where(at >= 0, by_row[np.maximum(at, 0)], -1)], dtype="string").fillna(UNLOGGED)
    big["purpose"] = big["purpose"].astype("string").fillna(UNLOGGED)
    label = f">= {opts.big_prefill_tokens:,} new tokens"
    big["all"] = label
    big["seconds"] = big["prompt_eval_ms"] / 1000
    rows = {"all": [label], "cause": CAUSES + ([UNLOGGED] if (big["cause"] == UNLOGGED).any() else [])}
    parts = []
    for by in ("all", "purpose", "cause"):
        g = big.groupby(by, sort=False, observed=True).agg(
            count=("task_id", "size"), new_tokens_total=("prompt_tokens_new", "sum"), seconds_total=("seconds", "sum"))
        g = g.reindex(rows[by]) if by in rows else g.sort_values("count", ascending=False, kind="stable")
        parts.append(g.rename_axis("value").reset_index().assign(by=by))
    table = pd.concat(parts, ignore_index=True)
    table["count"] = table["count"].fillna(0).astype("int64")
    table["new_tokens_total"] = table["new_tokens_total"].fillna(0).astype("int64")
    table["seconds_total"] = table["seconds_total"].astype("float64").fillna(0.0).round(3)
    table["few_samples"] = table["count"] < opts.min_samples
    table["note"] = ""
    if "app_session" not in calls or calls["app_session"].isna().all():
        table.loc[table["value"] == "first_of_session", "note"] = "the app log names no sessions"
    return table[["by", "value", "count", "new_tokens_total", "seconds_total", "few_samples", "note"]]


@pytest.mark.parametrize("case", ["as read", "purposes tied, missing, '(unlogged)'", "no big prefill", "no sessions",
                                  "lines repeated", "lines with gaps", "harder calls"])
def test_table_on_codes_equals_the_texts(case: str) -> None:
    """The table made on integer codes (causes, purposes, packed (file, line) keys) is the one
    the texts gave: purposes tied in count, missing or named "(unlogged)"; no big prefill; no
    sessions; calls sharing a (file, line) key; lines with gaps; users, sessions, summaries and
    starts shuffled."""
    import numpy as np

    from .test_analyze_cache import _harder_calls

    ds = load([REAL / "before" / "logs"])
    calls = ds.matches.calls.copy()
    rng = np.random.default_rng(3)
    n = len(calls)
    opts = Options(big_prefill_tokens=10**9 if case == "no big prefill" else 2000)
    if case.startswith("purposes"):
        names = np.array([f"p{i}" for i in range(12)] + ["(unlogged)", "chat", "summary"], dtype=object)
        purpose = pd.Series(names[rng.integers(0, len(names), n)], dtype="object")
        purpose[rng.random(n) < 0.15] = None
        calls["purpose"] = purpose.astype("category")
    elif case == "no sessions":
        calls = calls.drop(columns=["app_session"])
    elif case == "lines repeated":
        calls["call_line"] = calls["call_line"] // 3
    elif case == "lines with gaps":
        calls["call_line"] = calls["call_line"].astype("Int64").mask(pd.Series(rng.random(n) < 0.2))
    elif case == "harder calls":
        calls = _harder_calls(calls, 4)
    ds.matches.calls = calls
    pd.testing.assert_frame_equal(prefills(ds, opts), _prefills_by_texts(ds, opts))
