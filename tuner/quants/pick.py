"""Which quant to run: the least quality loss that meets a speed floor, within a loss budget, decided with the
measurement's confidence.

A speed is known to within its rounds' interval (Student's t over the finish's per-round tok/s, two-sided
90 %, as :mod:`tuner.search.verdict` judges configs); a mean KLD to within 1.645 of llama-perplexity's own
standard error. A row fails a limit only when its whole interval lies beyond it; two rows whose difference lies
inside their combined error bars tie, and the smaller file wins a tie. Pure: rows in, a :class:`Pick` out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tuner.search.verdict import t95

Z_TWO_SIDED_90 = 1.645

PICK, TIE, MORE_LOSS, SLOWER = "pick", "tie, larger file", "more loss", "slower"
TOO_SLOW, OVER_LOSS, UNMEASURED = "below speed floor", "over loss budget", "not measured"


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the pick needs of one measured quant."""

    quant: str
    size_bytes: int
    gen_tok_s: float | None
    gen_error: float  # half-width of the speed's interval (0: unknown)
    kld_mean: float | None
    kld_error: float  # half-width of the mean KLD's interval


@dataclass(frozen=True, slots=True)
class Pick:
    quant: str | None  # None: no quant meets the limits
    binding: str  # which limit decided the answer, in words
    verdicts: dict[str, str]  # per quant


def speed_error(samples: Sequence[float]) -> float:
    """Half-width of the two-sided 90 % interval of the mean of per-round speeds (0 with fewer than two)."""
    ok = [s for s in samples if s is not None and s > 0]
    if len(ok) < 2:
        return 0.0
    return t95(len(ok) - 1) * statistics.stdev(ok) / math.sqrt(len(ok))


def kld_error(standard_error: float | None) -> float:
    return Z_TWO_SIDED_90 * (standard_error or 0.0)


def _tie(a: float, ea: float, b: float, eb: float) -> bool:
    return abs(a - b) <= math.hypot(ea, eb)


def _smallest_of_ties(best: Candidate, pool: Sequence[Candidate], value: str,
                      error: str) -> tuple[Candidate, list[str]]:
    ties = [c for c in pool if _tie(getattr(c, value), getattr(c, error), getattr(best, value), getattr(best, error))]
    chosen = min(ties, key=lambda c: (c.size_bytes, c.quant))
    return chosen, [c.quant for c in ties if c is not chosen]


def pick(cands: Sequence[Candidate], min_tok_s: float | None = None, max_kld: float | None = None) -> Pick:
    """With a speed floor (and maybe a loss budget): the least loss that meets both. With only a loss budget:
    the fastest within it. With neither: the least loss. Ties go to the smaller file."""
    verdicts = {c.quant: UNMEASURED for c in cands}
    measured = [c for c in cands if c.gen_tok_s is not None and c.kld_mean is not None]
    fast = [c for c in measured if min_tok_s is None or c.gen_tok_s + c.gen_error >= min_tok_s]  # type: ignore[operator]
    close = [c for c in measured if max_kld is None or c.kld_mean - c.kld_error <= max_kld]  # type: ignore[operator]
    for c in measured:
        verdicts[c.quant] = OVER_LOSS if c not in close else TOO_SLOW if c not in fast else MORE_LOSS
    ok = [c for c in fast if c in close]
    if not ok:
        return Pick(None, _none_line(measured, fast, close, min_tok_s, max_kld), verdicts)
    by_speed = min_tok_s is None and max_kld is not None
    if by_speed:
        best = max(ok, key=lambda c: c.gen_tok_s or 0.0)
        chosen, tied = _smallest_of_ties(best, ok, "gen_tok_s", "gen_error")
        for c in ok:
            verdicts[c.quant] = SLOWER
    else:
        best = min(ok, key=lambda c: c.kld_mean or 0.0)
        chosen, tied = _smallest_of_ties(best, ok, "kld_mean", "kld_error")
    for q in tied:
        verdicts[q] = TIE
    verdicts[chosen.quant] = PICK
    return Pick(chosen.quant, _binding(chosen, measured, fast, close, min_tok_s, max_kld, by_speed), verdicts)


def _binding(chosen: Candidate, measured: Sequence[Candidate], fast: Sequence[Candidate],
             close: Sequence[Candidate], min_tok_s: float | None, max_kld: float | None, by_speed: bool) -> str:
    if by_speed:
        # Faster quants shut out by the loss budget make it bind.
        faster = [c for c in measured if c not in close and (c.gen_tok_s or 0) - c.gen_error
                  > (chosen.gen_tok_s or 0) + chosen.gen_error]
        if faster:
            f = max(faster, key=lambda c: c.gen_tok_s or 0.0)
            return (f"the loss budget binds: {f.quant} runs {f.gen_tok_s:.1f} tok/s but its mean KLD "
                    f"{f.kld_mean:.4f} is over --max-kld {max_kld:g}")
        return "no limit binds: the fastest quant is within the loss budget"
    # Quants with clearly less loss shut out by the speed floor make it bind.
    better = [c for c in measured if c not in fast and (c.kld_mean or 0) + c.kld_error
              < (chosen.kld_mean or 0) - chosen.kld_error]
    if better and min_tok_s is not None:
        b = min(better, key=lambda c: c.kld_mean or 0.0)
        return (f"the speed floor binds: {b.quant} loses less (mean KLD {b.kld_mean:.4f}) but runs "
                f"{b.gen_tok_s:.1f} tok/s, under --min-tok-s {min_tok_s:g}")
    if min_tok_s is None and max_kld is None:
        return "no limits given: the least quality loss measured (ties go to the smaller file)"
    return "no limit binds: the quant with the least loss meets " + (
        "both limits" if min_tok_s is not None and max_kld is not None else "the speed floor")


def _none_line(measured: Sequence[Candidate], fast: Sequence[Candidate], close: Sequence[Candidate],
               min_tok_s: float | None, max_kld: float | None) -> str:
    if not measured:
        return "no quant was measured: see the errors in the table"
    limits = " and ".join(x for x in (f"--min-tok-s {min_tok_s:g}" if min_tok_s is not None else "",
                                      f"--max-kld {max_kld:g}" if max_kld is not None else "") if x)
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
