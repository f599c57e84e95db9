"""How often does the finish print a candidate's line, by the candidate's true gain and the machine's noise? A
simulation of the launch-line rule (selection, then 3-then-4 fresh confirmation rounds at 99 %), driven by the
finish's own code (tuner.search.finish.two_phase_finish) on independent lognormal round scores, beside the rule it
replaced (the best median of every round wins). Not a measurement: no engine runs.

    .venv/bin/python scripts/sim_launch_rule.py [--runs 2000] [--arms 5]

Prints one row per (noise, gain): the share of runs that printed the faster candidate, and the share that printed
any non-default line; the gain 1.00 rows are the false positives (every arm equal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.search.test_launch_rule import lognormal, simulate  # noqa: E402

NOISE_SD = {"1.7 % (quiet median)": 0.017, "8.6 % (quiet max)": 0.086, "30 % (busy)": 0.30}
GAINS = (1.00, 1.05, 1.10, 1.20, 1.50, 2.00)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--arms", type=int, default=5, help="default, fit and N-2 candidates")
    args = ap.parse_args()
    labels = ["default", "fit", *(f"candidate-{i + 1}" for i in range(args.arms - 2))]
    print(f"command: .venv/bin/python scripts/sim_launch_rule.py --runs {args.runs} --arms {args.arms}")
    print(f"arms: {', '.join(labels)}; the last candidate is the faster one; every other arm equal")
    print(f"{'noise per round':<22} {'gain':>5} {'rule: printed faster':>21} {'rule: not default':>18} "
          f"{'best median: not default':>25} {'arm-rounds':>11}")
    for name, sd in NOISE_SD.items():
        for gain in GAINS:
            true = {**dict.fromkeys(labels, 1.0), labels[-1]: gain}
            faster = other = best_median = measured = 0
            for seed in range(args.runs):
                fin, n = simulate(true, lognormal(sd), seed)
                measured += n
                w = fin.winner
                faster += w is not None and w.label == labels[-1]
                other += w is not None and w.label != "default"
                pool = [m for m in (*fin.candidates, *fin.baselines) if fin.score(m) is not None]
                best_median += max(pool, key=lambda m: fin.score(m) or 0.0).label != "default"
            pct = 100 / args.runs
            print(f"{name:<22} {gain:>5.2f} {faster * pct:>20.1f}% {other * pct:>17.1f}% {best_median * pct:>24.1f}% "
                  f"{measured / args.runs:>11.1f}")


if __name__ == "__main__":
    main()
