"""Small file helpers shared across modules."""

from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK_BYTES = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (files may be GBs)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()
