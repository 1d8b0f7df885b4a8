"""Ollama: each [GIN] call joined to its runner task; its queue, the loads, the parallel setting.

A call's latency (gin: end - start of the whole handler) holds Ollama's own queue, a model
load when one came first, and the runner's task. The task is found by the call's end and
duration, one to one: its release lies within a second or so of the call's end (the [GIN]
stamp is cut to the second, a borrowed runner time is at most a second late where Ollama
writes often), and it lasted no longer than the call. A task's launch is the latest time its
launch line allows (the reader derives it: :func:`slotscope.ollama.retime`). Then

- queue time = latency - (release - launch);
- load wait = the part of a model load (``llama-server started in N seconds``) between the
  call's start and its task's launch;
- prefill and generation = the task's ``prompt eval time`` and ``eval time``.

The parallel setting in force is the runner's (``--parallel N``/``-np N``, the load request's
``Parallel:N``), else ``OLLAMA_NUM_PARALLEL`` of the config dump. Observed concurrency:
calls in flight at once (from [GIN]) against tasks running at once (runner lines). Many calls
at once and tasks one at a time is the NUM_PARALLEL queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..dataset import Dataset, tasks_of
from ..match import MATCH_COLUMNS
from ..tasks import TASK_COLUMNS as STABLE_TASK_COLUMNS
from ..timeline import within_ranges
from ..ollama import CALL_COLUMNS, TIME_RESOLUTION_S, OllamaLogs
from .questions import Options, register

END_BEFORE_S = 1.5  # a task's release this long before the call's [GIN] stamp (a slog stamp in between)
END_AFTER_S = 2.5  # ... or after it (the stamp is cut to the second; borrowed times lag)
QUEUED_S = 1.0  # a queue time worth counting (what the times are good to)
JOIN_COLUMNS = ["session", "task_id", "slot", "task_line", "match_method", "queue_ms", "load_wait_ms", "prefill_ms",
                "generation_ms", "task_ms", "overlapped", "wait_before_prefill_ms", "ttft_ms", "prompt_tokens",
                "completion_tokens"]
TASK_COLUMNS = ["source", "session", "task_id", "slot", "line", "status", "launch_at", "prefill_start_at", "release_at",
                "prompt_eval_ms", "eval_ms", "first_token_at", "wait_before_prefill_ms", "prompt_tokens", "n_gen"]
SUMMARY_COLUMNS = ["source", "figure", "value", "samples", "few_samples"]


def _us(col: pd.Series) -> np.ndarray:
    """Datetimes as float µs since the epoch (NaN where missing)."""
    t = pd.to_datetime(col, utc=True)
    out = t.astype("datetime64[us, UTC]").astype("int64").to_numpy().astype(float)
    out[t.isna().to_numpy()] = np.nan
    return out


def loads(ol: OllamaLogs) -> pd.DataFrame:
    """Model loads: ``source, start_us, end_us, seconds, line`` from the runner-ready lines.
    One load may say it twice (v0.30+ waits for the runner twice, and each wait ends with
    ``llama-server started in``, both timed from the process start): spans that overlap are
    one load, the first line's."""
    ev = ol.events[ol.events["kind"] == "runner_ready"].sort_values(["source", "at"], kind="stable")
    secs = ev["text"].astype("string").str.extract(r"started in ([0-9.]+) seconds")[0].astype(float).to_numpy()
    end = _us(ev["at"])
    start = end - secs * 1e6
    src = ev["source"].astype(str).to_numpy()
    reach = np.full(len(end), -np.inf)  # the latest end of the same source's earlier loads
    for s in pd.unique(src):
        m = np.flatnonzero(src == s)
        reach[m[1:]] = np.maximum.accumulate(end[m])[:-1]
    new = start > reach
    group = np.cumsum(new) - 1
    ends = pd.Series(end).groupby(group).max().to_numpy()
    first = np.flatnonzero(new)
    return pd.DataFrame({"source": src[first], "start_us": start[first], "end_us": ends,
                         "seconds": (ends - start[first]) / 1e6, "line": ev["line"].to_numpy()[first]})


def join(calls: pd.DataFrame, tasks: pd.DataFrame, load: pd.DataFrame) -> pd.DataFrame:
    """The calls with their task's columns (:data:`JOIN_COLUMNS`), one task per call at most."""
    out = calls.reset_index(drop=True).copy()
    end, lat = _us(out["end_at"]), out["latency_ms"].to_numpy(dtype=float) * 1e3
    start = end - lat
    # gin cuts a latency above a minute to whole seconds: the middle of that second, for the queue.
    cut = (lat > 60e6) & (np.mod(lat, 1e6) == 0)
    lat_mid = np.where(cut, lat + 0.5e6, lat)
    t = tasks[tasks["release_at"].notna()].reset_index(drop=True)
    release = _us(t["release_at"])
    begin = t["begin_us"].to_numpy(dtype=float)
    busy = release - begin
    # Candidate pairs: the task released near the call's end, within the call's duration.
    ci_parts, ti_parts = [], []
    for src in pd.unique(out["source"]):
        cm, tm = np.flatnonzero(out["source"].to_numpy() == src), np.flatnonzero(t["source"].to_numpy() == src)
        order = tm[np.argsort(release[tm], kind="stable")]
        lo = np.searchsorted(release[order], end[cm] - END_BEFORE_S * 1e6, side="left")
        hi = np.searchsorted(release[order], end[cm] + END_AFTER_S * 1e6, side="right")
        n = np.maximum(hi - lo, 0)
        ci_parts.append(np.repeat(cm, n))
        ti_parts.append(order[np.repeat(lo, n) + within_ranges(n)])
    ci = np.concatenate(ci_parts) if ci_parts else np.zeros(0, np.int64)
    ti = np.concatenate(ti_parts) if ti_parts else np.zeros(0, np.int64)
    fits = busy[ti] <= lat[ci] + TIME_RESOLUTION_S * 1e6 + 0.5e6
    ci, ti = ci[fits], ti[fits]
    # Closest end first, then the shortest queue; pairs best both ways are kept, round by round.
    score = np.abs(release[ti] - end[ci] - 0.5e6) + np.maximum(lat[ci] - busy[ti], 0)
    task_of = np.full(len(out), -1, dtype=np.int64)
    free_c, free_t = np.ones(len(out), bool), np.ones(len(t), bool)
    while len(ci):
        keep = free_c[ci] & free_t[ti]
        ci, ti, score = ci[keep], ti[keep], score[keep]
        if not len(ci):
            break
        o = np.argsort(score, kind="stable")
        first_c, first_t = np.zeros(len(o), bool), np.zeros(len(o), bool)
        first_c[np.unique(ci[o], return_index=True)[1]] = True  # each call's best pair
        first_t[np.unique(ti[o], return_index=True)[1]] = True  # each task's
        won = o[first_c & first_t]  # (never none: the best pair of all is both)
        task_of[ci[won]] = ti[won]
        free_c[ci[won]] = False
        free_t[ti[won]] = False
    has = task_of >= 0
    k = np.where(has, task_of, 0)

    def pick(col: pd.Series | np.ndarray, dtype: str = "float64") -> pd.Series:
        vals = pd.Series(np.asarray(col)[k] if len(t) else np.full(len(out), np.nan))
        return vals.where(has).astype(dtype)

    out["session"] = pick(t["session"], "Int64")
    out["task_id"] = pick(t["task_id"], "Int64")
    out["slot"] = pick(t["slot"], "Int64")
    out["task_line"] = pick(t["line"], "Int64")
    out["match_method"] = np.where(has, "end+duration", "unmatched:no_task_at_end" if len(t) else "unmatched:no_runner_lines")
    task_ms = pick(busy / 1e3)
    out["task_ms"] = task_ms.round(3)
    out["queue_ms"] = (pd.Series(lat_mid / 1e3) - task_ms).clip(lower=0).round(3)
    out["prefill_ms"] = pick(t["prompt_eval_ms"])
    out["generation_ms"] = pick(t["eval_ms"])
    task_begin = np.where(has, begin[k] if len(t) else np.nan, end)
    out["load_wait_ms"] = _load_wait(out["source"].to_numpy(), start, task_begin, load)
    out["overlapped"] = _overlapped(out["source"].to_numpy(), start, end)
    out["wait_before_prefill_ms"] = pick(t["wait_before_prefill_ms"])
    out["ttft_ms"] = ((pick(_us(t["first_token_at"])) - start) / 1e3).round(3)
    out["prompt_tokens"] = pick(t["prompt_tokens"], "Int64")
    out["completion_tokens"] = pick(t["n_gen"], "Int64")
    return out


def _load_wait(source: np.ndarray, start: np.ndarray, until: np.ndarray, load: pd.DataFrame) -> np.ndarray:
    """Per call, ms of a model load between its start and ``until`` (its task's begin, or its end)."""
    wait = np.zeros(len(start))
    for r in load.itertuples(index=False):  # (loads are few: one per model start)
        own = source == r.source
        part = np.minimum(until, r.end_us) - np.maximum(start, r.start_us)
        wait = np.where(own & (part > 0), wait + part / 1e3, wait)
    return wait.round(3)


def _cold(load: pd.DataFrame, waited: pd.DataFrame) -> pd.DataFrame:
    """The loads some call waited on: those that overlap a waiting call's span. (Its wait lies
    between its start and its task's begin, not from its start: the start is cut to the second,
    and a load may begin after it. No load overlaps the task itself, which the runner ran.)"""
    start, end = _us(waited["start_at"]), _us(waited["end_at"])
    hit = np.zeros(len(load), bool)
    for i, (a, b) in enumerate(zip(load["start_us"].to_numpy(), load["end_us"].to_numpy())):  # (loads are few)
        hit[i] = bool(((start < b) & (end > a)).any())
    return load[hit]


def _overlapped(source: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Whether each call was in flight while another call of the same server was."""
    out = np.zeros(len(start), bool)
    for src in pd.unique(source):
        m = np.flatnonzero(source == src)
        running = _in_flight_at(start[m], end[m], start[m]) + _in_flight_at(start[m], end[m], end[m] - 1)
        out[m] = running > 2  # (each counts itself at both points)
    return out


def _in_flight_at(start: np.ndarray, end: np.ndarray, at: np.ndarray) -> np.ndarray:
    """How many of the intervals [start, end) hold each time of ``at``."""
    return np.searchsorted(np.sort(start), at, side="right") - np.searchsorted(np.sort(end), at, side="right")


def most_at_once(start: np.ndarray, end: np.ndarray) -> int:
    """The most intervals [start, end) holding one moment, not counting overlaps shorter
    than the times are good to (one call's end and the next one's start may cross by that)."""
    half = TIME_RESOLUTION_S * 0.5e6
    start, end = start + half, np.maximum(end - half, start + half)
    ok = ~(np.isnan(start) | np.isnan(end))
    if not ok.any():
        return 0
    return int(_in_flight_at(start[ok], end[ok], start[ok]).max())


def _ollama(ds: Dataset) -> OllamaLogs | None:
    return getattr(ds.server, "ollama", None)


def _tasks(ds: Dataset) -> pd.DataFrame:
    """The runner's tasks with ``begin_us``: their launch (µs since the epoch)."""
    if not ds.n_tasks:
        t = pd.DataFrame({c: pd.Series(dtype="datetime64[us, UTC]" if c.endswith("_at") else "float64")
                          for c in TASK_COLUMNS})
        return t.assign(begin_us=pd.Series(dtype="float64"))
    t = tasks_of(ds, TASK_COLUMNS)
    for c in TASK_COLUMNS:
        if c not in t.columns:  # (no wall clock: no *_at columns)
            t[c] = pd.Series(pd.NaT, index=t.index, dtype="datetime64[us, UTC]")
    return t.assign(begin_us=np.fmin(_us(t["launch_at"]), _us(t["prefill_start_at"])))  # (no launch line: its prefill)


def joined_calls(ds: Dataset) -> pd.DataFrame:
    """The [GIN] calls, each joined to its runner task (the ``ollama-calls`` table)."""
    ol = _ollama(ds)
    if ol is None:
        return pd.DataFrame({c: [] for c in CALL_COLUMNS + JOIN_COLUMNS})
    return ol.in_zone(join(ol.calls, _tasks(ds), loads(ol)))


def matched_calls(ds: Dataset) -> pd.DataFrame:
    """The [GIN] calls as ``match`` gives an app's: the match table's columns first (what a
    [GIN] line cannot say, NA: purpose, user, LoRA, confidence; the tokens are the task's),
    then the ``ollama-calls`` table's other columns."""
    calls = joined_calls(ds).rename(columns={"latency_ms": "total_ms"})
    calls["total_ms"] = calls["total_ms"].round(3)
    for c in ("purpose", "user", "lora"):
        calls[c] = pd.Series(pd.NA, index=calls.index, dtype="string")
    calls["confidence"] = pd.Series(np.nan, index=calls.index)
    return calls[MATCH_COLUMNS + [c for c in calls.columns if c not in MATCH_COLUMNS]]


def unmatched_tasks(ds: Dataset) -> pd.DataFrame:
    """The runner's tasks no [GIN] call was joined to (``match --unlogged``)."""
    calls = joined_calls(ds)
    t = tasks_of(ds, STABLE_TASK_COLUMNS + ["file", "port", "launch_at", "release_at", "time_resolution_s"])
    if not len(t):
        return t
    joined = pd.MultiIndex.from_frame(calls.loc[calls["task_id"].notna(), ["source", "session", "task_id"]]
                                      .astype({"source": str, "session": "int64", "task_id": "int64"}))
    keys = pd.MultiIndex.from_frame(t[["source", "session", "task_id"]].astype({"source": str, "session": "int64",
                                                                                "task_id": "int64"}))
    return t[~keys.isin(joined)].reset_index(drop=True)


@register("ollama-calls")
def ollama_calls(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Every [GIN] inference call with its task, queue time, load wait, prefill and generation."""
    return joined_calls(ds)


def _settings(ev: pd.DataFrame) -> dict[str, str]:
    """What the config dump, the runner's command line and the load request say."""
    out: dict[str, str] = {}
    text = ev["text"].astype(str)
    for kind, rx, key in (
        ("config", r"OLLAMA_NUM_PARALLEL:(\d+)", "config_parallel"),
        ("config", r"OLLAMA_MAX_QUEUE:(\d+)", "max_queue"),
        ("config", r"OLLAMA_CONTEXT_LENGTH:(\d+)", "context_length"),
        ("config", r"OLLAMA_KEEP_ALIVE:(\S*?)(?: |\])", "keep_alive"),
        ("runner_start", r"(?:--parallel|-np) (\d+)", "runner_parallel"),
        ("runner_start", r"(?:--model|-m) (\S+)", "model"),
        ("load_request", r"Parallel:(\d+)", "runner_parallel"),
        ("fit", r"parallel=(\d+)", "runner_parallel"),
        ("version", r"\(version ([^)]+)\)", "version"),
    ):
        hits = text[ev["kind"] == kind].str.extract(rx)[0].dropna()
        if len(hits):
            out[key] = str(hits.iloc[-1])  # (the last: the setting in force at the end)
    return out


def _q(x: pd.Series, p: float) -> float:
    return float(x.quantile(p)) if len(x) else float("nan")


@dataclass(frozen=True)
class _Seen:
    """What the ``ollama`` table and its findings say, measured once: the calls, the runner's
    tasks, the loads and Ollama's events."""

    calls: pd.DataFrame
    matched: pd.DataFrame  # the calls matched to a runner task
    calls_at_once: int
    tasks_at_once: int
    tasks_released: int
    load: pd.DataFrame
    cold: pd.DataFrame  # the loads some call waited on
    waited: pd.Series  # per call: it waited on a load
    wait_s: pd.Series  # the waits of those calls
    unloads: int
    n503: int
    aborts: int
    shifts: int


def summary(ds: Dataset, opts: Options, calls: pd.DataFrame | None = None) -> tuple[pd.DataFrame, list[str]]:
    """The ``ollama`` table (one figure a row, with its sample count) and the findings in words."""
    ol = _ollama(ds)
    if ol is None:
        return pd.DataFrame({c: [] for c in SUMMARY_COLUMNS}), []
    seen = _measure(joined_calls(ds) if calls is None else calls, _tasks(ds), ol)
    st = _settings(ol.events)
    rows = _setting_rows(st) + _figure_rows(seen)
    # (Each value as its own text: a column of numbers alone would print every count as a float.)
    text = ["" if isinstance(v, float) and np.isnan(v) else str(v) for _, v, _ in rows]
    table = pd.DataFrame({"figure": [r[0] for r in rows], "value": pd.Series(text, dtype=object),
                          "samples": [r[2] for r in rows]})
    table.insert(0, "source", ", ".join(sorted(ol.zones)) or "")
    table["few_samples"] = (table["samples"] < opts.min_samples) & table["figure"].str.startswith("queue")
    return table[SUMMARY_COLUMNS], _queue_findings(seen, st, opts) + _other_findings(seen, st)


def _measure(calls: pd.DataFrame, tasks: pd.DataFrame, ol: OllamaLogs) -> _Seen:
    """The figures of the calls (joined to their tasks), the tasks and Ollama's logs."""
    load = loads(ol)
    waited = calls["load_wait_ms"] > 0
    kind = ol.events["kind"]
    return _Seen(
        calls=calls, matched=calls[calls["task_id"].notna()],
        calls_at_once=most_at_once(_us(calls["start_at"]), _us(calls["end_at"])),
        tasks_at_once=most_at_once(tasks["begin_us"].to_numpy(dtype=float), _us(tasks["release_at"])),
        tasks_released=int(tasks["release_at"].notna().sum()),
        load=load, cold=_cold(load, calls[waited]), waited=waited, wait_s=calls.loc[waited, "load_wait_ms"] / 1e3,
        unloads=int((kind == "unload").sum()), n503=int((calls["status"] == 503).sum()),
        aborts=int((kind == "abort").sum()), shifts=int((kind == "shift").sum()))


def _setting_rows(st: dict[str, str]) -> list[tuple[str, object, int]]:
    """The settings the logs show, as rows of the table."""
    rows: list[tuple[str, object, int]] = []
    for key, label in (("version", "version"), ("model", "model"), ("config_parallel", "OLLAMA_NUM_PARALLEL"),
                       ("runner_parallel", "runner parallel (-np)"), ("max_queue", "OLLAMA_MAX_QUEUE"),
                       ("context_length", "OLLAMA_CONTEXT_LENGTH"), ("keep_alive", "OLLAMA_KEEP_ALIVE")):
        if key in st:
            rows.append((label, st[key], 1))
    return rows


def _figure_rows(seen: _Seen) -> list[tuple[str, object, int]]:
    """The figures, as rows of the table: concurrency, queue times, loads, refusals."""
    calls, load, cold, wait_s = seen.calls, seen.load, seen.cold, seen.wait_s
    n = len(calls)
    rows: list[tuple[str, object, int]] = [
        ("calls", n, n), ("calls in flight at once (most)", seen.calls_at_once, n),
        ("tasks running at once in the runner (most)", seen.tasks_at_once, seen.tasks_released),
        ("calls that overlapped another", int(calls["overlapped"].sum()), n),
        ("calls matched to a runner task", len(seen.matched), n)]
    q = seen.matched["queue_ms"] / 1e3
    for label, v in (("queue time median (s)", q.median()), ("queue time p95 (s)", _q(q, 0.95)),
                     ("queue time max (s)", q.max())):
        rows.append((label, round(float(v), 3) if len(q) else float("nan"), len(q)))
    rows += [("model loads", len(load), len(load)), ("model load seconds (total)", round(float(load["seconds"].sum()), 2), len(load)),
             ("cold loads (a call waited on them)", len(cold), len(load)),
             ("cold load seconds (total)", round(float(cold["seconds"].sum()), 2), len(cold)),
             ("calls that waited on a load", int(seen.waited.sum()), n),
             ("load wait median (s)", round(float(wait_s.median()), 3) if len(wait_s) else float("nan"), len(wait_s)),
             ("model unloads (keep-alive ran out; DEBUG lines)", seen.unloads, seen.unloads)]
    rows += [("503 responses (queue full)", seen.n503, n), ("client aborts", seen.aborts, seen.aborts),
             ("context shifts", seen.shifts, seen.shifts)]
    return rows


def _queue_findings(seen: _Seen, st: dict[str, str], opts: Options) -> list[str]:
    """The calls that waited in Ollama's queue, in words: behind a parallel setting of 1 (many
    calls at once, tasks one at a time), or outside the runner otherwise."""
    overlapped = seen.matched[seen.matched["overlapped"]]
    queued = overlapped[overlapped["queue_ms"] >= QUEUED_S * 1e3]
    if len(overlapped) and seen.tasks_at_once == 1 and seen.calls_at_once > 1 and len(queued):
        parallel = st.get("runner_parallel") or st.get("config_parallel")
        setting = f"OLLAMA_NUM_PARALLEL={parallel}" if parallel else "a parallel setting of 1"
        return [f"{len(queued)} of {len(overlapped)} calls that overlapped another waited in Ollama's queue "
                f"(median {queued['queue_ms'].median() / 1e3:.0f} s): {setting} lets the runner take one at a time, "
                f"while up to {seen.calls_at_once} calls were in flight at once"
                + (f" (few samples: {len(overlapped)})" if len(overlapped) < opts.min_samples else "")]
    if len(queued):
        return [f"{len(queued)} of {len(overlapped)} calls that overlapped another waited {QUEUED_S:.0f} s or more "
                f"outside the runner (median {queued['queue_ms'].median() / 1e3:.1f} s); the runner ran up to "
                f"{seen.tasks_at_once} tasks at once"]
    return []


def _other_findings(seen: _Seen, st: dict[str, str]) -> list[str]:
    """Loads a call waited for, 503s, aborts and context shifts, in words with counts."""
    said: list[str] = []
    if seen.waited.any():
        unloads = seen.unloads
        after = f" after {unloads} unload(s) of the model (keep-alive {st['keep_alive']})" if unloads and "keep_alive" in st else ""
        said.append(f"{int(seen.waited.sum())} call(s) waited for a model load{after}: {len(seen.cold)} cold load(s) of "
                    f"{seen.cold['seconds'].sum():.1f} s, median wait {seen.wait_s.median():.1f} s; the first call after an "
                    f"unload waits for the next load")
    if seen.n503:
        said.append(f"{seen.n503} of {len(seen.calls)} calls were refused with 503: Ollama's queue was full"
                    + (f" (OLLAMA_MAX_QUEUE={st['max_queue']})" if "max_queue" in st else ""))
    if seen.aborts:
        said.append(f"{seen.aborts} completion(s) aborted because the client closed the connection")
    if seen.shifts:
        said.append(f"{seen.shifts} context shift(s): a prompt outgrew its context and the runner dropped tokens")
    return said


@register("ollama")
def ollama_summary(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Ollama's settings against the concurrency seen, queue times, loads, 503s, aborts."""
    return summary(ds, opts)[0]


@register("ollama-findings")
def ollama_findings(ds: Dataset, opts: Options) -> pd.DataFrame:
    """What Ollama's lines show, in words with counts."""
    return pd.DataFrame({"finding": summary(ds, opts)[1]}, dtype=object)
