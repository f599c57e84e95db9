"""Frontier trials measured under a watch, as the single-winner study and its finish measure theirs
(:func:`tuner.machine.quiet.watch_for`: judged for the batch's own configs, so a ``--device none`` batch is blind
to work on the GPU and a ``-t 1`` batch tolerates a busy second core): what else used the machine while a batch
of trials ran is kept with each trial, and a disturbed batch is measured again once the machine has gone quiet
(when the time budget still holds a second measurement).

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

from tuner.core.config import CacheType, LaunchConfig
from tuner.core.model import ModelInfo, TensorClass
from tuner.engine import runner
from tuner.machine import processes, quiet
from tuner.search.watched_round import blamed

QUIET_LOOK_S = 1.0  # how long the machine is looked at before a disturbed batch is measured again


class Watching(Protocol):
    """What a watch tells after the measurement: None when the machine stayed quiet; ``others_memory``: other
    programs' memory load it saw, which a trial's paging is blamed on (:func:`tuner.search.watched_round.blamed`)."""

    @property
    def noise(self) -> str | None: ...

    @property
    def others_memory(self) -> str | None: ...


# A watch over the machine while the given configs are measured; a quick look whether it is quiet for them.
WatchFn = Callable[[Sequence[LaunchConfig]], contextlib.AbstractContextManager[Watching]]
QuietFn = Callable[[Sequence[LaunchConfig]], bool]


class Unwatched:
    """No watch: a replay of figures measured earlier (the frontier benchmark) is not a measurement. A
    :data:`WatchFn` itself (it takes the batch's configs and ignores them)."""

    noise: str | None = None
    others_memory: str | None = None

    def __init__(self, cfgs: Sequence[LaunchConfig] = ()) -> None:
        return None

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
    named = [p for p in parts if " pid " in p and not p.startswith("other processes")]  # not the CPU line's names
    rest = [p for p in parts if p not in named]
    more = f"{len(named) - keep} more processes" if len(named) > keep else ""
    return "; ".join([*named[:keep], *([more] if more else []), *rest])


def engine_watch(cfgs: Sequence[LaunchConfig]) -> quiet.Watch:
    return quiet.watch_for(cfgs, runner.own_pids)


def machine_quiet(cfgs: Sequence[LaunchConfig]) -> bool:
    """One look, judged for ``cfgs`` as :func:`tuner.machine.quiet.watch_for` judges a watch: the GPU only when one
    of them uses it, others' CPU use against the most cores any of them uses."""
    threads = [c.threads for c in cfgs]
    most = None if not threads or None in threads else max(t for t in threads if t is not None)
    return not processes.observe(runner.own_pids, QUIET_LOOK_S, gpu=any(c.device != "none" for c in cfgs),
                                 threads=most).busy


@dataclass(frozen=True, slots=True)
class WatchedBatch:
    """A batch's results; ``noise``: what disturbed the kept measurement (None: quiet); ``remeasured``: whether
    it was measured a second time; ``seconds``: how long one measurement of the batch took (the last one)."""

    results: list[Any]
    noise: str | None
    remeasured: bool
    seconds: float = 0.0


def _faster(a: Any, b: Any) -> Any:
    """The faster of two figures of one trial; a trial that has none (failed, stopped) yields to one that has."""
    fa, fb = getattr(a, "request_s", None), getattr(b, "request_s", None)
    if fa is None:
        return b
    if fb is None:
        return a
    return a if fa <= fb else b


def measure_watched(measure: Callable[[Sequence[Any]], list[Any]], plans: Sequence[Any], *,
                    watch: WatchFn = engine_watch, quiet_now: QuietFn = machine_quiet,
                    on_step: Callable[[str], None] | None = None,
                    left_s: Callable[[], float] | None = None) -> WatchedBatch:
    """``measure(plans)`` under a watch judged for the plans' configs; measured once more when disturbed, the
    machine is quiet now and ``left_s()`` (the time budget left; None: no time budget) still holds as long again."""
    cfgs = [p.config for p in plans]
    t0 = time.monotonic()
    with watch(cfgs) as seen:
        first = [blamed(r, seen.others_memory) for r in measure(plans)]
    took = time.monotonic() - t0
    noise = brief(seen.noise)
    if noise is None:
        return WatchedBatch(first, None, False, took)
    if left_s is not None and left_s() < took:
        if on_step:
            on_step(f"{len(plans)} trial(s) measured on a busy machine ({noise}); no time left to measure them "
                    "again: kept, marked")
        return WatchedBatch(first, noise, False, took)
    if not quiet_now(cfgs):
        if on_step:
            on_step(f"{len(plans)} trial(s) measured on a busy machine ({noise}); still busy: kept, marked")
        return WatchedBatch(first, noise, False, took)
    if on_step:
        on_step(f"{len(plans)} trial(s) measured on a busy machine ({noise}); quiet now: measuring again")
    t0 = time.monotonic()
    with watch(cfgs) as again_seen:
        again = [blamed(r, again_seen.others_memory) for r in measure(plans)]
    took = time.monotonic() - t0
    if again_seen.noise is None:
        return WatchedBatch(again, None, True, took)
    return WatchedBatch([_faster(a, b) for a, b in zip(first, again, strict=True)], brief(again_seen.noise), True,
                        took)


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

    def work(self, tokens: int, attention_weight: float = 1.0) -> float:
        """Operations to process ``tokens`` tokens from an empty context, each attending to those before it;
        ``attention_weight`` scales the attention (a KV cache that is slower to read, :data:`KV_ATTENTION_WEIGHT`)."""
        n = float(tokens)
        full = n * (n - 1) / 2
        w = float(self.window)
        swa = full if n <= w else w * (w - 1) / 2 + (n - w) * w
        return n * self.token_flops + attention_weight * (full * self.full_flops + swa * self.swa_flops)


# What attention at depth costs on the CPU with a quantized KV cache, per position, relative to f16: llama.cpp's
# CPU attention turns each quantized K/V row back into floats as it reads it. Fitted on the demo grid
# (results/benchmarks/frontier_grid_*_chat.json, flash attention on: 8 quantized pairs x 11 contexts from 1,024 to
# 4,096, 1 thread, quiet): scaling only the attention share of :class:`Cost` by these factors gives every pair's
# prompt speed at every depth within 25 % (median 4 %): the factor is flat in depth while attention's share of the
# cost grows, so a deep quantized trial costs far more than its f16 twin (5-9x at 4,096 there). A pair weighs as
# its costlier type (f16/q4_0 as q4_0/q4_0: the quantized read is the cost, whichever side it is on; q5_1 was not
# measured and weighs as q5_0). Not weighed on a GPU, whose attention kernels read quantized K/V natively.
KV_ATTENTION_WEIGHT: dict[CacheType, float] = {
    CacheType.Q8_0: 6.0, CacheType.Q4_0: 8.8, CacheType.Q4_1: 9.0, CacheType.Q5_0: 11.7, CacheType.Q5_1: 11.7,
    CacheType.IQ4_NL: 12.1,
}


def kv_weight(cfg: LaunchConfig) -> float:
    """The attention weight of ``cfg``'s KV pair on the CPU (:data:`KV_ATTENTION_WEIGHT`; f16, bf16, f32: 1)."""
    return max(KV_ATTENTION_WEIGHT.get(cfg.cache_type_k, 1.0), KV_ATTENTION_WEIGHT.get(cfg.cache_type_v, 1.0))


class Pace:
    """Seconds per operation, learnt from the batches measured so far, to say how long a batch should take and
    which of its trials a time budget still holds.

    A trial fills a slot's history and answers the request at its end: about ``slots x (depth + the request's
    own tokens)`` tokens, each attending to those before it. Counting tokens alone under-counts a deep
    context: on the demo model (2 cores, quiet) a batch at contexts 8,192–32,768 was estimated at 77 s from a
    4,096 trial and took 322 s, because attention grows with the depth (llama-bench processes a whole history
    before it times the request: ``test_prompt`` at ``n_depth``). :class:`Cost` weighs both by the model's own
    shape, and one factor (seconds per operation on this machine) is learnt: 304 s for that batch.

    On the CPU (no GPU, or ``-dev none``) two settings weigh too, since the pace is learnt on the first trials
    (the seeds: f16, every core) and a later trial may differ: the KV pair (:func:`kv_weight`; unweighed, a
    q8_0/q4_0 trial was announced at 20 s and took 84 s) and the threads (a trial on ``t`` of ``cores`` cores is
    weighed ``cores / t``: a ``-t 1`` request took 1.8x its ``-t 2`` twin on 2 cores). ``cores``: the machine's
    physical cores, what a trial without ``-t`` uses.
    """

    def __init__(self, request_tokens: int, cost: Cost = Cost(), *, gpu: bool = False,
                 cores: int | None = None) -> None:
        self.request_tokens = request_tokens
        self.cost = cost
        self.gpu = gpu
        self.cores = cores
        self.ops = 0.0  # operations of the batches measured so far (0: nothing learnt yet)
        self.seconds = 0.0

    def _ops(self, plan: Any) -> float:
        cfg = plan.config
        tokens = plan.gen_depth + self.request_tokens
        if self.gpu and cfg.device != "none":
            return (cfg.parallel or 1) * self.cost.work(tokens)
        cores = self.cores or cfg.threads or 1
        threads = min(cfg.threads or cores, cores)
        return (cfg.parallel or 1) * cores / threads * self.cost.work(tokens, kv_weight(cfg))

    def took(self, plans: Sequence[Any], seconds: float) -> None:
        self.ops += sum(self._ops(p) for p in plans)
        self.seconds += seconds

    def estimate_s(self, plans: Sequence[Any]) -> float | None:
        """Seconds the plans should take; None before anything was measured."""
        if not self.ops:
            return None
        return self.seconds / self.ops * sum(self._ops(p) for p in plans)

    def fitting(self, plans: Sequence[Any], left_s: float) -> list[int]:
        """Which of the plans (their indices, in order) the pace says finish in ``left_s`` seconds, taken in order
        and passing over one that would not fit (a shallower one after it may); all of them before the pace is
        known, none when no time is left."""
        if left_s <= 0:
            return []
        kept: list[int] = []
        for i, p in enumerate(plans):
            if (self.estimate_s([*(plans[k] for k in kept), p]) or 0.0) <= left_s:
                kept.append(i)
        return kept

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
