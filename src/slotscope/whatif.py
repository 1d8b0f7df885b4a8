"""What a server setting would have changed: the logged workload replayed under other settings.

Three parts, each a model of the mechanism rather than a fit of the outcome:

* **Pass costs** (:func:`fit_pass_costs`). llama-server works in *passes*: one ``llama_decode``
  of at most ``n_batch`` tokens, cut into ``n_ubatch`` pieces. A pass's time is modelled as
  ``ubatches * c_ub + P * c_p + A_p * c_att + G * c_g + A_g * c_gatt + L * c_lora`` with P the
  prompt tokens in the pass, A_p the sum of their positions (attention grows with depth), G
  the generating slots (one token each), A_g the sum of their context lengths and L the tokens
  run with an adapter on. The coefficients are fitted by least relative squares on passes the
  logs show whole: progress-line steps (one pass each), the last chunk of a prefill, short
  prefills without lines, and generation between heartbeats (``tokens`` passes). Only stretches
  in which no task changed phase are used, and the batch of such a stretch follows from the
  rules below. A LoRA switch always coincides with a change of the batch, which those
  stretches leave out: its cost is not measurable at the default verbosity and is taken as 0.
* **The scheduler** (:func:`replay`), as ``update_slots`` in tools/server/server-context.cpp
  does it at b11434: generating slots first, in slot order, one token each; the first one
  sets the batch's LoRA and slots whose LoRA differs are left out (``can_batch_with``); then
  prompt slots in slot order, skipped when their LoRA differs, filling the batch up to
  ``n_batch``. A task arriving while every slot is busy is deferred, first in first out, and
  launched when a slot is released, onto the slot the prompt-cache rule below picks.
  Heartbeats and progress lines are printed as the server prints them, so the report's own
  analyzers read the replay as they read a log.
* **The workload** (:func:`workload`). Closed loop by default when the app log names users: a
  user's next call leaves its logged think time after the previous call ended. ``open_loop``
  replays the logged send times. Tasks no call explains replay at their logged launch.

Prompt-cache rule (:mod:`slotscope.prompt_cache`, after tools/server at b11434): each call's
prompt is modelled by what it shares with the others (its conversation's earlier turns, its
user's persona, a header), and slots are picked, saved to the host cache and loaded from it
as get_available_slot and server_prompt_cache do (:class:`slotscope.prompt_cache.HostCache`).
A change of LoRA setting then clears the slot (launch_slot_with_task). The call reuses the
common prefix of what the slot holds and its prompt, never the whole prompt (pre_decode). The
model is run once with the logged settings: where a replay's cache model gives a call the reuse
it gives it there, the call keeps its logged split (the logs know the prompts; the model does
not), and takes the model's figure where a setting changed it (a LoRA setting, slots, an order
that n_batch changed). The context is modelled too: a prompt that no longer fits the per-slot
context (``ctx / slots``) is refused, as the server refuses it, and a generation that would
overflow it stops there.

Memory: the logs are read a part of the busy periods at a time (:mod:`slotscope.periods`), and
a replay is measured a stretch between its idle moments at a time (:func:`measure`); what
grows with the log is a few numbers per task. A replay that never idles is measured whole.

Intervals come from resampling users' sessions (a call's app session; a task no call explains
is a unit of its own) over the replay's results: they say how much the figure rests on the
few sessions behind it, not how wrong the model is. That is the ``replayed`` column's job: the
model run with the logged settings, on every run.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import heapq
import itertools
import math
import mmap
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import pandas as pd
from rich.console import Console
from rich.rule import Rule

from . import timeline as tl
from .analyze import Options
from .analyze.stalls import MIN_PIECE_S, generation_segments, task_pieces
from .analyze.turns import CONDITIONS, SHORT_TOKENS, is_chat_turn, turn_conditions
from .analyze.waits import CAUSES, classify_waits
from .resample import QUANTILES, resampled_stats
from .dataset import Dataset, calls_of, task_view, task_view_rows
from .periods import PART_TASKS, Part, PartStore
from .prompt_cache import HostCache, Tokens, token_model
from .errors import UsageError
from .filters import matching
from .output import print_table
from .workers import beside, workers_for

TABLE_NAMES = ["summary", "pass-costs", "pass-fit", "settings", "findings"]
SUMMARY_COLUMNS = ["setting", "metric", "logged", "replayed", "whatif", "whatif_low", "whatif_high", "samples", "note"]
COST_COLUMNS = ["term", "unit", "coefficient_ms", "observations", "seen_min", "seen_max", "note"]
FIT_COLUMNS = ["kind", "observations", "passes", "median_error_pct", "p90_abs_error_pct", "bias_pct"]
SETTING_COLUMNS = ["setting", "name", "logged", "whatif", "note"]
FINDING_COLUMNS = ["setting", "finding"]
SETTING_NOTES = {"n_batch": "logged: the fullest pass the progress lines show",
                 "n_ubatch": "logged: the default (not in the log at verbosity 3)",
                 "slots": "from the start-up line", "ctx": "the whole context (-c), shared by the slots"}

# What the workload and the replay's metrics read of the task view.
WORKLOAD_COLUMNS = tl.GROUP + [
    "task_id", "slot", "launch_s", "prefill_start_s", "first_token_s", "release_s", "wait_before_prefill_ms",
    "prompt_tokens_new", "prompt_tokens_cached", "n_gen", "prompt_eval_ms", "eval_ms", "prefill_tps", "gen_tps",
    "truncated", "status", "line", "file", "release_line", "total_ms", "n_tokens_released", "prompt_tokens",
    "has_timings", "has_release", "time_resolution_s", "call_id", "purpose", "user", "lora", "queue_ms", "ttft_ms",
    "call_total_ms"]
SETTING_NAMES = ("n_batch", "n_ubatch", "slots", "lora", "ctx")
DEFAULT_N_BATCH = 2048  # llama-server's -b default (used when the logs show no full pass)
DEFAULT_N_UBATCH = 512  # -ub default: not in the log at verbosity 3
HEARTBEAT_TOKENS = 100  # print_timings_tg: only from n_gen >= 100 ...
HEARTBEAT_S = 3.0  # ... and at least this long after the last print
PROGRESS_S = 3.0  # print_timings_pp: only once the prefill has run this long
NOT_YET = -1  # a call's entry of the cache model's reuse until the replay that writes it has launched it
WAIT_S = 0.001  # how often a what-if replay waiting on that looks again
LEVEL = 0.90
FIT_OBSERVATIONS = 1 << 15  # stretches the pass costs are fitted on: an even draw of all the logs show
NO_ADAPTER = "none"  # the app log's label of a call without LoRA (scale 0)
_EPS = 1e-3  # a boundary this close to an interval's end belongs to the end
_Num = TypeVar("_Num", float, np.ndarray)
OBS_COLUMNS = ["kind", "seconds", "passes", "ubatch", "prompt_token", "prompt_attention", "gen_slot", "gen_attention",
               "lora_token", "pass_tokens", "gen_slots", "row"]
TERMS = ["ubatch", "prompt_token", "prompt_attention", "gen_slot", "gen_attention", "lora_token", "lora_switch"]
_UNITS = {"ubatch": "per ubatch (n_ubatch piece) of a pass", "prompt_token": "per prompt token",
          "prompt_attention": "per prompt token per 1M positions before it",
          "gen_slot": "per generating slot (one token)", "gen_attention": "per generated token per 1M tokens of its context",
          "lora_token": "per token run with an adapter on", "lora_switch": "per change of adapter between passes"}


@dataclass(frozen=True)
class Settings:
    """Server settings of a replay; None (and ``lora="as-logged"``) keeps the logged value.

    ``lora``: ``as-logged``, ``unified`` (every call with the setting most calls used), a
    label from the app log (``none``: no adapter), or ``LABEL where CONDITION``: the calls the
    condition picks (a ``--where`` condition on the calls' columns) get LABEL, the rest keep
    theirs. ``ctx`` is the whole context (``-c``),
    shared by the slots as llama-server shares it (``kv_unified = false``).
    """

    n_batch: int | None = None
    n_ubatch: int | None = None
    slots: int | None = None
    lora: str = "as-logged"
    ctx: int | None = None

    def label(self) -> str:
        """``n_batch=512 lora=unified``: the settings that differ from the log, or ``as logged``."""
        parts = [f"{k}={getattr(self, k)}" for k in SETTING_NAMES
                 if getattr(self, k) is not None and not (k == "lora" and self.lora == "as-logged")]
        return " ".join(parts) or "as logged"


def parse_settings(items: Iterable[str]) -> Settings:
    """``["n_batch=512", "lora=unified"]`` -> :class:`Settings` (a usage error names a bad item)."""
    values: dict[str, object] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in SETTING_NAMES or not value:
            raise UsageError(None, None, f"--set {item!r}: give NAME=VALUE with NAME one of {', '.join(SETTING_NAMES)}")
        values[name] = _value(name, value)
    return Settings(**values)  # type: ignore[arg-type]


def parse_sweep(spec: str, base: Settings) -> list[Settings]:
    """``n_batch=256,512,1024`` -> one :class:`Settings` per value, the others as ``base``."""
    name, sep, values = spec.partition("=")
    name = name.strip()
    if not sep or name not in SETTING_NAMES or not values.strip():
        raise UsageError(None, None, f"--sweep {spec!r}: give NAME=V1,V2,... with NAME one of {', '.join(SETTING_NAMES)}")
    return [dataclasses.replace(base, **{name: _value(name, v.strip())})  # type: ignore[arg-type]
            for v in values.split(",")]


def _value(name: str, value: str) -> str | int:
    """A setting's value: lora's as given, the others' a positive whole number."""
    if name == "lora":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise UsageError(None, None, f"{name} must be a positive whole number, not {value!r}")
    return n


# --------------------------------------------------------------------------------------------
# The workload


@dataclass(frozen=True)
class TaskRows:
    """The replayed tasks' rows of the task view (:data:`WORKLOAD_COLUMNS`), read from it when
    asked: the view waits on disk (:meth:`Dataset.keep_on_disk`)."""

    ds: Dataset
    rows: np.ndarray  # their positions in the task view

    def __len__(self) -> int:
        return len(self.rows)

    def read(self, rows: np.ndarray | None = None, columns: Sequence[str] = WORKLOAD_COLUMNS) -> pd.DataFrame:
        """Every replayed task's row, or those at positions ``rows`` of them."""
        return task_view_rows(self.ds, self.rows if rows is None else self.rows[rows], columns)

    @functools.cached_property
    def shape(self) -> pd.DataFrame:
        """No row: the columns the view has and their types."""
        return self.read(np.zeros(0, dtype=np.int64))

    def column(self, name: str) -> pd.Series:
        return task_view_rows(self.ds, self.rows, [name])[name]


@dataclass
class Workload:
    """The tasks to replay, one row each, in the task view's order (``tv.rows``: their places in it)."""

    tv: TaskRows  # the logged tasks replayed (task view rows, one per task)
    group: np.ndarray  # session code (tasks of different server sessions never meet)
    send_s: np.ndarray  # logged send time on the server clock (launch - queue)
    next_call: np.ndarray  # closed loop: the row of the same user's next call (sent once this one ends), -1: none
    think_s: np.ndarray  # closed loop: logged time from the previous call's end to this send
    end_lag_s: np.ndarray  # logged time from release to the call's end (the client's end)
    new: np.ndarray  # prompt tokens processed, as logged
    cached: np.ndarray  # prompt tokens reused, as logged
    n_gen: np.ndarray  # tokens to generate
    lora: list[str]  # the LoRA setting, as a label
    user: np.ndarray  # user code, -1: none
    cluster: np.ndarray  # resampling unit: the app session, else the task itself
    closed: bool
    tokens: Tokens  # what the prompts have in common (slotscope.prompt_cache)
    model_logged: np.ndarray | None = None  # the cache model's reuse replayed as logged (None: not run yet)
    model_from: int = 0  # the process writing model_logged while this workload replays (0: written already)


def _labels(s: pd.Series) -> np.ndarray:
    return s.astype("object").where(s.notna(), None).to_numpy() if len(s) else np.zeros(0, dtype=object)


def _codes(s: pd.Series) -> np.ndarray:
    """Codes of a column's values in order of appearance, -1: NA (no Python object per row);
    int32, as the workload holds its codes."""
    return pd.factorize(s)[0].astype(np.int32)


@dataclass
class WorkloadTasks:
    """The logged tasks a replay takes and what reading the logs for them needs (the rest of
    the workload is read after that: :func:`workload`). Their columns are read from the task
    view one at a time: each becomes one compact array."""

    tv: TaskRows
    replayed: np.ndarray  # per task view row: whether it is one of them
    group: np.ndarray  # session code
    lora: list[str]  # the LoRA setting, as a label
    conv: np.ndarray  # conversation code (app session), -1: none
    cluster: np.ndarray  # resampling unit: the app session, else the task itself

    def column(self, name: str) -> pd.Series | None:
        """Their values of a task view column (None: the view has none)."""
        got = task_view(self.tv.ds, [name])
        return got[name][self.replayed].reset_index(drop=True) if name in got.columns else None

    def floats(self, name: str, missing: float = np.nan) -> np.ndarray:
        c = self.column(name)
        return np.full(len(self.tv), missing) if c is None else tl.floats(c)

    def codes(self, name: str) -> np.ndarray:
        c = self.column(name)
        return np.full(len(self.tv), -1, dtype=np.int32) if c is None else _codes(c)


def workload_tasks(ds: Dataset) -> WorkloadTasks:
    """The tasks replayed: every complete one with a first token, once per task."""
    keys = tl.GROUP + ["task_id"]
    head = task_view(ds, keys + ["status", "first_token_s"]).reset_index(drop=True)
    ok = np.asarray((head["status"] == "complete").fillna(False), dtype=bool) & np.isfinite(tl.floats(head["first_token_s"]))
    ok[ok] = ~head.loc[ok, keys].duplicated().to_numpy()
    n = int(ok.sum())
    # Codes and row numbers (below the number of tasks) are held as int32: half the room a task.
    group = tl.key_codes([head[ok]], tl.GROUP)[0].astype(np.int32) if n else np.zeros(0, dtype=np.int32)
    del head
    wt = WorkloadTasks(tv=TaskRows(ds, np.flatnonzero(ok).astype(np.int32)), replayed=ok, group=group, lora=[],
                       conv=np.zeros(0, dtype=np.int32), cluster=np.zeros(0, dtype=np.int32))
    lora = wt.column("lora")
    wt.lora = list(_fill_lora(_labels(lora) if lora is not None else np.full(n, None, dtype=object), group))
    call_id = wt.column("call_id")
    wt.conv = _app_sessions(ds, call_id) if call_id is not None else np.full(n, -1, dtype=np.int32)
    wt.cluster = np.where(wt.conv >= 0, wt.conv, wt.conv.max(initial=-1) + 1 + np.arange(n)).astype(np.int32)
    return wt


def workload(wt: WorkloadTasks, open_loop: bool = False) -> Workload:
    """The logged tasks as a workload to replay (see the module's docstring)."""
    n, group, conv = len(wt.tv), wt.group, wt.conv
    send = wt.floats("launch_s") - np.maximum(np.nan_to_num(wt.floats("queue_ms", 0.0) / 1000), 0)
    release = wt.floats("release_s")
    total = wt.floats("call_total_ms") / 1000
    end_lag = np.where(np.isfinite(total), send + total - release, 0.0)
    end_lag = np.clip(np.nan_to_num(end_lag), 0, None)
    new = np.nan_to_num(wt.floats("prompt_tokens_new")).astype(np.int64)
    cached = np.nan_to_num(wt.floats("prompt_tokens_cached")).astype(np.int64)
    n_gen = np.maximum(np.nan_to_num(wt.floats("n_gen")).astype(np.int64), 1)
    user = wt.codes("user")
    purpose_col = wt.column("purpose")
    chat = is_chat_turn(purpose_col).to_numpy() if purpose_col is not None else np.zeros(n, dtype=bool)
    purpose = _codes(purpose_col) if purpose_col is not None else np.full(n, -1, dtype=np.int32)
    del purpose_col
    tokens = token_model(new + cached, cached, n_gen, send, group, conv, user, chat, purpose)
    prev = np.full(n, -1, dtype=np.int64)
    think = np.zeros(n)
    closed = not open_loop and bool((user >= 0).any())
    if closed:
        order = np.lexsort((send, user, group))
        o_user, o_group = user[order], group[order]
        same = np.r_[False, (o_user[1:] == o_user[:-1]) & (o_group[1:] == o_group[:-1]) & (o_user[1:] >= 0)]
        p = np.r_[-1, order[:-1]]
        prev[order[same]] = p[same]
        has = prev >= 0
        prev_end = release[prev[has]] + end_lag[prev[has]]
        gap = send[has] - prev_end
        # A call sent before the previous one ended (the app ran two at once) is not waiting
        # for it: it keeps its logged offset from the previous send instead (think < 0 marks it).
        think[has] = np.where(gap >= 0, gap, -(send[has] - send[prev[has]]) - 1e-9)
    next_call = np.full(n, -1, dtype=np.int32)
    next_call[prev[prev >= 0]] = np.flatnonzero(prev >= 0)
    return Workload(tv=wt.tv, group=group, send_s=send, next_call=next_call, think_s=think, end_lag_s=end_lag, new=new,
                    cached=cached, n_gen=n_gen, lora=wt.lora, user=user, cluster=wt.cluster, closed=closed,
                    tokens=tokens)


def _fill_lora(labels: np.ndarray, group: np.ndarray) -> np.ndarray:
    """A task with no LoRA label (no call explains it) runs with its session's most common one."""
    out = labels.copy()
    missing = pd.isna(pd.Series(labels)).to_numpy()
    for g in np.unique(group):
        rows = group == g
        known = pd.Series(labels[rows]).dropna()
        common = known.value_counts().index[0] if len(known) else NO_ADAPTER
        out[missing & rows] = common
    return out


def _app_sessions(ds: Dataset, call_id: pd.Series) -> np.ndarray:
    """Each task's app session (conversation) code where its call (``call_id``) names one, else -1."""
    n = len(call_id)
    if ds.matches is None:
        return np.full(n, -1, dtype=np.int32)
    calls = calls_of(ds, ["call_id", "app_session"])
    if "app_session" not in calls.columns:
        return np.full(n, -1, dtype=np.int32)
    # A call id's first call names the session; ids coded over both tables at once (-1: NA).
    ids = _codes(pd.concat([calls["call_id"].astype(call_id.dtype), call_id], ignore_index=True))
    call_ids, task_ids = ids[:len(calls)], ids[len(calls):]
    first = np.full(int(ids.max(initial=-1)) + 2, -1, dtype=np.int64)  # (the last place: NA's, naming none)
    known, at = np.unique(call_ids, return_index=True)
    first[known[known >= 0]] = at[known >= 0]
    conv = np.r_[_codes(calls["app_session"]), -1].astype(np.int32)
    return conv[first[task_ids]]


# --------------------------------------------------------------------------------------------
# Pass costs


@dataclass(frozen=True)
class PassCosts:
    """A pass's time, fitted (seconds per unit of each term, :data:`TERMS`)."""

    coef: dict[str, float]
    seen: dict[str, tuple[float, float]]  # per feature: the smallest and largest value per pass fitted on
    observations: dict[str, int]
    fit: pd.DataFrame  # the error on the logged passes, by kind
    max_pass_tokens: int
    max_gen_slots: int


def ubatches(tokens: Sequence[int], n_ubatch: int) -> int:
    """:func:`_ubatches` (passes repeat: the count is kept per pass shape)."""
    return _ubatches(tuple(tokens), n_ubatch)


@functools.lru_cache(maxsize=1 << 16)
def _ubatches(tokens: tuple[int, ...], n_ubatch: int) -> int:
    """How many ubatches llama_decode cuts a pass into, given each slot's tokens in it (index:
    slot id). With one KV stream per slot (``kv_unified = false``) a ubatch holds an equal
    number of tokens of each of its sequences, and only sequences with consecutive ids
    (llama-batch's ``split_equal``, sequential): two generating slots with an idle one between
    them cost two ubatches, not one."""
    rem = list(tokens)
    n = 0
    start = 0
    while True:
        while start < len(rem) and rem[start] <= 0:
            start += 1
        if start >= len(rem):
            return n
        end = start + 1
        while end < len(rem) and rem[end] > 0 and end - start < n_ubatch:
            end += 1
        per = max(1, min(min(rem[start:end]), n_ubatch // (end - start)))
        for k in range(start, end):
            rem[k] -= per
        n += 1


def _positions(p0: _Num, p: _Num) -> _Num:
    """Sum of positions p0 .. p0+p-1, in millions (the attention work of a prompt chunk)."""
    return (p * p0 + p * (p - 1) / 2) / 1e6


class _Phases:
    """Per session and LoRA label: how many tasks prefill or generate at a time, and the summed
    context of those generating (linear within a stretch between boundaries)."""

    def __init__(self, tv: pd.DataFrame, lora: np.ndarray, group: np.ndarray) -> None:
        self.ps, self.ft, self.rel = (tl.floats(tv[c]) for c in ("prefill_start_s", "first_token_s", "release_s"))
        prompt = np.nan_to_num(tl.floats(tv["prompt_tokens_new"]) + tl.floats(tv["prompt_tokens_cached"]))
        n_gen = np.nan_to_num(tl.floats(tv["n_gen"]))
        span = np.where(self.rel > self.ft, self.rel - self.ft, np.inf)
        # context of a generating task at time t: prompt + n_gen * (t - ft) / span = a + b t
        self.b = n_gen / span
        self.a = prompt - self.b * self.ft
        self.lora_code, self.labels = pd.factorize(pd.Series(lora, dtype="object"))
        self.group = group
        bounds = np.concatenate([self.ps, self.ft, self.rel])
        bgroup = np.concatenate([group, group, group])
        keep = np.isfinite(bounds)
        order = np.lexsort((bounds[keep], bgroup[keep]))
        self.b_t, self.b_g = bounds[keep][order], bgroup[keep][order]
        self.slot = np.nan_to_num(tl.floats(tv["slot"]), nan=-1).astype(np.int64)
        self._masks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def masks_at(self, g: np.ndarray, lc: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The slots generating with that LoRA at each ``t``, as bit masks."""
        out = np.zeros(len(t), dtype=np.int64)
        for gg, ll in set(zip(g.tolist(), lc.tolist())):
            q = (g == gg) & (lc == ll)
            times, masks = self._mask_steps(gg, ll)
            i = np.searchsorted(times, t[q], "right") - 1
            out[q] = np.where(i >= 0, masks[np.maximum(i, 0)] if len(masks) else 0, 0)
        return out

    def _mask_steps(self, g: int, lc: int) -> tuple[np.ndarray, np.ndarray]:
        key = (g, lc)
        if key not in self._masks:
            rows = np.flatnonzero((self.group == g) & (self.lora_code == lc) & np.isfinite(self.ft) & np.isfinite(self.rel))
            times = np.r_[self.ft[rows], self.rel[rows]]
            bits = np.r_[self.slot[rows], self.slot[rows]]
            sign = np.r_[np.ones(len(rows), dtype=np.int64), -np.ones(len(rows), dtype=np.int64)]
            order = np.lexsort((sign, times))
            mask, masks = 0, []
            for b, sg in zip(bits[order].tolist(), sign[order].tolist()):
                if b >= 0:
                    mask = mask | (1 << b) if sg > 0 else mask & ~(1 << b)
                masks.append(mask)
            self._masks[key] = (times[order], np.array(masks, dtype=np.int64))
        return self._masks[key]

    def crossings(self, g: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
        """Boundaries (a task's prefill start, first token or release) strictly inside each interval."""
        key = g.astype(np.float64) * 1e7
        bk = self.b_g.astype(np.float64) * 1e7 + self.b_t
        return np.searchsorted(bk, key + t1 - _EPS, "left") - np.searchsorted(bk, key + t0 + _EPS, "right")

    def at(self, g: np.ndarray, lora_code: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """At times ``t``: tasks prefilling and generating with that LoRA, and the generating ones' summed context."""
        pre = np.zeros(len(t))
        gen = np.zeros(len(t))
        ctx = np.zeros(len(t))
        for (gg, lc) in set(zip(g.tolist(), lora_code.tolist())):
            q = (g == gg) & (lora_code == lc)
            rows = (self.group == gg) & (self.lora_code == lc)
            tq = t[q]
            ps, ft, rel = self.ps[rows], self.ft[rows], self.rel[rows]
            pre[q] = _sum_in(ps, ft, np.ones(len(ps)), tq)
            gen[q] = _sum_in(ft, rel, np.ones(len(ft)), tq)
            ctx[q] = _sum_in(ft, rel, self.a[rows], tq) + tq * _sum_in(ft, rel, self.b[rows], tq)
        return pre, gen, ctx


def _sum_in(s: np.ndarray, e: np.ndarray, v: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Sum of ``v`` over the intervals [s, e) holding each t (cumulative sums at starts minus at ends)."""
    ok = np.isfinite(s) & np.isfinite(e) & np.isfinite(v)
    s, e, v = s[ok], e[ok], v[ok]
    os_, oe = np.argsort(s), np.argsort(e)
    cs, ce = np.r_[0, np.cumsum(v[os_])], np.r_[0, np.cumsum(v[oe])]
    return cs[np.searchsorted(s[os_], t, "right")] - ce[np.searchsorted(e[oe], t, "right")]


def pass_observations(ds: Dataset, tv: pd.DataFrame, lora: np.ndarray, group: np.ndarray, n_batch: int,
                      n_ubatch: int, steps_only: bool = False) -> pd.DataFrame:
    """Stretches of the log whose passes are known: ``kind``, ``seconds``, ``passes``, the
    features summed over the passes (:data:`TERMS` but the switch), the tokens of one pass.
    ``steps_only``: the progress-line steps alone (what n_batch is read from)."""
    ph = _Phases(tv, lora, group)
    out = []
    cached = np.nan_to_num(tl.floats(tv["prompt_tokens_cached"]))
    new = np.nan_to_num(tl.floats(tv["prompt_tokens_new"]))
    on = np.array([str(x) != NO_ADAPTER for x in lora], dtype=bool)
    keys = tl.GROUP + ["task_id"]

    def rows_of(frame: pd.DataFrame) -> np.ndarray:
        f, r = tl.join_tasks(frame, tv[keys])
        row = np.full(len(frame), -1)
        row[f] = r
        return row

    # Prefill: steps between progress lines (one pass each), the last chunk, short prefills.
    pre = ds.server.prefill_samples
    lines = pre[pre["task_id"].notna()] if pre is not None and len(pre) else None
    items: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    has_lines = np.zeros(len(tv), dtype=bool)
    if lines is not None and len(lines):
        row = rows_of(lines)
        t = tl.floats(lines["t_s"])
        n_tok = tl.floats(lines["n_tokens"])
        order = np.lexsort((t, row))
        row, t, n_tok = row[order], t[order], n_tok[order]
        same = np.r_[False, (row[1:] == row[:-1]) & (row[1:] >= 0)]
        t_prev, n_prev = np.r_[np.nan, t[:-1]], np.r_[np.nan, n_tok[:-1]]
        k = same & (n_tok > n_prev)
        items.append(("prefill_step", row[k], t_prev[k], t[k], n_tok[k] - n_prev[k], cached[row[k]] + n_prev[k]))
        last = np.r_[row[1:] != row[:-1], True] & (row >= 0)
        r = row[last]
        items.append(("prefill_last_chunk", r, t[last], tl.floats(tv["first_token_s"])[r], new[r] - n_tok[last],
                      cached[r] + n_tok[last]))
        has_lines[row[row >= 0]] = True
    if steps_only:
        items = items[:1]
    else:
        eval_ms = tl.floats(tv["prompt_eval_ms"])
        short = np.flatnonzero(~has_lines & (eval_ms < PROGRESS_S * 1000) & (new > 0))
        items.append(("prefill_whole", short, tl.floats(tv["prefill_start_s"])[short],
                      tl.floats(tv["first_token_s"])[short], new[short], cached[short]))
    for kind, r, t0, t1, p, p0 in items:
        ok = np.isfinite(t0) & np.isfinite(t1) & (t1 > t0) & (p > 0)
        r, t0, t1, p, p0 = r[ok], t0[ok], t1[ok], p[ok], p0[ok]
        g = group[r]
        clean = ph.crossings(g, t0, t1) == 0
        n_pre, n_gen, ctx = ph.at(g, ph.lora_code[r], (t0 + t1) / 2)
        clean &= n_pre == 1  # its own prefill only: no other prompt of its LoRA shares the batch
        room = n_batch - n_gen
        passes = np.where(kind == "prefill_whole", np.ceil(p / np.maximum(room, 1)), 1.0)
        clean &= (room > 0) & (p <= room * passes)
        r, t0, t1, p, p0, n_gen, ctx, passes = (x[clean] for x in (r, t0, t1, p, p0, n_gen, ctx, passes))
        chunk = np.minimum(p, room[clean])
        mid = (t0 + t1) / 2
        masks = ph.masks_at(group[r], ph.lora_code[r], mid)
        last = p - chunk * (passes - 1)  # (a short prefill's passes: full ones and the rest)
        ub = (_pass_ubatches(masks, ph.slot[r], chunk, n_ubatch) * (passes - 1)
              + _pass_ubatches(masks, ph.slot[r], last, n_ubatch))
        out.append(pd.DataFrame({
            "kind": kind, "seconds": t1 - t0, "passes": passes, "ubatch": ub, "prompt_token": p,
            "prompt_attention": _positions(p0, p), "gen_slot": n_gen * passes, "gen_attention": ctx * passes / 1e6,
            "lora_token": np.where(on[r], p + n_gen * passes, 0.0), "pass_tokens": chunk + n_gen, "gen_slots": n_gen,
            "row": r}))
    # Generation between heartbeats (and to the release): one token per pass.
    seg = generation_segments(ds, tv) if not steps_only else pd.DataFrame()
    if len(seg):
        r = rows_of(seg)
        t0, t1, tok = tl.floats(seg["start_s"]), tl.floats(seg["end_s"]), tl.floats(seg["tokens"])
        ok = (r >= 0) & (tok >= 1) & (t1 > t0)
        r, t0, t1, tok = r[ok], t0[ok], t1[ok], tok[ok]
        g = group[r]
        clean = ph.crossings(g, t0, t1) == 0
        n_pre, n_gen, ctx = ph.at(g, ph.lora_code[r], (t0 + t1) / 2)
        clean &= (n_pre == 0) & (n_gen >= 1)
        r, t0, t1, tok, n_gen, ctx = (x[clean] for x in (r, t0, t1, tok, n_gen, ctx))
        mid = (t0 + t1) / 2
        masks = ph.masks_at(group[r], ph.lora_code[r], mid)
        ub = _pass_ubatches(masks, np.full(len(r), -1), np.zeros(len(r)), n_ubatch)
        out.append(pd.DataFrame({
            "kind": "generation", "seconds": t1 - t0, "passes": tok, "ubatch": tok * ub,
            "prompt_token": 0.0, "prompt_attention": 0.0, "gen_slot": n_gen * tok, "gen_attention": ctx * tok / 1e6,
            "lora_token": np.where(on[r], n_gen * tok, 0.0), "pass_tokens": n_gen, "gen_slots": n_gen, "row": r}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=OBS_COLUMNS)


def _pass_ubatches(masks: np.ndarray, slot: np.ndarray, chunk: np.ndarray, n_ubatch: int) -> np.ndarray:
    """Ubatches of passes: the slots generating (a bit mask each), one token each, and
    ``chunk`` prompt tokens of ``slot`` (-1: none); counted once per distinct pass."""
    out = np.ones(len(masks))
    if not len(masks):
        return out
    # The distinct passes, hashed (np.unique over rows sorts them all; a MultiIndex's factorize
    # builds a tuple per row): each column coded, the codes joined into one key column by column.
    inv = np.zeros(len(masks), dtype=np.int64)
    for col in (masks, slot, np.asarray(chunk, dtype=np.int64)):
        codes, uniques = pd.factorize(col)
        inv, _ = pd.factorize(inv * len(uniques) + codes)
    first = np.unique(inv, return_index=True)[1]
    combos = zip(masks[first].tolist(), slot[first].tolist(), np.asarray(chunk, dtype=np.int64)[first].tolist())
    counts = np.empty(len(first))
    for k, (mask, sl, c) in enumerate(combos):
        width = max(int(mask).bit_length(), sl + 1, 1)
        tokens = [(int(mask) >> b) & 1 for b in range(width)]
        if sl >= 0:
            tokens[sl] += c
        counts[k] = max(ubatches(tokens, n_ubatch), 1)
    return counts[inv]


def fit_pass_costs(obs: pd.DataFrame) -> PassCosts:
    """Least relative squares of :data:`TERMS` on the observed stretches, coefficients kept
    non-negative (a term that would come out negative is dropped and the rest fitted again)."""
    y = obs["seconds"].to_numpy(dtype=float) if len(obs) else np.zeros(0)
    coef = _nonnegative_fit(obs, y)
    seen, counts = _term_ranges(obs)
    return PassCosts(coef=coef, seen=seen, observations=counts, fit=_fit_errors(obs, y, coef),
                     max_pass_tokens=int(obs["pass_tokens"].max()) if len(obs) else 0,
                     max_gen_slots=int(obs["gen_slots"].max()) if len(obs) else 0)


def _nonnegative_fit(obs: pd.DataFrame, y: np.ndarray) -> dict[str, float]:
    """Each term's seconds per unit, fitted on the stretches' times ``y`` (relative errors):
    terms the stretches never show are 0, and so is one that comes out negative (the others
    fitted again without it)."""
    coef = {t: 0.0 for t in TERMS}
    active = [t for t in TERMS[:-1] if len(obs) and float(obs[t].abs().sum()) > 0]
    while active and len(y) >= len(active):
        x = obs[active].to_numpy(dtype=float) / y[:, None]
        sol, *_ = np.linalg.lstsq(x, np.ones(len(y)), rcond=None)
        if (sol >= 0).all():
            coef.update(dict(zip(active, sol.tolist())))
            break
        active = [t for t, c in zip(active, sol) if c >= 0]
    return coef


def _term_ranges(obs: pd.DataFrame) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
    """Per term: the smallest and largest value per pass fitted on, and the stretches that
    show it (none show a LoRA switch)."""
    if not len(obs):
        return {}, {t: 0 for t in TERMS}
    per_pass = {t: (obs[t] / obs["passes"]).to_numpy(dtype=float) for t in TERMS[:-1]}
    seen = {t: (float(np.min(v)), float(np.max(v))) for t, v in per_pass.items()}
    counts = {t: int((obs[t] > 0).sum()) for t in TERMS[:-1]}
    counts["lora_switch"] = 0
    return seen, counts


def _fit_errors(obs: pd.DataFrame, y: np.ndarray, coef: dict[str, float]) -> pd.DataFrame:
    """The fit's error on the stretches' times ``y``, per kind of stretch and over all."""
    if not len(obs):
        return pd.DataFrame([], columns=FIT_COLUMNS)
    pred = obs[TERMS[:-1]].to_numpy(dtype=float) @ np.array([coef[t] for t in TERMS[:-1]])
    err = (pred - y) / y
    rows = []
    for kind in list(dict.fromkeys(obs["kind"])) + ["all"]:
        m = (obs["kind"] == kind).to_numpy() if kind != "all" else np.ones(len(obs), dtype=bool)
        e = err[m]
        rows.append({"kind": kind, "observations": int(m.sum()), "passes": int(obs["passes"][m].sum()),
                     "median_error_pct": float(np.median(e) * 100) if len(e) else math.nan,
                     "p90_abs_error_pct": float(np.quantile(np.abs(e), 0.9) * 100) if len(e) else math.nan,
                     "bias_pct": float((pred[m].sum() / y[m].sum() - 1) * 100) if len(e) else math.nan})
    return pd.DataFrame(rows, columns=FIT_COLUMNS)


def cost_table(costs: PassCosts) -> pd.DataFrame:
    """The fitted pass-cost model, one row per term."""
    rows = []
    for t in TERMS:
        lo, hi = costs.seen.get(t, (math.nan, math.nan))
        n = costs.observations.get(t, 0)
        note = ""
        if t == "lora_switch":
            note = "not measurable at verbosity 3 (a switch always changes the batch too); taken as 0"
        elif n == 0:
            note = "not in the logs; taken as 0"
        rows.append({"term": t, "unit": _UNITS[t], "coefficient_ms": costs.coef[t] * 1000, "observations": n,
                     "seen_min": lo, "seen_max": hi, "note": note})
    return pd.DataFrame(rows, columns=COST_COLUMNS)


# --------------------------------------------------------------------------------------------
# The scheduler


@dataclass(frozen=True)
class Resolved:
    """Settings with every value known (logged or asked)."""

    n_batch: int
    n_ubatch: int
    slots: int
    ctx: int
    unify: str | None  # the one LoRA label every call gets, None: as logged
    assign: tuple[str, str] | None = None  # (label, condition): the calls matching it get the label


def lora_labels(w: Workload, r: Resolved) -> list[str]:
    """Each call's LoRA setting in the replay: the one of ``unify``, else as logged but for the
    calls ``assign``'s condition picks, which get its label."""
    if r.unify is not None:
        return [r.unify] * len(w.lora)
    if r.assign is None:
        return w.lora  # (read only: as logged)
    labels = list(w.lora)
    label, condition = r.assign
    for i in np.flatnonzero(matching(w.tv.read(), condition, "--set lora=LABEL where").to_numpy()):
        labels[i] = label
    return labels


@dataclass
class Replay:
    """What the replay did: per task times and slots, heartbeats and progress lines."""

    slot: np.ndarray
    send: np.ndarray
    launch: np.ndarray
    prefill_start: np.ndarray
    first_token: np.ndarray
    release: np.ndarray
    n_gen: np.ndarray
    new: np.ndarray  # prompt tokens processed
    cached: np.ndarray  # prompt tokens reused: as logged, or the cache model's where it differs from its logged replay
    refused: np.ndarray
    lora: list[str]
    # Records laid end to end as float64 (a tuple of Python floats per line would take five times
    # the room): heartbeats of HB_FIELDS, progress lines of PROGRESS_FIELDS.
    heartbeats: array.array[float]
    progress: array.array[float]
    passes: int
    model_cached: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # the cache model's reuse (of the replay with the logged settings only)
    finished: list[int] = dataclasses.field(default_factory=list)  # rows released since the last flush


def replay(w: Workload, r: Resolved, costs: PassCosts, open_loop: bool = False) -> Replay:
    """Run the workload through the scheduler (see the module's docstring), session by session."""
    for res in replay_stretches(w, r, costs, open_loop):
        pass
    return res


def replay_stretches(w: Workload, r: Resolved, costs: PassCosts, open_loop: bool = False,
                     model_out: np.ndarray | None = None) -> Iterator[Replay]:
    """:func:`replay`, the replay given whenever no slot is busy (and at the end): every task in
    ``finished`` is done, with its heartbeats and progress lines; the caller may take them (and
    empty the three lists) to measure the replay a stretch at a time. ``model_out``: where the
    replay with the logged settings writes its cache model's reuse (default: a new array)."""
    n = len(w.tv)
    res = Replay(slot=np.full(n, -1, dtype=np.int32), send=np.full(n, np.nan), launch=np.full(n, np.nan),
                 prefill_start=np.full(n, np.nan), first_token=np.full(n, np.nan), release=np.full(n, np.nan),
                 n_gen=np.zeros(n, dtype=np.int64), new=w.new.copy(), cached=w.cached.copy(), refused=np.zeros(n, dtype=bool),
                 lora=lora_labels(w, r), heartbeats=array.array("d"), progress=array.array("d"), passes=0,
                 model_cached=model_out if model_out is not None else
                 np.zeros(n if w.model_logged is None else 0, dtype=np.int64))
    for g in np.unique(w.group):
        yield from _Session(w, r, costs, res, np.flatnonzero(w.group == g), open_loop or not w.closed).run()
    yield res


IDLE, PROMPT, GENERATING = 0, 1, 2  # a slot's state in the replay


@dataclass(slots=True)
class _Batch:
    """One pass's batch: the generating slots (a token each) and the prompt slots with the
    tokens each puts in, all of one LoRA setting (None: an empty batch)."""

    lora: str | None
    gens: list[int]
    chunks: list[tuple[int, int]]  # (slot, prompt tokens it puts in)
    size: int


class _Session:
    """The scheduler over one server session's tasks: the calls waiting to be sent, the queue,
    the slots and the clock. :meth:`run` replays them into ``res`` (the whole workload's).

    A slot's task's figures are Python numbers, read from the workload's arrays when it is
    launched and written back at its prefill start, first token and release: the passes
    read them one at a time, where a numpy element costs more than the arithmetic."""

    def __init__(self, w: Workload, r: Resolved, costs: PassCosts, res: Replay, rows: np.ndarray,
                 open_loop: bool) -> None:
        self.w, self.res = w, res
        self.coef = tuple(costs.coef[t] for t in TERMS)
        self.n_batch, self.n_ubatch, self.n_slots = r.n_batch, r.n_ubatch, r.slots
        self.n_ctx_slot = r.ctx // r.slots
        self.adapter_on = {x: x != NO_ADAPTER for x in set(res.lora[i] for i in rows)}
        self.prompt = w.tokens.prompt  # (new + cached)
        # Closed loop, a call is sent once its user's previous one ends (its next call, then).
        self.nxt = w.next_call if not open_loop else np.full(len(w.next_call), -1, dtype=np.int32)
        nxt = self.nxt[rows]
        waits = np.zeros(len(w.next_call), dtype=bool)
        waits[nxt[nxt >= 0]] = True
        self.heap: list[tuple[float, int]] = []  # (send time, row) of the calls to be sent
        for i in rows[~waits[rows]].tolist():
            heapq.heappush(self.heap, (float(w.send_s[i]), i))
        self.queue: deque[int] = deque()
        n = r.slots
        self.task = [-1] * n
        self.state = [IDLE] * n
        self.used = [-1.0] * n  # when the slot was last released
        self.cache = HostCache(w.tokens, res.n_gen, n, r.ctx)
        self.slot_lora: list[str | None] = [None] * n  # the LoRA setting the slot last ran with
        self.new = [0] * n  # prompt tokens the slot's task processes
        self.cached = [0] * n  # prompt tokens it reuses
        self.goal = [0] * n  # tokens it generates (cut where they would overflow the slot's context)
        self.t_prefill = [math.nan] * n  # when its prefill started
        self.done_p = [0] * n  # prompt tokens processed of the slot's task
        self.gen = [0] * n
        self.ctx = [0] * n  # tokens in the slot's context
        self.t_print = [0.0] * n
        self.n_print = [0] * n
        self.t_first = [0.0] * n
        self.cur_lora: str | None = None
        self.t = self.heap[0][0] if self.heap else 0.0
        # The slots a batch is made of, listed again only when a slot changes state.
        self.listed = False
        self.gens: list[int] = []  # the generating slots of the batch's LoRA setting (the first one's)
        self.gen_lora: str | None = None
        self.gen_ubatches = 0  # the ubatches of their tokens alone
        self.prompting: list[int] = []  # the slots processing a prompt

    def run(self) -> Iterator[Replay]:
        """Pass after pass: the calls sent by now queued, queued calls admitted to idle slots,
        one pass's batch run; when there is none, the replay is given (no slot is busy) and the
        clock jumps to the next send."""
        while True:
            self.receive()
            self.admit()
            batch = self.batch()
            if batch.size == 0:
                yield self.res
                if not self.heap:
                    if self.queue:  # (cannot happen: a queued task has a free slot or a busy one will release)
                        raise RuntimeError("replay stalled with queued tasks")
                    return
                self.t = max(self.t, self.heap[0][0])
                continue
            switch = 1.0 if (self.cur_lora is not None and batch.lora != self.cur_lora) else 0.0
            self.cur_lora = batch.lora
            lora_on = self.adapter_on.get(batch.lora, False) if batch.lora is not None else False
            if batch.chunks:
                self.run_pass(batch, switch, lora_on)
            else:
                self.run_generation(batch.gens, switch, lora_on)

    def receive(self) -> None:
        """The calls sent by now, into the queue in order of sending."""
        heap, t = self.heap, self.t
        while heap and heap[0][0] <= t + 1e-12:
            send, i = heapq.heappop(heap)
            self.res.send[i] = send
            self.queue.append(i)

    def admit(self) -> None:
        """launch_slot_with_task: queued calls, first in first out, onto the idle slots the
        prompt cache picks and loads (see the module's docstring); a change of LoRA setting
        drops the slot's tokens."""
        w, res, queue = self.w, self.res, self.queue
        while queue and IDLE in self.state:
            i = queue.popleft()
            idle = [s for s, st in enumerate(self.state) if st == IDLE]
            s = self.cache.pick(i, idle, self.used)
            keep = self.slot_lora[s] is None or self.slot_lora[s] == res.lora[i]
            model = self.cache.reused(s, i) if keep else 0
            if w.model_logged is None:  # (the replay with the logged settings: its model is what later ones are held to)
                res.model_cached[i] = model
                cached = int(w.cached[i])
            else:
                cached = int(w.cached[i]) if model == self._logged_model(i) else model
            new = int(self.prompt[i]) - cached
            res.cached[i], res.new[i] = cached, new
            self.cache.launched(s, i, idle)
            self.task[s], self.state[s], self.slot_lora[s] = i, PROMPT, res.lora[i]
            self.listed = False
            res.slot[i], res.launch[i] = s, self.t
            self.new[s], self.cached[s], self.goal[s] = new, cached, int(w.n_gen[i])
            self.t_prefill[s], self.done_p[s], self.gen[s] = math.nan, 0, 0

    def _logged_model(self, i: int) -> int:
        """The cache model's reuse of call ``i`` in the replay with the logged settings; where
        that replay runs beside this one (:func:`run`) and has not launched the call yet
        (:data:`NOT_YET`), once it has."""
        assert self.w.model_logged is not None
        m = int(self.w.model_logged[i])
        while m == NOT_YET:
            if os.getppid() != self.w.model_from:  # (that replay's process is gone: it will not come)
                raise RuntimeError("the replay with the logged settings ended before it launched a call")
            time.sleep(WAIT_S)
            m = int(self.w.model_logged[i])
        return m

    def batch(self) -> _Batch:
        """The next pass's batch: generating slots first, in slot order, one token each, the
        first setting the batch's LoRA (slots of another are left out); then prompt slots in
        slot order, of the same LoRA, filling the batch up to ``n_batch``."""
        if not self.listed:
            self._list_slots()
        batch = _Batch(self.gen_lora, self.gens, [], len(self.gens))
        self._take_prompts(batch)
        return batch

    def _list_slots(self) -> None:
        """The generating slots of the first one's LoRA setting (and their ubatches), and the
        prompt slots, each in slot order."""
        lora = self.res.lora
        self.gen_lora, self.gens, self.prompting = None, [], []
        for s in range(self.n_slots):
            if self.state[s] == GENERATING:
                la = lora[self.task[s]]
                if self.gen_lora is None:
                    self.gen_lora = la
                if la == self.gen_lora:
                    self.gens.append(s)
            elif self.state[s] == PROMPT:
                self.prompting.append(s)
        per_slot = [0] * self.n_slots
        for s in self.gens:
            per_slot[s] = 1
        self.gen_ubatches = _ubatches(tuple(per_slot), self.n_ubatch)
        self.listed = True

    def _take_prompts(self, batch: _Batch) -> None:
        """Prompt slots into ``batch``, up to ``n_batch``. A prompt's first chunk starts its
        prefill (a prompt that does not fit the slot's context is refused there, as the server
        refuses it); a prefill running for :data:`PROGRESS_S` prints a progress line a pass."""
        res, t = self.res, self.t
        new, cached, done_p = self.new, self.cached, self.done_p
        for s in self.prompting:
            if batch.size >= self.n_batch:
                break
            i = self.task[s]
            la = res.lora[i]
            if batch.lora is not None and la != batch.lora:
                continue
            if done_p[s] == 0 and math.isnan(self.t_prefill[s]):
                self.t_prefill[s] = res.prefill_start[i] = t
                if cached[s] + new[s] >= self.n_ctx_slot:
                    res.refused[i] = True
                    res.first_token[i] = t
                    self.release(s, t)
                    continue
                self.ctx[s] = cached[s]
            elif t - self.t_prefill[s] >= PROGRESS_S:
                res.progress.extend((i, t, done_p[s], (cached[s] + done_p[s]) / max(cached[s] + new[s], 1),
                                     t - self.t_prefill[s]))
            take = min(new[s] - done_p[s], self.n_batch - batch.size)
            batch.chunks.append((s, take))
            batch.size += take
            if batch.lora is None:
                batch.lora = la

    def run_generation(self, gens: list[int], switch: float, lora_on: bool) -> None:
        """A batch of generation only stays as it is until a slot finishes or a call arrives
        that an idle slot would take: those passes at once, each at the mean of their times
        (the context grows by a token a pass)."""
        c_ub, _, _, c_g, c_ag, c_l, c_s = self.coef
        goal, gen, ctx, t = self.goal, self.gen, self.ctx, self.t
        g = len(gens)
        held, k = 0, goal[gens[0]] - gen[gens[0]]
        for s in gens:  # (a loop: a batch has a few slots, too few for generators to pay)
            held += ctx[s]
            if goal[s] - gen[s] < k:
                k = goal[s] - gen[s]
        ag = held / 1e6
        base = c_ub * self.gen_ubatches + c_g * g + (c_l * g if lora_on else 0.0)
        if self.heap and IDLE in self.state:
            per = base + c_ag * ag
            k = max(1, min(k, math.ceil((self.heap[0][0] - t) / max(per, 1e-9))))
        dt = base + c_ag * (ag + (k - 1) / 2 * g / 1e6)
        t_start = t + c_s * switch
        for s in gens:
            self.heartbeats(s, t_start, dt, k, gen[s])
            gen[s] += k
            ctx[s] += k
        self.res.passes += k
        self.t = t_start + k * dt
        for s in gens:
            if gen[s] >= goal[s]:
                self.release(s, self.t)

    def run_pass(self, batch: _Batch, switch: float, lora_on: bool) -> None:
        """One pass with prompt tokens: its time from the pass costs, then each slot advanced
        by what it put in, and the slots done released; when none changed state, the passes
        alike to it (:meth:`repeat_pass`)."""
        c_ub, c_p, c_ap, c_g, c_ag, c_l, c_s = self.coef
        gens, chunks, ctx = batch.gens, batch.chunks, self.ctx
        g = len(gens)
        ag = sum(ctx[s] for s in gens) / 1e6
        per_slot = [0] * self.n_slots
        for s in gens:
            per_slot[s] = 1
        p, ap = 0, 0.0
        for s, take in chunks:
            per_slot[s] += take
            p += take
            ap += _positions(ctx[s], take)
        ub = _ubatches(tuple(per_slot), self.n_ubatch)
        dt = (c_ub * ub + c_p * p + c_ap * ap + c_g * g + c_ag * ag + (c_l * batch.size if lora_on else 0.0)
              + c_s * switch)
        self.t += dt
        self.res.passes += 1
        self._advance_generation(gens, dt)
        self._advance_prompts(chunks)
        for s in gens:
            if self.gen[s] >= self.goal[s]:
                self.release(s, self.t)
        for s, _ in chunks:
            if self.state[s] == GENERATING and self.gen[s] >= self.goal[s]:
                self.release(s, self.t)
        if self.listed and len(chunks) == 1:
            self.repeat_pass(batch, ub, lora_on)

    def repeat_pass(self, batch: _Batch, ubatches: int, lora_on: bool) -> None:
        """The passes after ``batch``'s (of ``ubatches``), while they are alike to it: the same
        generating slots and the same prompt slot filling the batch, until its prompt's last
        (smaller) chunk, a generation's last token or a call that an idle slot would take. They
        run back to back, each with the time :meth:`run_pass` gives it (the contexts grow a pass
        at a time), its progress line and its heartbeats. A call arriving with no slot idle
        waits as it would: :meth:`receive` queues it in order of sending once they are run."""
        c_ub, c_p, c_ap, c_g, c_ag, c_l, _ = self.coef  # (no LoRA switch: the pass before ran this batch)
        gens, (s, take) = batch.gens, batch.chunks[0]
        gen, ctx, goal = self.gen, self.ctx, self.goal
        n = (self.new[s] - self.done_p[s] - 1) // take  # passes before the prompt's last chunk ...
        ag = 0
        for k in gens:
            n = min(n, goal[k] - gen[k] - 1)  # ... and before a generation's last token
            ag += ctx[k]
        if n <= 0:
            return
        # run_pass's sum, term by term in its order (_positions inlined): the same float each pass.
        head, half = c_ub * ubatches + c_p * take, take * (take - 1) / 2
        g, gen_term, lora_term = len(gens), c_g * len(gens), (c_l * batch.size if lora_on else 0.0)
        arrival = self.heap[0][0] if self.heap and IDLE in self.state else math.inf
        i, t_pre, cached, whole = self.task[s], self.t_prefill[s], self.cached[s], max(self.cached[s] + self.new[s], 1)
        t, p0, done, progress = self.t, ctx[s], self.done_p[s], self.res.progress
        t_print, j_hb = self._heartbeat_gate(gens, 0)
        j = 0
        while j < n and arrival > t + 1e-12:
            if t - t_pre >= PROGRESS_S:
                progress.extend((i, t, done, (cached + done) / whole, t - t_pre))
            dt = head + c_ap * ((take * p0 + half) / 1e6) + gen_term + c_ag * (ag / 1e6) + lora_term
            t += dt
            j += 1
            p0 += take
            done += take
            ag += g
            if j >= j_hb or t - t_print >= HEARTBEAT_S:
                self._heartbeats_due(gens, t, dt, j)
                t_print, j_hb = self._heartbeat_gate(gens, j)
        for k in gens:
            gen[k] += j
            ctx[k] += j
        ctx[s], self.done_p[s] = p0, done
        self.res.passes += j
        self.t = t

    def _heartbeats_due(self, gens: list[int], t: float, dt: float, j: int) -> None:
        """The generating slots' heartbeats due after a pass of ``dt`` ended at ``t``, the
        ``j``-th since ``gen`` was counted (:meth:`repeat_pass` counts it after its last)."""
        gen, t_print = self.gen, self.t_print
        for k in gens:
            if gen[k] + j >= HEARTBEAT_TOKENS and t - t_print[k] >= HEARTBEAT_S:
                self.heartbeats(k, t - dt, dt, 1, gen[k] + j - 1)

    def _heartbeat_gate(self, gens: list[int], j: int) -> tuple[float, int]:
        """Before the passes after the ``j``-th of :meth:`repeat_pass`, when a heartbeat may
        next be due: the least recent print of the slots that have the tokens for one (no
        other is due before it: ``t - t_print`` only shrinks as ``t_print`` grows), and the
        pass at which the next slot gets them."""
        gen, t_print = self.gen, self.t_print
        least, at = math.inf, 1 << 62
        for k in gens:
            if gen[k] + j + 1 >= HEARTBEAT_TOKENS:
                least = min(least, t_print[k])
            else:
                at = min(at, HEARTBEAT_TOKENS - gen[k])
        return least, at

    def _advance_generation(self, gens: list[int], dt: float) -> None:
        """A token for each generating slot of a pass of ``dt`` that ended now, and its heartbeat
        where one is due."""
        for s in gens:
            self.gen[s] += 1
            self.ctx[s] += 1
        self._heartbeats_due(gens, self.t, dt, 0)

    def _advance_prompts(self, chunks: list[tuple[int, int]]) -> None:
        """Each prompt slot's chunk processed; a prompt done gives its first token, and a
        generation that would overflow the slot's context is cut to what fits."""
        t = self.t
        for s, take in chunks:
            self.done_p[s] += take
            self.ctx[s] += take
            if self.done_p[s] >= self.new[s]:
                self.state[s], self.listed = GENERATING, False
                self.gen[s] = 1
                self.res.first_token[self.task[s]] = t
                self.t_print[s], self.n_print[s], self.t_first[s] = t, 0, t
                limit = self.n_ctx_slot - (self.cached[s] + self.new[s])
                if limit < self.goal[s]:
                    self.goal[s] = max(limit, 1)

    def release(self, s: int, now: float) -> None:
        """The slot's task done at ``now``; closed loop, its user's next call sent after their
        think time (a negative one: at its logged send time, not before now)."""
        w, res = self.w, self.res
        i = self.task[s]
        res.release[i] = now
        res.n_gen[i] = self.gen[s]
        res.finished.append(i)
        self.state[s], self.task[s], self.used[s] = IDLE, -1, now
        self.listed = False
        j = int(self.nxt[i])
        if j >= 0:
            think = float(w.think_s[j])
            send = now + float(w.end_lag_s[i]) + think if think >= 0 else float(res.send[i]) - think
            heapq.heappush(self.heap, (max(send, now), j))

    def heartbeats(self, s: int, t0: float, dt: float, k: int, n0: int) -> None:
        """print_timings_tg after each of ``k`` tokens slot ``s`` sampled at ``t0 + (j + 1) * dt``
        (it had ``n0`` before them): from n_gen >= 100, at least 3 s after the last print."""
        t_print, n_print, t_first, task, out = self.t_print[s], self.n_print[s], self.t_first[s], self.task[s], \
            self.res.heartbeats
        j = max(0, HEARTBEAT_TOKENS - n0 - 1)
        while j < k:
            if dt > 0:
                j = max(j, math.ceil((t_print + HEARTBEAT_S - t0) / dt - 1 - 1e-9))
            if j >= k:
                break
            t_now = t0 + (j + 1) * dt
            if t_now - t_print < HEARTBEAT_S:  # (rounding)
                j += 1
                continue
            n_now = n0 + j + 1
            window = t_now - t_print
            out.extend((task, t_now, n_now, (n_now - 1) / max(t_now - t_first, 1e-9), (n_now - n_print) / window, window))
            t_print, n_print = t_now, n_now
            j += 1
        self.t_print[s], self.n_print[s] = t_print, n_print


# --------------------------------------------------------------------------------------------
# The replay as a task view and samples, and the metrics of both


# The task view's columns a replay gives anew (the others are as logged).
REPLAYED_COLUMNS = {"slot", "launch_s", "prefill_start_s", "first_token_s", "release_s", "wait_before_prefill_ms",
                    "prompt_eval_ms", "eval_ms", "n_gen", "prompt_tokens_new", "prompt_tokens_cached", "prefill_tps",
                    "gen_tps", "lora", "queue_ms", "ttft_ms", "call_total_ms", "status"}
HB_FIELDS = ("row", "t_s", "n_gen", "tg_tps", "tg_3s_tps", "window_s")
PROGRESS_FIELDS = ("row", "t_s", "n_tokens", "progress", "elapsed_s")


def _records(flat: array.array[float], fields: tuple[str, ...], ints: tuple[str, ...], at: np.ndarray,
             base: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """A replay's records (``fields`` per record, end to end, the first its workload row) of the
    tasks that have a row of ``base`` (``at``: each workload row's, -1: none), as that row and
    the other fields (``ints`` as int64), in order of ``keys`` and time."""
    values = np.frombuffer(flat, dtype=np.float64).reshape(-1, len(fields)) if len(flat) else np.zeros((0, len(fields)))
    place = at[values[:, 0].astype(np.int64)]
    keep = place >= 0
    out = base.iloc[place[keep]].reset_index(drop=True)
    out = out.assign(**{f: values[keep, k].astype(np.int64) if f in ints else values[keep, k]
                        for k, f in enumerate(fields) if k > 0})
    return out.sort_values(keys + ["t_s"], kind="stable").reset_index(drop=True)


def finished_part(rp: Replay) -> tuple[np.ndarray, Replay]:
    """The tasks the replay finished since the last call (their rows, in order) and its figures
    of them alone, with the heartbeats and progress lines it holds (copies: it goes on, and
    they are taken from it)."""
    rows = np.array(sorted(rp.finished), dtype=np.int64)
    part = dataclasses.replace(rp, **{f: getattr(rp, f)[rows] for f in (
        "slot", "send", "launch", "prefill_start", "first_token", "release", "n_gen", "new", "cached", "refused")},
        lora=[rp.lora[i] for i in rows.tolist()], heartbeats=array.array("d", rp.heartbeats),
        progress=array.array("d", rp.progress), model_cached=np.zeros(0, dtype=np.int64), finished=[])
    del rp.finished[:], rp.heartbeats[:], rp.progress[:]
    return rows, part


def replayed_dataset(ds: Dataset, w: Workload, rp: Replay, r: Resolved,
                     rows: np.ndarray) -> tuple[Dataset, pd.DataFrame]:
    """The replay in the log's shapes: a dataset (samples, sessions) and its task view, of the
    tasks ``rows``, of which ``rp`` holds the figures alone (:func:`finished_part`)."""
    at = np.full(len(w.tv), -1, dtype=np.int64)
    at[rows] = np.arange(len(rows))
    shape = w.tv.shape
    tv = w.tv.read(rows, [c for c in shape.columns if c not in REPLAYED_COLUMNS])  # (the others are the replay's)
    end_lag = w.end_lag_s[rows]
    keys = tl.GROUP + ["task_id"]
    tv["slot"] = pd.array(rp.slot, dtype=shape["slot"].dtype if rp.slot.size else "Int64")
    tv["launch_s"] = rp.launch
    tv["prefill_start_s"] = rp.prefill_start
    tv["first_token_s"] = rp.first_token
    tv["release_s"] = rp.release
    tv["wait_before_prefill_ms"] = (rp.prefill_start - rp.launch) * 1000
    tv["prompt_eval_ms"] = (rp.first_token - rp.prefill_start) * 1000
    tv["eval_ms"] = (rp.release - rp.first_token) * 1000
    tv["n_gen"] = pd.array(rp.n_gen, dtype=shape["n_gen"].dtype)
    tv["prompt_tokens_new"] = pd.array(rp.new, dtype=shape["prompt_tokens_new"].dtype)
    tv["prompt_tokens_cached"] = pd.array(rp.cached, dtype=shape["prompt_tokens_cached"].dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        tv["prefill_tps"] = rp.new / (tv["prompt_eval_ms"].to_numpy() / 1000)
        tv["gen_tps"] = (rp.n_gen - 1) / (tv["eval_ms"].to_numpy() / 1000)
    if "lora" in shape.columns:
        tv["lora"] = pd.Categorical(rp.lora)
    tv["queue_ms"] = (rp.launch - rp.send) * 1000
    tv["ttft_ms"] = np.where(rp.refused, np.nan, (rp.first_token - rp.send) * 1000)
    tv["call_total_ms"] = (rp.release + end_lag - rp.send) * 1000
    tv["status"] = np.where(rp.refused, "error", "complete")
    tv = tv[[c for c in shape.columns if c in tv.columns] + [c for c in tv.columns if c not in shape.columns]]
    base = tv[keys + ["slot"]]
    gen = _records(rp.heartbeats, HB_FIELDS, ("n_gen",), at, base, keys)
    gen["tokens"] = np.rint(gen["tg_3s_tps"] * gen["window_s"]).astype(np.int64)
    gen["window_start_s"] = gen["t_s"] - gen["window_s"]
    pre = _records(rp.progress, PROGRESS_FIELDS, ("n_tokens",), at, base, keys)
    with np.errstate(divide="ignore", invalid="ignore"):
        pre["tps"] = pre["n_tokens"] / pre["elapsed_s"]
    same = (pre[keys].shift().eq(pre[keys])).all(axis=1).to_numpy()
    pre["step_tokens"] = pd.array(np.where(same, pre["n_tokens"].diff(), np.nan), dtype="float64").astype("Int64")
    pre["step_s"] = np.where(same, pre["t_s"].diff(), np.nan)
    sessions = ds.server.sessions.copy()
    sessions["n_slots"] = r.slots
    sessions["n_ctx_slot"] = r.ctx // r.slots
    server = dataclasses.replace(ds.server, tasks=tv, gen_samples=gen, prefill_samples=pre, sessions=sessions)
    return Dataset(server=server, app=None, matches=None, accounting=ds.accounting), tv


@dataclass
class Sample:
    """One metric's per-unit values (or a whole-run figure) and the resampling clusters; a sum's
    values are its clusters' sums (a cluster may have several), ``n`` the units they sum."""

    values: np.ndarray
    clusters: np.ndarray
    kind: str  # median | p90 | p95 | sum | share (no interval)
    n: int  # units measured


class Gather:
    """The metrics' samples, gathered a stretch of the log (or of a replay) at a time: each
    :meth:`add` measures one stretch's tasks; :meth:`result` gives the whole run's samples."""

    def __init__(self) -> None:
        # Per set of values (named by its first metric): the stretches' values and clusters; a
        # sum's units (its values are per cluster). Per metric: its set and statistic.
        self.values: dict[str, list[np.ndarray]] = {}
        self.clusters: dict[str, list[np.ndarray]] = {}
        self.units: dict[str, int] = {}
        self.metrics: dict[str, tuple[str, str]] = {}
        self.busy = {2: 0.0, 4: 0.0}
        self.spans: dict[tuple[object, ...], list[float]] = {}  # per session: first and last step

    def _put(self, values: np.ndarray, clusters: np.ndarray, *metrics: tuple[str, str]) -> None:
        """One stretch's ``values`` (and their ``clusters``) of the ``metrics`` (name, statistic)
        that are statistics of them: the values are kept once for all of them."""
        key, kind = metrics[0]
        values, clusters = np.asarray(values, dtype=float), np.asarray(clusters, dtype=np.int32)
        if kind == "sum":  # (a resample of clusters sums their sums: one value per cluster is enough)
            ok = np.isfinite(values)
            self.units[key] = self.units.get(key, 0) + int(ok.sum())
            codes, uniques = pd.factorize(clusters[ok])
            values, clusters = np.bincount(codes, weights=values[ok], minlength=len(uniques)), uniques.astype(np.int32)
        self.values.setdefault(key, []).append(values)
        self.clusters.setdefault(key, []).append(clusters)
        self.metrics.update((name, (key, kind)) for name, kind in metrics)

    def add(self, ds: Dataset, tv: pd.DataFrame, cluster: np.ndarray, opts: Options,
            counted: np.ndarray | None = None, span: tuple[float, float] | None = None) -> None:
        """Measure the tasks ``tv`` (of the dataset ``ds``: their samples and sessions), of which
        those ``counted`` (default: all; the others are context) count; ``cluster``: each row's
        resampling unit; ``span``: the stretch of the session clock the tasks are a piece of."""
        tv = tv.reset_index(drop=True)
        n = len(tv)
        counted = np.ones(n, dtype=bool) if counted is None else np.asarray(counted, dtype=bool)
        chat = is_chat_turn(tv["purpose"]).to_numpy() if "purpose" in tv.columns else np.zeros(n, dtype=bool)
        ttft = tl.floats(tv["ttft_ms"]) / 1000 if "ttft_ms" in tv.columns else np.full(n, np.nan)
        m = chat & np.isfinite(ttft) & counted
        self._put(ttft[m], cluster[m], *((f"chat_ttft_{kind}_s", kind) for kind in ("median", "p90", "p95")))
        # compare's same-conditions classes: short turns by what else ran from send to first token
        short = np.flatnonzero(m & (tl.floats(tv["prompt_tokens_new"]) < SHORT_TOKENS))
        cond = turn_conditions(tv.iloc[short], tv, ds.server.sessions, opts.big_prefill_tokens)
        for c in CONDITIONS:
            pick = short[cond == c]
            self._put(ttft[pick], cluster[pick], *((f"short_ttft_{kind}_s:{c}", kind) for kind in ("median", "p90")))
        total = tl.floats(tv["call_total_ms"]) / 1000 if "call_total_ms" in tv.columns else np.full(n, np.nan)
        k = np.isfinite(total) & counted
        if "call_id" in tv.columns:
            k &= tv["call_id"].notna().to_numpy()
        self._put(total[k], cluster[k], ("call_total_median_s", "median"))
        keys = tv[tl.GROUP + ["task_id"]]
        pieces = task_pieces(ds, opts, tv)
        pieces = pieces[(pieces["class"] == "long_prefill") & (pieces["seconds"] >= MIN_PIECE_S)]
        rr = pieces["task"].to_numpy()
        own = counted[rr]
        self._put(pieces["tok_per_s"].to_numpy(dtype=float)[own], cluster[rr][own], ("gen_tps_during_long_prefill", "median"))
        wait = tl.floats(tv["wait_before_prefill_ms"]) >= opts.wait_threshold_s * 1000
        self._put(wait[counted].astype(float), cluster[counted], ("waits_over_1s_count", "sum"))
        waits = classify_waits(ds, opts, tv)
        f, rr = tl.join_tasks(waits, keys)
        cause = np.full(n, "", dtype=object)
        cause[rr] = waits["cause"].astype("object").to_numpy()[f]
        for c in CAUSES:
            if c != "deferred":
                self._put((cause == c)[counted].astype(float), cluster[counted], (f"waits_{c}_count", "sum"))
        refused = (tv["status"].astype("object") == "error").to_numpy() if "status" in tv.columns else np.zeros(n, bool)
        self._put(refused[counted].astype(float), cluster[counted], ("calls_refused_count", "sum"))
        steps = tl.concurrency(tv, ds.server.sessions)
        if len(steps):
            t0, t1 = tl.floats(steps["start_s"]), tl.floats(steps["end_s"])
            if span is not None:  # (a piece of a cut period measures its own stretch)
                lo, hi = span
                t0 = np.maximum(t0, lo) if np.isfinite(lo) else t0
                t1 = np.minimum(t1, hi) if np.isfinite(hi) else t1
            secs = np.clip(t1 - t0, 0, None)
            run = steps["running"].to_numpy()
            for need in self.busy:
                self.busy[need] += float(secs[run >= need].sum())
            for key, grp in steps.groupby(tl.GROUP, observed=True, sort=False).indices.items():
                first, last = float(np.min(t0[grp])), float(np.max(t1[grp]))
                have = self.spans.setdefault(key if isinstance(key, tuple) else (key,), [first, last])
                have[0], have[1] = min(have[0], first), max(have[1], last)

    def merge(self, other: Gather) -> None:
        """What ``other`` gathered, as if its stretches had been added here after these."""
        for key, values in other.values.items():
            self.values.setdefault(key, []).extend(values)
            self.clusters.setdefault(key, []).extend(other.clusters[key])
        for key, n in other.units.items():
            self.units[key] = self.units.get(key, 0) + n
        self.metrics.update(other.metrics)
        for need, secs in other.busy.items():
            self.busy[need] += secs
        for session, (first, last) in other.spans.items():
            have = self.spans.setdefault(session, [first, last])
            have[0], have[1] = min(have[0], first), max(have[1], last)

    def result(self) -> dict[str, Sample]:
        """Every metric's samples (the shares of time as whole-run figures)."""
        out: dict[str, Sample] = {}
        whole = sum(last - first for first, last in self.spans.values())
        joined = {key: (np.concatenate(v), np.concatenate(self.clusters[key])) for key, v in self.values.items()}
        for name, (key, kind) in self.metrics.items():
            if name == "calls_refused_count":
                for need, secs in self.busy.items():
                    share = secs / whole if whole > 0 else math.nan
                    out[f"share_{need}plus_running"] = Sample(np.array([share]), np.zeros(1, dtype=np.int64), "share", 1)
            values, clusters = joined[key]
            out[name] = Sample(values, clusters, kind, self.units[key] if kind == "sum" else int(np.isfinite(values).sum()))
        return out


def _point(s: Sample) -> float:
    v = s.values[np.isfinite(s.values)]
    if not len(v):
        return math.nan
    if s.kind == "sum":
        return float(v.sum())
    if s.kind == "share":
        return float(v[0])
    return float(np.quantile(v, QUANTILES[s.kind]))


def _interval(s: Sample, rng: np.random.Generator, n_boot: int) -> tuple[float, float]:
    """Percentile interval of the statistic over resamples of the clusters (users' sessions)."""
    ok = np.isfinite(s.values)
    v, c = s.values[ok], s.clusters[ok]
    if s.kind == "share" or len(v) < 2 or n_boot <= 0 or len(np.unique(c)) < 2:
        return math.nan, math.nan
    stats = resampled_stats(v, c, s.kind, rng, n_boot)
    lo, hi = np.nanquantile(stats, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


# --------------------------------------------------------------------------------------------
# The run


def logged_settings(ds: Dataset, fullest_step: int = 0) -> Resolved:
    """The settings the logs show: slots and per-slot context from the start-up lines, n_batch
    from the fullest pass (a progress step plus the generating slots it ran with), n_ubatch the
    default (it is not logged at verbosity 3)."""
    s = ds.server.sessions
    slots = int(pd.to_numeric(s["n_slots"], errors="coerce").max()) if len(s) and s["n_slots"].notna().any() else 1
    per = int(pd.to_numeric(s["n_ctx_slot"], errors="coerce").max()) if len(s) and s["n_ctx_slot"].notna().any() else 0
    n_batch = int(fullest_step) if fullest_step else DEFAULT_N_BATCH
    return Resolved(n_batch=n_batch, n_ubatch=min(DEFAULT_N_UBATCH, n_batch), slots=slots,
                    ctx=per * slots if per > 0 else 1 << 40, unify=None)


def resolve(settings: Settings, logged: Resolved, w: Workload) -> Resolved:
    """Asked settings over the logged ones."""
    n_batch = settings.n_batch or logged.n_batch
    n_ubatch = min(settings.n_ubatch or DEFAULT_N_UBATCH, n_batch)  # (the logged n_ubatch is the default too)
    unify: str | None = None
    assign: tuple[str, str] | None = None
    label, where, condition = settings.lora.partition(" where ")
    if where:  # (any label: an adapter setting the logs never show is a what-if too)
        if not label.strip() or not condition.strip():
            raise UsageError(None, None, f"lora={settings.lora!r}: give lora=LABEL where CONDITION")
        assign = (label.strip(), condition.strip())
        matching(w.tv.read(), assign[1], "--set lora=LABEL where")  # (a bad condition is said now, once)
    elif settings.lora == "unified":
        counts = pd.Series(w.lora, dtype="object").value_counts()
        unify = str(counts.index[0]) if len(counts) else NO_ADAPTER
    elif settings.lora not in ("as-logged", ""):
        if settings.lora not in set(w.lora) and settings.lora != NO_ADAPTER:
            raise UsageError(None, None, f"lora={settings.lora!r}: the calls' settings are "
                             f"{', '.join(sorted(set(w.lora)))} (or give unified, as-logged, {NO_ADAPTER})")
        unify = settings.lora
    return Resolved(n_batch=n_batch, n_ubatch=n_ubatch, slots=settings.slots or logged.slots,
                    ctx=settings.ctx or logged.ctx, unify=unify, assign=assign)


def _extrapolates(r: Resolved, costs: PassCosts, w: Workload) -> list[str]:
    notes = []
    if r.n_batch > costs.max_pass_tokens > 0:
        notes.append(f"passes of up to {r.n_batch} tokens; the logs show at most {costs.max_pass_tokens}")
    if r.slots > costs.max_gen_slots + 1 and costs.max_gen_slots > 0:
        notes.append(f"{r.slots} slots; the logs show at most {costs.max_gen_slots} generating at once")
    labels = set(lora_labels(w, r))
    if any(x != NO_ADAPTER for x in labels) and costs.observations.get("lora_token", 0) == 0:
        notes.append("passes with an adapter on, which the logs never show timed: their extra cost is taken as 0")
    return notes


@dataclass
class Logged:
    """What the replays start from: the workload, the settings and pass costs the logs show,
    and the logged run's figures (the metrics' points: nothing is resampled of them)."""

    workload: Workload
    settings: Resolved
    costs: PassCosts
    figures: dict[str, float]


def _part_dataset(ds: Dataset, tasks: pd.DataFrame, gen: pd.DataFrame, prefill: pd.DataFrame) -> Dataset:
    server = dataclasses.replace(ds.server, tasks=tasks, gen_samples=gen, prefill_samples=prefill)
    return Dataset(server=server, app=None, matches=None, accounting=ds.accounting)


def _kept(obs: list[pd.DataFrame], keys: list[np.ndarray], fresh: pd.DataFrame, rng: np.random.Generator) -> None:
    """Add ``fresh`` to the observations kept: at most :data:`FIT_OBSERVATIONS`, an even draw
    of all seen (each has a random key; the smallest keys stay)."""
    obs.append(fresh)
    keys.append(rng.random(len(fresh)))
    if sum(len(k) for k in keys) > 2 * FIT_OBSERVATIONS:
        whole, key = _draw(obs, keys)
        obs[:], keys[:] = [whole], [key]


def _draw(obs: list[pd.DataFrame], keys: list[np.ndarray]) -> tuple[pd.DataFrame, np.ndarray]:
    if not obs:
        return pd.DataFrame(columns=OBS_COLUMNS), np.zeros(0)
    whole, key = pd.concat(obs, ignore_index=True), np.concatenate(keys)
    if len(whole) > FIT_OBSERVATIONS:
        keep = np.sort(np.argpartition(key, FIT_OBSERVATIONS)[:FIT_OBSERVATIONS])
        whole, key = whole.iloc[keep].reset_index(drop=True), key[keep]
    return whole, key


def prepare(ds: Dataset, open_loop: bool = False, opts: Options | None = None) -> Logged:
    """Read the logs for the replays: the tasks replayed, what the logs show of them
    (:func:`read_logged`), the rest of the workload, then its replay with the logged settings."""
    opts = opts or Options()
    w, logged, costs, figures = _read(ds, open_loop, opts)
    # The replay with the logged settings keeps the logged cache split of every call; its cache
    # model's own reuse is what a what-if's model is held against (see :meth:`_Session.admit`).
    for rp in replay_stretches(w, logged, costs, open_loop):
        del rp.finished[:], rp.heartbeats[:], rp.progress[:]  # (only its cache model is kept)
    w.model_logged = rp.model_cached
    return Logged(w, logged, costs, figures)


def _read(ds: Dataset, open_loop: bool, opts: Options) -> tuple[Workload, Resolved, PassCosts, dict[str, float]]:
    """:func:`prepare` but the replay: the workload, and the settings, pass costs and figures
    the logs show."""
    ds.keep_on_disk()
    wt = workload_tasks(ds)
    logged, costs, figures = read_logged(ds, wt, opts)  # (before the workload's other columns are read)
    return workload(wt, open_loop), logged, costs, figures


def read_logged(ds: Dataset, w: WorkloadTasks, opts: Options) -> tuple[Resolved, PassCosts, dict[str, float]]:
    """The settings, pass costs and metric figures the logs show: the busy periods read twice
    (the fullest progress-line pass gives n_batch; then the passes for the cost fit and the
    logged metrics), a part at a time as the report reads them, by workers where there are
    cores for them."""
    n_view = int(w.tv.rows.max(initial=-1)) + 1
    at = np.full(n_view, -1, dtype=np.int64)
    at[w.tv.rows] = np.arange(len(w.tv))
    with ds.periods() as periods:
        workers = workers_for(periods.n_parts)
        lp = _LoggedParts(ds, periods, np.array(w.lora, dtype=object), w.group, w.cluster, at, opts)
        # n_batch is read from the passes themselves (a step's tokens plus its generating slots),
        # then the passes are read again with it (a short prefill's passes depend on it).
        most = max(beside(_fullest_step, lp, range(periods.n_parts), workers), default=0)
        logged = logged_settings(ds, most)
        lp = dataclasses.replace(lp, n_batch=logged.n_batch, n_ubatch=logged.n_ubatch)
        obs: list[pd.DataFrame] = []
        keys: list[np.ndarray] = []
        rng = np.random.default_rng(0)
        gather = Gather()
        for o, one in beside(_logged_part, lp, range(periods.n_parts), workers):
            if o is not None:
                _kept(obs, keys, o, rng)
            gather.merge(one)
    return logged, fit_pass_costs(_draw(obs, keys)[0]), {name: _point(x) for name, x in gather.result().items()}


@dataclass(frozen=True)
class _LoggedParts:
    """What :func:`read_logged` reads a part of the log with: the replayed tasks' LoRA settings,
    sessions and clusters (by workload row), each task view row's workload row (``at``, -1:
    not replayed) and the n_batch and n_ubatch of the second reading."""

    ds: Dataset
    periods: PartStore
    lora: np.ndarray
    group: np.ndarray
    cluster: np.ndarray
    at: np.ndarray
    opts: Options
    n_batch: int = 1 << 30
    n_ubatch: int = DEFAULT_N_UBATCH

    def read(self, k: int, heartbeats: bool = True) -> tuple[Part, np.ndarray, pd.DataFrame, np.ndarray, Dataset]:
        """Part ``k``, its replayed tasks' workload rows, task rows and counted flags, and the
        dataset of them."""
        part = self.periods.part(k, heartbeats)
        n_view = len(self.at)
        wr = np.where(part.rows < n_view, self.at[np.minimum(part.rows, max(n_view - 1, 0))], -1) if n_view else \
            np.full(len(part.rows), -1)
        keep = wr >= 0
        tasks = part.tasks[keep].reset_index(drop=True)
        return part, wr[keep], tasks, part.counted[keep], _part_dataset(self.ds, tasks, part.gen, part.prefill)

    def passes(self, k: int, steps_only: bool = False) -> tuple[pd.DataFrame, Part, np.ndarray, pd.DataFrame,
                                                                np.ndarray, Dataset]:
        """Part ``k``'s passes (``row``: of its replayed tasks), and what :meth:`read` gives of it."""
        part, wr, tasks, counted, pds = self.read(k, heartbeats=not steps_only)
        o = pass_observations(pds, tasks, self.lora[wr], self.group[wr], self.n_batch, self.n_ubatch, steps_only)
        return o, part, wr, tasks, counted, pds


def _fullest_step(lp: _LoggedParts, k: int) -> int:
    """The most tokens a progress-line pass of part ``k`` ran (0: none)."""
    steps, _, _, _, counted, _ = lp.passes(k, steps_only=True)
    steps = steps[counted[steps["row"].to_numpy(dtype=np.int64)]] if len(steps) else steps
    return int(steps["pass_tokens"].max()) if len(steps) else 0


def _logged_part(lp: _LoggedParts, k: int) -> tuple[pd.DataFrame | None, Gather]:
    """Part ``k``'s passes of the tasks it counts, for the fit (None: it has none at all), and
    its logged metrics."""
    o, part, wr, tasks, counted, pds = lp.passes(k)
    gather = Gather()
    gather.add(pds, tasks, lp.cluster[wr], lp.opts, counted, part.span)
    return (o[counted[o["row"].to_numpy(dtype=np.int64)]].reset_index(drop=True) if len(o) else None), gather


def measure(ds: Dataset, lg: Logged, r: Resolved, open_loop: bool = False, opts: Options | None = None) -> dict[str, Sample]:
    """Replay the workload with the settings ``r`` and measure it as the log is measured."""
    return _replay_measured(ds, lg.workload, r, lg.costs, open_loop, opts or Options())


def _replay_measured(ds: Dataset, w: Workload, r: Resolved, costs: PassCosts, open_loop: bool,
                     opts: Options, model_out: np.ndarray | None = None) -> dict[str, Sample]:
    """The samples of the replay with the settings ``r``, measured a stretch between idle
    moments of at least :data:`slotscope.periods.PART_TASKS` tasks at a time: memory holds a
    few stretches' heartbeats and rows. Each stretch is measured by a worker process while the
    replay goes on (the replay is one loop in this process, its measure pandas work of its
    own); a replay of one stretch is measured here."""
    def stretches() -> Iterator[tuple[np.ndarray, Replay]]:
        for rp in replay_stretches(w, r, costs, open_loop, model_out):
            if len(rp.finished) >= PART_TASKS:
                yield finished_part(rp)
        if rp.finished:
            yield finished_part(rp)

    gather = Gather()
    for part in beside(_measure_part, (ds, w, r, opts), stretches(), _beside_replay(w)):
        gather.merge(part)
    return gather.result()


def _beside_replay(w: Workload) -> int:
    """Workers beside a replay of ``w``: one where there is a core for it, and it has stretches
    to hand it (a replay of one is measured in its own process)."""
    return workers_for(len(w.tv) // PART_TASKS, most=1)


def _measure_part(shared: tuple[Dataset, Workload, Resolved, Options], item: tuple[np.ndarray, Replay]) -> Gather:
    """:func:`_replay_measured`'s measure of one stretch of the replay (:func:`finished_part`)."""
    ds, w, r, opts = shared
    rows, part = item
    gather = Gather()
    gather.add(*replayed_dataset(ds, w, part, r, rows), w.cluster[rows], opts)
    return gather


def run(ds: Dataset, settings: Settings | Sequence[Settings] | None = None, *, open_loop: bool = False,
        opts: Options | None = None, seed: int = 0, n_boot: int = 1000) -> dict[str, pd.DataFrame]:
    """Replay the logged workload with the logged settings and with each of ``settings``;
    the tables :data:`TABLE_NAMES` as DataFrames (``summary``: per setting and metric, the
    logged figure, the replay with the logged settings, the what-if and its interval)."""
    opts = opts or Options()
    asked = [Settings()] if settings is None else [settings] if isinstance(settings, Settings) else list(settings)
    w, logged, costs, figures = _read(ds, open_loop, opts)
    plans = [(st.label(), resolve(st, logged, w)) for st in asked]
    whatifs = [r for _, r in plans if r != logged]
    # The what-if replays hold their cache model against the logged settings' replay's, call
    # by call. With a core for it, they run in a worker beside that replay, each call waiting
    # until that replay has launched it (the model's entries are NOT_YET until then).
    beside_it = _beside_replay(w) if whatifs else 0
    model = _shared_ints(len(w.tv), NOT_YET)
    logged_run: list[dict[str, Sample]] = []

    def replays() -> Iterator[Resolved]:
        if beside_it:
            yield whatifs[0]
        logged_run.append(_replay_measured(ds, w, logged, costs, open_loop, opts, model))
        yield from whatifs[beside_it:]

    lg = Logged(dataclasses.replace(w, model_logged=model, model_from=os.getpid()), logged, costs, figures)
    measured = beside(_whatif_samples, (ds, lg, open_loop, opts), replays(), beside_it)
    first = list(itertools.islice(measured, 1))  # (the logged settings' replay is done by then)
    base = {name: _point(x) for name, x in logged_run[0].items()}
    # A setting that is the logged one is that replay: its rows are made now, then only its
    # points are kept.
    made = {i: _summary_rows(label, logged_run[0], figures, base, seed, n_boot, opts)
            for i, (label, r) in enumerate(plans) if r == logged}
    logged_run.clear()
    rows: list[dict[str, object]] = []
    set_rows, findings = [], []
    for i, (label, r) in enumerate(plans):
        rows += made.pop(i) if i in made else \
            _summary_rows(label, first.pop() if first else next(measured), figures, base, seed, n_boot, opts)
        notes = _extrapolates(r, costs, w)
        for name, note in SETTING_NOTES.items():
            set_rows.append({"setting": label, "name": name, "logged": getattr(logged, name), "whatif": getattr(r, name),
                             "note": note})
        set_rows.append({"setting": label, "name": "lora", "logged": "as logged (" + ", ".join(sorted(set(w.lora))) + ")",
                         "whatif": r.unify if r.unify is not None else
                         f"{r.assign[0]} where {r.assign[1]}, else as logged" if r.assign is not None else "as logged",
                         "note": ""})
        set_rows.append({"setting": label, "name": "workload", "logged": "", "whatif":
                         "closed loop (think times)" if w.closed and not open_loop else "open loop (send times)",
                         "note": "; ".join(notes) if notes else ""})
        findings.append({"setting": label, "finding": _finding(label, rows, notes)})
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    summary["samples"] = pd.array(summary["samples"], dtype="Int64")
    return {"summary": summary, "pass-costs": cost_table(costs), "pass-fit": costs.fit,
            "settings": pd.DataFrame(set_rows, columns=SETTING_COLUMNS).astype({"logged": "string", "whatif": "string"}),
            "findings": pd.DataFrame(findings, columns=FINDING_COLUMNS)}


def _whatif_samples(shared: tuple[Dataset, Logged, bool, Options], r: Resolved) -> dict[str, Sample]:
    """:func:`run`'s replay of one what-if setting, measured."""
    ds, lg, open_loop, opts = shared
    return measure(ds, lg, r, open_loop, opts)


def _shared_ints(n: int, fill: int) -> np.ndarray:
    """``n`` int64 filled with ``fill``, in memory that processes forked after share (what
    one writes the others read)."""
    out = np.frombuffer(mmap.mmap(-1, 8 * n), dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
    out[:] = fill
    return out


def _summary_rows(label: str, what: dict[str, Sample], figures: dict[str, float], base: dict[str, float], seed: int,
                  n_boot: int, opts: Options) -> list[dict[str, object]]:
    """The summary's rows of one setting: per metric, the logged and replayed figures and the
    what-if's with its interval."""
    rows: list[dict[str, object]] = []
    for name, s in what.items():
        rng = np.random.default_rng([seed, len(name), sum(map(ord, name + label))])
        lo, hi = _interval(s, rng, n_boot)
        rows.append({"setting": label, "metric": name, "logged": figures[name], "replayed": base[name], "whatif": _point(s),
                     "whatif_low": lo, "whatif_high": hi, "samples": s.n if s.kind != "share" else pd.NA,
                     "note": _few(s, opts)})
    return rows


def _few(s: Sample, opts: Options) -> str:
    if s.kind == "share":
        return "a share of the replay's time: no interval"
    if s.kind != "sum" and s.n < opts.min_samples:
        return f"only {s.n} samples: too few to rely on"
    return ""


def _finding(label: str, rows: list[dict[str, object]], notes: list[str]) -> str:
    got = {r["metric"]: r for r in rows if r["setting"] == label}

    def fig(metric: str, col: str) -> float:
        v = got.get(metric, {}).get(col, math.nan)
        return float(v) if isinstance(v, (int, float)) and not pd.isna(v) else math.nan

    parts = []
    g_w, g_r = fig("gen_tps_during_long_prefill", "whatif"), fig("gen_tps_during_long_prefill", "replayed")
    n_g = got.get("gen_tps_during_long_prefill", {}).get("samples", 0)
    if math.isfinite(g_w) and math.isfinite(g_r):
        parts.append(f"generation during long prefills would run at ~{g_w:.2g} tok/s instead of {g_r:.2g} ({n_g} stretches)")
    t_w, t_r = fig("chat_ttft_p95_s", "whatif"), fig("chat_ttft_p95_s", "replayed")
    if math.isfinite(t_w) and math.isfinite(t_r):
        parts.append(f"chat TTFT p95 {t_w:.3g} s instead of {t_r:.3g} s")
    w_w, w_r = fig("waits_over_1s_count", "whatif"), fig("waits_over_1s_count", "replayed")
    if math.isfinite(w_w):
        parts.append(f"{w_w:.0f} waits of 1 s or more before prefill instead of {w_r:.0f}")
    d_w = fig("waits_different_lora_count", "whatif")
    if math.isfinite(d_w):
        parts.append(f"{d_w:.0f} of them behind another LoRA setting")
    ref = fig("calls_refused_count", "whatif")
    if math.isfinite(ref) and ref > 0:
        parts.append(f"{ref:.0f} calls refused (prompt longer than the per-slot context)")
    head = f"with {label}" if label != "as logged" else "replayed as logged"
    text = f"{head}: " + ", ".join(parts) if parts else f"{head}: nothing to compare"
    if notes:
        text += " (extrapolates: " + "; ".join(notes) + ")"
    return text + "."


CAPTIONS = {  # (in the order render() prints the tables)
    "findings": "In plain words (logged settings replayed, then each what-if).",
    "summary": "Per metric: as logged, replayed with the logged settings (the model's own error), and the "
               f"what-if with a {LEVEL:.0%} interval from resampling users' sessions.",
    "pass-costs": "The pass-cost model fitted on the logged passes (ms per unit of each term).",
    "pass-fit": "Its error on the logged passes (predicted minus measured, in % of measured).",
    "settings": "The settings: as the logs show them, and as replayed.",
}


def render(tables: dict[str, pd.DataFrame], file: IO[str] | None = None, width: int | None = None) -> None:
    """Print the tables with a caption each, the findings first."""
    console = Console(file=file, width=width, soft_wrap=False, highlight=False)
    console.print(Rule("slotscope whatif", align="left"))
    for name, caption in CAPTIONS.items():
        df = tables[name]
        console.print()
        console.print(Rule(name, align="left"))
        console.print(caption, markup=False)
        if name == "findings":
            for r in df.itertuples(index=False):
                console.print(f"- {r.finding}", markup=False)
            continue
        if name == "summary" and len(df):  # (a setting's rows under its label: the metric names whole)
            for label, rows in df.groupby("setting", sort=False):
                console.print(f"setting: {label}", markup=False)
                print_table(console, rows.drop(columns="setting").round(3), whole=["metric"])
            continue
        print_table(console, df.round(3) if len(df) else df)
