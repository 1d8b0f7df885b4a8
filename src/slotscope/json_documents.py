"""JSON records that are not one per line: an array of objects, or objects one after another
(pretty-printed, as ``jq .`` writes them), read a block at a time.

A JSON-lines reader can drop one bad line and go on; in a document a bad record leaves no
place to start again, so it ends the reading with its line (:class:`DocumentError`).
Memory holds one block and the record being read (at most :data:`LONGEST_RECORD`).
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

LONGEST_RECORD = 64 << 20  # characters: a record beyond that is damage (an unclosed quote), not a call
_GAP = re.compile(r"[\s,\ufeff]*")  # between records: blanks, an array's commas, a byte-order mark
# json names an error in a value cut by the end of what it was given at most this many
# characters before that end (`-1.5e-`, `fals`), or as an unterminated string.
_CUT_REACH = 8


class DocumentError(ValueError):
    """A document that cannot be read on: the line where the bad record starts, and why."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"{line}: {reason}")
        self.line, self.reason = line, reason


_OPENS_RECORDS = re.compile(r"\[\s*[{\[]")  # an array of objects (or of arrays); not `[34m`, `[8080]`


def is_document(head: str) -> bool:
    """Whether the start of a file (as text) is a JSON document rather than JSON lines or CSV:
    it opens an array of records, or its first line is a lone ``{`` (no JSON line is that).
    Log lines may start with ``[`` too: a colour code that lost its ESC, a router's port, a
    bracketed stamp."""
    text = head.lstrip("\ufeff \t\r\n")
    return _OPENS_RECORDS.match(text) is not None or text.split("\n", 1)[0].rstrip() == "{"


def first_records(sample: bytes, n: int = 20) -> list[dict[str, Any]]:
    """The objects among the first ``n`` values of a document's start (a sniffed sample),
    up to a bad record."""
    found = []
    with contextlib.suppress(DocumentError):
        for _, value, _ in itertools.islice(Records([sample], json.JSONDecoder().raw_decode), n):
            if isinstance(value, dict):
                found.append(value)
    return found


class Records:
    """The values of a document, each as ``(line it starts on, value, its text)``, from blocks
    of UTF-8 bytes; ``lines`` counts the document's lines read so far (all of them at the
    end). ``decode``: a :meth:`json.JSONDecoder.raw_decode` (with the caller's hooks).
    Where the blocks end inside a record (a file cut by a crash, or a sniffed sample), the
    values end before it and ``cut_at`` is its line."""

    def __init__(self, blocks: Iterable[bytes], decode: Callable[[str, int], tuple[Any, int]]) -> None:
        self._blocks = iter(blocks)
        self._decode = decode
        self.cut_at: int | None = None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf, self._pos, self._ended = "", 0, False
        self.lines = 0
        self._last = ""  # the last character read (a last line without a newline counts too)

    def _more(self) -> bool:
        """Read the next block onto what is left unread; False at the end."""
        while not self._ended:
            data = next(self._blocks, None)
            self._ended = data is None
            text = self._utf8.decode(data or b"", final=self._ended)
            if text:
                self.lines += text.count("\n")
                self._last = text[-1]
                self._buf, self._pos = self._buf[self._pos:] + text, 0
                return True
        if self._last and self._last != "\n":
            self.lines, self._last = self.lines + 1, "\n"
        return False

    def __iter__(self) -> Iterator[tuple[int, Any, str]]:
        line, in_array = 1, False
        while True:
            end = _GAP.match(self._buf, self._pos).end()  # type: ignore[union-attr]  # (matches empty)
            line += self._buf.count("\n", self._pos, end)
            self._pos = end
            if end == len(self._buf):
                if self._more():
                    continue
                return
            buf, pos = self._buf, self._pos
            if buf[pos] == ("]" if in_array else "["):  # the document's array (one inside it is a value)
                in_array = not in_array
                self._pos += 1
                continue
            try:
                value, end = self._decode(buf, pos)
            except json.JSONDecodeError as e:
                cut = e.pos >= len(buf) - _CUT_REACH or e.msg.startswith("Unterminated string")
                too_long = len(buf) - pos > LONGEST_RECORD
                if cut and not too_long and self._more():
                    continue
                if cut and not too_long:  # the end of what was read is inside this record
                    self.cut_at = line
                    return
                raise DocumentError(line + buf.count("\n", pos, e.pos), f"invalid JSON: {e.msg}" if not too_long else
                                    f"a record of over {LONGEST_RECORD >> 20} Mi characters (a quote not closed?)") from None
            if end == len(buf) and self._more():  # (a number or word at the end may go on)
                continue
            text = buf[pos:end]
            yield line, value, text
            line += text.count("\n")
            self._pos = end
