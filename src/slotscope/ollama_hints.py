"""How an Ollama server log is told by content (for :mod:`slotscope.sources`, which
:mod:`slotscope.ollama` builds on)."""

from __future__ import annotations

import re

# What only an Ollama log has, somewhere in its first 64 KiB: a [GIN] access line, a slog line
# with a Go source file, journald's ``ollama[pid]:``, or the Go-log lines of old versions.
HINTS = re.compile(
    rb"\[GIN\] \d{4}/\d\d/\d\d - \d\d:\d\d:\d\d \||level=[A-Z]+ source=[\w.-]+\.go:\d+ msg=|"
    rb"(?m:^\S.{0,60} ollama\[[^\]\s]*\]: )|\d\d:\d\d:\d\d [\w.-]+\.go:\d+: (?:INFO |WARN |ERROR )?[a-z]"
)


def looks_like_ollama(head: bytes) -> bool:
    """Whether a file's first bytes are an Ollama server log's (behind any wrapper)."""
    return HINTS.search(head) is not None
