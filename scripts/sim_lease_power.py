"""How many interleaved rounds a GPU lease needs to decide "the tuned line is faster than llama.cpp's default", and
whether they fit the lease. A simulation of the project's own verdict (tuner.search.verdict.compare, 99 %), fed
with lease 2's per-round spreads; then the lease's time plan per design (a server start per arm and round, as
lease 2 ran, or both servers loaded once, as scripts/gpucheck/versus.py runs). Not a measurement: no engine runs.

    .venv/bin/python scripts/sim_lease_power.py [--sims 4000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from gpucheck import estimates as est  # noqa: E402
from gpucheck import power  # noqa: E402
from gpucheck import versus as gpu_versus  # noqa: E402

ROUNDS = range(3, 11)
GAINS = (1.0, 1.05, 1.14, 1.25)
# Lease 2's measured server lives per round, the arm's whole start-to-stop (logs.tgz, the servers' own clocks).
RESTART_ROUND_S = {"chat": 10.7, "agent": 23.1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sims", type=int, default=4000)
    args = ap.parse_args()
    t0 = time.monotonic()
    print(f"command: .venv/bin/python scripts/sim_lease_power.py --sims {args.sims}")
    print(f"verdict: tuner.search.verdict.compare (99 % two-sided t interval on per-round log ratios, at least 3 "
          f"rounds); {args.sims} simulated comparisons per cell, lognormal per-round ratios\n")
    print(f"P(verdict 'better') at a true gain of {power.TARGET_GAIN}x, by rounds (rows) and per-round spread "
          "(columns: lease 2's measured spreads, and the target 4 %)")
    spreads = power.LEASE2_SPREADS_PCT
    print(f"{'rounds':>6} " + " ".join(f"{name + f' {pct}%':>22}" for name, pct in spreads.items()))
    for n in ROUNDS:
        cells = [power.power(n, power.TARGET_GAIN, pct / 100, sims=args.sims).p_better for pct in spreads.values()]
        print(f"{n:>6} " + " ".join(f"{p:>22.3f}" for p in cells))
    print(f"\nat sigma {100 * power.TARGET_SIGMA:.0f} %, by gain (1.00: an equal pair called faster or slower, the "
          "verdict's error rate)")
    print(f"{'rounds':>6} " + " ".join(f"{'gain ' + format(g, '.2f') + ' better':>18}" for g in GAINS)
          + f" {'gain 1.00 worse':>16}")
    for n in ROUNDS:
        cells = [power.power(n, g, power.TARGET_SIGMA, sims=args.sims) for g in GAINS]
        print(f"{n:>6} " + " ".join(f"{c.p_better:>18.3f}" for c in cells) + f" {cells[0].p_worse:>16.3f}")
    need = power.rounds_for(sims=args.sims)
    print(f"\nfewest rounds for P >= {power.TARGET_POWER} at {power.TARGET_GAIN}x and sigma "
          f"{100 * power.TARGET_SIGMA:.0f} %: {need}; the lease runs 6 (P above), each step stopping between rounds "
          "at its command's limit")
    print("\ntime per comparison (estimates for 16 cores from lease 2, scripts/gpucheck/estimates.py): a server start "
          "per arm and round (lease 2's way) vs both servers loaded once (versus.py: two loads, a warm-up each)")
    print(f"{'run':>12} {'rounds':>6} {'restart per round s':>20} {'both loaded s':>14}")
    for budget, kind in ((12, "agent"), (8, "agent"), (16, "agent"), (12, "chat")):
        for n in (need, 6):
            live = est.versus_s(budget, kind, n, turns=gpu_versus.TURNS, turn_tokens=gpu_versus.TURN_TOKENS,
                                gen_tokens=gpu_versus.AGENT_GEN_TOKENS)
            one = (live - 2 * est.LOAD_S) / (2 * (n + 1))  # one session (or request) of one arm
            restart = 2 * n * max(RESTART_ROUND_S[kind], est.LOAD_S + one)
            print(f"{f'{budget} GiB {kind}':>12} {n:>6} {restart:>20.0f} {live:>14.0f}")
    print(f"\n({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
