"""Frontier trials measured under a watch, as the single-winner study and its finish measure theirs
(:class:`tuner.machine.quiet.Watch`): what else used the machine while a batch of trials ran is kept with each
trial, and a disturbed batch is measured again once the machine has gone quiet.

Measuring again while the machine is still busy would only measure the other programs again, so a batch is
re-measured only when a short look finds the machine quiet; if the second measurement is disturbed too, each
trial keeps its faster figure (other programs only ever slow a run down) and stays marked. A marked trial
can stand on the front, but never unmarked: :class:`tuner.frontier.result.FrontierPoint` carries the
interference, and the table and the report flag it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tuner.engine import runner
from tuner.machine import processes, quiet
from tuner.measure import failures

QUIET_LOOK_S = 1.0  # how long the machine is looked at before a disturbed batch is measured again


class Watching(Protocol):
    """What a watch tells after the measurement: None when the machine stayed quiet."""

    @property
    def noise(self) -> str | None: ...


WatchFn = Callable[[], contextlib.AbstractContextManager[Watching]]


class Unwatched:
    """No watch: a replay of figures measured earlier (the frontier benchmark) is not a measurement."""

    noise: str | None = None

    def __enter__(self) -> Unwatched:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def brief(noise: str | None, keep: int = 3) -> str | None:
    """A watch's description, short enough for a table note: the first few processes named, the rest counted
    (a busy shared machine can list dozens of other llama.cpp processes)."""
    if noise is None:
        return None
    parts = noise.split("; ")
    named = [p for p in parts if " pid " in p]
    rest = [p for p in parts if " pid " not in p]
    more = f"{len(named) - keep} more processes" if len(named) > keep else ""
    return "; ".join([*named[:keep], *([more] if more else []), *rest])


def engine_watch() -> quiet.Watch:
    return quiet.Watch(own=runner.own_pids)


def machine_quiet() -> bool:
    return not processes.observe(runner.own_pids, QUIET_LOOK_S).busy


@dataclass(frozen=True, slots=True)
class WatchedBatch:
    """A batch's results; ``noise``: what disturbed the kept measurement (None: quiet); ``remeasured``: whether
    it was measured a second time."""

    results: list[Any]
    noise: str | None
    remeasured: bool


def _faster(a: Any, b: Any) -> Any:
    if isinstance(a, failures.Failure):
        return b
    if isinstance(b, failures.Failure):
        return a
    return a if a.request_s <= b.request_s else b


def measure_watched(measure: Callable[[Sequence[Any]], list[Any]], plans: Sequence[Any], *,
                    watch: WatchFn = engine_watch, quiet_now: Callable[[], bool] = machine_quiet,
                    on_step: Callable[[str], None] | None = None) -> WatchedBatch:
    """``measure(plans)`` under a watch; measured once more when disturbed and the machine is quiet now."""
    with watch() as seen:
        first = measure(plans)
    noise = brief(seen.noise)
    if noise is None:
        return WatchedBatch(first, None, False)
    if not quiet_now():
        if on_step:
            on_step(f"{len(plans)} trial(s) measured on a busy machine ({noise}); still busy: kept, marked")
        return WatchedBatch(first, noise, False)
    if on_step:
        on_step(f"{len(plans)} trial(s) measured on a busy machine ({noise}); quiet now: measuring again")
    with watch() as again_seen:
        again = measure(plans)
    if again_seen.noise is None:
        return WatchedBatch(again, None, True)
    return WatchedBatch([_faster(a, b) for a, b in zip(first, again, strict=True)], brief(again_seen.noise), True)


class Pace:
    """Seconds per token processed, learnt from the batches measured so far: a trial at a slot's depth
    processes about ``slots x (depth + the request's own tokens)``, so a deep context is dearer in proportion.
    It cuts a batch to what a time budget still holds, and says how long a batch should take."""

    def __init__(self, request_tokens: int) -> None:
        self.request_tokens = request_tokens
        self.tokens = 0
        self.seconds = 0.0

    def _tokens(self, plan: Any) -> int:
        return (plan.config.parallel or 1) * (plan.gen_depth + self.request_tokens)

    def took(self, plans: Sequence[Any], seconds: float) -> None:
        self.tokens += sum(self._tokens(p) for p in plans)
        self.seconds += seconds

    def estimate_s(self, plans: Sequence[Any]) -> float | None:
        """Seconds the plans should take; None before anything was measured."""
        if not self.tokens:
            return None
        return self.seconds / self.tokens * sum(self._tokens(p) for p in plans)

    def fitting(self, plans: Sequence[Any], left_s: float) -> int:
        """How many of the plans, in order, fit in ``left_s`` seconds (all of them before the pace is known)."""
        if left_s <= 0:
            return 0
        n = 0
        while n < len(plans) and (self.estimate_s(plans[:n + 1]) or 0.0) <= left_s:
            n += 1
        return n

    def eta(self, plans: Sequence[Any]) -> str:
        est = self.estimate_s(plans)
        return "" if est is None else f" (about {est:,.0f} s at this run's pace)"


@contextlib.contextmanager
def heartbeat(on_step: Callable[[str], None] | None, what: str, every_s: float = 60.0) -> Iterator[None]:
    """A line every ``every_s`` seconds while a batch runs ("still measuring …: 2:00 so far"), so a log or a pipe
    never goes silent for minutes (a deep batch of the demo's frontier once ran 322 s without a line)."""
    if on_step is None:
        yield
        return
    stop = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            took = int(time.monotonic() - start)
            on_step(f"still measuring {what}: {took // 60}:{took % 60:02d} so far")

    thread = threading.Thread(target=beat, name="moe-tune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
