"""Each trial measures something new; an interrupted run says what it kept; an interrupted finish resumes as a
finish, not as a new search."""

from __future__ import annotations

from collections import Counter

import pytest

from tuner.cli.cmd_tune import _kept
from tuner.core.config import CacheType
from tuner.engine import build
from tuner.machine import hardware
from tuner.machine.hardware import Hardware
from tuner.measure import workload
from tuner.measure.workload import WorkloadKind
from tuner.models.gguf_reader import inspect_model
from tuner.search import autotune, dedup, finish, space, study

CPU_2 = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 2, "none")
TINY = study.Measure(n_prompt=16, n_gen=4, repetitions=1, timeout_s=120, prompt_depth=0, gen_depth=16)


def _small_space(model):
    info = inspect_model(model)
    sp = space.build_space(model, info, CPU_2, ctx=1024, parallel=1, prompt_tokens=16,
                           kv_pairs=((CacheType.F16, CacheType.F16),))
    return info, sp


def test_a_repeated_config_is_named_and_an_untried_one_offered(demo_models):
    info, sp = _small_space(demo_models[("qwen3moe", "Q4_K_M")])
    configs = list(space.iter_configs(sp))
    assert len(configs) == 4  # fa on/off x threads 1/2
    seen = dedup.Seen(sp, [(0, configs[0])])
    assert seen.repeat_of(1, configs[0]) == 0  # a repeat of trial 0
    assert seen.repeat_of(2, configs[1]) is None  # new: held from now on
    fresh = seen.untried()
    assert fresh is not None and space.make_config(sp, fresh) in configs[2:] and not seen.exhausted
    for n, cfg in enumerate(configs[2:], start=3):
        seen.repeat_of(n, cfg)
    assert seen.untried() is None and seen.exhausted
    assert seen.kept([type("R", (), {"number": n, "status": "measured"})() for n in (0, 1, 2, 9)]) == {"measured": 2}


def test_search_measures_each_config_once_and_stops_when_the_space_is_spent(demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info, sp = _small_space(model)
    loc = build.locate_engine()
    st = study.open_study("dedup", study.default_storage(tmp_path), study.Objective(), seed=3)
    out = study.run_search(st, sp, info, CPU_2, loc, budget=study.Budget(trials=7), measure=TINY,
                           caps=build.capabilities(loc))
    recs = study.records(st)
    configs = Counter(repr(sorted(r.config.items())) for r in recs)
    assert len(recs) == 4 and max(configs.values()) == 1  # 4 distinct configs, none twice
    assert out.exhausted and out.trials_this_run == 4 and not out.interrupted
    assert out.kept == {"measured": 4}
    assert _kept(out.kept) == "kept 4 trials of this run in the study (4 measured)"


def test_interrupt_message_names_what_was_kept():
    assert _kept({}) == "no trial of this run is in the study"
    text = _kept({"failed": 1, "interrupted": 3})
    assert text.startswith("kept 4 trials") and "3 cut short by Ctrl-C" in text and "1 failed" in text


@pytest.mark.slow
def test_an_interrupted_finish_resumes_at_the_finish(engine_loc, demo_models, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    load = workload.preset(WorkloadKind.CHAT, 16, 8, rounds=1)
    req = autotune.TuneRequest(model=demo_models[("qwen3moe", "Q4_K_M")], workload=load, min_ctx=1024,
                               budget=study.Budget(trials=2), top_candidates=1, results_dir=tmp_path,
                               measure=study.Measure.for_workload(load, repetitions=1), max_kld=None,
                               rounds=finish.Rounds(min=1, max=1))
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    searched: list[int] = []

    def stop_in_finish(msg: str) -> None:
        if msg.startswith("round 1"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        autotune.auto_tune(req, engine_loc, hw, on_step=stop_in_finish,
                           on_progress=lambda p: searched.append(p.done))
    assert searched[-1] == 2
    steps: list[str] = []
    again: list[int] = []
    res = autotune.auto_tune(req, engine_loc, hw, on_step=steps.append, on_progress=lambda p: again.append(p.done))
    assert not again and res.search.trials_this_run == 0  # no new trial budget spent
    assert any("going straight to the finish" in s for s in steps)
    assert res.result.to_dict()["finish"]["baselines"]
    third = autotune.auto_tune(req, engine_loc, hw, on_progress=lambda p: again.append(p.done))
    assert third.search.trials_this_run > 0  # a finished study searches again when asked again
