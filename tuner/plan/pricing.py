"""Whose memory figures decide: the replay of the pinned engine (:func:`tuner.plan.memory.estimate`) by default, or
an engine's own projection where a caller passes one in as a :data:`Price`.

The replay needs no engine and no I/O, so it plans for cards nobody here owns and makes the first guess; but it
follows one commit's graph, and a newer llama.cpp may reserve more (b11434's ``build_inp_embd`` added an input path
that grew Qwen3-30B-A3B's compute buffer from 304 to 324 MiB at ``-ub 512``). The engine's projection
(``llama-fit-params``) is the truth for the build that will run, so a caller with an engine passes a price that
corrects the replay by what the engine says (tuner.measure.engine_memory) to every verdict that decides: the fit
interval and the table here (:mod:`tuner.plan.placement`), the search's memory gate, bench's warning.

Pure: the price is passed in (it runs the engine, so it is never made here); this module only says how a drift
corrects an estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.plan.memory import Breakdown, MemoryEstimate, judge

# What a config costs by the figures that decide: :func:`tuner.plan.memory.estimate`, or an engine's correction.
Price = Callable[[ModelInfo, LaunchConfig, Hardware], MemoryEstimate]

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
