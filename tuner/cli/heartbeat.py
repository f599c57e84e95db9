"""A line at least every :data:`HEARTBEAT_S` seconds while a command waits on an engine, in a terminal and in a pipe:
what the run is doing (:mod:`tuner.machine.activity`: "llama-bench: benchmark 1/1: warmup prompt run") and for how long.
Every line the command says itself puts the next heartbeat off: a run that speaks often never shows one.

A trial on a 12-17 GiB model loads for up to a minute and runs a warm-up prompt for another on a 2-core CPU; the
two-engine run once went 17 minutes without a line."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from tuner.machine import activity

HEARTBEAT_S = 45.0  # under the minute a user waits before wondering


class Heartbeat:
    def __init__(self, say: Callable[[str], None], every_s: float = HEARTBEAT_S, poll_s: float = 1.0) -> None:
        self._say = say
        self._every = every_s
        self._poll = poll_s
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moe-tune-heartbeat", daemon=True)

    def say(self, text: str) -> None:
        """The command's own line: said, and the next heartbeat put off."""
        with self._lock:
            self._last = time.monotonic()
            self._say(text)

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                now = time.monotonic()
                if now - self._last < self._every:
                    continue
                doing = activity.current()
                what = f"{doing.what}, for {now - doing.since:,.0f} s" if doing else "waiting on the engine"
                self._say(f"… still at work: {what}")
                self._last = now

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def beating(say: Callable[[str], None], every_s: float = HEARTBEAT_S) -> Iterator[Callable[[str], None]]:
    """``say`` wrapped: for the block, a heartbeat line whenever nothing was said for ``every_s`` seconds."""
    beat = Heartbeat(say, every_s)
    beat.start()
    try:
        yield beat.say
    finally:
        beat.stop()
