"""The engines' run's clock (tuner.versus.clock): what is left, learned from what was measured, and --time kept across
the engines. The seconds below are a Qwen3-30B-A3B trial's on this project's 2-core machine (a 17 GiB load, 30 prompt
and 10 generated tokens a second); the run itself is timed end to end in tests/versus/test_engines_fast.py."""

from __future__ import annotations

import pytest

from tuner.search import decide
from tuner.versus.clock import RunClock, trial_tokens

ROUNDS = decide.Rounds(min=3, max=5, select=0)


def _clock(budget_s: float | None = None) -> RunClock:
    return RunClock(("llama.cpp", "ik_llama.cpp"), 4, ROUNDS, 512, 32, 512, 4, budget_s)


def test_nothing_is_estimated_before_a_trial_then_every_stage_from_it():
    c = _clock()
    assert c.left_s() is None and c.plan_words() is None
    tokens = trial_tokens(256, 32, 1, 0, 0, one_process=True)
    assert tokens == (512, 33)  # the warm-up prompt and one timed; one warm-up token and 32 timed
    c.trial("llama.cpp", 80.0, 30.0, 10.0, tokens)
    load = 80.0 - 512 / 30 - 33 / 10  # what the trial did beside its tokens: the model's load
    assert c.trials[0].load_s == pytest.approx(load)
    round_s = load + 517 / 30 + 36 / 10 + 0.2  # a race round: the load, the request and its warm-up at the trial's
    # rates, a server's own fixed cost
    assert c.round_estimate_s() == pytest.approx(round_s)
    search = 3 * 80.0 + 4 * 80.0  # ik's trials priced at llama.cpp's until one of its own is measured
    price = 512 / 30 * (1 + 2 * 1)  # the reference's first chunk, then two chunks of ik's line
    assert c.left_s() == pytest.approx(search + 3 * 4 * round_s + price + 1.0)  # and 1 s to write the results
    c.trial("ik_llama.cpp", 50.0, 60.0, 17.0, tokens)
    assert c.trial_s("ik_llama.cpp") == 50.0 and c.trial_s("llama.cpp") == 80.0
    c.search_ends("llama.cpp")
    assert c.search_left_s() == pytest.approx(3 * 50.0)
    c.race_round(70.0)
    assert c.round_estimate_s() == 70.0  # the race's own rounds, once it runs


def test_a_time_budget_keeps_room_for_the_later_engine_the_race_and_the_prices():
    tokens = trial_tokens(256, 32, 1, 0, 0, one_process=True)
    c = _clock(budget_s=900.0)
    c.search_begins("llama.cpp")
    assert c.stop_search("llama.cpp") is None  # nothing measured: the first trial runs (the engine's default)
    c.trial("llama.cpp", 80.0, 30.0, 10.0, tokens)
    # left: 900 - race (3 x 4 x ~82 s) - prices (~51 s): negative already: llama.cpp stops after its one trial
    why = c.stop_search("llama.cpp")
    assert why is not None and "ik_llama.cpp's search" in why and c.cuts == ["llama.cpp's search after 1 trials of 4"]
    roomy = _clock(budget_s=4000.0)
    roomy.trial("llama.cpp", 80.0, 30.0, 10.0, tokens)
    assert roomy.stop_search("llama.cpp") is None
    assert _clock().stop_search("llama.cpp") is None  # no budget: the trials asked
    assert "of --time 15.0 min" in c.end_words() and "cut to keep it: llama.cpp's search after 1 trials of 4" in \
        c.end_words()
