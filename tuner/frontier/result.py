"""The frontier as data: its points (each a measured trial of the frontier study, with its Optuna trial number)
and what reading it needs, stored in result.json and read back by the report and ``launch-line --ctx/--slots``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tuner.core.errors import UsageError
from tuner.engine import flags
from tuner.machine.sampler import PagingVerdict
from tuner.search import dedup
from tuner.search.trials import config_from_dict

CTX_SHORT = "ctx_short_tokens"  # constraint: tokens one request lacks in its slot (<= 0: it fits)
STOPPED = "stopped"  # status: still running when the time budget ended (measured again by the next run)
UNSTARTED = "unstarted"  # status: the pace said it would not finish in the time left (measured again too)
PAGING = dedup.PAGING  # status: measured, but the engine read its model back from disk (kept off the front)
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
    # Host RAM over its timed generation (PagingVerdict.to_dict; a point of the front never paged). None: a front
    # stored before the verdict was kept.
    host_paging: dict[str, Any] | None = None

    @property
    def paging_cell(self) -> str:
        """The verdict in a table cell: "none" (measured, no page read back), "?" (not measured)."""
        return "none" if PagingVerdict.from_dict(self.host_paging).measured else "?"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_trial(cls, t: Any, has_gpu: bool) -> FrontierPoint:
        """From an Optuna FrozenTrial of the frontier study."""
        a = t.user_attrs
        mem = a.get("memory", {})
        cfg = config_from_dict(a["config"])
        return cls(t.number, a["ctx"], a["slots"], a["config"], a["request_s"], a["gen_depth"], a.get("gen_tok_s"),
                   a.get("prompt_tok_s"), a.get("aggregate_tok_s"), a.get("kld"),
                   mem.get("gpu_total_bytes") if has_gpu else None, mem.get("host_total_bytes"),
                   flags.launch_line(cfg), a.get("interference"), bool(a.get("remeasured")), a.get("host_paging"))


def paged_trial(t: Any) -> dict[str, Any]:
    """A measured trial kept off the front because it paged host RAM, as the notes, the report and ``launch-line
    --ctx`` tell it (from an Optuna FrozenTrial)."""
    a = t.user_attrs
    verdict = PagingVerdict.from_dict(a.get("host_paging"))
    return {"trial": t.number, "ctx": a.get("ctx"), "slots": a.get("slots"), "config": a.get("config"),
            "request_s": a.get("request_s"), "major_faults_per_token": verdict.faults_per_token,
            "evidence": verdict.evidence, "fix": verdict.fix,
            "launch_line": flags.launch_line(config_from_dict(a["config"]))}


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
    # Measured trials kept off the front because the engine read its model back from disk (:func:`paged_trial`).
    paged: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"axes": list(self.axes), "points": [p.to_dict() for p in self.points],
                "contexts": list(self.contexts), "slots": list(self.slots), "concurrent": self.concurrent,
                "has_gpu": self.has_gpu, "trials_measured": self.trials_measured, "notes": list(self.notes),
                "unmeasured": dict(self.unmeasured), "host_paging": list(self.paged)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Frontier:
        return cls(tuple(d["axes"]), tuple(FrontierPoint(**p) for p in d["points"]), tuple(d["contexts"]),
                   tuple(d["slots"]), d["concurrent"], d["has_gpu"], d["trials_measured"], tuple(d.get("notes", ())),
                   tuple((d.get("unmeasured") or {}).items()), tuple(d.get("host_paging") or ()))

    def at(self, ctx: int | None = None, slots: int | None = None) -> FrontierPoint:
        """The fastest frontier point at ``ctx`` and ``slots``; a one-line error naming the points there are."""
        match = [p for p in self.points if (ctx is None or p.ctx == ctx) and (slots is None or p.slots == slots)]
        paged = [p for p in self.paged if (ctx is None or p["ctx"] == ctx) and (slots is None or p["slots"] == slots)]
        if not match and paged:
            p = paged[0]
            raise UsageError(f"no line at {_asked(ctx, slots)}: every config measured there paged host RAM (trial "
                             f"{p['trial']}: {p['evidence']}); such a line reads its model from disk as it generates: "
                             f"{p['fix'] or 'free RAM'}, or pick another point ({self._there() or 'none'})")
        if not match:
            raise UsageError(f"no frontier point at {_asked(ctx, slots)}: the frontier has "
                             f"{self._there() or 'no points'}; pick one")
        return min(match, key=lambda p: p.request_s)

    def _there(self) -> str:
        return ", ".join(sorted({f"-c {p.ctx}" + (f" -np {p.slots}" if self.concurrent else "") for p in self.points},
                                key=lambda s: [int(x) for x in s.split()[1::2]]))


def _asked(ctx: int | None, slots: int | None) -> str:
    return " ".join(f"--{k} {v}" for k, v in (("ctx", ctx), ("slots", slots)) if v is not None)
