"""What the engines' run measures and no more (tuner.versus.protocol): a search trial in one llama-bench process where
the reply's depth barely changes what a token reads, a short prompt where no ubatch is searched, one repetition; the
race's rounds one request each, the reply timed over a few tokens; a candidate its search could not tell from its
engine's default does not race.

The models are real shapes' headers (zero weights: megabytes on disk): the roofline reads their tensor sizes and KV
heads as the engine would."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.measure import workload
from tuner.models import gguf_reader, shape_model
from tuner.search import study
from tuner.search.verdict import compare
from tuner.versus import protocol
from tuner.versus.lines import EngineLine

CPU = Hardware("", 0, 0, 0.0, 0.0, 24 * 2**30, 23 * 2**30, 0, 40e9, 2, source="none")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shape") / "qwen3-30b-a3b-Q4_K_M.gguf"
    return shape_model.write_catalog_model("qwen3-30b-a3b:Q4_K_M", out).path


def _measure(kind: workload.WorkloadKind, **kw: int) -> study.Measure:
    return study.Measure.for_workload(workload.preset(kind, **kw))


def test_a_chat_trial_is_one_short_process_an_agent_s_long_history_keeps_its_depth(qwen):
    info = gguf_reader.inspect_model(qwen)
    cfg = LaunchConfig(model=qwen, ctx=4096, parallel=1)
    chat = protocol.search_measure(_measure(workload.WorkloadKind.CHAT), info, cfg, CPU)
    # Qwen3-30B-A3B at f16 KV: 48 layers x 4 KV heads x 128 x 2 x 2 bytes = 96 KiB a token of context; 512 more
    # tokens are 48 MiB on ~1.8 GiB a generated token reads: 2.6 %, under the 5 % that would ask a second process.
    growth = protocol.reply_growth(info, cfg, CPU, 0, 512)
    assert 0.01 < growth < protocol.ONE_PROCESS_GROWTH
    assert (chat.n_prompt, chat.n_gen, chat.repetitions, chat.prompt_depth, chat.gen_depth) == (256, 32, 1, 0, 0)
    # the score still charges the whole request: its 512-token prompt at the rate 256 tokens measured, its 128-token
    # reply at the rate 32 measured (the first run of this protocol charged 256: ik's -rtr line read 15.1 s a request
    # in its search and 20-23 s in the race, whose request is the workload's)
    assert (chat.request_gen_tokens, chat.request.prompt_tokens) == (128, 512)
    assert chat.score(44.4, 13.7) == pytest.approx(1 / (512 / 44.4 + 128 / 13.7))
    # a 512-token prompt at a 32K history: the reply adds 512 tokens to 32K already read: one process too
    deep = protocol.search_measure(_measure(workload.WorkloadKind.CHAT, depth_tokens=32768), info,
                                   LaunchConfig(model=qwen, ctx=40960, parallel=1), CPU)
    assert (deep.prompt_depth, deep.gen_depth) == (32768 - 512, 32768 - 512)
    # an agent's 8192-token prompt from an empty context: its reply reads 768 MiB more KV a token than the prompt's
    # start (40 %): measured at its own depth, in its own process; the prompt whole (its ubatch is searched)
    agent = protocol.search_measure(_measure(workload.WorkloadKind.AGENT), info,
                                    LaunchConfig(model=qwen, ctx=16384, parallel=1), CPU)
    assert protocol.reply_growth(info, LaunchConfig(model=qwen, ctx=16384, parallel=1), CPU, 0, 8192) > 0.3
    assert (agent.n_prompt, agent.prompt_depth, agent.gen_depth) == (8192, 0, 8192)


def test_the_race_sends_one_request_a_round_its_reply_timed_over_a_few_tokens():
    chat = workload.preset(workload.WorkloadKind.CHAT)
    sent = protocol.race_request(chat)
    assert sent is not None and (sent.prompt_tokens, sent.gen_tokens, sent.rounds) == (512, 32, 1)
    # the score is the workload's own sum of rates: 512 prompt tokens at 30 tok/s and 128 generated at 10
    assert chat.score(30.0, 10.0) == pytest.approx(1 / (512 / 30 + 128 / 10))
    assert protocol.race_request(workload.preset(workload.WorkloadKind.BATCH)) is None  # aggregate: whole requests


def test_what_the_race_can_decide_and_the_screen_it_sets():
    # the margin is what 5 rounds decide at the prior noise, less two search repetitions' error
    assert protocol.decidable_ratio(protocol.NOISE_PRIOR_PCT, 5) == pytest.approx(1.077, abs=0.002)
    margin = protocol.screen_margin(5)
    assert margin == pytest.approx(1.0356, abs=0.002)
    # and the race indeed cannot decide a 5 % gain in 5 rounds at that noise: per-round ratios 1.05 +/- 3.6 %
    spread = [1.05 * (1 + d) for d in (0.036, -0.036, 0.0, 0.036, -0.036)]
    assert compare("a", "b", spread, [1.0] * 5).outcome == "undecided"


def _line(label: str, role: str, score: float | None) -> EngineLine:
    cfg = LaunchConfig(model=Path("/m.gguf"), engine="ik_llama.cpp" if label.startswith("ik") else "llama.cpp",
                       flash_attn=FlashAttn.ON if role == "tuned" else FlashAttn.AUTO)
    return EngineLine(label, cfg.engine, cfg, "s", Path("r"), Path("b"), role, search_score=score)


def test_a_candidate_the_search_could_not_tell_from_its_default_does_not_race():
    lines = [_line("llama.cpp default", "default", 1 / 30.0), _line("llama.cpp tuned", "tuned", 1 / 29.4),
             _line("ik_llama.cpp default", "default", 1 / 22.0), _line("ik_llama.cpp tuned", "tuned", 1 / 16.5),
             _line("ik_llama.cpp second", "reserve", 1 / 17.0)]
    out = protocol.screen(lines, 5)
    assert list(out) == ["llama.cpp tuned"]  # 1.02x its default; ik tuned 1.33x races; the reserve is not screened
    assert out["llama.cpp tuned"].startswith("not raced: its search measured it 1.02x llama.cpp default, within the "
                                             "1.036x that 5 rounds could decide")
    # unmeasured (it paged in its trial, or no trial ran as it does): it races
    assert protocol.screen([lines[0], _line("llama.cpp tuned", "tuned", None)], 5) == {}
    assert protocol.reserves(lines) == {"ik_llama.cpp second": "held back: its engine's best candidate races in its "
                                                               "place"}


def test_a_line_far_behind_the_best_search_figure_does_not_race_llama_cpp_s_default_always_does():
    # this turn's first Qwen3-30B-A3B chat run, its search figures charged the whole 512-token request:
    # llama.cpp default 36.0 s, llama.cpp tuned (-lm none) 29.5 s, ik default 34.2 s, ik tuned (-rtr) 20.8 s
    from tuner.versus.standing import Gates

    lines = [_line("llama.cpp default", "default", 1 / 36.0), _line("llama.cpp tuned", "tuned", 1 / 29.5),
             _line("ik_llama.cpp default", "default", 1 / 34.2), _line("ik_llama.cpp tuned", "tuned", 1 / 20.8)]
    out = protocol.screen_behind(lines, Gates())
    assert sorted(out) == ["ik_llama.cpp default", "llama.cpp tuned"]  # 0.61x and 0.71x of ik tuned; the default races
    assert out["llama.cpp tuned"].startswith("not raced: its search measured it 0.71x ik_llama.cpp tuned")
    # the best refused by its price is no best: the others are judged against what can race
    refused = Gates(refused={"ik_llama.cpp tuned": "was refused by its price"})
    assert protocol.screen_behind(lines, refused) == {}
