"""The ``slotscope`` command: option parsing, one library call, one output call per command."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from importlib import resources
from typing import Annotated, Iterator, Optional

import pandas as pd
import typer
from rich.console import Console

from . import output
from .accounting import Accounting
from .errors import SlotscopeError
from .filters import parse_when, window
from .server_log import read_server_logs
from .sources import file_size

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Explain why a self-hosted llama-server felt slow: join its log with the app's call log, task by task.",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)

# Options shared by every command, declared once so flags read the same everywhere.
PathsArg = Annotated[Optional[list[str]], typer.Argument(help="Log files, directories, globs, or - for stdin.", show_default=False)]
FormatOpt = Annotated[Optional[str], typer.Option("--format", "-f", help="table | csv | json | parquet (default: table on a terminal, csv when piped, or from -o's extension).")]
OutOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="Write to this file instead of stdout.")]
SinceOpt = Annotated[Optional[str], typer.Option("--since", help="Keep tasks launched at or after this: server-clock seconds (e.g. 120) or an ISO time (needs a wall clock).")]
UntilOpt = Annotated[Optional[str], typer.Option("--until", help="Keep tasks launched before this (same forms as --since).")]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Exit 1 when any input line is unrecognized.")]
TzOpt = Annotated[str, typer.Option("--tz", help="Time zone for stamps without one (journald short, naive ISO).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No summary on stderr.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks.", hidden=True)]

_debug = False


def example_dir() -> str:
    """The real example logs bundled with the package (llama-server + app log)."""
    return str(resources.files("slotscope") / "examples" / "before")


@contextmanager
def _progress(paths: list[str]) -> Iterator[object]:
    """A byte progress bar on stderr for large inputs, only when stderr is a terminal."""
    sizes = [file_size(p) for p in paths if os.path.isfile(p)]
    total = sum(s or 0 for s in sizes)
    if not err.is_terminal or total < 64 * 2**20:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("reading", total=total)
        yield lambda n: bar.advance(task, n)


def _finish(acc: Accounting, strict: bool, quiet: bool) -> None:
    if not quiet:
        for line in acc.summary_lines():
            err.print(line, markup=False)
    if strict and acc.unrecognized:
        err.print(f"error: {acc.unrecognized} unrecognized line(s) (--strict)", markup=False)
        raise typer.Exit(1)


def _paths(paths: Optional[list[str]]) -> list[str]:
    if not paths:
        raise output.UsageError(None, None, "no input: give log files or directories (or - for stdin)")
    return paths


@app.command()
def tasks(
    paths: PathsArg = None, fmt: FormatOpt = None, out: OutOpt = None, since: SinceOpt = None,
    until: UntilOpt = None, strict: StrictOpt = False, tz: TzOpt = "UTC", quiet: QuietOpt = False,
) -> None:
    """One row per server task: launch, wait before prefill, prefill, generation, release."""
    ps = _paths(paths)
    with _progress(ps) as progress:
        logs = read_server_logs(ps, keep_samples=False, tz=tz, progress=progress)  # type: ignore[arg-type]
    df = window(logs.tasks, parse_when(since), parse_when(until), time_col="launch_s")
    output.write(df, fmt, out, title="tasks")
    _finish(logs.accounting, strict, quiet)


@app.command()
def samples(
    paths: PathsArg = None,
    kind: Annotated[str, typer.Option("--kind", "-k", help="gen (tg_3s heartbeats) or prefill (progress lines).")] = "gen",
    fmt: FormatOpt = None, out: OutOpt = None, since: SinceOpt = None, until: UntilOpt = None,
    strict: StrictOpt = False, tz: TzOpt = "UTC", quiet: QuietOpt = False,
) -> None:
    """Generation heartbeats (n_gen, tg, tg_3s and the window each covers) or prefill progress."""
    if kind not in ("gen", "prefill"):
        raise output.UsageError(None, None, f"--kind must be gen or prefill, not {kind!r}")
    ps = _paths(paths)
    with _progress(ps) as progress:
        logs = read_server_logs(ps, keep_samples=True, tz=tz, progress=progress)  # type: ignore[arg-type]
    df = logs.gen_samples if kind == "gen" else logs.prefill_samples
    df = window(df, parse_when(since), parse_when(until), time_col="t_s")
    output.write(df, fmt, out, title=f"samples ({kind})")
    _finish(logs.accounting, strict, quiet)


def main() -> None:
    """Entry point: map library errors to one line, exit quietly on a closed pipe."""
    global _debug
    _debug = "--debug" in sys.argv
    try:
        app()
    except BrokenPipeError:
        # `slotscope tasks big.log | head`: the reader left; stop without a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    except output.UsageError as e:
        if _debug:
            raise
        err.print(f"error: {e}", markup=False)
        sys.exit(2)
    except SlotscopeError as e:
        if _debug:
            raise
        err.print(f"error: {e}", markup=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
