"""The stalls table against what the clients saw (truth.jsonl chunk arrival times)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from slotscope import analyze, timeline as tl
from slotscope.analyze import TABLES, Options
from slotscope.analyze import stalls as st
from slotscope.analyze.stalls import CLASSES, STALL_COLUMNS, generation_segments, segment_pieces, worst_stalls
from slotscope.dataset import Dataset, load, task_view

from .conftest import REAL, load_truth

stalls = TABLES["stalls"]


@lru_cache(maxsize=None)
def _ds(path: str) -> Dataset:
    return load([REAL / path])


@lru_cache(maxsize=None)
def _table(scenario: str) -> pd.DataFrame:
    return stalls(_ds(f"{scenario}/logs"), Options())


def _median(scenario: str, cls: str) -> float:
    t = _table(scenario)
    return float(t.loc[t["class"] == cls, "median_tg_3s_tps"].iloc[0])


def truth_stall_speed(scenario: str, long_tokens: int = 15_000) -> float:
    """research/stalls.md: for every call generating while another call prefilled >= 15K new
    tokens, the chunks that arrived during the overlap (>= 2 s) over its length; median."""
    calls = [c for c in load_truth(scenario) if c.get("timings") and c.get("first_token_ms") is not None]
    speeds = []
    for b in calls:
        if b["timings"]["prompt_n"] < long_tokens:
            continue
        p0 = b["t_send"] + b["headers_ms"] / 1000
        p1 = b["t_send"] + b["first_token_ms"] / 1000
        for a in calls:
            if a is b or not a["chunks"]:
                continue
            lo = max(a["t_send"] + a["first_token_ms"] / 1000, p0)
            hi = min(a["t_send"] + a["end_ms"] / 1000, p1)
            if hi - lo < 2:
                continue
            arrived = a["t_send"] + np.array([c[0] for c in a["chunks"]]) / 1000
            speeds.append(((arrived > lo) & (arrived <= hi)).sum() / (hi - lo))
    return float(np.median(speeds))


def test_stable_columns_and_classes() -> None:
    t = TABLES["stalls"](_ds("before/logs"), Options())
    assert list(t.columns) == STALL_COLUMNS
    assert t["class"].tolist() == CLASSES
    assert (t["few_samples"] == (t["samples"] < Options().min_samples)).all()


def test_before_long_prefill_stalls_generation() -> None:
    assert _median("before", "long_prefill") < _median("before", "alone") / 5


def test_generation_crawls_while_another_slot_prefills_a_long_prompt() -> None:
    """before (n_batch 2048): a slot generating beside another slot's prefill of 15k+ new
    tokens gets about one token per server pass, far below its speed beside generation only."""
    t = TABLES["stalls"](_ds("before/logs"), Options()).set_index("class")
    lp, go = t.loc["long_prefill"], t.loc["generation_only"]
    # Four stretches of long prefill, from four tasks: too few to state as a finding, and said so.
    assert lp["samples"] == 4 and lp["tasks"] == 4 and lp["few_samples"]
    assert go["samples"] >= 100 and not go["few_samples"]
    assert lp["median_tg_3s_tps"] < go["median_tg_3s_tps"] / 10
    assert lp["tok_per_s_pooled"] < go["tok_per_s_pooled"] / 10


def _in_parts(ds: Dataset, part_tasks: int) -> dict[str, pd.DataFrame]:
    """The stalls tables from parts of at most ``part_tasks`` tasks, every part read with its
    sessions' typical steps over the whole log (a pass of :func:`st.line_steps` first)."""
    opts = Options()
    typical = st.typical_of([st.line_steps(p, opts) for p in ds.parts(part_tasks)])
    return st.merge([st.per_part(p, opts, typical) for p in ds.parts(part_tasks)], opts, ds)


@pytest.mark.parametrize("scenario", ["before", "restart"])
def test_the_tables_do_not_depend_on_the_part_size(scenario: str) -> None:
    """Parts of 5 tasks cut the busy periods (segments then run across cuts, measured in
    each part and split in the merge); the tables equal those of the whole log."""
    ds = _ds(f"{scenario}/logs")
    assert sum(p.span is not None for p in ds.parts(5)) >= 5
    want = analyze.answer([st.QUESTION], ds, Options())
    pd.testing.assert_frame_equal(want["stalls-worst"], worst_stalls(ds, Options()))
    for n in (5, 12):
        got = _in_parts(ds, n)
        for name in ("stalls", "stalls-worst"):
            pd.testing.assert_frame_equal(got[name], want[name])


def test_parts_of_before_give_the_same_tables_by_themselves() -> None:
    """On before the parts' own typical steps are the whole log's: asked in parts of 5 tasks
    the question gives the tables of the whole log."""
    ds = _ds("before/logs")
    want = analyze.answer([st.QUESTION], ds, Options())
    got = analyze.answer([st.QUESTION], ds, Options(), part_tasks=5)
    for name in ("stalls", "stalls-worst"):
        pd.testing.assert_frame_equal(got[name], want[name])


def test_alone_is_the_solo_generation_speed() -> None:
    for scenario in ("before", "after", "b2048-unified"):
        assert 38 <= _median(scenario, "alone") <= 52


def test_after_n_batch_512_stalls_less_than_before() -> None:
    assert _median("after", "long_prefill") > _median("before", "long_prefill")
    assert _median("b2048-unified", "long_prefill") < _median("after", "long_prefill")


@pytest.mark.parametrize("scenario", ["before", "after", "b2048-unified", "restart"])
def test_long_prefill_median_agrees_with_the_clients(scenario: str) -> None:
    truth = truth_stall_speed(scenario)
    got = _median(scenario, "long_prefill")
    assert truth / 2 <= got <= truth * 2, (scenario, got, truth)


@pytest.mark.parametrize("scenario", ["before", "after", "b2048-unified"])
def test_split_pieces_count_the_tokens_the_client_received(scenario: str) -> None:
    """A segment only partly inside a long prefill gets one token per pass of the prefill there;
    the client's chunk times say how many arrived in exactly that time."""
    ds = _ds(f"{scenario}/logs")
    tv = task_view(ds)
    pieces = segment_pieces(ds, Options(), tv)
    split = pieces[(pieces["class"] == "long_prefill") & pieces["split"]]
    assert len(split) >= 3
    active = tl.prefill_steps(tv, ds.server.prefill_samples)[0]
    active = active[active["prompt_tokens_new"] >= Options().long_prefill_tokens]
    truth = {c["id"]: c for c in load_truth(scenario)}
    wall = (tv["launch_at"] - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    offset = (wall - tv["launch_s"]).groupby(tv["session"]).median()
    call_of = tv.set_index(["session", "task_id"])["call_id"]
    for p in split.itertuples():
        call = truth[call_of.loc[(p.session, p.task_id)]]
        arrived = call["t_send"] + np.array([c[0] for c in call["chunks"]]) / 1000 - offset[p.session]
        a = active[active["session"] == p.session]
        lo, hi = np.maximum(a["start_s"], p.seg_start_s), np.minimum(a["end_s"], p.seg_end_s)
        received = sum(int(((arrived > x) & (arrived <= y)).sum()) for x, y in zip(lo, hi) if y > x)
        assert abs(p.tokens - received) <= 1, (p.task_id, p.tokens, received)


def test_segments_account_for_every_generated_token() -> None:
    ds = _ds("before/logs")
    tv = task_view(ds)
    seg = generation_segments(ds, tv)
    per_task = seg.groupby("task_id")["tokens"].sum()
    expected = (tv.set_index("task_id")["n_gen"] - 1).loc[per_task.index]
    assert (per_task == expected).all()
    t = _table("before")
    assert t["tokens"].sum() == expected.sum()
    # Segments of one task do not overlap and run from its first token to its release.
    seg = seg.sort_values(["task_id", "start_s"])
    same = seg["task_id"] == seg["task_id"].shift(1)
    assert np.allclose(seg["start_s"][same], seg["end_s"].shift(1)[same])
    span = seg.groupby("task_id").agg(a=("start_s", "min"), z=("end_s", "max"))
    tasks = tv.set_index("task_id").loc[span.index]
    assert np.allclose(span["a"], tasks["first_token_s"]) and np.allclose(span["z"], tasks["release_s"])


def test_worst_stalls_name_the_long_prefill_that_caused_them() -> None:
    w = worst_stalls(_ds("before/logs"), Options())
    top = w.iloc[0]
    assert top["class"] == "long_prefill"
    assert top["tok_per_s"] < 1
    assert top["cause_prompt_tokens_new"] >= 15_000
    assert top["cause_task_id"] in {102, 1328}
    assert top["line"] != top["cause_line"]
    assert len(w) <= Options().worst


def test_works_without_app_log() -> None:
    t = stalls(_ds("before/logs/llama-server.log"), Options())
    with_app = _table("before")
    # The classes rest on server lines only.
    pd.testing.assert_frame_equal(t, with_app)
    w = worst_stalls(_ds("before/logs/llama-server.log"), Options())
    assert w["purpose"].isna().all() and w["cause_task_id"].notna().iloc[0]
