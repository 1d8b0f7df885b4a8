"""llama-server log lines -> events, per chunk, with every line accounted for.

The hot path works on blocks of ~1 MiB: the block is decoded once, colour codes and carriage
returns are removed with one bytes-level substitution, the wrapper prefix (if any) is stripped
with one vectorised regex, and a single RE2 pattern (``pyarrow.compute.extract_regex``)
recognises every current line kind at once. No Python code runs per line, except for lines
the fast pattern does not know (older formats, see :mod:`slotscope.legacy`), which are rare.

Keys are message texts, not the 12-character function field (it moved between versions).
Each event row carries its file line so every figure can be traced back.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from . import legacy, prefixes
from .events import (
    CANCEL, CONFIG, ERROR, EVAL, EXIT, HEARTBEAT, INIT, LAUNCH, PROGRESS, PROMPT_EVAL, RELEASE,
    TIMING_HEADER, TOTAL,
)
from .accounting import Accounting, FileAccount
from .errors import InputError
from .sources import STDIN, Inputs, LogFile, collect, iter_chunks, reopen
from .tasks import GEN_COLUMNS, PREFILL_COLUMNS, TASK_COLUMNS, TaskAssembler

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
_SRV = (
    r"srv  .{12}: (?:"
    r"(?P<k_init>initializing \.\.\.)"
    r"|initializing, n_slots = (?P<n_slots>\d+), n_ctx_slot = (?P<n_ctx>\d+)"
    r"|.*cancel task, id_task = (?P<cancel>\d+)"
    r"|(?P<k_exit>.*cleaning up before exit)"
    r"|.*task id = (?P<err_task>\d+), error: (?P<err>.*)"
    r"|(?P<k_srv_other>.*))"
)
_COMP = r"(?P<k_comp>(?:cmn |que |res |spec) .{12}: )"
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
    r"\s*- |<\||\{%|\{\{|'|\s*$)"
)
_ANSI = re.compile(rb"\x1b?\[[0-9;]*m")


@dataclass
class StreamState:
    """What one server-log stream carries from chunk to chunk (bounded, per port)."""

    source: str
    wrapper: prefixes.Wrapper | None = None
    wrapper_known: bool = False
    year: int = field(default_factory=lambda: _dt.date.today().year)
    tz: str = "UTC"
    last_ts: dict[int, int] = field(default_factory=dict)  # port -> last relative µs
    session: dict[int, int] = field(default_factory=dict)  # port -> current session number
    session_has_lines: dict[int, bool] = field(default_factory=dict)
    last_header: tuple[int, int, int, int] | None = None  # (port, slot, task, ts) of a bare print_timing header
    wall_origin: int | None = None  # for logs with wall-clock stamps but no relative ones


def _nonempty(col: pa.Array) -> np.ndarray:
    return pc.not_equal(col, "").fill_null(False).to_numpy(zero_copy_only=False)


def _num(col: pa.Array, typ: pa.DataType = pa.float64()) -> np.ndarray:
    vals = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
    return pc.cast(vals, typ).to_numpy(zero_copy_only=False)


def parse_chunk(
    chunk: bytes, first_line: int, state: StreamState, account: FileAccount
) -> pd.DataFrame:
    """Turn one block of whole lines into events; count every line in ``account``.

    ``first_line`` is the 1-based file line of the block's first line.
    """
    lines_b = chunk.split(b"\n")
    if lines_b and lines_b[-1] == b"":
        lines_b.pop()
    n = len(lines_b)
    account.lines += n
    wrapper = state.wrapper
    if not state.wrapper_known:
        state.wrapper = wrapper = prefixes.detect(lines_b[:400])
        state.wrapper_known = True
        account.wrapper = wrapper.name if wrapper else None
    json_walls: list[float | None] | None = None
    if wrapper is not None and wrapper.stamp == "json":
        lines_b, json_walls = prefixes.decode_json_lines(lines_b, wrapper)
        chunk = b"\n".join(lines_b)
    if b"[" in chunk and _ANSI.search(chunk):
        chunk = _ANSI.sub(b"", chunk)
    if b"\r" in chunk:
        chunk = chunk.replace(b"\r", b"")
    text = chunk.decode("utf-8", "replace").split("\n")
    if len(text) > n:
        del text[n:]
    lines = pa.array(text, pa.string())

    wall = np.full(n, -1, dtype=np.int64)
    if json_walls is not None:
        w = np.array([(-1 if x is None else int(round(x * 1e6))) for x in json_walls], dtype=np.int64)
        wall[:] = w
    elif wrapper is not None:
        lines, wall = prefixes.strip(lines, wrapper, state.year, state.tz)

    parts = pc.extract_regex(lines, FAST_PATTERN)
    valid = parts.is_valid().to_numpy(zero_copy_only=False)
    f = {name: parts.field(name) for name in (t.name for t in parts.type)}

    kind = np.zeros(n, dtype=np.int8)
    conds = [
        (_nonempty(f["k_launch"]), LAUNCH),
        (_nonempty(f["pp_n"]), PROGRESS),
        (_nonempty(f["k_hb"]), HEARTBEAT),
        (_nonempty(f["pe_ms"]), PROMPT_EVAL),
        (_nonempty(f["ev_ms"]), EVAL),
        (_nonempty(f["tt_ms"]), TOTAL),
        (_nonempty(f["rel_n"]), RELEASE),
        (_nonempty(f["k_init"]), INIT),
        (_nonempty(f["n_slots"]), CONFIG),
        (_nonempty(f["cancel"]), CANCEL),
        (_nonempty(f["k_exit"]), EXIT),
        (_nonempty(f["err_task"]), ERROR),
    ]
    for mask, code in conds:
        kind[mask & (kind == 0)] = code
    c_kind = f["c_kind"]
    has_cont = _nonempty(c_kind)
    if has_cont.any():
        ck = np.asarray(c_kind.to_pylist(), dtype=object)
        kind[has_cont & (ck == "prompt eval")] = PROMPT_EVAL
        kind[has_cont & ((ck == "eval") | (ck == "generation eval"))] = EVAL
        kind[has_cont & (ck == "total")] = TOTAL
    slot_line = _nonempty(f["slot"])
    # A print_timing header with an empty message: the older multi-line timing block.
    bad = _nonempty(f["k_bad"])
    header = valid & slot_line & (kind == 0) & ~bad & ~_nonempty(f["k_slot_other"])
    kind[header] = TIMING_HEADER

    ignored = valid & (kind == 0) & ~bad
    unknown_idx = np.flatnonzero(~valid | bad)
    legacy_rows: list[dict] = []
    if len(unknown_idx):
        known_other = 0
        for i in unknown_idx:
            s = text[i] if wrapper is None else lines[int(i)].as_py()
            if bad[i]:
                account.unrecognized += 1
                if len(account.examples) < 5:
                    account.examples.append((first_line + int(i), s[:200]))
                continue
            if not s.strip() or _KNOWN_OTHER.match(s):
                known_other += 1
                continue
            row = legacy.parse_line(s)
            if row is not None:
                row["line"] = first_line + int(i)
                own_wall = row.pop("wall_stamp_us", -1)
                row["wall_us"] = int(wall[i]) if wall[i] >= 0 else own_wall
                legacy_rows.append(row)
                if row.get("kind", 0) == 0:
                    known_other += 1
                continue
            account.unrecognized += 1
            if len(account.examples) < 5:
                account.examples.append((first_line + int(i), s[:200]))
        account.ignored += known_other
    account.ignored += int(ignored.sum())
    used = kind != 0
    account.used += int(used.sum()) + sum(1 for r in legacy_rows if r.get("kind", 0) != 0)

    idx = np.flatnonzero(used)
    ev = pd.DataFrame({"line": (first_line + idx).astype(np.int64), "kind": kind[idx]})
    take = pa.array(idx)

    def col(name: str, typ: pa.DataType = pa.float64()) -> np.ndarray:
        return _num(pc.take(f[name], take), typ)

    port = col("port", pa.int64())
    ev["port"] = np.where(np.isnan(port), -1, port).astype(np.int64) if port.dtype.kind == "f" else port
    tmin, tsec, tms, tus = (col(x) for x in ("tmin", "tsec", "tms", "tus"))
    ts = ((tmin * 60 + tsec) * 1000 + tms) * 1000 + tus
    ev["ts_us"] = np.where(np.isnan(ts), -1, ts).astype(np.int64)
    ev["wall_us"] = wall[idx]
    slot = col("slot")
    task = col("task")
    k = ev["kind"].to_numpy()
    task = np.where(k == CANCEL, col("cancel"), task)
    task = np.where(k == ERROR, col("err_task"), task)
    ev["slot"] = slot
    ev["task"] = task

    def pick(*pairs: tuple[int, str]) -> np.ndarray:
        out = np.full(len(idx), np.nan)
        for code, name in pairs:
            m = k == code
            if m.any():
                out[m] = col(name)[m]
        return out

    cm = col("c_ms")
    cn = col("c_n")
    cont = has_cont[idx]
    v1 = pick((PROGRESS, "pp_n"), (HEARTBEAT, "hb_n"), (PROMPT_EVAL, "pe_ms"), (EVAL, "ev_ms"),
              (TOTAL, "tt_ms"), (RELEASE, "rel_n"), (CONFIG, "n_slots"), (LAUNCH, "child"))
    v2 = pick((PROGRESS, "pp_prog"), (HEARTBEAT, "hb_tg"), (PROMPT_EVAL, "pe_n"), (EVAL, "ev_n"),
              (TOTAL, "tt_n"), (RELEASE, "rel_tr"), (CONFIG, "n_ctx"))
    v3 = pick((PROGRESS, "pp_t"), (HEARTBEAT, "hb_tg3"))
    v4 = pick((PROGRESS, "pp_tps"))
    v1[cont] = cm[cont]
    v2[cont] = cn[cont]
    ev["v1"], ev["v2"], ev["v3"], ev["v4"] = v1, v2, v3, v4
    ev["cont"] = cont

    if legacy_rows:
        lg = pd.DataFrame(legacy_rows)
        lg = lg[lg["kind"] != 0]
        if len(lg):
            ev = pd.concat([ev, lg.reindex(columns=ev.columns)], ignore_index=True).sort_values("line", kind="stable")
            ev["cont"] = ev["cont"].fillna(False).astype(bool)
            ev["port"] = ev["port"].fillna(-1).astype(np.int64)
            ev["ts_us"] = ev["ts_us"].fillna(-1).astype(np.int64)
            ev["wall_us"] = ev["wall_us"].fillna(-1).astype(np.int64)
            ev["kind"] = ev["kind"].astype(np.int8)
    return ev.reset_index(drop=True)


def assign_sessions(ev: pd.DataFrame, state: StreamState) -> pd.DataFrame:
    """Number process sessions per port: a start-up banner or a clock going back starts one.

    Also attaches the continuation lines of older multi-line timing blocks to their header,
    and fills a relative clock from wall-clock stamps where llama's own timestamps are off.
    """
    if ev.empty:
        ev["session"] = pd.Series(dtype=np.int64)
        return ev
    ts = ev["ts_us"].to_numpy().copy()
    wall = ev["wall_us"].to_numpy()
    if (ts < 0).all() and (wall >= 0).any():
        if state.wall_origin is None:
            state.wall_origin = int(wall[wall >= 0][0])
        ts = np.where(wall >= 0, wall - state.wall_origin, -1)
        ev["ts_us"] = ts
    # Older multi-line blocks: continuation rows take slot/task/time from their header.
    cont = ev["cont"].to_numpy()
    if cont.any() or state.last_header is not None:
        k = ev["kind"].to_numpy()
        hdr = k == TIMING_HEADER
        if cont.any():
            h_port = pd.Series(np.where(hdr, ev["port"], np.nan))
            h_slot = pd.Series(np.where(hdr, ev["slot"], np.nan))
            h_task = pd.Series(np.where(hdr, ev["task"], np.nan))
            h_ts = pd.Series(np.where(hdr, ts, np.nan))
            if state.last_header is not None:
                p, s, t, tt = state.last_header
                for ser, val in ((h_port, p), (h_slot, s), (h_task, t), (h_ts, tt)):
                    if np.isnan(ser.iloc[0]):
                        ser.iloc[0] = val
            h_port, h_slot, h_task, h_ts = (x.ffill().to_numpy() for x in (h_port, h_slot, h_task, h_ts))
            ok = cont & ~np.isnan(h_task)
            ev.loc[ok, "port"] = h_port[ok].astype(np.int64)
            ev.loc[ok, "slot"] = h_slot[ok]
            ev.loc[ok, "task"] = h_task[ok]
            ts = np.where(ok, h_ts, ts).astype(np.int64)
            ev["ts_us"] = ts
        if hdr.any():
            last = np.flatnonzero(hdr)[-1]
            state.last_header = (int(ev["port"].iat[last]), int(ev["slot"].iat[last]), int(ev["task"].iat[last]), int(ts[last]))
    ports = ev["port"].to_numpy()
    kinds = ev["kind"].to_numpy()
    session = np.zeros(len(ev), dtype=np.int64)
    for port in np.unique(ports):
        m = ports == port
        p_ts = ts[m]
        p_kind = kinds[m]
        prev = state.last_ts.get(int(port), -1)
        # A clock going back by more than a second means a new process (same-millisecond
        # reordering between logger threads is far smaller).
        known = p_ts >= 0
        ff = pd.Series(np.where(known, p_ts, np.nan)).ffill().shift(1).to_numpy().copy()
        ff[0] = prev if prev >= 0 else np.nan
        back = known & ~np.isnan(ff) & (p_ts < ff - 1_000_000)
        banner = p_kind == INIT
        start = back | banner
        had = state.session_has_lines.get(int(port), False)
        # A banner at the very start of a stream opens session 1; it is not a restart.
        cur = state.session.get(int(port), 1)
        boundaries = start.copy()
        if not had and banner.any():
            first_banner = np.flatnonzero(banner)[0]
            if not (~banner[:first_banner] & (p_kind[:first_banner] != INIT)).any():
                boundaries[first_banner] = False
        s = cur + np.cumsum(boundaries)
        session[m] = s
        state.session[int(port)] = int(s[-1])
        state.session_has_lines[int(port)] = True
        if known.any():
            state.last_ts[int(port)] = int(p_ts[known][-1])
    ev["session"] = session
    return ev


@dataclass
class ServerLogs:
    """Everything read from llama-server logs: the tables and the line accounting."""

    tasks: pd.DataFrame
    gen_samples: pd.DataFrame
    prefill_samples: pd.DataFrame
    sessions: pd.DataFrame
    accounting: Accounting


def read_stream(
    files: list[LogFile],
    inputs: Inputs,
    *,
    keep_samples: bool = True,
    tz: str = "UTC",
    year: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[TaskAssembler, list[FileAccount]]:
    """Parse one server-log stream (rotated files oldest first) into an assembler."""
    source = files[-1].stream if files[-1].stream != STDIN else "<stdin>"
    state = StreamState(source=source, tz=tz)
    if year is not None:
        state.year = year
    asm = TaskAssembler(source=source, keep_samples=keep_samples)
    accounts = []
    for lf in files:
        account = FileAccount(lf.path if lf.path != STDIN else "<stdin>")
        accounts.append(account)
        state.wrapper_known = state.wrapper_known and lf.order > 0
        stream = reopen(lf, inputs)
        try:
            line = 1
            for chunk in iter_chunks(stream, lf.path):
                ev = parse_chunk(chunk, line, state, account)
                line = account.lines + 1
                if len(ev):
                    ev["file"] = account.path
                    asm.add(assign_sessions(ev, state))
                if progress is not None:
                    progress(len(chunk))
        except InputError as e:
            account.error = e.reason
        finally:
            if lf.path != STDIN:
                stream.close()
    return asm, accounts


def read_server_logs(
    paths: Sequence[str | os.PathLike[str]],
    *,
    keep_samples: bool = True,
    tz: str = "UTC",
    year: int | None = None,
    progress: Callable[[int], None] | None = None,
    inputs: Inputs | None = None,
) -> ServerLogs:
    """Read llama-server logs (files, directories, globs, ``-``) into task and sample tables.

    Tasks are keyed by (source, session, task_id); times are seconds on that session's server
    clock, with wall-clock columns where a capture wrapper stamped the lines. App call logs
    found among the paths are skipped here (see :func:`slotscope.app_log.read_app_logs`).
    """
    if inputs is None:
        inputs = collect(paths)
    tasks, gens, prefills, sessions = [], [], [], []
    acc = Accounting(skipped=list(inputs.skipped), unusable=list(inputs.unusable))
    for files in inputs.server:
        asm, accounts = read_stream(files, inputs, keep_samples=keep_samples, tz=tz, year=year, progress=progress)
        t, g, p, s = asm.finish()
        tasks.append(t)
        gens.append(g)
        prefills.append(p)
        sessions.append(s)
        acc.files.extend(accounts)
    out = ServerLogs(
        tasks=_concat(tasks, TASK_COLUMNS),
        gen_samples=_concat(gens, GEN_COLUMNS),
        prefill_samples=_concat(prefills, PREFILL_COLUMNS),
        sessions=_concat(sessions, ["source", "port", "session"]),
        accounting=acc,
    )
    st = out.tasks["status"] if len(out.tasks) else pd.Series([], dtype=str)
    acc.tasks_complete = int((st == "complete").sum())
    acc.tasks_cancelled = int((st == "cancelled").sum())
    acc.tasks_incomplete = int((st == "incomplete").sum())
    acc.sessions = len(out.sessions)
    return out


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in columns})
    return pd.concat(frames, ignore_index=True)
