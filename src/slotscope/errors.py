"""Typed errors raised by the library core; the CLI maps them to one-line messages."""

from __future__ import annotations


class SlotscopeError(Exception):
    """Base of every error slotscope reports to a user as one line (no traceback)."""

    def __init__(self, path: str | None, line: int | None, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(str(self))

    def __reduce__(self) -> tuple:  # raised in a worker process, re-raised in the main one
        return (self.__class__, (self.path, self.line, self.reason))

    def __str__(self) -> str:
        where = ""
        if self.path is not None:
            where = f"{self.path}:{self.line}: " if self.line else f"{self.path}: "
        return f"{where}{self.reason}"


class InputError(SlotscopeError):
    """A path cannot be read, is empty, binary junk, or is neither kind of log."""


class AppLogError(SlotscopeError):
    """An app call log that cannot be interpreted (e.g. no start-time column)."""


class UsageError(SlotscopeError):
    """A combination of options that cannot work (exit code 2)."""
