"""The column-wise CSV writer writes the bytes of pandas' ``to_csv(index=False)``, but for a
field holding a bare CR (quoted) and text a spreadsheet would run as a formula (a leading "'")."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotscope import output
from slotscope.output import CsvWriter, for_text, render_text
from slotscope.server_log import read_server_logs

from .conftest import REAL, SCENARIOS

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ours(df: pd.DataFrame, *batches: pd.DataFrame, raw: bool = True) -> str:
    buf = io.StringIO()
    writer = CsvWriter(buf, raw=raw)
    for b in batches or (df,):
        writer.write(b)
    return buf.getvalue()


def _text_cells(df: pd.DataFrame) -> list[str]:
    return [v for _, col in df.items() for v in col.astype(object) if isinstance(v, str)] + [str(c) for c in df.columns]


def pandas_csv(df: pd.DataFrame) -> str:
    """pandas' bytes, where a field holding a CR is quoted as one holding a line feed is.

    The csv module quotes a field holding a character of the line terminator: with CR in the
    terminator, each row's bytes are pandas' but for that quoting, and the terminator is cut off.
    """
    if not any("\r" in v for v in _text_cells(df)):
        return df.to_csv(index=False)
    eol = os.linesep + "\r"
    rows = [df.iloc[:0].to_csv(index=False, lineterminator=eol)]
    rows += [df.iloc[k:k + 1].to_csv(index=False, header=False, lineterminator=eol) for k in range(len(df))]
    return "".join(r[: -len(eol)] + os.linesep for r in rows)


def _is_plain_number(v: str) -> bool:
    if not v or not set(v) <= set("0123456789+-.eE"):
        return False
    try:
        float(v)
    except ValueError:
        return False
    return True


def _guard(v: object) -> object:
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r") and not _is_plain_number(v):
        return "'" + v
    return v


def guarded(df: pd.DataFrame) -> pd.DataFrame:
    """What a spreadsheet should be given: text cells that start like a formula behind a "'"."""
    out = df.copy()
    for k, (_, col) in enumerate(df.items()):
        if isinstance(col.dtype, pd.CategoricalDtype) and not (
                col.dtype.categories.dtype == object or isinstance(col.dtype.categories.dtype, pd.StringDtype)):
            continue  # numbers, times: never guarded
        if col.dtype == object or isinstance(col.dtype, (pd.StringDtype, pd.CategoricalDtype)):
            out.isetitem(k, pd.Series([_guard(v) for v in col.astype(object)], index=col.index, dtype=object))
    return out


# --- values -----------------------------------------------------------------------------------

SPECIAL_FLOATS = [
    0.0, -0.0, 1.0, -1.0, 2.0, 0.1, 0.1 + 0.2, 1 / 3, 1e-4, 9.999999999999999e-05, 1e-5, 1.5e-5, 1e-6, 9.99e-7,
    1e-7, 1e-9, 1e-10, 5e-324, 2.2250738585072014e-308, 1e10, 9999999999.5, 1e15, 1e15 + 0.25, 1e16, 1.5e16,
    9999999999999998.0, 1e21, 1e22, 1e23, 1.7976931348623157e308, float(2**53), float(2**53 + 2),
    float(2**53 - 1), 4503599627370495.5, 123456789012.0625, 9000000000.0078125, 1.2345678901234567e-5,
    float("inf"), float("-inf"), float("nan"),
]

near_power_of_ten = st.builds(
    lambda e, up, neg: (-1 if neg else 1) * float(np.nextafter(10.0**e, np.inf if up else 0.0)),
    st.integers(-12, 22), st.booleans(), st.booleans())
decimal_floats = st.builds(lambda k, d: k / 10**d, st.integers(-(10**17), 10**17), st.integers(0, 12))
# At most six decimals (every time, ms field and rate of the task table): laid out from their digits.
six_decimals = st.builds(lambda k, d: k / 10**d, st.integers(-(10**15), 10**15), st.integers(0, 6))
near_2_53 = st.integers(-60, 60).map(lambda i: float(2**53 + i)) | st.integers(-60, 60).map(lambda i: -float(2**53 + 2 * i))
floats = st.one_of(
    st.floats(), st.floats(width=32), st.sampled_from(SPECIAL_FLOATS), near_power_of_ten, decimal_floats, near_2_53,
    st.floats(min_value=-1e-3, max_value=1e-3), st.floats(min_value=-1e17, max_value=1e17),
)
# Everything the csv module quotes (comma, quote, newline) and what it does not (\r, NUL, unicode).
text = st.text(alphabet=st.sampled_from(list(',"\n\r\t ab\x00é€😀=+-@1.e')) | st.characters(exclude_categories=("Cs",)), max_size=8)
big_ints = st.integers(-(2**63), 2**63 - 1)
ints = st.one_of(st.integers(-1000, 1000), big_ints, st.integers(2**53 - 5, 2**53 + 5))


def column(kind: str, n: int) -> st.SearchStrategy[pd.Series]:
    """A column of ``n`` values of one dtype, missing values included where the dtype has them."""
    if kind == "float64":
        return st.lists(floats, min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype="float64"))
    if kind == "Float64":
        return st.lists(st.none() | floats, min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype="Float64"))
    if kind == "int64":
        return st.lists(ints, min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype="int64"))
    if kind in ("int8", "uint64"):
        info = np.iinfo(kind)
        return st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype=kind))
    if kind in ("Int64", "UInt8"):
        lo, hi = (-(2**63), 2**63 - 1) if kind == "Int64" else (0, 255)
        return st.lists(st.none() | st.integers(lo, hi), min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype=kind))
    if kind == "bool":
        return st.lists(st.booleans(), min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype="bool"))
    if kind == "boolean":
        return st.lists(st.none() | st.booleans(), min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype="boolean"))
    if kind in ("str", "string[python]", "string[pyarrow]"):
        return st.lists(st.none() | text, min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype=kind))
    if kind == "object":
        return st.lists(st.none() | st.just(np.nan) | text, min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype=object))
    if kind == "category":
        return st.lists(st.none() | st.sampled_from(["a", "b,c", 'q"uote', "line\nbreak", "", "/path/to/llama-server.log"]),
                        min_size=n, max_size=n).map(lambda v: pd.Series(v, dtype="category"))
    if kind == "category-one":
        return st.just(pd.Series(["/x/llama-server.log"] * n, dtype="category"))
    if kind == "category-num":
        return st.lists(st.none() | floats.filter(lambda f: not np.isnan(f)) | ints.map(float), min_size=n, max_size=n).map(
            lambda v: pd.Series(v, dtype="category"))
    if kind == "category-int":
        return st.lists(st.none() | ints, min_size=n, max_size=n).map(
            lambda v: pd.Series(pd.Categorical([x for x in v], categories=sorted({x for x in v if x is not None}))))
    raise AssertionError(kind)


KINDS = ["float64", "Float64", "int64", "int8", "uint64", "Int64", "UInt8", "bool", "boolean", "str", "string[python]",
         "string[pyarrow]", "object", "category", "category-one", "category-num", "category-int"]


@st.composite
def frames(draw: st.DrawFn, kinds: list[str] = KINDS, max_rows: int = 12, max_cols: int = 5) -> pd.DataFrame:
    n = draw(st.integers(0, max_rows))
    picked = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=max_cols))
    names = draw(st.lists(st.one_of(st.sampled_from(["a", "b", "total_ms"]), text), min_size=len(picked), max_size=len(picked)))
    cols = {f"{name}#{i}" if draw(st.booleans()) else name: draw(column(kind, n)) for i, (name, kind) in enumerate(zip(names, picked))}
    return pd.DataFrame(cols)


# --- properties -------------------------------------------------------------------------------


@SETTINGS
@given(frames())
def test_same_bytes_as_pandas(df: pd.DataFrame) -> None:
    assert ours(df) == pandas_csv(df)


@SETTINGS
@given(frames())
def test_text_that_starts_like_a_formula_is_guarded(df: pd.DataFrame) -> None:
    assert ours(df, raw=False) == pandas_csv(guarded(df))


@SETTINGS
@given(frames())
def test_a_reader_gets_one_record_per_row(df: pd.DataFrame) -> None:
    """A CR inside a field is quoted: a reader (which ends a record at CR too) splits no row."""
    records = list(csv.reader(io.StringIO(ours(df, raw=False), newline="")))
    assert len(records) == 1 + len(df) or (df.shape[1] == 0 and records == [[""]])
    if df.shape[1]:
        assert {len(r) for r in records} == {df.shape[1]}


@SETTINGS
@given(st.lists(floats, max_size=40))
def test_floats_one_column(values: list[float]) -> None:
    # One column: a missing value is the lone empty field that the csv module writes as "".
    df = pd.DataFrame({"x": np.array(values, dtype=np.float64)})
    assert ours(df) == pandas_csv(df)


@SETTINGS
@given(st.lists(floats, min_size=1, max_size=40))
def test_floats_several_columns(values: list[float]) -> None:
    df = pd.DataFrame({"x": np.array(values, dtype=np.float64), "y": np.array(values[::-1], dtype=np.float64)})
    assert ours(df) == pandas_csv(df)


@SETTINGS
@given(st.sampled_from(KINDS).flatmap(lambda k: st.integers(0, 6).flatmap(lambda n: column(k, n))))
def test_one_column_frames(col: pd.Series) -> None:
    df = col.to_frame("only")
    assert ours(df) == pandas_csv(df)


@SETTINGS
@given(frames(max_rows=20), st.data())
def test_any_split_into_batches_gives_the_same_bytes(df: pd.DataFrame, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(df)), max_size=4)))
    bounds = [0, *cuts, len(df)]
    batches = [df.iloc[a:b] for a, b in zip(bounds, bounds[1:])]
    assert ours(df, *batches) == pandas_csv(df)


def test_float_formatting_matches_numpy_on_many_values() -> None:
    """pandas formats float64 with numpy's str(): check the fix-ups on ~10^6 values at once."""
    rng = np.random.default_rng(6)
    bits = rng.integers(0, 2**64, size=300_000, dtype=np.uint64).view(np.float64)
    scales = 10.0 ** rng.integers(-12, 20, size=300_000)
    places = 10.0 ** rng.integers(0, 10, size=300_000)
    decimals = np.round(rng.standard_normal(300_000) * scales * places) / places
    powers = 10.0 ** np.arange(-325, 309)
    edges = np.concatenate([powers, np.nextafter(powers, 0.0), np.nextafter(powers, np.inf)])
    ties = np.concatenate([(2.0**52 / 2**s) + rng.integers(0, 2**40, size=2000) / 2**s for s in range(1, 12)])
    x = np.concatenate([bits, decimals, scales, -scales, np.trunc(scales * rng.random(300_000)), edges, -edges, ties, SPECIAL_FLOATS])
    got = output._float_text(x, None).to_pylist()
    want = np.where(np.isnan(x), "", x.astype(str)).tolist()
    bad = [(v, g, w) for v, g, w in zip(x.tolist(), got, want) if g != w]
    assert not bad[:10]


SIX_DECIMALS = [
    0.0, -0.0, 1.0, -7.0, 0.5, -0.5, 12.01, 12.1, 12.0001, 0.000123, 1e-4, -1e-4, 3.14159, 123.456, 10000.0,
    100000000.0, 999999999.0, 999999999.999999, -999999999.999999, 456718.986273, 0.083, 2991.62, 4.743761,
    1234.5, 100.05, 10.000001, 99999.99999,
]
NOT_SIX_DECIMALS = [  # written by _any_float_text: too small or big, too many decimals, not finite
    9.999999999999999e-05, 5e-05, 1e-06, 1e-7, 1e9, 1e9 + 0.5, 1234567890.0, 1e16, 1.5e16, 1e22, 0.1 + 0.2,
    1 / 3, 1.0000001, 12.3456789, 5e-324, float("inf"), float("-inf"),
]


def _no_general_path(x: np.ndarray) -> None:
    raise AssertionError(f"values with at most six decimals went to _any_float_text: {x[:5]}")


@pytest.mark.parametrize("values", [
    SIX_DECIMALS,  # a chunk with nothing else
    SIX_DECIMALS + [np.nan] * 3,  # ... and missing values
    [np.nan] * 4,  # all missing
    [-v for v in SIX_DECIMALS],  # negative (and -0.0 -> 0.0)
    list(np.round(np.random.default_rng(3).random(5000) * 2e5, 6)) + [np.nan],  # like launch_s
    list(np.round(np.random.default_rng(4).standard_normal(5000) * 1e3, 3)),  # like wait_before_prefill_ms
], ids=["short", "short-nan", "all-nan", "negative", "seconds", "ms"])
def test_six_decimal_floats_skip_the_float_cast(values: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.array(values, dtype=np.float64)
    want = pandas_csv(pd.DataFrame({"x": x, "y": x[::-1]}))
    monkeypatch.setattr(output, "_any_float_text", _no_general_path)
    assert output._float_text(x, None).to_pylist() == np.where(np.isnan(x), "", x.astype(str)).tolist()
    assert ours(pd.DataFrame({"x": x, "y": x[::-1]})) == want


@pytest.mark.parametrize("order", ["mixed", "sorted"])
def test_six_decimal_and_other_floats_in_one_chunk(order: str) -> None:
    x = np.array(SIX_DECIMALS + NOT_SIX_DECIMALS + [np.nan] + [-v for v in NOT_SIX_DECIMALS], dtype=np.float64)
    if order == "mixed":
        x = np.random.default_rng(5).permutation(x)
    assert output._float_text(x, None).to_pylist() == np.where(np.isnan(x), "", x.astype(str)).tolist()
    df = pd.DataFrame({"x": x, "masked": pd.array(x, dtype="Float64"), "s": "a"})
    df.loc[::3, "masked"] = pd.NA
    assert ours(df) == pandas_csv(df)


def test_masked_floats_with_six_decimals() -> None:
    # A missing Float64 value's slot holds 0.0: it is "", not "0.0".
    col = pd.array([1.5, None, 0.0, None, -2.25, 1e-5], dtype="Float64")
    df = pd.DataFrame({"f": col, "i": [1, 2, 3, 4, 5, 6]})
    assert ours(df) == pandas_csv(df)
    assert ours(df) == "f,i\n1.5,1\n,2\n0.0,3\n,4\n-2.25,5\n1e-05,6\n".replace("\n", os.linesep)


def test_empty_frames() -> None:
    for df in (pd.DataFrame({"a": pd.Series([], dtype="float64"), "b,c": pd.Series([], dtype="Int64")}),
               pd.DataFrame({"": pd.Series([], dtype="str")}), pd.DataFrame(), pd.DataFrame(index=[0, 1])):
        assert ours(df) == pandas_csv(df)


def test_duplicate_names_and_all_missing_columns() -> None:
    df = pd.DataFrame([[1, 2.5, None, np.nan], [3, np.nan, None, np.nan]], columns=["a", "a", "none", "nan"])
    df["none"] = df["none"].astype(object)
    assert ours(df) == pandas_csv(df)
    assert ours(df[["none"]]) == pandas_csv(df[["none"]])


def test_header_comes_with_the_first_batch_even_an_empty_one() -> None:
    df = pd.DataFrame({"a": [1.5, np.nan], 'say "hi"': ["x,y", None]})
    assert ours(df, df.iloc[:0], df.iloc[:1], df.iloc[:0], df.iloc[1:]) == pandas_csv(df)
    buf = io.StringIO()
    CsvWriter(buf, header=False).write(df)
    assert buf.getvalue() == df.to_csv(index=False, header=False)


def test_batches_must_have_the_same_columns() -> None:
    writer = CsvWriter(io.StringIO())
    writer.write(pd.DataFrame({"a": [1]}))
    with pytest.raises(ValueError):
        writer.write(pd.DataFrame({"b": [1]}))


def test_rows_are_written_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "_CHUNK_CELLS", 7)
    df = pd.DataFrame({"x": np.arange(50) / 7, "s": pd.Series(["a,b", None] * 25, dtype="str"), "i": pd.array([1, None] * 25, dtype="Int64")})
    assert ours(df) == pandas_csv(df)


@pytest.mark.parametrize("df", [
    pd.DataFrame({"t": pd.to_datetime(["2024-01-01T00:00:00.5Z", None], utc=True, format="ISO8601"), "x": [1.0, 2.0]}),
    pd.DataFrame({"mixed": [1, "a", 2.5, None, b"b"], "x": range(5)}),
    pd.DataFrame({"f32": np.array([0.1, np.nan, 3], dtype=np.float32)}),
    pd.DataFrame({"td": pd.to_timedelta([1, 2], unit="s")}),
    pd.DataFrame(np.arange(4).reshape(2, 2), columns=pd.MultiIndex.from_tuples([("a", "b"), ("a", "c")])),
    pd.DataFrame({1: [1.5], 2.5: ["x"]}),
    pd.DataFrame({"surrogate": pd.Series(["ok", "bad\udc80"], dtype=object), "x": [1, 2]}),
    pd.DataFrame({"cat_dt": pd.Series(pd.to_datetime(["2024-01-01", None]), dtype="category")}),
    pd.DataFrame({"mixed": [-5, "=1+1", "a\rb", "-5", None], "cat": pd.Series(["@x", "y", "@x", "-", None], dtype="category")}),
], ids=["datetime", "mixed-object", "float32", "timedelta", "multiindex-columns", "non-str-labels", "surrogate", "datetime-category",
        "mixed-formulas-and-cr"])
def test_what_it_does_not_format_goes_to_pandas(df: pd.DataFrame) -> None:
    assert ours(df) == pandas_csv(df)
    assert ours(df, raw=False) == pandas_csv(guarded(df))


def test_formula_cells_and_bare_cr_exactly() -> None:
    """What a user pastes into a spreadsheet: text behind a "'", numbers (and text that is a plain
    number) as they are, a CR quoted."""
    df = pd.DataFrame({
        "purpose": ["=HYPERLINK(\"x\")", "+1+2", "-2+3", "@SUM(A1)", "\tx", "chat", "-5", "+1.5e3", "a\rb", None],
        "n": [-1, 2, -3, 4, 5, 6, 7, 8, 9, 10],
        "f": [-1.5, 0.5, np.nan, 1, 2, 3, 4, 5, 6, 7],
        "cat": pd.Series(["-x", "ok"] * 5, dtype="category"),
    })
    eol = os.linesep
    assert ours(df, raw=False).split(eol) == [
        "purpose,n,f,cat",
        "\"'=HYPERLINK(\"\"x\"\")\",-1,-1.5,'-x",
        "'+1+2,2,0.5,ok",
        "'-2+3,-3,,'-x",
        "'@SUM(A1),4,1.0,ok",
        "'\tx,5,2.0,'-x",
        "chat,6,3.0,ok",
        "-5,7,4.0,'-x",
        "+1.5e3,8,5.0,ok",
        '"a\rb",9,6.0,\'-x',
        ",10,7.0,ok",
        "",
    ]
    raw = ours(df, raw=True)
    assert raw.startswith("purpose,n,f,cat" + eol + '"=HYPERLINK(""x"")",-1,-1.5,-x' + eol) and '"a\rb"' in raw


# --- ISO datetimes (for_text) ------------------------------------------------------------------


def iso_reference(col: pd.Series) -> pd.Series:
    """``output.iso`` for UTC as it was before the fast path (strftime)."""
    text = col.dt.strftime("%Y-%m-%dT%H:%M:%S.%f").str.replace(r"\.000000$", "", regex=True) + "+00:00"
    return text.where(col.notna(), "")


@SETTINGS
@given(st.lists(st.none() | st.integers(-(10**16), 10**17), max_size=30), st.sampled_from(["s", "ms", "us", "ns"]))
def test_iso_matches_strftime(micros: list[int | None], unit: str) -> None:
    if unit == "ns":  # nanosecond times end in 2262
        micros = [None if m is None else m % (9 * 10**15) for m in micros]
    col = _utc_micros(micros).astype(f"datetime64[{unit}, UTC]")
    col.index = col.index * 3
    pd.testing.assert_series_equal(output.iso(col), iso_reference(col))


@SETTINGS
@given(st.lists(st.none() | st.integers(-(10**18), 9 * 10**18), max_size=10))
def test_iso_of_nanosecond_times(nanos: list[int | None]) -> None:
    col = pd.Series(pd.to_datetime(nanos, unit="ns", utc=True))
    pd.testing.assert_series_equal(output.iso(col), iso_reference(col))


def _utc_micros(micros: list[int | None]) -> pd.Series:
    """µs since the epoch as a UTC column of µs resolution, NaT for None (pd.to_datetime would
    go through nanoseconds on pandas 2.2, which end in 2262)."""
    values = np.array([np.datetime64("NaT") if m is None else np.datetime64(m, "us") for m in micros], dtype="datetime64[us]")
    return pd.Series(values).dt.tz_localize("UTC")


def test_iso_on_whole_seconds_and_far_years() -> None:
    col = pd.Series(np.array(["2024-01-01T00:00:00", "0999-12-31T23:59:59.25", "2024-01-01T00:00:00.000001"],
                             dtype="datetime64[us]")).dt.tz_localize("UTC")
    pd.testing.assert_series_equal(output.iso(col), iso_reference(col))
    pd.testing.assert_series_equal(output.iso(col[[0, 2]]), iso_reference(col[[0, 2]]))


# --- the real tables ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=SCENARIOS)
def real_logs(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return read_server_logs([str(REAL / request.param / "logs" / "llama-server.log")])


@pytest.mark.parametrize("table", ["tasks", "gen_samples", "prefill_samples"])
def test_real_tables(real_logs, table: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    df = getattr(real_logs, table)
    assert len(df)
    reference = df.assign(**{c: iso_reference(df[c]) for c in df.columns if isinstance(df[c].dtype, pd.DatetimeTZDtype)})
    want = pandas_csv(reference)
    assert pandas_csv(for_text(df)) == want
    assert render_text(df, "csv") == want
    # Any split into batches, and through output.write to a file as the CLI does.
    third = len(df) // 3
    assert ours(df, for_text(df.iloc[:third]), for_text(df.iloc[third:2 * third]), for_text(df.iloc[2 * third:])) == want
    output.write(df, "csv", str(tmp_path / "t.csv"))
    assert (tmp_path / "t.csv").read_bytes() == want.encode()


def test_real_task_tables_use_the_fast_path(real_logs) -> None:  # type: ignore[no-untyped-def]
    """No column of slotscope's own tables falls back to pandas."""
    df = for_text(real_logs.tasks)
    assert all(output._column_formatter(df.iloc[:, k]) is not None for k in range(df.shape[1])), df.dtypes


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_batches_write_what_the_whole_table_writes(tmp_path, fmt: str) -> None:
    """`slotscope tasks` writes its table in batches: the same file as writing it whole."""
    from slotscope.server_log import read_server_logs

    paths = [str(REAL / "wallclock" / "logs"), str(REAL / "restart" / "logs")]
    whole = read_server_logs(paths, keep_samples=False).tasks
    assert "launch_at" in whole.columns and len(whole) > 50
    output.write(whole, fmt, str(tmp_path / f"whole.{fmt}"))
    parts = [whole.iloc[i : i + 17] for i in range(0, len(whole), 17)]
    output.write_batches(iter(parts), fmt, str(tmp_path / f"parts.{fmt}"))
    if fmt == "parquet":
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "parts.parquet"), pd.read_parquet(tmp_path / "whole.parquet"))
    else:
        assert (tmp_path / f"parts.{fmt}").read_bytes() == (tmp_path / f"whole.{fmt}").read_bytes()
    output.write_batches(iter([whole.iloc[:0]]), fmt, str(tmp_path / f"empty.{fmt}"))
    output.write(whole.iloc[:0], fmt, str(tmp_path / f"empty_whole.{fmt}"))
    if fmt != "parquet":
        assert (tmp_path / f"empty.{fmt}").read_bytes() == (tmp_path / f"empty_whole.{fmt}").read_bytes()


# --- the CLI -----------------------------------------------------------------------------------


def _app_log_with_formulas(tmp_path: Path) -> Path:
    """The real `before` logs, three of the app's calls given text a spreadsheet would run."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "llama-server.log").write_bytes((REAL / "before" / "logs" / "llama-server.log").read_bytes())
    lines = (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines(keepends=True)
    assert lines[0].startswith('{"id":"c-00001",') and '"purpose":"chat","user":"u02"' in lines[0]
    lines[0] = lines[0].replace('"purpose":"chat","user":"u02"', '"purpose":"=HYPERLINK(\\"http://x\\")","user":"-u02"')
    lines[1] = lines[1].replace('"purpose":"chat"', '"purpose":"night\\rshift"')
    (logs / "app.jsonl").write_text("".join(lines))
    return logs


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text, newline="")))


def test_cli_guards_formula_text_and_quotes_a_bare_cr(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from slotscope.cli import app

    logs = _app_log_with_formulas(tmp_path)
    runner = CliRunner()
    for args in (["calls", str(logs / "app.jsonl")], ["match", str(logs)]):
        safe = runner.invoke(app, [*args, "-f", "csv", "-q"])
        raw = runner.invoke(app, [*args, "-f", "csv", "-q", "--raw-csv"])
        assert safe.exit_code == 0 and raw.exit_code == 0, safe.output + raw.output
        for res, prefix in ((safe, "'"), (raw, "")):
            header, *rows = _rows(res.stdout)
            assert len(rows) == 45  # the CR splits no record
            by_id = {r[0]: dict(zip(header, r)) for r in rows}
            assert by_id["c-00001"]["purpose"] == prefix + '=HYPERLINK("http://x")'
            assert by_id["c-00001"]["user"] == prefix + "-u02"
            assert by_id["c-00004"]["purpose"] == "night\rshift"
            assert by_id["c-00001"]["prompt_tokens"] == "2281"
        assert '"night\rshift"' in safe.stdout
    res = runner.invoke(app, ["match", str(logs), "-f", "csv", "-q"])
    assert ",-1," in res.stdout  # a number column (port) is never guarded


def test_cli_help_names_raw_csv() -> None:
    from typer.testing import CliRunner

    from slotscope.cli import app

    for cmd in ("tasks", "samples", "calls", "match", "analyze", "compare"):
        res = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert res.exit_code == 0 and "--raw-csv" in res.stdout, cmd
