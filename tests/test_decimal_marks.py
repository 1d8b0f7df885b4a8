"""Numbers read with either decimal mark, and what each shows of a file's mark."""

from __future__ import annotations

import numpy as np
import pytest

from slotscope.decimal_marks import COMMA, POINT, DecimalMarks, reading
from slotscope.errors import AppLogError


@pytest.mark.parametrize("text, comma, point", [
    ("5,6", 5.6, None), ("0,25", 0.25, None), ("1.234,5", 1234.5, None), ("1.234.567", 1234567.0, None),
    ("12.5", None, 12.5), ("0.250", None, 0.25), ("1,234.5", None, 1234.5), ("1,234,567", None, 1234567.0),
    ("1.234", 1234.0, 1.234), ("1,234", 1.234, 1234.0),  # either, and not alike
    ("-3,5", -3.5, None), ("1,5E+03", 1500.0, None), (" 7 ", 7.0, 7.0),
    ("1.23.4", None, None), ("12.34,5", None, None), ("5,6 ms", None, None), ("", None, None),
])
def test_a_number_read_with_each_mark(text: str, comma: float | None, point: float | None) -> None:
    assert (reading(text, COMMA), reading(text, POINT)) == (comma, point)


def test_a_count_shows_the_mark_its_whole_number_needs() -> None:
    """``2.281`` tokens: 2,281 with a decimal comma (its thousands grouped), no count with a
    decimal point; ``2.000`` is a count either way and shows nothing."""
    marks = DecimalMarks("calls.csv")
    got = marks.read(np.array([2, 3]), {"prompt_tokens": ["2.000", "2.281"]}, counts={"prompt_tokens"})
    assert got == {"prompt_tokens": [2000.0, 2281.0]} and marks.shown[COMMA].line == 3
    assert marks.notes() == ["calls.csv: numbers read with a decimal comma (as line 3's prompt_tokens '2.281')"]


def test_text_and_empty_cells_stay_as_they_are() -> None:
    marks = DecimalMarks("calls.csv")
    got = marks.read(np.array([2, 3, 4]), {"status": ["ok", None, "200"], "duration_ms": [None, "n/a", "5,6"]}, ())
    assert got == {"duration_ms": [None, "n/a", 5.6]} and marks.notes()[0].startswith("calls.csv: numbers read with")


def test_both_marks_in_one_chunk_name_the_later_line() -> None:
    with pytest.raises(AppLogError, match=r"^calls.csv:9: duration_ms '0,5' has a decimal comma, but line 4's "
                                          r"duration_ms '12.5' a decimal point; "):
        DecimalMarks("calls.csv").read(np.array([4, 9]), {"duration_ms": ["12.5", "0,5"]}, ())


def test_a_point_file_says_nothing() -> None:
    marks = DecimalMarks("calls.csv")
    assert marks.read(np.array([2, 3]), {"duration_ms": ["12.5", "1.234"]}, ()) == {"duration_ms": [12.5, 1.234]}
    assert marks.notes() == []
