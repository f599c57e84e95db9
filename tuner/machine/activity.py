"""What the run is doing right now, in a few words ("llama-bench: warm-up prompt, trial 2"), and since when: set by the
code that waits on an engine, read by the command's heartbeat (:mod:`tuner.cli.heartbeat`), which says it whenever
nothing else was said for a while. No clock of its own but the monotonic one; no output: pure state, thread-safe."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Doing:
    what: str
    since: float  # time.monotonic() when it began


_LOCK = threading.Lock()
_NOW: list[Doing] = []  # a stack: the innermost activity is the one to say


def doing(what: str) -> None:
    """The innermost activity is now ``what`` (replacing the last one set this way)."""
    with _LOCK:
        if _NOW:
            _NOW[-1] = Doing(what, time.monotonic())
        else:
            _NOW.append(Doing(what, time.monotonic()))


@contextlib.contextmanager
def while_doing(what: str) -> Iterator[None]:
    """``what`` for the length of the block, the outer activity back after it."""
    with _LOCK:
        _NOW.append(Doing(what, time.monotonic()))
    try:
        yield
    finally:
        with _LOCK:
            if _NOW:
                _NOW.pop()


def current() -> Doing | None:
    with _LOCK:
        return _NOW[-1] if _NOW else None
