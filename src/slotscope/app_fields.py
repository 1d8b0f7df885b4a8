"""Which fields of an app call log mean what, found by name, and whether data reads as one.

Kept apart from :mod:`slotscope.app_log` so that :mod:`slotscope.sources` can tell an app log
from a server log by content without importing the app-log reader (which reads its files
through :mod:`slotscope.sources`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping
from typing import Any

from .json_documents import first_records, is_document

# Specific names before generic ones: a record with both `start` and `ts` usually means
# `ts` is when the line was written, i.e. the end of the call.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "start": ("start", "started_at", "start_time", "request_time", "t_send", "ts", "timestamp", "time"),
    "end": ("end", "ended_at", "finished_at", "end_time"),
    "duration_ms": ("duration_ms", "latency_ms", "elapsed_ms"),
    "duration_s": ("duration", "elapsed"),
    "purpose": ("purpose", "kind", "type", "task"),
    "user": ("user", "user_id", "conversation", "conversation_id", "session"),
    "lora": ("lora", "adapter", "lora_adapter"),
    "prompt_tokens": (
        "prompt_tokens", "input_tokens", "usage.prompt_tokens", "usage.input_tokens", "tokens_evaluated",
    ),
    "completion_tokens": (
        "completion_tokens", "output_tokens", "usage.completion_tokens", "usage.output_tokens", "tokens_predicted",
    ),
    "cached_tokens": (
        "cached_tokens", "usage.prompt_tokens_details.cached_tokens", "timings.cache_n", "timings_cache_n",
    ),
    "status": ("status", "status_code", "http_status"),
    "error": ("error", "error_message"),
    "call_id": ("id", "call_id", "request_id"),
    "session": ("session", "session_id"),
    "turn": ("turn",),
    "timings": ("timings",),
}
ALIASES = {"id": "call_id", "duration": "duration_s"}
TIMINGS: dict[str, str] = {"prompt_n": "Int64", "prompt_ms": "float64", "predicted_n": "Int64",
                           "predicted_ms": "float64", "cache_n": "Int64"}
# fields that, beside a start time, make a record a call rather than any timestamped line
STRONG = ("end", "duration_ms", "duration_s", "purpose", "lora", "prompt_tokens", "completion_tokens",
          "cached_tokens")


def nested_paths(override: Mapping[str, str]) -> set[str]:
    """Lower-cased dotted paths of the objects a field could be inside."""
    names = [n.lower() for ns in CANDIDATES.values() for n in ns] + [n.lower() for n in override.values()]
    names += [f"{override.get('timings', 'timings').lower()}.{k}" for k in TIMINGS]
    return {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)}


def path_index(records: Iterable[Mapping[str, Any]], override: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Lower-cased dotted path -> the path as written, for every key a field could name."""
    nested = nested_paths(override)
    index: dict[str, tuple[str, ...]] = {}

    def walk(obj: Mapping[str, Any], prefix: tuple[str, ...]) -> None:
        paths = [(*prefix, k) for k in obj]
        for path in paths:
            index.setdefault(".".join(path).lower(), path)
        for k, path in zip(obj, paths):
            if isinstance(obj[k], dict) and ".".join(path).lower() in nested:
                walk(obj[k], path)

    for rec in records:
        walk(rec, ())
    return index


def field_names(override: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Each field's names, the one to use first first: the column mapped to it, else its common
    names; a timing's inside the timings object, then beside it (``timings_prompt_n``)."""
    names = {key: (override[key],) if key in override else ns for key, ns in CANDIDATES.items() if key != "timings"}
    prefix = override.get("timings", "timings")
    names.update({f"timings_{sub}": (f"{prefix}.{sub}", f"{prefix}_{sub}") for sub in TIMINGS})
    return names


def resolve_fields(index: Mapping[str, tuple[str, ...]], override: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Each field's path in records indexed by :func:`path_index`: the first of its names there."""
    fields: dict[str, tuple[str, ...]] = {}
    for key, names in field_names(override).items():
        hit = next((index[n.lower()] for n in names if n.lower() in index), None)
        if hit is not None:
            fields[key] = hit
    return fields


CSV_DELIMITERS = ",;\t|"  # what spreadsheets and exports separate fields with (a locale with a decimal comma: ;)


def csv_header(header: str) -> tuple[list[str], str]:
    """The field names of a CSV header line and its delimiter: the one of :data:`CSV_DELIMITERS`
    that splits it into the most fields (the first of those, a comma when none splits it)."""
    splits = {d: next(csv.reader([header], delimiter=d)) for d in CSV_DELIMITERS}
    delimiter = max(splits, key=lambda d: len(splits[d]))
    return [h.strip() for h in splits[delimiter]], delimiter


def _line_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    records = []
    for ln in lines:
        try:
            rec = json.loads(ln)
        except ValueError:
            continue  # the sample may end mid-line
        if isinstance(rec, dict):
            records.append(rec)
    return records


def looks_like_app_log(sample: bytes, override: Mapping[str, str] | None = None) -> bool:
    """True if the (decompressed) start of a file reads as an app call log, JSONL or CSV, with
    the field names it knows or those of ``override`` (--app-columns).

    llama-server text lines and journald/docker JSON wrappers around them are not app logs.
    """
    text = sample.decode("utf-8", "replace")
    lines = [ln for ln in text.lstrip("\ufeff").splitlines() if ln.strip()][:20]
    if not lines:
        return False
    if lines[0].lstrip().startswith("{") or is_document(text):
        records = first_records(sample) if is_document(text) else _line_records(lines)
        # journald (`journalctl -o json`) and docker json-file wrap server lines in JSON
        if not records or any("MESSAGE" in r or "__CURSOR" in r or ("log" in r and "stream" in r) for r in records):
            return False
        index = path_index(records, override or {})
    else:
        index = {h.strip().lower(): (h.strip(),) for h in csv_header(lines[0])[0]}
    fields = resolve_fields(index, override or {})
    return "start" in fields and any(k in fields for k in STRONG)
