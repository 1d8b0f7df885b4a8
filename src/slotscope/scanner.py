"""The line scanner: the common llama-server line shape read column-wise.

Most lines of a llama-server log follow one grammar (timestamp, level, ``slot <func>: id N |
task N | <message>``). The scanner reads a whole block of them at once and proves, line by
line, that :data:`slotscope.server_log.FAST_PATTERN` (the RE2 pattern that defines what each
line means) would read it the same way; lines it cannot prove are left "not known" for that
pattern. The lines with llama-server's own printf layout (nearly all) are read by the C
extension ``_cscan`` where it was built; the others, and every line where it was not, by
numpy: 8-byte words are gathered at each line's current position and tested a word at a
time (SWAR: digits and blanks found with bit tricks, numbers of up to 8 digits converted
with two multiplications).
"""

from __future__ import annotations

import importlib
import re
import types
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_cscan: types.ModuleType | None
try:  # llama-server's own line layout read in C (optional: numpy reads the same)
    _cscan = importlib.import_module("._cscan", __package__)
except ImportError:  # not built (no C compiler where slotscope was installed)
    _cscan = None

from .events import (
    BUILD, CANCEL, CONFIG, ERROR, EVAL, EXIT, HEARTBEAT, INIT, LAUNCH, MODEL, PROGRESS, PROMPT_EVAL, RELEASE,
    TIMING_HEADER, TOTAL,
)

# The server-event alternatives of FAST_PATTERN's ``srv`` branch (shared with server_log).
SRV_EVENT = (
    r"(?P<k_init>initializing \.\.\.)"
    r"|initializing, n_slots = (?P<n_slots>\d+), n_ctx_slot = (?P<n_ctx>\d+)"
    r"|.*cancel task, id_task = (?P<cancel>\d+)"
    r"|(?P<k_exit>.*cleaning up before exit)"
    r"|.*task id = (?P<err_task>\d+), error: (?P<err>.*)"
    r"|loading model '(?P<model>.*)'"
)
# The build line of FAST_PATTERN's component branch (``cmn``, printed at verbosity 4).
COMP_BUILD = r"common_params_print_info: build (?P<build>\d+ \([^)]*\))"

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
        # one gather, where aligned words need two gathers and a funnel shift.
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


def _eight_digits(v: np.ndarray) -> np.ndarray:
    """The number written by a word's 8 bytes as digits 0..9 (the first byte the highest)."""
    v = v * _U(10) + (v >> _U(8))
    return ((((v & _PAIR_MASK) * _PAIR_MUL1) + (((v >> _U(16)) & _PAIR_MASK) * _PAIR_MUL2)) >> _U(32)).astype(np.int64)


def _value(x: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The number written by the first ``n`` (1..8) digits of ``x`` (digits as 0..9)."""
    return np.where(n > 0, _eight_digits(x << (np.minimum(8 - n, 7) * 8).astype(_U)), 0)


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
        self.ok &= in_a | self.has(b)
        self.pos = self.pos + np.where(in_a, len(a), len(b))

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
class Reading:
    """One reading of each line of a block: event kind (0 none), port, time, slot, task, values."""

    kind: np.ndarray
    port: np.ndarray
    ts: np.ndarray
    slot: np.ndarray
    task: np.ndarray
    v: list[np.ndarray]
    text: dict[int, str] = field(default_factory=dict, kw_only=True)  # row -> a MODEL/BUILD line's text


@dataclass
class Scan(Reading):
    """What the scanner made of each line of a block (``known`` False: ask FAST_PATTERN)."""

    known: np.ndarray

    @classmethod
    def empty(cls, n: int) -> "Scan":
        """No line known yet: every line is left to FAST_PATTERN."""
        return cls(known=np.zeros(n, bool), kind=np.zeros(n, np.int8), port=np.full(n, -1, np.int64),
                   ts=np.full(n, -1, np.int64), slot=np.full(n, np.nan), task=np.full(n, np.nan),
                   v=[np.full(n, np.nan) for _ in range(4)])


_TAG_SLOT, _TAG_SRV = _word(b"slot ")[0], _word(b"srv  ")[0]
_TAG_COMP = [_word(t)[0] for t in (b"cmn  ", b"que  ", b"res  ", b"spec ")]
_MASK2, _MASK5 = _word(b"..")[1], _word(b".....")[1]
_ID = _word(b": id")[0]
# The 12 bytes after the minutes, ".SS.mmm.uuu ", as two words XOR "0" bytes: "." is 0x1E, " " 0x10.
_TS_DOTS, _TS_DOTS_MASK = _U(0x1E00000000000000 | 0x1E000000 | 0x1E), _U(0xFF000000FF0000FF)
_TS_END, _TS_END_MASK = _U(0x10000000), _U(0xFF000000)
_TS_DIGITS1 = _U(0x0080808000808000)  # high bits of bytes 1, 2, 4, 5, 6
_TS_DIGITS2 = _U(0x0000000000808080)  # bytes 0, 1, 2


def _stamp(minutes: np.ndarray, x1: np.ndarray, x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The µs of "M.SS.mmm.uuu ": ``x1`` the word ".SS.mmm." after the minutes, ``x2`` the next
    ("uuu " ...), both XOR "0" bytes. (whether their dots and digits are there, the time).

    The 8 digits "SSmmmuuu" are gathered into one word and read with two multiplications; the
    time is FAST_PATTERN's float64 arithmetic repeated (it rounds past 2**53 µs)."""
    ok = ((x1 & _TS_DOTS_MASK) == _TS_DOTS) & (((((x1 & _LO7) + _OVER9) | x1) & _TS_DIGITS1) == 0)
    ok &= ((((x2 & _LO7) + _OVER9) | x2) & _TS_DIGITS2) == 0
    # bytes 1-2 of x1 (seconds), 4-6 (ms) and 0-2 of x2 (µs), side by side, first digit lowest
    digits = ((x1 >> _U(8)) & _U(0xFFFF)) | ((x1 >> _U(16)) & _U(0xFFFFFF0000)) | ((x2 & _U(0xFFFFFF)) << _U(40))
    within = _eight_digits(digits)  # µs since the minute began
    sec, ms, us = within // 1_000_000, within // 1000 % 1000, within % 1000
    return ok, ((minutes.astype(np.float64) * 60 + sec) * 1000 + ms) * 1000 + us


_COLON = _word(b": ")[0]
_LEVELS = [_U(ord(c)) for c in "IWED"]
# A slot message that starts (after its blanks) with one of these may be a record or a
# broken one (FAST_PATTERN's k_bad): never taken as an ignored line by the scanner.
_KEYWORDISH = [_word(t)[0] for t in (b"promp", b"eval ", b"total", b"n_gen", b"n_dec", b"stop ", b"proce")]
_KW_PROMPT, _KW_EVAL, _KW_TOTAL, _KW_GEN, _KW_DECODED, _KW_RELEASE, _KW_LAUNCH = _KEYWORDISH
_KW_PROGRESS, _KW_PROMPT_EVAL = _word(b"prompt p")[0], _word(b"prompt e")[0]
_SRV_EVENTS = r"initializing|cancel task, id_task = |cleaning up before exit|task id = |loading model '"
# The same alternatives for Python's re (ASCII: \d is [0-9] as in RE2; no \s in them), for the
# few server lines that may be events: cheaper than compiling FAST_PATTERN for each block.
_SRV_EVENT_RE = re.compile(SRV_EVENT, re.ASCII)
_COMP_BUILD_RE = re.compile(COMP_BUILD, re.ASCII)
_BUILD_TEXT = b"common_params_print_info: build "


def line_bounds(lines: pa.StringArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block's bytes, and where each line starts and ends (before its newline)."""
    n = len(lines)
    off = np.frombuffer(lines.buffers()[1], np.int32, count=n + 1, offset=4 * lines.offset).astype(np.int64)
    data = lines.buffers()[2]
    raw = np.frombuffer(data, np.uint8, count=int(off[-1])) if data is not None else np.zeros(0, np.uint8)
    s, e = off[:-1], off[1:]
    ends_nl = np.zeros(n, bool)
    has = e > s
    ends_nl[has] = raw[e[has] - 1] == 10
    return raw, s, e - ends_nl


def scan(lines: pa.StringArray) -> Scan:
    """Read each line of a block (elements ending in a newline) with the scanner's grammar."""
    n = len(lines)
    raw, s, e = line_bounds(lines)
    words = _Words(raw)
    out = Scan.empty(n)
    if n == 0:
        return out
    rows, m = np.zeros(0, np.int64), np.zeros(0, np.int64)
    rest = np.arange(n)
    if _cscan is not None and USE_C:
        rest, rows, m = _c_laid_out(raw, s, e, out)
    if len(rest):
        more, m_more = _heads(words, s[rest], e[rest], lines, out, rest)
        rows, m = np.concatenate([rows, more]), np.concatenate([m, m_more])
    if len(rows):
        _messages(words, rows, m, e[rows], out)
    return out


USE_C = True  # tests turn it off to read every line with numpy, as where C was not built


def _c_laid_out(raw: np.ndarray, s: np.ndarray, e: np.ndarray, out: Scan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lines with llama-server's own layout, read in C as :func:`_heads` and
    :func:`_messages` read them: (the lines left to :func:`_heads`, the slot lines whose
    message is left to :func:`_messages`, where those messages start)."""
    state = np.empty(len(s), np.int8)
    m = np.empty(len(s), np.int64)
    assert _cscan is not None
    _cscan.laid_out(raw, np.ascontiguousarray(s, np.int64), np.ascontiguousarray(e, np.int64), out.ts, out.slot,
                    out.task, out.known, out.kind, *out.v, state, m)
    rows = np.flatnonzero(state == 2)
    return np.flatnonzero(state == 0), rows, m[rows]


def _heads(words: _Words, s: np.ndarray, e: np.ndarray, lines: pa.StringArray, out: Scan,
           idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Read the heads of lines ``idx`` (starts ``s``, ends ``e``) step by step: ports, times,
    levels, tags; server and component lines are done here. Returns the slot lines (block
    rows) and where their messages start (after ``task N |``)."""
    c = _Cursor(words, s.copy())
    w0 = words.at(c.pos)

    # [port] (router mode)
    bracket = np.flatnonzero((w0 & _U(0xFF)) == _U(0x5B))
    if len(bracket):
        b = _Cursor(words, c.pos[bracket] + 1)
        b.blanks()
        p = b.uint()
        b.lit(b"] ")
        out.port[idx[bracket]] = np.where(b.ok, p, -1).astype(np.int64)
        c.pos[bracket] = b.pos
        c.ok[bracket] &= b.ok

    # M.SS.mmm.uuu timestamp (optional): minutes of any width, then 12 fixed bytes
    minutes, nd = c.number_at(c.pos, w0 if not len(bracket) else None)
    stamped = np.flatnonzero(c.ok & (nd >= 1))
    if len(stamped):
        q = c.pos[stamped] + nd[stamped]
        x2 = words.at(q + 8) ^ _ASCII0  # "uuu "
        good, ts = _stamp(minutes[stamped], words.at(q) ^ _ASCII0, x2)
        good &= (nd[stamped] <= 10) & ((x2 & _TS_END_MASK) == _TS_END)
        out.ts[idx[stamped]] = np.where(good, ts, -1).astype(np.int64)
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
    out.known[idx[comp]] = True
    at_comp = np.flatnonzero(comp)
    if len(at_comp):  # a build line? (start-up lines only: few)
        builds = at_comp[c.has(_BUILD_TEXT, at=c.pos[at_comp] + 19)]
        if len(builds):
            _comp_builds(out, idx[builds], c.pos[builds] + 19 - s[builds], lines.take(pa.array(idx[builds])).to_pylist())
    srv = np.flatnonzero(colon & (tag == _TAG_SRV))
    if len(srv):  # ignored, unless it may be one of the server events (those few: FAST_PATTERN)
        maybe = pc.match_substring_regex(lines.take(pa.array(idx[srv])), _SRV_EVENTS).to_numpy(zero_copy_only=False)
        out.known[idx[srv[~maybe]]] = True
        events = srv[maybe]
        if len(events):
            _srv_events(out, idx[events], c.pos[events] + 19 - s[events], lines.take(pa.array(idx[events])).to_pylist())

    rows = np.flatnonzero(is_slot)
    h = _Cursor(words, c.pos[rows] + 21)
    h.blanks(1)
    slot = h.signed()
    h.lit(b" | task ")
    task = h.signed()
    h.lit(b" |")
    rows = idx[rows[h.ok]]
    out.slot[rows], out.task[rows] = slot[h.ok], task[h.ok]
    return rows, h.pos[h.ok]


def _messages(words: _Words, rows: np.ndarray, m: np.ndarray, end: np.ndarray, out: Scan) -> None:
    """Read the messages of slot lines (block ``rows``; each starts at ``m``, ends at ``end``)."""
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
    for code, sel in (
        (LAUNCH, one & (kw5 == _KW_LAUNCH)),
        (PROGRESS, one & (kw == _KW_PROGRESS)),
        (HEARTBEAT, one & ((kw5 == _KW_GEN) | (kw5 == _KW_DECODED))),
        (PROMPT_EVAL, one & (kw == _KW_PROMPT_EVAL)),
        (EVAL, some & (kw5 == _KW_EVAL)),
        (TOTAL, some & (kw5 == _KW_TOTAL)),
        (RELEASE, one & (kw5 == _KW_RELEASE)),
    ):
        i = np.flatnonzero(sel)
        if len(i):
            cur = _Cursor(words, m[i] + k[i])
            vals = _launch(cur) if code == LAUNCH else _read(cur, _GRAMMAR[code])
            done = rows[i[cur.ok]]
            out.known[done] = True
            out.kind[done] = code
            for j, v in enumerate(vals):
                out.v[j][done] = v[cur.ok]


def _srv_events(out: Scan, rows: np.ndarray, rest_at: np.ndarray, texts: list[str]) -> None:
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
        if g["model"] is not None:
            if g["model"]:  # FAST_PATTERN's reading cannot tell an empty name from none: no event
                out.kind[i] = MODEL
                out.text[int(i)] = g["model"]
        elif g["k_init"] is not None:
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


def _comp_builds(out: Scan, rows: np.ndarray, rest_at: np.ndarray, texts: list[str]) -> None:
    """Component lines whose message starts like the build line, read like FAST_PATTERN."""
    for i, at, text in zip(rows, rest_at, texts):
        m = _COMP_BUILD_RE.match(text.rstrip("\n"), int(at))
        if m is not None:
            out.kind[i] = BUILD
            out.text[int(i)] = m["build"]


def _launch(c: _Cursor) -> list[np.ndarray]:
    c.lit(b"processing task")
    tail = c.has(b", is_child = ")
    child, nd = c.number_at(c.pos + 13)  # the optional group takes the digits if there are any
    c.ok &= ~tail | (nd <= 15)
    return [np.where(tail & (nd >= 1), child.astype(np.float64), np.nan)]


# The other slot messages as steps: bytes, a literal; (a, b), either literal; int or float, a
# number (after any blanks: a value); [text, ...], an optional tail at the end of the line
# (where its text is there, the rest must read too: else FAST_PATTERN may read it otherwise).
_Steps = tuple[object, ...]
_GRAMMAR: dict[int, _Steps] = {
    PROGRESS: (b"prompt processing, n_tokens =", int, b", progress =", float, b", t =", float, b" s /", float,
               b" tokens per second"),
    HEARTBEAT: ((b"n_gen =", b"n_decoded ="), int, b", tg =", float, b" t/s", [b", tg_3s =", float, b" t/s"]),
    PROMPT_EVAL: (b"prompt eval time =", float, b" ms /", int, b" tokens"),
    EVAL: (b"eval time =", float, b" ms /", int, (b" tokens", b" runs")),
    TOTAL: (b"total time =", float, b" ms", [b" /", int, b" tokens"]),
    RELEASE: ((b"stop processing: n_tokens =", b"stop processing: n_past ="), int, b", truncated =", int),
}


def _read(c: _Cursor, steps: _Steps) -> list[np.ndarray]:
    """The values of a message read by its steps (see :data:`_GRAMMAR`)."""
    values = []
    for step in steps:
        if isinstance(step, bytes):
            c.lit(step)
        elif isinstance(step, tuple):
            c.either(*step)
        elif isinstance(step, list):
            there = c.has(step[0])
            tail = _Cursor(c.w, c.pos + len(step[0]))
            values += [np.where(there, v, np.nan) for v in _read(tail, tuple(step[1:]))]
            c.ok &= ~there | tail.ok
        else:
            c.blanks()
            values.append(c.decimal() if step is float else c.uint())
    return values
