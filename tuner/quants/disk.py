"""compare-quants under ``--disk-budget``: what the comparison keeps on disk, and its resumable state.

The budget covers every file the comparison adds to the disk, wherever it lives: its output folder (made
quants, tuning storage, reports), the quants and the reference it downloads into the Hugging Face cache (every
shard of a split file), the reference logits and the importance matrix under the tool's cache, and each quant's
KV-pricing logits while its auto-tune runs. Files the user had before (a local F16, a quant already cached)
are not counted, except the reference, which is counted whenever it sits in the Hugging Face cache.

A file that will be needed but is not on disk yet is *reserved* at its size known in advance (the Hub's listing
for every shard, llama-perplexity's logits layout, a bound for the matrix), so the budget is checked before a
byte is fetched. Before a quant is fetched or made, :meth:`DiskLedger.make_room` first checks that what cannot
be dropped (the fixed part, the current winner) plus the quant's need fits; only then does it drop other kept
quants, the largest first. Usage is read from the disk each time, so nothing the comparison writes into its
folder escapes the count.

The state file keeps every measured row; a comparison started again with the same request resumes at the next
quant.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.core.errors import OverBudgetError
from tuner.hub import download
from tuner.machine.fileio import atomic_write
from tuner.models.gguf_reader import ModelInfo

STATE_FILE = "compare-state.json"
STATE_VERSION = 1
OWNED_FILE = "compare-owned.json"  # quant → the files the comparison fetched or made and has not dropped
# Room kept for what a quant's measurement writes besides the files counted by name (tuning storage, logs,
# reports, the quality results' small JSON files).
WORK_RESERVE_BYTES = 4 * 2**20
GiB = 2**30


def tree_bytes(path: Path) -> int:
    """Bytes of a file (a link: its target) or of every file under a folder."""
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


def gib(n_bytes: int) -> str:
    return f"{n_bytes / GiB:.3f} GiB"


def parts_line(parts: Iterable[tuple[str, int]]) -> str:
    return ", ".join(f"{label} {gib(n)}" for label, n in parts)


@dataclass(frozen=True, slots=True)
class Need:
    """What one step adds to the disk, by part (the quant, its KV-pricing logits, a reservation)."""

    parts: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.parts)


@dataclass
class DiskLedger:
    """The files one comparison keeps, against its budget (None: unlimited, only counted)."""

    out_dir: Path
    budget_bytes: int | None
    files: dict[str, tuple[Path, ...]] = field(default_factory=dict)  # label → kept files outside out_dir
    droppable: dict[str, Callable[[], None]] = field(default_factory=dict)  # label → drop (kept quants only)
    reserved: dict[str, int] = field(default_factory=dict)  # label → bytes of a needed file not on disk yet

    def used_bytes(self) -> int:
        inside = tree_bytes(self.out_dir)
        outside = {p.resolve() for paths in self.files.values() for p in paths if not _inside(p, self.out_dir)}
        return inside + sum(tree_bytes(p) for p in outside) + sum(self.reserved.values())

    def reserve(self, label: str, n_bytes: int) -> None:
        self.reserved[label] = n_bytes

    def keep(self, label: str, paths: Sequence[Path], drop: Callable[[], None] | None = None) -> None:
        """Count ``paths`` from now on (a reservation under the same label ends); ``drop``: a quant the budget
        may delete, None: a fixed file it may not."""
        self.reserved.pop(label, None)
        self.files[label] = tuple(paths)
        if drop is not None:
            self.droppable[label] = drop

    def forget(self, label: str) -> None:
        self.files.pop(label, None)
        self.droppable.pop(label, None)
        self.reserved.pop(label, None)

    def label_bytes(self, label: str) -> int:
        return sum(tree_bytes(p) for p in self.files.get(label, ())) + self.reserved.get(label, 0)

    def kept_parts(self, protect: set[str] | None = None) -> list[tuple[str, int]]:
        """What cannot be dropped, by label (the fixed part, ``protect``), and the rest of the output folder."""
        labels = [q for q in (*self.files, *self.reserved) if q not in self.droppable or q in (protect or set())]
        parts = [(q, self.label_bytes(q)) for q in dict.fromkeys(labels)]
        named_inside = sum(tree_bytes(p) for paths in self.files.values() for p in paths if _inside(p, self.out_dir))
        parts.append(("the rest of its folder", tree_bytes(self.out_dir) - named_inside))
        return [(q, n) for q, n in parts if n > 0]

    def fits(self, need: Need) -> bool:
        return self.budget_bytes is None or (
            self.used_bytes() + need.total_bytes + WORK_RESERVE_BYTES <= self.budget_bytes)

    def make_room(self, need: Need, protect: set[str], what: str) -> list[str]:
        """Drop kept quants (largest first, never ``protect``) until ``need`` fits; the dropped, in order.

        Refuses (:class:`OverBudgetError`) before deleting anything when ``need`` cannot fit even with every
        droppable quant gone."""
        if self.budget_bytes is None:
            return []
        victims = sorted(((self.label_bytes(q), q) for q in self.droppable if q not in protect), reverse=True)
        used = self.used_bytes()
        floor = used - sum(n for n, _ in victims)
        if floor + need.total_bytes + WORK_RESERVE_BYTES > self.budget_bytes:
            raise OverBudgetError(
                f"{what} needs {gib(need.total_bytes)} ({parts_line(need.parts)}) and the comparison keeps "
                f"{gib(floor)} it cannot drop ({parts_line(self.kept_parts(protect))}): raise --disk-budget to at "
                f"least {(floor + need.total_bytes + WORK_RESERVE_BYTES) / GiB:.3f}")
        dropped = []
        while victims and used + need.total_bytes + WORK_RESERVE_BYTES > self.budget_bytes:
            _, q = victims.pop(0)
            self.droppable.pop(q)()
            self.files.pop(q, None)
            dropped.append(q)
            used = self.used_bytes()
        return dropped


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def drop_files(paths: Iterable[Path]) -> int:
    """Delete files and, for Hugging Face cache links, the blobs they point at; the bytes freed."""
    return download.drop_links(paths)


def imatrix_bytes_bound(info: ModelInfo) -> int:
    """An upper bound of the importance matrix llama-imatrix writes for this model (save_imatrix in
    tools/imatrix/imatrix.cpp): per weight matrix an ``in_sum2`` of ne0 x n_mat and a ``counts`` of n_mat f32
    values (n_mat: the experts of a 3-D expert tensor, else 1), each with its name and tensor info, 32-aligned."""
    total = 64 * 2**10  # metadata: type, chunk count and size, the dataset path
    for t in info.tensors:
        if len(t.shape) < 2:
            continue
        n_mat = t.shape[2] if len(t.shape) > 2 else 1
        total += 4 * (t.shape[0] + 1) * n_mat + 2 * (len(t.name) + 96) + 2 * 32
    return total


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


def load_owned(out_dir: Path) -> dict[str, tuple[Path, ...]]:
    """The files earlier runs of the comparison fetched or made, by quant (the budget counts them on resume)."""
    try:
        data = json.loads((out_dir / OWNED_FILE).read_text())
        return {q: tuple(Path(p) for p in paths) for q, paths in dict(data).items()}
    except (OSError, ValueError, TypeError):
        return {}


def save_owned(out_dir: Path, quant: str, paths: Sequence[Path] | None) -> None:
    """Record (or with None, forget) the files of ``quant`` as the comparison's own."""
    owned = {q: [str(p) for p in ps] for q, ps in load_owned(out_dir).items()}
    if paths is None:
        owned.pop(quant, None)
    else:
        owned[quant] = [str(p) for p in paths]
    atomic_write(out_dir / OWNED_FILE, json.dumps(owned, indent=1) + "\n")
