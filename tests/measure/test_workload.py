"""The server workload: exact-length real-text prompts, and per-level figures from per-request timings."""

from __future__ import annotations

import pytest

from tuner.core.errors import UsageError
from tuner.measure import workload
from tuner.measure.workload import LevelResult, RequestResult, WorkloadKind


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]  # a stand-in tokenizer: one token per character of the real text


def test_prompts_are_exact_length_distinct_windows_of_real_text():
    windows = workload.prompt_windows(_chars, 300, 6)
    assert len(windows) == 6 and all(len(w) == 300 for w in windows)
    assert len({tuple(w) for w in windows}) == 6  # no two requests share a prompt
    text = "".join(chr(t) for t in windows[0])
    assert text == workload.prompt_text()[:300] and len(set(text)) > 20  # real text, not one repeated token


def test_prompt_longer_than_the_text_is_refused():
    with pytest.raises(UsageError, match="use a smaller -p"):
        workload.prompt_windows(lambda text: _chars(text)[:50], 100, 1)


def test_presets_and_custom():
    assert workload.preset(WorkloadKind.AGENT).prompt_tokens == 8192
    chat = workload.preset(WorkloadKind.CHAT, gen_tokens=16)
    assert (chat.prompt_tokens, chat.gen_tokens) == (512, 16)
    with pytest.raises(UsageError, match="custom needs both"):
        workload.preset(WorkloadKind.CUSTOM, prompt_tokens=10)
    with pytest.raises(UsageError):
        workload.Workload(WorkloadKind.CUSTOM, 0, 8)


def test_depth_concurrency_and_the_one_score():
    agent = workload.preset(WorkloadKind.AGENT, 1024, 64)
    assert (agent.prompt_depth, agent.gen_depth, agent.context_tokens) == (0, 1024, 1088)  # fresh conversation
    history = workload.preset(WorkloadKind.AGENT, 1024, 64, depth_tokens=32768)
    assert (history.prompt_depth, history.gen_depth, history.context_tokens) == (31744, 32768, 32832)
    assert history.score(512.0, 16.0) == pytest.approx(1 / (1024 / 512 + 64 / 16))  # 6 s per request
    assert history.score(None, 16.0) is None and history.score(512.0, 0.0) is None
    assert workload.preset(WorkloadKind.BATCH).concurrency == 4 and agent.concurrency == 1
    assert history.describe()["depth_tokens"] == 32768
    with pytest.raises(UsageError, match="--depth"):
        workload.preset(WorkloadKind.CHAT, 512, depth_tokens=100)  # shorter than the 512-token prompt asked for
    # The preset's prompt is cut to a shorter depth; one asked for with -p is not.
    assert workload.preset(WorkloadKind.CHAT, depth_tokens=100).prompt_tokens == 100
    assert workload.preset(WorkloadKind.AGENT, depth_tokens=1024).prompt_tokens == 1024


def test_level_figures_per_request_and_aggregate():
    reqs = (RequestResult(0.10, 1.0, 64, 32, 600.0, 40.0), RequestResult(0.30, 1.0, 64, 32, 500.0, 30.0),
            RequestResult(0.20, 2.0, 64, 32, 400.0, 20.0))
    level = LevelResult(concurrency=3, requests=reqs, wall_s=2.0)
    assert level.per_request_gen_tok_s == 30.0 and level.per_request_prompt_tok_s == 500.0
    assert level.ttft_s == pytest.approx(0.20)
    # Generation spans [0.1, 1.0], [0.3, 1.0] and [0.2, 2.0] overlap into 1.9 s of decoding.
    assert level.decode_s == pytest.approx(1.9)
    assert level.aggregate_gen_tok_s == pytest.approx(96 / 1.9)
    assert level.end_to_end_gen_tok_s == pytest.approx(96 / 2.0)
    staggered = LevelResult(2, (RequestResult(0.5, 1.0, 8, 10, 1.0, 1.0, start_s=0.0),
                                RequestResult(0.5, 1.0, 8, 10, 1.0, 1.0, start_s=3.0)), wall_s=4.0)
    assert staggered.decode_s == pytest.approx(1.0)  # two disjoint 0.5 s spans
    assert level.to_dict()["requests"][1]["gen_tok_s"] == 30.0
