"""Each trial measures something new; what a study holds as tried (not what was cut short or orphaned); shared
studies across model folders; SIGTERM ends a run as Ctrl-C does; an interrupted run says what it kept; an
interrupted finish resumes as a finish, not as a new search."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

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


def _seen(st, sp) -> dedup.Seen:
    return study.seen_of(st, lambda: space.iter_configs(sp), lambda cfg: space.params_of(sp, cfg))


def test_a_repeated_config_is_named_and_an_untried_one_offered(demo_models, tmp_path):
    info, sp = _small_space(demo_models[("qwen3moe", "Q4_K_M")])
    configs = list(space.iter_configs(sp))
    assert len(configs) == 4  # fa on/off x threads 1/2
    st = study.open_study("seen", study.default_storage(tmp_path), study.Objective(), seed=0)
    seen = _seen(st, sp)
    assert seen.repeat_of(0, configs[0]) is None  # new: held from now on
    assert seen.repeat_of(1, configs[0]) == 0  # a repeat of trial 0
    # The same settings on the same model file in another folder are the same config.
    assert seen.repeat_of(2, replace(configs[0], model=Path("/elsewhere") / configs[0].model.name)) == 0
    assert seen.repeat_of(3, replace(configs[0], model=configs[0].model.with_name("other.gguf"))) is None
    assert seen.repeat_of(4, configs[1]) is None
    fresh = seen.untried(seed=7)
    assert fresh is not None and space.make_config(sp, fresh) in configs[2:] and not seen.exhausted
    for n, cfg in enumerate(configs[2:], start=5):
        seen.repeat_of(n, cfg)
    assert seen.untried(seed=7) is None and seen.exhausted
    assert seen.kept([type("R", (), {"number": n, "status": "measured"})() for n in (0, 1, 2, 9)]) == {"measured": 3}


def test_repeats_of_refused_configs_are_told_with_the_refusal_and_never_launched(demo_models, tmp_path):
    """Nothing fits a machine with 1 MiB of RAM: the memory gate refuses every config of a 4-config space. The
    sampler repeats itself; each repeat is told FAIL as a duplicate carrying its original's violated constraints,
    so no repeat of an infeasible config reaches the sampler, or a reader of the storage, as a feasible point.
    The engine folder is empty: a launch would fail the run."""
    info, sp = _small_space(demo_models[("qwen3moe", "Q4_K_M")])
    tiny = replace(CPU_2, ram_total_bytes=2**20, ram_available_bytes=2**20)
    st = study.open_study("refused", study.default_storage(tmp_path), study.Objective(), seed=3)
    out = study.run_search(st, sp, info, tiny, build.EngineLocation(tmp_path, "option"),
                           budget=study.Budget(trials=12), measure=TINY)
    assert out.exhausted and out.trials_this_run == 4 and out.kept == {"infeasible": 4}
    trials = st.get_trials(deepcopy=False)
    refused = {t.number: t for t in trials if t.user_attrs.get("status") == "infeasible"}
    assert len({dedup.key(study.config_from_dict(t.user_attrs["config"])) for t in refused.values()}) == 4
    repeats = [t for t in trials if t.user_attrs.get("status") == dedup.DUPLICATE]
    assert repeats, "the seeded sampler repeats itself in a 4-config space"
    for t in repeats:
        first = refused[t.user_attrs["duplicate_of"]]
        assert t.state == TrialState.FAIL
        original = study.config_from_dict(first.user_attrs["config"])
        assert dedup.key(space.make_config(sp, t.params)) == dedup.key(original)
        assert t.user_attrs[study.CONSTRAINTS_ATTR] == first.user_attrs[study.CONSTRAINTS_ATTR]
        assert t.user_attrs[study.CONSTRAINTS_ATTR]["ram_over_mib"] > 0
        if study.OPTUNA_MAJOR >= 5:
            assert t.constraints == first.constraints and max(t.constraints.values()) > 0
    assert all(r.status == "infeasible" for r in study.records(st))  # repeats are not records


def _stored(st, sp, cfg, *, status: str | None, worker: str, value: float | None = None) -> optuna.Trial:
    """A trial of ``cfg`` as another run left it: told with ``status``, or RUNNING (status None)."""
    st.enqueue_trial(space.params_of(sp, cfg))
    trial = st.ask()
    assert space.suggest(trial, sp) == cfg
    trial.set_user_attr("config", study.config_to_dict(cfg))
    trial.set_user_attr("worker", worker)
    if status == "measured":
        trial.set_user_attr("status", status)
        st.tell(trial, value)
    elif status is not None:
        study.tell_status(st, trial, status, state=TrialState.FAIL)
    return trial


def test_interrupted_and_orphaned_trials_are_measured_again(demo_models, tmp_path):
    """A config cut short by Ctrl-C, and one left RUNNING by a worker that died, are not held as tried; a config a
    live worker is measuring is. The next run measures exactly the two that were lost."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info, sp = _small_space(model)
    c = list(space.iter_configs(sp))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = study.WORKER.rpartition(":")[0]
    st = study.open_study("lost", study.default_storage(tmp_path), study.Objective(), seed=1)
    _stored(st, sp, c[0], status="measured", worker=f"{host}:1", value=1.0)
    _stored(st, sp, c[1], status="interrupted", worker=f"{host}:1")
    _stored(st, sp, c[2], status=None, worker=f"{host}:{dead.stdout.strip()}")  # its process is gone
    live = _stored(st, sp, c[3], status=None, worker=study.WORKER)  # this process: alive
    assert set(_seen(st, sp).numbers) == {dedup.key(c[0]), dedup.key(c[3])}
    # Another machine's RUNNING trial is held while it is young enough to be in the works.
    now = datetime.now()
    assert study.worker_alive("elsewhere:42", now - timedelta(hours=1), now)
    assert not study.worker_alive("elsewhere:42", now - timedelta(seconds=study.STALE_RUNNING_S + 1), now)

    loc = build.locate_engine()
    out = study.run_search(st, sp, info, CPU_2, loc, budget=study.Budget(trials=4), measure=TINY,
                           caps=build.capabilities(loc))
    measured = [r for r in study.records(st) if r.status == "measured"]
    assert {dedup.key(study.config_from_dict(r.config)) for r in measured} == {dedup.key(x) for x in c[:3]}
    assert out.trials_this_run == 2 and out.exhausted  # c[3] is still someone's: nothing else to try
    study.tell_status(st, live, "interrupted", state=TrialState.FAIL)


def test_a_shared_study_dedups_across_model_folders(demo_models, tmp_path):
    """Two workers hold the same model file in different folders: one study (named by the model's name and
    size), and each sees the other's configs; the finish launches each worker's own copy."""
    src = demo_models[("qwen3moe", "Q4_K_M")]
    copies = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        os.link(src, tmp_path / folder / src.name)
        copies.append(tmp_path / folder / src.name)
    loc = build.locate_engine()
    caps = build.capabilities(loc)
    spaces = [_small_space(m) for m in copies]
    [name] = {study.study_name(m, CPU_2, caps, sp, TINY, study.Objective())
              for m, (_, sp) in zip(copies, spaces, strict=True)}
    outs = []
    for (info, sp), trials in zip(spaces, (2, 4), strict=True):
        st = study.open_study(name, study.default_storage(tmp_path), study.Objective(), seed=5)
        outs.append(study.run_search(st, sp, info, CPU_2, loc, budget=study.Budget(trials=trials), measure=TINY,
                                     caps=caps))
    assert [o.trials_this_run for o in outs] == [2, 2] and outs[1].exhausted
    recs = study.records(st)
    assert sorted(Path(r.config["model"]).parent.name for r in recs) == ["a", "a", "b", "b"]
    assert len({dedup.key(study.config_from_dict(r.config)) for r in recs}) == 4  # none measured twice
    top = study.top_configs(recs, 4, model=copies[1])
    assert len(top) == 4 and {cfg.model for _, cfg in top} == {copies[1]}


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


def _running(url: str) -> list[optuna.trial.FrozenTrial]:
    """The trials of the one study in ``url`` that a worker has gated and is measuring (empty before it exists)."""
    try:
        [summary] = optuna.get_all_study_summaries(url)
        st = optuna.load_study(study_name=summary.study_name, storage=url)
    except (ValueError, KeyError, RuntimeError):  # not created yet
        return []
    return [t for t in st.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if "config" in t.user_attrs]


def test_sigterm_ends_a_run_as_ctrl_c_does(demo_models, tmp_path):
    """`timeout` or a service stop sends SIGTERM: the run tells its trials in flight ``interrupted`` (none stays
    RUNNING), stops its llama.cpp children (the autouse fixture checks none is left) and exits 130."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    url = study.default_storage(tmp_path)
    env = dict(os.environ, COLUMNS="200")
    argv = [str(Path(sys.executable).parent / "moe-tune"), "auto-tune", str(model), "-p", "16", "-n", "16",
            "--min-ctx", "512", "--trials", "20", "--max-kld", "off", "--storage", url,
            "--results-dir", str(tmp_path / "r")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (running := _running(url)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running and proc.poll() is None, "the run never reached a measurement"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted: kept " in out + err
    [summary] = optuna.get_all_study_summaries(url)
    st = optuna.load_study(study_name=summary.study_name, storage=url)
    assert not st.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    cut = {t.number: t for t in st.get_trials(deepcopy=False) if t.user_attrs.get("status") == "interrupted"}
    assert {t.number for t in running} <= set(cut) and all(t.state == TrialState.FAIL for t in cut.values())


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


def _told(st, sp, cfg, status: str) -> int:
    """A trial of ``cfg`` told with ``status``, as the search stores one (its config and status as user attrs)."""
    trial = st.ask()
    trial.set_user_attr("config", study.config_to_dict(cfg))
    study.tell_status(st, trial, status)
    return trial.number


def _queued(st) -> list[tuple[int | None, dict]]:
    return [(t.user_attrs.get("again_of"), t.system_attrs.get("fixed_params")) for t in st.get_trials(deepcopy=False)
            if t.state == TrialState.WAITING and t.user_attrs.get("queued_for") == dedup.AGAIN]


def test_a_config_that_paged_beside_others_load_is_measured_again_also_after_a_resume(demo_models, tmp_path):
    """Issue 51: paging while others' memory load pressed on the engine is theirs, so the config is queued again
    (not held like one that paged on its own), once per trial it redoes, a resumed study too, and at most
    dedup.REMEASURES times; a config that paged with the machine otherwise quiet is held for good."""
    _, sp = _small_space(demo_models[("qwen3moe", "Q4_K_M")])
    ours, theirs = list(space.iter_configs(sp))[:2]
    storage = study.default_storage(tmp_path)
    st = study.open_study("again", storage, study.Objective(), seed=0)
    _told(st, sp, ours, dedup.PAGING)
    first = _told(st, sp, theirs, dedup.BESIDE_OTHERS)
    seen = _seen(st, sp)
    assert seen.repeat_of(99, ours) is not None and seen.repeat_of(98, theirs) is None  # only ours is held
    assert _queued(st) == [(first, space.params_of(sp, theirs))]
    # A resumed run reads the storage: queued already, not queued twice.
    _seen(study.open_study("again", storage, study.Objective(), seed=0), sp)
    assert len(_queued(st)) == 1
    for n in range(dedup.REMEASURES):  # every re-measurement beside others' load again
        redo = st.ask()  # the queued trial, as the search asks it
        assert redo.user_attrs["again_of"] is not None and space.make_config(sp, redo.params) == theirs
        redo.set_user_attr("config", study.config_to_dict(theirs))
        study.tell_status(st, redo, dedup.BESIDE_OTHERS)
        seen.exhausted = True  # the sampler found nothing new in the batch that measured it
        study.hold(st, seen)
        if n + 1 < dedup.REMEASURES:  # queued again: the search goes on for it
            assert _queued(st)[-1][0] == redo.number and not seen.exhausted
    assert not _queued(st) and seen.repeat_of(97, theirs) is not None  # measured beside others every time: held
    assert st.get_trials(deepcopy=False)[first].state == TrialState.PRUNED  # never a point for the sampler
