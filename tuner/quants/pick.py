"""Which quant to run: the least quality loss that meets a speed floor, within a loss budget, decided with the
measurement's confidence.

A speed is the mean of the printed line's quiet rounds (its confirmation rounds when the finish chose among
candidates, so not the rounds that chose it), known to within that mean's interval (Student's t, two-sided
90 %); a mean KLD to within 1.645 of llama-perplexity's own standard error. A row meets a limit only when its
whole interval lies within it, and fails it only when its whole interval lies beyond it; an interval that
straddles the limit leaves the row *undecided*, and an undecided row is never picked (noise must not decide):
the answer says which rows were undecided, with their intervals, so a re-measurement with more rounds can
settle them. A speed with no interval (one round) is undecided against a floor for the same reason. Two rows
whose difference lies inside their combined error bars tie, and the smaller file wins a tie. Pure: rows in, a
:class:`Pick` out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from tuner.search.verdict import t95

Z_TWO_SIDED_90 = 1.645

PICK, TIE, MORE_LOSS, SLOWER = "pick", "tie, larger file", "more loss", "slower"
TOO_SLOW, OVER_LOSS, UNMEASURED, UNDECIDED = "below speed floor", "over loss budget", "not measured", "undecided"


class Side(Enum):
    """Where an interval lies against a limit."""

    MEETS = "meets"
    FAILS = "fails"
    UNDECIDED = "undecided"


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the pick needs of one measured quant."""

    quant: str
    size_bytes: int
    gen_tok_s: float | None
    gen_error: float | None  # half-width of the speed's interval; None: one round, no interval
    kld_mean: float | None
    kld_error: float | None  # half-width of the mean KLD's interval


@dataclass(frozen=True, slots=True)
class Pick:
    quant: str | None  # None: no quant meets the limits
    binding: str  # which limit decided the answer, in words
    verdicts: dict[str, str]  # per quant
    undecided: tuple[str, ...] = ()  # one line per row whose interval straddles a limit


def speed_mean(samples: Sequence[float]) -> float | None:
    """The mean of per-round speeds: the statistic :func:`speed_error`'s interval is centred on (None: no rounds)."""
    ok = [s for s in samples if s is not None and s > 0]
    return statistics.fmean(ok) if ok else None


def speed_error(samples: Sequence[float]) -> float | None:
    """Half-width of the two-sided 90 % interval of the mean of per-round speeds (None with fewer than two); print
    it beside :func:`speed_mean`, never beside a median."""
    ok = [s for s in samples if s is not None and s > 0]
    if len(ok) < 2:
        return None
    return t95(len(ok) - 1) * statistics.stdev(ok) / math.sqrt(len(ok))


def kld_error(standard_error: float | None) -> float:
    return Z_TWO_SIDED_90 * (standard_error or 0.0)


def floor_side(value: float, error: float | None, floor: float) -> Side:
    """A speed against a floor: meets when its whole interval is at or above it, fails when wholly below."""
    if error is None:
        return Side.UNDECIDED
    if value - error >= floor:
        return Side.MEETS
    return Side.FAILS if value + error < floor else Side.UNDECIDED


def ceiling_side(value: float, error: float | None, ceiling: float) -> Side:
    """A loss against a budget: meets when its whole interval is at or below it, fails when wholly above."""
    if error is None:
        return Side.UNDECIDED
    if value + error <= ceiling:
        return Side.MEETS
    return Side.FAILS if value - error > ceiling else Side.UNDECIDED


def _tie(a: float, ea: float | None, b: float, eb: float | None) -> bool:
    return abs(a - b) <= math.hypot(ea or 0.0, eb or 0.0)


def _smallest_of_ties(best: Candidate, pool: Sequence[Candidate], value: str,
                      error: str) -> tuple[Candidate, list[str]]:
    ties = [c for c in pool if _tie(getattr(c, value), getattr(c, error), getattr(best, value), getattr(best, error))]
    chosen = min(ties, key=lambda c: (c.size_bytes, c.quant))
    return chosen, [c.quant for c in ties if c is not chosen]


def _interval(value: float, error: float | None, spec: str) -> str:
    return f"{value:{spec}} (one round, no interval)" if error is None else f"{value:{spec}} ± {error:{spec}}"


def _undecided_line(c: Candidate, speed: Side, loss: Side, min_tok_s: float | None, max_kld: float | None) -> str:
    why = []
    if speed is Side.UNDECIDED and min_tok_s is not None:
        why.append(f"{_interval(c.gen_tok_s or 0.0, c.gen_error, '.1f')} tok/s straddles --min-tok-s {min_tok_s:g}")
    if loss is Side.UNDECIDED and max_kld is not None:
        why.append(f"mean KLD {_interval(c.kld_mean or 0.0, c.kld_error, '.4f')} straddles --max-kld {max_kld:g}")
    return f"{c.quant} is undecided: {' and '.join(why)}; measure more rounds to settle it"


def pick(cands: Sequence[Candidate], min_tok_s: float | None = None, max_kld: float | None = None) -> Pick:
    """With a speed floor (and maybe a loss budget): the least loss that meets both. With only a loss budget:
    the fastest within it. With neither: the least loss. Ties go to the smaller file; rows whose interval
    straddles a limit are undecided and never picked."""
    verdicts = {c.quant: UNMEASURED for c in cands}
    measured = [c for c in cands if c.gen_tok_s is not None and c.kld_mean is not None]
    speed = {c.quant: Side.MEETS if min_tok_s is None else floor_side(c.gen_tok_s or 0.0, c.gen_error, min_tok_s)
             for c in measured}
    loss = {c.quant: Side.MEETS if max_kld is None else ceiling_side(c.kld_mean or 0.0, c.kld_error, max_kld)
            for c in measured}
    undecided: dict[str, str] = {}  # quant → why, with its interval
    for c in measured:
        s, k = speed[c.quant], loss[c.quant]
        if Side.FAILS in (s, k):
            verdicts[c.quant] = OVER_LOSS if k is Side.FAILS else TOO_SLOW
        elif Side.UNDECIDED in (s, k):
            verdicts[c.quant] = UNDECIDED
            undecided[c.quant] = _undecided_line(c, s, k, min_tok_s, max_kld)
        else:
            verdicts[c.quant] = MORE_LOSS
    ok = [c for c in measured if speed[c.quant] is Side.MEETS and loss[c.quant] is Side.MEETS]
    if not ok:
        line = _none_line(measured, speed, loss, min_tok_s, max_kld)
        if undecided:
            line += f"; {len(undecided)} undecided ({'; '.join(undecided.values())})"
        return Pick(None, line, verdicts, tuple(undecided.values()))
    by_speed = min_tok_s is None and max_kld is not None
    if by_speed:
        best = max(ok, key=lambda c: c.gen_tok_s or 0.0)
        chosen, tied = _smallest_of_ties(best, ok, "gen_tok_s", "gen_error")
        for c in ok:
            verdicts[c.quant] = SLOWER
    else:
        best = min(ok, key=lambda c: c.kld_mean or 0.0)
        chosen, tied = _smallest_of_ties(best, ok, "kld_mean", "kld_error")
    for name in tied:
        verdicts[name] = TIE
    verdicts[chosen.quant] = PICK
    binding = _binding(chosen, measured, speed, loss, min_tok_s, max_kld, by_speed)
    # An undecided row that would beat the pick if it met the limits makes the answer provisional: say so.
    def beats(c: Candidate) -> bool:
        if by_speed:
            return (c.gen_tok_s or 0.0) > (chosen.gen_tok_s or 0.0)
        return (c.kld_mean or 0.0) < (chosen.kld_mean or 0.0)
    rivals = [undecided[c.quant] for c in measured if c.quant in undecided and beats(c)]
    if rivals:
        binding += f"; {'; '.join(rivals)}"
    return Pick(chosen.quant, binding, verdicts, tuple(undecided.values()))


def _binding(chosen: Candidate, measured: Sequence[Candidate], speed: dict[str, Side], loss: dict[str, Side],
             min_tok_s: float | None, max_kld: float | None, by_speed: bool) -> str:
    if by_speed:
        # Faster quants shut out by the loss budget make it bind.
        faster = [c for c in measured if loss[c.quant] is Side.FAILS and (c.gen_tok_s or 0) - (c.gen_error or 0)
                  > (chosen.gen_tok_s or 0) + (chosen.gen_error or 0)]
        if faster:
            f = max(faster, key=lambda c: c.gen_tok_s or 0.0)
            return (f"the loss budget binds: {f.quant} runs {f.gen_tok_s:.1f} tok/s but its mean KLD "
                    f"{f.kld_mean:.4f} is over --max-kld {max_kld:g}")
        return "no limit binds: the fastest quant is within the loss budget"
    # Quants with clearly less loss shut out by the speed floor make it bind.
    better = [c for c in measured if speed[c.quant] is Side.FAILS and (c.kld_mean or 0) + (c.kld_error or 0)
              < (chosen.kld_mean or 0) - (chosen.kld_error or 0)]
    if better and min_tok_s is not None:
        b = min(better, key=lambda c: c.kld_mean or 0.0)
        return (f"the speed floor binds: {b.quant} loses less (mean KLD {b.kld_mean:.4f}) but runs "
                f"{b.gen_tok_s:.1f} tok/s, under --min-tok-s {min_tok_s:g}")
    if min_tok_s is None and max_kld is None:
        return "no limits given: the least quality loss measured (ties go to the smaller file)"
    return "no limit binds: the quant with the least loss meets " + (
        "both limits" if min_tok_s is not None and max_kld is not None else "the speed floor")


def _none_line(measured: Sequence[Candidate], speed: dict[str, Side], loss: dict[str, Side],
               min_tok_s: float | None, max_kld: float | None) -> str:
    if not measured:
        return "no quant was measured: see the errors in the table"
    limits = " and ".join(x for x in (f"--min-tok-s {min_tok_s:g}" if min_tok_s is not None else "",
                                      f"--max-kld {max_kld:g}" if max_kld is not None else "") if x)
    fast = [c for c in measured if speed[c.quant] is Side.MEETS]
    close = [c for c in measured if loss[c.quant] is Side.MEETS]
    hints = []
    if close and min_tok_s is not None:
        f = max(close, key=lambda c: c.gen_tok_s or 0.0)
        hints.append(f"the fastest within the loss budget, {f.quant}, runs {f.gen_tok_s:.1f} tok/s")
    if fast and max_kld is not None:
        q = min(fast, key=lambda c: c.kld_mean or 0.0)
        hints.append(f"the least loss at the speed floor, {q.quant}, has mean KLD {q.kld_mean:.4f}")
    if not hints:
        f = max(measured, key=lambda c: c.gen_tok_s or 0.0)
        hints.append(f"the fastest, {f.quant}, runs {f.gen_tok_s:.1f} tok/s at mean KLD {f.kld_mean:.4f}")
    both = "both " if min_tok_s is not None and max_kld is not None else ""
    return f"no quant meets {both}{limits}: {'; '.join(hints)}"
