"""Verdicts from interleaved rounds: the ratio's confidence bound, and a deliberately noisy arm on the real engine."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from tuner.core.config import LaunchConfig
from tuner.measure.workload import Workload, WorkloadKind
from tuner.search import finish, verdict
from tuner.search.verdict import BETTER, UNDECIDED, Verdict


def test_t_quantiles_and_the_interval():
    assert verdict.t95(1) == 6.314 and verdict.t95(10) == 1.812
    assert verdict.t95(30) == pytest.approx(1.697, abs=0.002) and verdict.t95(0) == math.inf
    # The verdict's two-sided 99 % quantiles (published t tables), beyond the table within 0.5 %.
    assert verdict.t995(2) == 9.925 and verdict.t995(20) == 2.845 and verdict.t995(0) == math.inf
    assert verdict.t995(30) == pytest.approx(2.750, rel=0.005) and verdict.t995(60) == pytest.approx(2.660, rel=0.005)
    v = verdict.compare("a", "b", [2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 1.0])
    # log-ratios: mean 0.69252, SD 0.040865; half width t995(3) * SD / 2 = 0.11935
    assert v.outcome == "better" and v.ratio == pytest.approx(2.0) and v.confidence_pct == 99.0
    assert v.low == pytest.approx(math.exp(0.69252 - 0.11935), rel=1e-4)
    assert v.high == pytest.approx(math.exp(0.69252 + 0.11935), rel=1e-4)
    assert verdict.compare("b", "a", [1.0] * 4, [2.0, 2.1, 1.9, 2.0]).outcome == "worse"
    one = verdict.compare("a", "b", [3.0], [1.0])
    assert one.outcome == "undecided" and one.rounds == 1  # one round says nothing about the noise
    skipped = verdict.compare("a", "b", [2.0, None, 2.0], [1.0, 1.0, None])
    assert skipped.rounds == 1


def _m(label: str, scores: list[float | None]) -> finish.ServerMeasurement:
    ok = [x for x in scores if x is not None]
    return finish.ServerMeasurement(label, {"model": "m.gguf"}, f"llama-server -m m.gguf # {label}", [],
                                    max(ok) if ok else None, [], None, None, None, None, scores=scores)


def test_a_verdict_always_needs_three_rounds():
    """Two rounds that happen to agree make a razor-thin interval: never a verdict, disturbed rounds or not."""
    two = verdict.compare("a", "b", [1.10, 1.101], [1.0, 1.0])
    assert two.rounds == 2 and two.low > 1.0 and two.outcome == "undecided"
    three = verdict.compare("a", "b", [1.10, 1.101, 1.099], [1.0, 1.0, 1.0])
    assert three.rounds == 3 and three.outcome == "better"
    # The finish's verdict on two quiet rounds of three (one left out as disturbed) is undecided too, and on
    # three quiet rounds it decides.
    fast = _m("candidate-1", [1.10, 1.101, 1.099])
    slow = _m("default", [1.0, 1.0, 1.0])
    done = finish.Finish((fast,), (slow,), 16, 16)
    assert done.verdict(fast, slow).outcome == "better"
    disturbed = replace(fast, interference=[None, "2 other processes", None])
    v = done.verdict(disturbed, slow)
    assert v.rounds == 2 and v.busy_rounds == 1 and v.outcome == "undecided"
    quiet = replace(fast, scores=[*fast.scores[:2], None, 1.102], interference=[])
    assert done.verdict(quiet, replace(slow, scores=[1.0] * 4)).outcome == "better"
    assert verdict.Verdict.from_dict(v.to_dict()) == v


def test_an_interval_from_too_few_rounds_is_not_printed():
    """Two rounds 1.69x and 2.06x apart (a Qwen3-30B-A3B race here) bound the ratio at 0.00-1015.76x: noise, said as
    too few rounds; three rounds print their bound."""
    two = verdict.compare("ik", "llama", [1 / 24.1, 1 / 24.7], [1 / 40.7, 1 / 50.8])
    assert two.high > 100 and two.interval_words() == "over 2 rounds: too few to bound (a verdict needs 3)"
    assert "0.00" not in two.describe() and "too few to bound" in two.describe()
    three = verdict.compare("a", "b", [1.10, 1.101, 1.099], [1.0, 1.0, 1.0])
    # log SD 0.000909, half width t995(2) 9.925 x SD / sqrt(3) = 0.0052: 1.1 x exp(-+0.0052) = 1.094-1.106
    assert three.interval_words() == "99 % 1.09-1.11x over 3 rounds"
    assert three.describe() == "a vs b: better (1.10x, 99 % interval 1.09-1.11x over 3 rounds)"


def _hog() -> list[subprocess.Popen[bytes]]:
    """Two busy processes: on this two-core machine they halve whatever runs beside them."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    time.sleep(0.3)  # running before the server starts
    return hogs


@pytest.mark.slow
def test_a_noisy_arm_is_measured_again_and_left_undecided(engine_loc, demo_models, tmp_path):
    """The same config twice; a CPU hog runs while 'candidate-1' is measured in rounds 1 and 3. The true ratio is
    1.0: the finish must measure again or end undecided, naming the noise, rather than call a tie for the default."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    cfg = LaunchConfig(model=model, ctx=512, parallel=1, threads=2)
    load = Workload(WorkloadKind.CUSTOM, 128, 96, rounds=2)
    hogs: list[subprocess.Popen[bytes]] = []
    rounds_seen: set[int] = set()

    def on_step(msg: str) -> None:
        while hogs:  # a hog only ever runs during one measurement
            p = hogs.pop()
            p.kill()
            p.wait()
        r = int(msg.split(":")[0].split()[1])
        rounds_seen.add(r)
        if "candidate-1" in msg and r in (1, 3):
            hogs.extend(_hog())

    try:
        done = finish.finish(engine_loc, [(0, cfg)], [("default", cfg)], load, log_dir=tmp_path,
                             rounds=finish.Rounds(min=3, max=4), on_step=on_step)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    [cand], [default] = done.candidates, done.baselines
    assert all(x is not None for x in (*cand.scores, *default.scores))
    [v] = done.verdicts
    # Measured again (a fourth round) or left undecided: the spread of the hogged arm cannot be turned into a tie.
    assert len(cand.scores) == 4 or v.outcome == "undecided", v
    assert rounds_seen == set(range(1, len(cand.scores) + 1))
    # The candidate is printed only when decided faster, which the hog (slowing the candidate) cannot cause ...
    assert done.winner is default and not done.decision.taken
    # ... and a decided verdict can only be the hog's doing (it never slows the quiet arm).
    if v.outcome != "undecided":
        loser = v.b if v.outcome == "better" else v.a
        assert loser == "candidate-1", v
    elif v.busy_rounds:
        # The hog was seen: its rounds were left out as measured on a busy machine, and the quiet rounds alone
        # cannot tell the same config from itself.
        assert "busy machine left out" in v.describe() or "every round was measured on a busy machine" in v.describe()
    else:
        assert v.noise_pct > 5 and "noise" in v.describe()


def test_an_undecided_pair_is_hopeless_when_the_rounds_left_cannot_narrow_its_interval_past_one():
    from tuner.search.verdict import decidable

    # A 1.105x median ratio (log 0.1 at the interval's centre) over 4 rounds at 10 % round-to-round noise. After n
    # rounds the 99 % half-width is t995(n-1) * 0.1 / sqrt(n): at 10 rounds 3.250 * 0.1 / 3.162 = 0.1028 (still holds
    # 1), at 11 rounds 3.169 * 0.1 / 3.317 = 0.0955 (excludes it). Figures from Student's t table.
    half4 = 5.841 * 0.1 / 2
    v = Verdict("a", "b", 4, 1.105, math.exp(0.1 - half4), math.exp(0.1 + half4), 10.0, UNDECIDED)
    assert not decidable(v, 6)
    assert decidable(v, 7)
    assert not decidable(replace(v, outcome=BETTER), 7)  # decided already: nothing to spend rounds on
    assert decidable(replace(v, rounds=1, noise_pct=math.nan), 1)  # too few rounds to know the noise
