"""Line accounting: every input line is used, known-and-ignored, or unrecognized."""

from __future__ import annotations

from dataclasses import dataclass, field

EXAMPLES = 5  # unrecognized lines kept per file to show


@dataclass
class FileAccount:
    """Counts for one input file."""

    path: str
    kind: str = "server"
    lines: int = 0
    used: int = 0
    ignored: int = 0
    unrecognized: int = 0
    examples: list[tuple[int, str]] = field(default_factory=list)  # (line, text) of unrecognized lines
    wrapper: str | None = None
    error: str | None = None  # why the file could not be (fully) read
    notes: list[str] = field(default_factory=list)  # how the file was read, said with the summary

    @property
    def is_server_log(self) -> bool:
        """A server's own log: llama-server's, or Ollama's (its runner's lines inside)."""
        return self.kind in ("server", "ollama")

    def add_unrecognized(self, line: int, text: str) -> None:
        """Count one unrecognized line, and keep it as an example while there are few."""
        self.unrecognized += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append((line, text[:200]))

    def absorb(self, part: "FileAccount") -> None:
        """Add the counts of the next block of this file, read on its own (its lines counted from 1)."""
        offset = self.lines
        for line, text in part.examples:
            if len(self.examples) < EXAMPLES:
                self.examples.append((line + offset, text))
        self.lines += part.lines
        self.used += part.used
        self.ignored += part.ignored
        self.unrecognized += part.unrecognized


def _total(count: str) -> property:
    """One of the files' counts, summed over them."""
    return property(lambda self: sum(getattr(f, count) for f in self.files))


@dataclass
class Accounting:
    """What happened to every line of every input, for the summary on stderr."""

    files: list[FileAccount] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason): not a log
    unusable: list[tuple[str, str]] = field(default_factory=list)  # named explicitly, yet not a usable log
    notes: list[str] = field(default_factory=list)  # how inputs were read, said with the summary
    tasks_complete: int = 0
    tasks_incomplete: int = 0
    tasks_cancelled: int = 0
    tasks_cut_at_start: int = 0  # launched before the log's first line
    sessions: int = 0

    def count_tasks(self, counts: tuple[int, int, int, int]) -> None:
        """Add (complete, cancelled, incomplete, cut at start) task counts, e.g. of one batch."""
        self.tasks_complete += counts[0]
        self.tasks_cancelled += counts[1]
        self.tasks_incomplete += counts[2]
        self.tasks_cut_at_start += counts[3]

    lines = _total("lines")
    used = _total("used")
    ignored = _total("ignored")
    unrecognized = _total("unrecognized")

    def examples(self, limit: int = 5) -> list[str]:
        """Up to ``limit`` unrecognized lines as ``file:line: text``."""
        return [f"{f.path}:{line}: {text}" for f in self.files for line, text in f.examples][:limit]

    def merge(self, other: "Accounting") -> "Accounting":
        """Both accounts in one (server and app logs of one run)."""
        def union(mine: list, theirs: list) -> list:
            return mine + [x for x in theirs if x not in mine]

        return Accounting(
            files=self.files + other.files, skipped=union(self.skipped, other.skipped),
            unusable=union(self.unusable, other.unusable), notes=union(self.notes, other.notes),
            tasks_complete=self.tasks_complete + other.tasks_complete,
            tasks_incomplete=self.tasks_incomplete + other.tasks_incomplete,
            tasks_cancelled=self.tasks_cancelled + other.tasks_cancelled,
            tasks_cut_at_start=self.tasks_cut_at_start + other.tasks_cut_at_start,
            sessions=self.sessions + other.sessions,
        )

    def summary_lines(self) -> list[str]:
        """The human summary printed on stderr at the end of every command."""
        out = [
            f"lines read {self.lines:,}: used {self.used:,}, known and ignored {self.ignored:,}, "
            f"unrecognized {self.unrecognized:,}"
        ]
        for f in self.files:
            extra = f" [{f.wrapper}]" if f.wrapper else ""
            err = f"; {f.error}" if f.error else ""
            out.append(
                f"  {f.path} ({f.kind}{extra}): {f.lines:,} lines, used {f.used:,}, "
                f"ignored {f.ignored:,}, unrecognized {f.unrecognized:,}{err}"
            )
        if self.tasks_complete or self.tasks_incomplete or self.tasks_cancelled or self.tasks_cut_at_start or self.sessions:
            out.append(
                f"tasks: {self.tasks_complete:,} complete, {self.tasks_cancelled:,} cancelled, "
                f"{self.tasks_incomplete:,} incomplete"
                + (f", {self.tasks_cut_at_start:,} cut at the log's start" if self.tasks_cut_at_start else "")
                + f"; server sessions: {self.sessions}"
            )
        out += [f"  unrecognized: {ex}" for ex in self.examples()]
        out += [f"note: {note}" for note in [*self.notes, *(n for f in self.files for n in f.notes)]]
        out += [f"skipped {path}: {reason}" for path, reason in self.skipped if (path, reason) not in self.unusable]
        return out
