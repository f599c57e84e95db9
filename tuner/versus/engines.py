"""Which engine for this rig: what the race decided (:class:`EngineChoice`) and the records it leaves in each engine's
study folder. The lines are :mod:`tuner.versus.lines`'s, their standing :mod:`tuner.versus.standing`'s, the rule that
picks the printed one :mod:`tuner.versus.rule`'s (re-exported here: the names callers have used since the start).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tuner.search import autotune
from tuner.search.verdict import BETTER, Verdict
from tuner.versus import judge
from tuner.versus.lines import (  # noqa: F401 - the race's public names since the start
    DEFAULT,
    REFERENCE,
    RESERVE,
    TUNED,
    EngineLine,
    EngineTune,
    lines_of,
)
from tuner.versus.rule import choose, out_of_running, settled  # noqa: F401 - as above
from tuner.versus.standing import NO_GATES, PRINTED, UNPRICED, Gates, Standing, standings


@dataclass(frozen=True, slots=True)
class EngineChoice:
    lines: tuple[EngineLine, ...]
    versus: judge.HeadToHead | None
    printed: str | None  # the label of the line to run; None: no line can be run here
    reason: str  # one sentence: why the printed line won, or why llama.cpp's default stays, or why nothing is printed
    refused: tuple[str, ...] = ()  # lines and engines left out, each with why
    against_default: Verdict | None = None  # the printed line against llama.cpp's default, from the race's rounds
    gates: Gates = NO_GATES  # what kept lines out before the race, or marks them (unpriced)

    @property
    def line(self) -> EngineLine | None:
        return next((x for x in self.lines if x.label == self.printed), None)

    def standings(self) -> dict[str, Standing]:
        return standings(self.lines, self.versus, self.gates)

    def verdicts(self) -> list[Verdict]:
        """Every runnable line against llama.cpp's default (the race's own figures)."""
        v = self.versus
        if v is None or v.arm(REFERENCE) is None:
            return []
        return [v.pair(a.label, REFERENCE) for a in v.arms if a.label != REFERENCE and a.score is not None
                and v.arm(REFERENCE).score is not None]  # type: ignore[union-attr]

    def order(self) -> list[str]:
        """The rule's order: the printed line, then the lines still in decided faster than llama.cpp's default, then
        the others still in by median, then the rest (slower, paged, refused, not raced) by median."""
        stand = self.standings()
        v = self.versus

        def key(x: EngineLine) -> tuple[bool, bool, bool, float]:
            arm = v.arm(x.label) if v is not None else None
            score = arm.score if arm is not None else None
            faster = v is not None and x.label != REFERENCE and arm is not None and score is not None and \
                v.arm(REFERENCE) is not None and v.pair(x.label, REFERENCE).outcome == BETTER
            return x.label != self.printed, not stand[x.label].is_in, not faster, -(score or 0.0)

        return [x.label for x in sorted(self.lines, key=key)]

    def standing_dict(self, label: str, stand: dict[str, Standing]) -> dict[str, Any]:
        s = stand[label]
        if label == self.printed:
            return s.to_dict() | {"state": PRINTED, "why": self.reason}
        if s.is_in and label in self.gates.unpriced:
            return s.to_dict() | {"state": UNPRICED, "why": self.gates.unpriced[label]}
        return s.to_dict()

    def to_dict(self) -> dict[str, Any]:
        line = self.line
        stand = self.standings()
        return {"lines": [x.to_dict() | {"standing": self.standing_dict(x.label, stand)} for x in self.lines],
                "head_to_head": self.versus.to_dict() if self.versus else None, "printed": self.printed,
                "printed_engine": line.engine if line else None, "reason": self.reason, "refused": list(self.refused),
                "order": self.order(),
                "against_default": self.against_default.to_dict() if self.against_default else None,
                "verdicts_against_default": [v.to_dict() for v in self.verdicts()]}


# -------------------------------------------------------------------------------------------------- the record


def record(tunes: Sequence[EngineTune], choice: EngineChoice) -> list[autotune.TuneResult]:
    """Each engine's result.json with the race in it (``engines``, ``chosen`` where that engine printed the line), the
    chosen one written last: the newest result of the model is the one to serve."""
    from tuner.search.result import write_result

    block = choice.to_dict()
    printed = choice.line
    out = []
    done = [t for t in tunes if t.result is not None]
    for t in sorted(done, key=lambda t: printed is not None and t.kind.name == printed.engine):
        assert t.result is not None
        chosen = printed is not None and t.kind.name == printed.engine
        result = replace(t.result.result, engines={**block, "chosen": chosen})
        write_result(result, t.result.result_dir)
        out.append(replace(t.result, result=result))
    return out
