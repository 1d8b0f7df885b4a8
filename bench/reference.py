#!/usr/bin/env python3
"""Every output table of slotscope on a set of scenarios, saved once and compared later.

    python bench/reference.py make  OUT_DIR [--scenario NAME ...] [--bench DIR ...]
    python bench/reference.py check OUT_DIR [--scenario NAME ...] [--bench DIR ...]

``make`` computes, with the slotscope that is installed, for each scenario: the server tables
(tasks, gen and prefill samples, sessions), the matched calls, the unlogged tasks, the clock
alignment, every report table, the timeline's data, and for the real pairs `compare`'s tables,
and pickles each table (values and dtypes kept) under OUT_DIR/<scenario>/. ``check``
computes them again and compares each with ``pd.testing.assert_frame_equal``; it prints one
line per scenario and exits 1 if any table differs. Made on one commit and checked on another,
it shows that a change kept the output as it was.

Scenarios: every capture in fixtures/real/, every variant in fixtures/formats/, and each
``--bench DIR`` (a folder with llama-server.log and app.jsonl, as bench/make_log.py writes).
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
_FIXTURES = re.compile(r"^\S*?/fixtures/")
PAIRS = [("before", "after"), ("before", "b2048-unified"), ("b2048-unified", "after")]


def _made_in(reference: Path, name: str) -> Path:
    """The folder a bench scenario's reference was made in (its tables name it), or a new one."""
    try:
        sessions = pickle.loads((reference / name / "server.sessions.pkl").read_bytes())
        return Path(str(sessions["source"].iloc[0])).parent
    except (OSError, KeyError, IndexError, pickle.UnpicklingError):
        return Path(tempfile.mkdtemp(prefix="slotscope-ref-"))


def scenarios(bench: list[str], reuse: Path | None = None) -> dict[str, list[str]]:
    """Scenario name -> the paths slotscope is given."""
    out: dict[str, list[str]] = {}
    for d in sorted((REPO / "fixtures" / "real").iterdir()):
        if (d / "logs").is_dir():
            out[f"real-{d.name}"] = [str(d / "logs")]
    for f in sorted((REPO / "fixtures" / "formats").iterdir()):
        if f.name.endswith((".log", ".gz", ".zst")) or f.is_dir():
            out[f"format-{f.name}"] = [str(f)]
    for b in bench:
        # Hard links to the log and the app log only (the folder also holds the .gz copy), in
        # the folder the reference was made in where it is still there: the tables name it.
        tmp = Path(tempfile.mkdtemp(prefix="slotscope-ref-")) if reuse is None else _made_in(reuse, f"bench-{Path(b).name}")
        if (tmp / "llama-server.log").exists():
            out[f"bench-{Path(b).name}"] = [str(tmp)]
            continue
        for name in ("llama-server.log", "app.jsonl"):
            os.link(Path(b) / name, tmp / name)
        out[f"bench-{Path(b).name}"] = [str(tmp)]
    return out


def tables_of(paths: list[str]) -> dict[str, pd.DataFrame]:
    """Every table slotscope makes of one scenario, by name."""
    import slotscope
    from slotscope import analyze
    from slotscope.picture import timeline_data

    out: dict[str, pd.DataFrame] = {}
    logs = slotscope.read_server_logs(paths)
    for name in ("tasks", "gen_samples", "prefill_samples", "sessions"):
        v = getattr(logs, name)
        if v is not None:
            out[f"server.{name}"] = v
    del logs
    ds = slotscope.load(paths)
    if ds.matches is not None:
        out["match.calls"] = ds.matches.calls
        out["match.unlogged"] = ds.matches.unlogged
        out["match.aligned"] = ds.matches.aligned
    for name, df in analyze.run(ds, strict=True).items():
        out[f"analyze.{name}"] = df
    try:
        td = timeline_data(ds)
    except Exception as e:  # noqa: BLE001 - a scenario the timeline refuses is recorded as such
        out["timeline.error"] = pd.DataFrame({"error": [f"{type(e).__name__}: {e}"]})
    else:
        for name in ("lanes", "tasks", "speed", "stalls", "waits", "overview", "overview_speed"):
            v = getattr(td, name)
            if v is not None:
                out[f"timeline.{name}"] = v
        out["timeline.meta"] = pd.DataFrame({"wall": [td.wall], "speed_top": [td.speed_top], "lo": [td.domain[0]],
                                             "hi": [td.domain[1]], "title": [td.title], "detail_span": [td.detail_span],
                                             "notes": ["\n".join(td.notes)]})
    return out


def _where_made(df: pd.DataFrame) -> pd.DataFrame:
    """The table with the checkout's own path cut from the fixture paths it names, so that a
    reference made in one checkout (a worktree) checks the code of another."""
    out = df.copy()
    for c in out.columns:
        col = out[c]
        if isinstance(col.dtype, pd.CategoricalDtype) and col.cat.categories.inferred_type == "string":
            cats = col.cat.categories.str.replace(_FIXTURES, "fixtures/", regex=True)
            if cats.is_unique:
                out[c] = col.cat.rename_categories(cats)
        elif col.dtype == object or isinstance(col.dtype, pd.StringDtype):
            out[c] = col.map(lambda v: _FIXTURES.sub("fixtures/", v) if isinstance(v, str) else v)
    return out


def compare_tables(before: list[str], after: list[str]) -> dict[str, pd.DataFrame]:
    import slotscope
    from slotscope import compare

    tables = compare.compare(slotscope.load(before), slotscope.load(after))
    return {f"compare.{k}": v for k, v in tables.items()}


def all_scenarios(bench: list[str], only: list[str] | None, reuse: Path | None = None) -> dict[str, Callable[[], dict[str, pd.DataFrame]]]:
    sc = scenarios(bench, reuse)
    jobs = {name: (lambda p=paths: tables_of(p)) for name, paths in sc.items()}
    for b, a in PAIRS:
        if f"real-{b}" in sc and f"real-{a}" in sc:
            jobs[f"compare-{b}-{a}"] = (lambda b=sc[f"real-{b}"], a=sc[f"real-{a}"]: compare_tables(b, a))
    if only:
        jobs = {k: v for k, v in jobs.items() if k in only}
    return jobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["make", "check"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--scenario", action="append", default=None)
    ap.add_argument("--bench", action="append", default=[])
    args = ap.parse_args()
    failed = 0
    for name, job in all_scenarios(args.bench, args.scenario, args.out if args.action == "check" else None).items():
        d = args.out / name
        try:
            got = job()
        except Exception as e:  # noqa: BLE001
            got = {"error": pd.DataFrame({"error": [f"{type(e).__name__}: {e}"]})}
            if args.action == "check":
                traceback.print_exc()
        if args.action == "make":
            d.mkdir(parents=True, exist_ok=True)
            for t, df in got.items():
                with open(d / f"{t}.pkl", "wb") as f:
                    pickle.dump(df, f)
            print(f"{name}: {len(got)} tables", flush=True)
            continue
        want = {p.stem: pickle.loads(p.read_bytes()) for p in sorted(d.glob("*.pkl"))}
        bad: list[str] = []
        close: list[str] = []
        for t in sorted(set(want) | set(got)):
            if t not in got or t not in want:
                bad.append(f"{t}: {'missing' if t not in got else 'new'}")
                continue
            got[t], want[t] = _where_made(got[t]), _where_made(want[t])
            try:
                pd.testing.assert_frame_equal(got[t], want[t], check_exact=True)
            except AssertionError:
                try:  # pandas' default: floats equal to a relative 1e-5
                    pd.testing.assert_frame_equal(got[t], want[t])
                    close.append(t)
                except AssertionError as e:
                    lines = str(e).strip().splitlines()
                    bad.append(f"{t}: " + "\n      ".join(lines[:6]))
        failed += bool(bad)
        verdict = "DIFFERS" if bad else "equal" + (f" (floats within 1e-5 in {', '.join(close)})" if close else "")
        print(f"{name}: {verdict} ({len(want)} tables)", flush=True)
        for b in bad:
            print(f"    {b}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
