"""The rule that picks the printed line from the race, when the race may stop, and which lines it stops measuring;
each asks the lines' standings (:func:`tuner.versus.standing.standings`), nothing else.

The printed line is one decided faster than llama.cpp's default and decided slower than no other line; among several
such, the fastest median, or the simpler line (fewer settings changed from its engine's default) where the rounds
left the two undecided. A line that paged, broke the VRAM budget, was refused by its price or was decided slower than
another line is never printed. Where no line wins and llama.cpp's default can run, it stays, said. Where the default
cannot be printed (it paged, failed, broke the budget, or was decided slower than another line), the fastest line
still in is printed, and said; never one decided slower than that default. Where none is left, llama.cpp's default
stays if it was measured at all (its paging said), else no line is printed, and why is said.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tuner.search.verdict import BETTER, WORSE, Verdict, decidable
from tuner.versus import judge
from tuner.versus.lines import REFERENCE, EngineLine
from tuner.versus.standing import IN, NO_GATES, PAGED, SLOWER, Gates, Standing, left_out_words, standings


def _fastest(pool: Sequence[EngineLine], v: judge.HeadToHead) -> tuple[EngineLine, str | None]:
    """The fastest median of ``pool``, or a simpler line of it that the rounds did not decide slower than that one;
    with why, in words, where the simpler line was taken (None: the fastest was)."""
    def score(x: EngineLine) -> float:
        arm = v.arm(x.label)
        return (arm.score or 0.0) if arm is not None else 0.0

    ranked = sorted(pool, key=score, reverse=True)
    best = ranked[0]
    simpler = [x for x in ranked[1:] if len(x.changed) < len(best.changed)
               and v.pair(best.label, x.label).outcome != BETTER]
    if not simpler:
        return best, None
    won = min(simpler, key=lambda x: (len(x.changed), -score(x)))
    p = v.pair(best.label, won.label)
    n = len(won.changed)
    what = f"{n} setting{'s' if n != 1 else ''} changed from its engine's default, {len(best.changed)} for the other"
    return won, (f"the simpler line ({what}) where the rounds left it undecided against the faster median of "
                 f"{best.label} ({p.ratio:.2f}x it, 99 % {p.low:.2f}-{p.high:.2f}x over {p.rounds} rounds both ran "
                 "clean)")


def choose(lines: Sequence[EngineLine], versus: judge.HeadToHead | None, gates: Gates = NO_GATES
           ) -> tuple[str | None, str, Verdict | None]:
    """The line to print, one sentence on why, and its verdict against llama.cpp's default (module docstring)."""
    stand = standings(lines, versus, gates)
    if versus is None:
        ok = REFERENCE in stand and stand[REFERENCE].state not in ("refused", "screened")
        return (REFERENCE, "no race was run: llama.cpp's default stays", None) if ok else \
            (None, "no race was run and llama.cpp's default was not measured: no line to print", None)
    ref_arm = versus.arm(REFERENCE)
    measured = ref_arm is not None and ref_arm.score is not None

    def against(x: EngineLine) -> Verdict | None:
        return versus.pair(x.label, REFERENCE) if measured and x.label != REFERENCE else None

    ins = [x for x in lines if stand[x.label].is_in]
    winners = [x for x in ins if x.label != REFERENCE and (w := against(x)) is not None and w.outcome == BETTER]
    if winners:
        won, simpler = _fastest(winners, versus)
        v = against(won)
        assert v is not None
        ran = [x for x in lines if stand[x.label].state in (IN, SLOWER)]
        others = "" if len(ran) <= 2 else " and slower than no other line"
        return won.label, (f"{won.label} was decided faster than llama.cpp's default ({v.ratio:.2f}x, 99 % "
                           f"{v.low:.2f}-{v.high:.2f}x over {v.rounds} rounds){others}"
                           + (f"; of the lines that were, it is {simpler}" if simpler else "")), v
    ref = stand.get(REFERENCE)
    if ref is not None and ref.is_in:
        return REFERENCE, f"llama.cpp's default stays: {_why_default_stays(lines, versus, stand, against)}" + \
            left_out_words(lines, stand), None
    rest = [x for x in ins if x.label != REFERENCE]
    why_ref = ref.why if ref is not None else "was not measured"
    if rest:
        won, simpler = _fastest(rest, versus)
        raw = against(won)
        vs = f" ({raw.ratio:.2f}x llama.cpp's default in the rounds both ran, {raw.interval_words()})" \
            if raw is not None and raw.rounds else ""
        pick = (f"of the lines decided slower than no other, {won.label}{vs} is {simpler}" if simpler else
                f"{won.label}{vs} is the fastest line decided slower than no other")
        return won.label, f"llama.cpp's default {why_ref}: {pick}", raw
    if ref is not None and ref.state == PAGED:
        return REFERENCE, (f"llama.cpp's default stays, though it {ref.why}: no other line can be printed"
                           + left_out_words(lines, stand, slower=True, but=REFERENCE)), None
    gone = [f"{x.label} {stand[x.label].why}" for x in lines if not stand[x.label].is_in]
    return None, "no line can be run here: " + ("; ".join(gone) or "the rounds ranked none above the others"), None


def _why_default_stays(lines: Sequence[EngineLine], versus: judge.HeadToHead, stand: dict[str, Standing],
                       against: Callable[[EngineLine], Verdict | None]) -> str:
    rivals = [(x, against(x)) for x in lines if x.label != REFERENCE and stand[x.label].state in (IN, SLOWER)]
    rivals = [(x, v) for x, v in rivals if v is not None and v.rounds]
    if not rivals:
        return "no other line could be run here to race it"
    x, v = max(rivals, key=lambda p: p[1].ratio if p[1] is not None else 0.0)
    assert v is not None
    if v.outcome == BETTER:  # decided faster than the default, but slower than another line
        return f"{x.label} was decided faster than it ({v.ratio:.2f}x) but {stand[x.label].why}"
    word = "undecided" if v.outcome != WORSE else "decided slower"
    return f"no line was decided faster than it (the closest, {x.label}: {v.ratio:.2f}x, {v.interval_words()}, {word})"


def settled(lines: Sequence[EngineLine], max_rounds: int, gates: Gates = NO_GATES
            ) -> Callable[[judge.HeadToHead], bool]:
    """When the race may stop (asked after each round from the third): no line still in could become the printed one
    in the rounds left, up to ``max_rounds``. Every line still in is decided, or hopeless (undecided and, as noisy as
    it has been, still undecided after the rounds left: :func:`tuner.search.verdict.decidable`), both against
    llama.cpp's default (where it is measured: a line about to be decided faster than it could become the answer) and
    against the printed line."""
    def done(versus: judge.HeadToHead) -> bool:
        answer, _, _ = choose(lines, versus, gates)
        stand = standings(lines, versus, gates)
        ins = [x.label for x in lines if stand[x.label].is_in]
        if answer is None:
            return not ins  # nothing runs: more rounds change nothing
        left = max_rounds - rounds_so_far(versus)
        ref = versus.arm(REFERENCE)
        ref_measured = ref is not None and ref.score is not None
        for y in ins:
            if y == answer:
                continue
            if ref_measured and y != REFERENCE and decidable(versus.pair(y, REFERENCE), left):
                return False
            if decidable(versus.pair(answer, y), left):
                return False
        return True

    return done


def rounds_so_far(versus: judge.HeadToHead) -> int:
    """The race's rounds so far: the highest round number any line ran (a line out of the running ran fewer)."""
    return max((max((r.number for r in a.rounds), default=0) or len(a.rounds) for a in versus.arms), default=0)


def out_of_running(lines: Sequence[EngineLine], gates: Gates = NO_GATES
                   ) -> Callable[[judge.HeadToHead], set[str]]:
    """The lines the rounds so far put out of the running, not measured again: decided slower than another line still
    in, or unable to run here (paged, over the VRAM budget). llama.cpp's default is never out: every verdict is
    against it. A line comes back when the line it was slower than leaves (its next round is fresh)."""
    def out(versus: judge.HeadToHead) -> set[str]:
        stand = standings(lines, versus, gates)
        return {label for label, s in stand.items() if s.state in (SLOWER, PAGED, "over_budget")} - {REFERENCE}

    return out
