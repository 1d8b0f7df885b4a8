"""Capture-wrapper prefixes: journald, docker, docker compose, moreutils ``ts``, CRI, LM Studio.

A wrapper puts a wall-clock stamp (and maybe host/identifier) in front of each llama-server
line. It is detected once per stream from the first lines, then stripped per chunk with one
vectorised regex; its stamp becomes a ``wall_us`` column (µs since the epoch, UTC), which is
what anchors the server's relative clock to real time. JSON wrappers (``journalctl -o json``,
docker's json-file driver) are decoded line by line, since their payload is escaped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

# RE2 syntax (pyarrow.compute) and Python re agree on everything used here.
_ISO = r"(?P<wall>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)"
# The month as the system's locale abbreviates it (``Nov``, ``janv.``, ``Okt``, ``9月``): any
# short run of non-digits, or digits before 月/월 (read by _MONTHS).
_SYSLOG = r"(?P<wall>(?:[^\s\d]{2,12}|\d{1,2}(?:月|월)) {1,2}\d{1,2} \d\d:\d\d:\d\d(?:\.\d+)?)"
_UNIX = r"(?P<wall>\d{9,11}\.\d+)"
# Host, then identifier and PID; pasted logs often have the host or the PID redacted, emptied
# or replaced (``Sep 11 00:04:26   ollama[]:``, ``<host> ollama[XXXX]:``).
_HOST_IDENT = r" +(?:\S+ +)?[^\s\[:]+(?:\[[^\]\s]*\])?: ?"
_COMPOSE = r"[\w.-]+ *\| "
# LM Studio's developer log: a header line ``2026-06-05 10:33:08 [DEBUG]`` (local time, whole
# seconds) before each llama.cpp line, which is indented by one space; its log files put the
# same stamp in brackets in front of the line (``[2026-05-25 01:28:08][DEBUG] 1.58.806.837 I slot …``).
_LMS_STAMP = r"(?P<wall>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)"
_LMS_LEVEL = r"\[[A-Z]+\]"


@dataclass(frozen=True)
class Wrapper:
    """One capture wrapper: a regex whose match is the prefix, and how to read its stamp."""

    name: str
    pattern: str  # anchored at ^, group "wall" is the stamp (absent for compose)
    stamp: str  # "iso" | "syslog" | "unix" | "none" | "json" | "header" (a line of its own stamps the lines after it)


WRAPPERS: tuple[Wrapper, ...] = (
    Wrapper("journald-iso", "^" + _ISO + _HOST_IDENT, "iso"),
    Wrapper("journald", "^" + _SYSLOG + _HOST_IDENT, "syslog"),
    Wrapper("journald-unix", "^" + _UNIX + _HOST_IDENT, "unix"),
    Wrapper("cri", "^" + _ISO + r" (?:stdout|stderr) [PF] ", "iso"),
    Wrapper("compose-timestamps", "^" + _COMPOSE + _ISO + " ", "iso"),
    Wrapper("timestamps", "^" + _ISO + " ", "iso"),  # docker logs -t, moreutils ts, kubectl
    Wrapper("compose", "^" + _COMPOSE, "none"),
    Wrapper("lmstudio-file", r"^\[" + _LMS_STAMP + r"\]" + _LMS_LEVEL + " ", "iso"),
)
# Its header line (the rest is empty, or LM Studio's own message), or the one space before a
# line it stamps.
LMSTUDIO = Wrapper("lmstudio", "^(?:" + _LMS_STAMP + " " + _LMS_LEVEL + " ?| )", "header")
UNKNOWN_WALL = -2  # a line's header stamp is in an earlier block, not yet known (see strip)
JOURNALD_JSON = Wrapper("journald-json", "", "json")
DOCKER_JSON = Wrapper("docker-json", "", "json")

_COMPILED = [(w, re.compile(w.pattern.encode())) for w in WRAPPERS]
# What a bare llama-server line starts with (so a bare log is never taken for a wrapped one).
_BARE = re.compile(rb"^(?:\[ *\d+\] )?(?:\d+\.\d\d\.\d{3}\.\d{3} )?(?:[IWED] )?(?:slot|srv |cmn |que |res |spec) ")
_LMS_HEADER = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[A-Z]+\]\s*$")
_INDENTED = re.compile(rb"^ \S")


def detect(sample_lines: Sequence[bytes]) -> Wrapper | None:
    """Pick the wrapper that frames most of the sample lines, or None for bare llama-server lines."""
    lines = [ln for ln in sample_lines if ln.strip()][:400]
    if not lines:
        return None
    first = lines[0].lstrip()
    if first.startswith(b"{"):
        try:
            obj = json.loads(first)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            if "MESSAGE" in obj or "__REALTIME_TIMESTAMP" in obj:
                return JOURNALD_JSON
            if "log" in obj and "time" in obj:
                return DOCKER_JSON
    framed: list[tuple[int, Wrapper | None]] = [(sum(1 for ln in lines if _BARE.match(ln)), None)]
    framed += [(sum(1 for ln in lines if rx.match(ln)), w) for w, rx in _COMPILED]
    headers = sum(1 for ln in lines if _LMS_HEADER.match(ln))
    if headers:  # (a line that starts with a space alone is no sign of LM Studio)
        framed.append((headers + sum(1 for ln in lines if _INDENTED.match(ln)), LMSTUDIO))
    n, best = max(framed, key=lambda nw: nw[0])  # (on a tie, the first: bare lines before any wrapper)
    return best if n * 2 >= len(lines) else None


def decode_json_lines(lines: list[bytes], wrapper: Wrapper) -> tuple[list[bytes], list[float | None]]:
    """Unwrap journald/docker JSON records: the llama-server line and its epoch seconds.

    A line that is not such a record is passed through unchanged (it is accounted later).
    """
    out: list[bytes] = []
    walls: list[float | None] = []
    for raw in lines:
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        msg: object = None
        wall: float | None = None
        if isinstance(obj, dict) and wrapper == JOURNALD_JSON:  # equal, not identical: workers get a copy
            msg = obj.get("MESSAGE")
            if isinstance(msg, list):  # journald stores non-printable payloads as byte arrays
                msg = bytes(b & 0xFF for b in msg if isinstance(b, int)).decode("utf-8", "replace")
            ts = obj.get("__REALTIME_TIMESTAMP")
            wall = int(ts) / 1e6 if isinstance(ts, str) and ts.isdigit() else None
        elif isinstance(obj, dict):
            msg = obj.get("log")
            t = obj.get("time")
            try:
                wall = pd.Timestamp(t).timestamp() if isinstance(t, str) else None
            except (ValueError, OverflowError):  # a damaged stamp: the line stays, without a wall time
                wall = None
        if isinstance(msg, str):
            out.append(msg.rstrip("\n").encode("utf-8", "replace"))
            walls.append(wall)
        else:
            out.append(raw)
            walls.append(None)
    return out, walls


def strip(
    lines: pa.StringArray, wrapper: Wrapper, year: int, tz: str, before: int = -1
) -> tuple[pa.StringArray, np.ndarray]:
    """Strip a (non-JSON) wrapper prefix; return the bare lines and wall-clock µs (-1 = none).

    With header lines (LM Studio), each line takes the stamp of the last header at or before
    it, and the lines before the block's first header take ``before`` (the stamp in force at
    the end of the previous block, or :data:`UNKNOWN_WALL` where that is not known here).
    """
    parts = pc.extract_regex(lines, wrapper.pattern + r"(?P<rest>.*)$")
    matched = parts.is_valid()
    rest = pc.if_else(matched, parts.field("rest"), lines)
    wall = np.full(len(lines), -1, dtype=np.int64)
    if wrapper.stamp == "none":
        return rest, wall
    if wrapper.stamp == "header":
        return rest, _header_walls(pc.if_else(matched, parts.field("wall"), ""), year, tz, before)
    stamps = parts.field("wall").to_pandas()
    ok = matched.to_numpy(zero_copy_only=False)
    if not ok.any():
        return rest, wall
    wall[ok] = stamps_to_us(stamps[ok], wrapper.stamp, year, tz)
    return rest, wall


def _header_walls(stamps: pa.Array, year: int, tz: str, before: int) -> np.ndarray:
    """Each line's stamp from the header line at or before it (``stamps``: a header's stamp,
    else empty; ``before``: for the lines before the first header)."""
    n = len(stamps)
    at = np.flatnonzero(pc.not_equal(stamps, "").fill_null(False).to_numpy(zero_copy_only=False))
    if not len(at):
        return np.full(n, before, dtype=np.int64)
    own = stamps_to_us(stamps.take(pa.array(at)).to_pandas(), "iso", year, tz)
    last = np.full(n, -1, dtype=np.int64)
    last[at] = np.arange(len(at))
    np.maximum.accumulate(last, out=last)
    return np.where(last >= 0, own[np.maximum(last, 0)], before).astype(np.int64)


def stamps_to_us(stamps: pd.Series, kind: str, year: int, tz: str) -> np.ndarray:
    """Convert wrapper stamps to epoch µs (UTC). Zone-less stamps are read in ``tz``."""
    if kind == "unix":
        return (stamps.astype("float64") * 1e6).round().astype("int64").to_numpy().copy()
    if kind == "syslog":  # "Nov 29 07:31:43[.123456]" has no year and no zone
        parts = stamps.str.extract(r"^(\S+) +(\d+) (\S+)$")
        month = parts[0].str.lower().str.rstrip(".").map(_month_number).astype("Int64")
        text = f"{year} " + month.astype("string") + " " + parts[1] + " " + parts[2]
        ts = pd.to_datetime(text, format="%Y %m %d %H:%M:%S.%f", errors="coerce")
        missing = ts.isna()
        if missing.any():
            ts[missing] = pd.to_datetime(text[missing], format="%Y %m %d %H:%M:%S", errors="coerce")
        ts = ts.dt.tz_localize(tz, ambiguous="NaT", nonexistent="NaT")
    else:
        s = stamps.str.replace(",", ".", regex=False)
        zoned = s.str.contains(r"(?:Z|[+-]\d\d:?\d\d)$", regex=True).fillna(False).to_numpy(dtype=bool)
        if zoned.all():
            ts = pd.to_datetime(s, format="ISO8601", errors="coerce", utc=True)
        elif not zoned.any():
            ts = pd.to_datetime(s, format="ISO8601", errors="coerce").dt.tz_localize(tz, ambiguous="NaT", nonexistent="NaT")
        else:  # both kinds in one block (a damaged or spliced log): each read on its own
            us = np.full(len(s), -1, dtype=np.int64)
            us[zoned] = _epoch_us(pd.to_datetime(s[zoned], format="ISO8601", errors="coerce", utc=True))
            naive = pd.to_datetime(s[~zoned], format="ISO8601", errors="coerce")
            us[~zoned] = _epoch_us(naive.dt.tz_localize(tz, ambiguous="NaT", nonexistent="NaT"))
            return us
    return _epoch_us(ts)


def _epoch_us(ts: pd.Series) -> np.ndarray:
    """Zoned times as epoch µs, NaT as -1, whatever unit pandas chose for them."""
    us = ts.dt.tz_convert("UTC").astype("datetime64[us, UTC]").astype("int64").to_numpy().copy()
    us[ts.isna().to_numpy()] = -1
    return us


# Months as glibc's locales abbreviate them (%b), lower case, without a final dot: English,
# French, German, Spanish, Italian, Portuguese, Dutch, Polish, Russian; CJK ones are numbers.
_MONTHS = {name: i + 1 for names in (
    "jan feb mar apr may jun jul aug sep oct nov dec",
    "janv févr mars avr mai juin juil août sept oct nov déc",
    "jan feb mär apr mai jun jul aug sep okt nov dez",
    "ene feb mar abr may jun jul ago sept oct nov dic",
    "gen feb mar apr mag giu lug ago set ott nov dic",
    "jan fev mar abr mai jun jul ago set out nov dez",
    "jan feb mrt apr mei jun jul aug sep okt nov dec",
    "sty lut mar kwi maj cze lip sie wrz paź lis gru",
    "янв фев мар апр мая июн июл авг сен окт ноя дек",
) for i, name in enumerate(names.split())}


def _month_number(token: object) -> float:
    """A month abbreviation's number (NaN if unknown): a name of :data:`_MONTHS`, a longer
    form of one (``sept``, ``févr``: its first four or three letters), or ``9月``."""
    if not isinstance(token, str):
        return np.nan
    if token[-1:] in ("月", "월") and token[:-1].isdigit():
        return float(token[:-1]) if 1 <= int(token[:-1]) <= 12 else np.nan
    for name in (token, token[:4], token[:3]):
        if name in _MONTHS:
            return float(_MONTHS[name])
    return np.nan
