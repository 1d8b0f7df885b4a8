"""llama-server log lines -> events, per chunk, with every line accounted for.

The hot path works on blocks of ~8 MiB, with no Python code per line: colour codes and
carriage returns are removed with one bytes-level substitution, the lines become one Arrow
array over the block's own bytes (offsets from the newline positions), a wrapper prefix (if
any) is stripped with one vectorised regex, and a numpy scanner reads the lines of the
current llama.cpp grammar column-wise (``scan``). The scanner only takes lines whose reading
by the single RE2 pattern ``FAST_PATTERN`` it can prove, and gives the same reading; the rest
(older multi-line timings, damaged lines) go through ``FAST_PATTERN`` itself, and lines it does
not know either go to :mod:`slotscope.legacy` one by one (older formats, which are rare).
``FAST_PATTERN`` on every line would be an order of magnitude slower than the scanner.

Keys are message texts, not the 12-character function field (it moved between versions).
Each event row carries its file line so every figure can be traced back.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import os
import re
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterator, Sequence, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from . import legacy, prefixes
from .ollama import OllamaLogs, retime, runner_streams
from .events import (
    BUILD, CANCEL, CONFIG, ERROR, EVAL, EXIT, HEARTBEAT, INIT, LAUNCH, MODEL, PROGRESS, PROMPT_EVAL, RELEASE,
    TIMING_HEADER, TOTAL,
)
from .accounting import Accounting, FileAccount
from .errors import InputError
from .sources import (
    CHUNK_SIZE, STDIN, Inputs, LogFile, Span, collect, is_plain, iter_chunks, iter_spans, read_span, reopen, staged,
)
from .store import StoredField, StoredTable, release_memory
from .workers import Pool
from .scanner import COMP_BUILD, SRV_EVENT, Reading, Scan, scan
from .tasks import (
    GEN_COLUMNS, PREFILL_COLUMNS, SESSION_COLUMNS, TASK_COLUMNS, BlockTasks, SampleBatch, SampleSource, TaskAssembler,
    Samples, TaskBatch, FirstTokens, concat_tables, empty_task_table, fold_block, joined_categories, shifted_sessions,
)

T = TypeVar("T")
R = TypeVar("R")

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|inf|nan)"
_HEAD = (
    r"^(?:\[ *(?P<port>\d+)\] )?"
    r"(?:(?P<tmin>\d+)\.(?P<tsec>\d\d)\.(?P<tms>\d{3})\.(?P<tus>\d{3}) )?"
    r"(?:[IWED] )?"
)
_SLOT = (
    r"slot .{12}: id +(?P<slot>-?\d+) \| task (?P<task>-?\d+) \|"
    r"(?:"
    r" (?P<k_launch>processing task)(?:, is_child = (?P<child>\d+))?"
    r"| prompt processing, n_tokens = *(?P<pp_n>\d+), progress = *(?P<pp_prog>" + _NUM + r"), "
    r"t = *(?P<pp_t>" + _NUM + r") s / *(?P<pp_tps>" + _NUM + r") tokens per second"
    r"| (?P<k_hb>n_(?:gen|decoded)) = *(?P<hb_n>\d+), tg = *(?P<hb_tg>" + _NUM + r") t/s"
    r"(?:, tg_3s = *(?P<hb_tg3>" + _NUM + r") t/s)?"
    r"| prompt eval time = *(?P<pe_ms>" + _NUM + r") ms / *(?P<pe_n>\d+) tokens"
    r"| +eval time = *(?P<ev_ms>" + _NUM + r") ms / *(?P<ev_n>\d+) (?:tokens|runs)"
    r"| +total time = *(?P<tt_ms>" + _NUM + r") ms(?: / *(?P<tt_n>\d+) tokens)?"
    r"| stop processing: n_(?:tokens|past) = *(?P<rel_n>\d+), truncated = *(?P<rel_tr>\d+)"
    r"| ?(?P<k_hdr>)$"
    # A known message that did not parse (a line cut short): unrecognized, not ignored.
    r"| +(?P<k_bad>(?:prompt eval time|eval time|total time|n_gen|n_decoded|prompt processing, n_tokens|stop processing|processing task).*)"
    r"| (?P<k_slot_other>.*)"
    r")"
)
_SRV = r"srv  .{12}: (?:" + SRV_EVENT + r"|(?P<k_srv_other>.*))"
_COMP = r"(?P<k_comp>(?:cmn |que |res |spec) .{12}: )(?:" + COMP_BUILD + ")?"
# Continuation lines of the older multi-line print_timing block (no prefix of their own).
_CONT = (
    r"(?:print_timings: )?\s*(?P<c_kind>prompt eval|generation eval|eval|total) time += *"
    r"(?P<c_ms>" + _NUM + r") ms(?: / *(?P<c_n>\d+) (?:tokens|runs))?"
)
FAST_PATTERN = _HEAD + "(?:" + _SLOT + "|" + _SRV + "|" + _COMP + "|" + _CONT + ")"

# Lines from libllama/ggml and the server's own start-up that carry no per-task meaning.
_KNOWN_OTHER = re.compile(
    r"^(?:\[ *\d+\] )?(?:\d+\.\d\d\.\d{3}\.\d{3} )?(?:[IWED] )?\s*(?:"
    r"[a-z][a-z0-9_]*(?:\.cpp)?(?::[a-z0-9_]+)?: |"  # llama_model_loader: ..., load_tensors: ..., main: ...
    r"build: |system_info: |system prompt|request: |HTTP server|all slots are idle|"
    r"[a-z_]+ = [-+0-9.e]+(?:, [a-z_]+ = [-+0-9.e]+)+\s*$|"  # the indented lines of `sampler params:`
    r"\s*- |<\||\{%|\{\{|'|\s*$)"
)
_ANSI = re.compile(rb"\x1b?\[[0-9;]*m")
_ANSI_ANY = re.compile(rb"\[[0-9;]*m")  # same hits as _ANSI, found faster (literal first)
_USE_SCANNER = True  # tests turn it off to compare with FAST_PATTERN alone
TASK_ROWS = 1 << 16  # finished tasks held in memory at a time while they go to disk
# What times a stream's lines: llama's own `M.SS.mmm.uuu` stamps, or a wrapper's wall-clock
# stamps (journald, docker, `ts`) where llama printed none. The stream's first timed line
# decides, once: deciding per block made the times depend on where blocks were cut, and one
# clock per stream keeps a session's times on one scale (lines without the chosen clock stay
# untimed).
LLAMA_CLOCK, WALL_CLOCK = "llama", "wall"


@dataclass
class StreamState:
    """What one server-log stream carries from chunk to chunk (bounded, per port)."""

    source: str
    wrapper: prefixes.Wrapper | None = None
    wrapper_known: bool = False
    year: int = field(default_factory=lambda: _dt.date.today().year)
    tz: str = "UTC"
    last_ts: dict[int, int] = field(default_factory=dict)  # port -> last relative µs
    session: dict[int, int] = field(default_factory=dict)  # port -> current session number (once it has lines)
    last_header: tuple[int, int, int, int] | None = None  # (port, slot, task, ts) of a bare print_timing header
    clock: str | None = None  # LLAMA_CLOCK or WALL_CLOCK: what times the stream (None: no timed line yet)
    wall_origin: int | None = None  # the stream's first wall-clock stamp: 0 s on a WALL_CLOCK stream
    header_wall: int = -1  # the stamp of the last header line (LM Studio), for the lines after it


# --------------------------------------------------------------------------- block -> lines

def _clean(chunk: bytes) -> bytes:
    """Colour codes and carriage returns removed, invalid UTF-8 replaced (line breaks kept)."""
    if b"[" in chunk and _ANSI_ANY.search(chunk):
        chunk = _ANSI.sub(b"", chunk)
    if b"\r" in chunk:
        chunk = chunk.replace(b"\r", b"")
    if not chunk.isascii():
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            chunk = chunk.decode("utf-8", "replace").encode("utf-8")
    return chunk


def _split(block: bytes, last_ends: bool) -> pa.StringArray:
    """The lines of a block as one Arrow array over the block's own bytes.

    Each element keeps its newline (the last one may have none: then ``last_ends`` is False
    and the piece after the last newline, even empty, is a line). No copy, no Python string
    per line. Patterns used on such elements never cross a newline.
    """
    raw = np.frombuffer(block, np.uint8)
    nl = np.flatnonzero(raw == 10)
    off = np.zeros(len(nl) + (1 if last_ends else 2), np.int32)
    off[1 : len(nl) + 1] = nl + 1
    off[len(nl) + 1 :] = len(block)  # (a last line without its newline: end of input)
    return pa.StringArray.from_buffers(len(off) - 1, pa.py_buffer(off), pa.py_buffer(block))


# --------------------------------------------------------------------------- FAST_PATTERN

def _nonempty(col: pa.Array) -> np.ndarray:
    return pc.not_equal(col, "").fill_null(False).to_numpy(zero_copy_only=False)


def _num(col: pa.Array, typ: pa.DataType = pa.float64()) -> np.ndarray:
    vals = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
    return pc.cast(vals, typ).to_numpy(zero_copy_only=False)


@dataclass
class _Exact(Reading):
    """FAST_PATTERN's reading of some lines (the definition the scanner reproduces)."""

    valid: np.ndarray
    bad: np.ndarray
    cont: np.ndarray


def _parse_exact(lines: pa.Array) -> _Exact:
    """Read lines (without their newline) with the one RE2 pattern that knows every kind."""
    n = len(lines)
    parts = pc.extract_regex(lines, FAST_PATTERN)
    valid = parts.is_valid().to_numpy(zero_copy_only=False)
    f = {name: parts.field(name) for name in (t.name for t in parts.type)}

    kind = np.zeros(n, dtype=np.int8)
    for name, code in (("k_launch", LAUNCH), ("pp_n", PROGRESS), ("k_hb", HEARTBEAT), ("pe_ms", PROMPT_EVAL),
                       ("ev_ms", EVAL), ("tt_ms", TOTAL), ("rel_n", RELEASE), ("k_init", INIT), ("n_slots", CONFIG),
                       ("cancel", CANCEL), ("k_exit", EXIT), ("err_task", ERROR), ("model", MODEL), ("build", BUILD)):
        kind[_nonempty(f[name]) & (kind == 0)] = code
    c_kind = f["c_kind"]
    cont = _nonempty(c_kind)
    if cont.any():
        ck = np.asarray(c_kind.to_pylist(), dtype=object)
        kind[cont & (ck == "prompt eval")] = PROMPT_EVAL
        kind[cont & ((ck == "eval") | (ck == "generation eval"))] = EVAL
        kind[cont & (ck == "total")] = TOTAL
    slot_line = _nonempty(f["slot"])
    # A print_timing header with an empty message: the older multi-line timing block.
    bad = _nonempty(f["k_bad"])
    header = valid & slot_line & (kind == 0) & ~bad & ~_nonempty(f["k_slot_other"])
    kind[header] = TIMING_HEADER

    try:
        port = _num(f["port"], pa.int64())
    except pa.ArrowInvalid:  # a "port" beyond int64 in a damaged line: no port
        port = _num(f["port"])
        port = np.where(port < 2.0**63, port, np.nan)
    port = np.where(np.isnan(port), -1, port).astype(np.int64) if port.dtype.kind == "f" else port.astype(np.int64)
    tmin, tsec, tms, tus = (_num(f[x]) for x in ("tmin", "tsec", "tms", "tus"))
    ts = ((tmin * 60 + tsec) * 1000 + tms) * 1000 + tus
    # No time, or minutes of 12+ digits (a damaged line) beyond int64 µs: read as no time (a cast
    # would make it a huge negative time, and warn on stderr).
    ts = np.where(np.isnan(ts) | (ts >= 2.0**63), -1, ts).astype(np.int64)
    task = _num(f["task"])
    task = np.where(kind == CANCEL, _num(f["cancel"]), task)
    task = np.where(kind == ERROR, _num(f["err_task"]), task)

    def pick(*pairs: tuple[int, str]) -> np.ndarray:
        out = np.full(n, np.nan)
        for code, name in pairs:
            m = kind == code
            if m.any():
                out[m] = _num(f[name])[m]
        return out

    v1 = pick((PROGRESS, "pp_n"), (HEARTBEAT, "hb_n"), (PROMPT_EVAL, "pe_ms"), (EVAL, "ev_ms"),
              (TOTAL, "tt_ms"), (RELEASE, "rel_n"), (CONFIG, "n_slots"), (LAUNCH, "child"))
    v2 = pick((PROGRESS, "pp_prog"), (HEARTBEAT, "hb_tg"), (PROMPT_EVAL, "pe_n"), (EVAL, "ev_n"),
              (TOTAL, "tt_n"), (RELEASE, "rel_tr"), (CONFIG, "n_ctx"))
    v3 = pick((PROGRESS, "pp_t"), (HEARTBEAT, "hb_tg3"))
    v4 = pick((PROGRESS, "pp_tps"))
    if cont.any():
        v1[cont] = _num(f["c_ms"])[cont]
        v2[cont] = _num(f["c_n"])[cont]
    text: dict[int, str] = {}
    for code, name in ((MODEL, "model"), (BUILD, "build")):
        rows = np.flatnonzero(kind == code)
        if len(rows):
            text.update(zip(rows.tolist(), f[name].take(pa.array(rows)).to_pylist()))
    return _Exact(valid=valid, bad=bad, cont=cont, kind=kind, port=port, ts=ts, slot=_num(f["slot"]),
                  task=task, v=[v1, v2, v3, v4], text=text)


# --------------------------------------------------------------------------- a block -> events

def parse_chunk(
    chunk: bytes, first_line: int, state: StreamState, account: FileAccount, *, arrays: bool = False
) -> pd.DataFrame:
    """Turn one block of whole lines into events; count every line in ``account``.

    ``first_line`` is the 1-based file line of the block's first line. ``arrays``: the events
    as a dict of numpy columns, not a DataFrame (for the worker processes: no table built and
    taken apart again per block).
    """
    lines, wall = _block_lines(chunk, state, account)
    account.lines += len(lines)
    read = _read_lines(lines)
    legacy_rows = _unknown_lines(lines, read, wall, first_line, account)
    account.ignored += int((read.valid & (read.kind == 0) & ~read.bad).sum())
    account.used += int((read.kind != 0).sum()) + sum(1 for r in legacy_rows if r.get("kind", 0) != 0)
    cols = _event_columns(read, wall, first_line)
    if arrays and not legacy_rows:
        return cols  # type: ignore[return-value]
    ev = pd.DataFrame(cols)
    if legacy_rows:
        ev = _with_legacy(ev, legacy_rows)
    ev = ev.reset_index(drop=True)
    return {c: ev[c].to_numpy() for c in ev.columns} if arrays else ev  # type: ignore[return-value]


def _block_lines(chunk: bytes, state: StreamState, account: FileAccount) -> tuple[pa.Array, np.ndarray]:
    """The block's lines (each with its newline) with any wrapper prefix removed, and each
    line's wall-clock stamp in µs from that prefix (-1: none). The first block of a stream
    decides the wrapper."""
    if not state.wrapper_known:
        _decide_wrapper(_first_lines(chunk, WRAPPER_LINES), state, account)
    wrapper = state.wrapper
    if wrapper is not None and wrapper.stamp == "json":
        return _json_lines(chunk, wrapper)
    lines = _split(_clean(chunk), chunk.endswith(b"\n"))  # cleaning never adds or removes a newline
    wall = np.full(len(lines), -1, dtype=np.int64)
    if wrapper is not None:
        bare, wall = prefixes.strip(pc.utf8_rtrim(lines, characters="\n"), wrapper, state.year, state.tz, state.header_wall)
        lines = pc.binary_join_element_wise(bare, "", "\n")
        if wrapper.stamp == "header" and len(wall):
            state.header_wall = int(wall[-1])
    return lines, wall


WRAPPER_LINES = 400  # a stream's first lines, which decide its wrapper


def _first_lines(chunk: bytes, n: int) -> list[bytes]:
    """The first ``n`` lines of a block (without their newlines; fewer if it has fewer)."""
    lines = chunk.split(b"\n", n)[:n]
    if len(lines) < n and chunk.endswith(b"\n"):
        lines.pop()  # (the nothing after the last newline)
    return lines


def _decide_wrapper(sample: list[bytes], state: StreamState, account: FileAccount) -> None:
    state.wrapper = prefixes.detect(sample)
    state.wrapper_known = True
    account.wrapper = state.wrapper.name if state.wrapper else None


def _framed(blocks: Iterator[bytes | Span], state: StreamState, account: FileAccount) -> Iterator[bytes | Span]:
    """Decide the stream's wrapper from its first :data:`WRAPPER_LINES` lines, in as many
    blocks as hold them (small blocks: several); the same blocks, those read for it as bytes
    (a staged span can be read once)."""
    read: list[bytes] = []
    sample: list[bytes] = []
    failure: InputError | None = None
    try:
        for block in blocks:
            read.append(read_span(block) if isinstance(block, Span) else block)
            sample += _first_lines(read[-1], WRAPPER_LINES - len(sample))
            if len(sample) >= WRAPPER_LINES:
                break
    except InputError as e:  # (a damaged .gz: its lines before the damage come first)
        failure = e
    if read:  # (no lines at all: the stream's next file decides)
        _decide_wrapper(sample, state, account)
    return itertools.chain(read, _raise(failure) if failure is not None else blocks)


def _raise(e: Exception) -> Iterator[bytes]:
    raise e
    yield b""  # (a generator: it raises when its turn comes)


def _json_lines(chunk: bytes, wrapper: prefixes.Wrapper) -> tuple[pa.Array, np.ndarray]:
    """:func:`_block_lines` for a JSON wrapper (journald, docker): the messages and stamps."""
    lines_b = chunk.split(b"\n")
    if lines_b and lines_b[-1] == b"":
        lines_b.pop()
    n = len(lines_b)
    lines_b, json_walls = prefixes.decode_json_lines(lines_b, wrapper)
    # A stamp no clock can show (a damaged record, beyond year 287,000) is no stamp.
    wall = np.array([(int(round(x * 1e6)) if x is not None and abs(x) < 9e12 else -1) for x in json_walls], np.int64)
    # A message with a line break inside shifts what follows, as in a plain read of it.
    text = _clean(b"\n".join(lines_b)).decode("utf-8").split("\n")
    del text[n:]
    return pa.array([t + "\n" for t in text], pa.string()), wall


def _read_lines(lines: pa.Array) -> _Exact:
    """Every line's reading: the scanner's where it can prove it, else FAST_PATTERN's."""
    n = len(lines)
    sc = scan(lines) if _USE_SCANNER else Scan.empty(n)
    read = _Exact(valid=sc.known.copy(), bad=np.zeros(n, bool), cont=np.zeros(n, bool), kind=sc.kind, port=sc.port,
                  ts=sc.ts, slot=sc.slot, task=sc.task, v=sc.v,
                  text={r: t for r, t in sc.text.items() if sc.known[r]})  # MODEL/BUILD rows -> their text
    asked = np.flatnonzero(~sc.known)
    if len(asked):
        ex = _parse_exact(pc.utf8_rtrim(lines.take(pa.array(asked)), characters="\n"))
        for full, part in ((read.kind, ex.kind), (read.port, ex.port), (read.ts, ex.ts), (read.slot, ex.slot),
                           (read.task, ex.task), (read.valid, ex.valid), (read.bad, ex.bad), (read.cont, ex.cont),
                           *zip(read.v, ex.v)):
            full[asked] = part
        read.text.update((int(asked[r]), t) for r, t in ex.text.items())
    # A task id a float may not hold exactly (2**53 or more: no server counts that far, a damaged
    # line does) would join the line to a wrong task: the line is unrecognized instead.
    with np.errstate(invalid="ignore"):
        huge = np.abs(read.task) >= 2.0**53
    if huge.any():
        read.bad |= huge
        read.kind[huge], read.task[huge] = 0, np.nan
    return read


def _unknown_lines(lines: pa.Array, read: _Exact, wall: np.ndarray, first_line: int,
                   account: FileAccount) -> list[dict[str, Any]]:
    """The events of the lines FAST_PATTERN does not know, read one by one by
    :mod:`slotscope.legacy` (older formats: rare); the others counted as ignored or
    unrecognized."""
    unknown_idx = np.flatnonzero(~read.valid | read.bad)
    legacy_rows: list[dict[str, Any]] = []
    known_other = 0
    texts = pc.utf8_rtrim(lines.take(pa.array(unknown_idx)), characters="\n").to_pylist()
    for i, s in zip(unknown_idx, texts):
        if not read.bad[i] and (not s.strip() or _KNOWN_OTHER.match(s)):
            known_other += 1
            continue
        row = None if read.bad[i] else legacy.parse_line(s)
        if row is None:
            account.add_unrecognized(first_line + int(i), s)
            continue
        row["line"] = first_line + int(i)
        own_wall = row.pop("wall_stamp_us", -1)
        row["wall_us"] = int(wall[i]) if wall[i] >= 0 or own_wall < 0 else own_wall
        legacy_rows.append(row)
        if row.get("kind", 0) == 0:
            known_other += 1
    account.ignored += known_other
    return legacy_rows


def _event_columns(read: _Exact, wall: np.ndarray, first_line: int) -> dict[str, np.ndarray]:
    """The event rows of the lines that mean something, as numpy columns."""
    idx = np.flatnonzero(read.kind != 0)
    v = read.v
    cols = {
        "line": (first_line + idx).astype(np.int64), "kind": read.kind[idx], "port": read.port[idx],
        "ts_us": read.ts[idx], "wall_us": wall[idx], "slot": read.slot[idx], "task": read.task[idx],
        "v1": v[0][idx], "v2": v[1][idx], "v3": v[2][idx], "v4": v[3][idx], "cont": read.cont[idx],
    }
    if read.text:  # a column only where a block has such lines (start-ups): no objects per block else
        cols["text"] = np.full(len(idx), None, dtype=object)
        rows = np.array(sorted(read.text))
        cols["text"][np.searchsorted(idx, rows)] = [read.text[r] for r in rows.tolist()]
    return cols


def _with_legacy(ev: pd.DataFrame, legacy_rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The events with those :mod:`slotscope.legacy` read, in line order."""
    lg = pd.DataFrame(legacy_rows)
    lg = lg[lg["kind"] != 0]
    if not len(lg):
        return ev
    lg = lg.reindex(columns=ev.columns)
    # A column all missing on one side takes the other side's type where that holds
    # gaps (what pandas < 3 did, with a FutureWarning, and pandas 3 does not).
    for c in ev.columns:
        a, b = ev[c], lg[c]
        if a.dtype != b.dtype:
            if b.isna().all() and a.dtype.kind in "fO":
                lg[c] = b.astype(a.dtype)
            elif a.isna().all() and b.dtype.kind in "fO":
                ev[c] = a.astype(b.dtype)
    ev = pd.concat([ev, lg], ignore_index=True).sort_values("line", kind="stable")
    ev["cont"] = ev["cont"].fillna(False).astype(bool)
    for c in ("port", "ts_us", "wall_us"):
        ev[c] = ev[c].fillna(-1).astype(np.int64)
    ev["kind"] = ev["kind"].astype(np.int8)
    return ev


def assign_sessions(ev: pd.DataFrame, state: StreamState) -> pd.DataFrame:
    """Number process sessions per port: a start-up banner or a clock going back starts one.

    Also attaches the continuation lines of older multi-line timing blocks to their header,
    and fills a relative clock from wall-clock stamps where llama's own timestamps are off.
    """
    if ev.empty:
        ev["session"] = pd.Series(dtype=np.int64)
        return ev
    _fill_times(ev, state)
    local, ports = local_sessions(ev)
    ev["session"] = shifted_sessions(ev["port"].to_numpy(), local, resolve_sessions(ports, state))
    return ev


def _fill_times(ev: pd.DataFrame | dict[str, np.ndarray], state: StreamState) -> None:
    """Times that depend on earlier lines: the stream's clock (see :data:`LLAMA_CLOCK`), a
    relative one from wall-clock stamps where that is the wrapper's, and the header's
    slot/task/time on older multi-line timing blocks.
    ``ev``: a table or a dict of columns (changed columns are replaced, in either)."""
    ts = np.asarray(ev["ts_us"]).copy()
    wall = np.asarray(ev["wall_us"])
    if (wall == prefixes.UNKNOWN_WALL).any():  # a header stamp from an earlier block (LM Studio)
        wall = np.where(wall == prefixes.UNKNOWN_WALL, state.header_wall, wall)
        ev["wall_us"] = wall
    cont = np.asarray(ev["cont"])
    if state.wall_origin is None and (wall >= 0).any():
        state.wall_origin = int(wall[wall >= 0][0])
    if state.clock is None:
        timed = np.flatnonzero(~cont & ((ts >= 0) | (wall >= 0)))
        if len(timed):
            state.clock = LLAMA_CLOCK if ts[timed[0]] >= 0 else WALL_CLOCK
    if state.clock == WALL_CLOCK:
        assert state.wall_origin is not None  # (the deciding line had a stamp)
        ts = np.where(wall >= 0, wall - state.wall_origin, -1)
        ev["ts_us"] = ts
    # Older multi-line blocks: continuation rows take slot/task/time from their header.
    hdr = np.asarray(ev["kind"]) == TIMING_HEADER
    if cont.any() or hdr.any():  # a header's lines may follow in the next block
        port, slot, task = (np.asarray(ev[c]) for c in ("port", "slot", "task"))
        if cont.any():
            heads = [np.where(hdr, x, np.nan) for x in (port, slot, task, ts)]
            for h, val in zip(heads, state.last_header or ()):
                if np.isnan(h[0]):
                    h[0] = val
            filled = [pd.Series(h).ffill().to_numpy() for h in heads]
            ok = cont & ~np.isnan(filled[2])  # (a header's task)
            port, slot, task, ts = (np.where(ok, h, x) for h, x in zip(filled, (port, slot, task, ts)))
            port, ts = port.astype(np.int64), ts.astype(np.int64)
            ev["port"], ev["slot"], ev["task"], ev["ts_us"] = port, slot, task, ts
        if hdr.any():
            last = np.flatnonzero(hdr)[-1]
            state.last_header = (int(port[last]), int(slot[last]), int(task[last]), int(ts[last]))


def _needs_earlier_lines(ev: pd.DataFrame | dict[str, np.ndarray], state: StreamState) -> bool:
    """Whether :func:`_fill_times` would need what earlier blocks left in ``state``."""
    ts, wall = np.asarray(ev["ts_us"]), np.asarray(ev["wall_us"])
    cont = np.asarray(ev["cont"])
    if state.wall_origin is None and (wall >= 0).any():
        return True
    if state.clock is None and (~cont & ((ts >= 0) | (wall >= 0))).any():
        return True
    if (wall == prefixes.UNKNOWN_WALL).any():
        return True
    if cont.any():
        hdr = np.flatnonzero(np.asarray(ev["kind"]) == TIMING_HEADER)
        return not len(hdr) or np.flatnonzero(cont)[0] < hdr[0]
    return False


@dataclass
class PortSessions:
    """What numbering a block's sessions needs from the lines before it, per port."""

    port: int
    first_ts: int  # the port's first row's relative time (-1: none)
    first_is_banner: bool
    last_ts: int  # its last known relative time in the block (-1: none)
    starts: int  # sessions started inside the block after its first row


def local_sessions(ev: pd.DataFrame | dict[str, np.ndarray]) -> tuple[np.ndarray, list[PortSessions]]:
    """Sessions numbered from 0 within the block, per port, and what fixes them up.

    A new session starts where the clock goes back by more than a second from the last known
    time before it (same-millisecond reordering between logger threads is far smaller), and
    at a start-up banner. Whether the port's first row starts one depends on earlier blocks:
    :func:`resolve_sessions` decides that.
    """
    ts = np.asarray(ev["ts_us"])
    ports = np.asarray(ev["port"])
    kinds = np.asarray(ev["kind"])
    local = np.zeros(len(ts), dtype=np.int64)
    info = []
    # One port (no router): no sort of the whole block to find it.
    uniq = ports[:1] if len(ports) and ports.min() == ports.max() else np.unique(ports)
    for port in uniq:
        m = slice(None) if len(uniq) == 1 else ports == port
        p_ts = ts[m]
        banner = kinds[m] == INIT
        known = p_ts >= 0
        # The last known time before each row (none for the first).
        last = np.where(known, np.arange(len(p_ts)), -1)
        np.maximum.accumulate(last, out=last)
        before = np.concatenate(([-1], last[:-1]))
        prior = p_ts[np.maximum(before, 0)]
        start = (known & (before >= 0) & (p_ts < prior - 1_000_000)) | banner
        start[0] = False
        s = np.cumsum(start)
        local[m] = s
        k = np.flatnonzero(known)
        info.append(PortSessions(int(port), int(p_ts[0]), bool(banner[0]), int(p_ts[k[-1]]) if len(k) else -1,
                                 int(s[-1])))
    return local, info


def resolve_sessions(ports: list[PortSessions], state: StreamState) -> dict[int, int]:
    """Per port, the session number of the block's local session 0; ``state`` moves on."""
    shift = {}
    for ps in ports:
        prev = state.last_ts.get(ps.port, -1)
        had = ps.port in state.session
        back = ps.first_ts >= 0 and prev >= 0 and ps.first_ts < prev - 1_000_000
        # A banner at the very start of a stream opens session 1; it is not a restart.
        first_starts = (back or ps.first_is_banner) and not (ps.first_is_banner and not had)
        base = state.session.get(ps.port, 1) + int(first_starts)
        shift[ps.port] = base
        state.session[ps.port] = base + ps.starts
        if ps.last_ts >= 0:
            state.last_ts[ps.port] = ps.last_ts
    return shift


@dataclass
class ServerLogs:
    """Everything read from llama-server logs: the tables and the line accounting.

    ``gen_samples`` and ``prefill_samples`` are kept on disk (:class:`Samples`): reading one
    builds it, and it stays built.
    """

    tasks: pd.DataFrame = StoredField()  # type: ignore[assignment]
    gen_samples: pd.DataFrame = StoredField()  # type: ignore[assignment]
    prefill_samples: pd.DataFrame = StoredField()  # type: ignore[assignment]
    sessions: pd.DataFrame  # type: ignore[misc]  # (StoredField above is no default: its __get__ raises on the class)
    accounting: Accounting  # type: ignore[misc]
    ollama: OllamaLogs | None = None  # what Ollama's own lines said, where Ollama logs were read

    def on_disk(self, kind: str) -> Samples | None:
        """The :class:`Samples` behind ``gen_samples`` or ``prefill_samples`` (``kind``) while
        its table is not built; None when it is a table in memory."""
        v = self.__dict__.get("_" + kind)
        return v if isinstance(v, Samples) and not v.built else None


@dataclass
class _Parsed:
    """One block parsed on its own: folded tasks (or, where its meaning depends on earlier
    lines, its raw events), its line counts and its size in bytes. Line numbers count from 1
    at the block's first line."""

    account: FileAccount
    nbytes: int
    block: BlockTasks | None = None
    ports: list[PortSessions] | None = None
    last_header: tuple[int, int, int, int] | None = None
    events: dict[str, np.ndarray] | None = None
    header_wall: int = prefixes.UNKNOWN_WALL  # the header stamp in force at its end (UNKNOWN_WALL: none in it)


def _parse_block(job: tuple[bytes | Span, StreamState, bool | int]) -> _Parsed:
    """Parse and fold one block with nothing from the blocks before it (in a worker process)."""
    block, state, keep_samples = job  # the state: a fresh one per block (_given), this block's to change
    data = read_span(block) if isinstance(block, Span) else block
    account = FileAccount("")
    ev = parse_chunk(data, 1, state, account, arrays=True)
    if not len(ev["line"]) or _needs_earlier_lines(ev, state):
        return _Parsed(account, len(data), events=ev, header_wall=state.header_wall)
    _fill_times(ev, state)
    local, ports = local_sessions(ev)
    ev["session"] = local
    return _Parsed(account, len(data), block=fold_block(ev, keep_samples), ports=ports, last_header=state.last_header,
                   header_wall=state.header_wall)


def _blocks(stream: BinaryIO, lf: LogFile, size: int, pool: Pool) -> Iterator[bytes | Span]:
    """The blocks of one file. With workers, spans they read themselves: of the file where it
    is plain, else of a temporary copy of each block (compressed or piped input); without,
    the bytes."""
    if pool.jobs < 2:
        return iter_chunks(stream, lf.path, size)
    if is_plain(stream):
        return iter_spans(stream, lf.path, size)
    # (Blocks of the full size: smaller ones save little memory and add per-block work.)
    return staged(iter_chunks(stream, lf.path, size, pieces=True))


def read_stream(
    files: list[LogFile],
    inputs: Inputs,
    *,
    keep_samples: bool | int = True,
    tz: str = "UTC",
    year: int | None = None,
    progress: Callable[[int], None] | None = None,
    chunk_size: int | None = None,
    pool: Pool,
    spill_rows: int = TASK_ROWS,
) -> tuple[TaskAssembler, list[FileAccount]]:
    """Parse one server-log stream (rotated files oldest first) into an assembler.

    ``chunk_size``: bytes per block (default :data:`slotscope.sources.CHUNK_SIZE`); ``pool``:
    worker processes that parse blocks while this process assembles tasks in order. The
    result depends on neither.
    """
    source = files[-1].stream if files[-1].stream != STDIN else "<stdin>"
    state = StreamState(source=source, tz=tz)
    if year is not None:
        state.year = year
    asm = TaskAssembler(source=source, keep_samples=keep_samples, spill_rows=spill_rows)
    accounts = []
    for lf in files:
        account = FileAccount(lf.shown or (lf.path if lf.path != STDIN else "<stdin>"))
        accounts.append(account)
        state.wrapper_known = state.wrapper_known and lf.order > 0
        stream = reopen(lf, inputs)
        blocks = _blocks(stream, lf, chunk_size or CHUNK_SIZE, pool)
        try:
            todo: Iterator[bytes | Span] = blocks
            if not state.wrapper_known:  # the first lines decide how lines are framed; the first block, here
                todo = _framed(blocks, state, account)
                first = next(todo, None)
                if first is not None:
                    chunk = read_span(first) if isinstance(first, Span) else first
                    asm.add(assign_sessions(parse_chunk(chunk, 1, state, account), state), file=account.path)
                    if progress is not None:
                        progress(len(chunk))
            jobs = ((b, _given(state), keep_samples) for b in todo)
            for got in pool.map(_parse_block, jobs):
                offset = account.lines
                account.absorb(got.account)
                if got.block is not None:
                    assert got.ports is not None
                    shift = resolve_sessions(got.ports, state)
                    if got.last_header is not None:
                        state.last_header = got.last_header
                    got.block.shift_lines(offset)
                    asm.merge(got.block, shift, file=account.path)
                elif got.events is not None:
                    got.events["line"] = got.events["line"] + offset
                    asm.add(assign_sessions(pd.DataFrame(got.events), state), file=account.path)
                if got.header_wall != prefixes.UNKNOWN_WALL:  # (after add: its lines take the stamp before)
                    state.header_wall = got.header_wall
                if progress is not None:
                    progress(got.nbytes)
        except InputError as e:
            account.error = e.reason
        finally:
            if hasattr(blocks, "close"):
                blocks.close()  # stops a read-ahead thread before its stream is closed
            if lf.path != STDIN:
                stream.close()
    return asm, accounts


def _given(state: StreamState) -> StreamState:
    """What a worker needs of the stream's state (small: no per-port tables), as a new object
    for each block: parsing it may change it."""
    return StreamState(source="", wrapper=state.wrapper, wrapper_known=True, year=state.year, tz=state.tz,
                       clock=state.clock, wall_origin=state.wall_origin, header_wall=prefixes.UNKNOWN_WALL)


def read_server_logs(
    paths: Sequence[str | os.PathLike[str]],
    *,
    keep_samples: bool | int = True,
    tz: str = "UTC",
    year: int | None = None,
    progress: Callable[[int], None] | None = None,
    inputs: Inputs | None = None,
    chunk_size: int | None = None,
    jobs: int | None = None,
    samples_on_disk: bool = False,
    tasks_on_disk: bool = False,
) -> ServerLogs:
    """Read llama-server logs (files, directories, globs, ``-``) into task and sample tables.

    Tasks are keyed by (source, session, task_id); times are seconds on that session's server
    clock, with wall-clock columns where a capture wrapper stamped the lines. App call logs
    found among the paths are skipped here (see :func:`slotscope.app_log.read_app_logs`).
    Input is read in blocks of ``chunk_size`` bytes (default 8 MiB), parsed by ``jobs`` worker
    processes (default: :func:`slotscope.workers.default_jobs`; 1: in this process) and
    assembled here in order. The finished tasks and the samples wait in a temporary directory
    as they are read; each table is built when first read (see :class:`ServerLogs`), the
    tasks written a batch at a time (:class:`slotscope.store.StoredTable`), never whole in
    memory. (``samples_on_disk`` and ``tasks_on_disk`` are accepted for callers that still
    pass them: both are always so.)
    """
    found: list[OllamaLogs] = []
    assemblers, streams, sessions, with_wall, acc = _read_all(
        paths, inputs, Pool(jobs), TASK_ROWS, keep_pool=False, keep_samples=keep_samples, tz=tz, year=year,
        progress=progress, chunk_size=chunk_size, ollama=found)
    # Two or more streams with tasks: each categorical column with one set of categories, as
    # _concat gives them (taken from a one-row batch of each stream).
    cats: dict[str, list[str]] = {}
    if len(streams) > 1:
        cats = joined_categories([_task_table(dataclasses.replace(parts[0], idx=parts[0].idx[:1]), with_wall)
                                   for _, parts in streams])

    def batches() -> Iterator[pd.DataFrame]:
        for asm, parts in streams:
            for part in parts:
                table = _task_table(part, with_wall)
                acc.count_tasks(_status_counts(table))
                yield table.assign(**{c: table[c].cat.set_categories(v) for c, v in cats.items()}) if cats else table
            asm.discard()  # its finished rows, on disk

    session_table = concat_tables(sessions, SESSION_COLUMNS)
    none = [] if streams else [empty_task_table(assemblers[0].source if assemblers else "", session_table, with_wall)]
    tasks = StoredTable.of_parts(itertools.chain(batches(), none), "tasks")
    samples: tuple[list[SampleSource], list[SampleSource]] = ([], [])
    at = 0
    for asm in assemblers:  # (a stream without tasks: its samples, if any, without first tokens)
        for kept, part in zip(samples, asm.samples_later(_first_tokens_of(tasks, at, asm.n_finished)
                                                         if asm.n_finished else None)):
            kept.append(part)
        at += asm.n_finished
    return ServerLogs(tasks=tasks, gen_samples=Samples(samples[0], GEN_COLUMNS),
                      prefill_samples=Samples(samples[1], PREFILL_COLUMNS),
                      sessions=session_table, accounting=acc, ollama=found[0] if found else None)


def _first_tokens_of(stored: StoredTable, first: int, n: int) -> Callable[[], FirstTokens]:
    """What makes the :class:`FirstTokens` of the ``n`` tasks from row ``first`` of the table
    (one stream's: its gen samples' first windows)."""
    return lambda: FirstTokens.of(stored.take(np.arange(first, first + n), ["port", "session", "task_id", "first_token_s"]))


def read_task_batches(
    paths: Sequence[str | os.PathLike[str]],
    *,
    rows: int = 1 << 15,
    then: Callable[[pd.DataFrame, int], object] | None = None,
    tz: str = "UTC",
    year: int | None = None,
    progress: Callable[[int], None] | None = None,
    inputs: Inputs | None = None,
    chunk_size: int | None = None,
    jobs: int | None = None,
) -> tuple[Iterator[object], Accounting]:
    """:func:`read_server_logs`' task table as batches of ``rows`` rows, for logs of any size.

    All input is read first (finished tasks beyond ``rows`` wait in a temporary directory),
    so the accounting's line counts are final on return; its task counts are final once every
    batch has been taken. The batches, joined, are the ``tasks`` table (the same text as CSV).
    ``then(batch, i)``: what to hand out instead of the i-th batch (e.g. its CSV text); with
    worker processes, batches are built and ``then`` runs in them (it must be a module-level
    function or a ``functools.partial`` of one).
    """
    pool = Pool(jobs)
    assemblers, streams, _, with_wall, acc = _read_all(paths, inputs, pool, rows, keep_samples=False, tz=tz, year=year,
                                                       progress=progress, chunk_size=chunk_size)
    todo: list[TaskBatch | None] = [b for _, parts in streams for b in parts] or [None]
    work = [(b, i, with_wall, then) for i, b in enumerate(todo)]

    def batches() -> Iterator[object]:
        for out, counts in _in_order(pool, _task_batch, work, [asm.discard for asm in assemblers]):
            acc.count_tasks(counts)
            yield out

    return batches(), acc


def _spread(pool: Pool, fn: Callable[[T], R], work: list[T]) -> Iterator[R]:
    """``fn`` of each item in order, by the pool's workers where there are two items or more."""
    return pool.map(fn, work) if pool.jobs > 1 and len(work) > 1 else map(fn, work)


def _in_order(pool: Pool, fn: Callable[[T], R], work: list[T], then: list[Callable[[], None]]) -> Iterator[R]:
    """:func:`_spread`; when done, or given up, the pool is closed and each of ``then`` runs
    (removing the spilled rows)."""
    try:
        yield from _spread(pool, fn, work)
    finally:
        pool.close()
        for cleanup in then:
            cleanup()


def read_sample_batches(
    paths: Sequence[str | os.PathLike[str]],
    *,
    kind: str = "gen",
    rows: int = 1 << 16,
    then: Callable[[pd.DataFrame, int], object] | None = None,
    tz: str = "UTC",
    year: int | None = None,
    progress: Callable[[int], None] | None = None,
    inputs: Inputs | None = None,
    chunk_size: int | None = None,
    jobs: int | None = None,
) -> tuple[Iterator[object], Accounting]:
    """:func:`read_server_logs`' ``gen_samples`` (``kind`` "gen") or ``prefill_samples``
    ("prefill") as batches of ``rows`` rows, for logs of any size, like :func:`read_task_batches`.

    Sample rows beyond a chunk wait in a temporary directory; memory holds their sort keys
    and each task's first-token time. The accounting (lines and tasks) is final on return. ``then(batch, i)``: as in
    :func:`read_task_batches`.
    """
    code = {"gen": HEARTBEAT, "prefill": PROGRESS}[kind]
    pool = Pool(jobs)
    assemblers, streams, _, _, acc = _read_all(paths, inputs, pool, 1 << 15, keep_samples=code, tz=tz, year=year,
                                               progress=progress, chunk_size=chunk_size)
    try:
        with_tasks = {id(asm): parts for asm, parts in streams}
        todo = []
        for asm in assemblers:
            work = [(b, i, False, _first_tokens) for i, b in enumerate(with_tasks.get(id(asm), []))]
            found = list(_spread(pool, _task_batch, work))
            for _, counts in found:
                acc.count_tasks(counts)
            asm.discard()
            firsts = pd.concat([f for f, _ in found]) if found else None
            todo += asm.samples_later(firsts)[0 if code == HEARTBEAT else 1].batches(rows)
    except BaseException:
        pool.close()
        for asm in assemblers:
            asm.discard_samples()
        raise
    work_s = [(b, i, then, kind) for i, b in enumerate(todo or [None])]
    return _in_order(pool, _sample_batch, work_s, [a.discard_samples for a in assemblers]), acc


def _first_tokens(tasks: pd.DataFrame, i: int) -> pd.DataFrame:
    """What the gen samples need of a batch of tasks (in a worker process)."""
    return tasks[["port", "session", "task_id", "first_token_s"]]


def _sample_batch(job: tuple[SampleBatch | None, int, Callable[[pd.DataFrame, int], object] | None, str]) -> object:
    """One batch of a samples table (in a worker process, or here); None: the empty table."""
    batch, i, then, kind = job
    part = batch.table() if batch is not None else concat_tables([], GEN_COLUMNS if kind == "gen" else PREFILL_COLUMNS)
    return then(part, i) if then is not None else part


def _task_batch(job: tuple[TaskBatch | None, int, bool, Callable[[pd.DataFrame, int], object] | None]) -> tuple[object, tuple[int, int, int, int]]:
    """One batch of the task table (in a worker process, or here), and its status counts."""
    batch, i, with_wall, then = job
    part = _task_table(batch, with_wall)
    return (then(part, i) if then is not None else part), _status_counts(part)


def _task_table(batch: TaskBatch | None, with_wall: bool) -> pd.DataFrame:
    """One batch of the task table (None: the empty table); ``with_wall``: with the wall-clock
    columns, NaT where this stream has none (another stream has wall clocks)."""
    part = batch.table() if batch is not None else concat_tables([], TASK_COLUMNS)
    if with_wall and "launch_at" not in part.columns:
        for c in ("launch_at", "release_at", "prefill_start_at", "first_token_at"):
            part[c] = pd.Series(pd.NaT, index=part.index, dtype="datetime64[us, UTC]")
    return part


def _read_all(
    paths: Sequence[str | os.PathLike[str]], inputs: Inputs | None, pool: Pool, rows: int, *,
    keep_pool: bool = True, ollama: list[OllamaLogs] | None = None, **kw: Any,
) -> tuple[list[TaskAssembler], list[tuple[TaskAssembler, list[TaskBatch]]], list[pd.DataFrame], bool, Accounting]:
    """Read every stream (``pool``: its workers; closed after, unless ``keep_pool``, and on a
    failure) and close its tasks: the assemblers, each stream with tasks and its task batches
    of ``rows`` rows, every stream's sessions, whether a batch has wall-clock columns, and the
    accounting (its task counts are the caller's to add). ``ollama``: where to put what the
    Ollama logs among the inputs said (their runner lines are read as llama-server's)."""
    if inputs is None:
        inputs = collect(paths)
    acc = Accounting(skipped=list(inputs.skipped), unusable=list(inputs.unusable), notes=list(inputs.notes))
    assemblers = []
    # Ollama's logs: their own lines read there, their runner's lines here as llama-server's.
    inputs, ollama_logs = runner_streams(inputs, tz=kw.get("tz", "UTC"), year=kw.get("year"))
    try:
        for files in inputs.server:
            runner = ollama_logs.is_runner(files)
            # (A runner's samples are kept: their lines time its tasks; see slotscope.ollama.retime.)
            asm, accounts = read_stream(files, inputs, pool=pool, spill_rows=rows,
                                        **({**kw, "keep_samples": True} if runner else kw))
            if runner:
                asm.close()
                retime(asm)
                if not kw.get("keep_samples", True):
                    asm.discard_samples()
            assemblers.append(asm)
            acc.files.extend(accounts)
        if not keep_pool:
            pool.close()
        ends = [asm.finish_in_batches(rows) for asm in assemblers]
    except BaseException:
        pool.close()
        for asm in assemblers:
            asm.discard_samples()
        raise
    finally:
        ollama_logs.discard()
    ollama_logs.settle(acc)
    if ollama is not None and ollama_logs.found:
        ollama.append(ollama_logs)
    release_memory()  # the parse's freed blocks (and a .gz's inflate buffers), before the batches
    streams = [(asm, parts) for asm, (parts, _) in zip(assemblers, ends) if asm.n_finished]
    acc.sessions = sum(len(s) for _, s in ends)
    return assemblers, streams, [s for _, s in ends], any(a.has_wall_rows for a, _ in streams), acc


def _status_counts(tasks: pd.DataFrame) -> tuple[int, int, int, int]:
    """How many tasks are complete, cancelled, incomplete and cut at the log's start."""
    return tuple(int((tasks["status"] == s).sum()) for s in ("complete", "cancelled", "incomplete", "cut_at_start"))  # type: ignore[return-value]
