"""Choosing the winner among re-measured configs: fastest, unless a baseline is as fast within the noise."""

from __future__ import annotations

from tuner.report import study_report
from tuner.search.finish import Finish, ServerMeasurement


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
    assert [m.label for m in study_report.ranked(result)] == ["default", "candidate-1", "candidate-2"]


def test_between_candidates_inside_the_noise_the_simpler_launch_line_wins():
    plain = ServerMeasurement("candidate-1", {}, "llama-server -m m.gguf -t 2 -fa on", [], 1131.6, [], 1.1,
                              None, None, None)
    fancy = ServerMeasurement("candidate-2", {}, "llama-server -m m.gguf -ctk q4_1 -ctv q8_0 -t 2 -fa on", [],
                              1140.4, [], 2.9, None, None, None)
    fin = Finish((fancy, plain), (_m("default", 1011.0, 2.1),))
    assert fin.winner is plain


def test_with_the_workload_known_a_config_cannot_win_on_tg_while_losing_more_on_pp():
    default = ServerMeasurement("default", {}, "llama-server -m m.gguf", [], 1137.0, [], 1.4, 6400.0, None, None)
    kv_q5 = ServerMeasurement("candidate-1", {}, "llama-server -m m.gguf -ctk q5_0", [], 1194.0, [], 0.9, 3892.0,
                              None, None)
    by_gen = Finish((kv_q5,), (default,))
    assert by_gen.winner is kv_q5 and by_gen.metric == "generation tok/s"
    by_request = Finish((kv_q5,), (default,), prompt_tokens=512, gen_tokens=128)
    assert by_request.winner is default  # 512/6400 + 128/1137 = 0.193 s beats 0.239 s
    assert by_request.speedup("default") == 1.0
    assert Finish.from_dict(by_request.to_dict()).metric.startswith("end-to-end request time (P=512")
