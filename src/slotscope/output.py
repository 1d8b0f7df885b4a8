"""DataFrame -> table | csv | json | parquet, chosen in one place.

stdout carries data only. ``table`` is a rich table for a terminal; when stdout is piped and no
format is given, CSV is written instead (rich would cut rows to 80 columns). The format is
guessed from ``-o FILE``'s extension; binary Parquet is refused on a terminal.
"""

from __future__ import annotations

import csv
import functools
import io
import itertools
import json
import math
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterable, Iterator, Literal, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .errors import UsageError  # noqa: F401 - raised here and by the CLI
from .glossary import label

Format = Literal["table", "csv", "json", "parquet"]
FORMATS = ("table", "csv", "json", "parquet")
_EXT = {".csv": "csv", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".txt": "table"}


def is_terminal(stream: IO[str]) -> bool:
    """Whether a stream is an interactive terminal (tests replace this)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def choose_format(fmt: str | None, out: str | None, stdout_is_tty: bool) -> Format:
    """The format to write: explicit, else from the output file's extension, else by terminal."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UsageError(None, None, f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        chosen: Format = fmt  # type: ignore[assignment]
    elif out is not None and out != "-":
        chosen = _EXT.get(Path(out).suffix.lower(), "csv")  # type: ignore[assignment]
    else:
        chosen = "table" if stdout_is_tty else "csv"
    if chosen == "parquet" and (out is None or out == "-") and stdout_is_tty:
        raise UsageError(None, None, "refusing to write binary Parquet to a terminal; use -o FILE.parquet or pipe it")
    return chosen


def _iso_utc(col: pd.Series) -> pd.Series | None:
    """``iso`` of a UTC column without strftime (a Python call per value), the same text.

    pyarrow casts the naive times to "YYYY-MM-DD HH:MM:SS.ffffff"; that becomes
    "YYYY-MM-DDTHH:MM:SS[.ffffff]+00:00" (".000000" dropped, as strftime's "%f" then the regex
    did). None (the caller formats) for times with nanoseconds or years outside 1000..9999.
    """
    if col.dtype.unit == "ns":  # type: ignore[union-attr]
        ns = col.array.asi8[col.notna().to_numpy()]  # type: ignore[attr-defined]
        if (ns % 1000).any():
            return None
        col = col.dt.as_unit("us")
    naive = pa.array(col.array).cast(pa.timestamp("us"))
    try:
        lo, hi = (v.as_py() for v in pc.min_max(naive).values())
    except (ValueError, OverflowError):
        return None
    if lo is not None and not (lo.year >= 1000 and hi.year <= 9999):
        return None
    text = pc.utf8_replace_slice(pc.cast(naive, pa.string()), 10, 11, "T")
    text = pc.if_else(pc.ends_with(text, ".000000"), pc.utf8_slice_codeunits(text, 0, 19), text)
    text = pc.fill_null(pc.binary_join_element_wise(text, "+00:00", ""), "")
    return pd.Series(pd.array(text, dtype="str"), index=col.index, name=col.name)


def iso(col: pd.Series) -> pd.Series:
    """ISO-8601 text of a datetime column, exactly as ``Timestamp.isoformat()`` writes it.

    Column-wise for UTC (every time slotscope produces); other zones fall back to per value.
    """
    if str(getattr(col.dt, "tz", None)) in ("UTC", "UTC+00:00"):
        fast = _iso_utc(col)
        if fast is not None:
            return fast
        text = col.dt.strftime("%Y-%m-%dT%H:%M:%S.%f").str.replace(r"\.000000$", "", regex=True) + "+00:00"
        return text.where(col.notna(), "")
    return col.map(lambda x: x.isoformat() if not pd.isna(x) else "")


def for_text(df: pd.DataFrame) -> pd.DataFrame:
    """Datetimes as ISO-8601 with offset, everything else as is (for CSV and tables).

    Only the datetime columns are replaced; the table itself is not copied (a million-row
    task table would be).
    """
    # By the dtypes: a column of a DataFrame is a Series made each time it is asked for.
    dt = {c: iso(df[c]) for c, dtype in df.dtypes.items()
          if isinstance(dtype, pd.DatetimeTZDtype) or pd.api.types.is_datetime64_any_dtype(dtype)}
    return df.assign(**dt) if dt else df


# --- CSV --------------------------------------------------------------------------------------
#
# ``CsvWriter`` writes the bytes of ``df.to_csv(index=False)`` (pandas' defaults: ",",
# '"' doubled inside quotes, csv.QUOTE_MINIMAL, os.linesep, NaN/NA as ""), with two changes
# below (a bare CR quoted; text a spreadsheet would run as a formula guarded), but formats
# column by column into pyarrow string arrays and joins them into rows in C: no Python per
# row or value. What pandas writes, per dtype (pandas.core.indexes.base.get_values_for_csv, then the
# stdlib csv writer, which str()s every value and repr()s Python floats):
#
#   float64           numpy's str(): shortest round-trip digits like repr(float); positional for
#                     1e-4 <= |x| < 1e16 (integral ones end in ".0"), else "1e-05", "1.5e+16".
#                     pyarrow's cast has the same digits but is positional for 1e-6 <= |x| < 1e10
#                     only, prints integral values without ".0" and one-digit exponents as
#                     "e-7": those ranges are rewritten (vectorised) below. NaN -> "".
#   int, Int64 ...    decimal digits; <NA> -> "".
#   bool, boolean     "True" / "False"; <NA> -> "".
#   str, category     the text, quoted when the csv module would quote it; missing -> "".
#   (one column)      a row whose only field is empty is written '""', not as a blank line.
#
# The header is pandas' own (to_csv of no rows). Anything else (datetimes not made text by
# for_text, float32, mixed objects, MultiIndex columns ...) goes to pandas for the whole batch,
# and a chunk pyarrow cannot take (e.g. lone surrogates) to pandas for that chunk, so the bytes
# are always pandas' own, but for the two changes:
#
#   a bare CR         quoted like a line feed: readers end a record at either. The csv module
#                     before Python 3.12 quotes only the characters of its line terminator.
#   formula text      a text cell starting with = + - @ a tab or a CR, unless it is a plain
#                     number ("-5", "+1.5e3"), gets a leading "'" so that a spreadsheet shows
#                     it instead of running it. Number columns are never touched. ``raw=True``
#                     (the CLI's --raw-csv) writes text as it is.

_EOL = os.linesep
_CHUNK_CELLS = 1 << 18  # cells formatted and joined at a time: the writer's memory stays the same whatever the batch


def _csv_dialect() -> tuple[list[int], str]:
    """(the characters that make the csv module quote a field, how it writes a lone empty field).

    Asked of the csv module itself with pandas' settings rather than assumed: which control
    characters force quoting depends on the line terminator (os.linesep) and on the csv module.
    """
    special = []
    for code in range(128):
        buf = io.StringIO()
        csv.writer(buf, lineterminator=_EOL).writerow([f"a{chr(code)}b", "x"])
        if buf.getvalue().startswith('"'):
            special.append(code)
    buf = io.StringIO()
    csv.writer(buf, lineterminator=_EOL).writerow([""])
    return special, buf.getvalue()[: -len(_EOL)]


_MODULE_QUOTE_CODES, _LONE_EMPTY = _csv_dialect()
_QUOTE_CODES = sorted({*_MODULE_QUOTE_CODES, ord("\n"), ord("\r")})
_FORMULA_CHARS = "=+-@\t\r"  # what a spreadsheet's formula (or a field split in two) starts with
_FORMULA_BYTES = np.frombuffer(_FORMULA_CHARS.encode("ascii"), dtype=np.uint8)
# One pattern text for both engines (RE2 in pyarrow, re for what pandas writes): ASCII digits only.
_PLAIN_NUMBER = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_PLAIN_NUMBER_RE = re.compile(_PLAIN_NUMBER)
_QUOTE_BYTES = [bytes([c]) for c in _QUOTE_CODES]
_QUOTE_RE = "[" + "".join(f"\\x{c:02x}" for c in _QUOTE_CODES) + "]"  # RE2
_BOOL_TEXT = pa.array(["False", "True", ""])
_MASKED_INTS = {"Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64"}


class _Fallback(Exception):
    """This chunk cannot be formatted exactly here: pandas writes it."""


def _as_string(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.type != pa.string():
        arr = arr.cast(pa.string())
    return arr


def _no_nulls(text: pa.Array) -> pa.Array:
    return pc.fill_null(text, "") if text.null_count else text


def _utf8(text: pa.Array) -> memoryview:
    """The bytes of a string array's values, end to end."""
    _, offsets, data = text.buffers()
    if data is None:
        return memoryview(b"")
    bounds = np.frombuffer(offsets, dtype=np.int32)[[text.offset, text.offset + len(text)]]
    return memoryview(data)[bounds[0]:bounds[1]]


def _quoted(text: pa.Array) -> pa.Array:
    """Fields the csv module would quote, quoted (inner quotes doubled); the rest as they are."""
    raw = bytes(_utf8(text))
    if not any(c in raw for c in _QUOTE_BYTES):  # memchr: no regex machinery for the usual text
        return text
    need = pc.match_substring_regex(text, _QUOTE_RE)
    if not pc.any(need).as_py():
        return text
    sub = text.filter(need)
    sub = pc.binary_join_element_wise('"', pc.replace_substring(sub, '"', '""'), '"', "")
    return pc.replace_with_mask(text, need, sub)


def _guarded(text: pa.Array) -> pa.Array:
    """Text a spreadsheet would run as a formula with a leading "'"; the rest as it is."""
    text = _no_nulls(text)
    _, offsets, data = text.buffers()
    if data is None or not len(text):
        return text
    bounds = np.frombuffer(offsets, dtype=np.int32)[text.offset:text.offset + len(text) + 1]
    chars = np.frombuffer(data, dtype=np.uint8)
    if not len(chars):
        return text
    starts = bounds[:-1]
    # The first byte of each value, read from the buffers: most cells (ids, ISO times) hold a
    # "-" but do not start with one, and are passed over without a regex.
    first = chars.take(np.minimum(starts, len(chars) - 1))
    need = np.isin(first, _FORMULA_BYTES) & (bounds[1:] > starts)
    if not need.any():
        return text
    mask = pa.array(need)
    number = pc.match_substring_regex(text.filter(mask), "^(?:" + _PLAIN_NUMBER + ")$").to_numpy(zero_copy_only=False)
    need[need] = ~number
    return _replace(text, need, lambda t: pc.binary_join_element_wise("'", t, ""))


def _guard_cell(v: object) -> object:
    """:func:`_guarded` for one value (for what pandas writes)."""
    if isinstance(v, str) and v[:1] and v[0] in _FORMULA_CHARS and not _PLAIN_NUMBER_RE.fullmatch(v):
        return "'" + v
    return v


def _guard_frame(df: pd.DataFrame) -> pd.DataFrame:
    """:func:`_guarded` for a batch that pandas writes: its text cells, number cells untouched."""
    fixed = {}
    for k, (_, col) in enumerate(df.items()):
        dtype = col.dtype
        if isinstance(dtype, pd.CategoricalDtype):
            cats = dtype.categories
            if cats.dtype != object and not isinstance(cats.dtype, pd.StringDtype):
                continue
            new = cats.map(_guard_cell)
            if not new.equals(cats):
                fixed[k] = col.cat.rename_categories(new) if new.is_unique else col.astype(object).map(_guard_cell)
        elif dtype == object or isinstance(dtype, pd.StringDtype):
            values = col.to_numpy(dtype=object)
            new_values = [_guard_cell(v) for v in values]
            if any(a is not b for a, b in zip(values, new_values)):
                fixed[k] = pd.Series(new_values, index=col.index, dtype=dtype)
    if not fixed:
        return df
    out = df.copy(deep=False)
    for k, col in fixed.items():
        out.isetitem(k, col)  # by position: names may repeat
    return out


def _has_bare_cr(df: pd.DataFrame) -> bool:
    """Whether a text cell or a column name of a batch that pandas writes holds a CR."""
    if any("\r" in str(c) for c in df.columns):
        return True
    for _, col in df.items():
        dtype = col.dtype
        if isinstance(dtype, pd.CategoricalDtype):
            col = pd.Series(dtype.categories)
            dtype = col.dtype
        if (dtype == object or isinstance(dtype, pd.StringDtype)) and any(
                isinstance(v, str) and "\r" in v for v in col.to_numpy(dtype=object)):
            return True
    return False


def _pandas_csv(df: pd.DataFrame, stream: IO[str], header: bool) -> None:
    """``df.to_csv(stream, index=False, header=header)``, a field holding a bare CR quoted.

    The csv module quotes a field that holds any character of its line terminator, so such a
    batch is written a row at a time with CR added to the terminator, and the terminator put back.
    """
    if ord("\r") in _MODULE_QUOTE_CODES or not _has_bare_cr(df):
        df.to_csv(stream, index=False, header=header)
        return
    eol = _EOL + "\r"
    if header:
        stream.write(df.iloc[:0].to_csv(index=False, lineterminator=eol)[: -len(eol)] + _EOL)
    for k in range(len(df)):
        stream.write(df.iloc[k : k + 1].to_csv(index=False, header=False, lineterminator=eol)[: -len(eol)] + _EOL)


def _replace(text: pa.Array, mask: np.ndarray, fix) -> pa.Array:  # type: ignore[no-untyped-def]
    """``text`` with the elements under ``mask`` replaced by ``fix(those elements)``."""
    if not mask.any():
        return text
    return pc.replace_with_mask(text, pa.array(mask), fix(text.filter(pa.array(mask))))


def _small_sci(sub: pa.Array) -> pa.Array:
    """pyarrow's positional "-0.0000123" (1e-6 <= |x| < 1e-4) as Python's "-1.23e-05"."""
    parts = pc.extract_regex(sub, r"^(?P<sign>-?)0\.(?P<zeros>0*)(?P<lead>\d)(?P<rest>\d*)$")
    rest = parts.field("rest")
    frac = pc.if_else(pc.equal(rest, ""), "", pc.binary_join_element_wise(".", rest, ""))
    exp = pc.binary_join_element_wise("e-", pc.utf8_lpad(pc.cast(pc.add(pc.utf8_length(parts.field("zeros")), 1), pa.string()), 2, "0"), "")
    return pc.binary_join_element_wise(parts.field("sign"), parts.field("lead"), frac, exp, "")


def _big_positional(sub: pa.Array) -> pa.Array:
    """pyarrow's "1.2345678e+12" (1e10 <= |x| < 1e16, not integral) as Python's "1234567800000.0"."""
    parts = pc.extract_regex(sub, r"^(?P<sign>-?)(?P<lead>\d)\.?(?P<rest>\d*)e\+(?P<exp>\d+)$")
    digits = pc.binary_join_element_wise(parts.field("lead"), parts.field("rest"), "")
    exps = pc.cast(parts.field("exp"), pa.int16()).to_numpy(zero_copy_only=False)
    out = sub
    for e in np.unique(exps).tolist():  # at most six exponents: 10..15
        at = pa.array(exps == e)
        d = digits.filter(at)
        whole = pc.utf8_rpad(pc.utf8_slice_codeunits(d, 0, e + 1), e + 1, "0")
        frac = pc.utf8_slice_codeunits(d, e + 1)
        frac = pc.if_else(pc.equal(frac, ""), "0", frac)
        out = pc.replace_with_mask(out, at, pc.binary_join_element_wise(parts.field("sign").filter(at), whole, ".", frac, ""))
    return out


def _float_text(x: np.ndarray, null: np.ndarray | None) -> pa.Array:
    """float64 as numpy's str() (= repr(float)) writes it; ``null`` (or NaN if None) -> "".

    Values with at most six decimals (nearly all that slotscope writes) are laid out from their
    digits (:func:`_six_decimals_text`), the others by :func:`_any_float_text`.
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    if null is None:
        null = np.isnan(x)
    a = np.abs(x)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN, inf and huge values are not short
        k = np.rint(a * 1e6)  # exact below 1e9: k < 1e15 < 2**53
        # k / 1e6 is one correctly rounded division: the double that reading "k * 10**-6" gives.
        short = (k / 1e6 == a) & (a < 1e9) & ((a >= 1e-4) | (a == 0)) & ~null
    text = _six_decimals_text(x, a, k, short)
    rest = ~(short | null)
    if rest.any():
        text = pc.replace_with_mask(text, pa.array(rest), _any_float_text(x[rest]))
    return text


# A value of at most six decimals below 1e9 is written "IIIIIIIII.FFFFFF" (nine digits, the point,
# six decimals) with leading zeros of the integer part and trailing zeros of the decimals (one
# kept) cut: that is repr()'s text. It reads back as the value, and no shorter text does: below
# 1e9 doubles are less than 1e-6 apart (< 2**-23), so no other decimal of at most six places
# reads back as it, and a shorter one would be such a decimal. Numpy would write it the same
# way: positional from 1e-4 up. The 16 characters are four 4-character pieces looked up in one
# table (a uint32 each), zeros to be cut written as blanks, which pyarrow trims: no pass of
# pyarrow's float cast and the fix-ups of _any_float_text.
def _pieces(texts: list[str]) -> np.ndarray:
    return np.frombuffer("".join(texts).encode("ascii"), dtype=np.uint32)


_BLANKS = np.uint32(0x20202020)


@functools.cache
def _piece_table() -> tuple[np.ndarray, int, int, int]:
    """The pieces, and where the 2nd, 3rd and 4th pieces' parts begin (built at first use: most
    commands write no CSV floats)."""
    lead = _pieces([f"{i:4d}" if i else "    " for i in range(10_000)])  # digits 1-4 of 9
    ints = _pieces([f"{i:04d}" for i in range(10_000)]  # digits 5-8 after a digit (+0) or not (+10000)
                   + [f"{i:4d}" if i else "    " for i in range(10_000)])
    point = _pieces([f"{u}.{d:02d}" for u in range(10) for d in range(100)]  # digit 9, ".", decimals 1-2
                    + [f"{u}.{d // 10}" + (" " if d % 10 == 0 else str(d % 10))  # (+1000: decimals 3-6 are 0)
                       for u in range(10) for d in range(100)])
    frac = _pieces([f"{i:04d}".rstrip("0").ljust(4) for i in range(10_000)])  # decimals 3-6
    return np.concatenate([lead, ints, point, frac]), len(lead), len(lead) + len(ints), len(lead) + len(ints) + len(point)


def _six_decimals_text(x: np.ndarray, a: np.ndarray, k: np.ndarray, short: np.ndarray) -> pa.Array:
    """The text of the values under ``short`` (``a`` = |x|, ``k`` = round(a * 1e6)), "" for the rest."""
    n = len(x)
    u32 = np.uint32
    every = bool(short.all())
    if not every:
        a, k = np.where(short, a, 0.0), np.where(short, k, 0.0)
    whole = np.trunc(a)
    i = whole.astype(u32)
    frac = (k - whole * 1e6).astype(u32)  # 0 .. 999999: k / 1e6 rounds to a, so it is whole + frac / 1e6
    tens = i // u32(10)
    hi = tens // u32(10_000)
    lo = tens - hi * u32(10_000) + (hi == 0).view(np.uint8) * u32(10_000)
    f2 = frac // u32(10_000)
    f4 = frac - f2 * u32(10_000)
    point = (i - tens * u32(10)) * u32(100) + f2 + (f4 == 0).view(np.uint8) * u32(1000)
    pieces, at_int, at_point, at_frac = _piece_table()
    at = np.stack([hi, lo + u32(at_int), point + u32(at_point), f4 + u32(at_frac)], axis=1)
    chars = pieces.take(at)
    if not every:
        chars[~short] = _BLANKS
    fixed = pa.StringArray.from_buffers(n, pa.py_buffer(np.arange(0, 16 * n + 1, 16, dtype=np.int32)), pa.py_buffer(chars))
    text = pc.ascii_trim_whitespace(fixed)
    return _replace(text, np.signbit(x) & short, lambda t: pc.binary_join_element_wise("-", t, ""))


def _any_float_text(x: np.ndarray) -> pa.Array:
    """Any float64 (none missing) as numpy's str() (= repr(float)) writes it.

    pyarrow's cast gives the same shortest round-trip digits; the values whose notation differs
    (see above) are taken out, re-laid out by kind, and gathered back in one pass.
    """
    text = pc.cast(pa.array(x), pa.string())
    a = np.abs(x)
    with np.errstate(invalid="ignore"):
        integral = (x == np.trunc(x)) & (a < 1e16)
        small = (a < 1e-4) & (a > 0)
        big = (a >= 1e10) & (a < 1e16) & ~integral
    fix = integral | small | big
    n_fix = int(np.count_nonzero(fix))
    if not n_fix:
        return text
    sub, sx = text.filter(pa.array(fix)), x[fix]
    integral, small, big = integral[fix], small[fix], big[fix]

    def whole(_: pa.Array) -> pa.Array:
        # Integral and below 1e16 (< 2**53 or even): the shortest digits are the integer's own.
        vals = sx[integral]
        ints = pc.cast(pa.array(vals.astype(np.int64)), pa.string())
        negzero = (vals == 0) & np.signbit(vals)
        if negzero.any():
            ints = pc.if_else(pa.array(negzero), "-0", ints)
        return pc.binary_join_element_wise(ints, "0", ".")

    sub = _replace(sub, integral, whole)
    # Below 1e-6 pyarrow is scientific too, but writes "e-7" where Python writes "e-07".
    sa = np.abs(sx)
    sub = _replace(sub, small & (sa < 1e-6), lambda s: pc.replace_substring_regex(s, r"e-(\d)$", r"e-0\1"))
    sub = _replace(sub, small & (sa >= 1e-6), _small_sci)
    sub = _replace(sub, big, _big_positional)
    return pc.replace_with_mask(text, pa.array(fix), sub)


def _column_formatter(col: pd.Series, raw: bool = False):  # type: ignore[no-untyped-def]
    """``f(start, stop) -> pa.StringArray`` writing rows [start, stop) of ``col`` as pandas would
    (text guarded unless ``raw``, see above); None for a dtype not handled exactly here."""
    text = _quoted if raw else (lambda t: _quoted(_guarded(t)))
    dtype = col.dtype
    if isinstance(dtype, np.dtype):
        values = col.to_numpy()
        if dtype == np.float64:
            return lambda i, j: _float_text(values[i:j], None)
        if dtype.kind in "iu":
            return lambda i, j: pc.cast(pa.array(values[i:j]), pa.string())
        if dtype == np.bool_:
            return lambda i, j: _BOOL_TEXT.take(pa.array(values[i:j].view(np.int8)))
        if dtype == object:
            kind = pd.api.types.infer_dtype(values, skipna=True)
            if kind not in ("string", "empty"):
                return None
            return lambda i, j: text(pa.array(np.where(pd.isna(values[i:j]), "", values[i:j]), type=pa.string()))
        return None
    arr = col.array
    if dtype.name in _MASKED_INTS:
        return lambda i, j: _no_nulls(pc.cast(pa.array(arr[i:j]), pa.string()))
    if dtype.name == "Float64":
        return lambda i, j: _float_text(arr[i:j].to_numpy(dtype=np.float64, na_value=0.0), np.asarray(arr[i:j].isna()))
    if isinstance(dtype, pd.BooleanDtype):
        return lambda i, j: _BOOL_TEXT.take(pa.array(arr[i:j].to_numpy(dtype=np.int8, na_value=2)))
    if isinstance(dtype, pd.StringDtype):
        return lambda i, j: text(_no_nulls(_as_string(pa.array(arr[i:j]))))
    if isinstance(dtype, pd.CategoricalDtype):
        # Categories are written as their values' str(), like a column of that dtype would be.
        fmt = _column_formatter(pd.Series(dtype.categories), raw)
        if fmt is None:
            return None
        cats = pa.concat_arrays([fmt(0, len(dtype.categories)), pa.array([""])])
        codes = arr.codes

        def categorical(i: int, j: int) -> pa.Array:
            c = codes[i:j]
            return cats.take(pa.array(np.where(c < 0, len(cats) - 1, c)))

        return categorical
    return None


def _csv_chunk(formatters: list, start: int, stop: int) -> str:  # type: ignore[type-arg]
    """Rows [start, stop) as CSV text, line terminators included."""
    cols = [f(start, stop) for f in formatters]
    if len(cols) == 1:
        # The csv module writes a row whose only field is empty as '""' (else it is a blank line).
        cols[0] = pc.if_else(pc.equal(cols[0], ""), _LONE_EMPTY, cols[0])
    cols[-1] = pc.binary_join_element_wise(cols[-1], "", _EOL)
    rows = pc.binary_join_element_wise(*cols, ",")
    if rows.null_count or len(rows) != stop - start:
        raise _Fallback
    return str(_utf8(rows), "utf-8")


class CsvWriter:
    """CSV of one table written in batches: the bytes of ``pd.concat(batches).to_csv(stream, index=False)``
    but for a bare CR, quoted, and text a spreadsheet would run as a formula, guarded with "'"
    unless ``raw`` (see above).

    ``write(df)`` appends a batch; the header (pandas' own) comes with the first batch, even an
    empty one, so any split of a table into batches writes the same bytes. Batches must have the
    same columns. Each batch is formatted column-wise and written a chunk of rows at a time.
    """

    def __init__(self, stream: IO[str], *, header: bool = True, raw: bool = False) -> None:
        self.stream = stream
        self._header = header
        self._raw = raw
        self._columns: pd.Index | None = None

    def write(self, df: pd.DataFrame) -> None:
        first = self._columns is None
        if first:
            self._columns = df.columns
        elif not df.columns.equals(self._columns):  # type: ignore[union-attr]
            raise ValueError("CsvWriter: a batch's columns differ from the first batch's")
        header = self._header and first
        ncols = len(df.columns)
        formatters = None
        if ncols and not isinstance(df.columns, pd.MultiIndex):
            formatters = [_column_formatter(col, self._raw) for _, col in df.items()]  # by position: names may repeat
        if formatters is None or any(f is None for f in formatters):
            _pandas_csv(df if self._raw else _guard_frame(df), self.stream, header)
            return
        if header:
            _pandas_csv(df.iloc[:0], self.stream, True)
        step = max(1, _CHUNK_CELLS // ncols)
        for start in range(0, len(df), step):
            stop = min(start + step, len(df))
            try:
                text = _csv_chunk(formatters, start, stop)
            except (_Fallback, pa.ArrowException, UnicodeError):
                chunk = df.iloc[start:stop]
                _pandas_csv(chunk if self._raw else _guard_frame(chunk), self.stream, False)
                continue
            self.stream.write(text)


def _cell(v: object) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        a = abs(v)
        if a >= 1e15:
            return f"{v:g}"
        if a >= 100 or v == int(v):
            return f"{v:,.0f}"
        return f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    if isinstance(v, pd.Timestamp):
        return v.isoformat(timespec="milliseconds")
    return str(v)


def rich_table(df: pd.DataFrame, title: str | None = None, max_rows: int | None = None,
               whole: Sequence[str] = (), columns: dict[object, tuple[list[str], int]] | None = None) -> Table:
    """A rich Table of a DataFrame (numbers right-aligned, blanks for missing values): each
    column exactly as wide as its values (up to 24 characters, longer ones fold, but never in
    the columns ``whole``: names) or its header's longest word, the header wrapped between
    words to it. ``columns``: the cells and widths already made of these rows (``_columns``)."""
    # Cells, headers and the title as Text: they hold the logs' own strings (users, purposes,
    # paths), which rich would otherwise read as markup ("[bold]") and emoji codes (":fire:").
    table = Table(title=None if title is None else Text(title), title_justify="left", show_lines=False, pad_edge=False,
                  header_style="bold", box=box.SIMPLE_HEAD, collapse_padding=True)
    cols = _columns(df if max_rows is None else df.head(max_rows), whole) if columns is None else columns
    for c, (cells, width) in cols.items():
        numeric = pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
        table.add_column(Text(label(str(c))), justify="right" if numeric else "left", overflow="fold", width=width)
    for rec in zip(*(cells for cells, _ in cols.values())):
        table.add_row(*map(Text, rec))
    if max_rows is not None and len(df) > max_rows:
        table.caption = f"{len(df) - max_rows:,} more rows; use --format csv for all"
    return table


def _percent(v: object) -> str:
    """A share (0-1) as a percentage, three significant digits: 0.488 -> "48.8%"."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return ""
    p = 100 * float(v)  # type: ignore[arg-type]
    return "0%" if p == 0 else f"{p:.3g}%"


def _is_share(c: object) -> bool:
    """A column of shares (0-1), which a terminal shows as percentages (CSV keeps the fractions)."""
    return str(c) == "share" or str(c).endswith("_share")


def _columns(rows: pd.DataFrame, whole: Sequence[str] = ()) -> dict[object, tuple[list[str], int]]:
    """Each column's cells and width (see :func:`rich_table`)."""
    out = {}
    for c in rows.columns:
        cells = [(_percent if _is_share(c) else _cell)(v) for v in rows[c].tolist()]
        width = max((len(x) for x in cells), default=0)
        width = width if c in whole else min(width, 24)
        out[c] = (cells, max([width, *(len(w) for w in label(str(c)).split())]))
    return out


def print_table(console: Console, df: pd.DataFrame, title: str | None = None, max_rows: int | None = None,
                caption: str | None = None, whole: Sequence[str] = ()) -> None:
    """Print ``df`` as :func:`rich_table` does, never wider than the console and never a value
    cut: the columns that fit, in order, and a caption naming the others (``--format csv``
    shows every column). A table wider than the console would lose its last columns at the
    edge, or rich would squeeze them into words broken over lines."""
    cols = _columns(df if max_rows is None else df.head(max_rows), whole)
    # A column takes its width and a space each side (what rich draws these tables with).
    ends = np.cumsum([w + 2 for _, w in cols.values()])
    n = max(1, int(np.searchsorted(ends, console.width, "right")))
    shown = df.iloc[:, :n]
    table = rich_table(shown, title=title, max_rows=max_rows, whole=whole, columns={c: cols[c] for c in shown.columns})
    hidden = [str(c) for c in df.columns[n:]]
    notes = [str(table.caption or ""), caption]
    if hidden:
        notes.append(f"{len(hidden)} more column{'s' if len(hidden) > 1 else ''} ({', '.join(hidden)}): --format csv shows all")
    table.caption = "; ".join(x for x in notes if x) or None
    console.print(table)


@contextmanager
def _opened(out: str | None, stdout: IO[str] | None, newline: str | None = "") -> Iterator[IO[str]]:
    """Where text goes: the file ``out`` (closed after), or stdout for None and ``-``."""
    if out is None or out == "-":
        yield stdout if stdout is not None else sys.stdout
    else:
        with open(out, "w", newline=newline) as f:
            yield f


def _chosen(fmt: str | None, out: str | None, stdout: IO[str] | None) -> Format:
    """:func:`choose_format` for a table written to ``out``, or to ``stdout`` (None: sys.stdout)."""
    return choose_format(fmt, out, out in (None, "-") and is_terminal(stdout if stdout is not None else sys.stdout))


def write(
    df: pd.DataFrame,
    fmt: str | None = None,
    out: str | None = None,
    *,
    title: str | None = None,
    stdout: IO[str] | None = None,
    table_columns: list[str] | None = None,
    raw_csv: bool = False,
) -> Format:
    """Write one table to ``out`` (a path, ``-`` or None = stdout) in the chosen format.

    ``table_columns`` narrows what a terminal table shows (every format else has all columns);
    ``raw_csv`` writes CSV text cells as they are (see :class:`CsvWriter`).
    """
    chosen = _chosen(fmt, out, stdout)
    if chosen == "parquet":
        df.to_parquet(sys.stdout.buffer if out in (None, "-") else out, index=False)  # type: ignore[arg-type]
        return chosen
    if chosen == "table":
        shown = df
        if table_columns is not None:
            shown = df[[c for c in table_columns if c in df.columns]]
        # A key that is the same on every row goes into the title instead of a column.
        for key in ("source", "session", "port"):
            if key in shown.columns and len(shown) and shown[key].nunique(dropna=False) == 1:
                title = f"{title} ({key} {shown[key].iloc[0]})" if title else f"{key} {shown[key].iloc[0]}"
                shown = shown.drop(columns=[key])
        hidden = len(df.columns) - len(shown.columns)
        with _opened(out, stdout, newline=None) as f:
            print_table(Console(file=f, soft_wrap=False), shown, title=title,
                        caption=f"{hidden} more columns: --format csv shows all" if hidden else None)
        return chosen
    text = for_text(df)
    with _opened(out, stdout) as buf:
        if chosen == "csv":
            CsvWriter(buf, raw=raw_csv).write(text)
        else:
            text.to_json(buf, orient="records", force_ascii=False)
            buf.write("\n")
    return chosen


def write_tables(tables: dict[str, pd.DataFrame], out: str | None = None, *, stdout: IO[str] | None = None) -> None:
    """Every table in one JSON object, ``{"NAME": [records], ...}`` in the order given: each
    value is what :func:`write` writes for that table as JSON."""
    with _opened(out, stdout) as buf:
        buf.write("{")
        for i, (name, df) in enumerate(tables.items()):
            buf.write(("," if i else "") + json.dumps(name, ensure_ascii=False) + ":")
            for_text(df).to_json(buf, orient="records", force_ascii=False)
        buf.write("}\n")


def write_batches(
    batches: Iterable[pd.DataFrame],
    fmt: str | None = None,
    out: str | None = None,
    *,
    title: str | None = None,
    stdout: IO[str] | None = None,
    table_columns: list[str] | None = None,
    raw_csv: bool = False,
) -> Format:
    """Write a table that comes in batches (same columns in each), as :func:`write` would
    write the batches joined: the same bytes for CSV and JSON, the same rows for Parquet.

    Only one batch is in memory at a time, except for a terminal table (shown whole).
    """
    chosen = _chosen(fmt, out, stdout)
    it = iter(batches)
    if chosen == "table":
        return write(pd.concat(list(it), ignore_index=True), chosen, out, title=title, stdout=stdout,
                     table_columns=table_columns, raw_csv=raw_csv)
    first = next(it, None)
    if first is None:
        raise ValueError("write_batches needs at least one batch (an empty one gives the header)")
    if chosen == "parquet":
        import pyarrow.parquet as pq

        target = sys.stdout.buffer if out in (None, "-") else out
        schema = pa.Schema.from_pandas(first, preserve_index=False)
        with pq.ParquetWriter(target, schema) as writer:  # type: ignore[arg-type]
            for df in itertools.chain([first], it):
                writer.write_table(pa.Table.from_pandas(df, schema=schema, preserve_index=False))
        return chosen
    # CSV, JSON: the batches' text pieces, joined as write_pieces joins them.
    pieces = (text_piece(df, i, chosen, raw_csv=raw_csv) for i, df in enumerate(itertools.chain([first], it)))
    write_pieces(pieces, chosen, out, stdout=stdout)
    return chosen


def text_piece(df: pd.DataFrame, i: int, fmt: Format, *, raw_csv: bool = False) -> str:
    """Batch ``i`` of a table as CSV or JSON text, to be joined by :func:`write_pieces`
    (CSV: the header comes with batch 0; JSON: the records without the array's brackets)."""
    if fmt == "csv":
        buf = io.StringIO()
        CsvWriter(buf, header=i == 0, raw=raw_csv).write(for_text(df))
        return buf.getvalue()
    if fmt == "json":
        return for_text(df).to_json(orient="records", force_ascii=False)[1:-1] if len(df) else ""
    raise ValueError(f"no text pieces for {fmt}")


def write_pieces(pieces: Iterable[str], fmt: Format, out: str | None = None, *, stdout: IO[str] | None = None) -> None:
    """Join :func:`text_piece` texts into what :func:`write` writes for the whole table."""
    with _opened(out, stdout) as buf:
        if fmt == "json":
            buf.write("[")
            sep = ""
            for p in pieces:
                if p:
                    buf.write(sep + p)
                    sep = ","
            buf.write("]\n")
        else:
            for p in pieces:
                buf.write(p)


def render_text(df: pd.DataFrame, fmt: Format, *, raw_csv: bool = False) -> str:
    """The table as a string in a text format (for tests and fixtures/golden)."""
    if fmt == "csv":
        return text_piece(df, 0, fmt, raw_csv=raw_csv)
    buf = io.StringIO()
    if fmt == "json":
        for_text(df).to_json(buf, orient="records", force_ascii=False)
    else:
        print_table(Console(file=buf, width=100, soft_wrap=False), df)
    return buf.getvalue()
