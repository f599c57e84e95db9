"""compare-quants under ``--disk-budget``: what the comparison keeps on disk, and its resumable state.

The budget covers every file the comparison keeps, wherever: its output folder (made quants, tuning storage,
reports), the quants it downloaded, the reference logits and the importance matrix. Before a quant is fetched
or made, :meth:`DiskLedger.make_room` drops kept quants (the largest first, never the current winner or the
quantizing source) until the new one fits; a quant that cannot fit even then is not fetched. Usage is read
from the disk each time, so nothing the comparison writes escapes the count.

The state file keeps every measured row; a comparison started again with the same request resumes at the next
quant.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.core.errors import OverBudgetError
from tuner.machine.fileio import atomic_write

STATE_FILE = "compare-state.json"
STATE_VERSION = 1
# Room kept for what a quant's measurement writes into the folder (tuning storage, logs, reports).
WORK_RESERVE_BYTES = 4 * 2**20


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # a journal or part file gone between listing and stat
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


@dataclass
class DiskLedger:
    """The files one comparison keeps, against its budget (None: unlimited, only counted)."""

    out_dir: Path
    budget_bytes: int | None
    external: dict[str, Path] = field(default_factory=dict)  # label → a kept file outside out_dir
    quants: dict[str, tuple[Path, Callable[[], None]]] = field(default_factory=dict)  # quant → (file, drop)

    def used_bytes(self) -> int:
        inside = tree_bytes(self.out_dir)
        outside = {p.resolve() for p in self.external.values()} | {
            p.resolve() for p, _ in self.quants.values() if not _inside(p, self.out_dir)}
        return inside + sum(tree_bytes(p) for p in outside)

    def keep(self, quant: str, path: Path, drop: Callable[[], None]) -> None:
        self.quants[quant] = (path, drop)

    def keep_file(self, label: str, path: Path) -> None:
        self.external[label] = path

    def make_room(self, need_bytes: int, protect: set[str], what: str) -> list[str]:
        """Drop kept quants (largest first, never ``protect``) until ``need_bytes`` more fits; the dropped."""
        if self.budget_bytes is None:
            return []
        dropped = []
        while self.used_bytes() + need_bytes + WORK_RESERVE_BYTES > self.budget_bytes:
            victims = sorted(((tree_bytes(p), q) for q, (p, _) in self.quants.items() if q not in protect),
                             reverse=True)
            if not victims:
                used = self.used_bytes()
                raise OverBudgetError(
                    f"{what} needs {need_bytes / 2**30:.3f} GiB and the comparison already keeps "
                    f"{used / 2**30:.3f} GiB (the winner, the source, reference logits): raise --disk-budget to "
                    f"at least {(used + need_bytes + WORK_RESERVE_BYTES) / 2**30:.2f}")
            _, q = victims[0]
            self.quants.pop(q)[1]()
            dropped.append(q)
        return dropped

    def is_kept(self, quant: str) -> bool:
        return quant in self.quants


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def fingerprint(**parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_rows(out_dir: Path, key: str) -> list[dict[str, Any]]:
    """The rows an earlier run of the same comparison measured (none when the request differs)."""
    try:
        data = json.loads((out_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return []
    if data.get("version") != STATE_VERSION or data.get("fingerprint") != key:
        return []
    return list(data.get("rows") or [])


def save_rows(out_dir: Path, key: str, rows: list[dict[str, Any]]) -> None:
    atomic_write(out_dir / STATE_FILE, json.dumps({"version": STATE_VERSION, "fingerprint": key, "rows": rows},
                                                  indent=1) + "\n")
