"""How many rounds a lease's tuned-vs-default comparison needs: the chance that the project's own verdict
(tuner.search.verdict.compare: per-round ratios, a 99 % t interval on their logs, at least MIN_ROUNDS rounds)
calls a line that is truly ``gain`` times faster "better", when each round's ratio scatters by ``sigma`` (the SD of
the per-round log ratio, what the verdict names the machine's noise). Not a measurement: no engine runs.

Lease 2's per-round spreads (results/benchmarks/gpu-lease-2; DESIGN.md §15): 0.9 % at 12 GiB chat, 1.2 % at 8 GiB,
2.5 % at 24 GiB, 12.1 % on the agent's cold 4K prompt, 15.4 % at 16 GiB (one busy round). The issue's target:
P >= 0.9 at a gain of 1.14x and sigma 4 %.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tuner.search.verdict import BETTER, compare

LEASE2_SPREADS_PCT = {"12 GiB chat": 0.9, "8 GiB chat": 1.2, "24 GiB chat": 2.5, "target": 4.0, "agent (cold 4K)": 12.1,
                      "16 GiB chat": 15.4}
TARGET_GAIN = 1.14
TARGET_SIGMA = 0.04
TARGET_POWER = 0.9


@dataclass(frozen=True, slots=True)
class Power:
    rounds: int
    gain: float
    sigma: float
    p_better: float  # the verdict says "better"
    p_worse: float  # the verdict says "worse" (the wrong way when gain > 1)
    sims: int


def power(rounds: int, gain: float, sigma: float, *, sims: int = 4000, seed: int = 0) -> Power:
    """Simulate ``sims`` comparisons of ``rounds`` interleaved rounds; each round's candidate/default ratio is
    lognormal around ``gain`` with log-SD ``sigma`` (the pair's own noise, as the verdict estimates it)."""
    rng = random.Random(seed)
    better = worse = 0
    for _ in range(sims):
        cand = [gain * math.exp(rng.gauss(0.0, sigma)) for _ in range(rounds)]
        verdict = compare("candidate", "default", cand, [1.0] * rounds)
        better += verdict.outcome == BETTER
        worse += verdict.outcome == "worse"
    return Power(rounds, gain, sigma, better / sims, worse / sims, sims)


def rounds_for(gain: float = TARGET_GAIN, sigma: float = TARGET_SIGMA, target: float = TARGET_POWER, *,
               most: int = 20, sims: int = 4000) -> int:
    """The fewest rounds whose simulated power reaches ``target``."""
    for n in range(3, most + 1):
        if power(n, gain, sigma, sims=sims).p_better >= target:
            return n
    return most
