"""JSONL app logs are read by pyarrow where a block allows it, record by record elsewhere:
both ways must give the same calls, problems and notes.

Each variant is the real "before" app log (or its records) written another way an application
might write it; every one is read with pyarrow allowed and with it refused, and the results
must be identical. Whether pyarrow took the block is pinned too: the plain real logs and the
common variants must take it (else the fast way is silently never used), and the variants
where a column cannot tell what a record held must not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest

from slotscope import app_log, store
from slotscope.app_log import read_app_logs

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
SCENARIOS = sorted(p.name for p in REAL.iterdir() if (p / "logs" / "app.jsonl").exists())
BEFORE = REAL / "before" / "logs" / "app.jsonl"


def _records() -> list[dict]:
    return [json.loads(ln) for ln in BEFORE.read_text().splitlines()]


def _lines(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _each(change: Callable[[int, dict], None]) -> Callable[[], bytes]:
    """Records changed by ``change(i, record)``."""
    def make() -> bytes:
        recs = _records()
        for i, r in enumerate(recs):
            change(i, r)
        return _lines(recs)
    return make


def _text(change: Callable[[list[bytes]], list[bytes]]) -> Callable[[], bytes]:
    """The file's lines (with their newlines) changed by ``change``."""
    return lambda: b"".join(change(BEFORE.read_bytes().splitlines(keepends=True)))


def _set(key: str, value: Callable[[int, dict], object], every: int = 1) -> Callable[[int, dict], None]:
    def change(i: int, r: dict) -> None:
        if i % every == 0:
            r[key] = value(i, r)
    return change


def _drop(key: str, every: int = 1) -> Callable[[int, dict], None]:
    def change(i: int, r: dict) -> None:
        if i % every == 0:
            r.pop(key, None)
    return change


def _nest_tokens(i: int, r: dict) -> None:
    r["usage"] = {"prompt_tokens": r.pop("prompt_tokens"), "completion_tokens": r.pop("completion_tokens")}


def _timings(flat: Callable[[int], bool]) -> Callable[[int, dict], None]:
    def change(i: int, r: dict) -> None:
        t = {"prompt_n": r["prompt_tokens"] - r["cached_tokens"], "prompt_ms": 12.5 + i, "predicted_n": r["completion_tokens"]}
        if flat(i):
            r.update({f"timings_{k}": v for k, v in t.items()})
        else:
            r["timings"] = t
    return change


def _epoch(scale: float, as_int: bool) -> Callable[[int, dict], None]:
    def change(i: int, r: dict) -> None:
        v = pd.Timestamp(r["start"]).value / 1e9 * scale
        r["start"] = int(round(v)) if as_int else v
        r.pop("end")
    return change


# name -> (file bytes, whether pyarrow reads it, extra read arguments)
VARIANTS: dict[str, tuple[Callable[[], bytes], bool, dict]] = {
    "real": (lambda: BEFORE.read_bytes(), True, {}),
    "no final newline": (lambda: BEFORE.read_bytes().rstrip(b"\n"), True, {}),
    "crlf": (_text(lambda ls: [ln.replace(b"\n", b"\r\n") for ln in ls]), True, {}),
    # LoRA written other ways
    "lora as text": (_each(_set("lora", lambda i, r: "style-a@1.0" if r["lora"] else ["none", None, "", "off"][i % 4])), True, {}),
    "lora scale integer": (_each(_set("lora", lambda i, r: {"name": "style-a", "scale": 1} if r["lora"] else None)), True, {}),
    "lora scale zero or NaN": (_each(_set("lora", lambda i, r: {"name": "a", "scale": [0.0, float("nan"), 0.5][i % 3]})), True, {}),
    "lora id, path, name as number": (_each(_set("lora", lambda i, r: [{"id": "x", "scale": 0.5}, {"path": "/p", "scale": 2},
                                                                       {"name": 7, "scale": 1.0}, None][i % 4])), True, {}),
    "lora name as boolean": (_each(_set("lora", lambda i, r: {"name": i % 2 == 0, "scale": 1.0})), True, {}),
    "lora scale missing in some": (_each(_set("lora", lambda i, r: {"name": "a"} if i % 3 else {"name": "a", "scale": 0.5})),
                                   False, {}),
    "lora list": (_each(_set("lora", lambda i, r: [{"name": "a", "scale": 1.0}, {"name": "b", "scale": 0.5}])), False, {}),
    # fields under several names, or nested
    "user missing in some (session read instead)": (_each(_drop("user", every=3)), False, {}),
    "user null in some": (_each(_set("user", lambda i, r: None, every=3)), False, {}),
    "tokens nested in some": (_each(lambda i, r: _nest_tokens(i, r) if i % 2 else None), False, {}),
    "tokens nested in all": (_each(_nest_tokens), True, {}),
    "timings nested": (_each(_timings(lambda i: False)), True, {}),
    "timings flat": (_each(_timings(lambda i: True)), True, {}),
    "timings nested in some, flat in others": (_each(_timings(lambda i: i % 2 == 0)), False, {}),
    "names differing in case": (_each(lambda i, r: r.__setitem__("Start", r.pop("start")) if i % 2 else None), False, {}),
    "mapped column": (_each(lambda i, r: r.__setitem__("kind", r.pop("purpose"))), True, {"columns": {"purpose": "kind"}}),
    # numbers
    "tokens as text": (_each(_set("prompt_tokens", lambda i, r: str(r["prompt_tokens"]))), True, {}),
    "tokens as text, some unreadable": (_each(_set("prompt_tokens", lambda i, r: "n/a" if i % 5 == 0 else str(r["prompt_tokens"]))),
                                        True, {}),
    "tokens text in some, numbers in others": (_each(_set("prompt_tokens", lambda i, r: str(r["prompt_tokens"]), every=2)), False, {}),
    "tokens beyond 2**53": (_each(_set("prompt_tokens", lambda i, r: 2**60 + 1, every=7)), False, {}),
    "tokens as floats in some": (_each(_set("prompt_tokens", lambda i, r: r["prompt_tokens"] + 0.0, every=2)), True, {}),
    "duration infinite": (_text(lambda ls: [ln.replace(b'"duration_ms": ', b'"duration_ms": Infinity, "x": ', 1)
                                            .replace(b'"duration_ms":', b'"duration_ms":Infinity,"x":', 1) if i == 3 else ln
                                            for i, ln in enumerate(ls)]), True, {}),
    # status, error, ids
    "status words": (_each(_set("status", lambda i, r: ["ok", "failed", "", None, "Done"][i % 5])), True, {}),
    "status as float": (_each(_set("status", lambda i, r: 200.0)), False, {}),
    "status null in some": (_each(_set("status", lambda i, r: None, every=4)), True, {}),
    "error object": (_each(_set("error", lambda i, r: {"message": "boom", "code": 3}, every=5)), False, {}),
    "error blank": (_each(_set("error", lambda i, r: ["  ", "", "x"][i % 3], every=2)), True, {}),
    "ids missing, null or numbers": (_each(lambda i, r: r.pop("id") if i % 3 == 0 else r.__setitem__("id", [None, i][i % 2])),
                                     True, {}),
    # times
    "epoch seconds": (_each(_epoch(1.0, False)), True, {}),
    "epoch milliseconds": (_each(_epoch(1e3, True)), True, {}),
    "epoch nanoseconds": (_each(_epoch(1e9, True)), False, {}),
    "no zone, read in Berlin": (_each(_set("start", lambda i, r: r["start"][:-6])), True, {"tz": "Europe/Berlin"}),
    "zones written oddly": (_each(_set("start", lambda i, r: r["start"][:-6] + ["\u00a0UTC", " Z", "\u000bZ", "Z\n", "+0000",
                                                                                 "\u0663Z", " UTC"][i % 7])), True, {}),
    "digits of another script": (_each(_set("start", lambda i, r: r["start"].replace("07:", "\u0660\u0667:"), every=3)), True, {}),
    # lines pyarrow must not read
    "blank lines": (_text(lambda ls: [ln + (b"\n" if i % 9 == 0 else b"") for i, ln in enumerate(ls)]), False, {}),
    "spaces-only line": (_text(lambda ls: ls[:5] + [b"   \n"] + ls[5:]), False, {}),
    "indented line": (_text(lambda ls: ls[:5] + [b" " + ls[5]] + ls[6:]), False, {}),
    "byte-order mark": (_text(lambda ls: [b"\xef\xbb\xbf" + ls[0]] + ls[1:]), False, {}),
    "invalid JSON line": (_text(lambda ls: ls[:5] + [ls[5][:30] + b"\n"] + ls[6:]), False, {}),
    "array line": (_text(lambda ls: ls[:5] + [b"[1, 2]\n"] + ls[5:]), False, {}),
    "two objects on a line": (_text(lambda ls: ls[:5] + [ls[5].rstrip(b"\n") + ls[6]] + ls[7:]), False, {}),
    "object begun after another on its line": (_text(lambda ls: ls[:5] + [ls[5].rstrip(b"\n") + b'{"x":\n', ls[6].rstrip(b"\n") + b"}\n"]
                                                        + ls[7:]), False, {}),
    "object across lines": (_text(lambda ls: ls[:5] + [ls[5].replace(b"\",\"", b"\",\n\"", 1)] + ls[6:]), False, {}),
    "duplicate key": (_text(lambda ls: ls[:5] + [ls[5].replace(b"{", b'{"purpose": "x", ', 1)] + ls[6:]), False, {}),
    "lone surrogate": (_each(_set("user", lambda i, r: "u\ud800", every=11)), False, {}),
    "invalid UTF-8": (_text(lambda ls: ls[:5] + [ls[5].replace(b'"chat', b'"ch\xffat', 1)] + ls[6:]), False, {}),
}


def _read(path: Path, arrow: bool, monkeypatch: pytest.MonkeyPatch, **kw: object) -> tuple[app_log.AppLog, list[bool]]:
    """The log read with pyarrow allowed (or refused), and whether it read each block."""
    taken: list[bool] = []
    real = app_log._arrow_fields

    def spy(block: bytes, override: dict) -> object:
        got = real(block, override) if arrow else None
        taken.append(got is not None)
        return got

    with monkeypatch.context() as m:
        m.setattr(app_log, "_arrow_fields", spy)
        return read_app_logs([path], **kw), taken  # type: ignore[arg-type]


def _same(a: app_log.AppLog, b: app_log.AppLog) -> None:
    pd.testing.assert_frame_equal(a.calls, b.calls, check_exact=True)
    assert a.accounting == b.accounting


@pytest.mark.parametrize("name", list(VARIANTS))
def test_pyarrow_and_record_by_record_read_alike(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make, fast, kw = VARIANTS[name]
    path = tmp_path / "app.jsonl"
    path.write_bytes(make())
    slow, _ = _read(path, False, monkeypatch, **kw)
    got, taken = _read(path, True, monkeypatch, **kw)
    assert set(taken) == {fast}  # (a last line without newline: a block of its own)
    _same(got, slow)
    assert len(got.calls) > 0


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_real_logs_are_read_by_pyarrow(scenario: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = REAL / scenario / "logs" / "app.jsonl"
    slow, _ = _read(path, False, monkeypatch)
    got, taken = _read(path, True, monkeypatch)
    assert taken and all(taken)
    _same(got, slow)


def test_blocks_of_lines_each_go_their_own_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of ~10 lines: the one with an invalid line is read record by record, the others
    by pyarrow, and the lines, problems and calls are those of reading it all one way."""
    lines = BEFORE.read_bytes().splitlines(keepends=True)
    lines[23] = lines[23][:40] + b"\n"
    path = tmp_path / "app.jsonl"
    path.write_bytes(b"".join(lines))
    monkeypatch.setattr(app_log, "SPAN_BYTES", 3000)
    slow, _ = _read(path, False, monkeypatch)
    got, taken = _read(path, True, monkeypatch)
    assert len(taken) >= 4 and taken.count(False) == 1
    _same(got, slow)
    assert [p.line for p in got.accounting.problems] == [24]


def _finish_whole(frames: list[pd.DataFrame], tally: app_log._Tally) -> pd.DataFrame:
    """The calls as _finish made them before it joined a column at a time: the chunks joined
    whole, sorted, completed to the call columns, cast."""
    import numpy as np

    calls = pd.concat(frames, ignore_index=True)
    codes, names = pd.factorize(calls["file"])
    file_order = np.array([tally.files[n] for n in names], dtype=np.int64)[codes]
    order = np.lexsort((calls["line"].to_numpy(), file_order, calls["start_us"].to_numpy()))
    calls = calls.take(order).reset_index(drop=True)
    calls["start_at"] = pd.to_datetime(calls["start_us"], unit="us", utc=True)
    calls["end_at"] = pd.to_datetime(calls["end_us"], unit="us", utc=True)
    extra = [c for c in ("session", "turn") if c in calls]
    calls = calls.reindex(columns=[*app_log.CALL_COLUMNS, *extra])
    calls = calls.astype({c: app_log._DTYPES[c] for c in calls.columns if c not in ("start_at", "end_at")})
    calls["start_at"] = calls["start_at"].dt.as_unit("us")
    calls["end_at"] = calls["end_at"].dt.as_unit("us")
    return calls


@pytest.mark.parametrize("arrow", [True, False])
@pytest.mark.parametrize("on_disk", [False, True])
def test_calls_joined_a_column_at_a_time_equal_the_chunks_joined_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arrow: bool, on_disk: bool) -> None:
    """Chunks of one log can differ in columns (a field the first records lack, written out of
    time order): the calls are the same as a join of the whole chunks gives them, kept in
    memory or written to disk a column at a time."""
    recs = _records()
    for i, r in enumerate(recs):
        if i < len(recs) // 2:  # the first chunks have no session, turn nor timings-like extras
            r.pop("session", None)
            r.pop("turn", None)
            r.pop("cached_tokens", None)
    recs = recs[7:] + recs[:7]  # not in time order: the join sorts
    path = tmp_path / "app.jsonl"
    path.write_bytes(_lines(recs))
    monkeypatch.setattr(app_log, "CHUNK_ROWS", 5)
    monkeypatch.setattr(app_log, "SPAN_BYTES", 1500)
    if not arrow:
        monkeypatch.setattr(app_log, "_arrow_fields", lambda block, override: None)
    seen = []
    finish = app_log._finish

    def spy(frames: list, tally: app_log._Tally, disk: bool = False) -> app_log.AppLog:
        assert disk == on_disk  # (on disk: so are the chunks' tables, read back here as they were)
        seen.append(([f.read() if isinstance(f, store.StoredTable) else f.copy() for f in frames], tally))
        assert all(isinstance(f, store.StoredTable) for f in frames) == on_disk
        return finish(frames, tally, on_disk)

    monkeypatch.setattr(app_log, "_finish", spy)
    monkeypatch.setattr(store, "ROWS_PER_BATCH", 4)
    with open(path, "rb") as stream:
        log = app_log.read_app_log_stream(str(path), stream, on_disk=on_disk)
    assert (store.stored(log, "calls") is not None) == on_disk
    got = log.calls
    (frames, tally), = seen
    assert len({tuple(f.columns) for f in frames}) > 1  # chunks with and without the columns
    pd.testing.assert_frame_equal(got, _finish_whole(frames, tally))
    assert got["session"].notna().any() and got["session"].isna().any()
    if on_disk:  # (and the chunks on disk changed nothing: the calls of a read in memory)
        monkeypatch.setattr(app_log, "_finish", finish)
        with open(path, "rb") as stream:
            pd.testing.assert_frame_equal(got, app_log.read_app_log_stream(str(path), stream).calls)


def test_calls_of_several_files_keep_each_ones_name_and_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several files, read in an order their names do not sort in, their calls interleaved in
    time and each read in several chunks: the file column (made a chunk at a time from each
    chunk's names) and the order are those of the chunks joined whole."""
    recs = _records()
    paths = []
    for k, name in enumerate(["b.jsonl", "a.jsonl", "c.jsonl"]):
        path = tmp_path / name
        path.write_bytes(_lines(recs[k::3] + recs[k::5]))  # (calls of one time in two files)
        paths.append(path)
    monkeypatch.setattr(app_log, "CHUNK_ROWS", 4)
    seen = []
    finish = app_log._finish

    def spy(frames: list, tally: app_log._Tally, disk: bool = False) -> app_log.AppLog:
        seen.append(([f.copy() for f in frames], tally))
        return finish(frames, tally, disk)

    monkeypatch.setattr(app_log, "_finish", spy)
    got = read_app_logs(paths).calls
    (frames, tally), = seen
    pd.testing.assert_frame_equal(got, _finish_whole(frames, tally))
    assert list(got["file"].cat.categories) == sorted(str(p) for p in paths)
    assert got["file"].iloc[:6].nunique() > 1  # (interleaved)


def test_repeated_call_ids_are_counted_as_pandas_counts_duplicates() -> None:
    """The repeats among the call ids (counted from their values sorted) are
    ``duplicated().sum()``'s, missing ids included (one missing id repeats another)."""
    import numpy as np

    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 3, 50, 2000):
        for _ in range(20):
            values = [None if rng.random() < 0.1 else f"id-{rng.integers(0, max(n // 2, 1))}" for _ in range(n)]
            col = pd.Series(values, dtype="string")
            assert app_log._repeats(col) == int(col.duplicated().sum())


@pytest.mark.parametrize("span_bytes", [1000, 3000, 1 << 20])
@pytest.mark.parametrize("jobs", [1, 2])
def test_a_key_named_twice_reads_its_last_value_in_one_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              span_bytes: int, jobs: int) -> None:
    """``{"prompt_tokens": 10, "prompt_tokens": 2458}`` (as an app that adds a key to an object
    already written may log it): the last value counts, as json.loads, JSON.parse and jq read
    it, and one note names the first such line and how many records do it, however the file
    falls into blocks and workers. pyarrow refuses such a block: the records are read one by
    one, as before, but the reading was silent."""
    from slotscope.app_log import read_app_log_stream
    from slotscope.workers import Pool

    lines = BEFORE.read_bytes().splitlines(keepends=True)
    for i in (2, 29, 40):
        lines[i] = lines[i].replace(b'"prompt_tokens":', b'"prompt_tokens":10,"prompt_tokens":', 1)
    path = tmp_path / "app.jsonl"
    path.write_bytes(b"".join(lines))
    want = read_app_logs([BEFORE]).calls
    monkeypatch.setattr(app_log, "SPAN_BYTES", span_bytes)
    with Pool(jobs) as pool, open(path, "rb") as f:
        log = read_app_log_stream(str(path), f, pool=pool)
    pd.testing.assert_frame_equal(log.calls.drop(columns="file"), want.drop(columns="file"))
    assert log.accounting.notes == (f"{path}:3: a record names 'prompt_tokens' twice (10, then 12419): the last value "
                                    "counts, as in JSON.parse and jq; 3 records name a key twice",)
    assert log.accounting.problems == () and log.accounting.rows_loaded == len(lines)


def test_a_nested_key_named_twice_is_named_by_its_path(tmp_path: Path) -> None:
    lines = BEFORE.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b'"scale":1.0', b'"scale":0.5,"scale":1.0', 1)
    assert b'"scale":0.5' in lines[4]
    path = tmp_path / "app.jsonl"
    path.write_bytes(b"".join(lines))
    log = read_app_logs([path])
    assert log.accounting.notes == (f"{path}:5: a record names 'lora.scale' twice (0.5, then 1.0): the last value "
                                    "counts, as in JSON.parse and jq",)
    assert log.calls.set_index("line")["lora"][5] == "style-a@1.0"
