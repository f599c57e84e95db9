"""What identifies a model file without hashing gigabytes: its size, and SHA-256 of its first 8 MiB (the GGUF
header: every key, every tensor's name, type, shape and offset, and the first tensors' data) and of its last
1 MiB (the last tensor's data). A requantized or re-exported file changes the header; a file whose weights were
replaced changes its data, which the two windows sample. Read in about 10 ms from the page cache; a renamed,
copied or re-downloaded identical file keeps its fingerprint whatever its modification time."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

HEAD_BYTES = 8 * 2**20
TAIL_BYTES = 2**20


def fingerprint(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "head_sha256": …, "tail_sha256": …}`` of ``path`` (the first shard of a split model)."""
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
        size = f.seek(0, 2)
        f.seek(max(0, size - TAIL_BYTES))
        tail = hashlib.sha256(f.read(TAIL_BYTES)).hexdigest()
    return {"size": size, "head_sha256": head, "tail_sha256": tail}


def differs(recorded: dict[str, Any], path: Path) -> str | None:
    """How ``path`` differs from the file ``recorded`` was taken of, in words; None when it is the same file."""
    now = fingerprint(path)
    if now["size"] != recorded.get("size"):
        return f"its size is {now['size']:,} bytes, the tuned file's was {int(recorded.get('size') or 0):,}"
    if now["head_sha256"] != recorded.get("head_sha256"):
        return "its header (or first tensors) differs from the tuned file's"
    if now["tail_sha256"] != recorded.get("tail_sha256"):
        return "its last tensor data differs from the tuned file's"
    return None
