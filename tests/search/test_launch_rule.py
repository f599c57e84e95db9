"""The launch-line rule, end to end on simulated rounds: selection among k arms, the 3-then-4-round confirmation and
the printed line, driven by the finish's own code (:func:`tuner.search.finish.two_phase_finish`), with each round's
score drawn independently, as noisy as this machine's rounds are.

Noise: the per-round scores of one config on this 2-core machine spread by a CV of 1.7 % (median) to 8.6 % (max)
on quiet cores (results/benchmarks/frontier-demo-chat.md, 110 configs), and by 16.7-48.7 % beside other load (the
README's session: CV % of three arms measured with --allow-busy). The cases below span that, plus a burst model
(one round in ten at half speed) for the heavy tail a compile or a browser leaves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from tuner.search import decide, finish
from tuner.search.finish import Finish, ServerMeasurement

pytestmark = pytest.mark.fast

RUNS = 1500
LABELS = ["default", "fit", "candidate-1", "candidate-2", "candidate-3"]


def _arm(label: str, scores: list[float | None], kld: float | None) -> ServerMeasurement:
    ok = [s for s in scores if s is not None]
    return ServerMeasurement(label, {"model": "m.gguf", "arm": label}, f"llama-server # {label}", [],
                             max(ok) if ok else None, [], None, None, None, None, scores=scores, kld_mean=kld)


def simulate(true: dict[str, float], draw: Callable[[random.Random], float], seed: int,
             rounds: finish.Rounds = finish.DEFAULT_ROUNDS, kld: dict[str, float] | None = None) -> tuple[Finish, int]:
    """One finish on simulated rounds; returns it and the number of arm-rounds measured."""
    rng = random.Random(seed)
    scores: dict[str, dict[str, list[float | None]]] = {finish.SELECT: {}, finish.CONFIRM: {}}
    measured = [0]

    def measure(label: str, _r: int, phase: str) -> decide.Obs:
        s = true[label] * draw(rng)
        scores[phase].setdefault(label, []).append(s)
        measured[0] += 1
        return s, None

    def table(phase: str) -> Finish:
        arms = [_arm(x, scores[phase][x], (kld or {}).get(x)) for x in true if x in scores[phase]]
        return Finish(tuple(a for a in arms if a.label.startswith("candidate")),
                      tuple(a for a in arms if not a.label.startswith("candidate")), prompt_tokens=512,
                      gen_tokens=128)

    return finish.two_phase_finish(list(true), measure, table, rounds), measured[0]


def lognormal(sd: float) -> Callable[[random.Random], float]:
    return lambda rng: math.exp(rng.gauss(0.0, sd))


def bursty(sd: float) -> Callable[[random.Random], float]:
    return lambda rng: math.exp(rng.gauss(0.0, sd)) * (0.5 if rng.random() < 0.1 else 1.0)


NOISE = {"quiet 1.7 %": lognormal(0.017), "quiet max 8.6 %": lognormal(0.086), "busy 30 %": lognormal(0.30),
         "bursts": bursty(0.03)}


# The A/A bound: with every arm equal the rule printed a non-default line in 0.5 % of runs at every noise
# (results/benchmarks/launch-rule-simulation.txt, 2,000 runs; 8 of these 1,500 seeded runs). 1 % holds that with
# room (about 3 standard deviations of a 0.5 % rate over 1,500 runs) and fails a 95 % interval in place of the 99 %
# one (39 of 1,500 at lognormal noise, 22 with bursts: seen).
A_A_BOUND = 0.01


@pytest.mark.parametrize("noise", list(NOISE))
def test_equal_configs_print_llama_cpps_own_line_in_at_least_99_percent_of_runs(noise):
    equal = dict.fromkeys(LABELS, 1.0)
    printed = [simulate(equal, NOISE[noise], seed)[0].winner for seed in range(RUNS)]
    assert all(w is not None for w in printed)
    not_default = sum(w.label != "default" for w in printed)
    assert not_default <= A_A_BOUND * RUNS, f"{noise}: a non-default line printed in {not_default} of {RUNS} runs"


def test_best_median_wins_would_fail_the_same_test():
    """The rule the issue names as wrong, on the same simulated runs: the best median among the table's arms."""
    equal = dict.fromkeys(LABELS, 1.0)
    best_median = 0
    for seed in range(RUNS // 5):
        fin, _ = simulate(equal, NOISE["quiet max 8.6 %"], seed)
        pool = [m for m in (*fin.candidates, *fin.baselines) if fin.score(m) is not None]
        best_median += max(pool, key=lambda m: fin.score(m) or 0.0).label != "default"
    assert best_median > 0.5 * RUNS // 5  # about 4 in 5 with five equal arms: far above the 1 % the rule allows


def test_a_candidate_decided_faster_is_printed_and_judged_on_fresh_rounds():
    # 15 % faster on quiet cores (1.7 % per-round noise): decided in 3-4 confirmation rounds nearly always.
    true = {**dict.fromkeys(LABELS, 1.0), "candidate-2": 1.15}
    runs = [simulate(true, NOISE["quiet 1.7 %"], seed) for seed in range(300)]
    printed = [fin.winner.label for fin, _ in runs if fin.winner]
    assert printed.count("candidate-2") >= 0.95 * len(runs), printed.count("candidate-2")
    fin, n = runs[0]
    # Selection: 2 rounds of 5 arms; confirmation: fresh rounds of the two baselines and the selected candidate.
    assert fin.selected == "candidate-2"
    assert [m.label for m in fin.confirmation] == ["default", "fit", "candidate-2"]
    assert all(len(m.scores) == 2 for m in (*fin.candidates, *fin.baselines))
    assert all(len(m.scores) in (3, 4) for m in fin.confirmation) and n == 10 + 3 * len(fin.confirmation[0].scores)
    d = fin.decision
    assert d.taken and d.verdicts[0].a == "candidate-2" and d.verdicts[0].b == "default"
    assert d.verdicts[0].rounds == len(fin.confirmation[0].scores)  # judged on the confirmation rounds alone


def test_undecided_prints_the_default_and_names_the_best_candidate():
    true = {**dict.fromkeys(LABELS, 1.0), "candidate-1": 1.03}
    fin, _ = simulate(true, NOISE["busy 30 %"], 7)
    d = fin.decision
    assert d.shipped is not None and d.shipped.label == "default" and not d.taken
    assert d.best is not None and d.best.label.startswith("candidate")
    assert f"{d.best.label} was the best candidate but" in d.reason and "llama.cpp's own choice is printed" in d.reason
    assert Finish.from_dict(fin.to_dict()).decision.reason == d.reason  # rebuilt from the stored result alone


def test_a_lossy_candidate_must_also_beat_the_lossless_one_beside_it():
    true = {"default": 1.0, "candidate-1": 1.30, "candidate-2": 1.30}
    kld = {"candidate-1": 0.004}  # candidate-1: q8_0 KV, as fast as candidate-2 with f16 KV
    printed = [simulate(true, NOISE["quiet 1.7 %"], seed, kld=kld)[0] for seed in range(200)]
    confirmed = {tuple(m.label for m in fin.confirmation) for fin in printed if fin.selected == "candidate-1"}
    assert confirmed == {("default", "candidate-1", "candidate-2")}
    assert sum(fin.winner.label == "candidate-1" for fin in printed) <= 10  # not shown faster than the lossless one
    assert sum(fin.winner.label == "candidate-2" for fin in printed) >= 190
