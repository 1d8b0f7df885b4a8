"""App call logs: the real fixtures, the same data as CSV/gzip/zstd, and the ways input goes wrong."""

from __future__ import annotations

import csv
import gzip
import io
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from slotscope.app_log import (
    CALL_COLUMNS,
    lora_label,
    load_column_file,
    parse_column_spec,
    read_app_log_lines,
    read_app_log_stream,
    read_app_logs,
)
from slotscope.app_fields import looks_like_app_log
from slotscope.errors import AppLogError

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
SCENARIOS = sorted(p.name for p in REAL.iterdir() if (p / "logs" / "app.jsonl").exists())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_real_app_log_agrees_with_truth(scenario: str) -> None:
    path = REAL / scenario / "logs" / "app.jsonl"
    log = read_app_logs([path])
    n_lines = len(path.read_text().splitlines())
    truth = pd.DataFrame(_jsonl(REAL / scenario / "truth.jsonl")).set_index("id")

    calls = log.calls.set_index("call_id")
    assert len(calls) == n_lines
    assert log.accounting.lines_read == log.accounting.rows_loaded == n_lines
    assert log.accounting.rows_with_problems == 0 and log.accounting.problems == ()
    assert list(log.calls.columns[: len(CALL_COLUMNS)]) == list(CALL_COLUMNS)
    assert set(calls.index) == set(truth.index)
    truth = truth.loc[calls.index]
    assert (calls["prompt_tokens"].to_numpy() == truth["tokens_evaluated"].to_numpy()).all()
    assert (calls["completion_tokens"].to_numpy() == truth["tokens_predicted"].to_numpy()).all()
    send_us = (truth["t_send"] * 1e6).to_numpy()
    assert abs(calls["start_us"].to_numpy() - send_us).max() <= 1000
    assert abs((calls["start_at"] - pd.to_datetime(truth["t_send_iso"], utc=True)).dt.total_seconds()).max() < 1e-3
    assert str(log.calls["start_at"].dtype) == "datetime64[us, UTC]"
    assert (calls["ok"].to_numpy() == (truth["error"].isna() & (truth["status"] == 200)).to_numpy()).all()
    assert log.calls["start_us"].is_monotonic_increasing


def test_lora_labels_in_before() -> None:
    calls = read_app_logs([REAL / "before" / "logs" / "app.jsonl"]).calls
    assert set(calls["lora"]) == {"none", "style-a@1.0"}
    assert calls["lora"].dtype == "category" and calls["purpose"].dtype == "category"


def _as_csv(tmp_path: Path, name: str = "calls.csv", delimiter: str = ",",
            header: tuple[str, ...] = ("request_id", "timestamp", "kind", "user_id", "adapter", "input_tokens",
                                       "output_tokens", "cached_tokens", "status_code", "error", "latency_ms")) -> Path:
    out = tmp_path / name
    with out.open("w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        for r in _jsonl(REAL / "before" / "logs" / "app.jsonl"):
            w.writerow([r["id"], r["start"], r["purpose"], r["user"], json.dumps(r["lora"]) if r["lora"] else "",
                        r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"], r["status"],
                        r["error"] or "", r["duration_ms"]])
    return out


@pytest.mark.parametrize("delimiter", [",", ";", "\t"])
def test_csv_with_other_names_reads_like_jsonl(tmp_path: Path, delimiter: str) -> None:
    want = read_app_logs([REAL / "before" / "logs" / "app.jsonl"]).calls
    got = read_app_logs([_as_csv(tmp_path, delimiter=delimiter)])
    assert got.accounting.rows_loaded == len(want) and got.accounting.lines_read == len(want) + 1
    cols = ["call_id", "start_us", "end_us", "duration_ms", "purpose", "user", "lora", "prompt_tokens",
            "completion_tokens", "cached_tokens", "status", "ok"]
    pd.testing.assert_frame_equal(got.calls[cols].astype(object), want[cols].astype(object))
    assert got.calls["line"].min() == 2  # the header is line 1


def test_gzip_and_zstd_by_content(tmp_path: Path) -> None:
    data = (REAL / "after" / "logs" / "app.jsonl").read_bytes()
    gz = tmp_path / "calls.log"  # no .gz suffix: recognised by its magic bytes
    gz.write_bytes(gzip.compress(data))
    assert len(read_app_logs([gz]).calls) == data.count(b"\n")
    zstandard = pytest.importorskip("zstandard")
    zst = tmp_path / "calls.bin"
    zst.write_bytes(zstandard.ZstdCompressor().compress(data))
    assert read_app_logs([str(zst)]).calls["call_id"].tolist() == read_app_logs([gz]).calls["call_id"].tolist()


def test_several_files_keep_their_own_lines(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", [{"ts": 20.0, "prompt_tokens": 1}, {"ts": 10.0, "prompt_tokens": 2}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"ts": 15.0, "prompt_tokens": 3}])
    calls = read_app_logs([a, b]).calls
    assert calls["call_id"].tolist() == [f"{a}:2", f"{b}:1", f"{a}:1"]
    assert calls["line"].tolist() == [2, 1, 1]


def test_explicit_mapping_overrides_detection(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", [
        {"ts": "2026-05-12T08:00:10Z", "begin": "2026-05-12T08:00:00Z", "kind": "chat", "purpose": "ignored"},
    ])
    assert read_app_logs([path]).calls["start_at"][0] == pd.Timestamp("2026-05-12T08:00:10Z")
    calls = read_app_logs([path], columns={"start": "BEGIN", "purpose": "kind"}).calls
    assert calls["start_at"][0] == pd.Timestamp("2026-05-12T08:00:00Z")
    assert calls["purpose"][0] == "chat"


def test_column_spec_and_file(tmp_path: Path) -> None:
    assert parse_column_spec("start=ts, purpose=kind,id=req") == {"start": "ts", "purpose": "kind", "call_id": "req"}
    toml = tmp_path / "cols.toml"
    toml.write_text('[columns]\nstart = "begin"\nprompt_tokens = "usage.in"\n')
    assert load_column_file(toml) == {"start": "begin", "prompt_tokens": "usage.in"}
    with pytest.raises(ValueError, match="unknown app-log field colour"):
        parse_column_spec("colour=red")
    with pytest.raises(ValueError, match="FIELD=COLUMN"):
        parse_column_spec("start")


def test_naive_timestamps_read_in_given_zone(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", [
        {"start": "2026-11-29T08:31:47.961", "end": "2026-11-29T08:31:49", "prompt_tokens": 5},
        {"start": "2026-11-29 08:31:50", "prompt_tokens": 6},
        {"start": "2026-11-29T07:31:51+00:00", "prompt_tokens": 7},
    ])
    with warnings.catch_warnings():  # nothing on stderr (pandas 2.2 warned of a changed .dt result)
        warnings.simplefilter("error")
        log = read_app_logs([path], tz="Europe/Berlin")
    assert log.calls["line"].tolist() == [1, 2, 3]
    assert log.calls["start_at"].tolist() == [pd.Timestamp(t) for t in (
        "2026-11-29T07:31:47.961Z", "2026-11-29T07:31:50Z", "2026-11-29T07:31:51Z")]
    assert log.calls["duration_ms"][0] == pytest.approx(1039.0)
    assert log.accounting.rows_with_problems == 0
    assert len(log.accounting.notes) == 1 and "3 timestamp(s) without a zone read as Europe/Berlin" in log.accounting.notes[0]
    as_utc = read_app_logs([path]).calls.set_index("line")["start_at"]  # default UTC
    assert as_utc[1] == pd.Timestamp("2026-11-29T08:31:47.961Z")


def test_epoch_seconds_ms_us(tmp_path: Path) -> None:
    t = pd.Timestamp("2026-11-29T07:31:47.961Z")
    s = t.value / 1e9
    path = _write_jsonl(tmp_path / "x.jsonl", [
        {"time": s}, {"time": int(s * 1000)}, {"time": int(s * 1e6)}, {"time": str(int(s * 1000))},
    ])
    calls = read_app_logs([path]).calls
    assert (calls["start_at"] == t).all()
    assert calls["prompt_tokens"].isna().all()  # no token counts: still loaded, as NA


def test_nested_usage_lora_list_and_status_text(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", [
        {"request_time": 1795937507.5, "elapsed": 2.5, "usage": {"prompt_tokens": 100, "completion_tokens": 20,
         "prompt_tokens_details": {"cached_tokens": 64}}, "adapter": [{"id": 0, "scale": 0.0}], "status": "ok"},
        {"request_time": 1795937508.5, "usage": {"prompt_tokens": 50}, "adapter": [{"id": 0, "scale": 0.5}],
         "status": "failed", "error": {"message": "boom", "code": 500}},
    ])
    calls = read_app_logs([path]).calls
    assert calls["prompt_tokens"].tolist() == [100, 50]
    assert calls["completion_tokens"][0] == 20 and pd.isna(calls["completion_tokens"][1])
    assert calls["cached_tokens"][0] == 64
    assert calls["lora"].tolist() == ["none", "0@0.5"]
    assert calls["duration_ms"][0] == 2500.0 and calls["end_us"][0] == calls["start_us"][0] + 2_500_000
    assert calls["ok"].tolist() == [True, False] and calls["error"][1] == "boom"
    assert calls["status"].isna().all()


def test_bad_rows_are_counted_with_their_lines(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "app.jsonl", [
        {"id": "a", "start": "2026-05-12T08:00:00Z", "prompt_tokens": 10},
        '{"id": "b", "start": "2026-05-12T08:00:01Z", "prompt_tokens": ',
        {"id": "c", "start": "yesterday-ish", "prompt_tokens": 30},
        {"id": "d", "start": "2026-05-12T08:00:03Z", "prompt_tokens": "many"},
        "",
        {"id": "e", "start": "2026-05-12T08:00:04Z", "prompt_tokens": 50},
        "[1, 2]",
    ])
    log = read_app_logs([path])
    acc = log.accounting
    assert log.calls["call_id"].tolist() == ["a", "d", "e"]
    assert pd.isna(log.calls.set_index("call_id").loc["d", "prompt_tokens"])
    assert (acc.lines_read, acc.rows_loaded, acc.empty_lines) == (7, 3, 1)
    assert (acc.rows_with_problems, acc.rows_dropped) == (4, 3)
    assert [(p.file, p.line) for p in acc.problems] == [(str(path), n) for n in (2, 3, 4, 7)]
    assert "invalid JSON" in acc.problems[0].reason
    assert "unreadable start time: 'yesterday-ish'" in acc.problems[1].reason
    assert "non-numeric prompt_tokens: 'many'" in acc.problems[2].reason


def test_timings_are_flattened(tmp_path: Path) -> None:
    truth = _jsonl(REAL / "restart" / "truth.jsonl")
    path = _write_jsonl(tmp_path / "with-timings.jsonl", [
        {k: r[k] for k in ("id", "t_send", "purpose", "user", "lora", "status", "error", "timings")} for r in truth
    ])
    calls = read_app_logs([path]).calls.set_index("call_id")
    want = pd.DataFrame([{"id": r["id"], **(r["timings"] or {})} for r in truth]).set_index("id").loc[calls.index]
    for sub in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"):
        assert calls[f"timings_{sub}"].astype("float64").fillna(-1).tolist() == want[sub].fillna(-1).tolist()
    assert calls["cached_tokens"].tolist() == calls["timings_cache_n"].tolist()  # timings.cache_n as fallback
    assert calls["timings_prompt_n"].dtype == "Int64"


def test_no_start_column_is_a_typed_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "app.jsonl", [{"when": "2026-05-12T08:00:00Z", "prompt_tokens": 1}])
    with pytest.raises(AppLogError) as err:
        read_app_logs([path])
    assert str(err.value).startswith(f"{path}:1: no start-time column found (looked for start, started_at, ")
    assert str(err.value).endswith("; pass --app-columns start=NAME")
    csv_path = tmp_path / "app.csv"
    csv_path.write_text("\nwhen,prompt_tokens\n2026-05-12T08:00:00Z,1\n")
    with pytest.raises(AppLogError, match=r"app\.csv:2: no start-time column"):
        read_app_logs([csv_path])


def test_lines_and_stream_entry_points() -> None:
    data = (REAL / "wallclock" / "logs" / "app.jsonl").read_bytes()
    by_lines = read_app_log_lines("-", data.splitlines(keepends=True))
    by_stream = read_app_log_stream("-", io.BytesIO(data))
    assert len(by_lines.calls) == len(by_stream.calls) == data.count(b"\n")
    assert by_stream.calls["file"].unique().tolist() == ["-"]


def test_empty_input_has_the_schema() -> None:
    log = read_app_log_lines("empty", [b"", b"\n"])
    assert list(log.calls.columns) == list(CALL_COLUMNS) and len(log.calls) == 0
    assert log.accounting.empty_lines == 2
    assert str(log.calls["start_at"].dtype) == "datetime64[us, UTC]"


@pytest.mark.parametrize(("value", "label"), [
    (None, "none"), ({"name": "style-a", "scale": 1.0}, "style-a@1.0"), ({"name": "style-a", "scale": 0}, "none"),
    ([{"id": 0, "scale": 0.0}], "none"), ([{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}], "0@1.0+1@0.5"),
    ("style-b", "style-b"), ("", "none"), ('{"name": "x", "scale": 2}', "x@2.0"),
])
def test_lora_label(value: object, label: str) -> None:
    assert lora_label(value) == label


def test_looks_like_app_log(tmp_path: Path) -> None:
    assert looks_like_app_log((REAL / "before" / "logs" / "app.jsonl").read_bytes()[:4000])  # cut mid-line
    assert looks_like_app_log(_as_csv(tmp_path).read_bytes()[:2000])
    server = b"".join((REAL / "before" / "logs" / "llama-server.log").read_bytes().splitlines(keepends=True)[:50])
    assert not looks_like_app_log(server)
    wallclock = (REAL / "wallclock" / "logs" / "llama-server.log").read_bytes()[:4000]
    assert not looks_like_app_log(wallclock)
    docker = b'{"log":"0.00.001 I srv ...\\n","stream":"stderr","time":"2026-05-12T08:01:39.331095044Z"}\n'
    assert not looks_like_app_log(docker * 3)
    journald = json.dumps({"__CURSOR": "s=1", "MESSAGE": "0.00.001 I srv ...",
                           "__REALTIME_TIMESTAMP": "1778572899331095"}).encode()
    assert not looks_like_app_log(journald)
    assert not looks_like_app_log(b"")


def test_an_integer_beyond_any_float_is_named_not_raised(tmp_path: Path) -> None:
    """A token count of 400 digits (a corrupted record) is an unusable value on its line."""
    lines = (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    rec["prompt_tokens"] = int("9" * 400)
    lines[1] = json.dumps(rec)
    path = tmp_path / "app.jsonl"
    path.write_text("\n".join(lines) + "\n")
    log = read_app_logs([path])
    assert len(log.calls) == len(lines)
    at = log.calls["line"] == 2
    assert log.calls.loc[at, "prompt_tokens"].isna().all() and log.calls.loc[~at, "prompt_tokens"].notna().all()
    acc = log.accounting
    assert acc.rows_with_problems == 1 and acc.rows_dropped == 0
    assert [(p.line, "prompt_tokens" in p.reason) for p in acc.problems] == [(2, True)]


def _reshaped(records: list[dict]) -> list[dict]:
    """Real records, every other one written the way another client would: tokens under
    ``usage``, purpose as ``kind``, user as ``session``, duration in seconds."""
    out = []
    for i, r in enumerate(records):
        r = dict(r)
        if i % 2:
            r["usage"] = {"prompt_tokens": r.pop("prompt_tokens"), "completion_tokens": r.pop("completion_tokens")}
            r["kind"] = r.pop("purpose")
            r["session"] = r.pop("user")
        if i % 3 == 1:
            r["duration"] = r.pop("duration_ms") / 1000
            r.pop("end")
        out.append(r)
    return out


@pytest.mark.parametrize("chunk_rows", [1, 2, 7, 10_000])
def test_records_of_several_shapes_each_read_their_own_fields(tmp_path: Path, chunk_rows: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A record's fields are read from its own keys, whatever shapes the records around it have:
    once, a record in a chunk whose other records named a field differently lost that field
    (NA, with no problem reported), so results also depended on where chunks fell."""
    from slotscope import app_log

    records = _jsonl(REAL / "before" / "logs" / "app.jsonl")
    assert {"prompt_tokens", "purpose", "user", "duration_ms", "end"} <= set(records[0])
    plain = read_app_logs([_write_jsonl(tmp_path / "plain.jsonl", records)]).calls.set_index("line")
    monkeypatch.setattr(app_log, "CHUNK_ROWS", chunk_rows)
    log = read_app_logs([_write_jsonl(tmp_path / "mixed.jsonl", _reshaped(records))])
    mixed = log.calls.set_index("line")
    assert log.accounting.rows_with_problems == 0 and len(mixed) == len(records)
    for col in ("prompt_tokens", "completion_tokens", "purpose", "user", "call_id", "start_us", "lora"):
        pd.testing.assert_series_equal(mixed[col], plain[col], check_names=False)
    assert mixed["purpose"].notna().all() and mixed["prompt_tokens"].notna().all()
    # duration from seconds where the end is missing: the same call length within rounding
    assert (mixed["duration_ms"] - plain["duration_ms"]).abs().max() < 1.0


def _read_with_workers(path: Path, jobs: int, **kw: object) -> object:
    from slotscope.app_log import read_app_log_stream
    from slotscope.workers import Pool

    with Pool(jobs) as pool, open(path, "rb") as f:
        return read_app_log_stream(str(path), f, pool=pool, **kw)  # type: ignore[arg-type]


def test_worker_processes_read_a_jsonl_file_in_parts_with_the_same_result(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of ~1 KB (a few records each) read by two workers: the same calls, lines, problems
    and notes as one process reading it, including a leading byte-order mark (and misplaced
    ones), blank lines, broken records and naive timestamps in every part."""
    from slotscope import app_log

    lines = [json.dumps(r) for r in _reshaped(_jsonl(REAL / "before" / "logs" / "app.jsonl"))]
    empty = set(range(5, len(lines), 11))
    cut = sorted(set(range(3, len(lines), 7)) - empty)
    for i in cut:
        lines[i] = lines[i][: len(lines[i]) // 2]  # cut: invalid JSON
    for i in empty:
        lines[i] = ""
    boms = [i for i in range(1, len(lines), 3) if i not in empty and i not in cut]
    for i in boms:
        lines[i] = "\ufeff" + lines[i]  # only the file's first line may start with one: the rest are invalid
    for i in range(2, len(lines), 9):
        lines[i] = lines[i].replace("+00:00", "")  # no zone: read in --tz
    path = tmp_path / "app.jsonl"
    path.write_text("\ufeff" + "\n".join(lines) + "\n")
    ref = read_app_logs([path], tz="Europe/Berlin")
    monkeypatch.setattr(app_log, "SPAN_BYTES", 1000)
    got = _read_with_workers(path, 2, tz="Europe/Berlin")
    assert path.stat().st_size > 10 * 1000
    pd.testing.assert_frame_equal(got.calls, ref.calls)  # type: ignore[attr-defined]
    assert got.accounting == ref.accounting  # type: ignore[attr-defined]
    assert ref.accounting.rows_dropped == len(cut) + len(boms) and ref.accounting.empty_lines == len(empty)
    assert ref.accounting.notes  # the naive timestamps
    assert [p.line for p in ref.accounting.problems] == sorted(i + 1 for i in cut + boms)[: len(ref.accounting.problems)]


def test_a_file_without_start_times_is_an_error_with_workers_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slotscope import app_log

    records = [{k: v for k, v in r.items() if k != "start"} for r in _jsonl(REAL / "before" / "logs" / "app.jsonl")]
    path = _write_jsonl(tmp_path / "app.jsonl", records)
    monkeypatch.setattr(app_log, "SPAN_BYTES", 2000)
    with pytest.raises(AppLogError, match="no start-time column") as serial:
        read_app_logs([path])
    with pytest.raises(AppLogError, match="no start-time column") as parallel:
        _read_with_workers(path, 2)
    assert (serial.value.line, str(serial.value)) == (parallel.value.line, str(parallel.value)) == (1, str(serial.value))


def test_a_stretch_without_start_times_drops_its_rows_not_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records without any start field in one chunk are dropped and counted; the rest load."""
    from slotscope import app_log

    records = _jsonl(REAL / "before" / "logs" / "app.jsonl")
    for r in records[:10]:
        del r["start"]
    monkeypatch.setattr(app_log, "CHUNK_ROWS", 10)
    log = read_app_logs([_write_jsonl(tmp_path / "app.jsonl", records)])
    assert len(log.calls) == len(records) - 10
    assert log.accounting.rows_dropped == 10 and log.accounting.problems[0].line == 1


def test_a_lone_surrogate_escape_is_replaced_not_raised(tmp_path: Path) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"); json.loads gives a text no table can
    hold, and reading such a log once ended in a UnicodeEncodeError traceback. It now reads
    like an invalid UTF-8 byte does: replaced by U+FFFD, the call kept."""
    records = _jsonl(REAL / "before" / "logs" / "app.jsonl")[:6]
    records[2]["user"] = "u\ud800x"
    records[4]["purpose"] = {"a\udc00": "b\ud83d"}  # in keys and nested values too
    path = _write_jsonl(tmp_path / "app.jsonl", records)
    assert b"\\ud800" in path.read_bytes()
    calls = read_app_logs([path]).calls.set_index("line")
    assert calls.loc[3, "user"] == "u\ufffdx"
    assert calls.loc[5, "purpose"] == '{"a\\ufffd": "b\\ufffd"}'
    assert len(calls) == 6 and calls["user"].notna().all()


def test_true_false_negative_and_fractional_values_are_no_readings(tmp_path: Path) -> None:
    """Real records with a JSON true for a count or a time, a negative count and a fractional
    one: pandas would read true as 1 (or 1970-01-01 as a time) and let -5 and 2.5 through.
    Each is missing instead, with a problem naming its line; the rest of the record stays."""
    real = _jsonl(REAL / "before" / "logs" / "app.jsonl")[:5]
    bent = [dict(real[0], prompt_tokens=True), dict(real[1], end=True), dict(real[2], completion_tokens=-5),
            dict(real[3], cached_tokens=2.5), dict(real[4], start=False)]
    log = read_app_logs([_write_jsonl(tmp_path / "app.jsonl", bent)])
    calls = log.calls.set_index("call_id")
    assert sorted(calls.index) == sorted(r["id"] for r in real[:4])  # (no start: the record is no call)
    assert pd.isna(calls.loc[real[0]["id"], "prompt_tokens"]) and calls.loc[real[0]["id"], "completion_tokens"] == real[0]["completion_tokens"]
    assert calls.loc[real[1]["id"], "end_at"] == pd.Timestamp(real[1]["start"]) + pd.Timedelta(milliseconds=real[1]["duration_ms"])
    assert pd.isna(calls.loc[real[2]["id"], "completion_tokens"]) and pd.isna(calls.loc[real[3]["id"], "cached_tokens"])
    said = {(p.line, p.reason) for p in log.accounting.problems}
    assert said == {(1, "non-numeric prompt_tokens: True"), (2, "unreadable end time: True"),
                    (3, "completion_tokens is no count: -5"), (4, "cached_tokens is no count: 2.5"),
                    (5, "unreadable start time: False")}


def test_a_csv_header_naming_a_column_twice_is_one_error(tmp_path: Path) -> None:
    header = ("request_id", "timestamp", "kind", "user_id", "adapter", "input_tokens", "output_tokens",
              "cached_tokens", "status_code", "error", "timestamp")
    path = _as_csv(tmp_path, header=header)
    with pytest.raises(AppLogError, match="the CSV header names 'timestamp' twice; rename one"):
        read_app_logs([path])


def test_app_columns_make_a_csv_of_unknown_names_an_app_log(tmp_path: Path) -> None:
    """A CSV whose names slotscope does not know is no app log by content; with --app-columns
    naming its columns it is one, and it reads like the JSONL it came from."""
    from slotscope.dataset import load

    header = ("ident", "when", "kind", "who", "adapter", "in", "out", "reused", "code", "err", "took")
    path = _as_csv(tmp_path / "", name="calls.csv", delimiter=";", header=header)
    (tmp_path / "llama-server.log").write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    assert load([tmp_path]).app is None
    columns = parse_column_spec("call_id=ident,start=when,purpose=kind,user=who,lora=adapter,prompt_tokens=in,"
                                "completion_tokens=out,cached_tokens=reused,status=code,error=err,duration_ms=took")
    ds = load([tmp_path], app_columns=columns)
    assert ds.app is not None and len(ds.app.calls) == 45
    assert (ds.matches.calls["match_method"] == "tokens+time").all()


def _spreadsheet_csv(tmp_path: Path, delimiter: str, number: Callable[[str, object], str],
                     name: str = "calls.csv") -> Path:
    """The real app log as a spreadsheet exports it: ``number(field, value)`` writes each number."""
    out = tmp_path / name
    with out.open("w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(["id", "start", "end", "purpose", "user", "prompt_tokens", "completion_tokens", "status",
                    "duration_ms"])
        for r in _jsonl(REAL / "before" / "logs" / "app.jsonl"):
            w.writerow([r["id"], r["start"], r["end"], r["purpose"], r["user"], number("prompt_tokens", r["prompt_tokens"]),
                        number("completion_tokens", r["completion_tokens"]), r["status"],
                        number("duration_ms", r["duration_ms"])])
    return out


def _german(field: str, value: object) -> str:
    """A number as a spreadsheet in a German locale shows it: 12.419 tokens, 9.244,8 ms."""
    return f"{value:,}".replace(",", "\0").replace(".", ",").replace("\0", ".")


@pytest.mark.parametrize("delimiter", [";", "\t"])
def test_a_spreadsheets_decimal_commas_read_as_the_jsonl(tmp_path: Path, delimiter: str) -> None:
    """A CSV from a spreadsheet in a decimal-comma locale (``9.244,8`` ms, ``12.419`` tokens):
    the calls of the JSONL it came from, and one note. It read each duration as missing (a
    problem per row, 'non-numeric duration_ms: ...') and each grouped count as no count."""
    want = read_app_logs([REAL / "before" / "logs" / "app.jsonl"]).calls
    path = _spreadsheet_csv(tmp_path, delimiter, _german)
    assert "12.419" in path.read_text() and "9.244,8" in path.read_text()
    log = read_app_logs([path])
    assert log.accounting.problems == () and log.accounting.rows_with_problems == 0
    cols = ["call_id", "start_us", "end_us", "duration_ms", "prompt_tokens", "completion_tokens", "status"]
    pd.testing.assert_frame_equal(log.calls[cols], want[cols])
    assert log.accounting.notes == (f"{path}: numbers read with a decimal comma (as line 2's duration_ms '9.244,8')",)


def test_decimal_commas_in_seconds_and_a_problem_quotes_them(tmp_path: Path) -> None:
    """``0,25`` seconds (a comma no thousands reading allows) is a quarter second; a count
    written ``2,5`` is a problem that quotes it as written."""
    path = tmp_path / "calls.csv"
    path.write_text("start;duration;prompt_tokens\n2026-11-29T07:31:47.961Z;0,25;2,5\n2026-11-29T07:32:47Z;1.234,5;7\n")
    log = read_app_logs([path])
    assert log.calls["duration_ms"].tolist() == [250.0, 1_234_500.0]
    assert [p.reason for p in log.accounting.problems] == ["prompt_tokens is no count: '2,5'"]
    assert log.calls["prompt_tokens"].tolist()[1] == 7


def test_a_file_with_both_decimal_marks_is_refused_in_one_line(tmp_path: Path) -> None:
    """A comma and a point each read as the decimal mark in one file: which one the others
    use cannot be told, so the file is refused naming both lines."""
    path = _spreadsheet_csv(tmp_path, ";", _german)
    lines = path.read_text().splitlines()
    lines[5] = lines[5].replace("86.160,6", "86160.6")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(AppLogError) as e:
        read_app_logs([path])
    assert str(e.value) == (f"{path}:6: duration_ms '86160.6' has a decimal point, but line 2's duration_ms "
                            "'9.244,8' a decimal comma; write the file's numbers with one decimal mark")


def test_numbers_no_mark_tells_apart_are_read_with_one_note(tmp_path: Path) -> None:
    """Durations written ``1.234`` (three decimals) where no number shows the file's mark:
    read as 1.234, and one note names the first and the other reading."""
    path = _spreadsheet_csv(tmp_path, "\t", lambda f, v: f"{v / 1000:.3f}" if f == "duration_ms" else str(v))
    log = read_app_logs([path])
    want = read_app_logs([REAL / "before" / "logs" / "app.jsonl"]).calls
    assert (log.calls["duration_ms"] - want["duration_ms"] / 1000).abs().max() < 1e-3
    assert log.accounting.notes == (f"{path}:2: duration_ms '9.245' read as 9.245: no number in the file shows "
                                    "whether '.' is its decimal mark or groups thousands (then 9245)",)


@pytest.mark.parametrize("chunk_rows", [1, 7, 10_000])
def test_decimal_commas_read_alike_in_chunks_of_any_size(tmp_path: Path, chunk_rows: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark a file shows holds for its chunks before and after; a number read by a guess
    before a later chunk showed the other mark is an error naming both lines."""
    from slotscope import app_log

    whole = read_app_logs([_spreadsheet_csv(tmp_path, ";", _german)]).calls
    monkeypatch.setattr(app_log, "CHUNK_ROWS", chunk_rows)
    pd.testing.assert_frame_equal(read_app_logs([_spreadsheet_csv(tmp_path, ";", _german)]).calls, whole)
    # the first duration a whole number of ms, grouped, '9.245': a comma only on the next line
    path = _spreadsheet_csv(tmp_path, ";", lambda f, v: "9.245" if v == 9244.8 else _german(f, v) if f == "duration_ms"
                            else str(v), "late.csv")
    if chunk_rows == 1:
        with pytest.raises(AppLogError, match=r"late.csv:2: duration_ms '9.245' was read as 9.245, with a decimal "
                           r"point, before line 3's duration_ms '6.250,1' showed a decimal comma"):
            read_app_logs([path])
    else:
        assert read_app_logs([path]).calls.set_index("line")["duration_ms"][2] == 9245.0


def test_a_json_array_reads_alike_in_parts_of_any_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real app log as an indented JSON array with a byte-order mark, a record that names a
    key twice, one that is no object and one missing its start: the same calls, problems and
    notes as the JSON lines, read in parts of 1 KB and 7 bytes too (a record, a number, a
    multi-byte character cut by a part's end), each call at the line its record starts on."""
    from slotscope import app_log

    records: list = _jsonl(REAL / "before" / "logs" / "app.jsonl")
    records[3]["user"] = "u\u00e9\u00e8"
    records.insert(5, [1, 2])
    del records[8]["start"]
    lines = [json.dumps(r) for r in records]
    lines[10] = lines[10][:-1] + ', "purpose": "other"}'  # the key twice: the last value counts
    jsonl = tmp_path / "app.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    doc = tmp_path / "app.json"
    pretty = "[\n" + ",\n".join("  " + ln for ln in lines) + "\n]\n"
    doc.write_text("\ufeff" + pretty)
    want = read_app_logs([jsonl])
    ref = read_app_logs([doc])
    moved = ref.calls.assign(line=ref.calls["line"] - 1)  # (the array's "[" line comes first)
    pd.testing.assert_frame_equal(moved.drop(columns="file"), want.calls.drop(columns="file"))
    assert ref.accounting.lines_read == pretty.count("\n") == want.accounting.lines_read + 2
    assert [(p.line - 1, p.reason) for p in ref.accounting.problems] == [(p.line, p.reason) for p in want.accounting.problems]
    assert [n.replace(str(doc), "F").replace(":12:", ":11:") for n in ref.accounting.notes] == [
        n.replace(str(jsonl), "F") for n in want.accounting.notes]
    for size in (1000, 7):
        monkeypatch.setattr(app_log, "SPAN_BYTES", size)
        got = _read_with_workers(doc, 2)
        pd.testing.assert_frame_equal(got.calls, ref.calls)  # type: ignore[attr-defined]
        assert got.accounting == ref.accounting  # type: ignore[attr-defined]


def test_a_json_array_cut_short_keeps_its_records_and_names_the_cut_one(tmp_path: Path) -> None:
    """An array cut inside a record (the writer crashed): the records before it are calls, the
    cut one a problem at its first line, every line counted."""
    records = _jsonl(REAL / "before" / "logs" / "app.jsonl")
    text = json.dumps(records, indent=2)
    starts = [i + 1 for i, ln in enumerate(text.splitlines()) if ln.startswith("  {")]
    cut = text[: text.index('"c-00010"')]
    path = tmp_path / "app.json"
    path.write_text(cut)
    log = read_app_logs([path])
    assert sorted(log.calls["line"]) == starts[:9]
    assert log.accounting.lines_read == cut.count("\n") + 1
    assert [(p.line, p.reason) for p in log.accounting.problems] == [(starts[9], "the file ends inside this record")]


def _french(field: str, value: object) -> str:
    """A number as a spreadsheet in a French locale shows it: 12 419 tokens, 9 244,8 ms (the
    groups split by a narrow no-break space)."""
    return f"{value:,}".replace(",", "\u202f").replace(".", ",")


def _american(field: str, value: object) -> str:
    """A number with its thousands grouped, as a spreadsheet in an English locale shows it."""
    return f"{value:,}"


_CALL_COLUMNS = ["call_id", "start_us", "end_us", "duration_ms", "prompt_tokens", "completion_tokens", "status"]


@pytest.mark.parametrize("delimiter,number,note", [
    (",", _french, "numbers with a comma and no grouping point read with a decimal comma (as line 2's "
                   "duration_ms '9\\u202f244,8')"),  # (the note shows the space as written)
    (";", _french, "numbers read with a decimal comma (as line 2's duration_ms '9\\u202f244,8')"),
    (",", _american, None),
])
@pytest.mark.parametrize("chunk_rows", [1, 7, 10_000])
def test_grouped_and_quoted_numbers_in_a_csv_read_as_the_jsonl(tmp_path: Path, delimiter: str, number: Callable,
                                                               note: str | None, chunk_rows: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The real app log from a spreadsheet that groups thousands by spaces (``12 419``) or
    quotes numbers with a comma in a comma-separated file (``"9244,8"``, ``"12,419"``): the
    calls of the JSONL, no problem and at most one note, in chunks of any size. They were a
    problem per row ("non-numeric duration_ms: '9244,8'", "non-numeric prompt_tokens: '2 281'")."""
    from slotscope import app_log

    monkeypatch.setattr(app_log, "CHUNK_ROWS", chunk_rows)
    want = read_app_logs([REAL / "before" / "logs" / "app.jsonl"]).calls
    path = _spreadsheet_csv(tmp_path, delimiter, number)
    text = path.read_text()
    assert ("\"9,244.8\"" if number is _american else "9\u202f244,8") in text and "12" in text
    log = read_app_logs([path])
    assert log.accounting.problems == () and log.accounting.rows_with_problems == 0
    pd.testing.assert_frame_equal(log.calls[_CALL_COLUMNS], want[_CALL_COLUMNS])
    assert log.accounting.notes == ((f"{path}: {note}",) if note else ())


def test_a_quoted_number_either_mark_reads_is_read_with_the_files_point(tmp_path: Path) -> None:
    """In a comma-separated file, ``"1,234"`` ms reads 1234 (its comma grouping thousands, as
    the file's other numbers have decimal points), ``"5,6"`` reads 5.6 (no grouping allows
    it), ``"2,5"`` tokens stay a problem that quotes them; one note names the first guess."""
    path = tmp_path / "calls.csv"
    path.write_text("start,duration_ms,prompt_tokens\n2026-11-29T07:31:47.961Z,12.5,7\n"
                    "2026-11-29T07:32:47Z,\"1,234\",8\n2026-11-29T07:33:47Z,\"5,6\",\"2,5\"\n"
                    "2026-11-29T07:34:47Z,\"1,234.5\",\"1 024\"\n")
    log = read_app_logs([path])
    assert log.calls["duration_ms"].tolist() == [12.5, 1234.0, 5.6, 1234.5]
    assert log.calls["prompt_tokens"].tolist()[:2] + log.calls["prompt_tokens"].tolist()[3:] == [7, 8, 1024]
    assert [(p.line, p.reason) for p in log.accounting.problems] == [(4, "prompt_tokens is no count: '2,5'")]
    assert log.accounting.notes == (
        f"{path}: numbers with a comma and no grouping point read with a decimal comma (as line 4's duration_ms '5,6')",
        f"{path}:3: duration_ms '1,234' read as 1234, its comma grouping thousands as the file's points are decimal "
        "ones (with a decimal comma: 1.234)")
