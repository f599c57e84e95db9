"""A search says each trial as it ends, and each of its llama-bench tests as that test ends (issue 65: the two-engine
run's search on the gpt-oss-20b shape showed nothing for 17 minutes, then four trial lines at once): on the real
engine, the tiny demo model, two trials of one batch that cannot share a llama-bench process."""

from __future__ import annotations

import time
from dataclasses import replace

from tuner.core.machine_spec import Hardware
from tuner.engine import build
from tuner.models.gguf_reader import inspect_model
from tuner.search import study
from tuner.search.space import build_space

TINY = study.Measure(n_prompt=16, n_gen=4, repetitions=1, timeout_s=120, prompt_depth=0, gen_depth=0)
CPU = Hardware("", 0, 0, 0.0, 0.0, 16 * 2**30, 12 * 2**30, 0, 20e9, 2, source="none")


def test_each_trial_is_told_as_its_process_ends_and_each_test_as_it_ends(demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    loc = build.locate_engine()
    sp = build_space(model, info, CPU, ctx=1024, parallel=1, prompt_tokens=16)
    st = study.open_study("stream", study.default_storage(tmp_path), study.Objective(), seed=1)
    # K/V types and threads both differ: no cross product of the two, so two llama-bench processes
    st.enqueue_trial({"kv": "f16/f16", "flash_attn": "on", "threads": 1}, user_attrs={"seed": "a"})
    st.enqueue_trial({"kv": "q8_0/q8_0", "flash_attn": "on", "threads": 2}, user_attrs={"seed": "b"})
    events: list[tuple[str, str, float]] = []
    out = study.run_search(st, sp, info, CPU, loc, budget=study.Budget(trials=2), measure=TINY, batch_trials=2,
                           on_test=lambda line: events.append(("test", line, time.monotonic())),
                           on_progress=lambda p: events.append(("trial", str(p.done), time.monotonic())))
    assert out.trials_this_run == 2 and not out.interrupted
    kinds = [(kind, text.strip().split(":")[0]) for kind, text, _ in events]
    # trial 1's tests, trial 1 told, then trial 2's tests, trial 2 told: never both tests before either tell
    assert kinds == [("test", "trial 1/2"), ("test", "trial 1/2"), ("trial", "1"),
                     ("test", "trial 2/2"), ("test", "trial 2/2"), ("trial", "2")], events
    first_test = events[0][1]
    assert first_test.strip().startswith("trial 1/2: prompt 16 tokens at depth 0: ") and "tok/s" in first_test
    assert events[1][1].strip().startswith("trial 1/2: generation 4 tokens at depth 0: ")
    recs = study.records(st)
    assert all(r.elapsed_s and r.elapsed_s > 0 for r in recs)  # each trial's process time, for the run's clock


def test_a_test_line_names_the_trial_it_measured_and_the_number_its_trial_line_will_carry(demo_models, tmp_path):
    """Three trials of one batch: two share a process (threads 1 and 2, mapped), the third (threads 1, resident) runs
    alone after them. A row names no load setting, so the resident trial's settings matched the mapped one's row
    ("trials 1, 2" on the Qwen3-30B-A3B search here), and trials were numbered as asked while told as their
    processes ended: each test line now names one trial, by the number its trial line then carries."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    sp = replace(build_space(model, info, CPU, ctx=1024, parallel=1, prompt_tokens=16), load_mode=("mmap", "none"))
    st = study.open_study("numbers", study.default_storage(tmp_path), study.Objective(), seed=1)
    for seed, threads, load in (("a", 1, "mmap"), ("b", 1, "none"), ("c", 2, "mmap")):
        st.enqueue_trial({"kv": "f16/f16", "flash_attn": "on", "threads": threads, "load_mode": load},
                         user_attrs={"seed": seed})
    events: list[tuple[str, str]] = []
    out = study.run_search(st, sp, info, CPU, build.locate_engine(), budget=study.Budget(trials=3), measure=TINY,
                           batch_trials=3, on_test=lambda line: events.append(("test", line.strip().split(":")[0])),
                           on_progress=lambda p: events.append(("trial", f"trial {p.done}/3 {p.last.seed}")))
    assert out.trials_this_run == 3
    assert events == [("test", "trial 1/3"), ("test", "trial 1/3"), ("test", "trial 2/3"), ("test", "trial 2/3"),
                      ("trial", "trial 1/3 a"), ("trial", "trial 2/3 c"),
                      ("test", "trial 3/3"), ("test", "trial 3/3"), ("trial", "trial 3/3 b")], events
