"""The line scanner compiled with numba: :func:`slotscope.scanner.scan`'s reading, a line at a time.

:mod:`slotscope.scanner` reads a block column-wise with numpy; this module reads the same
grammar byte by byte in one compiled loop and gives the same
:class:`~slotscope.scanner.Scan` (``tests/test_perf_scanner.py`` holds both equal to
FAST_PATTERN's reading). It is used for large inputs when numba is installed (see
:func:`slotscope.scanner.use_compiled`); numba compiles it once and keeps the machine code in
its cache.

The message grammars are data, not code: each line kind is a little program of steps
(:data:`PROGRAMS`: a literal, one of two literals, a number field, an optional tail) that
one loop runs. One loop and no calls keeps numba's compile time to seconds and the work per
line to tens of nanoseconds (a compiled call that passes arrays costs more than a step).

Where the numpy scanner looks at bytes past a line's end it sees that line's newline, or
the zero padding after the block: neither is a digit, a blank or part of any literal. Here
nothing past the end is read, so both stop at the same place. Lines a step fails on are left
"not known" (FAST_PATTERN reads them); only known lines' values count.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from numba import njit

from .events import EVAL, HEARTBEAT, LAUNCH, PROGRESS, PROMPT_EVAL, RELEASE, TIMING_HEADER, TOTAL

# Steps: (op, a, b, c, d), ops below; literals are (offset, length) into _TEXT.
END, LIT, EITHER, FIELD, TAIL, DIGITS = 0, 1, 2, 3, 4, 5
NO_BLANKS = -1  # FIELD a: a number with no blanks before it (else: at least a blanks, < 16)

_text = bytearray()
_where: dict[bytes, tuple[int, int]] = {}


def _lit(text: str) -> tuple[int, int]:
    raw = text.encode()
    if raw not in _where:
        _where[raw] = (len(_text), len(raw))
        _text.extend(raw)
    return _where[raw]


def _step(op: int, *args: int) -> tuple[int, int, int, int, int]:
    return (op, *args, *(0,) * (4 - len(args)))  # type: ignore[return-value]


def lit(text: str) -> tuple[int, ...]:
    return _step(LIT, *_lit(text))


def either(a: str, b: str) -> tuple[int, ...]:
    return _step(EITHER, *_lit(a), *_lit(b))


def field(into: int, blanks: int = 0, sign: bool = False, frac: bool = False) -> tuple[int, ...]:
    """`` {blanks,15}-?\\d+`` (``frac``: then ``(?:\\.\\d*)?``), at most 15 digits in all."""
    return _step(FIELD, blanks, int(sign), int(frac), into)


def tail(text: str) -> tuple[int, ...]:
    """The line may end its reading here; if ``text`` follows, the steps after it must read."""
    return _step(TAIL, *_lit(text))


def digits(into: int) -> tuple[int, ...]:
    """``\\d*`` of at most 15 digits (none: no value)."""
    return _step(DIGITS, 0, 0, 0, into)


# ": id N | task N |" of a slot line (values 0, 1: slot and task), then each message kind.
HEAD = [lit(": id"), field(0, blanks=1, sign=True), lit(" | task "), field(1, blanks=NO_BLANKS, sign=True),
        lit(" |")]
PROGRAMS = {
    LAUNCH: [lit("processing task"), tail(", is_child = "), digits(0)],
    PROGRESS: [lit("prompt processing, n_tokens ="), field(0), lit(", progress ="), field(1, frac=True),
               lit(", t ="), field(2, frac=True), lit(" s /"), field(3, frac=True), lit(" tokens per second")],
    HEARTBEAT: [either("n_gen =", "n_decoded ="), field(0), lit(", tg ="), field(1, frac=True), lit(" t/s"),
                tail(", tg_3s ="), field(2, frac=True), lit(" t/s")],
    PROMPT_EVAL: [lit("prompt eval time ="), field(0, frac=True), lit(" ms /"), field(1), lit(" tokens")],
    EVAL: [lit("eval time ="), field(0, frac=True), lit(" ms /"), field(1), either(" tokens", " runs")],
    TOTAL: [lit("total time ="), field(0, frac=True), lit(" ms"), tail(" /"), field(1), lit(" tokens")],
    RELEASE: [either("stop processing: n_tokens =", "stop processing: n_past ="), field(0),
              lit(", truncated ="), field(1)],
}
_SLOT, _SRV, _CMN, _QUE, _RES, _SPEC = (_lit(t) for t in ("slot ", "srv  ", "cmn  ", "que  ", "res  ", "spec "))
_COLON, _CLOSE = _lit(": "), _lit("] ")
# Messages starting with these may be records or broken ones: never taken as ignored here.
_KEYWORDS = [_lit(t) for t in ("promp", "eval ", "total", "n_gen", "n_dec", "stop ", "proce")]
# Which program a message starting with this runs (kinds other than EVAL and TOTAL: after one blank).
_STARTS = [(LAUNCH, _lit("proce"), True), (PROGRESS, _lit("prompt p"), True), (HEARTBEAT, _lit("n_gen"), True),
           (HEARTBEAT, _lit("n_dec"), True), (PROMPT_EVAL, _lit("prompt e"), True), (EVAL, _lit("eval "), False),
           (TOTAL, _lit("total"), False), (RELEASE, _lit("stop "), True)]


def _assemble() -> tuple[np.ndarray, np.ndarray]:
    steps = HEAD + [_step(END)]
    starts = []
    for code, (off, n), after_one in _STARTS:
        starts.append((code, off, n, int(after_one), len(steps)))
        steps += PROGRAMS[code] + [_step(END)]
    return np.array(steps, np.int64), np.array(starts, np.int64)


_PROG, _DISPATCH = _assemble()
_TEXT = np.frombuffer(bytes(_text), np.uint8).copy()
_KW = np.array(_KEYWORDS, np.int64)
_TAGS = np.array([_SLOT, _SRV, _CMN, _QUE, _RES, _SPEC, _COLON, _CLOSE], np.int64)
_POW10F = 10.0 ** np.arange(17)


@njit(cache=True, nogil=True)
def _scan(buf, off, known, kind, port, ts, slot, task, v0, v1, v2, v3, srv_at,  # type: ignore[no-untyped-def]
          prog, dispatch, text, kw, tags, pow10f):
    vals = np.empty(4)
    for i in range(len(off) - 1):
        s, e = off[i], off[i + 1]
        if e > s and buf[e - 1] == 10:
            e -= 1
        p = s
        if p < e and buf[p] == 91:  # "[port] " (router mode): " *\d{1,15}\] "
            q = p + 1
            while q < e and buf[q] == 32:
                q += 1
            if q - p - 1 >= 16:
                continue
            v = 0
            nd = 0
            while q < e and 48 <= buf[q] <= 57:
                if nd < 15:
                    v = v * 10 + (buf[q] - 48)
                nd += 1
                q += 1
            if nd == 0 or nd > 15 or q + 2 > e or buf[q] != 93 or buf[q + 1] != 32:
                continue
            port[i] = v
            p = q + 2
        minutes = 0
        nd = 0
        while p + nd < e and 48 <= buf[p + nd] <= 57:
            if nd < 10:
                minutes = minutes * 10 + (buf[p + nd] - 48)
            nd += 1
        if nd >= 1:  # M.SS.mmm.uuu (minutes of up to 10 digits)
            q = p + nd
            if nd > 10 or q + 12 > e:
                continue
            if buf[q] != 46 or buf[q + 3] != 46 or buf[q + 7] != 46 or buf[q + 11] != 32:
                continue
            good = True
            for j in range(1, 11):
                if j != 3 and j != 7 and (buf[q + j] < 48 or buf[q + j] > 57):
                    good = False
            if not good:
                continue
            sec = (buf[q + 1] - 48) * 10 + (buf[q + 2] - 48)
            ms = (buf[q + 4] - 48) * 100 + (buf[q + 5] - 48) * 10 + (buf[q + 6] - 48)
            us = (buf[q + 8] - 48) * 100 + (buf[q + 9] - 48) * 10 + (buf[q + 10] - 48)
            # The same float64 arithmetic as FAST_PATTERN's reading (it rounds past 2**53 µs).
            ts[i] = np.int64(((float(minutes) * 60 + sec) * 1000 + ms) * 1000 + us)
            p = q + 12
        if p + 1 < e and (buf[p] == 73 or buf[p] == 87 or buf[p] == 69 or buf[p] == 68) and buf[p + 1] == 32:
            p += 2  # level "I W E D"
        # the tag and its 12-character function field (ASCII), then ": "
        if p + 19 > e:
            continue
        ascii_field = True
        for j in range(p + 5, p + 17):
            if buf[j] >= 128:
                ascii_field = False
        if not ascii_field or buf[p + 17] != 58 or buf[p + 18] != 32:
            continue
        tag = -1
        for t in range(6):
            o, n = tags[t, 0], tags[t, 1]
            same = True
            for j in range(n):
                if buf[p + j] != text[o + j]:
                    same = False
                    break
            if same:
                tag = t
                break
        if tag == 1:  # srv: the caller reads the few server events
            srv_at[i] = p + 19 - s
            continue
        if tag >= 2:  # cmn, que, res, spec: ignored
            known[i] = True
            continue
        if tag != 0:
            continue
        # A slot line: run the head's steps, then the message's.
        pc = 0
        p += 17
        head = True
        code = 0
        vals[0] = vals[1] = vals[2] = vals[3] = np.nan
        while True:
            op = prog[pc, 0]
            a, b, c, d = prog[pc, 1], prog[pc, 2], prog[pc, 3], prog[pc, 4]
            pc += 1
            if op == 1 or op == 4:  # LIT / TAIL
                same = p + b <= e
                if same:
                    for j in range(b):
                        if buf[p + j] != text[a + j]:
                            same = False
                            break
                if same:
                    p += b
                elif op == 4:
                    op = 0  # no tail: the reading ends here
                else:
                    break
            elif op == 2:  # EITHER
                took = 0
                for alt in range(2):
                    o, n = (a, b) if alt == 0 else (c, d)
                    if p + n <= e:
                        same = True
                        for j in range(n):
                            if buf[p + j] != text[o + j]:
                                same = False
                                break
                        if same:
                            took = n
                            break
                if took == 0:
                    break
                p += took
            elif op == 3 or op == 5:  # FIELD / DIGITS
                if op == 3 and a != -1:
                    k = 0
                    while p + k < e and buf[p + k] == 32:
                        k += 1
                    if k < a or k >= 16:
                        break
                    p += k
                neg = False
                if op == 3 and b == 1 and p < e and buf[p] == 45:  # "-"
                    neg = True
                    p += 1
                whole = 0
                n1 = 0
                while p < e and 48 <= buf[p] <= 57:
                    if n1 < 15:
                        whole = whole * 10 + (buf[p] - 48)
                    n1 += 1
                    p += 1
                if n1 > 15 or (n1 == 0 and op == 3):
                    break
                if op == 5:
                    if n1 >= 1:
                        vals[d] = float(whole)
                    continue
                n2 = 0
                if c == 1 and p < e and buf[p] == 46:  # "." and fraction digits
                    p += 1
                    while p < e and 48 <= buf[p] <= 57:
                        if n1 + n2 < 15:
                            whole = whole * 10 + (buf[p] - 48)
                        n2 += 1
                        p += 1
                    if n1 + n2 > 15:
                        break
                value = float(whole) / pow10f[n2]
                if neg:
                    value = -1.0 * value
                vals[d] = value
            if op == 0:  # END
                if not head:
                    known[i] = True
                    kind[i] = code
                    v0[i], v1[i], v2[i], v3[i] = vals[0], vals[1], vals[2], vals[3]
                    break
                head = False
                slot[i], task[i] = vals[0], vals[1]
                vals[0] = vals[1] = vals[2] = vals[3] = np.nan
                m = p
                k = 0
                while m + k < e and buf[m + k] == 32:
                    k += 1
                if e == m or (e == m + 1 and k == 1):
                    kind[i] = TIMING_HEADER
                    known[i] = True
                    break
                if k == 0 or k >= 16:
                    break
                p = m + k
                pc = -1
                for r in range(len(dispatch)):
                    o, n = dispatch[r, 1], dispatch[r, 2]
                    if (k == 1 or dispatch[r, 3] == 0) and p + n <= e:
                        same = True
                        for j in range(n):
                            if buf[p + j] != text[o + j]:
                                same = False
                                break
                        if same:
                            code, pc = dispatch[r, 0], dispatch[r, 4]
                            break
                if pc == -1:
                    keyword = False
                    for r in range(len(kw)):
                        o, n = kw[r, 0], kw[r, 1]
                        if p + n <= e:
                            same = True
                            for j in range(n):
                                if buf[p + j] != text[o + j]:
                                    same = False
                                    break
                            keyword = keyword or same
                    if not keyword:
                        known[i] = True  # another slot message: ignored
                    break


def scan_into(out: "object", lines: pa.StringArray) -> np.ndarray:
    """Fill ``out`` (a fresh :class:`~slotscope.scanner.Scan` of ``lines``) with the compiled
    reading; return, per line, where a server line's message starts (-1: not a server line),
    for the caller to read the few server events the numpy way."""
    n = len(lines)
    off = np.frombuffer(lines.buffers()[1], np.int32, count=n + 1, offset=4 * lines.offset).astype(np.int64)
    data = lines.buffers()[2]
    buf = np.frombuffer(data, np.uint8, count=int(off[-1])) if data is not None else np.zeros(0, np.uint8)
    srv_at = np.full(n, -1, np.int64)
    v = out.v  # type: ignore[attr-defined]
    _scan(buf, off, out.known, out.kind, out.port, out.ts, out.slot, out.task,  # type: ignore[attr-defined]
          v[0], v[1], v[2], v[3], srv_at, _PROG, _DISPATCH, _TEXT, _KW, _TAGS, _POW10F)
    return srv_at


def warm_up() -> None:
    """Compile (or load from numba's cache) for the array types real blocks have."""
    from .scanner import Scan

    text = b"0.00.000.001 I slot print_timing: id  0 | task 1 | n_gen =      1, tg =   1.00 t/s\n"
    offsets = np.array([0, len(text)], np.int32)
    lines = pa.StringArray.from_buffers(1, pa.py_buffer(offsets), pa.py_buffer(text))
    out = Scan.empty(1)
    scan_into(out, lines)
    if out.kind[0] != HEARTBEAT:
        raise RuntimeError("the compiled scanner misread its warm-up line")
