"""docs/how-it-decides.md states the decision constants the code uses, and quotes the launch-rule simulation as it
was printed: change a constant (the verdict's confidence, the selection or confirmation rounds, the quant pick's
interval) or a figure, and this fails until the page says the same."""

from __future__ import annotations

import re
from pathlib import Path

from tuner.quants import pick
from tuner.search import finish, session_stage, verdict

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "how-it-decides.md").read_text()
SIM = (REPO / "results" / "benchmarks" / "launch-rule-simulation.txt").read_text()


def _section(start: str, end: str) -> str:
    return " ".join(PAGE.split(start, 1)[1].split(end, 1)[0].split())


def test_the_finish_section_states_the_constants_of_the_code():
    text = _section("**The finish and its verdict.**", "**As measured**")
    rounds = finish.DEFAULT_ROUNDS
    assert f"{rounds.select} rounds of every arm choose the best candidate" in text
    assert f"fresh rounds — {rounds.min}, then a {rounds.max}th while undecided" in text
    assert f"with a {verdict.CONFIDENCE_PCT:.0f} % interval" in text
    assert rounds.min == verdict.MIN_ROUNDS  # a verdict needs as many rounds as the confirmation starts with


def test_the_session_and_quant_sections_state_the_constants_of_the_code():
    sessions = _section("**Agent sessions.**", "## Which trade-off")
    assert f"{session_stage.SELECT_ROUNDS} rounds of every arm select the best" in sessions
    assert f"(`--session-rounds`, {session_stage.DEFAULT_ROUNDS}, and a 4th while undecided)" in sessions
    quants = _section("## Which quant", "## Speculative decoding")
    two_sided = round(100 * (1 - 2 * 0.05))  # pick.speed_error uses verdict.t95: one-sided 95 %, two-sided 90 %
    assert f"{two_sided} % intervals" in quants and pick.Z_TWO_SIDED_90 == 1.645
    assert abs(verdict.t95(1000) - pick.Z_TWO_SIDED_90) < 0.01


def _row(noise: str, gain: str) -> list[str]:
    [line] = [x for x in SIM.splitlines() if x.startswith(noise) and f" {gain} " in x]
    return re.findall(r"\d+\.\d+%", line)


def test_the_simulation_figures_quoted_are_the_ones_printed():
    text = _section("What the rule costs", "**As measured**")
    quiet, noisy, busy = "1.7 % (quiet median)", "8.6 % (quiet max)", "30 % (busy)"
    equal = {_row(n, "1.00")[1] for n in (quiet, noisy, busy)}
    assert equal == {"0.5%"} and "non-default line in 0.5 % of runs at any noise" in text
    assert f"printed one in {_row(quiet, '1.00')[2][:-1]} %" in text
    assert f"10 % faster is printed in {_row(quiet, '1.10')[0][:-1]} %" in text
    assert f"20 % faster in {_row(quiet, '1.20')[0][:-1]} %" in text
    assert f"a 20 % gain is printed in only {_row(noisy, '1.20')[0][:-1]} %" in text
    assert f"a 2x gain in {_row(busy, '2.00')[0][:-1]} %" in text
