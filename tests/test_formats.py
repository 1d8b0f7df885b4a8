"""Every framing of llama-server lines (wrappers, colours, older builds) reads to the same tasks.

The variants in fixtures/formats were derived from real b11434 lines by fixtures/make_variants.py;
its manifest says what a correct parser must find in each.
"""

from __future__ import annotations

import json
import re
from datetime import datetime

import pandas as pd
import pytest

from slotscope.server_log import read_server_logs

from .conftest import FORMATS

MANIFEST = json.loads((FORMATS / "manifest.json").read_text())["variants"]


def _paths(spec: dict) -> list[str]:
    return [str(FORMATS / f) for f in spec["files"]]


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_variant_reads_every_task(name: str) -> None:
    spec = MANIFEST[name]
    logs = read_server_logs(_paths(spec))
    acc = logs.accounting
    assert acc.lines == spec["physical_lines"]
    assert acc.unrecognized == spec["unrecognized_lines"], acc.examples()
    assert acc.used + acc.ignored + acc.unrecognized == acc.lines
    tasks = logs.tasks
    assert len(tasks) == spec["tasks_launched"]
    for want in spec["complete_tasks"]:
        sel = tasks["task_id"] == want["task_id"]
        if "port" in want:
            sel &= tasks["port"] == want["port"]
        got = tasks[sel]
        assert len(got) == 1, want
        row = got.iloc[0]
        assert row["status"] == "complete"
        assert row["prompt_tokens_new"] == want["prompt_eval_tokens"]
        assert row["n_gen"] == want["n_gen"]
        assert row["prompt_eval_ms"] == pytest.approx(want["prompt_eval_ms"], abs=0.005)
        assert row["eval_ms"] == pytest.approx(want["eval_ms"], abs=0.005)
    if spec.get("first_launch_wall_iso"):
        want_at = pd.Timestamp(datetime.fromisoformat(spec["first_launch_wall_iso"]))
        first = tasks.sort_values("launch_at").iloc[0]["launch_at"]
        assert abs((first - want_at).total_seconds()) < 0.001
    if spec.get("ports"):
        assert sorted(tasks["port"].unique().tolist()) == spec["ports"]
    # Each session's model: the `loading model` line its start-up has in this framing (if kept).
    raw = b"".join((FORMATS / f).read_bytes() for f in spec["files"] if not f.endswith((".gz", ".zst")))
    named = sorted(set(re.findall(rb"loading model '([^'\\\"]*)'", raw)))
    if named and len(logs.sessions):  # (no sessions where no line has a time)
        assert sorted(set(logs.sessions["model"].dropna())) == [n.decode() for n in named]
        assert logs.sessions["model"].notna().all()


def test_garbage_lines_are_named_with_their_line_numbers() -> None:
    spec = MANIFEST["garbage"]
    acc = read_server_logs(_paths(spec)).accounting
    lines = {line for f in acc.files for line, _text in f.examples}
    assert set(int(k) for k in spec["junk_line_kinds"]) <= lines
    assert spec["final_partial_line"] in lines


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_variant_reads_the_same_in_small_blocks_and_worker_processes(name: str) -> None:
    """Blocks folded on their own (by workers, or here) and joined in order give the tables of
    one whole read, for every framing: wall-clock-only times, multi-line timing blocks cut
    between blocks, several ports, restarts."""
    paths = _paths(MANIFEST[name])
    whole = read_server_logs(paths, chunk_size=1 << 30, jobs=1)
    for jobs in (1, 2):
        got = read_server_logs(paths, chunk_size=700, jobs=jobs)
        for table in ("tasks", "gen_samples", "prefill_samples", "sessions"):
            pd.testing.assert_frame_equal(getattr(got, table), getattr(whole, table), check_exact=True, obj=table)
        assert [(f.lines, f.used, f.ignored, f.unrecognized, f.examples) for f in got.accounting.files] == [
            (f.lines, f.used, f.ignored, f.unrecognized, f.examples) for f in whole.accounting.files]
