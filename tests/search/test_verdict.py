"""Verdicts from interleaved rounds: the ratio's confidence bound, and a deliberately noisy arm on the real engine."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from tuner.core.config import LaunchConfig
from tuner.measure.workload import Workload, WorkloadKind
from tuner.search import finish, verdict


def test_t_quantiles_and_the_interval():
    assert verdict.t95(1) == 6.314 and verdict.t95(10) == 1.812
    assert verdict.t95(30) == pytest.approx(1.697, abs=0.01) and verdict.t95(0) == math.inf
    v = verdict.compare("a", "b", [2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert v.outcome == "better" and v.ratio == pytest.approx(2.0) and 1.8 < v.low < 2.0 < v.high < 2.2
    assert verdict.compare("b", "a", [1.0] * 4, [2.0, 2.1, 1.9, 2.0]).outcome == "worse"
    one = verdict.compare("a", "b", [3.0], [1.0])
    assert one.outcome == "undecided" and one.rounds == 1  # one round says nothing about the noise
    skipped = verdict.compare("a", "b", [2.0, None, 2.0], [1.0, 1.0, None])
    assert skipped.rounds == 1
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
