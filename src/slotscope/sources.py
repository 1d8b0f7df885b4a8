"""Inputs: expand paths, open (de)compressed streams, tell server logs from app logs.

A path may be a file, a directory (every file in it; rotated ``x.log.2.gz``, ``x.log.1``,
``x.log`` are read oldest first as one stream), a glob, or ``-`` for stdin. Compression
(gzip, zstd) and the kind of log are recognised by content, never by name.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import io
import os
import re
import stat
import sys
import types
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Literal, Mapping, Sequence, cast

from .app_fields import looks_like_app_log
from .json_documents import first_records, is_document
from .ollama_hints import looks_like_ollama
from . import store
from .errors import InputError

_zlib: types.ModuleType
try:  # a faster inflater when installed; the standard library otherwise
    from isal import isal_zlib as _zlib  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _zlib = zlib

Kind = Literal["server", "app", "ollama"]

# What a damaged or unreadable stream raises while being read (zstd's error is its own class).
# (isal's inflater raises its own class, not zlib's)
_INFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error, getattr(_zlib, "error", zlib.error))
READ_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError, *_INFLATE_ERRORS)
_DAMAGED: tuple[type[Exception], ...] = (EOFError, *_INFLATE_ERRORS)  # a damaged or cut gzip
try:
    import zstandard as _zstd

    READ_ERRORS += (_zstd.ZstdError,)
except ImportError:  # pragma: no cover - optional dependency
    pass

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
CHUNK_SIZE = 8 << 20  # 8 MiB: numpy's per-call cost spread over ~65k lines, yet a few blocks in flight stay small
SNIFF_BYTES = 64 * 1024

STDIN = "-"


@dataclass(frozen=True)
class LogFile:
    """One input file (or stdin) and what it holds."""

    path: str
    kind: Kind
    stream: str  # files of one rotated stream share this name (the un-rotated file name)
    order: int  # position inside the stream, oldest first
    shown: str | None = None  # the name to report, where ``path`` is a file made from it (Ollama's runner lines)


@dataclass
class Inputs:
    """What a set of paths expanded to: readable logs by kind, and what was skipped and why."""

    server: list[list[LogFile]] = field(default_factory=list)  # one list per stream
    ollama: list[list[LogFile]] = field(default_factory=list)  # Ollama server logs, one list per stream
    app: list[LogFile] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    unusable: list[tuple[str, str]] = field(default_factory=list)  # named explicitly, yet unusable
    notes: list[str] = field(default_factory=list)  # said on stderr with the summary
    stdin: BinaryIO | None = None  # stdin, already opened (it can be read only once)


_ROTATED = re.compile(r"^(?P<base>.+?)(?:[.-](?P<n>\d{1,4}))?(?:\.(?:gz|zst|zstd))?$")


def _rotation_key(name: str) -> tuple[str, int]:
    m = _ROTATED.match(name)
    assert m is not None
    return m.group("base"), int(m.group("n") or 0)


def _expand_one(p: str) -> list[str]:
    if p == STDIN:
        return [STDIN]
    if os.path.isdir(p):
        try:
            names = sorted(os.listdir(p))
        except OSError as e:  # (a directory without read permission)
            raise InputError(p, None, f"cannot read: {e.strerror or e}") from None
        out = [os.path.join(p, e) for e in names if not e.startswith(".") and os.path.isfile(os.path.join(p, e))]
        if not out:
            raise InputError(p, None, "directory holds no files")
        return out
    if os.path.exists(p):
        return [p]
    if glob.has_magic(p):
        hits = sorted(h for h in glob.glob(p) if os.path.isfile(h))
        if not hits:
            raise InputError(p, None, "no file matches this pattern")
        return hits
    raise InputError(p, None, "no such file or directory")


def open_binary(path: str) -> BinaryIO:
    """Open a file (or stdin for ``-``) for binary reading, decompressing gzip/zstd by magic."""
    if path == STDIN:
        raw: BinaryIO = sys.stdin.buffer
        if not hasattr(raw, "peek"):
            raw = cast(BinaryIO, io.BufferedReader(cast(io.RawIOBase, raw)))  # (a raw stream, then)
    else:
        try:
            raw = open(path, "rb")
        except OSError as e:
            raise InputError(path, None, f"cannot read: {e.strerror or e}") from None
    head = raw.peek(4)[:4]  # type: ignore[attr-defined]
    if head.startswith(GZIP_MAGIC):
        return _GzipStream(raw)  # type: ignore[return-value]
    if head.startswith(ZSTD_MAGIC):
        try:
            import zstandard
        except ImportError:
            raise InputError(
                path, None, "zstd-compressed, but the 'zstandard' package is not installed; "
                "pip install 'slotscope[zstd]'"
            ) from None
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)  # type: ignore[return-value]
    if head[:2] in UTF16_BOMS:
        return cast(BinaryIO, _Utf16Stream(raw))
    return raw


def read_head(stream: BinaryIO, path: str, n: int = SNIFF_BYTES) -> bytes:
    """Read up to ``n`` bytes from the start of a stream.

    A truncated or corrupt compressed file yields what could be decompressed (the full read
    reports the damage); an error is raised only when nothing at all can be read.
    """
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            block = stream.read(min(4096, n - got))
        except READ_ERRORS as e:  # corrupt gzip/zstd data, I/O errors
            if not parts:
                raise InputError(path, None, f"cannot read: {e}") from None
            break
        if not block:
            break
        parts.append(block)
        got += len(block)
    return b"".join(parts)


_SERVER_HINTS = re.compile(
    rb"(?:slot |srv  |cmn  |que  |llama_server|print_timing|processing task|"
    rb"\"slot is processing task\"|llama_|ggml_|\] slot released)"
)


def sniff(head: bytes, app_columns: Mapping[str, str] | None = None) -> Kind | str:
    """Tell a llama-server log from an Ollama log and an app call log by content.

    Returns ``"server"``, ``"ollama"`` or ``"app"``, or a short reason why the data is none.
    """
    if not head.strip():
        return "empty file"
    sample = head[:SNIFF_BYTES]
    seen = _other_encoding_or_shape(sample)
    if seen:
        return seen
    # By the share of text: a stray NUL (a crash, a disk hiccup) leaves a text log a text log.
    text_like = sum(1 for b in sample[:4096] if b >= 32 or b in (9, 10, 13, 27))
    if text_like < 0.9 * min(len(sample), 4096):
        return "binary data, not a text log"
    # Lines are cut at LF: such a file is one line, read as nothing or as one bad record.
    if b"\n" not in sample and b"\r" in sample.rstrip(b"\r"):
        return ("line ends are CR alone (as classic Mac OS programs write); slotscope reads LF and CRLF line ends: "
                "convert it first, e.g. tr '\\r' '\\n' < FILE > FILE.txt")
    if looks_like_app_log(sample, app_columns):
        return "app"
    seen = _document_seen(sample)
    if seen:
        return seen
    if looks_like_ollama(sample):
        return "ollama"
    if _SERVER_HINTS.search(sample):
        return "server"
    return "neither a llama-server log nor an app call log"


def _other_encoding_or_shape(sample: bytes) -> str | None:
    """What a file is when it holds the logs in a form slotscope does not read, with how to
    convert it: UTF-16 text it cannot decode; None otherwise."""
    # (UTF-16 with a byte-order mark is read as UTF-8 by open_binary; this is what is left: a
    # compressed copy, or no mark, where the byte order would be a guess)
    marked = sample[:2] in UTF16_BOMS
    little = sample[:2] == b"\xff\xfe" or (len(sample) >= 64 and sample[1:64:2].count(0) > 28)
    if marked or little or (len(sample) >= 64 and sample[0:64:2].count(0) > 28):
        what = "compressed UTF-16 text" if marked else "UTF-16 text without a byte-order mark"
        return (f"{what}; slotscope reads UTF-8, and UTF-16 files that start with a byte-order mark: convert it "
                f"first, e.g. iconv -f UTF-16{'LE' if little else 'BE'} -t UTF-8 FILE > FILE.utf8")
    return None


def _document_seen(sample: bytes) -> str | None:
    """What a JSON document (an array, pretty-printed records) that is no app log holds, with
    what an app log's records need; None for anything else."""
    if not is_document(sample[:SNIFF_BYTES].decode("utf-8", "replace")):
        return None
    records = first_records(sample)
    # journald, docker json-file, llama-server's 2024 JSON: log lines, read one object per line
    if any(k in r for r in records for k in ("MESSAGE", "__CURSOR", "msg", "message")) or \
            any("log" in r and "stream" in r for r in records):
        return ("log lines as one JSON document (an array, or pretty-printed); JSON log lines are read as one "
                "object per line: convert it first, e.g. jq -c '.[]' FILE (an array) or jq -c . FILE "
                "(pretty-printed) > FILE.jsonl (journalctl: -o json, not json-pretty)")
    keys = dict.fromkeys(k for rec in records for k in rec)
    shown = ", ".join(list(keys)[:8]) + (", ..." if len(keys) > 8 else "")
    return (f"a JSON document whose first records {f'have the keys {shown}' if keys else 'are no JSON objects'}; "
            "an app call log's records need a start time and one of end, duration_ms, prompt_tokens, "
            "completion_tokens, purpose, lora (--app-columns maps other names)")


def collect(paths: Sequence[str | os.PathLike[str]], app_columns: Mapping[str, str] | None = None) -> Inputs:
    """Expand paths and sort the files into server-log streams and app logs (``app_columns``:
    the --app-columns mapping, by which a file with unknown names is an app log too).

    Raises :class:`InputError` for a path that names nothing. A file that cannot be used (empty,
    binary, unreadable, neither kind of log) is listed in ``skipped`` with the reason, and also
    in ``unusable`` when it was named explicitly (the CLI reports those as errors).
    """
    inputs = Inputs()
    seen: set[str] = set()
    found: list[tuple[str, bool]] = []  # (path, named explicitly)
    for p in paths or []:
        ps = os.fspath(p)
        expanded = _expand_one(ps)
        explicit = len(expanded) == 1 and not os.path.isdir(ps)
        for f in expanded:
            key = f if f == STDIN else os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                found.append((f, explicit))
    streams: dict[tuple[str, str, str], list[LogFile]] = {}
    for f, explicit in found:
        try:
            stream = open_binary(f)
            try:
                head = read_head(stream, f)
            finally:
                if f != STDIN:
                    stream.close()
            kind = sniff(head, app_columns)
        except InputError as e:
            kind = e.reason
        if kind not in ("server", "app", "ollama"):
            inputs.skipped.append((f, str(kind)))
            if explicit:
                inputs.unusable.append((f, str(kind)))
            continue
        if f == STDIN:
            inputs.stdin = cast(BinaryIO, _Prepended(head, stream))  # (read as one: read(n) -> bytes)
        if kind == "app":
            inputs.app.append(LogFile(f, "app", f, 0))
            continue
        log_kind: Kind = "ollama" if kind == "ollama" else "server"
        directory, name = os.path.split(f)
        base, n = _rotation_key(name) if f != STDIN else (STDIN, 0)
        group = streams.setdefault((directory, base, kind), [])
        clash = next((lf for lf in group if lf.order == n), None)
        if clash is not None:
            # x.log beside x.log.gz: one rotation position twice, most likely a compressed copy.
            # Reading both as one stream would double every task; read it as its own source.
            streams.setdefault((directory, name, kind), []).append(LogFile(f, log_kind, f, 0))
            inputs.notes.append(f"{f} and {clash.path} hold the same rotation position; read as separate sources "
                                "(if one is a copy of the other, give only one)")
            continue
        group.append(LogFile(f, log_kind, os.path.join(directory, base) if f != STDIN else STDIN, n))
    for (_, _, kind), files in streams.items():
        files.sort(key=lambda lf: -lf.order)  # x.log.2 (oldest) ... x.log (newest)
        (inputs.ollama if kind == "ollama" else inputs.server).append(
            [LogFile(lf.path, lf.kind, lf.stream, i) for i, lf in enumerate(files)])
    return inputs


class _GzipStream(io.RawIOBase):
    """Streaming gzip reader (multi-member) that hands out everything before a damaged or cut end.

    ``gzip.GzipFile`` discards the data of a read that hits a truncated member; a log cut by a
    crash must still yield its lines, and the damage is reported as an error after them.
    Each read inflates straight into the size asked for (``max_length``): no intermediate
    buffer, one copy at most.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._d = _zlib.decompressobj(wbits=31)
        self._input = b""  # compressed bytes read but not yet inflated
        self._eof = False
        self._in_member = False
        self._pending: Exception | None = None

    def readable(self) -> bool:
        return True

    def _inflate(self, most: int) -> bytes:
        """Up to ``most`` bytes of output (b"" at a clean end); raises on damage."""
        while True:
            if self._input:
                data, self._input = self._input, b""
            else:
                if self._eof:
                    return b""
                data = self._raw.read(1 << 20)
                if not data:
                    self._eof = True
                    if self._in_member:  # a member was started but its end never came
                        raise EOFError("compressed file ended before the end-of-stream marker was reached")
                    return b""
            self._in_member = True
            out = self._d.decompress(data, most)
            if self._d.eof:  # next gzip member (concatenated .gz files are one stream)
                self._in_member = False
                self._input = self._d.unused_data
                self._d = _zlib.decompressobj(wbits=31)
            else:
                self._input = self._d.unconsumed_tail
            if out:
                return out

    def read1(self, n: int = -1) -> bytes:  # type: ignore[override]
        """Up to ``n`` bytes (fewer: what one inflate step gave), not joined from several steps:
        for a reader that takes any size of block (:func:`_block_pieces`)."""
        return self.read(n, steps=1)

    def read(self, n: int = -1, steps: int | None = None) -> bytes:  # type: ignore[override]
        if self._pending is not None:
            e, self._pending = self._pending, None
            raise EOFError(str(e))
        limit = n if n >= 0 else 1 << 62
        parts: list[bytes] = []
        got = 0
        try:
            while got < limit and len(parts) != steps:
                out = self._inflate(limit - got)
                if not out:
                    break
                parts.append(out)
                got += len(out)
        except _DAMAGED as e:
            self._eof = True
            self._input = b""
            if not parts:
                raise EOFError(str(e)) from None
            self._pending = e  # hand out what was decoded; the next read raises
        return b"".join(parts)  # (one part: itself, not a copy)

    def close(self) -> None:
        if self._raw is not sys.stdin.buffer:
            self._raw.close()
        super().close()


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # little- and big-endian byte-order marks


class _Utf16Stream(io.RawIOBase):
    """UTF-16 text that starts with a byte-order mark (PowerShell's ``>`` writes it), handed
    out as UTF-8 as it is read: the readers see the lines they read in UTF-8 files, one block
    at a time. Bytes that are not UTF-16 become U+FFFD, as invalid UTF-8 does elsewhere."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._decoder = codecs.getincrementaldecoder("utf-16")(errors="replace")  # (reads the mark, drops it)
        self._done = False

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        while not self._done:  # (b"" only at the end: a read of one odd byte decodes to nothing)
            data = self._raw.read(-1 if n < 0 else max(2 * n, 2))
            self._done = not data
            text = self._decoder.decode(data, final=self._done)
            if text:
                return text.encode("utf-8")
        return b""

    def close(self) -> None:
        self._raw.close()
        super().close()


class _Prepended(io.RawIOBase):
    """A stream whose first bytes were already read (to sniff stdin) and are served again."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        if self._head:
            out, self._head = (self._head, b"") if n < 0 or n >= len(self._head) else (self._head[:n], self._head[n:])
            return out
        return self._rest.read(n)


def reopen(lf: LogFile, inputs: Inputs) -> BinaryIO:
    """Open a collected file again for the full read (stdin is handed back as collected)."""
    if lf.path == STDIN:
        assert inputs.stdin is not None
        return inputs.stdin
    return open_binary(lf.path)


LONGEST_LINE = 64 << 20  # a "line" of 64 MiB is not a log line: handed on as it is, to stay bounded


def iter_chunks(stream: BinaryIO, path: str, size: int = CHUNK_SIZE, pieces: bool = False) -> Iterator[bytes]:
    """Yield blocks of whole lines (each ends at a newline, except possibly the very last).

    A damaged compressed stream yields every line decoded before the damage, then raises
    :class:`InputError` naming the file. Compressed streams are decoded one block ahead in a
    thread (inflating releases the GIL, so it runs on another core while a block is parsed).
    ``pieces``: each block as a list of buffers that make it up, not joined (for a writer:
    joining would copy every block once more).
    """
    # (b"".join of one bytes piece is that piece, no copy)
    blocks = cast(Iterator[bytes], (parts if pieces else b"".join(parts) for parts in _block_pieces(stream, path, size)))
    return _read_ahead(blocks) if _is_compressed(stream) else blocks


def _is_compressed(stream: object) -> bool:
    return isinstance(stream, _GzipStream) or type(stream).__name__ == "ZstdDecompressionReader"


def _read_ahead(blocks: Iterator[bytes], depth: int = 2) -> Iterator[bytes]:
    """The same blocks, made by a thread at most ``depth`` blocks ahead (errors in order)."""
    thread = ThreadPoolExecutor(1, thread_name_prefix="slotscope-read-ahead")  # (one: the blocks in order)
    try:
        coming = deque([thread.submit(next, blocks, None) for _ in range(depth)])
        while (block := coming.popleft().result()) is not None:
            coming.append(thread.submit(next, blocks, None))
            yield block
    finally:  # also when the reader stops early: let the thread end before the stream closes
        thread.shutdown(cancel_futures=True)


def _block_pieces(stream: BinaryIO, path: str, size: int) -> Iterator[list]:
    """Blocks of whole lines as [what the last read left after its last newline, this read up
    to its last newline] (one piece: a last line without newline, or a "line" over
    :data:`LONGEST_LINE`). A compressed stream's reads are single inflate steps (``read1``)."""
    read = stream.read1 if isinstance(stream, _GzipStream) else stream.read  # no join of inflate steps
    rest = b""
    failure: InputError | None = None
    while failure is None:
        try:
            block = read(size)
        except READ_ERRORS:
            block, failure = _salvage(stream, path)
        if not block:
            break
        cut = block.rfind(b"\n")
        if cut < 0:
            rest += block
            if len(rest) > LONGEST_LINE:
                yield [rest]
                rest = b""
            continue
        yield [rest, memoryview(block)[: cut + 1]]
        rest = block[cut + 1 :]
    if rest:
        yield [rest]
    if failure is not None:
        raise failure


def _salvage(stream: BinaryIO, path: str) -> tuple[bytes, InputError]:
    """After a failed read, what a decompressor still hands out in small reads, and the error."""
    parts: list[bytes] = []
    while True:
        try:
            piece = stream.read(4096)
        except READ_ERRORS as e:
            return b"".join(parts), InputError(path, None, f"cannot read past this point (corrupt or truncated compressed data?): {e}")
        if not piece:
            return b"".join(parts), InputError(path, None, "cannot read past this point (corrupt or truncated compressed data)")
        parts.append(piece)


def file_size(path: str) -> int | None:
    """Bytes on disk (compressed size for .gz/.zst), or None for stdin/unknown."""
    if path == STDIN:
        return None
    try:
        return os.path.getsize(path)
    except OSError:
        return None


@dataclass(frozen=True)
class Span:
    """A byte range of a plain (uncompressed, seekable) file that holds whole lines only.

    ``staged``: the file is a temporary copy of one block (see :func:`staged`), removed by
    whoever reads it. ``file_id``: the (device, inode) of the file the span was cut from: a
    worker opens the path again, and must find the same file there."""

    path: str
    start: int
    length: int
    staged: bool = False
    file_id: tuple[int, int] | None = None


def iter_spans(stream: BinaryIO, path: str, size: int = CHUNK_SIZE) -> Iterator[Span]:
    """Cut an open plain file into spans of ~``size`` bytes that end at a newline.

    Only the bytes around each cut are read here (to find the newline), so the spans can be
    read and parsed elsewhere, e.g. by another process. Together they cover the file as it is
    when the read starts (a file that grows meanwhile is read up to that point). A line longer
    than :data:`LONGEST_LINE` is cut there, as :func:`iter_chunks` does.
    """
    try:
        st = os.fstat(stream.fileno())
        end, file_id = st.st_size, (st.st_dev, st.st_ino)
        start = 0
        while start < end:
            cut = min(start + size, end)
            if cut < end:
                stream.seek(cut - 1)
                scanned = 0
                while True:
                    piece = stream.read(1 << 16)
                    at = piece.find(b"\n")
                    if at >= 0:
                        cut = min(cut + scanned + at, end)
                        break
                    scanned += len(piece)
                    if not piece or scanned > LONGEST_LINE:
                        cut = min(cut - 1 + scanned, end)
                        break
            yield Span(path, start, cut - start, file_id=file_id)
            start = cut
    except OSError as e:
        raise InputError(path, None, f"cannot read: {e.strerror or e}") from None


def read_span(span: Span) -> bytes:
    """The bytes of a span (in whichever process parses it)."""
    try:
        with open(span.path, "rb") as f:
            st = os.fstat(f.fileno())
            if span.file_id is not None and (st.st_dev, st.st_ino) != span.file_id:
                raise InputError(span.path, None, "the file was replaced while it was read (rotated meanwhile?); "
                                                  "copy it first, or read it again")
            f.seek(span.start)
            data = f.read(span.length)
        if span.staged:
            os.unlink(span.path)
    except OSError as e:
        raise InputError(span.path, None, f"cannot read: {e.strerror or e}") from None
    if len(data) != span.length:
        raise InputError(span.path, None, "the file shrank while it was read (truncated or rotated meanwhile?)")
    return data


class staged:
    """The same blocks, each written to a temporary file and handed on as a :class:`Span` of
    it, for a worker process to read (and remove).

    For a stream that cannot be cut into spans (compressed, stdin): a block sent through a pipe
    is copied four times (pickled, written, read, unpickled) in processes that are parsing too;
    a file is written once and read once, and waits in the page cache, not in memory. Where
    the temporary directory cannot take a block (full, read-only), the block itself is handed
    on. :meth:`close` (not the last block: workers may still be reading) closes the source
    (stopping its read-ahead thread) and removes the files no one read.
    """

    def __init__(self, blocks: Iterator[bytes]) -> None:
        self._blocks = blocks
        self._tmp = store.temp_dir("the log's blocks", prefix="slotscope-blocks-")
        self._n = 0

    def __iter__(self) -> "staged":
        return self

    def __next__(self) -> bytes | Span:
        block = next(self._blocks)  # bytes, or the pieces of a block (iter_chunks(pieces=True))
        parts = block if isinstance(block, list) else [block]
        path = os.path.join(self._tmp.name, str(self._n))
        self._n += 1
        try:
            with open(path, "wb") as f:
                for part in parts:
                    f.write(part)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return b"".join(parts)
        return Span(path, 0, sum(len(p) for p in parts), staged=True)

    def close(self) -> None:
        if hasattr(self._blocks, "close"):
            self._blocks.close()  # stops a read-ahead thread before its stream is closed
        self._tmp.cleanup()


def is_plain(stream: BinaryIO) -> bool:
    """Whether a stream is a regular uncompressed file that can be cut into spans."""
    if _is_compressed(stream) or stream is sys.stdin.buffer or not hasattr(stream, "fileno"):
        return False
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode) and stream.seekable()
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
