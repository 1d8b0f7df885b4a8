"""Rows that name one task or call say where to read it: the file and line of its log record.

For each real scenario, every listed row of stalls-worst, waits-worst and cache-misses is
looked up in the logs themselves: the server-log line must be the launch of the named task,
the app-log line the record of the named call.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache

import pandas as pd
import pytest

from slotscope import analyze, dataset

from .conftest import FORMATS, REAL

SCENARIOS = sorted(p.name for p in REAL.iterdir() if (p / "logs").is_dir())


@lru_cache(maxsize=None)
def _lines(path: str) -> list[str]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")


def _heartbeat_of(file: str, line: int, task_id: int) -> bool:
    text = _lines(file)[line - 1]
    return "n_gen =" in text and f"| task {task_id} |" in text


def _launch_of(file: str, line: int, task_id: int) -> bool:
    text = _lines(file)[line - 1]
    return "processing task" in text and f"| task {task_id} |" in text


def _call_at(file: str, line: int) -> str:
    return json.loads(_lines(file)[line - 1])["id"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_listed_rows_lead_to_their_log_lines(scenario: str) -> None:
    ds = dataset.load([REAL / scenario / "logs"])
    t = analyze.run(ds, analyze.Options(), ["stalls-worst", "waits-worst", "cache-misses"])
    checked = 0
    for name, who in (("stalls-worst", "cause"), ("waits-worst", "holder")):
        for r in t[name].itertuples():
            assert r.source == r.file  # one file per server in these scenarios
            assert _launch_of(r.file, r.line, r.task_id), (name, r.file, r.line, r.task_id)
            if not pd.isna(getattr(r, f"{who}_task_id")):
                assert _launch_of(getattr(r, f"{who}_file"), getattr(r, f"{who}_line"), getattr(r, f"{who}_task_id"))
            if name == "stalls-worst" and not pd.isna(r.hb_line):
                assert _heartbeat_of(r.hb_file, r.hb_line, r.task_id)
            checked += 1
    for r in t["cache-misses"].itertuples():
        assert _call_at(r.call_file, r.call_line) == r.call_id
        assert _call_at(r.prev_call_file, r.prev_call_line) == r.prev_call_id
        assert _launch_of(r.task_file, r.task_line, r.task_id)
        checked += 1
    assert checked >= 10  # each scenario lists stalls and waits


def test_rotated_logs_lead_to_the_file_each_line_is_in() -> None:
    """Rotated logs number lines per file: the slowest stalls of x.log.2.gz, x.log.1 and x.log
    name the file of the task's launch (file, line) and of the heartbeat (hb_file, hb_line)."""
    ds = dataset.load([FORMATS / "rotated"])
    worst = analyze.run(ds, analyze.Options(), ["stalls-worst"])["stalls-worst"]
    assert len(worst) and worst["file"].nunique() == 3  # rows from every file
    for r in worst.itertuples():
        assert _launch_of(r.file, r.line, r.task_id), (r.file, r.line, r.task_id)
        assert _heartbeat_of(r.hb_file, r.hb_line, r.task_id), (r.hb_file, r.hb_line, r.task_id)
