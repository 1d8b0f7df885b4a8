"""Ollama's server log: [GIN] access lines, slog lines, and the llama-server runner inside.

An Ollama log is read once, a block at a time. Its own lines are read here:

- ``[GIN]`` access lines become calls: end = the stamp (local time, 1 s), start = end -
  latency. Only inference paths are calls; ``/api/ps``, ``/api/tags``, ``HEAD /`` and the
  like are known and ignored.
- slog lines (``time=… level=… source=… msg=…``) and the Go-log lines of older versions
  become events: the config dump, the version, runner starts and their load time, the load
  request's ``Parallel``, client aborts, context shifts. The other slog lines are known and
  ignored.

Every other line is taken for the runner's (llama-server's) and handed to the llama-server
reader unchanged, in a file of its own that keeps every line at its line number (Ollama's
own lines are left blank there). From v0.30 Ollama starts llama-server with
``--no-log-timestamps --no-log-prefix``: its lines carry no time. Each is given the stamp of
its own wrapper (journald stamps every line, to the second) or else that of the next line
of Ollama's that has one: a line is written before the next stamped line, so its time is at
most that stamp, and where Ollama writes often (a [GIN] line at each call's end) it is
good to about a second. Once the runner lines are read, :func:`retime` takes what the tasks'
own timings tell (a runner stream's tasks are all good to 1 s, ``time_resolution_s``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import re
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from . import prefixes, store
from .accounting import Accounting, FileAccount
from .errors import InputError
from .sources import STDIN, Inputs, LogFile, iter_chunks, reopen
from .tasks import TaskAssembler, prefill_start_us, timing_anchor_us

TIME_RESOLUTION_S = 1.0  # what the runner lines' borrowed times, and [GIN]'s stamps, are good to

INFERENCE_PATHS = frozenset({
    "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/v1/chat/completions", "/v1/completions",
    "/v1/embeddings", "/v1/responses", "/v1/messages",
})
CALL_COLUMNS = ["source", "call_id", "start_at", "end_at", "latency_ms", "status", "method", "path", "client", "line",
                "file"]
EVENT_COLUMNS = ["source", "file", "line", "at", "kind", "text"]

_GIN = (r"\[GIN\] (?P<gin_at>\d{4}/\d\d/\d\d - \d\d:\d\d:\d\d) \| *(?P<status>\d{3}) *\| *(?P<latency>[0-9.]+[a-zµμ]+(?:[0-9.]+[a-zµμ]+)*) *\|"
        r" *(?P<client>\S*) *\| *(?P<method>[A-Z]+) +\"(?P<path>(?:[^\"\\]|\\.)*)\"")
_SLOG = (r"time=(?P<slog_at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?P<zone>Z|[+-]\d\d:\d\d)) level=(?P<level>[A-Z]+(?:[+-]\d+)?)"
         r" source=\S+ msg=(?P<msg>\"(?:[^\"\\]|\\.)*\"|\S*)(?P<attrs>.*)")
_GOLOG = r"(?P<go_at>\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) [\w.-]+\.go:\d+: (?P<go_msg>.*)"
# systemd's own lines about the unit, and what Ollama's old versions printed bare.
_OTHER = r"(?P<other>(?:Start|Stopp)(?:ing|ed) .*[Oo]llama.*|ollama\.service: .*|llama server listening at .*)"
PATTERN = "^(?:" + _GIN + "|" + _SLOG + "|" + _GOLOG + "|" + _OTHER + ")"

# Event kinds (the events' ``kind``) by the message that says them.
_EVENTS = [
    ("config", re.compile(r"^server config")),
    ("version", re.compile(r"^Listening on .*\(version [^)]+\)")),
    ("runner_start", re.compile(r"^starting (?:llama server|runner|llama-server)")),
    ("runner_ready", re.compile(r"^(?:llama runner|llama-server) started in [0-9.]+ seconds")),
    ("load_request", re.compile(r"^load$")),
    ("fit", re.compile(r"^new model will fit")),
    ("unload", re.compile(r"^(?:timer expired|runner with zero duration has gone idle), expiring to unload")),
    ("abort", re.compile(r"^aborting completion request due to client closing the connection")),
    ("shift", re.compile(r"^context limit hit - shifting")),
]
_ANSI = re.compile(rb"\x1b?\[[0-9;]*m")
_QUOTED = re.compile(rb"(?m)^(?:> ?|`)")  # a log pasted as a markdown quote or code span


def parse_duration_ms(text: pd.Series) -> pd.Series:
    """Go durations as gin prints them (``837.348699ms``, ``57.956598944s``, ``1m43s``,
    ``4.2µs``, ``1h2m3s``) in milliseconds; NaN for what is not one."""
    parts = text.str.extract(r"^(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m(?!s))?(?:(?P<v>[0-9.]+)(?P<u>s|ms|µs|μs|us|ns))?$")
    scale = parts["u"].map({"s": 1e3, "ms": 1.0, "µs": 1e-3, "μs": 1e-3, "us": 1e-3, "ns": 1e-6})
    value = pd.to_numeric(parts["v"], errors="coerce") * scale
    hours = pd.to_numeric(parts["h"], errors="coerce")
    minutes = pd.to_numeric(parts["m"], errors="coerce")
    out = hours.fillna(0) * 3.6e6 + minutes.fillna(0) * 6e4 + value.fillna(0)
    none = hours.isna() & minutes.isna() & value.isna()
    return out.mask(none).astype("float64")


@dataclass
class _State:
    """What one Ollama stream carries from block to block."""

    source: str
    tz: str
    year: int
    wrapper: prefixes.Wrapper | None = None
    wrapper_known: bool = False
    offset_us: int | None = None  # the slog lines' UTC offset, for [GIN]'s local stamps
    zone: str | None = None  # that offset as text (+08:00, Z), the calls' zone
    calls: int = 0
    last_stamp: int = -1


@dataclass
class OllamaLogs:
    """What Ollama's own lines said, per stream, and the runner lines' files for the
    llama-server reader (removed by :meth:`discard`)."""

    calls: pd.DataFrame = field(default_factory=lambda: _empty_calls())
    events: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({c: [] for c in EVENT_COLUMNS}))
    accounts: dict[str, FileAccount] = field(default_factory=dict)  # by file: Ollama's lines only
    blanked: dict[str, int] = field(default_factory=dict)  # by file: Ollama's lines, blank for the runner reader
    wrappers: dict[str, str | None] = field(default_factory=dict)
    zones: dict[str, str] = field(default_factory=dict)  # by source: the zone its times were written in
    runner: list[list[LogFile]] = field(default_factory=list)
    tmp: "store.TempDir | None" = None

    @property
    def found(self) -> bool:
        return bool(self.accounts)

    def settle(self, acc: Accounting) -> None:
        """Fold Ollama's line counts into the runner reader's accounts of the same files."""
        for f in acc.files:
            own = self.accounts.get(f.path)
            if own is None:
                continue
            f.kind = "ollama"
            f.wrapper = self.wrappers.get(f.path)
            f.ignored += own.ignored - self.blanked[f.path]
            f.used += own.used
        mine = {f.path for f in acc.files}
        for path, own in self.accounts.items():  # (a file the runner reader never opened)
            if path not in mine:
                acc.files.append(own)
        if self.found:
            acc.notes.append(f"Ollama's runner (llama-server) lines carry no time of their own: each is timed by "
                             f"the next stamped line and its task's timings, good to about {TIME_RESOLUTION_S:.0f} s")

    def in_zone(self, calls: pd.DataFrame) -> pd.DataFrame:
        """The calls' times in the zone Ollama wrote them in (where all its logs have one)."""
        zones = set(self.zones.values())
        if len(zones) != 1:
            return calls
        zone = zones.pop()
        return calls.assign(**{c: _in_zone(calls[c], zone) for c in ("start_at", "end_at")})

    def is_runner(self, files: list[LogFile]) -> bool:
        """Whether a server-log stream is one of the runner lines' (:func:`runner_streams`)."""
        return any(files is r for r in self.runner)

    def discard(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


def _in_zone(col: pd.Series, zone: str) -> pd.Series:
    """Times shown in a zone given as ``UTC``, a name, or an offset ``+01:00``."""
    m = re.fullmatch(r"([+-])(\d\d):(\d\d)", zone)
    if m is None:
        return col.dt.tz_convert(zone)
    minutes = (int(m[2]) * 60 + int(m[3])) * (1 if m[1] == "+" else -1)
    return col.dt.tz_convert(dt.timezone(dt.timedelta(minutes=minutes)))


def _empty_calls() -> pd.DataFrame:
    return pd.DataFrame({
        "source": pd.Series(dtype="object"), "call_id": pd.Series(dtype="object"),
        "start_at": pd.Series(dtype="datetime64[us, UTC]"), "end_at": pd.Series(dtype="datetime64[us, UTC]"),
        "latency_ms": pd.Series(dtype="float64"), "status": pd.Series(dtype="int64"),
        "method": pd.Series(dtype="object"), "path": pd.Series(dtype="object"), "client": pd.Series(dtype="object"),
        "line": pd.Series(dtype="int64"), "file": pd.Series(dtype="object"),
    })


def runner_streams(inputs: Inputs, *, tz: str = "UTC", year: int | None = None) -> tuple[Inputs, OllamaLogs]:
    """Read the Ollama logs among the inputs: their calls and events, and, as server-log
    streams in place of the Ollama ones, the files of their runner lines."""
    logs = OllamaLogs()
    if not inputs.ollama:
        return inputs, logs
    logs.tmp = store.temp_dir("Ollama's runner lines", prefix="slotscope-ollama-")
    calls, events = [], []
    try:
        for k, files in enumerate(inputs.ollama):
            source = files[-1].stream if files[-1].stream != STDIN else "<stdin>"
            state = _State(source=source, tz=tz, year=year or pd.Timestamp.now().year)
            derived = []
            for lf in files:
                shown = lf.path if lf.path != STDIN else "<stdin>"
                path = os.path.join(logs.tmp.name, f"{k}-{lf.order}.log")
                account = FileAccount(shown, kind="ollama")
                logs.accounts[shown] = account
                with open(path, "w", encoding="utf-8") as out:
                    c, e, blanked = _read_file(lf, inputs, state, account, out)
                logs.blanked[shown] = blanked
                logs.wrappers[shown] = "ollama" + (f", {state.wrapper.name}" if state.wrapper else "")
                calls += c
                events += e
                derived.append(LogFile(path, "server", files[-1].stream, lf.order, shown=shown))
            logs.runner.append(derived)
            logs.zones[source] = state.zone or tz
    except BaseException:
        logs.discard()
        raise
    if calls:
        logs.calls = pd.concat(calls, ignore_index=True)
    if events:
        logs.events = pd.concat(events, ignore_index=True)
    return dataclasses.replace(inputs, server=inputs.server + logs.runner, ollama=[]), logs


def _read_file(lf: LogFile, inputs: Inputs, state: _State, account: FileAccount,
               out: TextIO) -> tuple[list[pd.DataFrame], list[pd.DataFrame], int]:
    """One file: its calls and events (tables per block), its runner lines written to
    ``out`` line for line, and how many of Ollama's lines were left blank there."""
    stream = reopen(lf, inputs)
    calls: list[pd.DataFrame] = []
    events: list[pd.DataFrame] = []
    blanked = 0
    carry: list[str] = []  # lines after the block's last stamp: their time is in a later block
    try:
        for block in iter_chunks(stream, account.path):
            text = _clean(block).decode("utf-8")
            lines = carry + text.split("\n")
            if text.endswith("\n"):
                lines.pop()
            done, carry, c, e, b = _read_lines(lines, account.lines + 1, state, account, final=False)
            out.write("".join(d + "\n" for d in done))
            calls, events, blanked = calls + c, events + e, blanked + b
        if carry:
            done, _, c, e, b = _read_lines(carry, account.lines + 1, state, account, final=True)
            out.write("".join(d + "\n" for d in done))
            calls, events, blanked = calls + c, events + e, blanked + b
    except InputError as err:
        account.error = err.reason
    finally:
        if lf.path != STDIN:
            stream.close()
    return calls, events, blanked


def _clean(chunk: bytes) -> bytes:
    """Colour codes (gin colours its columns on a terminal), carriage returns and the marks
    of a pasted quote removed; line breaks kept."""
    if b"[" in chunk:
        chunk = _ANSI.sub(b"", chunk)
    chunk = chunk.replace(b"\r", b"")
    if b">" in chunk or b"`" in chunk:
        chunk = _QUOTED.sub(b"", chunk)
    return chunk.decode("utf-8", "replace").encode("utf-8")


def _read_lines(lines: list[str], first: int, state: _State, account: FileAccount, *, final: bool
                ) -> tuple[list[str], list[str], list[pd.DataFrame], list[pd.DataFrame], int]:
    """Lines ``first``.. of a file: the runner reader's text of each line that is done (all
    but those after the last stamp, unless ``final``), those left over, the calls, the events,
    and how many of the done lines were Ollama's (left blank)."""
    arr, wall = _unwrapped(lines, state)
    parts = pc.extract_regex(arr, PATTERN)
    ok = parts.is_valid().to_numpy(zero_copy_only=False)
    f = {name: pd.Series(pc.fill_null(parts.field(name), "").to_numpy(zero_copy_only=False), dtype=object)
         for name in (t.name for t in parts.type)}

    def has(name: str) -> np.ndarray:
        return (f[name] != "").to_numpy()

    gin, slog, golog = ok & has("gin_at"), ok & has("slog_at"), ok & has("go_at")
    own = _own_stamps(f, gin, slog, golog, wall, state)
    cut, borrowed = _borrowed_stamps(np.where(own >= 0, own, wall), slog, state, final=final)
    mine = ok[:cut]
    done = _runner_lines(arr.to_pylist()[:cut], mine, borrowed[:cut])
    calls = _calls(f, gin[:cut], own[:cut], first, state, account.path)
    events, used_events = _events(f, slog[:cut] | golog[:cut], own[:cut], first, state, account)
    account.used += len(calls) + used_events
    account.ignored += int(mine.sum()) - len(calls) - used_events
    account.lines += cut
    return done, lines[cut:], [calls] if len(calls) else [], [events] if len(events) else [], int(mine.sum())


def _unwrapped(lines: list[str], state: _State) -> tuple[pa.Array, np.ndarray]:
    """The lines without their wrapper's prefix (journald, docker, ...; detected on the first
    block) and the wrapper's stamp of each (UTC µs; -1: none)."""
    if not state.wrapper_known:
        state.wrapper = prefixes.detect([ln.encode() for ln in lines[:400]])
        state.wrapper_known = True
    arr = pa.array(lines, pa.string())
    wall = np.full(len(lines), -1, dtype=np.int64)
    if state.wrapper is not None and state.wrapper.stamp == "json":
        bare_b, walls = prefixes.decode_json_lines([ln.encode() for ln in lines], state.wrapper)
        arr = pa.array([b.decode("utf-8", "replace") for b in bare_b], pa.string())
        wall = np.array([int(round(w * 1e6)) if w is not None else -1 for w in walls], np.int64)
    elif state.wrapper is not None:
        arr, wall = prefixes.strip(arr, state.wrapper, state.year, state.tz)
    return arr, wall


def _own_stamps(f: dict[str, pd.Series], gin: np.ndarray, slog: np.ndarray, golog: np.ndarray, wall: np.ndarray,
                state: _State) -> np.ndarray:
    """Each line's own stamp (UTC µs; -1: none): a slog line's carries its zone, which the
    stream's first one sets for the local stamps of [GIN] and Go's log."""
    own = np.full(len(wall), -1, dtype=np.int64)
    if slog.any():
        at = pd.to_datetime(f["slog_at"][slog], format="ISO8601", utc=True)
        own[slog] = at.astype("datetime64[us, UTC]").astype("int64").to_numpy()
        zones = f["zone"][slog]
        offsets = (pd.to_datetime(f["slog_at"][slog].str.slice(0, 19), format="%Y-%m-%dT%H:%M:%S")
                   .astype("datetime64[us]").astype("int64").to_numpy() - own[slog] // 1_000_000 * 1_000_000)
        if state.offset_us is None:
            state.offset_us = int(offsets[0])
            state.zone = "UTC" if zones.iloc[0] == "Z" else str(zones.iloc[0])
    for mask, col, fmt in ((gin, "gin_at", "%Y/%m/%d - %H:%M:%S"), (golog, "go_at", "%Y/%m/%d %H:%M:%S")):
        if mask.any():
            naive = pd.to_datetime(f[col][mask], format=fmt, errors="coerce")
            own[mask] = _local_to_utc_us(naive, wall[mask], state)
    return own


def _borrowed_stamps(stamp: np.ndarray, slog: np.ndarray, state: _State, *, final: bool) -> tuple[int, np.ndarray]:
    """How many of the lines are done (those up to the last stamped one; all if ``final``) and
    each line's time (µs; -1: none yet): its own stamp, else the latest the stamped lines after
    it allow (a line is written before them); a stamp cut to the second ([GIN], Go's log,
    journald's short format) allows up to the end of its second."""
    n = len(stamp)
    known = stamp >= 0
    if final or not known.any():
        cut = n if final or n > 100_000 else 0
    else:
        cut = int(np.flatnonzero(known)[-1]) + 1
    latest = np.where(known & ~slog & (stamp % 1_000_000 == 0), stamp + 999_999, stamp).astype(np.float64)
    latest[~known] = np.inf
    latest = np.minimum.accumulate(latest[::-1])[::-1]
    nxt = pd.Series(np.where(np.isinf(latest), np.nan, latest))
    if final:
        nxt = nxt.ffill()  # (after the last stamp of the file: the last one)
    borrowed = nxt.fillna(-1).to_numpy().astype(np.int64)
    if (~known[:cut]).any() and state.last_stamp >= 0:
        borrowed[:cut][borrowed[:cut] < 0] = state.last_stamp
    if known[:cut].any():
        state.last_stamp = int(stamp[:cut][known[:cut]][-1])
    return cut, borrowed


def _runner_lines(bare: list[str], mine: np.ndarray, borrowed: np.ndarray) -> list[str]:
    """The runner reader's text of each line: blank for Ollama's own lines and empty ones,
    else the line framed as a CRI runtime frames it, with its time (the one frame whose stamp
    no payload can be taken for)."""
    stamps = pd.to_datetime(pd.Series(borrowed), unit="us", utc=True).dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return ["" if mine[i] or not bare[i].strip() else (f"{stamps.iat[i]} stderr F {bare[i]}" if borrowed[i] >= 0 else bare[i])
            for i in range(len(bare))]


def _local_to_utc_us(naive: pd.Series, wall: np.ndarray, state: _State) -> np.ndarray:
    """Local stamps without a zone ([GIN], Go's log) as UTC µs: in the slog lines' zone, else
    in the wrapper's (its stamp of the same line), else in ``--tz``."""
    local = naive.astype("datetime64[us]").astype("int64").to_numpy()
    bad = naive.isna().to_numpy().copy()
    if state.offset_us is not None:
        out = local - state.offset_us
    elif state.wrapper is not None and state.wrapper.stamp in ("iso", "json", "unix") and (wall >= 0).all():
        quarter = 900_000_000
        out = local - np.round((local - wall) / quarter).astype(np.int64) * quarter
    else:
        at = naive.dt.tz_localize(state.tz, ambiguous="NaT", nonexistent="NaT")
        out = at.dt.tz_convert("UTC").astype("datetime64[us, UTC]").astype("int64").to_numpy()
        bad |= at.isna().to_numpy()
    return np.where(bad, -1, out)


def _calls(f: dict[str, pd.Series], gin: np.ndarray, end_us: np.ndarray, first: int, state: _State,
           file: str) -> pd.DataFrame:
    """The inference calls among the [GIN] lines (the others are known and ignored)."""
    rows = np.flatnonzero(gin)
    path = f["path"].iloc[rows].reset_index(drop=True)
    inference = path.str.split("?").str[0].isin(INFERENCE_PATHS).to_numpy()
    rows, path = rows[inference], path[inference].reset_index(drop=True)
    latency = parse_duration_ms(f["latency"].iloc[rows].reset_index(drop=True))
    end = pd.Series(end_us[rows])
    ids = [f"gin-{state.calls + i + 1}" for i in range(len(rows))]
    state.calls += len(rows)
    return pd.DataFrame({
        "source": state.source, "call_id": ids,
        "start_at": _at(end - (latency * 1000).round().astype("Int64")),
        "end_at": _at(end), "latency_ms": latency,
        "status": pd.to_numeric(f["status"].iloc[rows].reset_index(drop=True)).astype("int64"),
        "method": f["method"].iloc[rows].reset_index(drop=True), "path": path,
        "client": f["client"].iloc[rows].reset_index(drop=True),
        "line": (first + rows).astype(np.int64), "file": file,
    })


def _at(us: pd.Series) -> pd.Series:
    us = pd.Series(us).astype("Int64")
    return pd.to_datetime(us.where(us >= 0), unit="us", utc=True).astype("datetime64[us, UTC]")


def _events(f: dict[str, pd.Series], mask: np.ndarray, at_us: np.ndarray, first: int, state: _State,
            account: FileAccount) -> tuple[pd.DataFrame, int]:
    """The slog and Go-log lines that say something the analysis reads."""
    rows = np.flatnonzero(mask)
    msg = f["msg"].iloc[rows].fillna("").str.strip('"').str.replace('\\"', '"', regex=False)
    go = f["go_msg"].iloc[rows].fillna("").str.replace(r"^(?:INFO|WARN|ERROR|DEBUG) ", "", regex=True)
    msg = msg.where(msg != "", go).reset_index(drop=True)
    attrs = f["attrs"].iloc[rows].fillna("").reset_index(drop=True)
    kind = pd.Series(None, index=msg.index, dtype="object")
    for name, rx in _EVENTS:
        kind = kind.where(kind.notna() | ~msg.str.contains(rx), name)
    keep = kind.notna().to_numpy()
    rows = rows[keep]
    out = pd.DataFrame({
        "source": state.source, "file": account.path, "line": (first + rows).astype(np.int64),
        "at": _at(pd.Series(at_us[rows])), "kind": kind[keep].reset_index(drop=True),
        "text": (msg[keep] + attrs[keep]).reset_index(drop=True),
    })
    return out, len(out)


_TASK_KEY = ["port", "session", "task"]


def retime(asm: TaskAssembler) -> None:
    """Give a runner stream's tasks and samples (read, closed) the times their own timings
    tell, where those are earlier than the borrowed ones (a line's borrowed time is an upper
    bound):

    - a prefill progress line is ``elapsed`` seconds after its task's prefill start (timing
      lines' time - ``total time``), a heartbeat ``(n_gen - 1) / tg`` seconds after its
      first token (prefill start + ``prompt eval time``);
    - a task was launched at the latest time its launch line allows: before its borrowed
      time, before its own prefill start, and before the next sample line of any task
      (behind another slot's long prefill, that is the other slot's next progress line, not
      this task's prefill start seconds later);
    - a task was released no later than the next launch on its slot;
    - and none before the stream's first line (its clock's zero: a derived time may come out
      up to a second early, as a [GIN] stamp is cut to the second).

    Every task's ``time_resolution_s`` is then 1 s: a wait before prefill under it reads 0.
    """
    t, t_files = asm.rows_of("tasks", _TASK_KEY + ["file", "line", "slot_launch", "launch_us", "release_us", "eval_us",
                                                   "total_us", "total_ms", "prompt_eval_ms", "eval_ms"])
    prefill = prefill_start_us(timing_anchor_us(t["eval_us"], t["total_us"]), t["total_ms"], t["prompt_eval_ms"],
                               t["eval_ms"])
    first = prefill + t["prompt_eval_ms"] * 1000
    lines: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (file names, lines, times) of the samples
    for which, names in (("prefill", ["v3"]), ("gen", ["v1", "v2"])):
        s, s_files = asm.rows_of(which, _TASK_KEY + ["file", "line", "ts_us"] + names)
        if not len(s["line"]):
            continue
        at = _row_of(t, s)
        own = np.where(at >= 0, (prefill if which == "prefill" else first)[at], np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            after = s["v3"] * 1e6 if which == "prefill" else (s["v1"] - 1) / s["v2"] * 1e6
            told = own + after
        told = np.maximum(told, 0)  # (not before the clock's zero, the stream's first line)
        ts = np.where(np.isfinite(told) & (told < s["ts_us"]), np.round(told), s["ts_us"]).astype(s["ts_us"].dtype)
        asm.update(which, {"ts_us": ts})
        lines.append((np.asarray(s_files, dtype=object)[s["file"].astype(np.int64)], s["line"], ts))
    launch = t["launch_us"].copy()
    with np.errstate(invalid="ignore"):
        launch = np.where(prefill < launch, np.round(np.maximum(prefill, 0)), launch)  # (NaN: no launch, or no timings)
    if lines:
        file = np.concatenate([x[0] for x in lines])
        line, ts = np.concatenate([x[1] for x in lines]), np.concatenate([x[2] for x in lines])
        t_file = np.asarray(t_files, dtype=object)[np.nan_to_num(t["file"]).astype(np.int64)] if t_files else file[:0]
        for name in pd.unique(file):  # (line numbers count per file)
            m, tm = np.flatnonzero(file == name), np.flatnonzero(t_file == name)
            order = m[np.argsort(line[m], kind="stable")]
            j = np.searchsorted(line[order], t["line"][tm], side="right")
            nxt = np.where(j < len(order), ts[order[np.minimum(j, len(order) - 1)]], np.nan)
            with np.errstate(invalid="ignore"):
                launch[tm] = np.where(nxt < launch[tm], nxt, launch[tm])
    release = _released_before_next_launch(t, launch)
    asm.update("tasks", {"launch_us": launch, "release_us": release,
                         "resolution_us": np.full(len(launch), TIME_RESOLUTION_S * 1e6)})


def _released_before_next_launch(t: dict[str, np.ndarray], launch: np.ndarray) -> np.ndarray:
    """Each task's release, no later than the next launch on its slot: a slot runs one task at a
    time, and its release line comes before that launch line (both times are upper bounds)."""
    release = t["release_us"].astype(np.float64).copy()
    key = pd.DataFrame({c: t[c] for c in ("port", "session", "slot_launch")}).assign(line=t["line"], launch=launch)
    key = key.dropna(subset=["slot_launch", "line"]).sort_values(["port", "session", "slot_launch", "line"], kind="stable")
    same = key[["port", "session", "slot_launch"]].eq(key[["port", "session", "slot_launch"]].shift(-1)).all(axis=1)
    nxt = key["launch"].shift(-1).where(same)
    rows = key.index.to_numpy()
    with np.errstate(invalid="ignore"):
        release[rows] = np.fmin(release[rows], nxt.to_numpy(dtype=np.float64))
    return release


def _row_of(tasks: dict[str, np.ndarray], rows: dict[str, np.ndarray]) -> np.ndarray:
    """Each row's task's place among ``tasks`` (its first row, for a task id seen twice; -1: none)."""
    t = pd.DataFrame({c: tasks[c].astype(np.int64) for c in _TASK_KEY}).assign(at=np.arange(len(tasks["task"])))
    r = pd.DataFrame({c: rows[c].astype(np.int64) for c in _TASK_KEY})
    got = r.merge(t.drop_duplicates(_TASK_KEY), on=_TASK_KEY, how="left")["at"]
    return got.fillna(-1).to_numpy().astype(np.int64)
