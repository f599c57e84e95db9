"""What a read of a pool skipped, said in a bounded number of lines however many records a pool refuses.

A pool may hold any number of records, names or rows that fail the gate (one shard of 200,000 junk rows printed
20,012 warning lines before). Each refusal is counted by its kind (the :class:`~tuner.core.errors.RecordError`'s
``reason``); the first :data:`FIRST` are kept as lines, then one line gives the count by kind. A record read and
passed over without fault (another model's, a copy read twice) is counted by its reason too, never as a line of its
own: every record read is kept or counted here. Refusals of what was never read (a file's name, its listed size, a
download, a whole shard) are counted apart as well (``unread``), so that records read = kept + :attr:`count` -
``unread``. Notes on what was not read at all (files past the sample, a listing cut short) are few by construction
and always kept, up to :data:`MAX_NOTES`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tuner.core.errors import RecordError

FIRST = 5  # refusals shown as lines of their own
MAX_NOTES = 20


@dataclass
class Refusals:
    first: list[str] = field(default_factory=list)
    by_reason: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    unread: int = 0  # refusals of what was never read as a record (a name, a size, a download, a shard)

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())

    def refuse(self, error: RecordError, *, read: bool = True) -> None:
        self.add(str(error), error.reason, read=read)

    def add(self, line: str, reason: str, *, read: bool = True) -> None:
        self.by_reason[reason] += 1
        self.unread += not read
        if len(self.first) < FIRST:
            self.first.append(line)

    def pass_over(self, reason: str) -> None:
        """A record read and not kept, through no fault of its own: counted by ``reason``, no line."""
        self.by_reason[reason] += 1

    def note(self, line: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append(line)

    def summary(self) -> str | None:
        """One line with the count by kind, where more were refused than shown."""
        if self.count <= len(self.first):
            return None
        kinds = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.by_reason.items(), key=lambda kv: (-kv[1],
                                                                                                          kv[0])))
        above = f"; the first {len(self.first)} are above" if self.first else ""
        return f"{self.count:,} shared records skipped in all ({kinds}){above}"

    def lines(self) -> tuple[str, ...]:
        """The notes, the first refusals, then the summary: at most MAX_NOTES + FIRST + 1 lines."""
        summary = self.summary()
        return (*self.notes, *self.first, *([summary] if summary else []))
