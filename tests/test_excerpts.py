"""Every real excerpt and every fixture, given to the commands a newcomer tries first: no
traceback, and every line counted (used, known and ignored, or unrecognized), or the file
refused whole with one ``error: FILE: reason`` line.

The excerpts (fixtures/excerpts) are vLLM and Ollama lines pasted in public threads; some
Ollama ones embed llama-server or llama.cpp lines. The fixtures are the real captures and
the format variants derived from them.
"""

from __future__ import annotations

import gc
import gzip
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zstandard
from typer.testing import CliRunner, Result

from slotscope.cli import app

from .conftest import EXCERPTS, FORMATS, REAL

runner = CliRunner()
SUMMARY = re.compile(r"^lines read ([\d,]+): used ([\d,]+), known and ignored ([\d,]+), unrecognized ([\d,]+)$", re.M)

EXCERPT_FILES = sorted(EXCERPTS.glob("*/*.log"))
FIXTURE_INPUTS = ([REAL / s / "logs" for s in sorted(p.name for p in REAL.iterdir() if p.is_dir())]
                  + sorted(REAL.glob("*/logs/*")) + sorted(p for p in FORMATS.iterdir() if p.name != "manifest.json"
                                                           and not p.name.endswith(".md")))


def _name(p: Path) -> str:
    return str(p.relative_to(p.parents[2] if p.parent.name == "logs" else p.parents[1]))


def _physical_lines(path: Path) -> int:
    """Lines in a file (a directory: in its files), as a reader counts them: a last line
    without its newline is a line."""
    if path.is_dir():
        return sum(_physical_lines(p) for p in path.iterdir() if p.is_file())
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    elif data[:4] == b"\x28\xb5\x2f\xfd":
        data = zstandard.ZstdDecompressor().decompress(data)
    return data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


def _clean(res, path: Path) -> str:
    """The run's stderr, asserted free of tracebacks and failed tables; an error is one line."""
    out = res.stdout + res.stderr
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in out and "could not compute" not in out, out[-2000:]
    assert res.exit_code in (0, 1, 2)
    if res.exit_code:
        errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, res.stderr
    return res.stderr


def _counted(stderr: str, path: Path) -> None:
    """The summary counts every line of the input once."""
    m = SUMMARY.search(stderr)
    assert m, stderr
    lines, used, ignored, unrecognized = (int(x.replace(",", "")) for x in m.groups())
    assert lines == _physical_lines(path)
    assert used + ignored + unrecognized == lines


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSCOPE_JOBS", "1")  # (small files: no worker processes to start)


@pytest.fixture(scope="module", autouse=True)
def _collected_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # (what the tests left is collected now)
    gc.collect()


@pytest.fixture(autouse=True)
def _frozen(_collected_after: None) -> None:
    """Every load ends with a full garbage collection (the app reader's tables are in cycles),
    which in a test process walks all that pytest, the imported modules and the earlier tests
    hold. Frozen before each test, those objects are not walked again: a load's collection
    walks what this test made, as in a command's own process."""
    gc.freeze()


Invoke = Callable[..., Result]


@pytest.fixture(scope="module")
def invoke() -> Invoke:
    """``runner.invoke(app, args)``, run once per arguments in this module: the tests that
    check the same command on the same file share its result. Only for commands that write
    no file (a result is kept, not what the command left on disk)."""
    results: dict[tuple[str, ...], Result] = {}

    def run(*args: str) -> Result:
        if args not in results:
            results[args] = runner.invoke(app, list(args))
        return results[args]

    return run


@pytest.mark.parametrize("path", EXCERPT_FILES, ids=_name)
def test_an_excerpt_is_read_or_refused_in_one_line_by_every_command(path: Path, tmp_path: Path, invoke: Invoke) -> None:
    for args in (["analyze"], ["match"], ["timeline", "-o", str(tmp_path / "t.html")], ["tasks"], ["samples"],
                 ["compare", "--before", str(path), "--after"]):
        res = invoke(*args, str(path)) if args[0] != "timeline" else runner.invoke(app, [*args, str(path)])
        stderr = _clean(res, path)
        if res.exit_code == 1 and stderr.strip().splitlines()[-1].startswith(f"error: {path}: "):
            assert "lines read" not in stderr  # refused whole: not a log slotscope reads
            continue
        if args[0] in ("analyze", "tasks", "samples"):
            assert res.exit_code == 0, stderr
            _counted(stderr, path)


def test_ollama_excerpts_are_read_and_vllm_ones_refused(invoke: Invoke) -> None:
    """Which excerpts are read: Ollama's (by its own reader, with the llama.cpp lines inside
    read as llama-server's); vLLM's are refused, whole, in one line."""
    read = []
    for path in EXCERPT_FILES:
        res = invoke("tasks", str(path))
        if res.exit_code == 0:
            read.append(_name(path))
        else:
            assert res.stderr.strip() == f"error: {path}: neither a llama-server log nor an app call log"
    assert read == [_name(p) for p in EXCERPT_FILES if p.parent.name == "ollama"] and len(read) == 11


@pytest.mark.parametrize("path", FIXTURE_INPUTS, ids=_name)
def test_analyze_reads_every_fixture_and_counts_each_line(path: Path) -> None:
    res = runner.invoke(app, ["analyze", str(path)])
    stderr = _clean(res, path)
    assert res.exit_code == 0, stderr
    _counted(stderr, path)


def test_match_on_a_file_that_is_no_log_names_the_file(invoke: Invoke) -> None:
    """A vLLM log given to `match`: the file is the problem, not a missing kind of log."""
    log = EXCERPTS / "vllm" / "01.log"
    res = invoke("match", str(log))
    assert res.exit_code == 1
    assert res.stderr.strip() == f"error: {log}: neither a llama-server log nor an app call log"


def test_a_log_without_tasks_says_what_its_lines_were(invoke: Invoke) -> None:
    """An Ollama excerpt with llama.cpp's start-up JSON and Ollama's own lines: no task, and
    the report says how its lines were read instead of computing empty sections."""
    path = EXCERPTS / "ollama" / "13.log"
    res = invoke("analyze", str(path))
    assert res.exit_code == 0, res.stderr
    assert "No task in the server log (7 lines: 1 used, 4 known and ignored, 2 unrecognized): it has no " \
           "`slot launch_slot_` line, so there is nothing to report." in " ".join(res.stdout.split())
    assert "─ turns" not in res.stdout and "turns ─" not in res.stdout
    _counted(res.stderr, path)
