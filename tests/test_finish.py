"""Choosing the winner among re-measured configs: fastest, unless a baseline is as fast within the noise."""

from __future__ import annotations

from tuner import report
from tuner.finish import Finish, ServerMeasurement


def _m(label: str, gen: float | None, cv: float | None) -> ServerMeasurement:
    return ServerMeasurement(label, {"model": "m.gguf"}, f"llama-server -m m.gguf # {label}", [], gen, [], cv,
                             None, None, None)


def test_clear_win_goes_to_the_candidate():
    fin = Finish((_m("candidate-1", 150.0, 2.0), _m("candidate-2", 120.0, 2.0)), (_m("default", 100.0, 3.0),))
    assert fin.winner is not None and fin.winner.label == "candidate-1"
    assert fin.speedup("default") == 1.5


def test_a_gain_inside_the_noise_keeps_llama_cpps_default():
    fin = Finish((_m("candidate-1", 104.0, 5.0),), (_m("default", 100.0, 3.0), _m("fit", 101.0, 1.0)))
    assert fin.winner is not None and fin.winner.label == "default"
    assert fin.speedup("default") == 1.0


def test_a_faster_baseline_wins_and_failures_never_do():
    fin = Finish((_m("candidate-1", None, None), _m("candidate-2", 90.0, 1.0)), (_m("default", 100.0, 1.0),))
    assert fin.winner is not None and fin.winner.label == "default"
    assert Finish((_m("candidate-1", None, None),), ()).winner is None


def test_launch_line_rank_one_is_the_winner():
    fin = Finish((_m("candidate-1", 104.0, 5.0), _m("candidate-2", 80.0, 1.0)), (_m("default", 100.0, 3.0),))
    result = {"finish": fin.to_dict()}
    assert [m.label for m in report.ranked(result)] == ["default", "candidate-1", "candidate-2"]
