"""llama-server log lines -> events, per chunk, with every line accounted for.

The hot path works on blocks of ~4 MiB, with no Python code per line: colour codes and
carriage returns are removed with one bytes-level substitution, the lines become one Arrow
array over the block's own bytes (offsets from the newline positions), a wrapper prefix (if
any) is stripped with one vectorised regex, and a numpy scanner reads the lines of the
current llama.cpp grammar column-wise (``_scan``). The scanner only takes lines whose reading
by the single RE2 pattern ``FAST_PATTERN`` it can prove, and gives the same reading; the rest
(older multi-line timings, damaged lines) go through ``FAST_PATTERN`` itself, and lines it does
not know either go to :mod:`slotscope.legacy` one by one (older formats, which are rare).
Measured on the bench's 1 GB log: 70-100 MB/s for the whole parse on one core (the shared
machine varies), where ``FAST_PATTERN`` on every line ran at ~6 MB/s.

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
from .sources import CHUNK_SIZE, STDIN, Inputs, LogFile, collect, iter_chunks, reopen
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
_SRV_EVENT = (
    r"(?P<k_init>initializing \.\.\.)"
    r"|initializing, n_slots = (?P<n_slots>\d+), n_ctx_slot = (?P<n_ctx>\d+)"
    r"|.*cancel task, id_task = (?P<cancel>\d+)"
    r"|(?P<k_exit>.*cleaning up before exit)"
    r"|.*task id = (?P<err_task>\d+), error: (?P<err>.*)"
)
_SRV = r"srv  .{12}: (?:" + _SRV_EVENT + r"|(?P<k_srv_other>.*))"
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
_ANSI_ANY = re.compile(rb"\[[0-9;]*m")  # same hits as _ANSI, found faster (literal first)
_USE_SCANNER = True  # tests turn it off to compare with FAST_PATTERN alone


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
    n = len(nl) + (0 if last_ends else 1)
    off = np.empty(n + 1, np.int32)
    off[0] = 0
    off[1 : len(nl) + 1] = nl + 1
    if len(nl) < n:  # the last line has no newline (end of input)
        off[n] = len(block)
    return pa.StringArray.from_buffers(n, pa.py_buffer(off), pa.py_buffer(block))


def _without_newline(lines: pa.Array) -> pa.Array:
    return pc.utf8_rtrim(lines, characters="\n")


# --------------------------------------------------------------------------- the line scanner
#
# Most lines of a llama-server log follow one grammar (timestamp, level, ``slot <func>: id N |
# task N | <message>``). They are read here column-wise with numpy: 8-byte words are gathered
# at each line's current position and tested a word at a time (SWAR: digits and blanks found
# with bit tricks, numbers of up to 8 digits converted with two multiplications). A step that
# fails leaves the line "not known", and such lines go through the full RE2 pattern below
# (FAST_PATTERN), which stays the definition of what each line means: the scanner only takes
# lines whose FAST_PATTERN reading it can prove, and reproduces that reading exactly.

_U = np.uint64
_HI = _U(0x8080808080808080)
_LO7 = _U(0x7F7F7F7F7F7F7F7F)
_ASCII0 = _U(0x3030303030303030)
_BLANKS = _U(0x2020202020202020)
_OVER9 = _U(0x7676767676767676)
_BYTE_INDEX = _U(0x0001020304050607)
_PAIR_MASK = _U(0x000000FF000000FF)
_PAIR_MUL1 = _U(100 + (1000000 << 32))
_PAIR_MUL2 = _U(1 + (10000 << 32))
_POW10 = 10 ** np.arange(17, dtype=np.int64)
_POW10F = 10.0 ** np.arange(17)


def _word(text: bytes) -> tuple[np.uint64, np.uint64]:
    """(value, mask) of up to 8 bytes as a little-endian word."""
    pad = text.ljust(8, b"\0")
    return np.frombuffer(pad, "<u8")[0], np.frombuffer(b"\xff" * len(text) + b"\0" * (8 - len(text)), "<u8")[0]


class _Words:
    """A block's bytes, zero-padded, read as 8-byte little-endian words at any positions."""

    def __init__(self, data: np.ndarray) -> None:
        size = len(data) + 32
        buf = np.zeros(size, np.uint8)
        buf[: len(data)] = data
        # One overlapping (stride-1, unaligned) view: word i is bytes i..i+7. Indexing it is
        # ~5x cheaper than two aligned gathers and a funnel shift.
        self._w = np.ndarray((size - 8,), dtype="<u8", buffer=buf, strides=(1,))
        self._last = size - 9

    def at(self, pos: np.ndarray) -> np.ndarray:
        return self._w[np.minimum(pos, self._last)]  # only lines that already failed read past the end


def _lead(stop: np.ndarray) -> np.ndarray:
    """Index (0..8) of the first byte with its high bit set in ``stop`` (8: none)."""
    low = stop & (~stop + _U(1))
    k = (((low >> _U(7)) * _BYTE_INDEX) >> _U(56)).astype(np.int64)
    return k + (stop == 0) * 8


def _digits(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The word with digits as 0..9, and how many bytes (0..8) from its start are digits."""
    x = w ^ _ASCII0
    return x, _lead((((x & _LO7) + _OVER9) | x) & _HI)


def _blanks(w: np.ndarray) -> np.ndarray:
    """How many bytes (0..8) from the start of each word are spaces."""
    x = w ^ _BLANKS
    return _lead((((x & _LO7) + _LO7) | x) & _HI)


def _blank_run(words: _Words, pos: np.ndarray) -> np.ndarray:
    """How many spaces (0..16; 16: too many to count) start at each position."""
    n = _blanks(words.at(pos))
    more = np.flatnonzero(n == 8)
    if len(more):
        n[more] += _blanks(words.at(pos[more] + 8))
    return n


def _value(x: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The number written by the first ``n`` (1..8) digits of ``x`` (digits as 0..9)."""
    v = x << (np.minimum(8 - n, 7) * 8).astype(_U)
    v = v * _U(10) + (v >> _U(8))
    v = (((v & _PAIR_MASK) * _PAIR_MUL1) + (((v >> _U(16)) & _PAIR_MASK) * _PAIR_MUL2)) >> _U(32)
    return np.where(n > 0, v.astype(np.int64), 0)


class _Cursor:
    """One position per line, moved along a grammar; ``ok`` turns False where a step fails."""

    _lits: dict[bytes, list[tuple[int, np.uint64, np.uint64]]] = {}

    def __init__(self, words: _Words, pos: np.ndarray) -> None:
        self.w = words
        self.pos = pos
        self.ok = np.ones(len(pos), bool)

    def has(self, text: bytes, at: np.ndarray | None = None) -> np.ndarray:
        """Whether ``text`` is at the position (does not move)."""
        pieces = self._lits.get(text)
        if pieces is None:
            pieces = self._lits[text] = [(k, *_word(text[k : k + 8])) for k in range(0, len(text), 8)]
        pos = self.pos if at is None else at
        out: np.ndarray | None = None
        for k, val, mask in pieces:
            hit = (self.w.at(pos + k) & mask) == val
            out = hit if out is None else out & hit
        assert out is not None
        return out

    def lit(self, text: bytes) -> None:
        self.ok &= self.has(text)
        self.pos = self.pos + len(text)

    def either(self, a: bytes, b: bytes) -> None:
        in_a = self.has(a)
        not_a = np.flatnonzero(~in_a)
        if len(not_a):  # b is read only where a is not there (usually nowhere)
            in_b = np.zeros(len(in_a), bool)
            in_b[not_a] = self.has(b, at=self.pos[not_a])
            self.ok &= in_a | in_b
        self.pos = self.pos + np.where(in_a, len(a), len(b))

    def field(self, blanks: int | None = None, sign: bool = False, frac: bool = False) -> np.ndarray:
        """`` *`` (``blanks``: at least that many; None: no blanks), ``-?`` (``sign``), ``\\d+``
        and, with ``frac``, ``(?:\\.\\d*)?``, as float64 like :meth:`uint`/:meth:`decimal`.

        Read from the one word at the position where the field ends inside it (a byte after
        it is seen there); the other rows are read step by step.
        """
        w = self.w.at(self.pos)
        k = _blanks(w) if blanks is not None else np.zeros(len(w), np.int64)
        x = (w >> (k * 8).astype(_U)) ^ _ASCII0  # bytes shifted in read as non-digits
        room = 8 - k
        neg = np.zeros(len(w), bool)
        if sign:
            neg = (x & _U(0xFF)) == _U(0x1D)  # "-"
            x = np.where(neg, x >> _U(8), x)
            room = room - neg
        n1 = _lead((((x & _LO7) + _OVER9) | x) & _HI)
        used = n1
        value = _value(x, n1).astype(np.float64)
        if frac:
            dot = ((x >> (n1 * 8).astype(_U)) & _U(0xFF)) == _U(0x1E)  # "."
            x2 = x >> ((n1 + 1) * 8).astype(_U)
            n2 = np.where(dot, _lead((((x2 & _LO7) + _OVER9) | x2) & _HI), 0)
            used = n1 + dot + n2
            value = (_value(x, n1) * _POW10[n2] + _value(x2, n2)) / _POW10F[n2]
        if sign:
            value = np.where(neg, -1.0, 1.0) * value
        ok = n1 >= 1
        if blanks:
            ok &= k >= blanks
        pos = self.pos + k + neg + used
        unsure = used >= room  # the field may go on past this word
        if not frac:  # digits up to the word's end: the next word holds the rest (task ids)
            more = np.flatnonzero(unsure & (n1 >= 1) & (k < 8))
            if len(more):
                x2, n2 = _digits(self.w.at(pos[more]))
                value[more] = value[more] * _POW10[n2] + np.where(neg[more], -1.0, 1.0) * _value(x2, n2)
                pos[more] += n2
                unsure[more] = n2 == 8
        unsure = np.flatnonzero(unsure)
        if len(unsure):
            sub = _Cursor(self.w, self.pos[unsure])
            if blanks is not None:
                sub.blanks(blanks)
            v = sub.signed() if sign else sub.decimal() if frac else sub.uint()
            value[unsure], ok[unsure], pos[unsure] = v, sub.ok, sub.pos
        self.ok &= ok
        self.pos = pos
        return value

    def blanks(self, least: int = 0) -> None:
        n = _blank_run(self.w, self.pos)
        self.ok &= (n >= least) & (n < 16)
        self.pos = self.pos + n

    def number_at(self, pos: np.ndarray, word: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The digits at each position (``word``: the word there, if read already):
        (value, how many; 16 = too many to read)."""
        x, n = _digits(self.w.at(pos) if word is None else word)
        v = _value(x, n)
        long = np.flatnonzero(n == 8)
        if len(long):  # 9 to 16 digits: a second word
            x2, n2 = _digits(self.w.at(pos[long] + 8))
            v[long] = v[long] * _POW10[n2] + _value(x2, n2)
            n[long] += n2
        return v, n

    def uint(self) -> np.ndarray:
        """``\\d+`` as float64 (at most 15 digits, so exact)."""
        v, n = self.number_at(self.pos)
        self.ok &= (n >= 1) & (n <= 15)
        self.pos = self.pos + n
        return v.astype(np.float64)

    def signed(self) -> np.ndarray:
        """``-?\\d+`` as float64."""
        neg = (self.w.at(self.pos) & _U(0xFF)) == _U(0x2D)
        self.pos = self.pos + neg
        return np.where(neg, -1.0, 1.0) * self.uint()

    def decimal(self) -> np.ndarray:
        """``\\d+(?:\\.\\d*)?`` as the float64 nearest to it, like Arrow's string->double cast.

        Integer digits and fraction digits together fit in 15 digits, so both the integer
        they spell and the power of ten are exact, and one IEEE division rounds correctly.
        """
        whole, n1 = self.number_at(self.pos)
        self.pos = self.pos + n1
        dot = (self.w.at(self.pos) & _U(0xFF)) == _U(0x2E)
        self.pos = self.pos + dot
        frac, n2 = self.number_at(self.pos)
        n2 = np.where(dot, n2, 0)
        self.pos = self.pos + n2
        self.ok &= (n1 >= 1) & (n1 + n2 <= 15)
        return (whole * _POW10[n2] + np.where(dot, frac, 0)) / _POW10F[n2]


@dataclass
class _Scan:
    """What the scanner made of each line of a block (``known`` False: ask FAST_PATTERN)."""

    known: np.ndarray
    kind: np.ndarray
    port: np.ndarray
    ts: np.ndarray
    slot: np.ndarray
    task: np.ndarray
    v: list[np.ndarray]


_TAG_SLOT, _TAG_SRV = _word(b"slot ")[0], _word(b"srv  ")[0]
_TAG_COMP = [_word(t)[0] for t in (b"cmn  ", b"que  ", b"res  ", b"spec ")]
_MASK2, _MASK4, _MASK5 = _word(b"..")[1], _word(b"....")[1], _word(b".....")[1]
_ID = _word(b": id")[0]
# The 12 bytes after the minutes, ".SS.mmm.uuu ", as two words XOR "0" bytes: "." is 0x1E, " " 0x10.
_TS_DOTS, _TS_DOTS_MASK = _U(0x1E00000000000000 | 0x1E000000 | 0x1E), _U(0xFF000000FF0000FF)
_TS_END, _TS_END_MASK = _U(0x10000000), _U(0xFF000000)
_TS_DIGITS1 = _U(0x0080808000808000)  # high bits of bytes 1, 2, 4, 5, 6
_TS_DIGITS2 = _U(0x0000000000808080)  # bytes 0, 1, 2
_COLON = _word(b": ")[0]
_LEVELS = [_U(ord(c)) for c in "IWED"]
# A slot message that starts (after its blanks) with one of these may be a record or a
# broken one (FAST_PATTERN's k_bad): never taken as an ignored line by the scanner.
_KEYWORDISH = [_word(t)[0] for t in (b"promp", b"eval ", b"total", b"n_gen", b"n_dec", b"stop ", b"proce")]
_KW_PROMPT, _KW_EVAL, _KW_TOTAL, _KW_GEN, _KW_DECODED, _KW_RELEASE, _KW_LAUNCH = _KEYWORDISH
_KW_PROGRESS, _KW_PROMPT_EVAL = _word(b"prompt p")[0], _word(b"prompt e")[0]
_SRV_EVENTS = r"initializing|cancel task, id_task = |cleaning up before exit|task id = "
# The same alternatives for Python's re (ASCII: \d is [0-9] as in RE2; no \s in them), for the
# few server lines that may be events: cheaper than compiling FAST_PATTERN for each block.
_SRV_EVENT_RE = re.compile(_SRV_EVENT, re.ASCII)


def _scan(lines: pa.StringArray) -> _Scan:
    """Read each line of a block (elements ending in a newline) with the scanner's grammar."""
    n = len(lines)
    off = np.frombuffer(lines.buffers()[1], np.int32, count=n + 1, offset=4 * lines.offset).astype(np.int64)
    data = lines.buffers()[2]
    raw = np.frombuffer(data, np.uint8, count=int(off[-1])) if data is not None else np.zeros(0, np.uint8)
    words = _Words(raw)
    s, e = off[:-1], off[1:]
    ends_nl = np.zeros(n, bool)
    has = e > s
    ends_nl[has] = raw[e[has] - 1] == 10
    e = e - ends_nl
    out = _Scan(
        known=np.zeros(n, bool), kind=np.zeros(n, np.int8), port=np.full(n, -1, np.int64),
        ts=np.full(n, -1, np.int64), slot=np.full(n, np.nan), task=np.full(n, np.nan),
        v=[np.full(n, np.nan) for _ in range(4)],
    )
    if n == 0:
        return out
    c = _Cursor(words, s.copy())
    w0 = words.at(c.pos)

    # [port] (router mode)
    bracket = np.flatnonzero((w0 & _U(0xFF)) == _U(0x5B))
    if len(bracket):
        b = _Cursor(words, c.pos[bracket] + 1)
        b.blanks()
        p = b.uint()
        b.lit(b"] ")
        out.port[bracket] = np.where(b.ok, p, -1).astype(np.int64)
        c.pos[bracket] = b.pos
        c.ok[bracket] &= b.ok

    # M.SS.mmm.uuu timestamp (optional): minutes of any width, then 12 fixed bytes
    minutes, nd = c.number_at(c.pos, w0 if not len(bracket) else None)
    stamped = np.flatnonzero(c.ok & (nd >= 1))
    if len(stamped):
        q = c.pos[stamped] + nd[stamped]
        x1 = words.at(q) ^ _ASCII0  # ".SS.mmm."
        x2 = words.at(q + 8) ^ _ASCII0  # "uuu "
        good = (nd[stamped] <= 10) & ((x1 & _TS_DOTS_MASK) == _TS_DOTS) & ((x2 & _TS_END_MASK) == _TS_END)
        good &= ((((x1 & _LO7) + _OVER9) | x1) & _TS_DIGITS1) == 0
        good &= ((((x2 & _LO7) + _OVER9) | x2) & _TS_DIGITS2) == 0

        def d(x: np.ndarray, k: int) -> np.ndarray:
            return ((x >> _U(8 * k)) & _U(0xFF)).astype(np.int64)

        sec = d(x1, 1) * 10 + d(x1, 2)
        ms = d(x1, 4) * 100 + d(x1, 5) * 10 + d(x1, 6)
        us = d(x2, 0) * 100 + d(x2, 1) * 10 + d(x2, 2)
        # The same float64 arithmetic as FAST_PATTERN's reading (it rounds past 2**53 µs).
        ts = ((minutes[stamped].astype(np.float64) * 60 + sec) * 1000 + ms) * 1000 + us
        out.ts[stamped] = np.where(good, ts, -1).astype(np.int64)
        c.pos[stamped] = q + 12
        c.ok[stamped] &= good  # digits that are no timestamp: not for the scanner

    # level letter (optional), then the tag and its 12-character function field
    w = words.at(c.pos)
    b0 = w & _U(0xFF)
    level = ((b0 == _LEVELS[0]) | (b0 == _LEVELS[1]) | (b0 == _LEVELS[2]) | (b0 == _LEVELS[3])) & (
        ((w >> _U(8)) & _U(0xFF)) == _U(0x20))
    c.pos = c.pos + 2 * level
    w = np.where(level, w >> _U(16), w)
    tag = w & _MASK5
    f1 = words.at(c.pos + 5)
    f2 = words.at(c.pos + 13)
    field = c.ok & ((f1 & _HI) == 0) & ((f2 & _U(0x80808080)) == 0) & (c.pos + 17 <= e)
    after = f2 >> _U(32)
    is_slot = field & (tag == _TAG_SLOT) & (after == _ID)
    colon = field & ((after & _MASK2) == _COLON)
    comp = colon & ((tag == _TAG_COMP[0]) | (tag == _TAG_COMP[1]) | (tag == _TAG_COMP[2]) | (tag == _TAG_COMP[3]))
    out.known[comp] = True
    srv = np.flatnonzero(colon & (tag == _TAG_SRV))
    if len(srv):  # ignored, unless it may be one of the server events (those few: FAST_PATTERN)
        maybe = pc.match_substring_regex(lines.take(pa.array(srv)), _SRV_EVENTS).to_numpy(zero_copy_only=False)
        out.known[srv[~maybe]] = True
        events = srv[maybe]
        if len(events):
            _srv_events(out, events, c.pos[events] + 19 - s[events], lines.take(pa.array(events)).to_pylist())

    rows = np.flatnonzero(is_slot)
    if not len(rows):
        return out
    h = _Cursor(words, c.pos[rows] + 21)
    slot = h.field(blanks=1, sign=True)
    h.lit(b" | task ")
    task = h.field(sign=True)
    h.lit(b" |")
    rows, m, slot, task = rows[h.ok], h.pos[h.ok], slot[h.ok], task[h.ok]
    out.slot[rows] = slot
    out.task[rows] = task
    end = e[rows]

    k = _blank_run(words, m)
    header = (end == m) | ((end == m + 1) & (k == 1))
    kw = words.at(m + k)
    kw5 = kw & _MASK5
    keywordish = np.zeros(len(rows), bool)
    for word in _KEYWORDISH:
        keywordish |= kw5 == word
    other = (k >= 1) & (k < 16) & ~header & ~keywordish
    out.kind[rows[header]] = TIMING_HEADER
    out.known[rows[header | other]] = True

    one = (k == 1) & ~header
    some = (k >= 1) & (k < 16) & ~header
    for code, sel, parse in (
        (LAUNCH, one & (kw5 == _KW_LAUNCH), _launch),
        (PROGRESS, one & (kw == _KW_PROGRESS), _progress),
        (HEARTBEAT, one & ((kw5 == _KW_GEN) | (kw5 == _KW_DECODED)), _heartbeat),
        (PROMPT_EVAL, one & (kw == _KW_PROMPT_EVAL), _prompt_eval),
        (EVAL, some & (kw5 == _KW_EVAL), _eval),
        (TOTAL, some & (kw5 == _KW_TOTAL), _total),
        (RELEASE, one & (kw5 == _KW_RELEASE), _release),
    ):
        i = np.flatnonzero(sel)
        if not len(i):
            continue
        cur = _Cursor(words, m[i] + k[i])
        vals = parse(cur)
        good = rows[i[cur.ok]]
        out.known[good] = True
        out.kind[good] = code
        for j, val in enumerate(vals):
            out.v[j][good] = val[cur.ok]
    return out


def _srv_events(out: _Scan, rows: np.ndarray, rest_at: np.ndarray, texts: list[str]) -> None:
    """Server lines that may be events, read like FAST_PATTERN's _SRV (the head is ASCII, so
    byte and character offsets agree). Numbers too long for a float64 to hold: left to it."""
    for i, at, text in zip(rows, rest_at, texts):
        m = _SRV_EVENT_RE.match(text.rstrip("\n"), int(at))
        if m is None:
            out.known[i] = True  # k_srv_other: a known line, ignored
            continue
        g = m.groupdict()
        if any(len(g[k] or "") > 15 for k in ("n_slots", "n_ctx", "cancel", "err_task")):
            continue
        out.known[i] = True
        if g["k_init"] is not None:
            out.kind[i] = INIT
        elif g["n_slots"] is not None:
            out.kind[i] = CONFIG
            out.v[0][i], out.v[1][i] = float(g["n_slots"]), float(g["n_ctx"])
        elif g["cancel"] is not None:
            out.kind[i] = CANCEL
            out.task[i] = float(g["cancel"])
        elif g["k_exit"] is not None:
            out.kind[i] = EXIT
        else:
            out.kind[i] = ERROR
            out.task[i] = float(g["err_task"])


def _launch(c: _Cursor) -> list[np.ndarray]:
    c.lit(b"processing task")
    tail = c.has(b", is_child = ")
    child, nd = c.number_at(c.pos + 13)  # the optional group takes the digits if there are any
    c.ok &= ~tail | (nd <= 15)
    return [np.where(tail & (nd >= 1), child.astype(np.float64), np.nan)]


def _progress(c: _Cursor) -> list[np.ndarray]:
    c.lit(b"prompt processing, n_tokens =")
    n = c.field(blanks=0)
    c.lit(b", progress =")
    prog = c.field(blanks=0, frac=True)
    c.lit(b", t =")
    t = c.field(blanks=0, frac=True)
    c.lit(b" s /")
    tps = c.field(blanks=0, frac=True)
    c.lit(b" tokens per second")
    return [n, prog, t, tps]


def _heartbeat(c: _Cursor) -> list[np.ndarray]:
    c.either(b"n_gen =", b"n_decoded =")
    n = c.field(blanks=0)
    c.lit(b", tg =")
    tg = c.field(blanks=0, frac=True)
    c.lit(b" t/s")
    tail = c.has(b", tg_3s =")
    t = _Cursor(c.w, c.pos + 9)
    tg3 = t.field(blanks=0, frac=True)
    t.lit(b" t/s")
    c.ok &= ~tail | t.ok  # a tail FAST_PATTERN might read otherwise (inf, nan, signs): not ours
    return [n, tg, np.where(tail, tg3, np.nan)]


def _prompt_eval(c: _Cursor) -> list[np.ndarray]:
    c.lit(b"prompt eval time =")
    ms = c.field(blanks=0, frac=True)
    c.lit(b" ms /")
    n = c.field(blanks=0)
    c.lit(b" tokens")
    return [ms, n]


def _eval(c: _Cursor) -> list[np.ndarray]:
    c.lit(b"eval time =")
    ms = c.field(blanks=0, frac=True)
    c.lit(b" ms /")
    n = c.field(blanks=0)
    c.either(b" tokens", b" runs")
    return [ms, n]


def _total(c: _Cursor) -> list[np.ndarray]:
    c.lit(b"total time =")
    ms = c.field(blanks=0, frac=True)
    c.lit(b" ms")
    tail = c.has(b" /")
    t = _Cursor(c.w, c.pos + 2)
    n = t.field(blanks=0)
    t.lit(b" tokens")
    c.ok &= ~tail | t.ok
    return [ms, np.where(tail, n, np.nan)]


def _release(c: _Cursor) -> list[np.ndarray]:
    c.either(b"stop processing: n_tokens =", b"stop processing: n_past =")
    n = c.field(blanks=0)
    c.lit(b", truncated =")
    tr = c.field(blanks=0)
    return [n, tr]


# --------------------------------------------------------------------------- FAST_PATTERN

def _nonempty(col: pa.Array) -> np.ndarray:
    return pc.not_equal(col, "").fill_null(False).to_numpy(zero_copy_only=False)


def _num(col: pa.Array, typ: pa.DataType = pa.float64()) -> np.ndarray:
    vals = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
    return pc.cast(vals, typ).to_numpy(zero_copy_only=False)


@dataclass
class _Exact:
    """FAST_PATTERN's reading of some lines (the definition the scanner reproduces)."""

    valid: np.ndarray
    bad: np.ndarray
    cont: np.ndarray
    kind: np.ndarray
    port: np.ndarray
    ts: np.ndarray
    slot: np.ndarray
    task: np.ndarray
    v: list[np.ndarray]


def _parse_exact(lines: pa.Array) -> _Exact:
    """Read lines (without their newline) with the one RE2 pattern that knows every kind."""
    n = len(lines)
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
    ts = np.where(np.isnan(ts), -1, ts).astype(np.int64)
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
    return _Exact(valid=valid, bad=bad, cont=cont, kind=kind, port=port, ts=ts, slot=_num(f["slot"]),
                  task=task, v=[v1, v2, v3, v4])


# --------------------------------------------------------------------------- a block -> events

def parse_chunk(
    chunk: bytes, first_line: int, state: StreamState, account: FileAccount
) -> pd.DataFrame:
    """Turn one block of whole lines into events; count every line in ``account``.

    ``first_line`` is the 1-based file line of the block's first line.
    """
    ends = chunk.endswith(b"\n")
    wrapper = state.wrapper
    if not state.wrapper_known:
        state.wrapper = wrapper = prefixes.detect(chunk.split(b"\n", 400)[:400])
        state.wrapper_known = True
        account.wrapper = wrapper.name if wrapper else None
    if wrapper is not None and wrapper.stamp == "json":
        lines_b = chunk.split(b"\n")
        if lines_b and lines_b[-1] == b"":
            lines_b.pop()
        n = len(lines_b)
        wall = np.full(n, -1, dtype=np.int64)
        lines_b, json_walls = prefixes.decode_json_lines(lines_b, wrapper)
        wall[:] = [(-1 if x is None else int(round(x * 1e6))) for x in json_walls]
        # A message with a line break inside shifts what follows, as in a plain read of it.
        text = _clean(b"\n".join(lines_b)).decode("utf-8").split("\n")
        del text[n:]
        lines = pa.array([t + "\n" for t in text], pa.string())
    else:
        lines = _split(_clean(chunk), ends)  # cleaning never adds or removes a newline
        n = len(lines)
        wall = np.full(n, -1, dtype=np.int64)
        if wrapper is not None:
            bare, wall = prefixes.strip(_without_newline(lines), wrapper, state.year, state.tz)
            lines = pc.binary_join_element_wise(bare, "", "\n")

    account.lines += n
    sc = _scan(lines) if _USE_SCANNER else _Scan(
        known=np.zeros(n, bool), kind=np.zeros(n, np.int8), port=np.full(n, -1, np.int64),
        ts=np.full(n, -1, np.int64), slot=np.full(n, np.nan), task=np.full(n, np.nan),
        v=[np.full(n, np.nan) for _ in range(4)])
    kind, port, ts, slot, task, v = sc.kind, sc.port, sc.ts, sc.slot, sc.task, sc.v
    valid = sc.known.copy()
    bad = np.zeros(n, bool)
    cont = np.zeros(n, bool)
    asked = np.flatnonzero(~sc.known)
    if len(asked):
        ex = _parse_exact(_without_newline(lines.take(pa.array(asked))))
        for full, part in ((kind, ex.kind), (port, ex.port), (ts, ex.ts), (slot, ex.slot), (task, ex.task),
                           (valid, ex.valid), (bad, ex.bad), (cont, ex.cont), *zip(v, ex.v)):
            full[asked] = part

    ignored = valid & (kind == 0) & ~bad
    unknown_idx = np.flatnonzero(~valid | bad)
    legacy_rows: list[dict] = []
    if len(unknown_idx):
        known_other = 0
        texts = _without_newline(lines.take(pa.array(unknown_idx))).to_pylist()
        for i, s in zip(unknown_idx, texts):
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
    ev = pd.DataFrame({
        "line": (first_line + idx).astype(np.int64), "kind": kind[idx], "port": port[idx],
        "ts_us": ts[idx], "wall_us": wall[idx], "slot": slot[idx], "task": task[idx],
        "v1": v[0][idx], "v2": v[1][idx], "v3": v[2][idx], "v4": v[3][idx], "cont": cont[idx],
    })
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
        # The last known time before each row (NaN if none; the first row: the previous block's).
        last = np.where(known, np.arange(len(p_ts)), -1)
        np.maximum.accumulate(last, out=last)
        before = np.empty_like(last)
        before[0] = -1
        before[1:] = last[:-1]
        ff = np.where(before >= 0, p_ts[np.maximum(before, 0)].astype(np.float64), np.nan)
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
    chunk_size: int | None = None,
) -> tuple[TaskAssembler, list[FileAccount]]:
    """Parse one server-log stream (rotated files oldest first) into an assembler.

    ``chunk_size``: bytes per block (default :data:`slotscope.sources.CHUNK_SIZE`); the result
    does not depend on it.
    """
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
        chunks = iter_chunks(stream, lf.path, chunk_size or CHUNK_SIZE)
        try:
            line = 1
            for chunk in chunks:
                ev = parse_chunk(chunk, line, state, account)
                line = account.lines + 1
                if len(ev):
                    asm.add(assign_sessions(ev, state), file=account.path)
                if progress is not None:
                    progress(len(chunk))
        except InputError as e:
            account.error = e.reason
        finally:
            chunks.close()  # stops a read-ahead thread before its stream is closed
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
    chunk_size: int | None = None,
) -> ServerLogs:
    """Read llama-server logs (files, directories, globs, ``-``) into task and sample tables.

    Tasks are keyed by (source, session, task_id); times are seconds on that session's server
    clock, with wall-clock columns where a capture wrapper stamped the lines. App call logs
    found among the paths are skipped here (see :func:`slotscope.app_log.read_app_logs`).
    Input is read in blocks of ``chunk_size`` bytes (default 4 MiB); memory is bounded by the
    block and the tables themselves.
    """
    if inputs is None:
        inputs = collect(paths)
    tasks, gens, prefills, sessions = [], [], [], []
    acc = Accounting(skipped=list(inputs.skipped), unusable=list(inputs.unusable), notes=list(inputs.notes))
    for files in inputs.server:
        asm, accounts = read_stream(files, inputs, keep_samples=keep_samples, tz=tz, year=year, progress=progress,
                                    chunk_size=chunk_size)
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
