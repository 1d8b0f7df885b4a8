"""What the analyzers do to stay linear in time and bounded in memory leaves their results alone.

Blocks (queries, segments) of any size give the same tables; the run-wide sharing of
intermediates (``Dataset.shared``) hands out private copies and forgets them afterwards; the
array helpers agree with the pandas operations they replace.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from slotscope import analyze, store
from slotscope import timeline as tl
from slotscope.analyze import Options
from slotscope.app_log import _numbers
from slotscope.dataset import Dataset, load, task_view

from .conftest import REAL


@lru_cache(maxsize=None)
def _ds(scenario: str) -> Dataset:
    return load([REAL / scenario / "logs"])


@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_tables_do_not_depend_on_block_sizes(scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _ds(scenario)
    names = ["breakdown", "stalls", "stalls-worst", "waits", "waits-worst", "context"]
    whole = analyze.run(ds, Options(), names, strict=True)
    monkeypatch.setattr(tl, "QUERY_BLOCK", 7)
    blocked = analyze.run(ds, Options(), names, strict=True)
    for name in names:
        pd.testing.assert_frame_equal(whole[name], blocked[name])
    # (run() reads each block's rows of the task view from disk; a dataset in memory, its rows)
    fresh = load([REAL / scenario / "logs"])
    assert fresh._view is None
    for name in ("stalls", "stalls-worst"):
        pd.testing.assert_frame_equal(whole[name], analyze.TABLES[name](fresh, Options()))
    assert fresh._view is None


def test_run_gives_the_tables_one_by_one_gives() -> None:
    """run() reads the columns each table needs of the tables it moved to disk; one table at a
    time reads them whole (the task view made in memory, the tasks and calls, which load
    wrote to disk, read whole)."""
    ds = load([REAL / "after" / "logs"])
    assert ds._view is None and store.stored(ds.matches, "calls") is not None
    alone = {name: analyze.TABLES[name](ds, Options()) for name in analyze.table_names() if name not in analyze.DERIVED}
    together = analyze.run(ds, Options(), strict=True)
    assert ds._view is not None and store.stored(ds.matches, "calls") is not None
    assert store.stored(ds.server, "tasks") is not None
    for name, table in together.items():
        if name in analyze.DERIVED:
            continue
        pd.testing.assert_frame_equal(alone[name], table)


def test_key_codes_follow_the_sort_order_of_the_keys_with_gaps_last() -> None:
    a = pd.DataFrame({"s": pd.Categorical(["y", "x", None], categories=["y", "x"]), "n": [2, 1, 1]})
    b = pd.DataFrame({"s": pd.Categorical(["x", "y"], categories=["y", "x"]), "n": [1, 2]})
    ca, cb = tl.key_codes([a, b], ["s", "n"])
    both = pd.concat([a, b], ignore_index=True)
    order = both.sort_values(["s", "n"], kind="stable").index.to_numpy()
    assert (np.argsort(np.r_[ca, cb], kind="stable") == order).all()
    assert ca[0] == cb[1] and ca[1] == cb[0]


@pytest.mark.parametrize("case", ["one value everywhere", "one value per frame, frames differ", "categories differ",
                                  "a gap", "text", "category and text alike", "text with a gap"])
def test_key_codes_skip_only_columns_of_one_value(case: str) -> None:
    """A column of one value adds nothing to the codes and is skipped; a column that is of one
    value in each frame but not across them, or holds a gap, still counts."""
    n = {"one value everywhere": ([7, 7, 7], [7, 7]), "one value per frame, frames differ": ([7, 7, 7], [8, 8]),
         "categories differ": (None, None), "a gap": (None, None), "text": (None, None),
         "category and text alike": (None, None), "text with a gap": (None, None)}[case]
    a = pd.DataFrame({"s": pd.Categorical(["x", "x", "x"]), "n": n[0] or [7, 7, 7], "t": [3, 1, 2]})
    b = pd.DataFrame({"s": pd.Categorical(["x", "x"]), "n": n[1] or [7, 7], "t": [2, 5]})
    if case == "categories differ":
        b["s"] = pd.Categorical(["y", "y"])
    if case == "a gap":
        b["s"] = pd.Categorical([None, None], categories=["x"])
    if case == "text":
        a["s"], b["s"] = "x", "z"
    if case == "category and text alike":  # (the tasks' source and the sessions')
        b["s"] = pd.Series(["x", "x"], dtype="string")
    if case == "text with a gap":
        a["s"], b["s"] = "x", pd.Series(["x", None], dtype="string")
    ca, cb = tl.key_codes([a, b], ["s", "n", "t"])
    both = pd.concat([a, b], ignore_index=True).astype({"s": "object"})
    ranks = both.drop_duplicates().sort_values(["s", "n", "t"], na_position="last").reset_index(drop=True)
    want = both.merge(ranks.reset_index(), on=["s", "n", "t"], how="left")["index"].to_numpy()
    assert (np.r_[ca, cb] == want).all()


def test_concurrency_steps_match_a_running_sum_of_events() -> None:
    ds = _ds("restart")
    tv = task_view(ds)
    steps = tl.concurrency(tv, ds.server.sessions)
    ends = tl.task_ends(tv, ds.server.sessions)
    for row in steps.sample(50, random_state=3).itertuples():
        same = (tv["session"] == row.session).to_numpy()
        t = row.start_s
        running = ((tv["launch_s"].to_numpy() <= t) & (ends > t) & same).sum()
        assert row.running == running


@pytest.mark.parametrize("values", [
    [1, 2, None], [1.5, None, float("nan")], [float("inf"), 1], [2**53 + 1, 3], [True, 1], ["12", 3], [None],
    [], [-0.0, 5], [float("-inf")], [" 7 ", "x"],
])
def test_numbers_are_read_as_to_numeric_reads_them(values: list) -> None:
    """As pd.to_numeric reads them, but for true and false: no number (not 1 and 0)."""
    raw = pd.Series(values, dtype=object)
    raw = raw.mask(raw.map(lambda v: isinstance(v, bool)).astype(bool), "true or false")
    want = pd.to_numeric(raw, errors="coerce").astype("float64")
    want = want.where(np.isfinite(want))
    got, bad = _numbers(values)
    pd.testing.assert_series_equal(got, want)
    assert bad.tolist() == (raw.notna() & want.isna()).tolist()


def test_samples_on_disk_give_the_tables_of_samples_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two servers (two streams of samples on disk): the parts' samples, made from the two
    streams as stored, give the tables that the sample tables in memory give."""
    import pickle

    from slotscope.server_log import Samples

    ds = load([REAL / "before" / "logs" / "llama-server.log", REAL / "after" / "logs" / "llama-server.log"])
    assert isinstance(ds.server.__dict__["_gen_samples"], Samples) and len(ds.server.__dict__["_gen_samples"].parts) == 2
    names = ["stalls", "stalls-worst", "context", "prefill-speed"]
    questions = list({id(analyze.QUESTIONS[n]): analyze.QUESTIONS[n] for n in names}.values())
    in_parts = analyze.answer(questions, ds, Options(), part_tasks=7)
    assert ds.server.on_disk("gen_samples") is not None  # (read as stored: the table was not built)
    in_memory = pickle.loads(pickle.dumps(ds))  # (pickled, the samples are tables)
    assert isinstance(in_memory.server.__dict__["_gen_samples"], pd.DataFrame)
    want = analyze.run(in_memory, Options(), names, strict=True)
    for name in names:
        pd.testing.assert_frame_equal(in_parts[name], want[name])


def test_task_ids_past_2_32_give_the_same_tables(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task id beyond 2**32 does not fit a packed task key: the analyzers give the same
    tables as with the ids 2**32 lower."""
    import re

    from slotscope.server_log import Samples

    src = (REAL / "before" / "logs" / "llama-server.log").read_text()
    big = re.sub(r"\| task (\d+) \|", lambda m: f"| task {int(m.group(1)) + 2**32} |", src)
    assert big != src
    (tmp_path / "llama-server.log").write_text(big)
    ds = load([tmp_path / "llama-server.log"])
    assert isinstance(ds.server.__dict__["_gen_samples"], Samples)
    plain = load([REAL / "before" / "logs" / "llama-server.log"])
    assert (ds.server.tasks["task_id"] - 2**32).equals(plain.server.tasks["task_id"])
    names = ["stalls", "stalls-worst", "context", "prefill-speed"]
    got, want = analyze.run(ds, Options(), names, strict=True), analyze.run(plain, Options(), names, strict=True)
    for c in ("task_id", "cause_task_id"):
        got["stalls-worst"][c] = got["stalls-worst"][c] - 2**32
    for t in (got, want):  # (where: another file)
        t["stalls-worst"] = t["stalls-worst"].drop(columns=["source", "file", "cause_file", "hb_file"])
    for name in names:
        pd.testing.assert_frame_equal(got[name], want[name])
