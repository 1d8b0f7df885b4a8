"""Whatever bytes arrive, the parser never raises and accounts for every line.

Inputs are built from real b11434 lines (fixtures/formats/plain.log): shuffled, cut short,
sprinkled with random bytes and invalid UTF-8, joined without a final newline.
"""

from __future__ import annotations

import warnings

from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotscope.server_log import read_server_logs

from .conftest import FORMATS, REAL

REAL_LINES = (FORMATS / "plain.log").read_bytes().splitlines(keepends=True)


def _mutate(line: bytes, op: int, cut: int, junk: bytes) -> bytes:
    if op == 0:
        return line
    if op == 1:  # truncated somewhere in the middle
        return line[: cut % max(len(line), 1)] + b"\n"
    if op == 2:  # random bytes (any value, incl. invalid UTF-8 and NUL) in the middle
        k = cut % max(len(line), 1)
        return line[:k] + junk + line[k:]
    if op == 3:  # a line of pure junk
        return junk.replace(b"\n", b" ") + b"\n"
    return b""  # dropped


lines_st = st.lists(
    st.tuples(st.sampled_from(REAL_LINES), st.integers(0, 4), st.integers(0, 300), st.binary(min_size=0, max_size=40)),
    min_size=0, max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=lines_st, cut_last=st.booleans())
def test_any_mix_of_real_and_broken_lines_is_accounted(tmp_path: Path, parts, cut_last: bool) -> None:
    data = b"".join(_mutate(line, op, cut, junk) for line, op, cut, junk in parts)
    if cut_last and data.endswith(b"\n"):
        data = data[: max(len(data) - 7, 0)]  # file cut mid-line
    f = tmp_path / "l.log"
    f.write_bytes(data)
    logs = read_server_logs([f])  # must not raise
    acc = logs.accounting
    if acc.files:
        fa = acc.files[0]
        expected = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
        assert fa.lines == expected
        assert fa.used + fa.ignored + fa.unrecognized == fa.lines
        # a task whose launch is not in the input (log starts mid-task) is kept, as incomplete
        launched = logs.tasks["line"].notna()
        assert launched.sum() <= sum(1 for x in data.split(b"\n") if b"processing task" in x)
        assert (logs.tasks.loc[~launched, "status"] != "complete").all() or (~launched).sum() == 0
    else:  # too broken to be told a log: reported as skipped, with the reason
        assert acc.skipped and acc.skipped[0][0] == str(f)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(min_size=0, max_size=3000))
def test_random_bytes_never_raise(tmp_path: Path, blob: bytes) -> None:
    f = tmp_path / "r.log"
    f.write_bytes(blob)
    logs = read_server_logs([f])
    acc = logs.accounting
    assert acc.files or acc.skipped


@pytest.fixture(params=["zlib", "isal"])
def inflater(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both inflaters .gz input may be read with: ISA-L where installed, else zlib."""
    import zlib

    from slotscope import sources

    if request.param == "isal":
        isal_zlib = pytest.importorskip("isal.isal_zlib")
        monkeypatch.setattr(sources, "_zlib", isal_zlib)
    else:
        monkeypatch.setattr(sources, "_zlib", zlib)
    return request.param


def test_gzip_reads_the_same_with_either_inflater(inflater: str) -> None:
    plain = read_server_logs([FORMATS / "plain.log"]).tasks
    gz = read_server_logs([FORMATS / "plain.log.gz"]).tasks
    pd.testing.assert_frame_equal(gz.drop(columns=["source", "file"]), plain.drop(columns=["source", "file"]))


def test_truncated_gzip_is_reported_not_raised(tmp_path: Path, inflater: str) -> None:
    gz = (FORMATS / "plain.log.gz").read_bytes()
    f = tmp_path / "cut.log.gz"
    f.write_bytes(gz[: len(gz) // 2])
    logs = read_server_logs([f])
    fa = logs.accounting.files[0]
    assert fa.error and "cannot read" in fa.error
    assert fa.lines > 0 and fa.used + fa.ignored + fa.unrecognized == fa.lines


def test_truncated_gzip_read_by_workers_keeps_every_line_before_the_damage(tmp_path: Path) -> None:
    """A .gz cut short, read by worker processes: every line decoded before the damage is
    counted and parsed, as in one process. (The blocks already read and in flight were once
    dropped with the error: a 9 MB cut of the 100 MB bench log lost 108k of its 455k lines.)"""
    import gzip

    data = (REAL / "before" / "logs" / "llama-server.log").read_bytes() * 20
    packed = gzip.compress(data, 6)
    f = tmp_path / "cut.log.gz"
    f.write_bytes(packed[: len(packed) * 3 // 4])
    one = read_server_logs([f], jobs=1, chunk_size=16 << 10)
    two = read_server_logs([f], jobs=2, chunk_size=16 << 10)
    a, b = one.accounting.files[0], two.accounting.files[0]
    assert a.error and b.error and a.lines > data.count(b"\n") // 2
    assert (a.lines, a.used, a.ignored, a.unrecognized) == (b.lines, b.used, b.ignored, b.unrecognized)
    pd.testing.assert_frame_equal(one.tasks, two.tasks, check_exact=True)


def test_a_log_replaced_while_it_is_read_is_an_error_not_a_mix(tmp_path: Path) -> None:
    """Worker processes open the log again by its path for each span: a log rotated (replaced)
    meanwhile would mix the new file's bytes into the old one's tasks. It is said instead."""
    import os

    from slotscope.errors import InputError
    from slotscope.sources import iter_spans, read_span

    log = tmp_path / "llama-server.log"
    log.write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    with open(log, "rb") as stream:
        spans = list(iter_spans(stream, str(log), 1 << 12))
    assert len(spans) > 2
    first = read_span(spans[0])
    assert first == log.read_bytes()[:spans[0].length]
    new = tmp_path / "new.log"
    new.write_bytes(log.read_bytes())
    os.replace(new, log)  # (same bytes, another file: as a rotation leaves it)
    with pytest.raises(InputError, match="replaced while it was read"):
        read_span(spans[1])


def test_one_nul_byte_near_the_start_leaves_a_text_log_read(tmp_path: Path) -> None:
    """A stray NUL in the first 4 KiB (a crash, a disk hiccup) made the whole log 'binary'.
    Text is judged by its share: the same tasks, every line counted."""
    raw = (REAL / "before" / "logs" / "llama-server.log").read_bytes()
    at = raw.index(b"\n", 1000)
    log = tmp_path / "llama-server.log"
    log.write_bytes(raw[:at] + b"\x00" + raw[at:])
    want = read_server_logs([str(REAL / "before" / "logs" / "llama-server.log")])
    got = read_server_logs([str(log)])
    assert got.accounting.lines == want.accounting.lines
    assert got.accounting.used + got.accounting.ignored + got.accounting.unrecognized == got.accounting.lines
    pd.testing.assert_frame_equal(got.tasks.drop(columns=["source", "file"], errors="ignore"),
                                  want.tasks.drop(columns=["source", "file"], errors="ignore"))


@pytest.mark.parametrize("old, new, column", [
    ("/  2281 tokens", "/  100000000000000000000 tokens", "prompt_tokens_new"),
    ("n_gen =    148,", "n_gen = 100000000000000000000000000,", None),
])
def test_numbers_beyond_what_a_count_can_be_read_as_missing(tmp_path: Path, old: str, new: str, column: str | None) -> None:
    """A damaged count (``n_tokens`` 1e20, ``n_gen`` 1e26) ended in a TypeError in `tasks` and
    `samples`. A count a float cannot hold exactly reads as missing; every other value stays."""
    text = (FORMATS / "plain.log").read_text()
    assert old in text
    log = tmp_path / "llama-server.log"
    log.write_text(text.replace(old, new, 1))
    want = read_server_logs([str(FORMATS / "plain.log")])
    got = read_server_logs([str(log)])
    assert len(got.tasks) == len(want.tasks) and got.accounting.lines == want.accounting.lines
    if column is not None:
        t = got.tasks.set_index("task_id")
        assert pd.isna(t.loc[0, column]) and t.drop(index=0)[column].notna().all()
    else:
        g = got.gen_samples
        assert len(g) == len(want.gen_samples) and int(g["n_gen"].isna().sum()) == 1


@pytest.mark.parametrize("task_id", [2**53 + 1, 2**63 - 1, 10**20])
def test_a_task_id_beyond_what_a_float_holds_leaves_its_lines_unrecognized(tmp_path: Path, task_id: int) -> None:
    """Task ids travel as floats: 2**53 + 1 read as its neighbour 2**53, and 2**63 - 1 or 1e20
    became -2**63 with a RuntimeWarning on stderr. A task id of 2**53 or more (a damaged line:
    no server counts that far) leaves its lines unrecognized; the other tasks stay."""
    text = (FORMATS / "plain.log").read_text()
    lines = text.count("| task 0 |")
    assert lines > 2
    log = tmp_path / "llama-server.log"
    log.write_text(text.replace("| task 0 |", f"| task {task_id} |"))
    want = read_server_logs([str(FORMATS / "plain.log")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = read_server_logs([str(log)])
    assert got.accounting.lines == want.accounting.lines
    assert got.accounting.unrecognized == want.accounting.unrecognized + lines
    assert set(got.tasks["task_id"]) == set(want.tasks["task_id"]) - {0}
    def others(t: pd.DataFrame) -> pd.DataFrame:
        return t[t["task_id"] != 0].drop(columns=["source", "file"]).reset_index(drop=True)

    pd.testing.assert_frame_equal(others(got.tasks), others(want.tasks), check_exact=True)


@pytest.mark.parametrize("field, value", [("prompt_tokens", 2**64), ("duration_ms", 1e308)])
def test_app_numbers_beyond_what_a_count_or_time_can_be_are_flagged_missing(tmp_path: Path, field: str, value: float) -> None:
    """A real app record with ``prompt_tokens`` 2**64 ended in a TypeError, one with
    ``duration_ms`` 1e308 (and no end time) in OutOfBoundsDatetime. Such a value reads as
    missing and is flagged on its line; the record's other fields stay."""
    import json

    from slotscope.app_log import read_app_logs

    lines = (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    record[field] = value
    record.pop("end")
    lines[0] = json.dumps(record)
    app = tmp_path / "app.jsonl"
    app.write_text("\n".join(lines) + "\n")
    log = read_app_logs([str(app)])
    first = log.calls.set_index("call_id").loc[record["id"]]
    assert pd.isna(first[field]) and first["completion_tokens"] == record["completion_tokens"]
    assert len(log.calls) == len(lines)
    assert [(p.line, p.reason) for p in log.accounting.problems] == [(1, f"{field} out of range: {value}")]
