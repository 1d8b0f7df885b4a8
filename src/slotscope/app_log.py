"""App call log (JSONL or CSV, optionally gzip/zstd) -> calls table, one row per LLM call.

The application writes one record per call. Field names differ between applications, so each
field is found by common names (case-insensitive; dotted paths reach into nested objects, e.g.
``usage.prompt_tokens``) unless the caller maps it explicitly. Every line is accounted for:
loaded, empty, or a :class:`Problem` naming its file and line.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from os import PathLike, fspath
from typing import TYPE_CHECKING, Any, BinaryIO
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from .app_fields import (
    CANDIDATES, ALIASES, TIMINGS, csv_header, field_names, nested_paths, path_index, resolve_fields,
)
from .errors import AppLogError
from .sources import CHUNK_SIZE, Span, is_plain, iter_chunks, iter_spans, open_binary, read_span
from . import json_documents, store
from .store import StoredField
from .workers import Pool

if TYPE_CHECKING:
    from .decimal_marks import CommaCsvNumbers, DecimalMarks

_TIMING_COLS = tuple(f"timings_{k}" for k in TIMINGS)
CALL_COLUMNS: tuple[str, ...] = (
    "call_id", "start_at", "end_at", "duration_ms", "purpose", "user", "lora", "prompt_tokens",
    "completion_tokens", "cached_tokens", "status", "error", "ok", "file", "line", "start_us", "end_us",
    *_TIMING_COLS,
)
_DTYPES: dict[str, str] = {
    "call_id": "string", "start_at": "datetime64[us, UTC]", "end_at": "datetime64[us, UTC]",
    "duration_ms": "float64", "purpose": "category", "user": "category", "lora": "category",
    "prompt_tokens": "Int64", "completion_tokens": "Int64", "cached_tokens": "Int64", "status": "Int64",
    "error": "string", "ok": "bool", "file": "category", "line": "int64", "start_us": "int64", "end_us": "Int64",
    **{f"timings_{k}": t for k, t in TIMINGS.items()}, "session": "category", "turn": "Int64",
}
_NUMBER_FIELDS = ("start", "end", "duration_ms", "duration_s", "prompt_tokens", "completion_tokens", "cached_tokens",
                  "status", "turn", *_TIMING_COLS)
_COUNTS = frozenset(k for k in _NUMBER_FIELDS if _DTYPES.get(k) == "Int64")
CHUNK_ROWS = 10_000  # records parsed at a time: their dicts are ~3 KB each, the peak of reading
MAX_EXAMPLES = 5
SPAN_BYTES = CHUNK_SIZE  # a plain JSONL file is read in parts of this size by worker processes
_Rows = Iterator[tuple[int, dict[str, Any]]]  # (1-based line, record)
_EXTRA = "\x00extra"  # marks a CSV row with more cells than the header
_OK_WORDS = {"ok", "success", "succeeded", "completed", "done"}
_AWARE_RE = re.compile(r"\d\d:\d\d(?::\d\d(?:[.,]\d+)?)?\s*(?:Z|z|UTC|[+-]\d\d(?::?\d\d)?)$")  # a zone given


@dataclass(frozen=True)
class Problem:
    """One unusable line or field, where it is and what was wrong."""

    file: str
    line: int
    reason: str


@dataclass(frozen=True)
class AppAccounting:
    """What happened to every line read: loaded, empty, or a problem (first few kept).

    ``rows_with_problems`` counts loaded rows with an unusable field (left NA) as well as the
    ``rows_dropped`` ones (invalid JSON/CSV, no usable start time). ``lines_read`` is
    ``rows_loaded + rows_dropped + empty_lines`` plus CSV header and continuation lines.
    """

    lines_read: int
    rows_loaded: int
    rows_with_problems: int
    rows_dropped: int
    empty_lines: int
    problems: tuple[Problem, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class AppLog:
    """The calls table and the accounting of how it was read."""

    calls: pd.DataFrame = StoredField()  # type: ignore[assignment]
    accounting: AppAccounting  # type: ignore[misc]  # (StoredField above is no default: its __get__ raises on the class)


@dataclass
class _Tally:
    lines_read: int = 0
    empty_lines: int = 0
    problem_rows: int = 0
    dropped: int = 0
    examples: list[Problem] = field(default_factory=list)
    notes: dict[str, None] = field(default_factory=dict)  # ordered set
    header_line: int | None = None
    marks: DecimalMarks | CommaCsvNumbers | None = None  # how a CSV file's numbers with a comma or point read
    files: dict[str, int] = field(default_factory=dict)  # file -> order read
    naive: dict[str, tuple[int, str]] = field(default_factory=dict)  # file -> (count, zone)
    twice: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # file -> (records, first line, what)
    # file -> (line, message) of the first chunk without any start-time column: an error only if
    # no row of the file has a start time (a file with no such column at all, or a wrong mapping)
    no_start: dict[str, tuple[int, str]] = field(default_factory=dict)

    def flag(self, name: str, lines: np.ndarray, mask: np.ndarray, values: Sequence[Any], reason: str) -> None:
        for i in np.flatnonzero(mask)[:MAX_EXAMPLES]:
            value = values[i]
            value = value.item() if isinstance(value, np.generic) else value  # a number read by pyarrow
            self.examples.append(Problem(name, int(lines[i]), f"{reason}: {value!r}"))

    def drop(self, name: str, line: int, reason: str) -> None:
        self.examples.append(Problem(name, line, reason))
        self.problem_rows += 1
        self.dropped += 1

    def absorb(self, part: "_Tally", offset: int) -> None:
        """Add what reading a later part of the same file found (its lines counted from 1)."""
        self.lines_read += part.lines_read
        self.empty_lines += part.empty_lines
        self.problem_rows += part.problem_rows
        self.dropped += part.dropped
        self.examples += [Problem(p.file, p.line + offset, p.reason) for p in part.examples]
        self.notes.update(part.notes)
        for name, (n, zone) in part.naive.items():
            self.naive[name] = (self.naive.get(name, (0, zone))[0] + n, zone)
        for name, (n, line, what) in part.twice.items():
            had, line, what = self.twice.get(name, (0, line + offset, what))
            self.twice[name] = (had + n, line, what)
        for name, (line, message) in part.no_start.items():
            self.no_start.setdefault(name, (line + offset, message))

    def check_start_found(self, name: str, frames: Sequence[pd.DataFrame]) -> None:
        """Raise the missing start column as an error if no row of file ``name`` has a start."""
        if name in self.no_start and not any(len(f) for f in frames):
            line, message = self.no_start[name]
            raise AppLogError(name, line, message)


def parse_column_spec(spec: str) -> dict[str, str]:
    """Parse ``"start=ts,purpose=kind"`` into ``{"start": "ts", "purpose": "kind"}``."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, name = part.partition("=")
        if not sep or not key.strip() or not name.strip():
            raise ValueError(f"{part!r} is not FIELD=COLUMN (e.g. start=ts)")
        out[key.strip()] = name.strip()
    return _checked(out)


def load_column_file(path: str | PathLike[str]) -> dict[str, str]:
    """Read a column mapping from the ``[columns]`` table of a small TOML file."""
    import tomllib  # (here: only an --app-columns file needs it)

    with open(path, "rb") as f:
        table = tomllib.load(f).get("columns")
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ValueError(f"{fspath(path)}: expected a [columns] table of FIELD = \"column\" strings")
    return _checked(table)


def _checked(columns: Mapping[str, str]) -> dict[str, str]:
    out = {ALIASES.get(k.lower(), k.lower()): v for k, v in columns.items()}
    unknown = sorted(set(out) - set(CANDIDATES))
    if unknown:
        raise ValueError(f"unknown app-log field {', '.join(unknown)}; known: {', '.join(CANDIDATES)}")
    return out


def lora_label(value: Any) -> str:
    """Normalise a LoRA field (object, list of ``{id, scale}``, string, null) to a label.

    ``None``/scale 0 -> ``"none"``; ``{"name": "style-a", "scale": 1.0}`` -> ``"style-a@1.0"``;
    several active adapters are joined with ``+``.
    """
    if value is None or value is False or (isinstance(value, float) and np.isnan(value)):
        return "none"
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "{")):
            try:
                return lora_label(json.loads(text))
            except ValueError:
                pass
        return "none" if text.lower() in {"", "none", "null", "off", "false"} else text
    items = [value] if isinstance(value, dict) else value if isinstance(value, list) else None
    if items is None:
        return str(value)
    parts = []
    for item in items:
        if not isinstance(item, dict):
            if lora_label(item) != "none":
                parts.append(lora_label(item))
            continue
        name = next((item[k] for k in ("name", "id", "path") if item.get(k) is not None), "?")
        try:
            scale = float(item.get("scale", 1.0))
        except (TypeError, ValueError):
            scale = float("nan")
        if scale != 0:
            parts.append(f"{name}@{scale!r}")
    return "+".join(parts) or "none"


def read_app_logs(
    paths: Iterable[str | PathLike[str]], *, columns: Mapping[str, str] | None = None, tz: str | None = None
) -> AppLog:
    """Read app call logs (JSONL or CSV; gzip/zstd recognised by content) into one calls table.

    ``columns`` maps fields (``start``, ``purpose``, ... see :data:`CANDIDATES`) to column names
    and overrides detection; ``tz`` is the zone of timestamps written without one (default UTC).
    """
    tally, frames = _Tally(), []
    for p in paths:
        name = fspath(p)
        with open_binary(name) as stream:
            frames += _parse(name, iter_chunks(stream, name, SPAN_BYTES), columns, tz, tally)
    return _finish(frames, tally)


def read_app_log_stream(
    name: str, stream: BinaryIO, *, columns: Mapping[str, str] | None = None, tz: str | None = None,
    pool: Pool | None = None, on_disk: bool = False,
) -> AppLog:
    """Read one already-opened (and decompressed) stream, e.g. stdin, named ``name`` in messages.

    ``pool``: worker processes that read parts of a plain JSONL file at the same time (JSON
    decoding is most of the time); the result is the same. ``on_disk``: the calls table is
    written to ``$TMPDIR`` a column at a time as it is made (:class:`slotscope.store.StoredTable`;
    ``calls`` reads it back), never whole in memory.
    """
    if pool is not None and pool.jobs > 1 and is_plain(stream) and os.fstat(stream.fileno()).st_size > SPAN_BYTES:
        blocks: Iterable[bytes | Span] = iter_spans(stream, name, SPAN_BYTES)
    else:
        blocks, pool = iter_chunks(stream, name, SPAN_BYTES), None
    tally = _Tally()
    return _finish(_parse(name, blocks, columns, tz, tally, on_disk, pool), tally, on_disk)


def read_app_log_lines(
    name: str, lines: Iterable[bytes], *, columns: Mapping[str, str] | None = None, tz: str | None = None,
    on_disk: bool = False,
) -> AppLog:
    """Read one app call log given as lines of bytes (line endings optional); ``on_disk``: as
    in :func:`read_app_log_stream`."""
    lines = iter(lines)
    blocks = (b"".join(ln if ln.endswith(b"\n") else ln + b"\n" for ln in batch)
              for batch in iter(lambda: list(islice(lines, CHUNK_ROWS)), []))
    tally = _Tally()
    return _finish(_parse(name, blocks, columns, tz, tally, on_disk), tally, on_disk)


def _block_lines(block: bytes) -> list[bytes]:
    parts = block.split(b"\n")
    return parts[:-1] if block.endswith(b"\n") else parts


def _zone(tz: str | None) -> str:
    zone = tz or "UTC"
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {zone!r} (use an IANA name like Europe/Berlin)") from None
    return zone


def _parse(
    name: str, blocks: Iterable[bytes | Span], columns: Mapping[str, str] | None, tz: str | None, tally: _Tally,
    on_disk: bool = False, pool: Pool | None = None,
) -> list[Any]:
    """The chunks' tables of one log (``on_disk``: each waits on disk, and :func:`_finish`
    reads them a column at a time), from its blocks of whole lines. JSONL: each block read on
    its own (by the pool's workers, if any), by pyarrow where it can be (see
    :func:`_arrow_fields`); CSV: line by line."""
    keep = (lambda f: store.StoredTable(f, "app log chunk")) if on_disk else (lambda f: f)
    zone, override = _zone(tz), _checked(columns or {})
    tally.files.setdefault(name, len(tally.files))
    tally.header_line, tally.marks = None, None
    blocks = iter(blocks)
    first = next(blocks, None)
    if first is None:
        return []
    blocks = chain([first], blocks)
    head = read_span(Span(first.path, first.start, min(first.length, 1 << 16))) if isinstance(first, Span) else first
    text = head[: 1 << 16].decode("utf-8", "replace")
    if json_documents.is_document(text):
        whole = (read_span(b) if isinstance(b, Span) else b for b in blocks)
        frames = [keep(f) for f in _frames(name, _document_rows(name, whole, tally), override, zone, tally)]
    elif not text.lstrip("\ufeff").lstrip().startswith("{"):
        # (blank for 64 KiB: _rows finds the first line that is not)
        lines = chain.from_iterable(_block_lines(read_span(b) if isinstance(b, Span) else b) for b in blocks)
        frames = [keep(f) for f in _frames(name, _rows(name, lines, tally), override, zone, tally)]
        tally.notes.update(dict.fromkeys(tally.marks.notes() if tally.marks is not None else []))
    else:
        jobs = ((block, name, override, zone, i == 0) for i, block in enumerate(blocks))
        frames, before = [], tally.lines_read  # (of the files read before)
        for part_frames, part in (pool.map if pool is not None else map)(_block_frames, jobs):
            offset = tally.lines_read - before
            for f in part_frames:
                f["line"] += offset
            frames += [keep(f) for f in part_frames]
            del part_frames
            tally.absorb(part, offset)
    tally.check_start_found(name, frames)
    return frames


def _block_frames(job: tuple[bytes | Span, str, Mapping[str, str], str, bool]) -> tuple[list[pd.DataFrame], _Tally]:
    """The frames and tally of one block of JSONL lines, counted from 1 (in a worker, if any;
    ``bom``: the file's first lines, a byte-order mark may lead)."""
    block, name, override, zone, bom = job
    tally = _Tally(files={name: 0})
    data = read_span(block) if isinstance(block, Span) else block
    got = _arrow_fields(data, override)
    if got is not None:
        n, get = got
        tally.lines_read += n
        return [_table(name, np.arange(1, n + 1, dtype=np.int64), get, override, zone, tally)], tally
    numbered = enumerate(_decoded(_block_lines(data), tally, bom=bom), start=1)
    return list(_frames(name, _json_rows(name, numbered, tally), override, zone, tally)), tally


def _frames(name: str, rows: _Rows, override: Mapping[str, str], zone: str, tally: _Tally) -> Iterator[pd.DataFrame]:
    while chunk := list(islice(rows, CHUNK_ROWS)):
        yield _frame(name, chunk, override, zone, tally)


def _rows(name: str, lines: Iterable[bytes], tally: _Tally) -> _Rows:
    numbered = enumerate(_decoded(lines, tally), start=1)
    for lineno, text in numbered:
        if text.strip():
            break
        tally.empty_lines += 1
    else:
        return
    rest = chain([(lineno, text)], numbered)
    yield from (_json_rows if text.lstrip().startswith("{") else _csv_rows)(name, rest, tally)


def _decoded(lines: Iterable[bytes], tally: _Tally, bom: bool = True) -> Iterator[str]:
    """Lines as text (``bom``: these are a file's first lines, a byte-order mark may lead)."""
    for i, raw in enumerate(lines):
        tally.lines_read += 1
        text = raw.decode("utf-8", "replace")
        yield (text.lstrip("\ufeff") if i == 0 and bom else text).rstrip("\r\n")


class _Pairs:
    """JSON's object hook: the last value of a key counts, as in json.loads; ``twice`` keeps
    the objects (with their pairs) that name a key twice, for the record being read."""

    def __init__(self) -> None:
        self.twice: list[tuple[dict[str, Any], list[tuple[str, Any]]]] = []

    def __call__(self, items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(items)
        if len(obj) < len(items):
            self.twice.append((obj, items))
        return obj


def _record(name: str, lineno: int, rec: Any, text: str, pairs: _Pairs, tally: _Tally) -> dict[str, Any] | None:
    """A decoded JSON value as a call record (None: dropped, with the reason kept)."""
    if not isinstance(rec, dict):
        tally.drop(name, lineno, f"not a JSON object: {text[:40]!r}")
        return None
    if pairs.twice:
        n, line, what = tally.twice[name] if name in tally.twice else (0, lineno, _named_twice(rec, *pairs.twice[-1]))
        tally.twice[name] = (n + 1, line, what)
    if "\\ud" in text or "\\uD" in text:  # maybe a lone surrogate escape: not text anything can write
        rec = _no_surrogates(rec)
    return rec


def _json_rows(name: str, numbered: Iterable[tuple[int, str]], tally: _Tally) -> _Rows:
    pairs = _Pairs()
    decode = json.JSONDecoder(object_pairs_hook=pairs).decode
    for lineno, text in numbered:
        if not text.strip():
            tally.empty_lines += 1
            continue
        pairs.twice.clear()
        try:
            value = decode(text)
        except json.JSONDecodeError as e:
            tally.drop(name, lineno, f"invalid JSON: {e.msg} (column {e.colno})")
            continue
        if (rec := _record(name, lineno, value, text, pairs, tally)) is not None:
            yield lineno, rec


def _document_rows(name: str, blocks: Iterable[bytes], tally: _Tally) -> _Rows:
    """The records of a JSON document (an array, or pretty-printed objects one after another;
    see :mod:`slotscope.json_documents`), each at the line it starts on; the document's lines
    are counted, those outside a record's first line known and ignored."""
    pairs = _Pairs()
    values = json_documents.Records(blocks, json.JSONDecoder(object_pairs_hook=pairs).raw_decode)
    before = tally.lines_read
    try:
        for lineno, value, text in values:
            tally.lines_read = before + values.lines
            if (rec := _record(name, lineno, value, text, pairs, tally)) is not None:
                yield lineno, rec
            pairs.twice.clear()
    except json_documents.DocumentError as e:
        raise AppLogError(name, e.line, f"{e.reason}; a JSON document cannot be read on past a bad record: mend "
                          "it, or write one record per line (JSONL), where a bad line is dropped") from None
    tally.lines_read = before + values.lines
    if values.cut_at is not None:
        tally.drop(name, values.cut_at, "the file ends inside this record")


def _named_twice(rec: dict[str, Any], obj: dict[str, Any], items: list[tuple[str, Any]]) -> str:
    """What a record that names a key twice in ``obj`` (one of its objects, with its ``items``
    as written) has: the key's path in the record and its first and last values."""
    key = next(k for k, _ in items if sum(k == other for other, _ in items) > 1)
    values = [json.dumps(v)[:40] for k, v in items if k == key]

    def path(value: Any, prefix: str) -> str | None:
        if value is obj:
            return prefix
        inner = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for k, v in inner:
            found = path(v, f"{prefix}[{k}]" if isinstance(value, list) else f"{prefix}.{k}" if prefix else str(k))
            if found is not None:
                return found
        return None

    where = path(rec, "")
    return f"a record names {(f'{where}.' if where else '') + key!r} twice ({values[0]}, then {values[-1]})"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_surrogates(value: Any) -> Any:
    """``value`` with each lone surrogate (which JSON's ``\\ud800`` escapes allow) in its texts
    replaced by U+FFFD, as invalid UTF-8 bytes are: no table or text output can hold one."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_no_surrogates(k): _no_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_surrogates(v) for v in value]
    return value


def _csv_rows(name: str, numbered: Iterable[tuple[int, str]], tally: _Tally) -> _Rows:
    numbered = iter(numbered)
    first, header_text = next(numbered)
    header, delimiter = csv_header(header_text)
    twice = sorted({h for h in header if h and header.count(h) > 1})
    if twice:  # (which of the two columns is meant cannot be told: neither is read silently)
        raise AppLogError(name, first, f"the CSV header names {', '.join(map(repr, twice))} twice; rename one "
                          "(--app-columns maps a field to a column name)")
    tally.header_line = first
    from .decimal_marks import CommaCsvNumbers, DecimalMarks  # (a CSV's numbers only: JSONL needs none of it)

    # (A spreadsheet that writes decimal commas separates fields with another mark, or quotes them.)
    tally.marks = DecimalMarks(name) if delimiter != "," else CommaCsvNumbers(name)
    reader, done = csv.reader((text + "\n" for _, text in numbered), delimiter=delimiter), 0  # (newlines kept in quotes)
    while True:
        start = first + 1 + done
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            tally.drop(name, start, f"unreadable CSV: {e}")
            done = reader.line_num
            continue
        done = reader.line_num
        if not any(c.strip() for c in cells):
            tally.empty_lines += 1
            continue
        rec = {h: (c if c.strip() else None) for h, c in zip(header, cells)}
        if len(cells) > len(header):
            rec[_EXTRA] = f"{len(cells)} fields, the header has {len(header)}"
        yield start, rec


def _shapes(records: Sequence[Mapping[str, Any]], override: Mapping[str, str]) -> tuple[np.ndarray, list[int]]:
    """Each record's shape (its keys, and those of the objects a field could be inside) as a
    number, and one record of each shape."""
    nested = nested_paths(override)
    deeper: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}  # per (prefix, keys): keys to look into

    def signature(obj: Mapping[str, Any], prefix: tuple[str, ...]) -> Any:
        keys = tuple(obj)
        into = deeper.get((prefix, keys))
        if into is None:
            into = deeper[(prefix, keys)] = [k for k in keys if ".".join((*prefix, k)).lower() in nested]
        if not into:
            return keys
        inner = tuple((k, signature(obj[k], (*prefix, k))) for k in into if isinstance(obj[k], dict))
        return (keys, inner) if inner else keys

    number: dict[Any, int] = {}
    shape = np.empty(len(records), dtype=np.int64)
    first: list[int] = []
    for i, rec in enumerate(records):
        sig = signature(rec, ())
        k = number.get(sig)
        if k is None:
            k = number[sig] = len(first)
            first.append(i)
        shape[i] = k
    return shape, first


def _field_values(records: Sequence[Mapping[str, Any]], override: Mapping[str, str]) -> dict[str, list[Any]]:
    """Each field's value in each record, read where that record has it: the first of the
    field's names (:data:`CANDIDATES`) present in the record itself. Records of other shapes in
    the same log (another name for a field, or a field nested differently) never hide it."""
    shape, first = _shapes(records, override)
    paths = [resolve_fields(path_index([records[i]], override), override) for i in first]
    values: dict[str, list[Any]] = {}
    for key in dict.fromkeys(k for fields in paths for k in fields):
        ways = {fields[key] for fields in paths if key in fields}
        if len(ways) == 1:  # a record without the field has none of its names: read as None
            values[key] = _pluck(records, next(iter(ways)))
            continue
        out: list[Any] = [None] * len(records)
        for way in ways:
            at = np.flatnonzero(np.isin(shape, [s for s, fields in enumerate(paths) if fields.get(key) == way]))
            rows = at.tolist()
            for i, v in zip(rows, _pluck([records[i] for i in rows], way)):
                out[i] = v
        values[key] = out
    return values


_OPEN, _CLOSE, _NL, _CR = ord("{"), ord("}"), ord("\n"), ord("\r")
# Text fields are printed with str(): read from pyarrow only as types whose Python values are
# the very ones json.loads gives (a double column may hold what JSON wrote as an integer).
_TEXT_FIELDS = ("call_id", "purpose", "user", "error", "session", "status")  # status: also read as a number
_AS_TEXT = (pa.types.is_string, pa.types.is_large_string, pa.types.is_int64, pa.types.is_boolean, pa.types.is_null)
_AS_NUMBER = (*_AS_TEXT, pa.types.is_float64)
_LORA_NAMES = ("name", "id", "path")  # what lora_label reads of an adapter object, besides scale


def _arrow_fields(block: bytes, override: Mapping[str, str]) -> tuple[int, dict[str, Sequence[Any]]] | None:
    """``(lines, get)``: the block's line count and each field's values exactly as
    :func:`_field_values` reads them from its records, read by pyarrow's JSON reader (a few
    times faster than json.loads and per-record lookups); None where that could differ, and
    the block is read record by record.

    It is read so when every line is one object on its own ('{' first, '}' last, an '\r' at
    most after it: no blank line, no object across lines or two on one), pyarrow reads it
    (valid JSON, no duplicate key, one type per field: else it refuses; valid UTF-8: checked),
    and each field reads the same from the block's columns as from a record's own keys:

    - where a field has several of its names in the block, the first is set in every row where
      a later one is (a record without it would have been read from the later name);
    - text fields are strings, integers, booleans or null (str() prints them as written);
    - numbers are below 2**53 (beyond that pyarrow's double is not the integer's float);
    - a LoRA value is text, a number, a boolean, null or an object of such values (no list);
    - a LoRA object gives a scale wherever it has one (absent and null scales differ).
    """
    n = _object_lines(block)
    if n is None:
        return None
    table = _json_table(block, n)
    if table is None:
        return None
    found = _arrow_paths(table, nested_paths(override))
    if found is None:
        return None
    index, arrays = found
    fields = resolve_fields(index, override)
    if "start" not in fields or _EXTRA.lower() in index:
        return None
    names = field_names(override)
    get: dict[str, Sequence[Any]] = {}
    for key, path in fields.items():
        if _hidden_by_later_name([arrays[index[name.lower()]] for name in names[key] if name.lower() in index]):
            return None
        got = _arrow_values(key, arrays[path])
        if got is None:
            return None
        get[key] = got
    return n, get


def _object_lines(block: bytes) -> int | None:
    """How many lines the block has, if each is one JSON object on its own ('{' first, '}'
    last, an '\\r' at most after it); else None."""
    buf = np.frombuffer(block, dtype=np.uint8)
    if not len(buf):
        return None
    ends = np.flatnonzero(buf == _NL)
    if not len(ends) or ends[-1] != len(buf) - 1:
        ends = np.append(ends, len(buf))
    starts = np.concatenate(([0], ends[:-1] + 1))
    last = ends - 1
    last -= buf[np.maximum(last, 0)] == _CR
    # (an empty line's first byte is its newline: it fails the first test)
    if not ((buf[starts] == _OPEN).all() and (buf[last] == _CLOSE).all()):
        return None
    return len(ends)


def _json_table(block: bytes, rows: int) -> pa.Table | None:
    """The block read by pyarrow's JSON reader, one chunk; None where it refuses the block
    (invalid JSON or UTF-8, a duplicate key, a field of two types) or reads other than
    ``rows`` records."""
    try:
        table = pa_json.read_json(io.BytesIO(block), read_options=pa_json.ReadOptions(use_threads=False,
                                                                                    block_size=len(block) + 1))
        table.validate(full=True)  # the reader keeps invalid UTF-8 in strings; this refuses it
    except (pa.ArrowInvalid, UnicodeDecodeError, ValueError):
        return None
    return table.combine_chunks() if table.num_rows == rows else None


def _arrow_paths(table: pa.Table, nested: set[str]) -> tuple[dict[str, tuple[str, ...]], dict[tuple[str, ...], pa.Array]] | None:
    """:func:`slotscope.app_fields.path_index` of the table's columns (and of the fields of
    the objects a field could be inside), and each path's array; None where two paths differ
    only by case (records may each have their own)."""
    index: dict[str, tuple[str, ...]] = {}
    arrays: dict[tuple[str, ...], pa.Array] = {}

    def walk(fields: Iterable[pa.Field], values: Iterable[pa.Array], prefix: tuple[str, ...]) -> bool:
        for f, arr in zip(fields, values):
            path = (*prefix, f.name)
            dotted = ".".join(path).lower()
            if dotted in index:
                return False
            index[dotted] = path
            arrays[path] = arr
            if dotted in nested and pa.types.is_struct(f.type):
                if not walk(f.type, [pc.struct_field(arr, [i]) for i in range(f.type.num_fields)], path):
                    return False
        return True

    if not walk(table.schema, [c.chunk(0) if c.num_chunks else pa.nulls(0, c.type) for c in table.columns], ()):
        return None
    return index, arrays


def _hidden_by_later_name(there: list[pa.Array]) -> bool:
    """Whether the first of a field's names present (``there``, in name order) is missing in
    a row where a later one is set (a record without it is read from the later name)."""
    if len(there) < 2:
        return False
    later = functools.reduce(pc.or_, [arr.is_valid() for arr in there[1:]])
    return bool(pc.any(pc.and_(later, there[0].is_null())).as_py())


def _arrow_values(key: str, arr: pa.Array) -> Sequence[Any] | None:
    """A field's values from its column as :func:`_field_values` reads them from the records
    (LoRA values: their labels); None where they could differ."""
    if key == "lora":
        return _arrow_lora_labels(arr)
    if not any(ok(arr.type) for ok in (_AS_TEXT if key in _TEXT_FIELDS else _AS_NUMBER)):
        return None
    if _number_type(arr.type) and _beyond_exact_integers(arr):
        return None
    if key not in _TEXT_FIELDS and (_number_type(arr.type) or pa.types.is_null(arr.type)):
        # Read as numbers only: floats, NaN where missing (what _numbers makes of ints, floats, None).
        return arr.cast(pa.float64()).to_numpy(zero_copy_only=False)
    return arr.to_pylist()


def _number_type(t: pa.DataType) -> bool:
    return pa.types.is_int64(t) or pa.types.is_float64(t)


def _beyond_exact_integers(arr: pa.Array) -> bool:
    """Whether a number column holds a finite value of 2**53 or more (infinities are JSON's own)."""
    if pa.types.is_floating(arr.type):
        arr = pc.filter(arr, pc.is_finite(arr))
    big = pc.max(pc.abs(arr)).as_py()
    return big is not None and big >= 2.0**53


def _arrow_lora_labels(arr: pa.Array) -> list[str] | None:
    """Each row's :func:`lora_label`, made once per distinct value; None where the column's
    Python values could label differently from the records' own (see :func:`_arrow_fields`).

    A LoRA object's label reads its name, id, path and scale: rows alike in those (and in being
    an object at all) are one value. A null name, id or path reads as an absent one; a null
    scale does not (absent is 1.0), so a scale must be set in every object.
    """
    t = arr.type
    if pa.types.is_struct(t):
        parts = [_exact_text(arr.is_valid())]
        for i in range(t.num_fields):
            f, child = t.field(i), pc.struct_field(arr, [i])
            if f.name in _LORA_NAMES:
                if not any(ok(f.type) for ok in _AS_TEXT):
                    return None
            elif f.name == "scale":
                if not any(ok(f.type) for ok in _AS_NUMBER) or child.null_count != arr.null_count:
                    return None
                if _number_type(f.type) and _beyond_exact_integers(child):
                    return None
            else:
                continue
            parts.append(_exact_text(child))
        key = pc.binary_join_element_wise(*parts, "") if len(parts) > 1 else parts[0]
    elif any(ok(t) for ok in _AS_TEXT):
        key = arr
    else:
        return None
    codes = pc.dictionary_encode(key)
    idx = codes.indices.fill_null(len(codes.dictionary)).to_numpy(zero_copy_only=False)
    _, first = np.unique(idx, return_index=True)
    table = np.empty(len(codes.dictionary) + 1, dtype=object)
    for row in first.tolist():
        table[idx[row]] = lora_label(arr[row].as_py())
    return table[idx].tolist()


def _exact_text(arr: pa.Array) -> pa.Array:
    """Text that tells every value of ``arr`` apart, null included, and can be joined with
    others' without two joins reading alike: a validity mark, the length, then the value."""
    text = pc.cast(arr, pa.string()) if not pa.types.is_null(arr.type) else pa.nulls(len(arr), pa.string())
    size = pc.cast(pc.utf8_length(text), pa.string())
    valid = pc.if_else(arr.is_valid(), "v", "n")
    return pc.binary_join_element_wise(valid, pc.fill_null(size, "0"), ":", pc.fill_null(text, ""), "")


def _pluck(records: Sequence[Mapping[str, Any]], path: tuple[str, ...]) -> list[Any]:
    out = []
    for r in records:
        v: Any = r
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        out.append(v)
    return out


def _numbers(values: Sequence[Any]) -> tuple[pd.Series, np.ndarray]:
    """The values as floats (NaN where missing or unusable) and where a value was unusable.
    A JSON true or false is no number (pandas would read it as 1 or 0)."""
    raw = pd.Series(values, dtype=object)
    kind = pd.api.types.infer_dtype(raw, skipna=True)
    if kind == "boolean" or kind.startswith("mixed"):
        raw = raw.mask(raw.map(lambda v: isinstance(v, (bool, np.bool_))).astype(bool), "true or false")
    try:
        num = pd.to_numeric(raw, errors="coerce").astype("float64")
    except OverflowError:  # pandas gives up on the whole column for one such integer
        num = pd.Series([_float_or_nan(v) for v in raw], dtype="float64")
    num = num.where(np.isfinite(num))
    return num, (raw.notna() & num.isna()).to_numpy()


def _float_or_nan(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def _times_us(values: Sequence[Any], zone: str) -> tuple[pd.Series, np.ndarray, int]:
    """Epoch µs (float, NaN where unusable), the bad mask, and how many were read in ``zone``."""
    # Text with a colon is a clock time, never a number: only the rest is tried as one.
    clock = np.fromiter((isinstance(v, str) and ":" in v for v in values), dtype=bool, count=len(values))
    num = pd.Series(np.full(len(values), np.nan))
    rest = np.flatnonzero(~clock)
    if len(rest):
        num.iloc[rest] = _numbers([values[i] for i in rest.tolist()])[0].to_numpy()
    mag = num.abs()
    us = num * np.select([mag < 1e11, mag < 1e14, mag < 1e17], [1e6, 1e3, 1.0], 1e-3)  # s, ms, µs, ns
    raw = pd.Series(values, dtype=object)
    text = raw[num.isna() & raw.notna()].astype(str)
    # (a copy: pandas 2.2 marks what a .dt method returns, and warns on stderr when it is changed)
    parsed = pd.to_datetime(text, format="ISO8601", utc=True, errors="coerce").dt.as_unit("us").copy()
    naive = ~text.str.contains(_AWARE_RE) & parsed.notna()
    if naive.any() and zone != "UTC":  # parsed as UTC wall time: re-read that wall time in `zone`
        local = parsed[naive].dt.tz_localize(None).dt.tz_localize(zone, ambiguous="NaT", nonexistent="NaT")
        parsed[naive] = local.dt.tz_convert("UTC")
    us[text.index] = np.where(parsed.notna(), parsed.array.asi8, np.nan)
    us = us.round()
    return us, (raw.notna() & us.isna()).to_numpy(), int(naive.sum())


def _text(values: Sequence[Any]) -> pd.Series:
    if pd.api.types.infer_dtype(values, skipna=True) in ("string", "empty"):
        text = pd.Series(values, dtype="string")
        return text.mask(text.str.strip() == "")

    def one(v: Any) -> Any:
        if v is None or v is False or v == "":
            return None
        if isinstance(v, dict) and "message" in v:
            return str(v["message"])
        return json.dumps(v) if isinstance(v, (dict, list)) else str(v)

    return pd.Series([one(v) for v in values], dtype="string")


def _frame(
    name: str, chunk: list[tuple[int, dict[str, Any]]], override: Mapping[str, str], zone: str, tally: _Tally
) -> pd.DataFrame:
    lines = np.fromiter((ln for ln, _ in chunk), dtype=np.int64, count=len(chunk))
    records = [rec for _, rec in chunk]
    get = _field_values(records, override)
    if "start" not in get:  # none of these rows has a start time; no row of the file: an error
        looked = override.get("start") or ", ".join(CANDIDATES["start"])
        found = ", ".join([k for k in records[0] if k != _EXTRA][:10])
        tally.no_start.setdefault(name, (tally.header_line or int(lines[0]), f"no start-time column found (looked "
                                         f"for {looked}; found {found}); pass --app-columns start=NAME"))
        get["start"] = [None] * len(records)
    extra = [r.get(_EXTRA) for r in records]
    if any(e is not None for e in extra):
        get[_EXTRA] = extra
    as_read: dict[str, Sequence[Any]] = {}
    if tally.marks is not None:
        numbers = tally.marks.read(lines, {k: get[k] for k in _NUMBER_FIELDS if k in get}, _COUNTS)
        as_read = {k: get[k] for k in numbers}
        get.update(numbers)
    if "lora" in get:
        get["lora"] = [lora_label(v) for v in get["lora"]]
    return _table(name, lines, get, override, zone, tally, as_read)


def _in_range(value: pd.Series, scale: float, key: str, check: Callable[[str, np.ndarray, str], None]) -> pd.Series:
    """``value`` with what is beyond an exact integer of a float (2**53, after ``scale``: a
    count, or a duration's microseconds) as missing, flagged: such a count or time is no
    reading, and would not fit the table's integer and time columns."""
    out = value.abs() * scale >= 2.0**53
    if not out.any():
        return value
    check(key, out.to_numpy(), f"{key} out of range")
    return value.mask(out)


def _table(
    name: str, lines: np.ndarray, get: Mapping[str, Sequence[Any]], override: Mapping[str, str], zone: str, tally: _Tally,
    as_read: Mapping[str, Sequence[Any]] | None = None,
) -> pd.DataFrame:
    """The calls of one chunk from each field's values (``get``, see :func:`_field_values`; LoRA
    values as their :func:`lora_label`; ``as_read``: the text of those read from other text,
    which a problem quotes)."""
    for key, col in override.items():
        if key not in get and key != "timings":
            tally.notes[f"{name}: column {col!r} for {key} not found"] = None
    bad = np.zeros(len(lines), dtype=bool)

    def check(key: str, mask: np.ndarray, reason: str) -> None:
        nonlocal bad
        tally.flag(name, lines, mask, (as_read or {}).get(key, get[key]), reason)
        bad |= mask

    if _EXTRA in get:
        check(_EXTRA, np.array([e is not None for e in get[_EXTRA]], dtype=bool), "too many CSV fields")
    out = pd.DataFrame({"file": name, "line": lines})
    start, mask, naive = _times_us(get["start"], zone)
    check("start", mask, "unreadable start time")
    check("start", start.isna().to_numpy() & ~mask, "no start time")
    end = pd.Series(np.nan, index=out.index)
    if "end" in get:
        end, mask, naive_end = _times_us(get["end"], zone)
        check("end", mask, "unreadable end time")
        naive += naive_end
    if naive:
        tally.naive[name] = (tally.naive.get(name, (0, zone))[0] + naive, zone)
    duration = pd.Series(np.nan, index=out.index)
    for key, factor in (("duration_s", 1000.0), ("duration_ms", 1.0)):  # ms wins when both exist
        if key in get:
            value, mask = _numbers(get[key])
            check(key, mask, f"non-numeric {key}")
            duration = _in_range(value * factor, 1000.0, key, check)
    out["start_us"] = start
    out["end_us"] = end.fillna((start + duration * 1000).round())
    out["duration_ms"] = duration.fillna((out["end_us"] - start) / 1000)
    check("start", (out["end_us"] < start).to_numpy(), "ends before it starts; start")
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens", "status", "turn", *_TIMING_COLS):
        if key in get:
            value, mask = _numbers(get[key])
            if key != "status":  # a textual status ("ok", "failed") is read below, not a problem
                check(key, mask, f"non-numeric {key}")
            if _DTYPES[key] == "Int64" and key != "status":  # (a count: whole and not negative)
                odd = value.notna() & ((value < 0) | (value != value.round()))
                check(key, odd.to_numpy(), f"{key} is no count")
                value = value.mask(odd)
            out[key] = _in_range(value.round(), 1.0, key, check) if _DTYPES[key] == "Int64" else value
    for key in ("purpose", "user", "error", "session"):
        if key in get:
            out[key] = _text(get[key])
    if "lora" in get:  # an absent column stays NA: without it a request may well have had LoRA on
        out["lora"] = get["lora"]
    no_text = pd.Series(pd.NA, index=out.index, dtype="string")
    ids = _text(get["call_id"]) if "call_id" in get else no_text
    no_id = np.flatnonzero(ids.isna().to_numpy())
    if len(no_id):  # a call without an id is named by its place
        ids = ids.copy()
        ids.iloc[no_id] = [f"{name}:{ln}" for ln in lines[no_id].tolist()]
    out["call_id"] = ids
    status = out.get("status", pd.Series(np.nan, index=out.index))
    # Without a numeric status a call is fine with no status word or an OK word.
    word_ok = np.ones(len(out), dtype=bool)
    no_number = np.flatnonzero(status.isna().to_numpy())
    if "status" in get and len(no_number):
        words = _text([get["status"][i] for i in no_number.tolist()]).str.lower()
        word_ok[no_number] = (words.isna() | words.isin(_OK_WORDS)).to_numpy()
    fine = status.between(200, 299) | (status.isna() & word_ok)
    out["ok"] = fine & out.get("error", no_text).isna()
    tally.problem_rows += int(bad.sum())
    keep = out["start_us"].notna()
    tally.dropped += int((~keep).sum())
    return out[keep]


def _repeats(col: pd.Series) -> int:
    """``col.duplicated().sum()`` of a text column, from its values sorted by pyarrow: no hash
    table of Python strings (several times the size of the sorted values)."""
    values = pa.array(col.array)  # (pyarrow's own where pandas keeps it so)
    nulls = values.null_count
    values = values.drop_null()
    if len(values) < 2:
        return max(nulls - 1, 0)
    ordered = values.take(pc.sort_indices(values))
    if isinstance(ordered, pa.ChunkedArray):
        ordered = ordered.combine_chunks()
    same = pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))
    return int(pc.sum(same).as_py() or 0) + max(nulls - 1, 0)


class _Chunks:
    """The chunks' tables, their columns apart (each is a block of its own as the chunks are
    made), joined a column at a time: a column popped once joined frees its memory. A column
    is joined as a join of the whole tables makes it (gaps where a chunk lacks it)."""

    def __init__(self, frames: list[Any]) -> None:
        self.sizes = [len(f) for f in frames]
        self.present = {c for f in frames for c in f.columns}
        self.parts: list[dict[str, pd.Series] | store.Columns] = [
            store.Columns(f) if isinstance(f, store.StoredTable) else {c: f[c] for c in f.columns} for f in frames]

    def pop(self, d: "dict[str, pd.Series] | store.Columns", c: str) -> pd.Series:
        """Column ``c`` of a chunk, no longer held by it (one on disk is read)."""
        return d.pop(c) if isinstance(d, dict) else d[c]

    def joined(self, c: str) -> pd.Series:
        parts = [self.pop(d, c).to_frame(c).set_axis(pd.RangeIndex(n)) if c in d else pd.DataFrame(index=pd.RangeIndex(n))
                 for d, n in zip(self.parts, self.sizes)]
        return pd.concat(parts, ignore_index=True)[c]

    def joined_codes(self, c: str) -> tuple[np.ndarray, pd.Index]:
        """``pd.factorize(self.joined(c))`` of a column every chunk has, a chunk at a time: a
        chunk has one file name, and the joined names (as read, a text per call) need not be
        held whole."""
        parts = [pd.factorize(self.pop(d, c)) for d in self.parts]
        names = pd.Index(pd.concat([u.to_series() for _, u in parts], ignore_index=True).unique())
        out = np.empty(sum(self.sizes), dtype=np.int64)
        at = 0
        for (k, u), n in zip(parts, self.sizes):
            out[at:at + n] = names.get_indexer(u)[k]
            at += n
        return out, names

    def discard(self) -> None:
        """Remove the chunks' files (now read) now, not when the collector finds them."""
        for d in self.parts:
            if isinstance(d, store.Columns):
                d.table.discard()
        self.parts.clear()


def _finish(frames: list[Any], tally: _Tally, on_disk: bool = False) -> AppLog:
    """The calls table of the chunks' tables (``frames``, emptied), sorted by start, and its
    accounting. ``on_disk``: the chunks wait on disk (see :func:`_parse`) and each finished
    column goes there.

    The chunks are joined a column at a time, each sorted and cast to its dtype as it is
    joined, and the chunks' column then dropped: the calls are held twice at most (the chunks
    and the result), not four times (joined, sorted, completed, cast); on disk, a few columns.
    """
    frames = frames or [pd.DataFrame(columns=list(CALL_COLUMNS))]
    chunks = _Chunks(frames)
    frames.clear()  # (the caller's list: its tables, now in ``chunks``)
    order, file, keys = _call_order(chunks, tally)
    extra = [c for c in ("session", "turn") if c in chunks.present]
    index = pd.RangeIndex(len(order))
    writer = store.ColumnWriter("app calls") if on_disk else None
    out: dict[str, pd.Series] = {}
    put: Callable[[str, pd.Series], None] = writer.add if writer is not None else out.__setitem__
    put("file", file)
    dup = early = 0
    # The call ids last: their check for repeats (a hash of every id) then runs beside the
    # last of the chunks, not all of them.
    for c in sorted([*CALL_COLUMNS, *extra], key=lambda c: c == "call_id"):
        if c in ("start_at", "end_at", "file"):
            continue
        col = ((keys.pop(c) if c in keys else chunks.joined(c)).take(order).set_axis(index) if c in chunks.present
               else pd.Series(np.nan, index=index))
        if c in ("start_us", "end_us"):  # (the wall times from the values as read, before the cast)
            put(c[:-3] + "_at", pd.to_datetime(col, unit="us", utc=True).dt.as_unit("us"))
        col = col.astype(_DTYPES[c])
        if c == "call_id":
            dup = _repeats(col)
        elif c == "start_us":
            early = int((col < 946_684_800_000_000).sum())  # 2000-01-01
        put(c, col)
        del col  # (freed before the next column is made)
    chunks.discard()
    columns = [*CALL_COLUMNS, *extra]
    table = writer.done(columns) if writer is not None else \
        pd.DataFrame({c: out.pop(c) for c in columns}, copy=False)  # (not consolidated: no copy)
    return AppLog(table, _accounting(tally, len(table), dup, early))


def _call_order(chunks: _Chunks, tally: _Tally) -> tuple[np.ndarray, pd.Series, dict[str, pd.Series]]:
    """The calls' order (by start, then file in reading order, then line), their file column
    in that order, and the sort keys as joined (``line``, ``start_us``: not joined again)."""
    codes, names = chunks.joined_codes("file")
    keys = {c: chunks.joined(c) for c in ("line", "start_us")}
    file_order = np.array([tally.files[n] for n in names], dtype=np.int64)[codes]
    order = np.lexsort((keys["line"].to_numpy(), file_order, keys["start_us"].to_numpy()))
    del file_order
    # The file names (a name per call: as read, the largest column) as the category column
    # their cast gives, from their codes: categories sorted, in the names' own type.
    cats = names.sort_values()
    file = pd.Series(pd.Categorical.from_codes(np.argsort(names.argsort())[codes[order]], dtype=pd.CategoricalDtype(cats)))
    return order, file, keys


def _accounting(tally: _Tally, n_calls: int, dup: int, early: int) -> AppAccounting:
    """What reading the app logs found, with the notes on the calls as a whole."""
    for name, (n, zone) in tally.naive.items():
        tally.notes[f"{name}: {n} timestamp(s) without a zone read as {zone} (set --tz if wrong)"] = None
    for name, (n, line, what) in tally.twice.items():
        also = f"; {n:,} records name a key twice" if n > 1 else ""
        tally.notes[f"{name}:{line}: {what}: the last value counts, as in JSON.parse and jq{also}"] = None
    if dup:
        tally.notes[f"{dup} call id(s) appear more than once"] = None
    if early:
        tally.notes[f"{early} call(s) start before 2000: relative times rather than wall clock?"] = None
    return AppAccounting(
        lines_read=tally.lines_read, rows_loaded=n_calls, rows_with_problems=tally.problem_rows,
        rows_dropped=tally.dropped, empty_lines=tally.empty_lines,
        problems=tuple(sorted(tally.examples, key=lambda p: (tally.files[p.file], p.line))[:MAX_EXAMPLES]),
        notes=tuple(tally.notes),
    )
