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
        r = int(msg.split(":")[0].removeprefix("round "))
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
    # No tie-break toward the baseline: the winner is the arm with the better median score ...
    assert done.winner is max((cand, default), key=lambda m: done.score(m) or 0.0)
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


AA_ROUNDS = 24  # interleaved rounds of the same config against itself (48 server launches, ~1-2 min here)


@pytest.mark.slow
def test_a_config_against_itself_is_undecided_in_95_percent_of_finishes(engine_loc, demo_models, tmp_path):
    """The A/A test: one config as both arms of the finish, measured on the real engine as the finish does
    (interleaved rounds, a fresh llama-server each, the machine watched). Every 3-round and every 4-round
    stretch of those rounds is one finish of the default length (Rounds(3, 4)); the finish's verdict on each
    must be "undecided" at least 95 times in 100: noise alone must not name a winner."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    cfg = LaunchConfig(model=model, ctx=512, parallel=1, threads=2)
    load = Workload(WorkloadKind.CUSTOM, 32, 16, rounds=1)
    done = finish.finish(engine_loc, [(0, cfg)], [("default", cfg)], load, log_dir=tmp_path,
                         rounds=finish.Rounds(min=AA_ROUNDS, max=AA_ROUNDS))
    [a], [b] = done.candidates, done.baselines
    assert len(a.scores) == len(b.scores) == AA_ROUNDS and all(a.scores) and all(b.scores)

    def stretch(m: finish.ServerMeasurement, start: int, n: int) -> finish.ServerMeasurement:
        return replace(m, scores=m.scores[start:start + n], interference=m.interference[start:start + n])

    verdicts = [done.verdict(stretch(a, i, n), stretch(b, i, n))
                for n in (3, 4) for i in range(AA_ROUNDS - n + 1)]
    decided = [v for v in verdicts if v.outcome != verdict.UNDECIDED]
    assert len(verdicts) == 2 * AA_ROUNDS - 5
    assert len(decided) <= 0.05 * len(verdicts), [v.describe() for v in decided]
    # Not vacuous: most stretches were judged on three quiet rounds or more (a round measured while the machine
    # was busy is left out and decides nothing), and the noise they saw is the machine's, not zero.
    judged = [v for v in verdicts if v.rounds >= verdict.MIN_ROUNDS]
    assert len(judged) >= 0.8 * len(verdicts) and all(v.noise_pct > 0 for v in judged)
