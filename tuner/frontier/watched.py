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
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tuner.core.model import ModelInfo, TensorClass
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


@dataclass(frozen=True, slots=True)
class Cost:
    """What one token costs a trial, in floating-point operations: ``token_flops`` for the weights it passes
    through (two per active parameter), and per position of the history it attends to ``full_flops`` (the
    layers that attend to the whole history) plus ``swa_flops`` (the sliding-window layers, which attend to at
    most ``window`` positions). The default counts tokens only."""

    token_flops: float = 1.0
    full_flops: float = 0.0
    swa_flops: float = 0.0
    window: int = 0

    @classmethod
    def of(cls, info: ModelInfo) -> Cost:
        """The model's own figures: the active parameters (routed experts at ``n_expert_used`` of
        ``n_expert``; the embedding table is a lookup, not a product) and, per attention layer, Q·K and the
        weighted sum of V for each head (``2 x n_head x (head_dim_k + head_dim_v)`` per position). Recurrent
        layers hold no KV (``n_head_kv`` 0) and attend to nothing."""
        active = 0.0
        for t in info.tensors:
            if t.klass is TensorClass.TOKEN_EMBD:
                continue
            n = float(math.prod(t.shape))
            if t.klass is TensorClass.ROUTED_EXPERTS and info.n_expert:
                n = n * info.n_expert_used / info.n_expert
            active += n
        per_layer = 2.0 * info.n_head * (info.head_dim_k + info.head_dim_v)
        swa = info.swa_layers or (False,) * info.n_layer
        full_layers = sum(1 for kv, w in zip(info.n_head_kv, swa, strict=False) if kv and not (w and info.n_swa))
        swa_layers = sum(1 for kv, w in zip(info.n_head_kv, swa, strict=False) if kv and w and info.n_swa)
        return cls(2.0 * max(active, 1.0), per_layer * full_layers, per_layer * swa_layers, info.n_swa)

    def work(self, tokens: int) -> float:
        """Operations to process ``tokens`` tokens from an empty context, each attending to those before it."""
        n = float(tokens)
        full = n * (n - 1) / 2
        w = float(self.window)
        swa = full if n <= w else w * (w - 1) / 2 + (n - w) * w
        return n * self.token_flops + full * self.full_flops + swa * self.swa_flops


class Pace:
    """Seconds per operation, learnt from the batches measured so far, to cut a batch to what a time budget
    still holds and say how long a batch should take.

    A trial fills a slot's history and answers the request at its end: about ``slots x (depth + the request's
    own tokens)`` tokens, each attending to those before it. Counting tokens alone under-counts a deep
    context: on the demo model (2 cores, quiet) a batch at contexts 8,192–32,768 was estimated at 77 s from a
    4,096 trial and took 322 s, because attention grows with the depth (llama-bench processes a whole history
    before it times the request: ``test_prompt`` at ``n_depth``). :class:`Cost` weighs both by the model's own
    shape, and one factor (seconds per operation on this machine) is learnt: 304 s for that batch. The KV
    type is not weighed (a q8_0/q4_0 trial on the CPU took about 3x its f16 twin's time there).
    """

    def __init__(self, request_tokens: int, cost: Cost = Cost()) -> None:
        self.request_tokens = request_tokens
        self.cost = cost
        self.ops = 0.0  # operations of the batches measured so far (0: nothing learnt yet)
        self.seconds = 0.0

    def _ops(self, plan: Any) -> float:
        return (plan.config.parallel or 1) * self.cost.work(plan.gen_depth + self.request_tokens)

    def took(self, plans: Sequence[Any], seconds: float) -> None:
        self.ops += sum(self._ops(p) for p in plans)
        self.seconds += seconds

    def estimate_s(self, plans: Sequence[Any]) -> float | None:
        """Seconds the plans should take; None before anything was measured."""
        if not self.ops:
            return None
        return self.seconds / self.ops * sum(self._ops(p) for p in plans)

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
