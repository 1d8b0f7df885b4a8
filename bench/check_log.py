#!/usr/bin/env python3
"""Check a directory written by make_log.py (streaming; fine on the 1 GB output).

    python bench/check_log.py bench/out/20MB

Checks: every line has a timestamp and they never go back; exactly one start-up banner (at the
top) and one `cleaning up before exit` (last line); `processing task` ids unique and, across
replays, increasing; the .gz decompresses to the same bytes; app.jsonl has one record per
replayed call with unique ids; each successful call's `end` lies 0-50 ms after a `stop
processing` line's wall time (popen_wall from .generated.json + log timestamp), i.e. the app
log was shifted by the same offset as the server log.
"""

from __future__ import annotations

import bisect
import datetime as dt
import gzip
import hashlib
import json
import re
import sys
from pathlib import Path

TS = re.compile(rb"^(\d+)\.(\d\d)\.(\d{3})\.(\d{3}) ")
LAUNCH = re.compile(rb"\| task (\d+) \| processing task")
STOP = re.compile(rb"stop processing")


def main(d: str) -> int:
    out = Path(d)
    gen = json.loads((out / ".generated.json").read_text())
    fails: list[str] = []
    prev = -1
    n = back = banner = cleanup = 0
    cleanup_last = False
    launches: set[int] = set()
    out_of_order = 0
    max_launch = -1
    stops: list[float] = []
    h = hashlib.sha256()
    with open(out / "llama-server.log", "rb") as f:
        for line in f:
            h.update(line)
            n += 1
            m = TS.match(line)
            if not m:
                fails.append(f"line {n}: no timestamp: {line[:60]!r}")
                continue
            us = (int(m[1]) * 60 + int(m[2])) * 1_000_000 + int(m[3]) * 1000 + int(m[4])
            if us < prev:
                back += 1
                if back <= 3:
                    fails.append(f"line {n}: time goes back {prev - us} us")
            prev = us
            if b"llama_server: initializing" in line:
                banner += 1
                if n != 1:
                    fails.append(f"line {n}: a second start-up banner")
            cleanup_last = b"cleaning up before exit" in line
            cleanup += cleanup_last
            lm = LAUNCH.search(line)
            if lm:
                t = int(lm[1])
                if t in launches:
                    fails.append(f"line {n}: task {t} launched twice")
                launches.add(t)
                if t < max_launch:
                    out_of_order += 1
                max_launch = max(max_launch, t)
            elif STOP.search(line):
                stops.append(gen["popen_wall"] + us / 1e6)
    if banner != 1 or cleanup != 1 or not cleanup_last:
        fails.append(f"banner x{banner}, cleanup x{cleanup}, cleanup is last line: {cleanup_last}")
    if n != gen["lines"]:
        fails.append(f"{n} lines, .generated.json says {gen['lines']}")

    gz = out / "llama-server.log.gz"
    if gz.exists():
        g = hashlib.sha256()
        with gzip.open(gz, "rb") as f:
            while b := f.read(1 << 20):
                g.update(b)
        gz_same = g.digest() == h.digest()
        if not gz_same:
            fails.append(".gz does not decompress to llama-server.log")
    else:
        gz_same = None

    ids: set[str] = set()
    calls = 0
    lags: list[float] = []
    with open(out / "app.jsonl", "rb") as f:
        for ln in f:
            r = json.loads(ln)
            calls += 1
            if r["id"] in ids:
                fails.append(f"app id {r['id']} twice")
            ids.add(r["id"])
            if r.get("status") == 200 and not r.get("error"):
                end = dt.datetime.fromisoformat(r["end"]).timestamp()
                i = bisect.bisect_right(stops, end)
                lags.append(end - stops[i - 1] if i else float("inf"))
    if calls != gen["calls"]:
        fails.append(f"app.jsonl has {calls} records, {gen['calls']} calls were replayed")
    lags.sort()
    bad_lag = sum(1 for x in lags if not 0 <= x <= 0.05)
    if bad_lag:
        fails.append(f"{bad_lag} calls end > 50 ms after the nearest earlier stop processing")

    print(f"{out}: {n:,} lines, time goes back {back}x, {len(launches):,} tasks "
          f"({out_of_order} launched below an earlier id), gz same bytes: {gz_same}, "
          f"{calls:,} app records ({gen['calls']:,} replayed), "
          f"app end - log stop: median {lags[len(lags) // 2] * 1e3:.1f} ms, "
          f"max {lags[-1] * 1e3:.1f} ms")
    for x in fails[:20]:
        print("FAIL", x)
    print("OK" if not fails else f"{len(fails)} problem(s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
