"""Events -> task records and sample tables, streaming: only still-open tasks are held.

Each chunk's events are folded into per-task partial rows with one ``groupby``; partials of
tasks still running are merged with the next chunk's. A task is closed when its release and
timings (or cancellation) have been seen, when its process restarts, or at the end of input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .events import (
    CANCEL, CONFIG, ERROR, EVAL, HEARTBEAT, LAUNCH, PROGRESS, PROMPT_EVAL, RELEASE, TOTAL,
)

KEY = ["port", "session", "task"]

TASK_COLUMNS = [
    "source", "session", "slot", "task_id", "launch_s", "prefill_start_s", "first_token_s",
    "release_s", "wait_before_prefill_ms", "prompt_tokens_new", "prompt_tokens_cached", "n_gen",
    "prompt_eval_ms", "eval_ms", "prefill_tps", "gen_tps", "truncated", "status", "line",
]
GEN_COLUMNS = ["source", "session", "slot", "task_id", "t_s", "n_gen", "tg_tps", "tg_3s_tps", "window_s"]
PREFILL_COLUMNS = [
    "source", "session", "slot", "task_id", "t_s", "n_tokens", "progress", "elapsed_s", "tps", "step_tokens",
]

_FIRST = "first"
# Partial-row columns and how two partials of one task combine.
_AGG = {
    "slot": _FIRST, "file": _FIRST, "line": _FIRST, "launch_us": _FIRST, "is_child": _FIRST,
    "prompt_eval_ms": _FIRST, "prompt_tokens_new": _FIRST, "eval_ms": _FIRST, "n_gen": _FIRST,
    "eval_us": _FIRST, "total_ms": _FIRST, "total_tokens": _FIRST, "total_us": _FIRST,
    "release_us": _FIRST, "n_tokens_released": _FIRST, "truncated": _FIRST, "release_line": _FIRST,
    "cancelled": "max", "error": "max", "n_heartbeats": "sum", "n_progress": "sum",
    "first_line": "min",
}


def _subset(ev: pd.DataFrame, kind: int, cols: dict[str, str]) -> pd.DataFrame:
    sub = ev.loc[ev["kind"] == kind, KEY + list(cols)]
    return sub.rename(columns=cols)


@dataclass
class TaskAssembler:
    """Folds event chunks of one server-log stream into finished task rows and samples."""

    source: str
    keep_samples: bool = True
    _open: pd.DataFrame | None = None
    _done: list[pd.DataFrame] = field(default_factory=list)
    _gen: list[pd.DataFrame] = field(default_factory=list)
    _prefill: list[pd.DataFrame] = field(default_factory=list)
    sessions: dict[tuple[int, int], dict] = field(default_factory=dict)

    def add(self, ev: pd.DataFrame) -> None:
        """Fold one chunk of events (with ``session`` assigned) into the open tasks."""
        if ev.empty:
            return
        self._track_sessions(ev)
        if self.keep_samples:
            hb = ev[ev["kind"] == HEARTBEAT]
            if len(hb):
                self._gen.append(hb[KEY + ["slot", "ts_us", "v1", "v2", "v3", "line"]])
            pp = ev[ev["kind"] == PROGRESS]
            if len(pp):
                self._prefill.append(pp[KEY + ["slot", "ts_us", "v1", "v2", "v3", "v4", "line"]])
        tev = ev[ev["task"].notna() & (ev["task"] >= 0)]
        if tev.empty:
            return
        tev = tev.assign(task=tev["task"].astype(np.int64))
        parts = [
            _subset(tev, LAUNCH, {"slot": "slot", "file": "file", "line": "line", "ts_us": "launch_us", "v1": "is_child"}),
            _subset(tev, PROMPT_EVAL, {"v1": "prompt_eval_ms", "v2": "prompt_tokens_new"}),
            _subset(tev, EVAL, {"v1": "eval_ms", "v2": "n_gen", "ts_us": "eval_us"}),
            _subset(tev, TOTAL, {"v1": "total_ms", "v2": "total_tokens", "ts_us": "total_us"}),
            _subset(tev, RELEASE, {"ts_us": "release_us", "v1": "n_tokens_released", "v2": "truncated", "line": "release_line"}),
        ]
        flags = tev[KEY].copy()
        flags["cancelled"] = (tev["kind"] == CANCEL).astype(np.int8)
        flags["error"] = (tev["kind"] == ERROR).astype(np.int8)
        flags["n_heartbeats"] = (tev["kind"] == HEARTBEAT).astype(np.int64)
        flags["n_progress"] = (tev["kind"] == PROGRESS).astype(np.int64)
        flags["first_line"] = tev["line"]
        flags["slot"] = tev["slot"]
        parts.append(flags)
        chunk = pd.concat(parts, ignore_index=True)
        if self._open is not None and len(self._open):
            chunk = pd.concat([self._open, chunk], ignore_index=True)
        agg = {c: a for c, a in _AGG.items() if c in chunk.columns}
        merged = chunk.groupby(KEY, sort=False, dropna=False).agg(agg).reset_index()
        for c in _AGG:
            if c not in merged.columns:
                merged[c] = np.nan
        self._close(merged, ev)

    def _close(self, merged: pd.DataFrame, ev: pd.DataFrame) -> None:
        cur_session: dict[int, int] = {}
        for (p, s) in self.sessions:
            cur_session[p] = max(cur_session.get(p, s), s)
        latest = ev[ev["ts_us"] >= 0].groupby(["port", "session"])["ts_us"].max()
        has_release = merged["release_us"].notna()
        has_timings = merged["total_ms"].notna() | merged["eval_ms"].notna()
        cancelled = merged["cancelled"].fillna(0) > 0
        now = pd.MultiIndex.from_frame(merged[["port", "session"]]).map(latest.to_dict()).to_numpy(dtype=float, na_value=np.nan) if len(latest) else np.full(len(merged), np.nan)
        # Older builds print the release before the timings; wait a little for them.
        stale_release = has_release & ((now - merged["release_us"].to_numpy(dtype=float)) > 5e6)
        old_session = merged["session"].to_numpy() < merged["port"].map(cur_session).to_numpy(dtype=float)
        done = (has_release & (has_timings | cancelled)) | stale_release | old_session
        merged["cut_by_restart"] = old_session & ~has_release.to_numpy()
        if done.any():
            self._done.append(merged[done])
        self._open = merged[~done].drop(columns=["cut_by_restart"])

    def _track_sessions(self, ev: pd.DataFrame) -> None:
        timed = ev[ev["ts_us"] >= 0]
        for (port, session), g in timed.groupby(["port", "session"], sort=False):
            info = self.sessions.setdefault((int(port), int(session)), {
                "first_line": int(g["line"].iloc[0]), "file": g["file"].iloc[0], "first_us": int(g["ts_us"].iloc[0]),
                "offset_us": None, "offset_support": 0, "n_slots": None, "n_ctx_slot": None,
            })
            info["last_us"] = int(g["ts_us"].iloc[-1])
            w = g[g["wall_us"] >= 0]
            if len(w):
                off = int((w["wall_us"] - w["ts_us"]).min())
                info["offset_us"] = off if info["offset_us"] is None else min(off, info["offset_us"])
                info["offset_support"] += len(w)
            cfg = g[g["kind"] == CONFIG]
            if len(cfg):
                info["n_slots"] = int(cfg["v1"].iloc[0])
                info["n_ctx_slot"] = int(cfg["v2"].iloc[0])

    def finish(self) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        """Close every task still open; return (tasks, gen samples, prefill samples, sessions)."""
        if self._open is not None and len(self._open):
            rest = self._open.copy()
            rest["cut_by_restart"] = False
            self._done.append(rest)
            self._open = None
        raw = pd.concat(self._done, ignore_index=True) if self._done else pd.DataFrame(columns=KEY + list(_AGG) + ["cut_by_restart"])
        sessions = self._sessions_table()
        tasks = _derive(raw, self.source, sessions)
        gen = _gen_samples(self._gen, self.source, tasks)
        prefill = _prefill_samples(self._prefill, self.source)
        return tasks, gen, prefill, sessions

    def _sessions_table(self) -> pd.DataFrame:
        rows = []
        for (port, session), info in sorted(self.sessions.items()):
            rows.append({
                "source": self.source, "port": port, "session": session, "file": info["file"],
                "first_line": info["first_line"], "first_s": info["first_us"] / 1e6,
                "last_s": info.get("last_us", info["first_us"]) / 1e6,
                "n_slots": info["n_slots"], "n_ctx_slot": info["n_ctx_slot"],
                "wall_offset_us": info["offset_us"], "wall_offset_support": info["offset_support"],
            })
        cols = ["source", "port", "session", "file", "first_line", "first_s", "last_s", "n_slots",
                "n_ctx_slot", "wall_offset_us", "wall_offset_support"]
        df = pd.DataFrame(rows, columns=cols)
        df["start_at"] = pd.to_datetime(df["wall_offset_us"].astype("Int64"), unit="us", utc=True)
        return df


def _us_to_s(col: pd.Series) -> pd.Series:
    v = col.astype("float64")
    return v.where(v >= 0) / 1e6


def _derive(raw: pd.DataFrame, source: str, sessions: pd.DataFrame) -> pd.DataFrame:
    """Timeline arithmetic of research/log-formats.md §1.3, column-wise."""
    raw = raw.sort_values(["port", "session", "launch_us", "first_line"], kind="stable", na_position="last")
    t = pd.DataFrame(index=raw.index)
    t["source"] = source
    t["session"] = raw["session"].astype("int64")
    t["slot"] = raw["slot"].astype("Int64")
    t["task_id"] = raw["task"].astype("int64")
    t["launch_s"] = _us_to_s(raw["launch_us"])
    anchor = raw["eval_us"].where(raw["eval_us"] >= 0, raw["total_us"]).astype("float64")
    total_ms = raw["total_ms"].astype("float64").fillna(raw["prompt_eval_ms"].astype("float64") + raw["eval_ms"].astype("float64"))
    t["prefill_start_s"] = (anchor.where(anchor >= 0) - total_ms * 1000) / 1e6
    t["first_token_s"] = t["prefill_start_s"] + raw["prompt_eval_ms"].astype("float64") / 1000
    t["release_s"] = _us_to_s(raw["release_us"])
    t["wait_before_prefill_ms"] = (t["prefill_start_s"] - t["launch_s"]) * 1000
    t["prompt_tokens_new"] = raw["prompt_tokens_new"].astype("Int64")
    n_gen = raw["n_gen"].astype("Int64")
    t["prompt_tokens_cached"] = raw["n_tokens_released"].astype("Int64") - n_gen + 1 - t["prompt_tokens_new"]
    t["n_gen"] = n_gen
    t["prompt_eval_ms"] = raw["prompt_eval_ms"].astype("float64")
    t["eval_ms"] = raw["eval_ms"].astype("float64")
    with np.errstate(divide="ignore", invalid="ignore"):
        t["prefill_tps"] = (t["prompt_tokens_new"].astype("float64") / (t["prompt_eval_ms"] / 1000)).replace([np.inf, -np.inf], np.nan)
        t["gen_tps"] = ((n_gen.astype("float64") - 1) / (t["eval_ms"] / 1000)).replace([np.inf, -np.inf], np.nan)
    t["truncated"] = raw["truncated"].astype("float64").map({1.0: True, 0.0: False}).astype("boolean")
    has_release = raw["release_us"].notna()
    has_timings = raw["total_ms"].notna() | raw["eval_ms"].notna()
    cancelled = (raw["cancelled"].fillna(0) > 0) | (has_release & ~has_timings)
    status = np.where(has_release & has_timings & ~(raw["cancelled"].fillna(0) > 0), "complete",
                      np.where(cancelled, "cancelled", "incomplete"))
    t["status"] = status
    t["line"] = raw["line"].astype("Int64")
    # Columns beyond the stable set.
    t["file"] = raw["file"]
    t["port"] = raw["port"].astype("int64")
    t["release_line"] = raw["release_line"].astype("Int64")
    t["total_ms"] = raw["total_ms"].astype("float64")
    t["n_tokens_released"] = raw["n_tokens_released"].astype("Int64")
    t["prompt_tokens"] = t["prompt_tokens_cached"] + t["prompt_tokens_new"]
    t["n_heartbeats"] = raw["n_heartbeats"].fillna(0).astype("int64")
    t["n_progress"] = raw["n_progress"].fillna(0).astype("int64")
    t["has_timings"] = has_timings.to_numpy()
    t["has_release"] = has_release.to_numpy()
    t["cut_by_restart"] = raw["cut_by_restart"].fillna(False).astype(bool).to_numpy()
    t["is_child"] = raw["is_child"].astype("float64").map({1.0: True, 0.0: False}).astype("boolean")
    t["error"] = raw["error"].fillna(0).astype(bool).to_numpy()
    # Log values have µs (times) and 10 µs (ms fields) resolution; do not print float noise.
    for c in ("launch_s", "prefill_start_s", "first_token_s", "release_s"):
        t[c] = t[c].round(6)
    for c in ("wait_before_prefill_ms", "prefill_tps", "gen_tps"):
        t[c] = t[c].round(3)
    offsets = sessions.set_index(["port", "session"])["wall_offset_us"] if len(sessions) else pd.Series(dtype=float)
    off = pd.MultiIndex.from_frame(raw[["port", "session"]]).map(offsets.to_dict()) if len(raw) else pd.Index([])
    off = pd.Series(np.asarray(off, dtype="float64"), index=t.index)
    if off.notna().any():
        t["launch_at"] = pd.to_datetime((off + raw["launch_us"].astype("float64")).round().astype("Int64"), unit="us", utc=True)
        t["release_at"] = pd.to_datetime((off + raw["release_us"].astype("float64")).round().astype("Int64"), unit="us", utc=True)
        t["prefill_start_at"] = pd.to_datetime((off + t["prefill_start_s"] * 1e6).round().astype("Int64"), unit="us", utc=True)
        t["first_token_at"] = pd.to_datetime((off + t["first_token_s"] * 1e6).round().astype("Int64"), unit="us", utc=True)
    return t.reset_index(drop=True)


def _gen_samples(chunks: list[pd.DataFrame], source: str, tasks: pd.DataFrame) -> pd.DataFrame:
    if not chunks:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in GEN_COLUMNS + ["tokens", "line", "port"]})
    hb = pd.concat(chunks, ignore_index=True)
    hb = hb.sort_values(KEY + ["ts_us"], kind="stable")
    g = pd.DataFrame({
        "source": source, "session": hb["session"].astype("int64"), "slot": hb["slot"].astype("Int64"),
        "task_id": hb["task"].astype("int64"), "t_s": _us_to_s(hb["ts_us"]), "n_gen": hb["v1"].astype("Int64"),
        "tg_tps": hb["v2"], "tg_3s_tps": hb["v3"], "port": hb["port"].astype("int64"), "line": hb["line"].astype("int64"),
    })
    same = (g[["port", "session", "task_id"]] == g[["port", "session", "task_id"]].shift(1)).all(axis=1)
    prev_t = g["t_s"].shift(1).where(same)
    prev_n = g["n_gen"].shift(1).where(same)
    # The first heartbeat's window starts at the task's first token (t_print_last is reset there).
    ft = tasks.set_index(["port", "session", "task_id"])["first_token_s"] if len(tasks) else pd.Series(dtype=float)
    ft = ft[~ft.index.duplicated()]
    first_token = pd.MultiIndex.from_frame(g[["port", "session", "task_id"]]).map(ft.to_dict())
    first_token = pd.Series(np.asarray(first_token, dtype="float64"), index=g.index)
    g["window_s"] = (g["t_s"] - prev_t).fillna(g["t_s"] - first_token)
    g["tokens"] = (g["n_gen"] - prev_n.astype("Int64")).fillna(g["n_gen"])
    g["window_s"] = g["window_s"].round(6)
    g["window_start_s"] = (g["t_s"] - g["window_s"]).round(6)
    return g[GEN_COLUMNS + ["tokens", "window_start_s", "line", "port"]].reset_index(drop=True)


def _prefill_samples(chunks: list[pd.DataFrame], source: str) -> pd.DataFrame:
    if not chunks:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in PREFILL_COLUMNS + ["step_s", "line", "port"]})
    pp = pd.concat(chunks, ignore_index=True).sort_values(KEY + ["ts_us"], kind="stable")
    p = pd.DataFrame({
        "source": source, "session": pp["session"].astype("int64"), "slot": pp["slot"].astype("Int64"),
        "task_id": pp["task"].astype("int64"), "t_s": _us_to_s(pp["ts_us"]), "n_tokens": pp["v1"].astype("Int64"),
        "progress": pp["v2"], "elapsed_s": pp["v3"], "tps": pp["v4"], "port": pp["port"].astype("int64"),
        "line": pp["line"].astype("int64"),
    })
    same = (p[["port", "session", "task_id"]] == p[["port", "session", "task_id"]].shift(1)).all(axis=1)
    p["step_tokens"] = (p["n_tokens"] - p["n_tokens"].shift(1)).where(same).astype("Int64")
    p["step_s"] = (p["t_s"] - p["t_s"].shift(1)).where(same).round(6)
    return p[PREFILL_COLUMNS + ["step_s", "line", "port"]].reset_index(drop=True)
