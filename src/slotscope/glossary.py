"""What the report's words mean: one line per table and per term, printed by ``slotscope explain``.

This is the one place the text lives: the report's captions are :data:`TABLES`, and a terminal
shows a column under its :data:`LABELS` entry (CSV and JSON keep the stable name). Plain data:
importing it costs nothing (``slotscope --help`` lists the table names from it).
"""

from __future__ import annotations

import difflib
from typing import Iterable

# The columns the report's terminal tables show (CSV and JSON have them all); a table's entry
# lists them.
REPORT_COLUMNS = {
    "turns": ["by", "group", "count", "total_median_s", "total_p95_s", "total_max_s", "ttft_median_s", "ttft_p95_s",
              "ttft_max_s", "few_samples"],
    "load": ["scope", "running", "seconds", "share"],
    "breakdown": ["purpose", "component", "seconds", "share", "tasks", "few_samples"],
    "stalls": ["class", "samples", "median_tg_3s_tps", "p10_tg_3s_tps", "tokens", "seconds", "tok_per_s_pooled", "few_samples"],
    "stalls-worst": ["class", "tok_per_s", "tokens", "seconds", "task_id", "purpose", "user", "line", "cause_task_id",
                     "cause_purpose", "cause_prompt_tokens_new", "cause_line"],
    "waits": ["cause", "count", "total_s", "max_s", "median_s", "few_samples"],
    "waits-worst": ["wait_s", "cause", "task_id", "purpose", "lora", "line", "holder_task_id", "holder_purpose",
                    "holder_lora", "holder_line"],
    "prefills": ["by", "value", "count", "new_tokens_total", "seconds_total", "few_samples"],
    "prefill-speed": ["step_tokens", "steps", "median_tps", "median_step_tokens", "few_samples"],
    "context": ["basis", "context_tokens", "samples", "tasks", "median_tg_3s_tps", "few_samples"],
    "cache": ["user", "consecutive_turns", "misses", "miss_share", "misses_on_other_slot", "few_samples"],
    "cache-misses": ["user", "call_id", "purpose", "slot", "task_id", "prev_call_id", "prev_slot", "gap_s",
                     "prev_left_tokens", "cached_tokens"],
    "lora-switch": ["setting", "count", "prefill_median_ms", "alone_count", "alone_prefill_median_ms", "few_samples"],
    "calls": ["call_id", "start_at", "purpose", "prompt_tokens", "completion_tokens", "total_ms", "status"],
}

# One line per report table, in report order (analyze.table_names()): the caption printed above it.
TABLES: dict[str, str] = {
    "turns": "Time per call by purpose: total and time to first token (includes queue and wait before prefill).",
    "load": "Share of time with 0, 1, 2, ... tasks running.",
    "breakdown": "Where processing time went: own generation and prefill at solo speed, contention, waits, queue.",
    "stalls": "Generation speed of a slot by what the other slots did meanwhile (segments between heartbeats).",
    "stalls-worst": "The slowest generation stretches and the task that caused them.",
    "waits": "Waits of {wait_threshold_s:g} s or more before a prefill started, by what ran meanwhile.",
    "waits-worst": "The longest waits before prefill and the task that held the batch.",
    "prefills": "Long prefills ({big_prefill_tokens:,}+ new tokens) by purpose and by cause.",
    "prefill-speed": "Prefill speed by tokens advanced per step; the common step is the effective batch.",
    "context": "Generation speed by context length.",
    "cache": "Prompt-cache misses among consecutive turns of one user.",
    "cache-misses": "The misses.",
    "lora-switch": "Prefill time of short prompts right after a LoRA change vs the same setting.",
    "ruled-out": "What wasn't the cause: each hypothesis against its figure.",
    "findings": "What the numbers show.",
    "ollama-calls": "Each [GIN] call with its runner task: queue = latency - the task's launch..release (times good to ~1 s).",
    "ollama": "Ollama: the parallel setting against the concurrency seen, queue times, model loads, 503s, aborts.",
    "ollama-findings": "What Ollama's lines show.",
}

# The report's thresholds a caption names, as analyze.Options has them by default (explain
# prints these; the report, the values it was made with).
THRESHOLDS: dict[str, float] = {"wait_threshold_s": 1.0, "big_prefill_tokens": 5_000}


def caption(name: str, values: dict[str, object] | None = None) -> str:
    """A table's caption with the thresholds it names (``values``: analyze.Options' fields)."""
    return TABLES[name].format(**{**THRESHOLDS, **{k: v for k, v in (values or {}).items() if k in THRESHOLDS}})


# One line per term: the report's columns (by their stable names), the values its tables
# classify by, the words of its footnotes and of its header.
TERMS: dict[str, str] = {
    # columns
    "by": "What a row groups by: purpose, chat turns (a subset of them), cause, or all; left out rows count the calls not measured.",
    "group": "The purpose, or the subset of chat turns, the row measures (turns).",
    "count": "How many calls, tasks, waits or prefills the row counts.",
    "total_median_s": "Median of the calls' total time, from the app's start of the call to its end (s).",
    "total_p95_s": "95th percentile of the calls' total time (s).",
    "total_max_s": "Longest total time of a call in the row (s).",
    "ttft_median_s": "Median time to first token: from the app's start of the call to the task's first token, queue and wait before prefill included (s).",
    "ttft_p95_s": "95th percentile of the time to first token (s).",
    "ttft_max_s": "Longest time to first token in the row (s).",
    "ttft": "Time to first token: from the call's start (the app's clock) to the task's first token, so it includes the queue and the wait before prefill that prompt eval time hides.",
    "few_samples": "True when the row rests on fewer than 10 samples: shown, but never stated as a finding.",
    "scope": "overall, or one calendar day (in --tz) when the log spans several.",
    "running": "How many tasks ran at once (a task runs from its launch to its release).",
    "seconds": "Seconds of time in the row: of the scope (load), of the component (breakdown), of the stretches (stalls).",
    "share": "The row's part of the whole, a percentage on the terminal and a fraction (0-1) in CSV and JSON.",
    "purpose": "What the app called the model for (from the app log: chat, summary, translation, ...).",
    "component": "A part of the tasks' time: own_generation, own_prefill, contention, wait, queue, unsplit, total.",
    "tasks": "How many server tasks the row's figures come from.",
    "class": "What the other slots did while a slot generated: long_prefill, other_prefill, generation_only or alone.",
    "samples": "How many measurements a figure rests on: stalls, stretches of at least 2 s; context, heartbeat windows.",
    "median_tg_3s_tps": "Median generation speed (tokens/s) over the row's stretches or heartbeat windows.",
    "p10_tg_3s_tps": "10th percentile of the generation speed (tokens/s): the slow end of the row.",
    "tokens": "Tokens generated in the row's stretches (exact counts from the heartbeats, shared out where a segment is split).",
    "tok_per_s_pooled": "All the row's tokens over all its seconds (short stretches included): the row's overall speed.",
    "tok_per_s": "Generation speed of the stretch (tokens/s).",
    "task_id": "The server's task id (llama-server's `task N`), unique within a session.",
    "user": "The user the app log names for the call.",
    "line": "Line of the server log where the task was launched (or the sample was printed).",
    "cause_task_id": "The task whose prefill ran in another slot during the stretch (the largest, if several).",
    "cause_purpose": "Purpose of the task that caused the stall.",
    "cause_prompt_tokens_new": "New (uncached) prompt tokens the causing task prefilled.",
    "cause_line": "Server-log line where the causing task was launched.",
    "cause": "What ran in other slots during a wait: different_lora, same_lora, nothing, unknown_lora, or deferred; for prefills, why the prompt was new.",
    "total_s": "Seconds of waiting in the row, summed.",
    "max_s": "Longest wait in the row (s).",
    "median_s": "Median wait in the row (s).",
    "wait_s": "Wait before prefill: from the task's launch to the start of its prefill (s).",
    "lora": "The LoRA setting of the call (from the app log; none = no LoRA).",
    "holder_task_id": "The task that held the batch during the wait (ran with another setting, or ran longest).",
    "holder_purpose": "Purpose of the task that held the batch.",
    "holder_lora": "LoRA setting of the task that held the batch.",
    "holder_line": "Server-log line where the holding task was launched.",
    "value": "The purpose or the cause the row counts (prefills).",
    "new_tokens_total": "New (uncached) prompt tokens of the row's prefills, summed.",
    "seconds_total": "Prompt eval time of the row's prefills, summed (s).",
    "step_tokens": "Tokens one prefill advanced between two progress lines (one batch pass); the bins are left-closed.",
    "steps": "How many progress steps fall in the bin.",
    "median_tps": "Median prefill speed of the steps (tokens/s): the task's share of each pass.",
    "median_step_tokens": "Median tokens per step in the bin.",
    "basis": "What a row's figure rests on: stalls, exact, split or exact+split; context, alone or no_prefill; waits, see `waits basis`.",
    "context_tokens": "Context length at the heartbeat: the prompt (cached + new tokens) plus the tokens generated so far.",
    "consecutive_turns": "Chat turns of the user that came within the cache window (--cache-window, 300 s) after their previous turn.",
    "misses": "Consecutive turns that reused less than half of what the previous turn left in its slot.",
    "miss_share": "Misses among the consecutive turns, a percentage on the terminal and a fraction in CSV.",
    "misses_on_other_slot": "Misses whose turn ran on another slot than the previous turn (its cache was elsewhere).",
    "call_id": "The app log's id of the call.",
    "slot": "The server slot the task ran in.",
    "prev_call_id": "The user's previous turn.",
    "prev_slot": "The slot the previous turn ran in.",
    "gap_s": "Seconds from the end of the previous turn to the start of this one.",
    "prev_left_tokens": "Tokens the previous turn left in its slot (its prompt plus its completion): what this turn could reuse.",
    "cached_tokens": "Prompt tokens this turn reused from the cache.",
    "setting": "to L: the task ran right after a task with another LoRA setting; same L: after a task with the same setting L.",
    "prefill_median_ms": "Median prompt eval time of the short prompts (ms).",
    "alone_count": "How many of them prefilled with no other task holding a slot.",
    "alone_prefill_median_ms": "Median prompt eval time of those that prefilled alone (ms).",
    "hypothesis": "A cause the field report considers for a slow server.",
    "figure": "The measured figure the hypothesis is judged by.",
    "verdict": "ruled out, not ruled out, too few samples, or unknown (the logs lack what the figure needs).",
    "finding": "A sentence stating what the numbers show, with its figures and counts.",
    "table": "The table a finding comes from.",
    "supported": "True when the finding rests on enough samples to be stated (else it is said as too few).",
    # Ollama's calls ([GIN] lines) and the columns of the match table they share
    "start_at": "When the call started (wall clock, ISO-8601).",
    "end_at": "When the call ended (wall clock, ISO-8601).",
    "latency_ms": "The call's latency as Ollama's [GIN] line gives it: its queue, a model load and the runner's task (ms).",
    "status": "The call's status: as the app log gives it (calls), its HTTP status (ollama-calls); a task's: complete, cancelled, incomplete or cut_at_start.",
    "method": "The call's HTTP method (ollama-calls); for the clock, how it was aligned: app-tokens, app-timings, wrapper, manual.",
    "path": "The HTTP path of the call (/api/chat, /v1/chat/completions, ...).",
    "client": "The client address the [GIN] line names.",
    "task_line": "Server-log line where the call's task was launched.",
    "match_method": "How the call was joined to its task, or unmatched:<reason>.",
    "task_ms": "The task's time in the runner, launch (or prefill start) to release (ms).",
    "queue_ms": "Time before the server launched the task: the app's queue (match), Ollama's latency less the task's time (ollama-calls) (ms).",
    "load_wait_ms": "The part of a model load that fell between the call's start and its task's start (ms).",
    "prefill_ms": "The task's prompt eval time (ms).",
    "generation_ms": "The task's eval time (ms).",
    "wait_before_prefill_ms": "Time from the task's launch to the start of its prefill: the wait behind other slots' work, which prompt eval time does not include (ms).",
    "ttft_ms": "Time to first token: from the call's start to the task's first generated token (ms).",
    "overlapped": "True when another call was in flight during this one.",
    # the calls section (an app log given alone)
    "calls": "The app's calls (`slotscope calls` lists them with every column).",
    "prompt_tokens": "Prompt tokens of the call, as the app log gives them (cached and new).",
    "completion_tokens": "Tokens the call generated, as the app log gives them.",
    "total_ms": "The call's total time, from its start to its end on the app's clock (ms).",
    # footnotes
    "note": "What the whole table rests on or leaves out, said once under it.",
    "solo_gen_basis": "Where the solo generation speed comes from: the median of tasks that generated alone, else of stretches alone, else the 90th percentile of all tasks.",
    "solo_prefill_basis": "Where the solo prefill speed comes from: the median of tasks that prefilled alone, else the 90th percentile of all tasks.",
    "solo_gen_tps": "Generation speed of a task running alone (tokens/s): what own_generation is measured at.",
    "solo_gen_n": "How many tasks (or stretches) the solo generation speed comes from.",
    "solo_prefill_tps": "Prefill speed of a task running alone (tokens/s): what own_prefill is measured at.",
    "solo_prefill_n": "How many tasks the solo prefill speed comes from.",
    "effective_chunk_tokens": "Prompt tokens one batch pass takes from one slot: n_batch minus one token per slot generating in the same pass.",
    "max_running": "The most tasks that ran at once.",
    "n_slots": "Slots of the server (llama-server's -np).",
    "waits basis": "The waits rows count waits before prefill of at least --wait-threshold s (1 s); the deferred row counts launches <= 5 ms after a release while all slots were busy, with the app's queue_ms as their seconds. Where tasks are timed by whole-second stamps (the 2024 formats, Ollama's runner lines), the basis counts them: a wait under 1 s reads 0 there.",
    # the classes of stalls, and the bases of stalls and context
    "long_prefill": "Stretches when another slot prefilled a long prompt (--long-prefill, 15,000+ new tokens).",
    "other_prefill": "Stretches when only shorter prefills of other slots ran.",
    "generation_only": "Stretches with no prefill in other slots, but another slot generating: they shared each batch pass. Compare alone.",
    "alone": "No other task on the server: the slot had every batch pass to itself (stalls, context); generation_only had company.",
    "no_prefill": "context: heartbeat windows with no other task prefilling (others may have been generating).",
    "exact": "The stretch's tokens are the exact count between two heartbeats: the whole segment was in one class.",
    "split": "A segment that spanned several classes: its tokens shared out by the prefilling slot's pass cadence (one token per pass).",
    "exact+split": "The row mixes exact stretches and split ones (split_samples in CSV says how many are split).",
    "none": "No samples in the row; for a LoRA setting, no LoRA.",
    # breakdown components
    "own_generation": "Generation time the task would have taken alone: (n_gen - 1) / solo generation speed.",
    "own_prefill": "Prefill time the task would have taken alone: new tokens / solo prefill speed.",
    "contention": "Prefill and generation time beyond what the task would have taken alone: the other slots' share of the passes.",
    "wait": "Wait before prefill: launched, not yet batched (not included in prompt eval time).",
    "queue": "The app's queue time before the server launched the task (queue_ms of the app log).",
    "unsplit": "Time of tasks with no timings (cancelled), which cannot be split into the other components.",
    "total": "All the tasks' time: the sum of the components.",
    # causes of waits and of prefills
    "different_lora": "A task with another LoRA setting ran during the wait: llama-server batches only slots whose LoRA settings match.",
    "same_lora": "Only tasks with the same LoRA setting ran during the wait.",
    "nothing": "No other task ran during the wait.",
    "unknown_lora": "The app log gives no LoRA setting for the waiting task or for what ran.",
    "deferred": "A launch right after (<= 5 ms) another task's release while all slots were busy: a request the server queued without a log line.",
    "first_of_day": "The user's first call of the calendar day (UTC) in the app log.",
    "first_of_session": "The user's first call of an app session: a conversation resumed later the same day.",
    "summary": "A summary call: the transcript it folds is read anew.",
    "after_summary": "The call after the user's summary: the history was just folded.",
    "cache_miss": "A consecutive chat turn that did not reuse what its previous turn left.",
    "other": "Any other prefill (translations, ...).",
    "(unlogged)": "Server tasks no app call explains.",
    # turns' groups and the rows left out
    "chat turns": "Calls whose purpose is chat or starts with chat_: the user-facing turns.",
    "cache rate": "Cached prompt tokens over all prompt tokens of a call.",
    "left out": "Calls not measured, with the reason: failed, or no server task matched.",
    "all": "Every task or call of the table, whatever its purpose or cause.",
    "overall": "The whole observed span: each session's first launch to its last release.",
    # verdicts
    "ruled out": "The figure shows this hypothesis cannot explain the slow server.",
    "not ruled out": "The figure leaves this hypothesis possible.",
    "too few samples": "Fewer than 10 samples: no verdict.",
    "unknown": "The logs lack what the figure needs (most need an app log).",
    # the header and the findings' words
    "session": "One run of the server process: a restart starts a new one, and its clock (seconds since start) from zero.",
    "server clock zero": "The wall time at which the session's clock read 0, found by aligning the app log's calls with the tasks.",
    "supporting calls": "How many app calls agree with the clock alignment.",
    "app-tokens": "Clock aligned by matching calls to tasks by their token counts.",
    "app-timings": "Clock aligned by matching calls to tasks by their token counts and the app's timings.",
    "wrapper": "Clock read from the wall-clock stamps a capture wrapper (journald, docker, ts) put on the lines.",
    "manual": "Clock set by --server-start.",
    "stretch": "A piece of one slot's generation in one class (between heartbeats, or to the release).",
    "solo speed": "The speed of a task running alone on the server (solo_gen_tps, solo_prefill_tps).",
    "prefill": "Reading a task's new prompt tokens into its slot (prompt eval time).",
    "wait before prefill": "From a task's launch to the start of its prefill: launched, not yet batched; prompt eval time does not include it.",
}

# The short labels a terminal shows for columns whose names are long (CSV and JSON keep the names).
LABELS: dict[str, str] = {
    "median_tg_3s_tps": "median tok/s",
    "p10_tg_3s_tps": "p10 tok/s",
    "tok_per_s_pooled": "pooled tok/s",
    "tok_per_s": "tok/s",
    "cause_task_id": "cause task",
    "cause_prompt_tokens_new": "cause new tokens",
    "holder_task_id": "holder task",
    "new_tokens_total": "new tokens",
    "seconds_total": "seconds",
    "misses_on_other_slot": "on other slot",
    "prefill_median_ms": "median ms",
    "alone_prefill_median_ms": "alone median ms",
}


def label(column: str) -> str:
    """What a terminal prints over ``column``: its short label, else its name with spaces."""
    return LABELS.get(column, column.replace("_", " "))


def _key(term: str) -> str:
    return " ".join(term.lower().replace("_", " ").replace("-", " ").split())


def lookup(term: str) -> list[tuple[str, str]]:
    """The entries for ``term`` as (name, line): the table and the term of that name, matched
    whatever its case, underscores, dashes or spaces (``few samples`` is ``few_samples``),
    or by a column's terminal label (``median tok/s``)."""
    key = _key(term)
    named = {_key(c): c for c, lab in LABELS.items() if _key(lab) == key}
    hits = [(n, caption(n)) for n in TABLES if _key(n) == key]
    hits += [(n, line) for n, line in TERMS.items() if _key(n) == key or n in named.values()]
    return list(dict.fromkeys(hits))


def near(term: str) -> list[str]:
    """Entry names close to ``term`` (for a term the glossary lacks)."""
    names = [*TABLES, *TERMS, *LABELS.values()]
    keys = {_key(n): n for n in names}
    return [keys[k] for k in difflib.get_close_matches(_key(term), list(keys), n=5, cutoff=0.6)]


def explain(term: str | None, columns: dict[str, list[str]] | None = None) -> list[str] | None:
    """What ``slotscope explain`` prints: every entry (no ``term``), or the entries of ``term``
    (a table's followed by its ``columns``' entries), each ``name  line``; None when the
    glossary has no entry for it."""
    if term is None:
        return ["tables:", *_aligned((n, caption(n)) for n in TABLES), "terms:", *_aligned(TERMS.items())]
    hits = lookup(term)
    if not hits:
        return None
    out = _aligned(((f"{n} ({LABELS[n]})" if n in LABELS else n, line) for n, line in hits), indent="")
    for name, _ in hits:
        if name in TABLES and columns and name in columns:
            out += [f"{name} columns:", *_aligned((label(c), TERMS[c]) for c in columns[name] if c in TERMS)]
    return out


def _aligned(entries: Iterable[tuple[str, str]], indent: str = "  ") -> list[str]:
    rows = list(entries)
    width = max((len(n) for n, _ in rows), default=0) + 2
    return [f"{indent}{n:<{width}}{line}" for n, line in rows]
