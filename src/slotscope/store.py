"""Everything slotscope keeps on disk while it works, in ``$TMPDIR``, as Arrow IPC files.

The task table, the calls and the task view are far bigger than what any report table reads
of them (a handful of their ~40 columns). :class:`StoredTable` keeps a table an IPC file per
column and reads back just the columns (or rows) asked for, with the dtypes the table had
(categories with their categories, nullable integers, wall times with their zone). A table
is written whole, a part of its rows at a time (:meth:`StoredTable.of_parts`: the tasks as
they are finished) or a column at a time (:class:`ColumnWriter`: the calls as they are
read): the last two never hold it whole. :class:`Chunks` holds the parse's finished sample
rows; :class:`Buckets`, the busy periods' rows (:mod:`slotscope.periods`); :class:`Spool`,
what a pass over them answered. :func:`release_memory` hands back what a stage freed.

(A gap in a column of Python objects comes back as Arrow gives it, None. The tables slotscope
stores have one such column, a task's status, under pandas < 3, and it has no gaps.)

A dataclass field declared as :class:`StoredField` holds a DataFrame or a StoredTable:
reading the field gives a DataFrame (built from disk on first read and kept until
:func:`unload`), and :func:`columns_of` gives some of its columns without building it.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import weakref
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa


def _returning_pool() -> None:
    """Arrow's buffers from jemalloc, set to hand freed pages back at once. Arrow's default
    pools keep freed pages for reuse, per thread: what the storage moved between pandas and
    disk would stay resident. A pool the user chose (``ARROW_DEFAULT_MEMORY_POOL``) stays."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    try:
        pa.set_memory_pool(pa.jemalloc_memory_pool())
        pa.jemalloc_set_decay_ms(0)
    except NotImplementedError:  # (a pyarrow built without jemalloc: its default pool)
        pass


_returning_pool()

from .errors import SlotscopeError

ROWS_PER_BATCH = 1 << 16  # rows converted to Arrow at a time while writing
# A table this short stays in memory, converted through Arrow once as a whole: what it reads
# back is what its files would give, without a file and a conversion per column.
SMALL_ROWS = 1 << 14


def release_memory() -> None:
    """Hand memory freed by the last stage back to the OS, so the next stage's peak does not
    stack on it: glibc keeps freed heap pages in the middle of its heap (``malloc_trim``
    returns them) and pyarrow's pool keeps freed buffers. Elsewhere (macOS, musl) nothing to
    do. Called where a stage ends: a table built from disk unloaded, the parts stored, a pass
    over them done."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    pa.default_memory_pool().release_unused()


def new_file(path: str) -> "pa.NativeFile":
    """A file of the temporary directory opened for writing (every file this module writes)."""
    return pa.OSFile(path, "wb")


class ColumnWriter:
    """Writes a table to disk a column at a time (:meth:`add`), or a part of its rows at a
    time (:meth:`add_part`); :meth:`done` gives the :class:`StoredTable`. One Arrow IPC file
    per column, in batches of :data:`ROWS_PER_BATCH` rows: a column is read back alone, and
    a table made column by column (the calls, as they are read or matched) is never whole in
    memory. A table of at most :data:`SMALL_ROWS` rows is held instead, and written nowhere.
    On an error the files are removed."""

    def __init__(self, what: str = "table") -> None:
        self.what = what
        self._tmp: TempDir | None = None  # (made for the first file)
        self.files: dict[str, str] = {}
        self.dtypes: dict[str, Any] = {}
        self.n: int | None = None
        self.schema: pa.Schema | None = None  # every column's (add_part)
        self._open: dict[str, tuple[Any, Any]] = {}  # per column: its file and writer (add_part)
        self._held: dict[str, pd.Series] = {}  # a small table's columns (add)
        self._held_parts: list[pa.Table] = []  # a small table's parts (add_part)

    def _dir(self) -> str:
        if self._tmp is None:
            self._tmp = temp_dir(f"the {self.what}")
        return self._tmp.name

    def _check(self, name: str, n: int) -> None:
        if name in self.files or name in self._held:
            raise ValueError(f"{self.what}: column {name} written twice")
        if self.n is not None and n != self.n:
            raise ValueError(f"{self.what}: column {name} has {n} rows, not {self.n}")

    def add(self, name: str, col: pd.Series) -> None:
        """Column ``name`` of every row (its index is not kept)."""
        self._check(name, len(col))
        self.n = len(col)
        if self.n <= SMALL_ROWS:
            self._held[name] = col.reset_index(drop=True)
            self.dtypes[name] = col.dtype
            return
        frame = col.to_frame(name).reset_index(drop=True)
        schema = pa.Schema.from_pandas(frame, preserve_index=False)
        with self._guard():
            path = os.path.join(self._dir(), str(len(self.files)))
            with new_file(path) as sink, pa.ipc.new_file(sink, schema) as writer:
                # (one chunk first: an Arrow-backed column keeps its own chunks, and every
                # column's batches must be the same rows for batches())
                writer.write_table(pa.Table.from_pandas(frame, preserve_index=False, schema=schema).combine_chunks(),
                                   max_chunksize=ROWS_PER_BATCH)
        self.files[name] = path
        self.dtypes[name] = col.dtype

    def add_stored(self, table: StoredTable, name: str) -> bool:
        """Column ``name`` of ``table``, its file linked (or copied), never read: where its
        stored batches are those :meth:`add` writes (True). Else nothing is written (False)."""
        n = len(table)
        self._check(name, n)
        if not table.files or n <= SMALL_ROWS:  # (a small table is held: no file to link)
            return False
        # (add's batches: ROWS_PER_BATCH rows each, the last one the rest)
        if n and not np.array_equal(table._batch_ends(), np.append(np.arange(ROWS_PER_BATCH, n, ROWS_PER_BATCH), n)):
            return False
        path = os.path.join(self._dir(), str(len(self.files)))
        with self._guard():
            try:
                os.link(table.files[name], path)
            except OSError:
                shutil.copyfile(table.files[name], path)
        self.n = n
        self.files[name] = path
        self.dtypes[name] = table.dtypes[name]
        return True

    def add_part(self, df: pd.DataFrame) -> None:
        """The next rows, every column (the first part's columns, dtypes and Arrow types: a
        column of Python objects all missing there must be so in every part)."""
        if self.n is not None and (list(df.columns) != list(self.dtypes) or any(df[c].dtype != self.dtypes[c] for c in df.columns)):
            raise ValueError(f"{self.what}: a part's columns or dtypes differ from the first part's")
        with self._guard():
            # One conversion a part, in one chunk (see add); the types are those the first part
            # converted to (a category with no categories yet: its values' type, not Arrow's
            # guess from the dtype alone, null, which no later text would fit).
            table = pa.Table.from_pandas(df, preserve_index=False, schema=self.schema).combine_chunks()
        if self.n is None:
            self.n, self.schema = 0, table.schema
            self.dtypes = {c: df[c].dtype for c in df.columns}
        self.n += len(df)
        if self.n <= SMALL_ROWS:
            self._held_parts.append(table)
            return
        held, self._held_parts = self._held_parts, []
        for t in [*held, table]:
            self._write_part(t)

    def _write_part(self, table: pa.Table) -> None:
        assert self.schema is not None
        if not self._open:
            with self._guard():
                for i, c in enumerate(self.dtypes):
                    path = os.path.join(self._dir(), str(i))
                    sink = new_file(path)
                    self._open[c] = (sink, pa.ipc.new_file(sink, pa.schema([self.schema.field(i)], metadata=self.schema.metadata)))
                    self.files[c] = path
        with self._guard():
            for i, c in enumerate(self.dtypes):
                self._open[c][1].write_table(table.select([i]), max_chunksize=ROWS_PER_BATCH)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:  # a full or read-only temporary directory
            self.discard()
            raise _disk_error(e, f"the {self.what}") from None
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Give up: close and remove what was written."""
        for sink, writer in self._open.values():
            with contextlib.suppress(Exception):
                writer.close()
            sink.close()
        self._open.clear()
        self._held, self._held_parts = {}, []
        if self._tmp is not None:
            self._tmp.cleanup()

    def done(self, columns: Sequence[str] | None = None) -> StoredTable:
        """The table (``columns``: every column written, in this order)."""
        written = [*self.files, *self._held] if not self._held_parts else list(self.dtypes)
        if columns is not None:
            if sorted(columns) != sorted(written):
                self.discard()
                raise ValueError(f"{self.what}: columns {sorted(columns)} are not those written, {sorted(written)}")
            written = list(columns)
        table = StoredTable.__new__(StoredTable)
        if self._held_parts or (self._held and not self.files):
            back = pa.concat_tables(self._held_parts).to_pandas() if self._held_parts else \
                pa.Table.from_pandas(pd.DataFrame(self._held, copy=False), preserve_index=False).to_pandas()
            table._hold(back, {c: self.dtypes[c] for c in written}, self.what, self.n or 0)
            return table
        self.files = {c: self.files[c] for c in written}
        with self._guard():
            for sink, writer in self._open.values():
                writer.close()
                sink.close()
        self._open.clear()
        table._take(self)
        return table


class StoredTable:
    """One DataFrame (with the default index 0..n-1) on disk, a file per column (see
    :class:`ColumnWriter`), or a small one held in memory."""

    _tmp: TempDir | None
    files: dict[str, str]
    _built: pd.DataFrame | None  # the whole table, once read whole (a small one: always)
    _ends: np.ndarray | None  # where the stored batches end (see take)

    def __init__(self, df: pd.DataFrame, what: str = "table") -> None:
        if len(df) <= SMALL_ROWS:
            self._hold(pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False).to_pandas(), dict(df.dtypes), what, len(df))
            return
        w = ColumnWriter(what)
        with w._guard():
            for c in df.columns:
                w.add(c, df[c])
        if not len(df.columns):
            w.n = len(df)
        self._take(w)

    def _hold(self, back: pd.DataFrame, dtypes: dict[str, Any], what: str, n: int) -> None:
        """Hold a small table in memory as its files would give it back: ``back`` is the table
        converted to Arrow and back (once, as a whole); ``dtypes``, the ones it had."""
        self._tmp, self.files, self.schema = None, {}, None
        self.columns = list(dtypes)
        self.dtypes = pd.Series(dtypes, index=self.columns, dtype=object)
        self.n = n
        self._ends = np.array([self.n] if self.n else [], dtype=np.int64)
        self._built = pd.DataFrame({c: self._restored(back[c], c) for c in self.columns}, index=pd.RangeIndex(self.n), copy=False)

    def _take(self, w: ColumnWriter) -> None:
        self._tmp, self.files = w._tmp, w.files
        self.columns = list(w.files)
        self.dtypes = pd.Series(w.dtypes, index=self.columns, dtype=object)
        self.n = w.n or 0
        self.schema = w.schema  # (when written a part at a time: the batches convert at once)
        self._built = None
        self._ends = None

    @classmethod
    def of_parts(cls, parts: Iterable[pd.DataFrame], what: str = "table") -> StoredTable:
        """The table the ``parts`` make joined (as ``pd.concat(parts, ignore_index=True)``),
        written as they come: it is never whole in memory. Every part has the columns and
        dtypes of the first (categories included); there is at least one (it may be empty).
        The Arrow types are the first part's: a column of Python objects all missing there
        must be so in every part (it is stored untyped)."""
        w = ColumnWriter(what)
        with w._guard():
            for df in parts:
                w.add_part(df)
        if w.n is None:
            w.discard()
            raise ValueError(f"{what}: no parts")
        return w.done()

    def __len__(self) -> int:
        return self.n

    def read(self, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """These columns (all: None) of every row, in the table's column order, as they were."""
        names = self._names(columns)
        if self._built is not None:  # (a frame of its columns: selecting them is slower)
            return pd.DataFrame({c: self._built[c] for c in names}, index=self._built.index, copy=False)
        return pd.DataFrame({c: self._column(c) for c in names}, index=pd.RangeIndex(self.n), copy=False)

    def column(self, name: str) -> pd.Series:
        """One column of every row, as it was."""
        return self._built[name] if self._built is not None else self._column(name)

    def _names(self, columns: Sequence[str] | None) -> list[str]:
        """The table's columns among ``columns`` (all: None), in its order."""
        return self.columns if columns is None else among(self.columns, columns)

    def take(self, rows: np.ndarray, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """These columns (all: None) at these row positions, a column at a time, each read only
        over the stored batches the rows are in (rows close together: a few of them)."""
        names = self._names(columns)
        index = pd.RangeIndex(len(rows))
        rows = np.asarray(rows, dtype=np.int64)
        if self._built is not None:
            return self._built[names].take(rows).set_axis(index)
        if not len(rows):  # (the columns of no batch: an empty slice of a whole column would keep it)
            return pd.DataFrame({c: self._column(c, 0, 0) for c in names}, index=index, copy=False)
        if not names:
            return pd.DataFrame(index=index)
        ends = self._batch_ends()
        first, last = np.searchsorted(ends, rows.min(), "right"), np.searchsorted(ends, rows.max(), "right")
        at = int(ends[first - 1]) if first else 0
        return pd.DataFrame({c: self._column(c, first, last + 1).take(rows - at).set_axis(index) for c in names},
                            index=index, copy=False)

    def _batch_ends(self) -> np.ndarray:
        """Where each stored batch ends (row positions; every column's file has the same)."""
        if self._ends is None:
            with pa.memory_map(self.files[self.columns[0]]) as source:
                reader = pa.ipc.open_file(source)
                self._ends = np.cumsum([reader.get_batch(i).num_rows for i in range(reader.num_record_batches)], dtype=np.int64)
        return self._ends

    def batches(self) -> Iterator[pd.DataFrame]:
        """Every column, a stored batch of rows at a time (their index: the rows' positions),
        as they were; joined, :meth:`read`'s table."""
        if not self.files:  # (a small table: one batch)
            if self.n:
                yield self._built.copy(deep=False)  # type: ignore[union-attr]
            return
        with contextlib.ExitStack() as stack:  # (read, not mapped: a map's pages would add up in RSS)
            readers = {c: pa.ipc.open_file(stack.enter_context(pa.OSFile(self.files[c]))) for c in self.columns}
            n_batches = min((r.num_record_batches for r in readers.values()), default=0)
            at = 0
            for i in range(n_batches):
                if self.schema is not None:
                    df = pa.Table.from_arrays([r.get_batch(i).column(0) for r in readers.values()], schema=self.schema).to_pandas()
                    cols = {c: self._restored(df[c], c) for c in self.columns}
                    del df
                else:
                    cols = {c: self._restored(pa.Table.from_batches([r.get_batch(i)]).to_pandas()[c], c) for c, r in readers.items()}
                size = len(next(iter(cols.values())))
                yield pd.DataFrame(cols, copy=False).set_axis(pd.RangeIndex(at, at + size))
                at += size

    def _column(self, name: str, first: int = 0, stop: int | None = None) -> pd.Series:
        """One column, as it was (only the stored batches ``first`` to ``stop`` - 1: their
        rows, from 0). Read from its file mapped, unmapped after: its Arrow and pandas copies
        are the only two held (a table read whole held both of every column)."""
        with pa.memory_map(self.files[name]) as source:
            reader = pa.ipc.open_file(source)
            if first == 0 and stop is None:
                table = reader.read_all()
            else:
                table = pa.Table.from_batches([reader.get_batch(i) for i in range(first, reader.num_record_batches if stop is None else stop)],
                                              schema=reader.schema)
            col = table.to_pandas()[name] if len(table) else pd.Series([], dtype=self.dtypes[name], name=name)
            del table
        return self._restored(col, name).set_axis(pd.RangeIndex(len(col)))

    def _restored(self, col: pd.Series, name: str) -> pd.Series:
        """What Arrow does not keep as pandas had it (e.g. the type of categories)."""
        return col.astype(self.dtypes[name]) if col.dtype != self.dtypes[name] else col

    def table(self) -> pd.DataFrame:
        """The whole table, built once and kept until :meth:`unload`."""
        if self._built is None:
            self._built = self.read()
        return self._built

    def unload(self) -> bool:
        """Free the table built from disk (a small table is held: it has nothing else);
        whether there was one."""
        built = self._built is not None and bool(self.files)
        if built:
            self._built = None
        return built

    def discard(self) -> None:
        """Remove the files (the table is not read again)."""
        self._built = None
        if self._tmp is not None:
            self._tmp.cleanup()

    def __reduce__(self) -> tuple:
        return table_itself, (self.table(),)  # pickled as its table: the file is this process'


class Columns:
    """A stored table's columns for code that reads a table a column at a time: ``df[c]``
    reads column ``c`` from disk (each time: nothing is kept), and ``c in df``, ``df.columns``,
    ``df.index`` (0..n-1) and ``len(df)`` answer as the table would."""

    def __init__(self, table: StoredTable, columns: Sequence[str] | None = None) -> None:
        """``columns``: only those of the table's (in its order) are there."""
        self.table = table
        self.columns = pd.Index([c for c in table.columns if columns is None or c in set(columns)])
        self.index = pd.RangeIndex(len(table))

    def __getitem__(self, name: str) -> pd.Series:
        if name not in self.columns:
            raise KeyError(name)
        return self.table.column(name)

    def __contains__(self, name: object) -> bool:
        return name in self.columns

    def __len__(self) -> int:
        return len(self.table)


def table_itself(df: pd.DataFrame) -> pd.DataFrame:
    """(What a table kept on disk unpickles to: its table, in memory.)"""
    return df


class StoredField:
    """A dataclass field holding a DataFrame (or None), or what builds one when the field is
    read (its ``table()``: a :class:`StoredTable`, or the samples of
    :class:`slotscope.tasks.Samples`); read, it is a DataFrame."""

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


def keep_on_disk(obj: object, name: str, what: str) -> bool:
    """Move field ``name`` of ``obj`` (a DataFrame) to disk; whether that freed its frame (a
    small table stays held)."""
    v = raw(obj, name)
    if not isinstance(v, pd.DataFrame):
        return False
    table = StoredTable(v.reset_index(drop=True), what)
    object.__setattr__(obj, name, table)  # (frozen ones too)
    return bool(table.files)


def among(names: Iterable[str], wanted: Iterable[str]) -> list[str]:
    """Those of ``names`` that are in ``wanted``, in the order of ``names``."""
    keep = set(wanted)
    return [c for c in names if c in keep]


def columns_of(obj: object, name: str, columns: Sequence[str]) -> pd.DataFrame:
    """Those of ``columns`` that field ``name`` of ``obj`` has (in its order), without reading
    the others from disk."""
    v = raw(obj, name)
    if isinstance(v, StoredTable):
        return v.read(columns)
    return v[among(v.columns, columns)]


def rows_of(obj: object, name: str, rows: np.ndarray, columns: Sequence[str]) -> pd.DataFrame:
    """Those of ``columns`` that field ``name`` of ``obj`` has, at row positions ``rows``
    (index 0..), without reading the others from disk."""
    v = raw(obj, name)
    if isinstance(v, StoredTable):
        return v.take(rows, columns)
    return v[among(v.columns, columns)].take(rows).reset_index(drop=True)


def unload(obj: object, name: str) -> bool:
    """Free the table built from disk for field ``name`` (built again when read); whether
    there was one."""
    v = raw(obj, name)
    return isinstance(v, StoredTable) and v.unload()


class Buckets:
    """Rows of several tables cut into numbered parts, kept on disk until read back a part at
    a time, in any order (:mod:`slotscope.periods`). Rows are added in any order, each with
    its part and a ``row`` (its place in the whole table); a part reads back with its rows of
    each table sorted by it, with the dtypes the first rows added had.

    Rows are held in memory until they pass :data:`HELD_BYTES`, then written: per table, one
    Arrow IPC file with a record batch per part, so that a part reads back its own batches
    and nothing else."""

    HELD_BYTES = 16 << 20  # rows held in memory before they go to disk

    def __init__(self, n_parts: int, names: Sequence[str]) -> None:
        self.n_parts, self.names = n_parts, list(names)
        self._tmp: TempDir | None = None
        self._held: dict[str, list[pa.Table]] = {}
        self._held_bytes = 0
        self._batches: dict[tuple[str, int], list[tuple[str, int]]] = {}  # (table, part) -> (file, batch)
        self._files = 0
        self._dtypes: dict[str, pd.Series] = {}
        self._schema: dict[str, pa.Schema] = {}

    def add(self, name: str, rows: pd.DataFrame | dict[str, np.ndarray], part: np.ndarray,
            extra: dict[str, np.ndarray] | None = None) -> None:
        """``rows`` of table ``name`` (a frame, or numpy columns), row i in part ``part[i]``;
        ``extra``: more columns."""
        if isinstance(rows, dict):
            table = pa.table({c: pa.array(v) for c, v in rows.items()})
        else:
            self._dtypes.setdefault(name, rows.dtypes)
            table = pa.Table.from_pandas(rows, preserve_index=False)
        for c, v in {**(extra or {}), "_part": part}.items():
            table = table.append_column(c, pa.array(v))
        self._schema.setdefault(name, table.schema)
        self._held.setdefault(name, []).append(table)
        self._held_bytes += table.nbytes
        if self._held_bytes > self.HELD_BYTES:
            self._spill()

    def done(self) -> None:
        """No more rows: once some went to disk, the rest go too (nothing held while read)."""
        if self._files:
            self._spill()

    def _spill(self) -> None:
        """Write what is held to disk (a small log's parts are never written): per table, one
        file, each added piece's rows of a part one record batch."""
        for name, pieces in self._held.items():
            path = os.path.join(self._dir(), f"{name}.{self._files}")
            self._files += 1
            try:
                with new_file(path) as sink, pa.ipc.new_file(sink, self._schema[name]) as writer:
                    for piece in pieces:
                        for k, rows in _part_slices(piece):
                            self._batches.setdefault((name, k), []).append((path, writer.stats.num_record_batches))
                            writer.write_batch(rows)
            except OSError as e:
                self.discard()
                raise _disk_error(e, "the analysis' parts") from None
        self._held, self._held_bytes = {}, 0

    def _dir(self) -> str:
        if self._tmp is None:
            self._tmp = temp_dir("the analysis' parts")
        return self._tmp.name

    def part(self, k: int, names: Sequence[str] | None = None,
             columns: dict[str, Sequence[str]] | None = None) -> dict[str, pd.DataFrame]:
        """{table: its rows} of part ``k`` alone; only the tables ``names`` (None: all), and of a
        table in ``columns`` only those of its columns."""
        return {name: self._frame(name, self._part(name, k), (columns or {}).get(name)) for name in names or self.names}

    def _part(self, name: str, k: int) -> pa.Table:
        """Part ``k``'s rows of table ``name``, sorted by row."""
        schema = self._schema.get(name, pa.schema([("row", pa.int64()), ("_part", pa.int64())]))
        pieces = [t.filter(pa.array(t.column("_part").to_numpy() == k)) for t in self._held.get(name, [])]
        for path, i in self._batches.get((name, k), []):
            with pa.OSFile(path) as source:
                pieces.append(pa.Table.from_batches([pa.ipc.open_file(source).get_batch(i)]))
        table = pa.concat_tables(pieces) if pieces else schema.empty_table()
        rows = table.column("row").to_numpy()
        if len(rows) > 1 and bool((rows[1:] < rows[:-1]).any()):  # (rows added in order come back sorted)
            table = table.take(pa.array(np.argsort(rows, kind="stable")))
        return table

    def _frame(self, name: str, table: pa.Table, columns: Sequence[str] | None = None) -> pd.DataFrame:
        keep = [c for c in table.column_names if c != "_part" and (columns is None or c in columns)]
        df = table.select(keep).to_pandas()
        dtypes = self._dtypes.get(name)
        if dtypes is not None:
            df = df.astype({c: t for c, t in dtypes.items() if c in df.columns and df[c].dtype != t})
        return df

    def discard(self) -> None:
        self._held = {}
        if self._tmp is not None:
            self._tmp.cleanup()


def _part_slices(table: pa.Table) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(part, its rows as one record batch) for every part the table's rows are in, in part
    order (rows as added within a part)."""
    table = table.take(pa.array(np.argsort(table.column("_part").to_numpy(), kind="stable")))
    parts = table.column("_part").to_numpy()
    starts = np.flatnonzero(np.r_[True, parts[1:] != parts[:-1]]) if len(parts) else np.zeros(0, np.int64)
    for lo, hi in zip(starts.tolist(), np.r_[starts[1:], len(parts)].tolist()):
        yield int(parts[lo]), table.slice(lo, hi - lo).combine_chunks().to_batches()[0]


class TempDir:
    """A directory of the temporary directory, removed by :meth:`cleanup`, or when its owner
    is collected or the program ends. (tempfile.TemporaryDirectory warns when it is removed
    that way; a dataset's tables live on disk until then by design.)"""

    def __init__(self, prefix: str) -> None:
        self.name = tempfile.mkdtemp(prefix=prefix)
        self._remove = weakref.finalize(self, shutil.rmtree, self.name, ignore_errors=True)

    def cleanup(self) -> None:
        self._remove()


def temp_dir(what: str, prefix: str = "slotscope-") -> TempDir:
    """A new directory in the temporary directory, for ``what`` (named in the error)."""
    _check_tmpdir(what)
    try:
        return TempDir(prefix)
    except OSError as e:
        raise _disk_error(e, what) from None


def _check_tmpdir(what: str) -> None:
    """A ``TMPDIR`` the user set, usable: Python would fall back to /tmp without a word (the
    disk the user meant to spare)."""
    d = os.environ.get("TMPDIR")
    if d and not os.path.isdir(d):
        raise SlotscopeError(d, None, f"TMPDIR is not a directory: cannot write {what} there; set TMPDIR to a directory with room")
    if d and not os.access(d, os.W_OK | os.X_OK):
        raise SlotscopeError(d, None, f"TMPDIR is not writable: cannot write {what} there; set TMPDIR to a directory with room")


def _disk_error(e: OSError, what: str) -> SlotscopeError:
    where = getattr(e, "filename", None)
    if not where:
        try:
            where = tempfile.gettempdir()
        except OSError:  # (no directory Python can use: the error says which ones it tried)
            where = None
    return SlotscopeError(where, None, f"cannot write {what} to the temporary directory ({e.strerror or e}); "
                          "set TMPDIR to a directory with room")


class Spool:
    """Objects (a pass's answers, one per part) kept on disk in the order added until read back
    together, so that what one question holds for its merge is not resident while the others
    are answered."""

    def __init__(self, what: str) -> None:
        self.what = what  # for the message when the disk is full
        self._file: "tempfile._TemporaryFileWrapper[bytes] | None" = None
        self.n = 0

    def append(self, obj: Any) -> None:
        try:
            if self._file is None:
                _check_tmpdir(self.what)
                self._file = tempfile.NamedTemporaryFile(prefix="slotscope-")
            pickle.dump(obj, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as e:
            self.discard()
            raise _disk_error(e, self.what) from None
        self.n += 1

    def read(self) -> list[Any]:
        """Every object added, in order."""
        if self._file is None:
            return []
        self._file.seek(0)
        out = [pickle.load(self._file) for _ in range(self.n)]
        self._file.seek(0, os.SEEK_END)  # (more may be added after)
        return out

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self.n = None, 0


class Chunks:
    """Chunks of rows of numeric columns (numpy arrays), each in an Arrow IPC file of its own
    in a temporary directory, read back a column at a time. A copy in
    another process (a parse worker) reads the same files; the directory stays this one's."""

    def __init__(self, what: str) -> None:
        self.what = what  # for the message when the disk is full
        self._tmp: TempDir | None = None
        self.paths: list[str] = []

    def write(self, cols: dict[str, np.ndarray]) -> str:
        """A new chunk; its file's path."""
        if self._tmp is None:
            self._tmp = temp_dir(self.what)
        path = os.path.join(self._tmp.name, str(len(self.paths)))
        self._write(path, cols)
        self.paths.append(path)
        return path

    def rewrite(self, k: int, cols: dict[str, np.ndarray]) -> None:
        """Chunk ``k`` holds ``cols`` instead (a new file put in its place: a copy that still
        maps the old one reads it whole)."""
        path = self.paths[k]
        self._write(path + ".new", cols)
        os.replace(path + ".new", path)

    def _write(self, path: str, cols: dict[str, np.ndarray]) -> None:
        table = pa.table({c: np.ascontiguousarray(v) for c, v in cols.items()})
        try:
            with new_file(path) as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
        except OSError as e:
            raise _disk_error(e, self.what) from None

    @staticmethod
    def read(path: str, names: Sequence[str]) -> list[np.ndarray]:
        """Columns ``names`` of the chunk in ``path``, as arrays of their own: the file is
        mapped while read, and only those columns' pages are touched."""
        with pa.memory_map(path) as source:
            batch = pa.ipc.open_file(source).get_batch(0)
            return [batch.column(c).to_numpy(zero_copy_only=False).copy() for c in names]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tmp": None}

    def discard(self) -> None:
        self.paths = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
