#!/usr/bin/env python3
"""Build a large, realistic llama-server log (+ matching app log) by replaying real sessions.

    python bench/make_log.py --size 1GB --out bench/out/1GB/ [--seed 1]

Writes ``llama-server.log``, ``llama-server.log.gz`` (``gzip -6`` of the same bytes) and
``app.jsonl`` into the out dir, plus ``.generated.json`` (what was built; dot-named so
``slotscope`` skips it when given the directory).

How: the real captured sessions in ``fixtures/real/<scenario>/logs`` are replayed back to back
as ONE continuous llama-server process. Per replay every server-log timestamp is shifted by a
running offset (format ``M.SS.mmm.uuu`` kept, minutes unbounded) and every task id by a running
offset (ids stay unique and increasing). The start-up banner is written once (first replay
only) and ``cleaning up before exit`` once (at the very end). Scenario specifics:

* ``wallclock``: the ``ts`` wall-clock prefix is stripped (its lines then look like the
  others; it ran with ``-np 2``, so it only uses slots 0-1).
* ``restart``: its two processes are merged into one timeline (the second process shifted by
  the real gap between the two starts, its task ids continued after the first's, its banner
  and the first ``cleaning up`` line dropped). The ``stop: cancel task`` line and the call the
  restart cut off are kept: in the merged timeline that task is cancelled and never released,
  which a real server also produces when a client goes away.

``app.jsonl`` records are shifted by the same wall-clock offset (``popen_wall`` of each
scenario -> the merged process' start) and get ids ``r<replay>-<id>``; a replay is one session
of one scenario, so the ids are unique.

Speed: each scenario is pre-rendered once as a template in which only the minute field of the
timestamp and the task id vary; replays start on whole minutes, so rendering a replay is one
``%``-format per line with two ready-made byte strings. Output is written in ~8 MiB blocks;
the same blocks are gzip-compressed (level 6) by worker threads on every core, pigz-style,
into one standard gzip member. Memory is bounded (templates + a few blocks), whatever the
size.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures" / "real"
DEFAULT_SCENARIOS = ("before", "after", "b2048-unified", "restart", "wallclock")

BLOCK_BYTES = 8 << 20
MINUTE_US = 60_000_000
UTC = dt.timezone.utc

# optional `ts` wall-clock prefix (wallclock scenario), then M.SS.mmm.uuu
TS_RE = re.compile(rb"^(?:\d{4}-\d\d-\d\dT\S+ )?(\d+)\.(\d\d)\.(\d{3})\.(\d{3})(?= )")
TASK_RE = re.compile(rb"(\| task |id_task = )(\d+)")  # `task -1` stays as it is
START_RE = re.compile(rb"llama_server: initializing")
CLEANUP_RE = re.compile(rb"cleaning up before exit")
APP_RE = re.compile(
    r'^(?P<a>.*?"id":\s*")(?P<id>[^"]*)(?P<b>".*?"start":\s*")(?P<start>[^"]*)'
    r'(?P<c>".*?"end":\s*")(?P<end>[^"]*)(?P<d>".*)$',
    re.S,
)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "K": 10**3, "M": 10**6, "G": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'100MB' -> 100_000_000, '1GB' -> 10**9, '500KB', '1.5GiB', '2000' (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 500KB, 100MB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    for unit, f in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def _pct(b: bytes) -> bytes:
    return b.replace(b"%", b"%%")


def _ts_rest(us: int) -> bytes:
    """The part of M.SS.mmm.uuu after the minutes, for a time within the minute."""
    s, r = divmod(us, 1_000_000)
    ms, u = divmod(r, 1000)
    return b".%02d.%03d.%03d" % (s, ms, u)


@dataclass
class Scenario:
    name: str
    popen_wall: float
    head: list[tuple[bytes, int, int]]  # banner lines (fmt, minute, task index); first replay only
    body: list[tuple[bytes, int, int]]
    exit_line: tuple[bytes, int, int] | None  # `cleaning up before exit`, written once at the end
    task_ids: list[int]  # distinct task ids in the template, index = task index
    n_minutes: int  # minutes 0..n_minutes-1 occur in the template
    max_task: int
    dur_us: int  # last timestamp in the session (incl. its cleaning-up line)
    body_bytes: int
    app: list[tuple[str, str, str, int, str, int, str]] = field(default_factory=list)

    @property
    def n_calls(self) -> int:
        return len(self.app)


def _iso_ms(s: str) -> int:
    d = dt.datetime.fromisoformat(s)
    if d.tzinfo is None:
        d = d.replace(tzinfo=UTC)
    return (d - dt.datetime(1970, 1, 1, tzinfo=UTC)) // dt.timedelta(milliseconds=1)


def load_scenario(name: str, fixtures: Path = FIXTURES) -> Scenario:
    d = fixtures / name
    meta = json.loads((d / "meta.json").read_text())
    popens = [s["popen_wall"] for s in meta["server_starts"]]
    raw = [ln if ln.endswith(b"\n") else ln + b"\n"
           for ln in (d / "logs" / "llama-server.log").read_bytes().splitlines(keepends=True)]

    # split into processes (a new `initializing` line, or the clock going back, starts one)
    procs: list[list[tuple[int, bytes]]] = []  # (us, text after the timestamp) per line
    prev_us = -1
    for line in raw:
        m = TS_RE.match(line)
        if not m:
            raise SystemExit(f"{d}: line without a timestamp: {line[:80]!r}")
        us = (int(m[1]) * 60 + int(m[2])) * 1_000_000 + int(m[3]) * 1000 + int(m[4])
        if not procs or START_RE.search(line) or us < prev_us:
            if procs and not START_RE.search(line):
                raise SystemExit(f"{d}: clock goes back without a restart banner: {line[:80]!r}")
            procs.append([])
        procs[-1].append((us, line[m.end():]))
        prev_us = us
    if len(procs) != len(popens):
        raise SystemExit(f"{d}: {len(procs)} processes in the log, {len(popens)} in meta.json")

    head: list[tuple[int, int | None, bytes, bytes]] = []  # (us, task, before, after)
    body: list[tuple[int, int | None, bytes, bytes]] = []
    exit_line = None
    task_off = 0
    dur_us = 0
    for k, lines in enumerate(procs):
        shift_us = round((popens[k] - popens[0]) * 1e6)
        in_banner = True
        max_task = -1
        for us, rest in lines:
            us += shift_us
            dur_us = max(dur_us, us)
            if in_banner and b" slot " in rest:
                in_banner = False
            tm = TASK_RE.search(rest)
            if tm:
                task = int(tm[2])
                max_task = max(max_task, task)
                item = (us, task + task_off, rest[:tm.start(2)], rest[tm.end(2):])
            else:
                item = (us, None, rest, b"")
            if CLEANUP_RE.search(rest):
                if k == len(procs) - 1:
                    exit_line = item
                continue
            if in_banner:
                if k == 0:
                    head.append(item)
                continue  # banner of a later process: one continuous process has one banner
            body.append(item)
        task_off += max_task + 1

    task_ids = sorted({t for _, t, _, _ in head + body + ([exit_line] if exit_line else [])
                       if t is not None})
    tindex = {t: i for i, t in enumerate(task_ids)}

    def tmpl(item):
        us, task, before, after = item
        minute, within = divmod(us, MINUTE_US)
        fmt = b"%s" + _pct(_ts_rest(within) + before) + b"%s" + _pct(after)
        return fmt, minute, (tindex[task] if task is not None else -1)

    sc = Scenario(
        name=name,
        popen_wall=popens[0],
        head=[tmpl(i) for i in head],
        body=[tmpl(i) for i in body],
        exit_line=tmpl(exit_line) if exit_line else None,
        task_ids=task_ids,
        n_minutes=dur_us // MINUTE_US + 1,
        max_task=task_off - 1,
        dur_us=dur_us,
        body_bytes=0,
    )
    sc.body_bytes = len(render(sc.body, *replay_values(sc, 0, 0)))

    for ln in (d / "logs" / "app.jsonl").read_text().splitlines():
        if not ln.strip():
            continue
        m = APP_RE.match(ln)
        if not m:
            raise SystemExit(f"{d}/logs/app.jsonl: record without id/start/end: {ln[:80]!r}")
        sc.app.append((m["a"], m["id"], m["b"], _iso_ms(m["start"]), m["c"], _iso_ms(m["end"]),
                       m["d"]))
    return sc


def replay_values(sc: Scenario, minute_off: int, task_off: int) -> tuple[list[bytes], list[bytes]]:
    minutes = [b"%d" % (m + minute_off) for m in range(sc.n_minutes)]
    tasks = [b"%d" % (t + task_off) for t in sc.task_ids]
    return minutes + [b""], tasks + [b""]  # index -1 = nothing


def render(lines: list[tuple[bytes, int, int]], minutes: list[bytes], tasks: list[bytes]) -> bytes:
    return b"".join([f % (minutes[m], tasks[t]) for f, m, t in lines])


class IsoCache:
    """epoch ms -> 'YYYY-MM-DDTHH:MM:SS.mmm+00:00', caching the per-minute prefix."""

    def __init__(self) -> None:
        self._minutes: dict[int, str] = {}

    def __call__(self, ms: int) -> str:
        minute, r = divmod(ms, 60_000)
        p = self._minutes.get(minute)
        if p is None:
            if len(self._minutes) > 100_000:
                self._minutes.clear()
            p = dt.datetime.fromtimestamp(minute * 60, UTC).strftime("%Y-%m-%dT%H:%M")
            self._minutes[minute] = p
        s, ms_ = divmod(r, 1000)
        return f"{p}:{s:02d}.{ms_:03d}+00:00"


def render_app(sc: Scenario, replay: int, shift_ms: int, iso: IsoCache) -> bytes:
    pre = f"r{replay}-"
    out = [f"{a}{pre}{i}{b}{iso(s + shift_ms)}{c}{iso(e + shift_ms)}{d}\n"
           for a, i, b, s, c, e, d in sc.app]
    return "".join(out).encode()


class GzipSink:
    """gzip level 6 of the written bytes, compressed on all cores (the pigz scheme).

    Each block is deflated by a worker thread (zlib releases the GIL) with the previous 32 KiB
    as its dictionary and ends with a sync flush, so the pieces concatenate into ONE ordinary
    gzip member (header like `gzip -6 -n`, CRC-32 and size trailer); `gzip -dc` gives back the
    same bytes. Compression ratio is within a fraction of a percent of `gzip -6`.
    """

    def __init__(self, path: Path, workers: int | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._f = open(path, "wb")
        self._f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03")  # no name, mtime 0, unix
        self._workers = workers or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self._workers)
        self._pending: list = []
        self._crc = 0
        self._size = 0
        self._prev_tail = b""

    @staticmethod
    def _deflate(data: bytes, zdict: bytes, last: bool) -> bytes:
        c = zlib.compressobj(6, zlib.DEFLATED, -15, 8, zlib.Z_DEFAULT_STRATEGY,
                             **({"zdict": zdict} if zdict else {}))
        return c.compress(data) + c.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)

    def _submit(self, data: bytes, last: bool) -> None:
        self._pending.append(self._pool.submit(self._deflate, data, self._prev_tail, last))
        self._prev_tail = data[-32768:]
        while len(self._pending) > 2 * self._workers:  # bounded memory
            self._f.write(self._pending.pop(0).result())

    def write(self, b: bytes) -> None:
        if b:
            self._crc = zlib.crc32(b, self._crc)
            self._size += len(b)
            self._submit(b, last=False)

    def close(self) -> None:
        self._submit(b"", last=True)
        for fut in self._pending:
            self._f.write(fut.result())
        self._pool.shutdown()
        self._f.write(self._crc.to_bytes(4, "little") + (self._size & 0xFFFFFFFF).to_bytes(4, "little"))
        self._f.close()


def build(size: int, out: Path, seed: int = 1, scenarios=DEFAULT_SCENARIOS, gz: bool = True,
          gap_s: tuple[float, float] = (1.0, 90.0), quiet: bool = False) -> dict:
    t0 = time.perf_counter()
    scs = [load_scenario(s) for s in scenarios]
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    log_path, gz_path, app_path = out / "llama-server.log", out / "llama-server.log.gz", out / "app.jsonl"
    for p in (log_path, gz_path, app_path):
        p.unlink(missing_ok=True)
    flog = open(log_path, "wb", buffering=0)
    fapp = open(app_path, "wb")
    fgz = GzipSink(gz_path) if gz else None
    iso = IsoCache()

    buf: list[bytes] = []
    buf_n = 0
    written = 0
    lines = 0
    calls = 0
    replay = 0
    minute_off = 0
    task_off = 0
    per_scenario = {s.name: 0 for s in scs}
    w0 = None  # popen_wall of the merged process = that of the first replay's scenario
    last = None

    def flush() -> None:
        nonlocal buf, buf_n
        if buf:
            blk = b"".join(buf)
            flog.write(blk)
            if fgz:
                fgz.write(blk)
            buf, buf_n = [], 0

    while written < size:
        order = list(scs)
        rng.shuffle(order)
        for sc in order:
            if w0 is None:
                w0 = sc.popen_wall
            mins, tasks = replay_values(sc, minute_off, task_off)
            if replay == 0 and sc.head:
                b = render(sc.head, mins, tasks)
                buf.append(b); buf_n += len(b); written += len(b); lines += len(sc.head)
            b = render(sc.body, mins, tasks)
            buf.append(b); buf_n += len(b); written += len(b); lines += len(sc.body)
            shift_ms = round((w0 - sc.popen_wall) * 1000) + minute_off * 60_000
            fapp.write(render_app(sc, replay, shift_ms, iso))
            calls += sc.n_calls
            per_scenario[sc.name] += 1
            last = (sc, mins, tasks)
            end_us = minute_off * MINUTE_US + sc.dur_us
            minute_off = math.ceil((end_us + rng.uniform(*gap_s) * 1e6) / MINUTE_US)
            task_off += sc.max_task + 1
            replay += 1
            if buf_n >= BLOCK_BYTES:
                flush()
            if written >= size:
                break
    sc, mins, tasks = last
    if sc.exit_line:
        b = render([sc.exit_line], mins, tasks)
        buf.append(b); written += len(b); lines += 1
    flush()
    flog.close()
    fapp.close()
    if fgz:
        fgz.close()
    elapsed = time.perf_counter() - t0
    info = {
        "size_requested": size,
        "bytes": written,
        "lines": lines,
        "gz_bytes": gz_path.stat().st_size if gz else None,
        "app_bytes": app_path.stat().st_size,
        "calls": calls,
        "replays": replay,
        "replays_per_scenario": per_scenario,
        "last_task_id_bound": task_off,
        "popen_wall": w0,
        "popen_wall_iso": dt.datetime.fromtimestamp(w0, UTC).isoformat(),
        "process_minutes": minute_off,
        "seed": seed,
        "scenarios": list(scenarios),
        "seconds": round(elapsed, 3),
        "mb_per_s": round(written / 1e6 / elapsed, 1),
    }
    (out / ".generated.json").write_text(json.dumps(info, indent=1) + "\n")
    if not quiet:
        print(f"{log_path}: {written:,} bytes, {lines:,} lines, {replay} replays, {calls:,} calls, "
              f"{elapsed:.2f} s ({info['mb_per_s']} MB/s{' incl. gzip' if gz else ''})",
              file=sys.stderr)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("100MB"),
                    help="target size of llama-server.log (500KB, 100MB, 1GB; decimal units; "
                         "KiB/MiB/GiB binary). Whole replays: overshoots by < 1 session (~120 KB)")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=1, help="scenario order and idle gaps (default 1)")
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                    help="comma-separated fixture scenarios to replay (default: all five)")
    ap.add_argument("--no-gz", action="store_true", help="skip llama-server.log.gz")
    a = ap.parse_args(argv)
    build(a.size, a.out, a.seed, tuple(s for s in a.scenarios.split(",") if s), gz=not a.no_gz)
    return 0


if __name__ == "__main__":
    sys.exit(main())
