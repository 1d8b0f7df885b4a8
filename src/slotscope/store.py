"""Tables kept on disk while the report is computed, read back a few columns at a time.

At 1 GB of log the task table, the calls and the task view hold ~300 MB between them, and
each report table reads a handful of their ~40 columns. :class:`StoredTable` writes a table
once to an Arrow IPC file in ``$TMPDIR`` (a slice of rows at a time, so the write never
holds a second copy of it) and reads back just the columns asked for, with the dtypes the
table had (categories with their categories, nullable integers, wall times with their zone).

(A gap in a column of Python objects comes back as Arrow gives it, None. The tables slotscope
stores have one such column, a task's status, under pandas < 3, and it has no gaps.)

A dataclass field declared as :class:`StoredField` holds a DataFrame or a StoredTable:
reading the field gives a DataFrame (built from disk on first read and kept until
:func:`unload`), and :func:`columns_of` gives some of its columns without building it.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from .errors import SlotscopeError
from .tasks import release_memory

ROWS_PER_BATCH = 1 << 16  # rows converted to Arrow at a time while writing


class StoredTable:
    """One DataFrame (with the default index 0..n-1) in an Arrow IPC file of its own."""

    def __init__(self, df: pd.DataFrame, what: str = "table") -> None:
        # The types from the whole table: a slice's own could differ (a text column of Python
        # objects that is empty in the first slice would be typed null there).
        self._write(iter([df]), what, df.dtypes, pa.Schema.from_pandas(df, preserve_index=False))

    @classmethod
    def of_parts(cls, parts: Iterable[pd.DataFrame], what: str = "table") -> StoredTable:
        """The table the ``parts`` make joined (as ``pd.concat(parts, ignore_index=True)``),
        written as they come: it is never whole in memory. Every part has the columns and
        dtypes of the first (categories included); there is at least one (it may be empty).
        The Arrow types are the first part's: a column of Python objects all missing there
        must be so in every part (it is stored untyped)."""
        it = iter(parts)
        first = next(it)
        schema = pa.Schema.from_pandas(first, preserve_index=False)
        table = cls.__new__(cls)
        table._write(itertools.chain([first], it), what, first.dtypes, schema)
        return table

    def _write(self, parts: Iterator[pd.DataFrame], what: str, dtypes: pd.Series, schema: pa.Schema) -> None:
        self.dtypes = dtypes
        self.columns = list(dtypes.index)
        self.n = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="slotscope-")
        self.path = os.path.join(self._tmp.name, what)
        self._built: pd.DataFrame | None = None
        try:
            with pa.OSFile(self.path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for df in parts:
                    if not df.dtypes.equals(dtypes):
                        raise ValueError(f"{what}: a part's columns or dtypes differ from the first part's")
                    for a in range(0, len(df), ROWS_PER_BATCH):
                        writer.write_table(pa.Table.from_pandas(df.iloc[a:a + ROWS_PER_BATCH], preserve_index=False, schema=schema))
                    self.n += len(df)
                    del df
                    if self.n >= ROWS_PER_BATCH:
                        # Between parts: what the part freed, before the next is built (each
                        # part's buffers otherwise stayed held: at 1 GB of log the task view's
                        # nine parts grew RSS by ~110 MB).
                        release_memory()
        except OSError as e:  # a full or read-only temporary directory
            self._tmp.cleanup()
            raise SlotscopeError(getattr(e, "filename", None) or tempfile.gettempdir(), None,
                                 f"cannot write the {what} to the temporary directory ({e.strerror or e}); "
                                 "set TMPDIR to a directory with room") from None
        except BaseException:  # (e.g. an error in the input the parts are made from)
            self._tmp.cleanup()
            raise

    def __len__(self) -> int:
        return self.n

    def read(self, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """These columns (all: None) of every row, in the table's column order, as they were."""
        names = self.columns if columns is None else [c for c in self.columns if c in set(columns)]
        if self._built is not None:
            return self._built[names].copy(deep=False)
        return pd.DataFrame({c: self._column(c) for c in names}, index=pd.RangeIndex(self.n), copy=False)

    def take(self, rows: np.ndarray) -> pd.DataFrame:
        """Every column at these row positions (a column read at a time)."""
        index = pd.RangeIndex(len(rows))
        return pd.DataFrame({c: self._column(c).take(rows).set_axis(index) for c in self.columns}, index=index, copy=False)

    def batches(self) -> Iterator[pd.DataFrame]:
        """Every column, a stored batch of rows at a time (their index: the rows' positions),
        as they were; joined, :meth:`read`'s table."""
        with pa.OSFile(self.path) as source:  # (read, not mapped: a map's pages would add up in RSS)
            reader = pa.ipc.open_file(source)
            at = 0
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                df = pa.Table.from_batches([batch]).to_pandas()
                del batch
                for c in self.columns:
                    if df[c].dtype != self.dtypes[c]:
                        df[c] = df[c].astype(self.dtypes[c])
                df.index = pd.RangeIndex(at, at + len(df))
                at += len(df)
                yield df

    def _column(self, name: str) -> pd.Series:
        """One column, as it was. Read a column at a time from the mapped file, unmapped after
        each: only that column's pages are touched, and its Arrow and pandas copies are the
        only two held (a table read whole held both of every column: 2x the table)."""
        with pa.memory_map(self.path) as source:
            table = pa.ipc.open_file(source).read_all().select([name])
            col = table.to_pandas()[name]  # (copied out of the mapped file: a writable array)
            del table
        if col.dtype != self.dtypes[name]:  # what Arrow does not keep as pandas had it (e.g. the type of categories)
            col = col.astype(self.dtypes[name])
        return col

    def table(self) -> pd.DataFrame:
        """The whole table, built once and kept until :meth:`unload`."""
        if self._built is None:
            self._built = self.read()
        return self._built

    def unload(self) -> None:
        self._built = None

    def __reduce__(self) -> tuple:
        return table_itself, (self.table(),)  # pickled as its table: the file is this process'


def table_itself(df: pd.DataFrame) -> pd.DataFrame:
    """(What a table kept on disk unpickles to: its table, in memory.)"""
    return df


class StoredField:
    """A dataclass field holding a DataFrame (or None), or what builds one when the field is
    read (its ``table()``: a :class:`StoredTable`, or the samples of
    :class:`slotscope.server_log.Samples`); read, it is a DataFrame."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = "_" + name

    def __get__(self, obj: object, owner: type | None = None) -> pd.DataFrame:
        if obj is None:
            raise AttributeError(self.key)  # (for dataclasses: the field has no default)
        v = obj.__dict__[self.key] if self.key in obj.__dict__ else obj.__dict__[self.key[1:]]  # (pickled before it was one)
        return v if v is None or isinstance(v, pd.DataFrame) else v.table()

    def __set__(self, obj: object, value: Any) -> None:
        obj.__dict__[self.key] = value


def raw(obj: object, name: str) -> "pd.DataFrame | StoredTable | Any":
    """What field ``name`` of ``obj`` holds, without building a stored table."""
    d = obj.__dict__
    return d["_" + name] if "_" + name in d else d.get(name, getattr(obj, name))


def stored(obj: object, name: str) -> StoredTable | None:
    v = raw(obj, name)
    return v if isinstance(v, StoredTable) else None


def keep_on_disk(obj: object, name: str, what: str) -> None:
    """Move field ``name`` of ``obj`` (a DataFrame) to disk."""
    v = raw(obj, name)
    if isinstance(v, pd.DataFrame):
        object.__setattr__(obj, name, StoredTable(v.reset_index(drop=True), what))  # (frozen ones too)


def columns_of(obj: object, name: str, columns: Sequence[str]) -> pd.DataFrame:
    """Those of ``columns`` that field ``name`` of ``obj`` has (in its order), without reading
    the others from disk."""
    v = raw(obj, name)
    if isinstance(v, StoredTable):
        return v.read(columns)
    return v[[c for c in v.columns if c in set(columns)]]


def unload(obj: object, name: str) -> None:
    """Free the table built from disk for field ``name`` (built again when read)."""
    v = raw(obj, name)
    if isinstance(v, StoredTable):
        v.unload()
