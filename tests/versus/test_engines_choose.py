"""Which engine's line is printed: another engine's only when fresh rounds decided it faster than every other line,
llama.cpp's default among them; otherwise llama.cpp's own choice. And a line for an engine whose numerics differ from
llama.cpp's by more than the quality floor is not judged at all."""

from __future__ import annotations

from pathlib import Path

from tuner.core.config import LaunchConfig
from tuner.search.verdict import BETTER, UNDECIDED, Verdict
from tuner.versus import judge
from tuner.versus.engines import REFERENCE, EngineLine, choose

M = Path("/m.gguf")


def _line(label: str, engine: str, kld: float | None = None) -> EngineLine:
    return EngineLine(label, engine, LaunchConfig(model=M, engine=engine), "s", Path("r"), Path("b"), kld=kld)


LINES = [_line("llama.cpp tuned", "llama.cpp"), _line(REFERENCE, "llama.cpp"),
         _line("ik_llama.cpp tuned", "ik_llama.cpp")]


def _versus(selected: str, outcomes: dict[str, str]) -> judge.HeadToHead:
    rounds = (judge.Round(1.0), judge.Round(1.0), judge.Round(1.0))
    arms = tuple(judge.Arm(x.label, "", rounds) for x in LINES)
    verdicts = tuple(Verdict(selected, b, 3, 1.2, 1.1, 1.3, 2.0, o) for b, o in outcomes.items())
    return judge.HeadToHead(arms, "end-to-end request time", verdicts, selected)


def test_another_engine_decided_faster_than_every_line_is_printed():
    v = _versus("ik_llama.cpp tuned", {"llama.cpp tuned": BETTER, REFERENCE: BETTER})
    printed, why = choose(LINES, v)
    assert printed == "ik_llama.cpp tuned" and "decided faster than every other line" in why


def test_undecided_against_one_line_keeps_llama_cpp_s_own_choice():
    v = _versus("ik_llama.cpp tuned", {"llama.cpp tuned": UNDECIDED, REFERENCE: BETTER})
    printed, why = choose(LINES, v)
    assert printed == "llama.cpp tuned"
    assert "faster than llama.cpp default only" in why and "llama.cpp's own choice, llama.cpp tuned, is printed" in why


def test_without_a_head_to_head_llama_cpp_s_own_choice_stays():
    assert choose(LINES, None)[0] == "llama.cpp tuned"
    assert choose([LINES[1], LINES[2]], None)[0] == REFERENCE


def test_an_engine_over_the_quality_floor_is_not_judged(tmp_path, monkeypatch):
    from tuner.versus import engines

    over = [_line(REFERENCE, "llama.cpp"), _line("ik_llama.cpp tuned", "ik_llama.cpp", kld=0.05)]
    said: list[str] = []
    monkeypatch.setattr(engines, "lines_of", lambda tunes: over)  # the lines, as two engines' tunes printed them
    choice = engines.decide([], load=None, log_dir=tmp_path, max_kld=0.01, on_step=said.append)  # type: ignore
    assert choice.versus is None and choice.printed == REFERENCE
    assert choice.refused == ("ik_llama.cpp: its logits differ from llama.cpp's by a mean KLD of 0.05, above the "
                              "quality floor 0.01 (--max-kld): its lines are not judged",)
    assert said == list(choice.refused)
