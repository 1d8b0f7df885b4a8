"""Numbers of a CSV app log that a spreadsheet may have written with a decimal comma.

A file whose fields are separated by ``;``, a tab or ``|`` may come from a spreadsheet in a
locale that writes ``5,6`` and ``1.234,5``. Each number with a mark in it is read both ways:
with a decimal comma (``.`` groups thousands) and with a decimal point (``,`` groups
thousands). A number that only one way reads (``5,6``, ``0,25``, ``1.234,5``; ``12.5``,
``0.250``, ``1,234.5``) shows the file's mark, and every number of the file is read with it;
a file that shows both is refused. A count is read only as a whole number, so ``2.281``
tokens show a decimal comma. A number both ways read differently (``1.234``) in a file that
shows no mark is read with its mark as the decimal mark, and one note says so.

In a file separated by commas (:class:`CommaCsvNumbers`), a number with a comma in it was
quoted (``"5,6"``, ``"1,234.5"``) by a spreadsheet; there a point is the decimal mark of
every other number, so each such number is read by the one reading it has, one that both
read (``"1,234"``) with a decimal point, and one note per file says so.

Thousands grouped by spaces (``1 234,5``, also the no-break spaces a French locale writes)
are read in either kind of file: a space is no decimal mark.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import AppLogError

COMMA, POINT = ",", "."
_NAMES = {COMMA: "a decimal comma", POINT: "a decimal point"}
_SPACES = "[ \u00a0\u202f]"  # a space, a no-break space, a narrow no-break space
_GRAMMAR = {  # the grouping mark (groups of three, after a first one of 1-3 digits), then the decimal mark
    COMMA: re.compile(rf"[+-]?(?:[1-9]\d{{0,2}}(?:\.\d{{3}})+|[1-9]\d{{0,2}}(?:{_SPACES}\d{{3}})+|\d+)(?:,\d+)?"
                      r"(?:[eE][+-]?\d+)?"),
    POINT: re.compile(rf"[+-]?(?:[1-9]\d{{0,2}}(?:,\d{{3}})+|[1-9]\d{{0,2}}(?:{_SPACES}\d{{3}})+|\d+)(?:\.\d+)?"
                      r"(?:[eE][+-]?\d+)?"),
}
_GROUPED = re.compile(rf"\d{_SPACES}\d")  # thousands grouped by spaces
_SPACE = re.compile(_SPACES)
# What may be a number with a comma or spaces in it: one test per field, which a date fails early.
_COMMA_OR_SPACES = re.compile(rf"\s*[+-]?\d[\d.]*(?:[,{_SPACES[1:-1]}]\d[\d.]*)+(?:[eE][+-]?\d+)?\s*")


def reading(text: str, mark: str) -> float | None:
    """``text`` read as a number with ``mark`` as its decimal mark (the other one, or spaces,
    grouping thousands); None where it is no such number."""
    text = text.strip()
    if not _GRAMMAR[mark].fullmatch(text):
        return None
    group = POINT if mark == COMMA else COMMA
    return float(_SPACE.sub("", text).replace(group, "").replace(mark, "."))


def _marked(value: Any) -> bool:
    """Whether a field's text has a decimal or grouping mark in it (spaces: between digits)."""
    if not isinstance(value, str):
        return False
    if COMMA in value or POINT in value:
        return True
    return (" " in value or "\u00a0" in value or "\u202f" in value) and _GROUPED.search(value) is not None


def _comma_or_spaces(value: Any) -> bool:
    return isinstance(value, str) and ("," in value or " " in value or "\u00a0" in value or "\u202f" in value) \
        and _COMMA_OR_SPACES.fullmatch(value) is not None


def _fits(value: float | None, count: bool) -> bool:
    return value is not None and (not count or value.is_integer())


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


@dataclass(frozen=True)
class _Readings:
    """A number's text and its value with either mark (None: no such number)."""

    text: str
    comma: float | None
    point: float | None
    only: str | None  # the mark that alone reads it (a count: as a whole number)
    both_fit: bool


def _readings(text: str, count: bool) -> _Readings:
    comma, point = reading(text, COMMA), reading(text, POINT)
    fit_comma, fit_point = _fits(comma, count), _fits(point, count)
    only = COMMA if fit_comma and not fit_point else POINT if fit_point and not fit_comma else None
    return _Readings(text, comma, point, only, fit_comma and fit_point)


@dataclass(frozen=True)
class Sign:
    """A number of the file, where it is: one that shows the mark, or one read by a guess."""

    line: int
    field: str
    text: str

    def __str__(self) -> str:
        return f"{self.field} {self.text!r}"


@dataclass
class DecimalMarks:
    """Which decimal mark the numbers of one file use, learnt as its chunks are read."""

    name: str
    shown: dict[str, Sign] = field(default_factory=dict)  # mark -> the first number only it reads
    # mark -> the first number both marks read, read with this one while no number showed either
    guessed: dict[str, tuple[Sign, float, float]] = field(default_factory=dict)

    def read(self, lines: np.ndarray, values: Mapping[str, Sequence[Any]],
             counts: Collection[str]) -> dict[str, list[Any]]:
        """The fields of ``values`` (number fields; text as read, None where empty) that have
        a number with a mark in it, each such number as a float read with the file's mark;
        a text no mark reads stays as it is. Raises :class:`AppLogError` where the file shows
        both marks."""
        both: dict[str, dict[int, _Readings]] = {}  # field -> row -> its readings
        for key, vals in values.items():
            got = {i: _readings(v, key in counts) for i, v in enumerate(vals) if _marked(v)}
            if got:
                both[key] = got
        for mark in (COMMA, POINT):
            only = [(int(lines[i]), key, r.text) for key, got in both.items() for i, r in got.items() if r.only == mark]
            if only and mark not in self.shown:
                self.shown[mark] = Sign(*min(only))
        self._check()
        return {key: [self._value(got[i], int(lines[i]), key) if i in got else v for i, v in enumerate(values[key])]
                for key, got in both.items()}

    def _check(self) -> None:
        if len(self.shown) == 2:
            first, later = sorted(self.shown.items(), key=lambda kv: kv[1].line)
            raise AppLogError(self.name, later[1].line, f"{later[1]} has {_NAMES[later[0]]}, but line "
                              f"{first[1].line}'s {first[1]} {_NAMES[first[0]]}; write the file's numbers "
                              "with one decimal mark")
        for mark, sign in self.shown.items():
            other = POINT if mark == COMMA else COMMA
            if other in self.guessed:  # (read in an earlier chunk, before this one showed the mark)
                guess, value, _ = self.guessed[other]
                raise AppLogError(self.name, guess.line, f"{guess} was read as {_number(value)}, with "
                                  f"{_NAMES[other]}, before line {sign.line}'s {sign} showed "
                                  f"{_NAMES[mark]}; write the file's numbers with one decimal mark")

    def _value(self, r: _Readings, line: int, key: str) -> Any:
        """A number's value read with the file's mark; where the file has shown none yet, the
        one reading a number has (such as a count's 2.5, a problem), or a guess."""
        mark = next(iter(self.shown), None)
        if mark is None and r.both_fit and r.comma != r.point:
            mark = POINT if POINT in r.text else COMMA  # (only one of them is in a number both read)
            value, other = (r.point, r.comma) if mark == POINT else (r.comma, r.point)
            assert value is not None and other is not None
            self.guessed.setdefault(mark, (Sign(line, key, r.text), value, other))
            return value
        got = (r.comma if mark == COMMA else r.point) if mark is not None else \
            r.comma if r.comma is not None else r.point
        return r.text if got is None else got

    def notes(self) -> list[str]:
        """What the file's numbers were read with, where that was a decimal comma or a guess."""
        if COMMA in self.shown:
            return [f"{self.name}: numbers read with a decimal comma (as line {self.shown[COMMA].line}'s "
                    f"{self.shown[COMMA]})"]
        if self.shown:
            return []
        return [f"{self.name}:{sign.line}: {sign} read as {_number(value)}: no number in the file shows whether "
                f"{mark!r} is its decimal mark or groups thousands (then {_number(other)})"
                for mark, (sign, value, other) in sorted(self.guessed.items(), key=lambda kv: kv[1][0].line)]


@dataclass
class CommaCsvNumbers:
    """The numbers of a file separated by commas that have a comma, or spaces grouping
    thousands, in them: each read by itself (see the module's text), so that no chunk
    depends on another; what needed saying, one note per file."""

    name: str
    comma: Sign | None = None  # the first number read with a decimal comma
    grouped: tuple[Sign, float, float] | None = None  # the first one both marks read: as read, and else

    def read(self, lines: np.ndarray, values: Mapping[str, Sequence[Any]],
             counts: Collection[str]) -> dict[str, list[Any]]:
        """As :meth:`DecimalMarks.read`, for the numbers with a comma or spaces in them (a
        text no mark reads stays as it is); never raises."""
        out = {}
        for key, vals in values.items():
            marked = [i for i, v in enumerate(vals) if _comma_or_spaces(v)]
            if marked:
                col = out[key] = list(vals)
                for i in marked:
                    col[i] = self._value(_readings(vals[i], key in counts), int(lines[i]), key)
        return out

    def _value(self, r: _Readings, line: int, key: str) -> Any:
        if r.only == COMMA:
            if self.comma is None or line < self.comma.line:
                self.comma = Sign(line, key, r.text)
            return r.comma
        if r.only is None and r.both_fit and r.comma != r.point and COMMA in r.text:
            assert r.comma is not None and r.point is not None
            if self.grouped is None or line < self.grouped[0].line:
                self.grouped = (Sign(line, key, r.text), r.point, r.comma)
        # (where no reading fits, such as a count's 2,5: the one it has, which is then a problem)
        got = r.point if r.only == POINT or r.both_fit else r.comma if r.comma is not None else r.point
        return r.text if got is None else got

    def notes(self) -> list[str]:
        """Which numbers were read with a decimal comma, and the first read by the file's point."""
        notes = []
        if self.comma is not None:
            notes.append(f"{self.name}: numbers with a comma and no grouping point read with a decimal comma "
                         f"(as line {self.comma.line}'s {self.comma})")
        if self.grouped is not None:
            sign, value, other = self.grouped
            notes.append(f"{self.name}:{sign.line}: {sign} read as {_number(value)}, its comma grouping thousands "
                         f"as the file's points are decimal ones (with a decimal comma: {_number(other)})")
        return notes
