"""A line's standing in the engines' race: one object says whether it can still be printed and, if not, why. The rule
(:func:`tuner.versus.rule.choose`), the race's stop (:func:`~tuner.versus.rule.settled`) and its drop
(:func:`~tuner.versus.rule.out_of_running`) all ask :func:`standings`, so none of them can read a line's state another
way than the others.

States, in the order they are judged:

- **screened**: not raced: its search measured it too close to its engine's default for the race's rounds to tell
  them apart (:mod:`tuner.versus.screen`);
- **refused**: its quality price refused it (priced before it raced: it never pushes another line out);
- **held**: an engine's second candidate, held back while its best one can race (it races where its best is
  refused); **not raced**: never measured;
- **paged**: it read its model back from disk in two rounds or more, or in one where the plan says it does not fit
  the RAM free (:attr:`tuner.versus.judge.Arm.paging`);
- **failed**; **over budget** (it grew the card's use past the VRAM budget, or its VRAM was not read);
- **slower**: decided slower than a line that is in, or than llama.cpp's default where that default was measured
  (even paging: a line slower than a paging default is slower still);
- **in**: it may be printed. ``unpriced`` says why a line that needed a price has none (it stays in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner.search.verdict import WORSE, Verdict
from tuner.versus import judge
from tuner.versus.lines import REFERENCE, EngineLine

IN, SLOWER, PAGED, FAILED, OVER_BUDGET = "in", "slower", "paged", "failed", "over_budget"
REFUSED, SCREENED, NOT_RACED = "refused", "screened", "not_raced"
HELD = "held"  # an engine's reserve candidate, not raced while its best one could be
PRINTED, UNPRICED = "printed", "unpriced"  # record-only words (tuner.versus.engines.record)


@dataclass(frozen=True, slots=True)
class Gates:
    """What kept lines out of the race before it ran, or marks them: label → why."""

    refused: Mapping[str, str] = field(default_factory=dict)  # by its price: never raced, never printed
    unpriced: Mapping[str, str] = field(default_factory=dict)  # its price failed: raced, printed with the reason
    screened: Mapping[str, str] = field(default_factory=dict)  # not raced: its search could not tell it apart
    held: Mapping[str, str] = field(default_factory=dict)  # not raced: a reserve while its engine's best races


NO_GATES = Gates()


@dataclass(frozen=True, slots=True)
class Standing:
    label: str
    state: str
    why: str = ""
    slower_than: str | None = None  # the line it was decided slower than (state "slower")
    verdict: Verdict | None = None  # that decision

    @property
    def is_in(self) -> bool:
        return self.state == IN

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "why": self.why, "slower_than": self.slower_than,
                "verdict": self.verdict.to_dict() if self.verdict else None}


def _paged_words(arm: judge.Arm) -> str:
    every = len(arm.selection) + len(arm.rounds)
    plan = f"; the plan says so too: {arm.plan_pages}" if arm.plan_pages else ""
    return (f"read its model back from disk while generating in {arm.paged_rounds} of {every} rounds (it does not fit "
            f"this machine's RAM as it is{plan})")


def _alone(x: EngineLine, versus: judge.HeadToHead | None, gates: Gates) -> Standing:
    """A line's standing on its own: what no other line's rounds change."""
    if x.label in gates.screened:
        return Standing(x.label, SCREENED, gates.screened[x.label])
    if x.label in gates.refused:
        return Standing(x.label, REFUSED, gates.refused[x.label])
    if x.label in gates.held:
        return Standing(x.label, HELD, gates.held[x.label])
    arm = versus.arm(x.label) if versus is not None else None
    if arm is None or not (arm.rounds or arm.selection or arm.failure):
        return Standing(x.label, NOT_RACED, "was not raced")
    if arm.paging:
        return Standing(x.label, PAGED, _paged_words(arm))
    if arm.score is None:
        return Standing(x.label, FAILED, f"failed ({arm.failure})" if arm.failure else "was not measured on a quiet "
                        "machine")
    budget = arm.budget_words(versus.vram_budget_bytes) if versus is not None else None
    if budget:
        return Standing(x.label, OVER_BUDGET, f"did not keep the VRAM budget: it {budget}")
    return Standing(x.label, IN, gates.unpriced.get(x.label, ""))


def standings(lines: Sequence[EngineLine], versus: judge.HeadToHead | None, gates: Gates = NO_GATES
              ) -> dict[str, Standing]:
    """Every line's standing after the rounds so far (module docstring)."""
    out = {x.label: _alone(x, versus, gates) for x in lines}
    if versus is None:
        return out
    pool = [label for label, s in out.items() if s.is_in]
    ref = out.get(REFERENCE)
    # llama.cpp's default judges even when it paged: a line decided slower than it is never the line to run.
    judges = pool + ([REFERENCE] if ref is not None and ref.state == PAGED else [])
    for label in pool:
        for other in judges:
            if other == label:
                continue
            v = versus.pair(label, other)
            if v.outcome == WORSE:
                out[label] = Standing(label, SLOWER, f"was decided slower than {other} ({v.ratio:.2f}x, 99 % "
                                      f"{v.low:.2f}-{v.high:.2f}x over {v.rounds} rounds)", other, v)
                break
    return out


def left_out_words(lines: Sequence[EngineLine], stand: Mapping[str, Standing], *, slower: bool = False,
                   but: str | None = None) -> str:
    """The lines that could not race for the print (not raced, refused, paged, failed, over budget; ``slower``: and
    those decided slower than another), ``but`` one, in a clause (empty when none)."""
    skip = (IN, HELD) if slower else (IN, SLOWER, HELD)
    gone = [f"{x.label} {stand[x.label].why}" for x in lines
            if stand[x.label].state not in skip and x.label != but]
    return f"; left out: {'; '.join(gone)}" if gone else ""
