"""Selection, then confirmation in fresh rounds: the driver behind every stage that prints a launch line.

A setting enters the printed line only when it was *decided* better than the line without it. Picking the best
of k arms and judging it on the same rounds is the winner's curse: with k equal arms the best median is a
candidate about (k-1)/k of the time, and its own rounds flatter it. So a stage measures in two phases:

1. **selection** — every arm in interleaved rounds (:attr:`Rounds.select` of them); the best candidate by
   median is *selected*. These rounds decide nothing; they are reported as such.
2. **confirmation** — the reference (the line without the candidate's settings: llama.cpp's own choice, or a
   stage's base line) and the selected candidate measured again in fresh interleaved rounds, :attr:`Rounds.min`
   and then up to :attr:`Rounds.max` while the verdict (:func:`tuner.search.verdict.compare`) is undecided.

With a single candidate there is nothing to select: every round is a confirmation round. Pure: the caller
measures (``measure``), says what to confirm (``to_confirm``) and when the verdicts are settled (``settled``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tuner.core.config import LaunchConfig
from tuner.search.verdict import MIN_ROUNDS

# One arm's one round: its score (higher is better; None: the round failed) and what disturbed the machine
# while it was measured (None: quiet).
Obs = tuple[float | None, str | None]


@dataclass(frozen=True, slots=True)
class Rounds:
    """Interleaved rounds: ``select`` to choose among several candidates, then ``min`` fresh confirmation rounds and
    more, up to ``max``, while the confirmation's verdict is undecided."""

    min: int = MIN_ROUNDS
    max: int = MIN_ROUNDS + 1
    select: int = 2


@dataclass(frozen=True, slots=True)
class Phases:
    """What the two phases measured, per arm label, round by round."""

    selection: dict[str, list[Obs]] = field(default_factory=dict)  # empty: nothing to select
    confirmation: dict[str, list[Obs]] = field(default_factory=dict)


def observations(scores: Sequence[float | None], interference: Sequence[str | None]) -> list[Obs]:
    """Per-round scores beside what disturbed each round (a round past the end of ``interference``: quiet)."""
    return [(s, interference[i] if i < len(interference) else None) for i, s in enumerate(scores)]


def quiet_median(obs: Sequence[Obs]) -> float | None:
    """The median score over the quiet rounds, or over every measured round when none was quiet (selection only
    ranks; a busy machine slows every arm alike, and the confirmation will not decide on busy rounds)."""
    quiet = [s for s, noise in obs if s is not None and not noise]
    scores = quiet or [s for s, _ in obs if s is not None]
    return statistics.median(scores) if scores else None


def best(tables: Mapping[str, Sequence[Obs]], labels: Sequence[str],
         allowed: Callable[[str], bool] = lambda _: True) -> str | None:
    """The label among ``labels`` with the highest :func:`quiet_median`, ties to the earlier one."""
    scored = [(quiet_median(tables.get(x, ())), -i, x) for i, x in enumerate(labels) if allowed(x)]
    scored = [t for t in scored if t[0] is not None]
    return max(scored)[2] if scored else None


def interleave(labels: Sequence[str], measure: Callable[[str, int], Obs], *, first: int, at_least: int,
               at_most: int, settled: Callable[[dict[str, list[Obs]]], bool] = lambda _: False,
               on_round: Callable[[int], None] | None = None,
               out_of_it: Callable[[], Collection[str]] | None = None) -> dict[str, list[Obs]]:
    """Every arm once per round, the order rotating each round (so slow drift and bursts hit every arm alike), for
    ``at_least`` rounds and then up to ``at_most`` until ``settled``. ``first`` numbers the rounds (1-based, for the
    messages of ``measure``). An arm whose first round failed is not measured again, nor one ``out_of_it`` names
    (asked before each round: arms the rounds so far put out of the running)."""
    table: dict[str, list[Obs]] = {x: [] for x in labels}
    arms = list(labels)
    for r in range(at_most):
        if on_round:
            on_round(first + r)
        out = set(out_of_it()) if out_of_it is not None and r > 0 else set()
        for label in arms[r % len(arms):] + arms[:r % len(arms)]:
            if (r > 0 and not any(s is not None for s, _ in table[label])) or label in out:
                continue
            table[label].append(measure(label, first + r))
        if r + 1 >= at_least and settled(table):
            break
    return table


def two_phase(arms: Sequence[str], candidates: Sequence[str], measure: Callable[[str, int], Obs], rounds: Rounds, *,
              to_confirm: Callable[[dict[str, list[Obs]]], list[str]],
              settled: Callable[[dict[str, list[Obs]]], bool],
              out_of_it: Callable[[], Collection[str]] | None = None) -> Phases:
    """Selection over ``arms`` when two or more ``candidates`` compete, then confirmation of ``to_confirm(selection)``
    in fresh rounds; with fewer candidates, confirmation rounds over every arm (less those ``out_of_it`` names)."""
    if len(candidates) < 2 or rounds.select < 1:
        conf = interleave(arms, measure, first=1, at_least=rounds.min, at_most=max(rounds.min, rounds.max),
                          settled=settled, out_of_it=out_of_it)
        return Phases({}, conf)
    sel = interleave(arms, measure, first=1, at_least=rounds.select, at_most=rounds.select)
    confirm = [x for x in to_confirm(sel) if x in sel]
    if not confirm:
        return Phases(sel, {})
    conf = interleave(confirm, measure, first=rounds.select + 1, at_least=rounds.min,
                      at_most=max(rounds.min, rounds.max), settled=settled)
    return Phases(sel, conf)


def slot_arms(candidates: Sequence[tuple[int, LaunchConfig]], slots: Sequence[int]
              ) -> list[tuple[str, LaunchConfig, int | None]]:
    """Candidates as arms; with several slot counts the best candidate is measured at each (context per slot
    kept), the others at the workload's own slot count."""
    arms: list[tuple[str, LaunchConfig, int | None]] = []
    for i, (num, cfg) in enumerate(candidates):
        label = f"candidate-{i + 1}"
        if i > 0 or len(slots) < 2:
            arms.append((label, cfg, num))
            continue
        per_slot = (cfg.ctx or 0) // (cfg.parallel or 1)
        for n in slots:
            arms.append((f"{label} np{n}", replace(cfg, parallel=n, ctx=per_slot * n or None), num))
    return arms
