"""Whose memory figures decide: the replay of the pinned engine (:func:`tuner.plan.memory.estimate`) by default,
or, while a command has an engine to ask, that engine's own projection (installed with :func:`priced_by`).

The replay needs no engine and no I/O, so it plans for cards nobody here owns and makes the first guess; but it
follows one commit's graph, and a newer llama.cpp may reserve more (b11434's ``build_inp_embd`` added an input path
that grew Qwen3-30B-A3B's compute buffer from 304 to 324 MiB at ``-ub 512``). The engine's projection
(``llama-fit-params``) is the truth for the build that will run, so where a command has one it installs a
:class:`Price` that corrects the replay by what the engine says (tuner.measure.engine_memory) and every verdict
that decides (the fit interval, the search's memory gate, bench's warning) follows it.

The price in force is context-local, set for the span of one command: nothing here does I/O; the installed
function does (it runs the engine), which is why it is passed in, never made here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.core.units import MIB
from tuner.plan.memory import Breakdown, MemoryEstimate, estimate, judge

Price = Callable[[ModelInfo, LaunchConfig, Hardware], MemoryEstimate]

_PRICE: ContextVar[Price | None] = ContextVar("moe_tune_price", default=None)


def price(model: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> MemoryEstimate:
    """What ``cfg`` costs by the figures that decide: the engine's where one was installed, else the replay."""
    chosen = _PRICE.get()
    return chosen(model, cfg, hw) if chosen is not None else estimate(model, cfg, hw)


def engine_first() -> bool:
    """Whether an engine's projection is in force (so a replay's guess is only a first guess)."""
    return _PRICE.get() is not None


@contextlib.contextmanager
def priced_by(chosen: Price | None) -> Iterator[None]:
    """Decide by ``chosen`` for the span of the block (None: the replay)."""
    token = _PRICE.set(chosen)
    try:
        yield
    finally:
        _PRICE.reset(token)


def replay_only() -> contextlib.AbstractContextManager[None]:
    """The replay alone for the span of the block: a bisection's guesses, before the engine settles the end."""
    return priced_by(None)


COMPONENTS = ("weights", "context", "compute")
# llama.cpp prints whole MiB, rounded down per buffer: a difference this small is its rounding, not a drift.
ROUNDING_MIB = 2


def decided_mib(replay_mib: int, engine_mib: int) -> int:
    """The figure that decides one component: the engine's, unless it differs from the replay's by its rounding."""
    return engine_mib if abs(engine_mib - replay_mib) > ROUNDING_MIB else replay_mib
_FIELD = {"weights": "weights_bytes", "context": "kv_bytes", "compute": "compute_bytes"}


@dataclass(frozen=True, slots=True)
class Drift:
    """The engine's projection less the replay's for the same config, per side ("gpu", "host") and component
    ("weights", "context", "compute"), in bytes; only the parts beyond the engine's own rounding are kept."""

    parts: tuple[tuple[str, str, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.parts)

    def bytes_of(self, where: str, component: str) -> int:
        return sum(d for w, c, d in self.parts if (w, c) == (where, component))


def corrected(est: MemoryEstimate, drift: Drift, hw: Hardware) -> MemoryEstimate:
    """``est`` with the engine's figures where they differ (a context difference is booked on the KV cache), and
    its verdict judged again."""
    if not drift:
        return est

    def side(b: Breakdown, where: str) -> Breakdown:
        changes = {_FIELD[c]: max(0, getattr(b, _FIELD[c]) + drift.bytes_of(where, c)) for c in COMPONENTS
                   if drift.bytes_of(where, c)}
        return replace(b, **changes) if changes else b

    gpu, host = side(est.gpu, "gpu"), side(est.host, "host")
    return replace(est, gpu=gpu, host=host, verdict=judge(gpu, host, hw))


def drift_mib(drift: Drift) -> dict[str, int]:
    """``{"host compute": 20, ...}``: the drift in whole MiB, for reports."""
    return {f"{w} {c}": d // MIB for w, c, d in drift.parts}
