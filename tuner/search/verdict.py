"""How sure is "A is faster than B"? Paired rounds, a robust ratio, a confidence bound, and "undecided".

Arms are measured in interleaved rounds (every arm once per round, the order rotating), so slow drift and
bursts from other processes on a shared machine hit every arm alike. The ratio of two arms is judged on the
per-round ratios: its point estimate is their median, its confidence interval comes from the t distribution
of their logarithms. When the interval straddles 1 the verdict is *undecided*, the machine's noise (the
spread of the per-round ratios) is named, and nobody wins by default.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

# Two-sided: the ratio lies inside [low, high] with this confidence. 99 %, not 90 %: the finish compares its
# winner (the best median) with every other arm, so a verdict is wrong in either direction; at 90 % the same
# config against itself would be called faster or slower once in ten (the A/A test,
# tests/search/test_launch_rule.py, holds the whole rule to 1 % non-default lines with every arm equal; it printed
# 0.5 % in results/benchmarks/launch-rule-simulation.txt).
CONFIDENCE_PCT = 99.0
MIN_ROUNDS = 3  # rounds a verdict needs, always: two rounds that happen to agree make a razor-thin interval
# One-sided 95 % quantiles of Student's t (two-sided 90 %) by degrees of freedom.
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}
_Z95 = 1.645
# One-sided 99.5 % quantiles of Student's t (two-sided 99 %) by degrees of freedom.
_T995 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355, 9: 3.250, 10: 3.169,
         11: 3.106, 12: 3.055, 13: 3.012, 14: 2.977, 15: 2.947, 16: 2.921, 17: 2.898, 18: 2.878, 19: 2.861,
         20: 2.845}
_Z995 = 2.576

BETTER, WORSE, UNDECIDED = "better", "worse", "undecided"


def _cornish_fisher(z: float, df: int) -> float:
    """Student's t quantile from the normal one, two terms of Cornish-Fisher's expansion (within 0.5 % for the
    df beyond the tables)."""
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t95(df: int) -> float:
    """Student's t, one-sided 95 % (two-sided 90 %)."""
    if df < 1:
        return math.inf
    return _T95.get(df) or _cornish_fisher(_Z95, df)


def t995(df: int) -> float:
    """Student's t, one-sided 99.5 % (two-sided 99 %): the verdict's quantile."""
    if df < 1:
        return math.inf
    return _T995.get(df) or _cornish_fisher(_Z995, df)


@dataclass(frozen=True, slots=True)
class Verdict:
    """``a`` against ``b``: ratio of scores (higher is better), its bound, and what that allows saying."""

    a: str
    b: str
    rounds: int
    ratio: float  # median of the per-round ratios a/b
    low: float
    high: float
    noise_pct: float  # spread of the per-round ratios (sample SD of their logs, in %): the machine's noise
    outcome: str  # better | worse | undecided
    confidence_pct: float = CONFIDENCE_PCT
    busy_rounds: int = 0  # rounds left out: measured while something else kept the machine busy

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(**d)

    def describe(self) -> str:
        busy = f"; {self.busy_rounds} rounds measured on a busy machine left out" if self.busy_rounds else ""
        if self.rounds == 0 and self.busy_rounds:
            return f"{self.a} vs {self.b}: undecided (every round was measured on a busy machine)"
        return self._describe() + (busy and f" [{busy[2:]}]")

    def interval_words(self, noun: str = "") -> str:
        """"99 % 1.43-2.16x over 3 rounds" (``noun``: "99 % interval …"); under MIN_ROUNDS rounds the bound is not
        worth reading (one degree of freedom made it 0.00-1015.76x on a Qwen3-30B-A3B race), so it is not printed."""
        if self.rounds < MIN_ROUNDS:
            return (f"over {self.rounds} round{'' if self.rounds == 1 else 's'}: too few to bound "
                    f"(a verdict needs {MIN_ROUNDS})")
        return f"{self.confidence_pct:.0f} % {noun + ' ' if noun else ''}{self.low:.2f}-{self.high:.2f}x over " \
               f"{self.rounds} rounds"

    def _describe(self) -> str:
        bound = self.interval_words("interval")
        if self.outcome == UNDECIDED:
            return (f"{self.a} vs {self.b}: undecided ({self.ratio:.2f}x, {bound}; "
                    f"this machine's round-to-round noise is {self.noise_pct:.1f} %)")
        return f"{self.a} vs {self.b}: {self.outcome} ({self.ratio:.2f}x, {bound})"


def compare_quiet(a: str, b: str, a_scores: Sequence[float | None], b_scores: Sequence[float | None],
                  a_quiet: Sequence[float | None], b_quiet: Sequence[float | None]) -> Verdict:
    """:func:`compare` on the rounds quiet for both arms (``*_quiet``: the scores with a disturbed round None),
    counting the measured rounds left out as busy. It still needs MIN_ROUNDS quiet rounds: two quiet rounds that
    happened to agree called identical configs "7.7 % apart" (measured when busy rounds were left out)."""
    pairs = zip(a_quiet, b_quiet, a_scores, b_scores, strict=False)
    busy = sum(1 for qa, qb, sa, sb in pairs if sa and sb and not (qa and qb))
    return replace(compare(a, b, a_quiet, b_quiet), busy_rounds=busy)


def compare(a: str, b: str, a_scores: Sequence[float | None], b_scores: Sequence[float | None]) -> Verdict:
    """Judge ``a`` against ``b`` from their scores per round (None: that round failed or was disturbed; the pair
    is skipped). Fewer than :data:`MIN_ROUNDS` rounds decide nothing."""
    ratios = [x / y for x, y in zip(a_scores, b_scores, strict=False) if x and y and x > 0 and y > 0]
    if not ratios:
        return Verdict(a, b, 0, math.nan, 0.0, math.inf, math.nan, UNDECIDED)
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    sd = statistics.stdev(logs) if n > 1 else math.inf
    half = t995(n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
    mean = statistics.fmean(logs)
    low, high = math.exp(mean - half) if half < math.inf else 0.0, math.exp(mean + half) if half < math.inf \
        else math.inf
    outcome = BETTER if low > 1.0 else WORSE if high < 1.0 else UNDECIDED
    if n < MIN_ROUNDS:
        outcome = UNDECIDED
    noise = 100 * sd if n > 1 else math.nan
    return Verdict(a, b, n, statistics.median(ratios), low, high, noise, outcome)


def decidable(v: Verdict, more_rounds: int) -> bool:
    """Could ``more_rounds`` more rounds decide an undecided pair, were they as noisy as its rounds so far? The
    interval's half-width shrinks with the rounds' count (Student's t and the square root); where even that narrower
    interval would still hold 1, more rounds are spent for nothing: the pair is hopeless within the budget. Too few
    rounds to know the noise: decidable. "Hopeless" needs the rounds a verdict needs (:data:`MIN_ROUNDS`): two quiet
    rounds are one degree of freedom, whose t quantile (63.7) makes any pair look hopeless (the agent run once printed
    ik's default over ik tuned, 1.34x on 2 clean rounds, that way)."""
    if v.outcome != UNDECIDED or more_rounds <= 0:
        return False
    if v.rounds < MIN_ROUNDS or not math.isfinite(v.noise_pct) or v.low <= 0 or not math.isfinite(v.high):
        return True
    center = (math.log(v.low) + math.log(v.high)) / 2
    n = v.rounds + more_rounds
    return abs(center) > t995(n - 1) * (v.noise_pct / 100) / math.sqrt(n)
