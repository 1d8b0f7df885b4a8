"""Older llama-server line formats the fast pattern does not cover (research/log-formats.md §2.2).

The 2024 ``server_log()`` records, as JSON objects or as ``--log-format text``
(``INFO [            update_slots] slot released | tid="…" timestamp=… id_slot=3 …``).
They carry unix-second wall stamps only. Parsed one line at a time: such logs are rare and
old, and only lines the fast path did not recognise come here.
"""

from __future__ import annotations

import json
import re
from typing import Any

_TEXT = re.compile(r"^\s*(?:INFO|WARN|ERR|ERROR|VERB|DEBUG)\s+\[\s*(?P<func>\w+)\]\s+(?P<msg>.*?)(?: \| (?P<kv>.*))?$")
_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')

from .events import EVAL, LAUNCH, PROMPT_EVAL, RELEASE, TOTAL


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _number(x: Any) -> float | None:
    """A JSON number as float; None for anything else (strings, huge or damaged values)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        v = float(x)
    except OverflowError:
        return None
    return v if abs(v) < 2.0**63 else None


def _fields(obj: dict[str, Any]) -> dict[str, Any]:
    msg = str(obj.get("msg", obj.get("message", ""))).strip()
    slot = _number(obj.get("id_slot", obj.get("slot_id")))
    task = _number(obj.get("id_task", obj.get("task_id")))
    row: dict[str, Any] = {"kind": 0, "slot": slot, "task": task, "port": -1, "ts_us": -1, "cont": False}
    stamp = _number(obj.get("timestamp"))
    if stamp is not None and abs(stamp) < 1e12:  # unix seconds; anything else is damage
        row["wall_stamp_us"] = int(stamp * 1e6)
    if msg == "slot is processing task":
        row["kind"] = LAUNCH
    elif msg.startswith("prompt eval time"):
        row.update(kind=PROMPT_EVAL, v1=_number(obj.get("t_prompt_processing")), v2=_number(obj.get("n_prompt_tokens_processed")))
    elif msg.startswith("generation eval time"):
        row.update(kind=EVAL, v1=_number(obj.get("t_token_generation")), v2=_number(obj.get("n_decoded")))
    elif msg.startswith("total time"):
        row.update(kind=TOTAL, v1=_number(obj.get("t_total")))
    elif msg == "slot released":
        row.update(kind=RELEASE, v1=_number(obj.get("n_past")), v2=1 if obj.get("truncated") in (True, "true", 1) else 0)
    if row["kind"] and (task is None or (row["kind"] != LAUNCH and slot is None and row["kind"] != RELEASE)):
        row["kind"] = 0
    return row


def parse_line(s: str) -> dict[str, Any] | None:
    """One old-format record as an event row (``kind`` 0 = known but not used), or None."""
    st = s.strip()
    if st.startswith("{"):
        try:
            obj = json.loads(st)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not ("msg" in obj or "message" in obj):
            return None
    else:
        m = _TEXT.match(s)
        if not m:
            return None
        obj = {k: _value(v) for k, v in _KV.findall(m.group("kv") or "")}
        obj["msg"] = m.group("msg")
    return _fields(obj)
