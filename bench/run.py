#!/usr/bin/env python3
"""Speed and memory benchmark of slotscope against C baselines, on a generated log.

    python bench/run.py [--size 1GB] [--keep] [--skip-build] [--repeat N]

Builds (bench/make_log.py) a SIZE log and a SIZE/10 log, then times on each, as separate child
processes: `wc -l`, `LC_ALL=C grep -c 'slot '`, `slotscope tasks LOG --format csv`,
`slotscope tasks LOG.gz --format csv`, `slotscope analyze DIR` (stdout to /dev/null). Wall time
and peak RSS come from each child's own rusage (os.wait4). Prints a table and the target
checks, writes bench/out/results.json. Exit status 1 if a check FAILs, else 0 (a check whose
command is missing or failed is N/A, reported, not a failure). See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_log  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
VENV_BIN = Path("/tmp/venv/bin/slotscope")

LIMITS = {
    "tasks_vs_grep": 10.0,  # slotscope tasks <= 10x grep -c 'slot '
    "rss_mb": 256.0,  # peak RSS of tasks (plain and .gz)
    "analyze_rss_mb": 384.0,  # peak RSS of analyze
    "rss_growth": 0.20,  # tasks: RSS(SIZE) within 20% of RSS(SIZE/10)
    "analyze_scaling": 11.0,  # analyze(10x input) <= 11x analyze(1x)
    "gz_vs_plain": 1.3,  # tasks on .gz <= 1.3x tasks on the plain file
    "analyze_vs_baseline": 1.2,  # analyze(SIZE) <= 1.2x the --baseline slotscope's, same run
    "example_vs_import": 2.0,  # analyze on the bundled example <= 2x `import pandas, pyarrow`
    "help_vs_import": 0.6,  # slotscope --help <= 0.6x `import pandas, pyarrow`
    "whatif_vs_analyze": 3.0,  # --whatif: whatif(SIZE) <= 3x analyze(SIZE), same run
    "whatif_rss_mb": 384.0,  # --whatif: peak RSS of whatif, the bound of analyze
}


# --------------------------------------------------------------------------- running children

# Why not os.wait4's own ru_maxrss: Linux records, at exec, the peak RSS of the memory image the
# child had before exec (with vfork/posix_spawn that is the PARENT's image, so this runner's own
# peak) as a floor of the child's ru_maxrss. Measured: after this runner touched 300 MB, a plain
# Popen + os.wait4 reported `wc -l` at 310 MB. So the command is started from a small process
# (GNU /usr/bin/time, ~2 MB; else a bare `python -I -S` helper, ~10 MB) that reports the
# command's own rusage. Wall time is measured here around the whole thing (os.wait4 on the
# wrapper); the wrapper adds about a millisecond (time) or ~20 ms (python helper).
GNU_TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None
_HELPER = r"""
import json, os, subprocess, sys, time
t = time.perf_counter()
p = subprocess.Popen(sys.argv[2:])
_, st, ru = os.wait4(p.pid, 0)
s = time.perf_counter() - t
p.returncode = rc = os.waitstatus_to_exitcode(st)
open(sys.argv[1], "w").write(json.dumps({"rc": rc, "seconds": s, "maxrss_kb": ru.ru_maxrss}))
sys.exit(rc if rc >= 0 else 128 - rc)
"""


def rss_method() -> str:
    return ("GNU /usr/bin/time %M (floor ~2 MB)" if GNU_TIME else
            "os.wait4 in a `python -I -S` helper (floor ~10 MB)")


PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def _group_stats(pgid: int) -> Iterator[tuple[str, bytes]]:
    """(pid, the part of /proc/PID/stat after the command name) of each process in a group."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                st = f.read()
            fields = st[st.rindex(b")") + 2:].split()  # fields[0] = stat field 3 (state)
            if int(fields[2]) == pgid:  # field 5: pgrp
                yield d, fields
        except (OSError, ValueError, IndexError):
            continue


def _group_rss_kb(pgid: int) -> int:
    """Current RSS of every process in a process group (from /proc/*/stat)."""
    return sum(int(fields[21]) * PAGE_KB for _, fields in _group_stats(pgid))  # field 24: rss in pages


def _group_pss_kb(pgid: int) -> int | None:
    """Proportional set size of every process in a process group (shared pages split among
    their sharers): what the group takes from the machine, workers included. None where
    /proc/PID/smaps_rollup is missing (kernels before 4.14, non-Linux)."""
    total, seen = 0, False
    for pid, _ in _group_stats(pgid):
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1])
                        seen = True
                        break
        except (OSError, ValueError, IndexError):
            continue
    return total if seen else None


def run_child(argv: list[str], env: dict | None = None, timeout: float = 3600.0,
              capture: bool = False, max_rss_mb: float | None = None) -> dict:
    """Run argv, stdout to /dev/null: wall seconds, cpu seconds, the command's own peak RSS.

    capture: stdout to a temporary file instead, kept in the result. Needed for grep: GNU grep
    notices that stdout is /dev/null and stops at the first match, like -q (measured: 0.002 s
    for 1 GB).
    max_rss_mb: kill the command's process group once its RSS passes this (polled every
    0.2 s): a command that grows with the input must not take the shared machine down.
    """
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as rep, \
            tempfile.TemporaryFile() as out:
        if GNU_TIME:
            wrapped = [GNU_TIME, "-f", "%M", "-o", rep.name, *argv]
        else:
            wrapped = [sys.executable, "-I", "-S", "-c", _HELPER, rep.name, *argv]
        t0 = time.perf_counter()
        try:
            p = subprocess.Popen(wrapped, stdout=out if capture else subprocess.DEVNULL, stderr=err,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        except OSError as e:
            return {"rc": None, "error": f"cannot start: {e}"}
        done = threading.Event()
        killed: dict = {}

        def watchdog() -> None:
            while not done.wait(0.2):
                pss = _group_pss_kb(p.pid)
                if pss is not None:
                    killed["pss_peak_kb"] = max(pss, killed.get("pss_peak_kb", 0))
                why = None
                if time.perf_counter() - t0 > timeout:
                    why = f"killed after {timeout:.0f} s timeout"
                elif max_rss_mb:
                    kb = _group_rss_kb(p.pid)
                    killed["polled_peak_kb"] = max(kb, killed.get("polled_peak_kb", 0))
                    if kb > max_rss_mb * 1024:
                        why = f"killed at {kb / 1024:.0f} MB RSS (cap --max-rss-mb {max_rss_mb:g})"
                        killed["over_rss_cap"] = True
                if why:
                    killed["why"] = why
                    try:
                        os.killpg(p.pid, 9)
                    except ProcessLookupError:
                        pass
                    return

        wd = threading.Thread(target=watchdog, daemon=True)
        wd.start()
        _, status, ru = os.wait4(p.pid, 0)
        t1 = time.perf_counter()
        done.set()
        wd.join()
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, tell Popen
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace").strip()
        report = rep.read().strip()
        out.seek(0)
        stdout = out.read(2000).decode(errors="replace").strip() if capture else None
    rss_kb = None
    try:
        if GNU_TIME:  # "Command exited with non-zero status N" may come first
            rss_kb = int(report.splitlines()[-1])
        else:
            rss_kb = json.loads(report)["maxrss_kb"]
    except (ValueError, IndexError, KeyError):
        pass
    if killed.get("over_rss_cap"):
        rss_kb = max(rss_kb or 0, killed["polled_peak_kb"])
    r = {
        "rc": p.returncode,
        "seconds": t1 - t0,
        "cpu_seconds": ru.ru_utime + ru.ru_stime,  # wrapper + command (wrapper: ~ms)
        "rss_mb": rss_kb / 1024 if rss_kb is not None else None,  # KiB -> MiB
    }
    if "pss_peak_kb" in killed:  # sampled every 0.2 s: a lower bound of the true peak
        r["group_pss_mb"] = killed["pss_peak_kb"] / 1024
    if capture:
        r["stdout"] = stdout
    if killed.get("over_rss_cap"):
        r["over_rss_cap"] = True
    if p.returncode != 0 or rss_kb is None or "why" in killed:
        why = killed.get("why") or (f"exit {p.returncode}" if p.returncode != 0 else
                                    "no rusage report")
        r["error"] = why + (f": {tail}" if tail and "why" not in killed else "")
        r["rc"] = r["rc"] or -1
    return r


def _interpreter(exe: str | None) -> str | None:
    """The Python a console script runs on (its #! line), else this one."""
    try:
        first = open(exe, "rb").readline().decode() if exe else ""
    except OSError:
        first = ""
    return first[2:].strip().split()[0] if first.startswith("#!") and first[2:].strip() else sys.executable


def find_slotscope() -> str | None:
    for cand in (os.environ.get("SLOTSCOPE_BIN"), shutil.which("slotscope"), str(VENV_BIN)):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def probe(exe: str | None, sub: str) -> str | None:
    """None if `slotscope SUB --help` works, else why not."""
    if exe is None:
        return "slotscope not found (PATH, /tmp/venv/bin, $SLOTSCOPE_BIN)"
    try:
        p = subprocess.run([exe, sub, "--help"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`slotscope {sub} --help` failed: {e}"
    if p.returncode != 0:
        text = (p.stderr or p.stdout).decode(errors="replace")
        last = [x for x in (ln.strip(" \t│╭╮╰╯─") for ln in text.splitlines()) if x]
        return f"`slotscope {sub} --help` exit {p.returncode}: {last[-1] if last else ''}"
    return None


# --------------------------------------------------------------------------- inputs

def ensure_input(size: int, skip_build: bool, seed: int) -> tuple[Path, dict]:
    d = OUT / make_log.format_size(size)
    gen_file = d / ".generated.json"
    ok = all((d / f).exists() for f in ("llama-server.log", "llama-server.log.gz", "app.jsonl"))
    if skip_build and ok and gen_file.exists():
        info = json.loads(gen_file.read_text())
        if info.get("size_requested") == size:
            print(f"reusing {d} ({info['bytes']:,} bytes)", file=sys.stderr)
            return d, info
    if skip_build:
        print(f"--skip-build: no usable input in {d}, building it", file=sys.stderr)
    print(f"building {d} ...", file=sys.stderr)
    info = make_log.build(size, d, seed=seed)
    return d, info


def analyze_dir(d: Path) -> Path:
    """A directory with only the two logs: given the out dir, slotscope would also read the
    .gz (same stream, read twice). Hard links, so no copy."""
    a = d / "analyze_in"
    a.mkdir(exist_ok=True)
    for f in ("llama-server.log", "app.jsonl"):
        (a / f).unlink(missing_ok=True)
        try:
            os.link(d / f, a / f)
        except OSError:
            os.symlink(d / f, a / f)
    return a


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


# --------------------------------------------------------------------------- main

def machine() -> dict:
    cpu = ""
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
                           capture_output=True, text=True).stdout.strip()
    return {"host": platform.node(), "cpu": cpu, "nproc": os.cpu_count(),
            "python": platform.python_version(), "kernel": platform.release(),
            "git_head": head + ("+dirty src" if dirty else ""), "loadavg_start": os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=make_log.parse_size, default=make_log.parse_size("1GB"),
                    help="big input size (default 1GB); the small one is SIZE/10")
    ap.add_argument("--keep", action="store_true", help="keep the generated inputs in bench/out/")
    ap.add_argument("--skip-build", action="store_true", help="reuse inputs already in bench/out/")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole sequence N times (interleaved); report medians (default 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600, help="per command, seconds")
    ap.add_argument("--baseline", metavar="SLOTSCOPE",
                    help="another slotscope (e.g. an install of the last release) whose analyze is timed beside this one's")
    ap.add_argument("--whatif", action="store_true",
                    help="also time `whatif --set n_batch=512` on the big input (minutes at 1 GB)")
    ap.add_argument("--max-rss-mb", type=float, default=4096,
                    help="kill a command whose RSS passes this (default 4096; 0 = no cap)")
    a = ap.parse_args(argv)

    # A user's slotscope has its bytecode compiled (pip writes it at install): a checkout run
    # under PYTHONDONTWRITEBYTECODE would compile every module at every start, and time that.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    info = machine()
    exe = find_slotscope()
    missing = {sub: probe(exe, sub) for sub in ("tasks", "samples", "analyze")}
    print(f"slotscope: {exe or 'NOT FOUND'}; " + "; ".join(
        f"{k}: {'ok' if v is None else 'not available (' + v + ')'}" for k, v in missing.items()),
        file=sys.stderr)

    sizes = {"big": a.size, "small": a.size // 10}
    inputs = {}
    for key, size in sizes.items():
        d, gen = ensure_input(size, a.skip_build, a.seed)
        inputs[key] = {"dir": d, "gen": gen, "label": make_log.format_size(size)}

    cenv = dict(os.environ, LC_ALL="C")
    plan: list[tuple[str, str, list[str] | None, str | None, dict | None]] = []
    # (input, name, argv, why not available, env); env LC_ALL=C only for the C tools
    for key in ("big", "small"):
        d = inputs[key]["dir"]
        log, gz = str(d / "llama-server.log"), str(d / "llama-server.log.gz")
        adir = str(analyze_dir(d))
        plan += [
            (key, "wc -l", ["wc", "-l", log], None, cenv),
            (key, "grep -c 'slot '", ["grep", "-c", "slot ", log], None, cenv),
            (key, "tasks", [exe, "tasks", log, "--format", "csv"] if exe else None,
             missing["tasks"], None),
            (key, "tasks .gz", [exe, "tasks", gz, "--format", "csv"] if exe else None,
             missing["tasks"], None),
            # no target of its own: shows that the heartbeat table streams too (memory)
            (key, "samples", [exe, "samples", log, "--kind", "gen", "--format", "csv"] if exe else None,
             missing["samples"], None),
            (key, "analyze", [exe, "analyze", adir] if exe else None, missing["analyze"], None),
        ]
    if a.whatif:
        plan.append(("big", "whatif", [exe, "whatif", str(analyze_dir(inputs["big"]["dir"])), "--set", "n_batch=512"]
                     if exe else None, missing["analyze"], None))
    if a.baseline:
        plan.append(("big", "analyze (baseline)", [a.baseline, "analyze", str(analyze_dir(inputs["big"]["dir"]))], None, None))
    # Start-up: the bundled example and --help against the imports every analysis needs, with
    # the interpreter slotscope runs on.
    python = _interpreter(exe)
    plan += [
        ("small", "import pandas, pyarrow", [python, "-c", "import pandas, pyarrow"] if python else None,
         None if python else "no interpreter found for slotscope", None),
        ("small", "analyze (example)", [exe, "analyze"] if exe else None, missing["analyze"], None),
        ("small", "--help", [exe, "--help"] if exe else None, missing["analyze"], None),
    ]
    for key in ("big", "small"):
        d = inputs[key]["dir"]
        warm([d / "llama-server.log", d / "llama-server.log.gz", d / "app.jsonl"])
    if exe:  # (the bytecode of every module analyze imports, written before any run is timed)
        subprocess.run([exe, "analyze"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=a.timeout)

    results: dict[tuple[str, str], dict] = {}
    for rep in range(a.repeat):
        for key, name, cmd, why_not, env in plan:
            r = results.setdefault((key, name), {"size": key, "label": inputs[key]["label"],
                                                 "command": name, "argv": cmd, "runs": []})
            if why_not or cmd is None:
                r["status"] = "not available"
                r["error"] = why_not or "slotscope not found"
                continue
            if r.get("status") in ("failed", "over RSS cap"):
                continue
            print(f"[{rep + 1}/{a.repeat}] {inputs[key]['label']:>6}  {name} ...", file=sys.stderr,
                  flush=True)
            x = run_child(cmd, env=env, timeout=a.timeout, capture=cmd[0] in ("wc", "grep"),
                          max_rss_mb=a.max_rss_mb)
            if x.get("over_rss_cap"):
                r["over_rss_cap"] = True
            if x.get("rc") != 0:
                r["status"] = "over RSS cap" if x.get("over_rss_cap") else "failed"
                r["error"] = x.get("error")
                if x.get("over_rss_cap"):
                    r["rss_mb"] = x["rss_mb"]  # a lower bound, enough to fail the RSS checks
                continue
            r["runs"].append(x)
            r["status"] = "ok"
    for r in results.values():
        if r["status"] == "ok":
            r["seconds"] = statistics.median(x["seconds"] for x in r["runs"])
            r["cpu_seconds"] = statistics.median(x["cpu_seconds"] for x in r["runs"])
            r["rss_mb"] = max(x["rss_mb"] for x in r["runs"])
            pss = [x["group_pss_mb"] for x in r["runs"] if "group_pss_mb" in x]
            r["group_pss_mb"] = max(pss) if pss else None
    info["loadavg_end"] = os.getloadavg()

    # ---- table
    def get(key, name, field="seconds"):
        r = results.get((key, name))
        if r and (r.get("status") == "ok" or (field == "rss_mb" and r.get("over_rss_cap"))):
            return r.get(field)
        return None

    rows = []
    for (key, name), r in results.items():
        nbytes = inputs[key]["gen"]["bytes"]
        g = get(key, "grep -c 'slot '")
        if r["status"] == "ok":
            s = r["seconds"]
            r["mb_per_s"] = nbytes / 1e6 / s
            r["ratio_to_grep"] = s / g if g else None
            rows.append([r["label"], name, f"{s:.3f}", f"{r['mb_per_s']:,.0f}",
                         f"{r['ratio_to_grep']:.1f}x" if g else "-", f"{r['rss_mb']:.0f}",
                         f"{r['group_pss_mb']:.0f}" if r.get("group_pss_mb") else "-", f"{r['cpu_seconds']:.2f}"])
        else:
            rss = f">{r['rss_mb']:.0f}" if r.get("over_rss_cap") else ""
            rows.append([r["label"], name, r["status"].upper(), "", "", rss, "", ""])
    hdr = ["input", "command", "seconds", "MB/s", "vs grep -c", "peak RSS MB", "all procs PSS MB", "cpu s"]
    widths = [max(len(str(x[i])) for x in rows + [hdr]) for i in range(len(hdr))]
    print()
    print("  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(hdr, widths))))
    for row in rows:
        print("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
    print(f"MB/s = uncompressed log bytes / wall s ({inputs['big']['label']}: "
          f"{inputs['big']['gen']['bytes']:,} B, {inputs['big']['gen']['lines']:,} lines; "
          f"{inputs['small']['label']}: {inputs['small']['gen']['bytes']:,} B). "
          f"{info['nproc']} CPUs, load {info['loadavg_start'][0]:.2f} -> {info['loadavg_end'][0]:.2f}")
    for r in results.values():
        if r["status"] != "ok":
            print(f"  {r['label']} {r['command']}: {r['status']}: {r.get('error')}")

    # ---- checks
    B, S = inputs["big"]["label"], inputs["small"]["label"]
    checks = []

    def check(name, value, limit, ok, detail, why_na=None):
        if value is None:
            checks.append({"check": name, "status": "N/A", "detail": why_na or detail})
        else:
            checks.append({"check": name, "status": "PASS" if ok(value) else "FAIL",
                           "value": round(value, 3), "limit": limit, "detail": detail})

    def na(*keys):
        bad = [f"{inputs[k]['label']} {n}: {results[(k, n)]['status']}"
               for k, n in keys if results[(k, n)]["status"] != "ok"]  # (after a value check)
        return ", ".join(bad) or None

    t, g = get("big", "tasks"), get("big", "grep -c 'slot '")
    check(f"tasks <= {LIMITS['tasks_vs_grep']:g}x grep -c ({B})", t / g if t and g else None,
          LIMITS["tasks_vs_grep"], lambda v: v <= LIMITS["tasks_vs_grep"],
          f"{t:.2f} s / {g:.2f} s" if t and g else "", na(("big", "tasks"), ("big", "grep -c 'slot '")))
    for key in ("big", "small"):
        for name, limit in (("tasks", LIMITS["rss_mb"]), ("tasks .gz", LIMITS["rss_mb"]), ("analyze", LIMITS["analyze_rss_mb"])):
            rss = get(key, name, "rss_mb")
            check(f"RSS <= {limit:g} MB: {name} ({inputs[key]['label']})", rss,
                  limit, lambda v, limit=limit: v <= limit,
                  f"{rss:.0f} MB" if rss else "", na((key, name)))
    for name in ("tasks", "tasks .gz"):
        rb, rs = get("big", name, "rss_mb"), get("small", name, "rss_mb")
        if results[("small", name)].get("over_rss_cap"):  # both are only lower bounds
            checks.append({"check": f"RSS({B}) within {LIMITS['rss_growth']:.0%} of RSS({S}): {name}",
                           "status": "N/A", "detail": f"{S} {name} was killed over the RSS cap"})
            continue
        check(f"RSS({B}) within {LIMITS['rss_growth']:.0%} of RSS({S}): {name}",
              rb / rs if rb and rs else None, f"{1 - LIMITS['rss_growth']:g}..{1 + LIMITS['rss_growth']:g}",
              lambda v: abs(v - 1) <= LIMITS["rss_growth"] + 1e-9,
              f"{rb:.0f} MB vs {rs:.0f} MB" if rb and rs else "", na(("big", name), ("small", name)))
    ab, as_ = get("big", "analyze"), get("small", "analyze")
    check(f"analyze({B}) <= {LIMITS['analyze_scaling']:g}x analyze({S})", ab / as_ if ab and as_ else None,
          LIMITS["analyze_scaling"], lambda v: v <= LIMITS["analyze_scaling"],
          f"{ab:.2f} s / {as_:.2f} s" if ab and as_ else "", na(("big", "analyze"), ("small", "analyze")))
    tg, tp = get("big", "tasks .gz"), get("big", "tasks")
    check(f"tasks .gz <= {LIMITS['gz_vs_plain']:g}x tasks plain ({B})", tg / tp if tg and tp else None,
          LIMITS["gz_vs_plain"], lambda v: v <= LIMITS["gz_vs_plain"],
          f"{tg:.2f} s / {tp:.2f} s" if tg and tp else "", na(("big", "tasks .gz"), ("big", "tasks")))

    if a.baseline:
        base = get("big", "analyze (baseline)")
        check(f"analyze <= {LIMITS['analyze_vs_baseline']:g}x the baseline's ({B})", ab / base if ab and base else None,
              LIMITS["analyze_vs_baseline"], lambda v: v <= LIMITS["analyze_vs_baseline"],
              f"{ab:.2f} s / {base:.2f} s" if ab and base else "", na(("big", "analyze"), ("big", "analyze (baseline)")))
    if a.whatif:
        w = get("big", "whatif")
        check(f"whatif <= {LIMITS['whatif_vs_analyze']:g}x analyze ({B})", w / ab if w and ab else None,
              LIMITS["whatif_vs_analyze"], lambda v: v <= LIMITS["whatif_vs_analyze"],
              f"{w:.2f} s / {ab:.2f} s" if w and ab else "", na(("big", "whatif"), ("big", "analyze")))
        rss = get("big", "whatif", "rss_mb")
        check(f"RSS <= {LIMITS['whatif_rss_mb']:g} MB: whatif ({B})", rss, LIMITS["whatif_rss_mb"],
              lambda v: v <= LIMITS["whatif_rss_mb"], f"{rss:.0f} MB" if rss else "", na(("big", "whatif")))
    imp = get("small", "import pandas, pyarrow")
    for name, limit in (("analyze (example)", "example_vs_import"), ("--help", "help_vs_import")):
        v = get("small", name)
        check(f"{name} <= {LIMITS[limit]:g}x `import pandas, pyarrow`", v / imp if v and imp else None,
              LIMITS[limit], lambda x, limit=limit: x <= LIMITS[limit],
              f"{v:.3f} s / {imp:.3f} s" if v and imp else "", na(("small", name), ("small", "import pandas, pyarrow")))

    print("\nchecks:")
    for c in checks:
        v = f"{c['value']:.2f} (limit {c['limit']})  " if "value" in c else ""
        print(f"  {c['status']:4}  {c['check']}: {v}{c['detail']}")

    # ---- JSON
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {
        "started": started,
        "machine": info,
        "rss_method": rss_method(),
        "slotscope": {"path": exe, "not_available": {k: v for k, v in missing.items() if v}},
        "repeat": a.repeat,
        "inputs": {k: {"label": v["label"], "dir": str(v["dir"]), **v["gen"]} for k, v in inputs.items()},
        "commands": [{k: v for k, v in r.items()} for r in results.values()],
        "checks": checks,
        "limits": LIMITS,
    }
    (OUT / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nwrote {OUT / 'results.json'}")

    if not a.keep:
        for v in inputs.values():
            shutil.rmtree(v["dir"], ignore_errors=True)
        print("removed the generated inputs (--keep keeps them)", file=sys.stderr)
    return 1 if any(c["status"] == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
