"""Fuzz: do the tables depend on where the server log is cut into blocks, or on the workers?

Each case is a real fixture (fixtures/real/*/logs) with a few random mutations made of its own
lines: a line duplicated (next to itself or a little later), deleted, moved a few lines, a
release line repeated, a launch line repeated after its task's release (a task id used
again). Each case is read with the default block size in one process (the reference), with
blocks of a few KB in one process and in two worker processes, and with a block edge inside
a mutated line. A case *differs* when a table (tasks, gen and prefill samples, sessions, the
line accounting; with ``--analyze`` also every ``analyze`` table) is not equal to the
reference, or when one reading raises and the other does not.

``--formats`` adds the single-file variants of fixtures/formats (derived from the same real
lines: wrappers, older builds, several ports, wall-clock-only times).

    python bench/fuzz_blocks.py -n 200 [--seed 1] [--formats] [--analyze] [--show 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from slotscope import server_log  # noqa: E402
from slotscope.server_log import read_server_logs  # noqa: E402

REAL = ROOT / "fixtures" / "real"
FORMATS = ROOT / "fixtures" / "formats"
TABLES = ("tasks", "gen_samples", "prefill_samples", "sessions")


def mutate(lines: list[bytes], rng: random.Random, n: int) -> tuple[list[bytes], list[int]]:
    """``n`` mutations of a log's lines (each ends with a newline); also the indexes of lines
    a mutation put or moved, for block edges inside them (a later mutation may shift them
    by a line or two: near enough)."""
    lines = list(lines)
    marks: list[int] = []
    for _ in range(n):
        what = rng.choice(["dup", "dup_later", "delete", "move", "dup_release", "reuse_id"])
        i = rng.randrange(len(lines))
        if what == "dup":
            lines.insert(i + 1, lines[i])
            marks.append(i)
        elif what == "dup_later":
            j = min(len(lines), i + rng.randint(2, 60))
            lines.insert(j, lines[i])
            marks.append(j)
        elif what == "delete":
            del lines[i]
        elif what == "move":
            line = lines.pop(i)
            j = max(0, min(len(lines), i + rng.randint(-8, 8)))
            lines.insert(j, line)
            marks.append(j)
        elif what == "dup_release":
            rel = [k for k, ln in enumerate(lines) if b"stop processing" in ln]
            if rel:
                k = rng.choice(rel)
                lines.insert(k + 1, lines[k])
                marks.append(k)
        else:  # a launch line again after its task's release: the same task id a second time
            launches = [k for k, ln in enumerate(lines) if b"processing task" in ln and b"| task " in ln]
            if launches:
                k = rng.choice(launches)
                task = lines[k].split(b"| task ")[1].split(b" ")[0]
                rel = next((r for r in range(k, len(lines)) if b"| task " + task + b" |" in lines[r]
                            and b"stop processing" in lines[r]), None)
                if rel is not None:
                    at = min(len(lines), rel + rng.randint(1, 30))
                    lines.insert(at, lines[k])
                    marks.append(at)
    return lines, [k for k in marks if k < len(lines)]


def read(path: Path, chunk: int | None, jobs: int, analyze_dir: Path | None) -> dict[str, object]:
    """Every table of one reading (or the error it raised, as text)."""
    out: dict[str, object] = {}
    try:
        logs = read_server_logs([path], chunk_size=chunk, jobs=jobs)
        for t in TABLES:
            out[t] = getattr(logs, t)
        acc = logs.accounting
        out["accounting"] = ([(f.lines, f.used, f.ignored, f.unrecognized, f.examples, f.wrapper) for f in acc.files],
                             acc.tasks_complete, acc.tasks_cancelled, acc.tasks_incomplete, acc.tasks_cut_at_start,
                             acc.sessions)
    except Exception:
        out["error"] = traceback.format_exc(limit=-3)
        return out
    if analyze_dir is not None:
        from slotscope import analyze, load

        old_size, old_jobs = server_log.CHUNK_SIZE, os.environ.get("SLOTSCOPE_JOBS")
        server_log.CHUNK_SIZE = chunk or old_size
        os.environ["SLOTSCOPE_JOBS"] = str(jobs)
        try:
            ds = load([analyze_dir])
            for name, table in analyze.run(ds, strict=True).items():
                out["analyze:" + name] = table
        except Exception:
            out["error"] = traceback.format_exc(limit=-3)
        finally:
            server_log.CHUNK_SIZE = old_size
            if old_jobs is None:
                os.environ.pop("SLOTSCOPE_JOBS", None)
            else:
                os.environ["SLOTSCOPE_JOBS"] = old_jobs
    return out


def differences(a: dict[str, object], b: dict[str, object]) -> list[str]:
    """What differs between two readings (table names, or an error's last line)."""
    if "error" in a or "error" in b:
        ea, eb = a.get("error"), b.get("error")
        return [] if ea == eb else [f"error: {str(ea or eb).strip().splitlines()[-1]}"]
    out = []
    for name in a.keys() | b.keys():
        x, y = a.get(name), b.get(name)
        if isinstance(x, pd.DataFrame) and isinstance(y, pd.DataFrame):
            try:
                pd.testing.assert_frame_equal(x, y, check_exact=True)
            except AssertionError:
                out.append(name)
        elif x != y:
            out.append(name)
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=100, help="cases (default 100)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--formats", action="store_true", help="mutate the fixtures/formats variants too")
    ap.add_argument("--analyze", action="store_true", help="compare the analyze tables too (slow: ~2 s a reading)")
    ap.add_argument("--show", type=int, default=3, help="cases to describe per kind of difference")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    sources = [p / "llama-server.log" for p in sorted(REAL.glob("*/logs"))]
    if args.formats:
        sources += sorted(FORMATS.glob("*.log"))
    by_size = by_jobs = raised = 0
    shown: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="slotscope-fuzz-") as tmp:
        for case in range(args.n):
            log = rng.choice(sources)
            scenario = log.parent.parent.name if log.parent.name == "logs" else log.name
            lines = log.read_bytes().splitlines(keepends=True)
            mutated, marks = mutate(lines, rng, rng.randint(1, 5))
            work = Path(tmp) / f"case{case}"
            work.mkdir()
            path = work / "llama-server.log"
            path.write_bytes(b"".join(mutated))
            app = log.parent / "app.jsonl"
            if args.analyze and app.exists():
                shutil.copy(app, work / "app.jsonl")
            adir = work if args.analyze else None
            small = rng.randint(1500, 8192)
            # A block edge in the middle of a mutated line (the first edge: where both ways
            # of cutting, by spans and by reads, put it).
            edge = None
            if marks:
                k = rng.choice(marks)
                start = sum(len(x) for x in mutated[:k])
                edge = max(64, start + len(mutated[k]) // 2)
            ref = read(path, None, 1, adir)
            size_diff: list[str] = []
            jobs_diff: list[str] = []
            for chunk in [small] + ([edge] if edge else []):
                one, two = read(path, chunk, 1, adir), read(path, chunk, 2, adir)
                size_diff += differences(ref, one)
                jobs_diff += differences(one, two)
            errors = [d for d in size_diff + jobs_diff if d.startswith("error")]
            by_size += bool(size_diff)
            by_jobs += bool(jobs_diff)
            raised += bool(errors) or "error" in ref
            for kind, diff in (("block size", size_diff), ("workers", jobs_diff)):
                if diff and shown.get(kind, 0) < args.show:
                    shown[kind] = shown.get(kind, 0) + 1
                    print(f"case {case} ({scenario}, blocks {small}/{edge}): {kind}: {sorted(set(diff))}")
            shutil.rmtree(work)
    print(f"{args.n} cases: {by_size} differ with the block size, {by_jobs} with the workers, "
          f"{raised} raised an error")
    return 1 if by_size or by_jobs else 0


if __name__ == "__main__":
    sys.exit(main())
