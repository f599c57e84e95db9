"""The frontier as data: its points (each a measured trial of the frontier study, with its Optuna trial number)
and what reading it needs, stored in result.json and read back by the report and ``launch-line --ctx/--slots``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tuner.core.errors import UsageError
from tuner.engine import flags
from tuner.search import study

CTX_SHORT = "ctx_short_tokens"  # constraint: tokens one request lacks in its slot (<= 0: it fits)
STOPPED = "stopped"  # status: still running when the time budget ended (measured again by the next run)
UNSTARTED = "unstarted"  # status: the pace said it would not finish in the time left (measured again too)
AGAIN = frozenset({STOPPED, UNSTARTED, "interrupted"})  # statuses whose config the next run measures again


def unmeasured_reason(status: str, failure: dict[str, Any] | None = None,
                      constraints: dict[str, float] | None = None) -> str | None:
    """Why a frontier trial was not measured, in a few words (None: it was, or it is a skipped repeat). Failures
    are told by their kind only, so that counts group: the reason itself is in the trial's record."""
    if status == STOPPED:
        return "stopped at the time budget"
    if status == UNSTARTED:
        return "not started: would not finish in the time left"
    if status == "interrupted":
        return "cut short by Ctrl-C"
    if status == "infeasible":
        return ("slots shorter than one request" if (constraints or {}).get(CTX_SHORT, 0.0) > 0
                else "does not fit in memory")
    if status == "failed":
        kind = (failure or {}).get("kind", "")
        return "failed: " + ("KV pair not priced" if kind == "not_priced" else kind.replace("_", " ") or "unknown")
    return None


def counted(unmeasured: tuple[tuple[str, int], ...]) -> str:
    """Trials not measured, in words: ``4 stopped at the time budget, 1 does not fit in memory``."""
    return ", ".join(f"{count} {reason}" for reason, count in unmeasured)


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """One Pareto-optimal measured trial, as the table, the plot and ``launch-line --ctx`` read it."""

    trial: int
    ctx: int
    slots: int
    config: dict[str, Any]
    request_s: float
    gen_depth: int
    gen_tok_s: float | None = None
    prompt_tok_s: float | None = None
    aggregate_tok_s: float | None = None
    kld: float | None = None
    vram_bytes: int | None = None
    ram_bytes: int | None = None
    launch_line: str = ""
    # What else used the machine while this point was measured (None: quiet); such a point is marked wherever
    # it is shown. ``remeasured``: its batch was measured a second time (:mod:`tuner.frontier.watched`).
    interference: str | None = None
    remeasured: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_trial(cls, t: Any, has_gpu: bool) -> FrontierPoint:
        """From an Optuna FrozenTrial of the frontier study."""
        a = t.user_attrs
        mem = a.get("memory", {})
        cfg = study.config_from_dict(a["config"])
        return cls(t.number, a["ctx"], a["slots"], a["config"], a["request_s"], a["gen_depth"], a.get("gen_tok_s"),
                   a.get("prompt_tok_s"), a.get("aggregate_tok_s"), a.get("kld"),
                   mem.get("gpu_total_bytes") if has_gpu else None, mem.get("host_total_bytes"),
                   flags.launch_line(cfg), a.get("interference"), bool(a.get("remeasured")))


@dataclass(frozen=True, slots=True)
class Frontier:
    """The measured front, and what a person needs to read it."""

    axes: tuple[str, ...]
    points: tuple[FrontierPoint, ...]
    contexts: tuple[int, ...]
    slots: tuple[int, ...]
    concurrent: bool
    has_gpu: bool
    trials_measured: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The study's trials not measured, counted by :func:`unmeasured_reason` (most first); one stopped, not started
    # or cut short whose config was measured since is not counted.
    unmeasured: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"axes": list(self.axes), "points": [p.to_dict() for p in self.points],
                "contexts": list(self.contexts), "slots": list(self.slots), "concurrent": self.concurrent,
                "has_gpu": self.has_gpu, "trials_measured": self.trials_measured, "notes": list(self.notes),
                "unmeasured": dict(self.unmeasured)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Frontier:
        return cls(tuple(d["axes"]), tuple(FrontierPoint(**p) for p in d["points"]), tuple(d["contexts"]),
                   tuple(d["slots"]), d["concurrent"], d["has_gpu"], d["trials_measured"], tuple(d.get("notes", ())),
                   tuple((d.get("unmeasured") or {}).items()))

    def at(self, ctx: int | None = None, slots: int | None = None) -> FrontierPoint:
        """The fastest frontier point at ``ctx`` and ``slots``; a one-line error naming the points there are."""
        match = [p for p in self.points if (ctx is None or p.ctx == ctx) and (slots is None or p.slots == slots)]
        if not match:
            there = ", ".join(sorted({f"-c {p.ctx}" + (f" -np {p.slots}" if self.concurrent else "")
                                      for p in self.points}, key=lambda s: [int(x) for x in s.split()[1::2]]))
            asked = " ".join(f"--{k} {v}" for k, v in (("ctx", ctx), ("slots", slots)) if v is not None)
            raise UsageError(f"no frontier point at {asked}: the frontier has {there or 'no points'}; pick one")
        return min(match, key=lambda p: p.request_s)
