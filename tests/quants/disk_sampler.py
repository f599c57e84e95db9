"""What a comparison holds on disk, measured from outside the tool: bytes allocated under folders, and their
peak sampled while a command runs."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path


def disk_bytes(folder: Path) -> int:
    """Bytes allocated on disk under ``folder`` (st_blocks: a sparse header stand-in costs its header only);
    links are not followed, so a Hugging Face snapshot link and its blob count once."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # a file deleted between listing and stat
                st = os.lstat(os.path.join(root, name))
                if not os.path.islink(os.path.join(root, name)):
                    total += st.st_blocks * 512
    return total


@contextlib.contextmanager
def sampled(*folders: Path) -> Iterator[list[int]]:
    """The peak of the folders' bytes on disk together, sampled every 20 ms while the block runs."""
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sum(disk_bytes(f) for f in folders))
            stop.wait(0.02)
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
