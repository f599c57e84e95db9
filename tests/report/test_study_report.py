"""`launch-line --rank k` after a finish with confirmation rounds: every measured line once, the printed one first,
then the others in the order of the score the finish selects by (not by generation speed alone).

The finish is the finish's own code (:func:`tuner.search.finish.two_phase_finish`) on simulated rounds: two
selection rounds over five arms, then the baselines and the selected candidate in fresh rounds. The true speeds
are chosen so that the selected candidate cannot be decided faster than the default (0.5 % apart, 2 % noise): the
default's confirmation copy is printed, and its selection copy is the one that used to come back at rank 3.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tuner.core.config import LaunchConfig
from tuner.engine import flags
from tuner.report import study_report
from tuner.search import decide, finish
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.result import StudyResult, write_result
from tuner.search.trials import config_to_dict

pytestmark = pytest.mark.fast

MODEL = Path("/models/m.gguf")
BASE = LaunchConfig(model=MODEL, ctx=4096, parallel=1)
# Each arm's config; fit's placement is candidate-2's (a candidate that is the --fit seed): one line, two arms.
CONFIGS = {"default": BASE, "fit": replace(BASE, ubatch=256), "candidate-1": replace(BASE, ubatch=1024),
           "candidate-2": replace(BASE, ubatch=256), "candidate-3": replace(BASE, ubatch=64)}
# The workload's score per arm (requests per second); candidate-3 generates fastest but loses on prompts.
TRUE = {"default": 1.0, "fit": 0.7, "candidate-1": 1.005, "candidate-2": 0.9, "candidate-3": 0.5}
GEN_TOK_S = {"default": 40.0, "fit": 30.0, "candidate-1": 41.0, "candidate-2": 35.0, "candidate-3": 90.0}


def _finish(seed: int) -> Finish:
    rng = random.Random(seed)
    scores: dict[str, dict[str, list[float | None]]] = {finish.SELECT: {}, finish.CONFIRM: {}}

    def measure(label: str, _r: int, phase: str) -> decide.Obs:
        s = TRUE[label] * math.exp(rng.gauss(0.0, 0.02))
        scores[phase].setdefault(label, []).append(s)
        return s, None

    def table(phase: str) -> Finish:
        arms = [ServerMeasurement(x, config_to_dict(CONFIGS[x]), flags.launch_line(CONFIGS[x]), [],
                                  GEN_TOK_S[x], [], None, None, None, None, scores=scores[phase][x])
                for x in TRUE if x in scores[phase]]
        return Finish(tuple(a for a in arms if a.label.startswith("candidate")),
                      tuple(a for a in arms if not a.label.startswith("candidate")), prompt_tokens=512,
                      gen_tokens=128)

    return finish.two_phase_finish(list(TRUE), measure, table, finish.DEFAULT_ROUNDS)


def test_each_measured_line_once_in_the_finish_score_order(tmp_path):
    fin = _finish(seed=7)
    assert fin.confirmation and fin.selected == "candidate-1"  # selection, then confirmation rounds
    assert fin.winner is not None and fin.winner.label == "default" and not fin.decision.taken
    result = StudyResult(study="s", model=str(MODEL), finish=fin)
    ranked = study_report.ranked(result)
    # fit runs candidate-2's line and scored lower: it is that line, listed once, as candidate-2.
    assert [m.label for m in ranked] == ["default", "candidate-1", "candidate-2", "candidate-3"]
    assert ranked[0] is fin.winner  # the printed line with the figures of the rounds that decided it
    assert len({m.launch_line for m in ranked}) == len(ranked)

    write_result(result, tmp_path)
    lines = [run_cli("launch-line", str(tmp_path), "--rank", str(k)) for k in range(1, 5)]
    assert [r.returncode for r in lines] == [0, 0, 0, 0], [r.stderr for r in lines]
    ubatch = [re.search(r"-ub (\d+)", r.stdout) for r in lines]
    assert [u.group(1) if u else None for u in ubatch] == [None, "1024", "256", "64"]
    beyond = run_cli("launch-line", str(tmp_path), "--rank", "5")
    assert beyond.returncode == 1 and "this result has 4 measured configs" in beyond.stderr
