"""Text for an 80-column terminal (tuner/report/terminal.py): prose wrapped, launch lines and paths whole on lines of
their own (issue 58)."""

from __future__ import annotations

import pytest

from tuner.report.terminal import fitted

pytestmark = pytest.mark.fast

LINE = "llama-server -m /models/qwen3-30b-a3b-Q4_K_M.gguf -c 32768 -np 1 -ctk q8_0 -ctv q8_0 -t 16 -fa on"
ENV_LINE = f"GGML_OP_OFFLOAD_MIN_BATCH=512 {LINE}"


def test_a_message_that_fits_is_left_as_it_is():
    short = "round 1 (selection): default (llama-server -m a.gguf -c 512)"
    assert fitted(short, 80) == [short]


def test_a_launch_line_in_a_sentence_stands_whole_on_its_own_line_and_once():
    seen: set[str] = set()
    assert fitted(f"round 1 (confirmation): llama-server candidate-1 ({LINE})", 80, seen) == [
        "round 1 (confirmation): llama-server candidate-1", LINE]
    # The same arm's next round: its line was shown, the round is named alone.
    assert fitted(f"round 2 (confirmation): llama-server candidate-1 ({LINE})", 80, seen) == [
        "round 2 (confirmation): llama-server candidate-1"]
    assert fitted(f"tuned + op offload from 512 tokens: {ENV_LINE}", 80) == ["tuned + op offload from 512 tokens:",
                                                                            ENV_LINE]
    ik = f"/opt/ik_llama.cpp/build/bin/{LINE}"  # another engine's server, named by its path
    assert fitted(f"round 1 (selection): ik ({ik})", 80) == ["round 1 (selection): ik", ik]


def test_prose_wraps_at_the_width_and_paths_stand_whole():
    note = ("memory: llama.cpp 0c1e57098's own projection (llama-fit-params) decides what fits, each distinct "
            "config asked once and cached; the replay's figures are its first guess")
    lines = fitted(note, 80)
    assert all(len(x) <= 80 for x in lines) and len(lines) == 3 and lines[1].startswith("  ")
    assert " ".join(x.strip() for x in lines) == note
    written = ("written: /tmp/a-very-long-results-folder/compare-models-qwen3-30b-a3b-vs-qwen3.5-9b/report.md, "
               "/tmp/a-very-long-results-folder/compare-models-qwen3-30b-a3b-vs-qwen3.5-9b/compare-models.json")
    assert fitted(written, 80) == ["written:",
                                   "/tmp/a-very-long-results-folder/compare-models-qwen3-30b-a3b-vs-qwen3.5-9b/report.md",
                                   "/tmp/a-very-long-results-folder/compare-models-qwen3-30b-a3b-vs-qwen3.5-9b/"
                                   "compare-models.json"]
    study = "study s: 6 trials stored (3 this run) in sqlite:////home/someone/projects/tuning/results/studies.db"
    assert fitted(study, 80) == ["study s: 6 trials stored (3 this run) in",
                                 "sqlite:////home/someone/projects/tuning/results/studies.db"]
    # Units with a slash and Hub names are prose, not paths.
    trial = ("unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M: trial 1/2 measured: 0.08 s/request (gen 125.9, prompt 1,393.0 "
             "tok/s); best 0.08 s/request")
    assert all(len(x) <= 80 for x in fitted(trial, 80)) and len(fitted(trial, 80)) == 2
