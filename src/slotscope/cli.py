"""The ``slotscope`` command: option parsing, one library call, one output call per command."""

import functools
import gc
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, NoReturn, Optional

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from .errors import InputError, SlotscopeError, UsageError
from .glossary import TABLES

if TYPE_CHECKING:
    import pandas as pd

    from . import output
    from .accounting import Accounting
    from .dataset import Dataset

# The library (pandas, pyarrow) is imported by the commands that run, not here: `slotscope
# --help` and a usage error answer without it.

class _FlagsAsFlags:
    """Help that shows a flag as a flag, ``--strict``: typer 0.2x writes ``--strict <bool>``
    (``--help <bool>`` too), as if it took a value."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Command(_FlagsAsFlags, TyperCommand):
    pass


class _Group(_FlagsAsFlags, TyperGroup):
    pass


app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="Explain why a self-hosted llama-server felt slow: join its log with the app's call log, task by task.",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)

# Options shared by every command, declared once so flags read the same everywhere.
PathsArg = Annotated[Optional[list[str]], typer.Argument(help="Log files, directories, globs, or - for stdin.", show_default=False)]
FormatOpt = Annotated[Optional[str], typer.Option("--format", "-f", help="table | csv | json | parquet (default: table on a terminal, csv when piped, or from -o's extension).")]
OutOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="Write to this file instead of stdout.")]
ReportOutOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="Write to this file instead of stdout; a directory (DIR/): one file per table in --format (csv by default), and findings.md.")]
RawCsvOpt = Annotated[bool, typer.Option("--raw-csv", help="CSV text as it is: no ' before text starting with = + - @ or a tab (a spreadsheet runs such text as a formula).")]
SinceOpt = Annotated[Optional[str], typer.Option("--since", help="Keep tasks launched at or after this: server-clock seconds (e.g. 120) or an ISO time (needs a wall clock).")]
UntilOpt = Annotated[Optional[str], typer.Option("--until", help="Keep tasks launched before this (same forms as --since).")]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Exit 1 when any input line is unrecognized.")]
TzOpt = Annotated[str, typer.Option("--tz", help="Time zone for stamps without one (journald short, naive ISO), and of the calendar days of per-day tables.")]
LongPrefillOpt = Annotated[int, typer.Option("--long-prefill", help="New tokens that make a prefill 'long' (stalls, indicators).")]
BigPrefillOpt = Annotated[int, typer.Option("--big-prefill", help="New tokens that make a prefill 'big' (prefills, same-conditions, prefill speed).")]
WaitThresholdOpt = Annotated[float, typer.Option("--wait-threshold", help="Seconds of wait before prefill worth counting.")]
WhereOpt = Annotated[Optional[str], typer.Option("--where", "-w", help="Keep rows matching a condition of column names, literals and operators, e.g. \"wait_before_prefill_ms >= 1000 and slot == 2\".")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No summary on stderr.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks.", hidden=True)]
AppColumnsOpt = Annotated[Optional[str], typer.Option("--app-columns", help="Map app-log fields explicitly: start=ts,purpose=kind,... or a TOML file with a columns table.")]
ServerStartOpt = Annotated[Optional[str], typer.Option("--server-start", help="Wall time of the server's clock zero (overrides alignment), ISO-8601.")]
SideOpt = Annotated[Optional[list[str]], typer.Option(help="START..END: a wall-clock window of PATHS (ISO times or dates; tasks by launch time), or this side's own logs (files or directories; repeat for several).", show_default=False)]

_debug = False

# What a terminal table shows (every other format has every column).
TASK_TABLE = ["session", "slot", "task_id", "launch_s", "wait_before_prefill_ms", "prompt_tokens_new",
              "prompt_tokens_cached", "n_gen", "prompt_eval_ms", "eval_ms", "gen_tps", "status", "line"]
GEN_TABLE = ["session", "slot", "task_id", "t_s", "n_gen", "tg_tps", "tg_3s_tps", "window_s", "line"]
PREFILL_TABLE = ["session", "slot", "task_id", "t_s", "n_tokens", "progress", "elapsed_s", "tps", "step_tokens", "line"]
MATCH_TABLE = ["call_id", "purpose", "user", "lora", "prompt_tokens", "task_id", "match_method", "queue_ms",
               "wait_before_prefill_ms", "prefill_ms", "generation_ms", "ttft_ms", "total_ms"]
GIN_CALLS_TABLE = ["call_id", "start_at", "end_at", "latency_ms", "status", "method", "path", "client", "line"]
GIN_MATCH_TABLE = ["call_id", "start_at", "task_id", "match_method", "queue_ms", "load_wait_ms", "wait_before_prefill_ms",
                   "prefill_ms", "generation_ms", "ttft_ms", "total_ms", "status"]
CALLS_TABLE = ["call_id", "start_at", "purpose", "user", "lora", "prompt_tokens", "completion_tokens", "duration_ms", "status", "line"]


def command(name: str | None = None, library: bool = True) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``@app.command`` that maps the core's typed errors to one stderr line and an exit code.
    ``library``: the command reads logs, and imports pandas and pyarrow first (:func:`_library`)."""

    def deco(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> None:
            frozen = gc.get_freeze_count()  # (a caller's own freeze is left as it was)
            try:
                if library:
                    _library()
                fn(*args, **kwargs)
            except BrokenPipeError:
                # `slotscope tasks big.log | head`: the reader left; stop without a traceback.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                raise typer.Exit(0) from None
            except SlotscopeError as e:
                if _debug:
                    raise
                err.print(f"error: {e}", markup=False)
                raise typer.Exit(2 if isinstance(e, UsageError) else 1) from None
            finally:
                if not frozen:
                    gc.unfreeze()  # (what `_library` froze: collected as usual after the command)

        return app.command(name, cls=_Command)(wrapper)

    return deco


def _library() -> None:
    """Import pandas and pyarrow, then freeze what is alive (the modules mostly: it lives until
    the command ends), so that the collections of the run do not walk it again. The collector
    is paused for the import: of the some 100k objects it makes, the collections their making
    would set off (a few hundred) free next to nothing."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        import pandas  # noqa: F401
        import pyarrow  # noqa: F401
        if not gc.get_freeze_count():  # (a caller's own freeze is left as it was)
            gc.freeze()
    finally:
        if was_on:
            gc.enable()


def _long_run(paths: list[str]) -> int | None:
    """The server logs' size if the run is long enough for progress on stderr (a terminal:
    64 MiB of logs or more), else None."""
    from .sources import collect, file_size

    if not err.is_terminal or "-" in paths:  # stdin: its size is unknown, and it is read once
        return None
    try:
        inputs = collect(paths)
    except SlotscopeError:
        return None  # the command itself will say what is wrong
    server = sum(file_size(lf.path) or 0 for files in inputs.server for lf in files)
    app = sum(file_size(lf.path) or 0 for lf in inputs.app)
    return server if server + app >= 64 * 2**20 else None


class _Bar:
    """A byte progress bar: called with the bytes just read; ``stage(text)`` names what runs next.

    It is drawn by the thread that reads (at most every ``EVERY`` seconds), not by rich's
    refresh thread: worker processes are forked while the bar is up, and a fork must not copy
    a thread that may be holding the console's or stderr's lock at that moment (a worker that
    then wrote a warning would hang; Python 3.12 and later warn about such forks).
    """

    EVERY = 0.1

    def __init__(self, bar: Any, task: Any) -> None:
        self._bar, self._task = bar, task
        self._drawn = 0.0

    def __call__(self, n: int) -> None:
        self._bar.advance(self._task, n)
        self._draw()

    def stage(self, text: str) -> None:
        self._bar.update(self._task, description=text)
        self._draw(now=True)

    def _draw(self, now: bool = False) -> None:
        t = time.monotonic()
        if now or t - self._drawn >= self.EVERY:
            self._drawn = t
            self._bar.refresh()


@contextmanager
def _progress(paths: list[str]) -> Iterator[_Bar | None]:
    """A byte progress bar on stderr for large inputs, only when stderr is a terminal."""
    total = _long_run(paths)
    if total is None:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=err, transient=True, auto_refresh=False) as bar:  # no refresh thread: see _Bar
        yield _Bar(bar, bar.add_task("reading", total=total))


@contextmanager
def _status(paths: list[str]) -> Iterator[Callable[[str], None]]:
    """A status line on stderr saying what a long run computes (a terminal only; else silent)."""
    if _long_run(paths) is None:
        yield lambda text: None
        return
    with err.status("") as status:
        yield lambda text: status.update(text)


def _finish(acc: "Accounting", strict: bool, quiet: bool) -> None:
    _say(acc.summary_lines(), quiet)
    for path, reason in acc.unusable:
        err.print(f"error: {path}: {reason}", markup=False)
    if acc.unusable:
        raise typer.Exit(1)
    if strict and acc.unrecognized:
        err.print(f"error: {acc.unrecognized} unrecognized line(s) (--strict)", markup=False)
        raise typer.Exit(1)


def _no_input(unusable: list[tuple[str, str]], message: str) -> NoReturn:
    """Stop with one line: the unusable file's own reason if one was named, else ``message``."""
    if unusable:
        path, reason = unusable[0]
        raise InputError(path, None, reason)
    raise InputError(None, None, message)


def _need_server(acc: "Accounting", what: str = "") -> None:
    """Stop with one line unless a llama-server log was read: the unusable file's reason, or
    what was found instead (app logs: what ``what`` needs, and what they give alone)."""
    if any(f.is_server_log for f in acc.files):
        return
    apps = [f for f in acc.files if f.kind == "app"]
    if apps and not acc.unusable:
        found = ", ".join(f"{f.path} ({f.used:,} calls)" for f in apps)
        raise InputError(None, None, f"no llama-server log among the inputs, only the app call log {found}: "
                                     f"{what or 'this command'} needs the server's tasks; an app log alone gives "
                                     "`slotscope analyze` (turns and calls) and `slotscope calls`")
    _no_input(acc.unusable, "no llama-server log among the inputs")


def _paths(paths: Optional[list[str]]) -> list[str]:
    if not paths:
        raise UsageError(None, None, "no input: give log files or directories (or - for stdin)")
    return paths


def _exporting(table: str | None, fmt: str | None, out: str | None, names: list[str], every: str = "") -> bool:
    """Whether one table is written as data (else the report is rendered as text). ``every``:
    how the command writes every table instead, for the message that asks for one."""
    if table is None and fmt not in ("csv", "json", "parquet") and not (out and not out.endswith(".txt")):
        return False
    if table is None:
        raise UsageError(None, None, f"exporting needs one table: --table NAME ({', '.join(names)}){every}")
    return True


def _directory(out: str | None) -> bool:
    """Whether ``-o`` names a directory: one that exists, or a path ending in ``/``."""
    return out is not None and out != "-" and (out.endswith(("/", os.sep)) or os.path.isdir(out))


def _every_table_as_json(table: str | None, fmt: str | None, out: str | None) -> bool:
    """``analyze -f json`` (or ``-o FILE.json``) without ``--table``: the whole report as one object."""
    return table is None and (fmt == "json" or (fmt is None and out is not None and out.lower().endswith(".json")))


def _rows(read: Callable[..., tuple[Any, "Accounting"]], paths: Optional[list[str]], fmt: str | None, out: str | None,
          since: str | None, until: str | None, where: str | None, time_col: str, title: str, columns: list[str],
          strict: bool, quiet: bool, raw_csv: bool, **kw: Any) -> None:
    """``tasks`` and ``samples``: the table read in batches (never held whole, whatever the log's
    size), filtered, and for CSV/JSON made text by the worker processes, each batch where it is built."""
    from . import output
    from .filters import parse_when

    ps = _paths(paths)
    lo, hi = parse_when(since), parse_when(until)
    chosen = output.choose_format(fmt, out, (out is None or out == "-") and output.is_terminal(sys.stdout))
    text = chosen in ("csv", "json")
    then = functools.partial(_rows_in, since=lo, until=hi, where=where, fmt=chosen if text else None, time_col=time_col,
                             raw_csv=raw_csv)
    with _progress(ps) as progress:
        batches, acc = read(ps, progress=progress, then=then, **kw)
    _need_server(acc)
    if text:
        output.write_pieces(batches, chosen, out)
    else:
        output.write_batches(batches, chosen, out, title=title, table_columns=columns, raw_csv=raw_csv)
    _finish(acc, strict, quiet)


def _rows_in(batch: "pd.DataFrame", i: int, *, since: object, until: object, where: str | None,
             fmt: "output.Format | None", time_col: str, raw_csv: bool = False) -> object:
    """One batch of ``tasks`` or ``samples``: filtered, and as text for CSV/JSON (runs in a
    worker process)."""
    from . import output
    from .filters import where as where_rows, window

    rows = where_rows(window(batch, since, until, time_col=time_col), where)  # type: ignore[arg-type]
    return output.text_piece(rows, i, fmt, raw_csv=raw_csv) if fmt is not None else rows


@command()
def tasks(
    paths: PathsArg = None, fmt: FormatOpt = None, out: OutOpt = None, since: SinceOpt = None,
    until: UntilOpt = None, where: WhereOpt = None, strict: StrictOpt = False, tz: TzOpt = "UTC", quiet: QuietOpt = False,
    raw_csv: RawCsvOpt = False,
) -> None:
    """One row per server task: launch, wait before prefill, prefill, generation, release."""
    from .server_log import read_task_batches

    _rows(read_task_batches, paths, fmt, out, since, until, where, "launch_s", "tasks", TASK_TABLE, strict, quiet, raw_csv, tz=tz)


@command()
def samples(
    paths: PathsArg = None,
    kind: Annotated[str, typer.Option("--kind", "-k", help="gen (tg_3s heartbeats) or prefill (progress lines).")] = "gen",
    fmt: FormatOpt = None, out: OutOpt = None, since: SinceOpt = None, until: UntilOpt = None,
    where: WhereOpt = None, strict: StrictOpt = False, tz: TzOpt = "UTC", quiet: QuietOpt = False,
    raw_csv: RawCsvOpt = False,
) -> None:
    """Generation heartbeats (n_gen, tg, tg_3s and the window each covers) or prefill progress."""
    from .server_log import read_sample_batches

    if kind not in ("gen", "prefill"):
        raise UsageError(None, None, f"--kind must be gen or prefill, not {kind!r}")
    _rows(read_sample_batches, paths, fmt, out, since, until, where, "t_s", f"samples ({kind})",
          GEN_TABLE if kind == "gen" else PREFILL_TABLE, strict, quiet, raw_csv, kind=kind, tz=tz)


def _app_columns(spec: Optional[str]) -> Optional[dict[str, str]]:
    from .app_log import load_column_file, parse_column_spec

    if not spec:
        return None
    if os.path.isfile(spec):
        return load_column_file(spec)
    return parse_column_spec(spec)


def _load(paths: list[str], tz: str, app_columns: Optional[str], server_start: Optional[str], keep_samples: bool = True) -> "Dataset":
    import pandas as pd

    from .dataset import load
    from .filters import parse_when

    start = parse_when(server_start) if server_start else None
    if start is not None and not isinstance(start, pd.Timestamp):
        raise UsageError(None, None, "--server-start needs a wall time (ISO-8601)")
    with _progress(paths) as progress:
        return load(paths, app_columns=_app_columns(app_columns), tz=tz, server_start=start,
                    keep_samples=keep_samples, progress=progress, stage=progress.stage if progress else None)


def _say(lines: list[str], quiet: bool) -> None:
    if not quiet:
        for line in lines:
            err.print(line, markup=False)


@command()
def calls(
    paths: PathsArg = None, fmt: FormatOpt = None, out: OutOpt = None, tz: TzOpt = "UTC",
    app_columns: AppColumnsOpt = None, quiet: QuietOpt = False, strict: StrictOpt = False, raw_csv: RawCsvOpt = False,
) -> None:
    """The app's call log as a table (one row per call), columns found by common names."""
    from . import output
    from .accounting import Accounting
    from .dataset import read_app, read_ollama_calls
    from .sources import collect

    ps = _paths(paths)
    columns = _app_columns(app_columns)
    inputs = collect(ps, columns)
    app_log, accounts = read_app(inputs, columns=columns, tz=tz)
    if app_log is None:
        gin = read_ollama_calls(inputs, tz=tz)  # (no app log: Ollama's [GIN] lines are the calls)
        if gin is None:
            _no_input(inputs.unusable, "no app call log among the inputs (JSONL or CSV with a start-time column)")
        output.write(gin[0], fmt, out, title="calls ([GIN] lines)", table_columns=GIN_CALLS_TABLE, raw_csv=raw_csv)
        _finish(gin[1], strict, quiet)
        return
    output.write(app_log.calls, fmt, out, title="calls", table_columns=CALLS_TABLE, raw_csv=raw_csv)
    _finish(Accounting(files=accounts, skipped=inputs.skipped, unusable=inputs.unusable), strict, quiet)


@command("match")
def match_cmd(
    paths: PathsArg = None, fmt: FormatOpt = None, out: OutOpt = None, tz: TzOpt = "UTC",
    app_columns: AppColumnsOpt = None, server_start: ServerStartOpt = None,
    unlogged: Annotated[bool, typer.Option("--unlogged", help="List the server tasks no call explains instead.")] = False,
    where: WhereOpt = None, quiet: QuietOpt = False, strict: StrictOpt = False, raw_csv: RawCsvOpt = False,
) -> None:
    """Every app call joined to its server task: queue, wait, prefill, generation, TTFT."""
    from . import output
    from .filters import where as where_rows
    from .report import clock_lines, gin_match_lines, match_lines

    ds = _load(_paths(paths), tz, app_columns, server_start, keep_samples=False)
    if ds.matches is None and ds.server.ollama is not None:  # Ollama's [GIN] calls, joined to its runner's tasks
        from .analyze.ollama import matched_calls, unmatched_tasks

        calls, alone = matched_calls(ds), unmatched_tasks(ds)
        if unlogged:
            output.write(where_rows(alone, where), fmt, out, title="runner tasks no call explains", table_columns=TASK_TABLE,
                         raw_csv=raw_csv)
        else:
            output.write(where_rows(calls, where), fmt, out, title="[GIN] calls matched to runner tasks",
                         table_columns=GIN_MATCH_TABLE, raw_csv=raw_csv)
        _say(gin_match_lines(calls, len(alone)), quiet)
        _finish(ds.accounting, strict, quiet)
        return
    if ds.matches is None:
        if ds.accounting.unusable:  # a file named that is no log: say so, not that a kind is missing
            _no_input(ds.accounting.unusable, "")
        raise UsageError(None, None, "no app call log among the inputs; `match` joins one to the server log")
    if unlogged:
        output.write(where_rows(ds.matches.unlogged, where), fmt, out, title="tasks no call explains", table_columns=TASK_TABLE + ["busy_s"],
                     raw_csv=raw_csv)
    else:
        output.write(where_rows(ds.matches.calls, where), fmt, out, title="calls matched to tasks", table_columns=MATCH_TABLE, raw_csv=raw_csv)
    _say(clock_lines(ds) + match_lines(ds.matches), quiet)
    _finish(ds.accounting, strict, quiet)


@command()
def analyze(
    paths: PathsArg = None,
    table: Annotated[Optional[str], typer.Option("--table", "-t", help=f"Only this table: {', '.join(TABLES)} (`slotscope explain TABLE` says what each holds).", autocompletion=lambda: list(TABLES))] = None,
    fmt: FormatOpt = None, out: ReportOutOpt = None, tz: TzOpt = "UTC",
    app_columns: AppColumnsOpt = None, server_start: ServerStartOpt = None,
    long_prefill: LongPrefillOpt = 15_000, big_prefill: BigPrefillOpt = 5_000, wait_threshold: WaitThresholdOpt = 1.0,
    cache_rate: Annotated[float, typer.Option(help="turns: the subset of chat turns with at least this prompt-cache rate.")] = 0.95,
    uncached_tokens: Annotated[int, typer.Option(help="turns: the subset of chat turns with at least this many new tokens.")] = 5_000,
    cache_window: Annotated[float, typer.Option(help="cache: consecutive turns of one user within this many seconds.")] = 300.0,
    solo_gen_tps: Annotated[Optional[float], typer.Option(help="Solo generation speed (default: estimated).")] = None,
    solo_prefill_tps: Annotated[Optional[float], typer.Option(help="Solo prefill speed (default: estimated).")] = None,
    html_out: Annotated[Optional[str], typer.Option("--html", help="Also write the report and the timeline to this self-contained HTML file.")] = None,
    quiet: QuietOpt = False, strict: StrictOpt = False, debug: DebugOpt = False, raw_csv: RawCsvOpt = False,
) -> None:
    """The incident report: every table of the field report, computed from raw logs, with findings.

    With no path, analyzes the real example bundled with slotscope.
    """
    from importlib import resources

    from . import output
    from . import analyze as analysis
    from .report import clock_lines, export, export_format, render

    if not paths:
        paths = [str(resources.files("slotscope") / "examples" / "before")]
        err.print(f"no path given: analyzing the bundled example ({paths[0]})", markup=False)
    names = analysis.table_names()
    if table is not None and table not in names:
        raise UsageError(None, None, f"unknown table {table!r}; tables: {', '.join(names)}")
    opts = analysis.Options(long_prefill_tokens=long_prefill, big_prefill_tokens=big_prefill,
                            wait_threshold_s=wait_threshold, solo_gen_tps=solo_gen_tps, solo_prefill_tps=solo_prefill_tps,
                            cache_rate=cache_rate, uncached_tokens=uncached_tokens, cache_window_s=cache_window, tz=tz)
    to_dir = _directory(out)
    if to_dir:
        fmt = export_format(fmt)
    as_json = not to_dir and _every_table_as_json(table, fmt, out)
    one = not (to_dir or as_json) and _exporting(table, fmt, out, names, every="; -o DIR/ writes every table, -f json all in one object")
    ds = _load(paths, tz, app_columns, server_start)
    if ds.matches is None or table not in (None, *analysis.APP_LOG_ALONE):  # (an app log alone: its own times)
        _need_server(ds.accounting, f"`{table}`" if table else "")
    if one:
        output.write(analysis.run(ds, opts, [table], strict=debug)[table], fmt, out, title=table,  # type: ignore[list-item,index]
                     raw_csv=raw_csv)
    else:
        with _status(paths) as say:
            tables = analysis.run(ds, opts, None if table is None else [table], strict=debug,
                                  on_table=lambda name, i, n: say(f"computing {name} ({i}/{n})"))
        if html_out and table is None:
            from .picture import report_html

            report_html(ds, tables, html_out, opts)
            _say([f"wrote {html_out}"], quiet)
        if to_dir:
            written = export(ds, tables, out, fmt, raw_csv, opts)  # type: ignore[arg-type]
            _say([f"wrote {len(written) - 1} table(s) and findings.md to {out}"], quiet)
        elif as_json:
            output.write_tables(tables, out)
        else:
            with open(out, "w") if out else nullcontext() as target:
                render(ds, tables, file=target, width=None if output.is_terminal(sys.stdout) and not out else 100, opts=opts)
    _say(clock_lines(ds), quiet)
    _finish(ds.accounting, strict, quiet)


@command()
def demo() -> None:
    """The report on the real example bundled with slotscope (same as `slotscope analyze`)."""
    analyze(paths=None)


@command(library=False)
def explain(
    term: Annotated[Optional[list[str]], typer.Argument(help="A table's name or a term the report prints, e.g. basis, few samples, deferred (none: every entry).", show_default=False)] = None,
) -> None:
    """What a table or a term of the report means, one line each (the glossary).

    A table's entry lists the columns the report shows of it, each with its line.
    """
    from . import glossary

    asked = " ".join(term) if term else None
    said = glossary.explain(asked, glossary.REPORT_COLUMNS)
    if said is None:
        near = glossary.near(asked or "")
        raise UsageError(None, None, f"no glossary entry for {asked!r}; "
                         + (f"did you mean {', '.join(near)}?" if near else "`slotscope explain` lists every entry"))
    for line in said:
        typer.echo(line)


@command("compare")
def compare_cmd(
    paths: PathsArg = None, before: SideOpt = None, after: SideOpt = None,
    table: Annotated[Optional[str], typer.Option("--table", "-t", help="Only this table: overall | same-conditions | indicators | changes | cautions.")] = None,
    fmt: FormatOpt = None, out: OutOpt = None, tz: TzOpt = "UTC",
    app_columns: AppColumnsOpt = None, server_start: ServerStartOpt = None,
    short_tokens: Annotated[int, typer.Option(help="Turns with fewer new prompt tokens are 'short' (same-conditions).")] = 1_000,
    long_prefill: LongPrefillOpt = 15_000, big_prefill: BigPrefillOpt = 5_000, wait_threshold: WaitThresholdOpt = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap intervals.")] = 0,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples per interval.")] = 2000,
    quiet: QuietOpt = False, strict: StrictOpt = False, debug: DebugOpt = False, raw_csv: RawCsvOpt = False,
) -> None:
    """Before/after a change, in a way that survives changing traffic: load, TTFT under the same
    conditions, the mechanisms (stalls, waits, speeds) and the settings that changed.

    Either two windows of one set of logs (slotscope compare logs/ --before 2026-11-28 --after
    2026-11-30..2026-11-30T12:00) or two sets (--before old/logs --after new/logs).
    """
    from . import output
    from . import compare as cmp
    from .analyze import Options

    sides = cmp.read_sides(paths, before, after, tz)
    if table is not None and table not in cmp.TABLE_NAMES + ["cautions"]:
        raise UsageError(None, None, f"unknown table {table!r}; tables: {', '.join(cmp.TABLE_NAMES)}, cautions")
    exporting = _exporting(table, fmt, out, cmp.TABLE_NAMES)
    opts = Options(long_prefill_tokens=long_prefill, big_prefill_tokens=big_prefill, wait_threshold_s=wait_threshold, tz=tz)
    b_ds: Dataset
    a_ds: Dataset
    if sides.windows:
        ds = _load(_paths(paths), tz, app_columns, server_start)
        b_ds, a_ds = cmp.split(ds, sides.before_window, sides.after_window)  # type: ignore[arg-type]
        accounting = ds.accounting
    else:
        b_ds = _load(list(sides.before_paths), tz, app_columns, server_start)
        a_ds = _load(list(sides.after_paths), tz, app_columns, server_start)
        accounting = b_ds.accounting.merge(a_ds.accounting)
    for side_ds in (b_ds, a_ds):
        _need_server(side_ds.accounting, "`compare`")
    tables = cmp.compare(b_ds, a_ds, opts, seed=seed, n_boot=resamples, short_tokens=short_tokens)
    if exporting:
        output.write(tables[table], fmt, out, title=table, raw_csv=raw_csv)  # type: ignore[index]
    else:
        with open(out, "w") if out else nullcontext() as target:
            cmp.render(tables, file=target, width=None if output.is_terminal(sys.stdout) and not out else 100,
                       header=[f"before: {cmp.describe(b_ds)}", f"after: {cmp.describe(a_ds)}"])
    _finish(accounting, strict, quiet)


@command("whatif")
def whatif_cmd(
    paths: PathsArg = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="A setting to change: n_batch=N, n_ubatch=N, slots=N, lora=unified|as-logged|LABEL, lora=\"LABEL where CONDITION\" (the calls the condition picks, as --where does, get LABEL), ctx=N (repeat for several).", show_default=False)] = None,
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="One setting over several values, e.g. n_batch=256,512,1024,2048 (with the --set ones).")] = None,
    open_loop: Annotated[bool, typer.Option("--open-loop", help="Replay the calls at their logged send times (default: closed loop, users' think times).")] = False,
    table: Annotated[Optional[str], typer.Option("--table", "-t", help="Only this table: summary | pass-costs | pass-fit | settings | findings.")] = None,
    fmt: FormatOpt = None, out: OutOpt = None, tz: TzOpt = "UTC",
    app_columns: AppColumnsOpt = None, server_start: ServerStartOpt = None,
    long_prefill: LongPrefillOpt = 15_000, wait_threshold: WaitThresholdOpt = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the resampling intervals.")] = 0,
    resamples: Annotated[int, typer.Option(help="Resamples of users' sessions per interval.")] = 1000,
    quiet: QuietOpt = False, strict: StrictOpt = False,
) -> None:
    """What a setting would have changed: the logged workload replayed through a model of
    llama-server's scheduler, with pass costs fitted from the same logs. Per metric: as logged,
    replayed with the logged settings (the model's own error) and with the asked ones.
    """
    from . import output, whatif
    from .analyze import Options

    base = whatif.parse_settings(set_ or [])
    asked = whatif.parse_sweep(sweep, base) if sweep else [base]
    if table is not None and table not in whatif.TABLE_NAMES:
        raise UsageError(None, None, f"unknown table {table!r}; tables: {', '.join(whatif.TABLE_NAMES)}")
    exporting = _exporting(table, fmt, out, whatif.TABLE_NAMES)
    ds = _load(_paths(paths), tz, app_columns, server_start)
    _need_server(ds.accounting)
    opts = Options(long_prefill_tokens=long_prefill, wait_threshold_s=wait_threshold, tz=tz)
    tables = whatif.run(ds, asked, open_loop=open_loop, opts=opts, seed=seed, n_boot=resamples)
    if exporting:
        output.write(tables[table], fmt, out, title=table)  # type: ignore[index]
    else:
        with open(out, "w") if out else nullcontext() as target:
            whatif.render(tables, file=target, width=None if output.is_terminal(sys.stdout) and not out else 100)
    _finish(ds.accounting, strict, quiet)


@command()
def timeline(
    paths: PathsArg = None,
    out: Annotated[Optional[str], typer.Option("--output", "-o", help="incident.html (interactive, opens offline), or .png / .svg (static, for an issue thread).")] = None,
    since: SinceOpt = None, until: UntilOpt = None, tz: TzOpt = "UTC",
    app_columns: AppColumnsOpt = None, server_start: ServerStartOpt = None,
    quiet: QuietOpt = False, strict: StrictOpt = False,
) -> None:
    """The incident as a picture: one lane per slot, each task's queue, wait, prefill and generation,
    each slot's generation speed, the worst stalls with the prefill that caused them and the
    longest waits with the task that held the batch.
    """
    from .filters import parse_when
    from .picture import write_timeline
    from .report import clock_lines

    if not out:
        raise UsageError(None, None, "timeline needs -o FILE: incident.html, incident.png or incident.svg")
    ds = _load(_paths(paths), tz, app_columns, server_start)
    _need_server(ds.accounting, "`timeline`")
    write_timeline(ds, out, since=parse_when(since), until=parse_when(until))
    _say(clock_lines(ds) + [f"wrote {out}"], quiet)
    _finish(ds.accounting, strict, quiet)


def _version(shown: bool) -> None:
    if shown:
        from . import __version__

        typer.echo(f"slotscope {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", help="Print slotscope's version and exit.", is_eager=True, callback=_version)] = False,
) -> None:
    # No docstring: the app's help (typer.Typer(help=...)) is the one shown.
    pass


def main() -> None:
    """Entry point. Library errors and a closed pipe are mapped in each command (``command``)."""
    global _debug
    _debug = "--debug" in sys.argv
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        # The process ends here, and the OS takes its memory back: frozen, what is alive is not
        # walked again by the collections of the interpreter's shutdown (every object of pandas
        # and pyarrow, each time). Files still open are closed and temporary files removed
        # as before (by reference counts and atexit, which the collector does not run).
        gc.freeze()
