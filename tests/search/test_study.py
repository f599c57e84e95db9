"""The Optuna study on the real engine: constraints, infeasible configs never launched, resume, Ctrl-C."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.fakes import small_card
from tuner.catalog.cards import find_card
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import build
from tuner.models.gguf_reader import inspect_model
from tuner.search import study
from tuner.search.space import build_space

GIB = 2**30
# The workload's request: a 16-token prompt from an empty context, generation at depth 16 (after the prompt).
TINY = study.Measure(n_prompt=16, n_gen=4, repetitions=1, timeout_s=120, prompt_depth=0, gen_depth=16)


def test_parse_duration():
    assert study.parse_duration("20m") == 1200 and study.parse_duration("1h30m") == 5400
    assert study.parse_duration("90s") == 90 and study.parse_duration("45") == 45
    with pytest.raises(UsageError):
        study.parse_duration("soon")


def test_constraints_reach_optuna_whatever_its_version(tmp_path):
    st = optuna.create_study(storage=f"sqlite:///{tmp_path}/c.db", sampler=study.make_sampler(0))
    trial = st.ask()
    study.set_constraints(trial, {"vram_over_mib": 12.5, "ram_over_mib": -3.0})
    st.tell(trial, state=TrialState.PRUNED)
    frozen = st.get_trials()[0]
    assert frozen.user_attrs["constraints"] == {"vram_over_mib": 12.5, "ram_over_mib": -3.0}
    if study.OPTUNA_MAJOR >= 5:
        assert frozen.constraints == {"vram_over_mib": 12.5, "ram_over_mib": -3.0}


def test_search_gates_by_memory_resumes_and_stops_on_ctrl_c(demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    loc = build.locate_engine()
    caps = build.capabilities(loc)
    # A fake small card (at the hardware boundary): low n_cpu_moe values cannot fit, high ones can, with the
    # space's cheapest KV pair too (on the tiny model q4_0 saves more than four layers' experts).
    cheapest = LaunchConfig(model=model, ctx=1024, parallel=1, flash_attn=FlashAttn.ON, cache_type_k=CacheType.Q4_0,
                            cache_type_v=CacheType.Q4_0)
    hw = small_card(info, cheapest, info.n_layer // 2)
    sp = build_space(model, info, hw, ctx=1024, parallel=1, prompt_tokens=16, vram_margin_mib=0)
    # --n-cpu-moe is searched from the memory model's fitting boundary up, not from 0.
    assert sp.n_cpu_moe is not None and 0 < sp.n_cpu_moe[0] <= sp.n_cpu_moe[1] <= info.n_layer
    obj = study.Objective()
    name = study.study_name(model, hw, caps, sp, TINY, obj)
    assert name == study.study_name(model, hw, caps, sp, TINY, obj) and "RTX-4060-Ti" in name
    storage = study.default_storage(tmp_path)
    st = study.open_study(name, storage, obj, seed=1)
    st.enqueue_trial({"n_cpu_moe": 0}, user_attrs={"seed": "all-on-gpu"})
    st.enqueue_trial({"n_cpu_moe": info.n_layer, "kv": "q8_0/q8_0", "threads": 1},
                     user_attrs={"seed": "all-on-host"})
    out = study.run_search(st, sp, info, hw, loc, budget=study.Budget(trials=3), measure=TINY, caps=caps,
                           vram_margin_mib=0)
    assert out.trials_this_run == 3 and not out.interrupted
    recs = study.records(st)
    first, second = recs[0], recs[1]
    assert first.seed == "all-on-gpu" and first.status == "infeasible" and first.constraints["vram_over_mib"] > 0
    assert first.gen_tok_s is None and st.trials[0].state is TrialState.PRUNED and st.trials[0].value is None
    assert second.status == "measured" and second.gen_tok_s and second.gen_tok_s > 0
    # The score is one request's end-to-end time at the measured speeds, and the trial says at which depths.
    assert second.request_s == pytest.approx(16 / second.prompt_tok_s + 4 / second.gen_tok_s)
    assert all(v <= 0 for v in second.constraints.values())
    assert st.trials[1].value == pytest.approx(1 / second.request_s)
    assert (second.prompt_depth, second.gen_depth) == (0, 16)
    assert second.argv and "-ncmoe" in second.argv and second.argv.count("-d") == 1 and "16" in second.argv

    # Resume: a second run on the same storage continues the trial count; Ctrl-C leaves nothing RUNNING.
    again = study.open_study(name, storage, obj, seed=1)
    assert len(again.trials) == 3

    def interrupt(p: study.Progress) -> None:
        raise KeyboardInterrupt

    out2 = study.run_search(again, sp, info, hw, loc, budget=study.Budget(trials=8), measure=TINY, caps=caps,
                            on_progress=interrupt, batch_trials=3)
    assert out2.interrupted and out2.trials_this_run == 1
    states = [t.state for t in study.open_study(name, storage, obj).trials]
    assert len(states) >= 4 and TrialState.RUNNING not in states and states[:3] == [t.state for t in st.trials[:3]]


def test_top_configs_leave_out_what_runs_as_a_baseline():
    from tuner.plan.memory import effective_config

    default = LaunchConfig(model=Path("m.gguf"), ctx=4096, parallel=1)
    same_as_default = study.config_to_dict(replace(default, threads=2, flash_attn=FlashAttn.ON))
    other = study.config_to_dict(replace(default, threads=1, flash_attn=FlashAttn.ON))
    recs = [study.TrialRecord(0, "measured", same_as_default, gen_tok_s=10.0, request_s=1.0),
            study.TrialRecord(1, "measured", other, gen_tok_s=9.0, request_s=1.1)]
    assert [r.number for r, _ in study.top_configs(recs, 2)] == [0, 1]
    kept = study.top_configs(recs, 2, exclude=[default], same=lambda c: effective_config(c, 2))
    assert [r.number for r, _ in kept] == [1]


def test_a_signal_between_asking_and_holding_a_trial_leaves_none_running(demo_models, tmp_path, monkeypatch):
    """CI once caught a SIGTERM that landed after ``study.ask()`` created trial 3 and before the search held it:
    the trial stayed RUNNING for good, with no parameters. Here the signal lands inside the second ask of a
    batch (at the same place: the trial exists, its parameters do not); no trial may stay RUNNING."""
    import os
    import signal

    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    loc = build.locate_engine()
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9, physical_cores=2)
    sp = build_space(model, info, hw, ctx=1024, parallel=1, prompt_tokens=16, vram_margin_mib=0)
    st = study.open_study("signal-in-ask", study.default_storage(tmp_path), study.Objective(), seed=1)
    real_suggest, calls = study.space.suggest, []

    def suggest(trial, space_):
        calls.append(trial.number)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_suggest(trial, space_)

    monkeypatch.setattr(study.space, "suggest", suggest)
    out = study.run_search(st, sp, info, hw, loc, budget=study.Budget(trials=3), measure=TINY, batch_trials=3)
    assert out.interrupted and len(calls) == 2
    trials = st.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL]
    assert all(t.user_attrs["status"] == "interrupted" for t in trials)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run puts back the handler it found


def test_a_sigint_ignored_on_purpose_stays_ignored_and_sigterm_still_ends_the_run():
    """A background command of a shell without job control starts with SIGINT ignored; the run leaves it so
    (and puts every handler back), while SIGTERM is still Ctrl-C for it."""
    import signal

    from tuner.machine import interrupt

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt.sigterm_as_ctrl_c():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is interrupt._raise_interrupt
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)
    with interrupt.sigterm_as_ctrl_c():
        assert signal.getsignal(signal.SIGINT) is interrupt._raise_interrupt
    assert signal.getsignal(signal.SIGINT) is before


# --- thermal drift: an anchor config measured again every few trials of a GPU run ---------------------------------


class FakeCardClock:
    """A FAKE card (the hardware boundary) measured by a fake llama-bench: every config it runs takes 45 s of card
    time, and once ``clock_down`` is set its clocks fall 1.5 % per minute of load (to 80 %), as a card heating
    over back-to-back trials boosts less. Each config's own speed is fixed: only the clock moves it."""

    def __init__(self, clock_down: bool) -> None:
        self.clock_down = clock_down
        self.card_s = 0.0
        self.calls: list[list[LaunchConfig]] = []

    def factor(self) -> float:
        return max(0.80, 1.0 - 0.015 * self.card_s / 60) if self.clock_down else 1.0

    def run_bench_many(self, loc, cfgs, **kw):
        from tuner.measure.bench import BenchResult, BenchRow

        self.calls.append(list(cfgs))
        out = []
        for cfg in cfgs:
            self.card_s += 45.0
            base = 50.0 + 5.0 * (cfg.threads or 1) + (cfg.n_cpu_moe or 0)
            gen, prompt = base * self.factor(), 20 * base * self.factor()
            rows = (BenchRow(kw["n_prompt"], 0, kw["depth"], prompt, 0.2, (prompt * 0.998, prompt, prompt * 1.002),
                             "fake"),
                    BenchRow(0, kw["n_gen"], kw["gen_depth"], gen, 0.1, (gen * 0.998, gen, gen * 1.002), "fake"))
            out.append(BenchResult(("fake-llama-bench",), rows, 0.1, cfg))
            if kw.get("on_done") is not None:  # the real one tells each config as its group ends
                kw["on_done"](cfg, out[-1])
        return out


class FakeQuietWatch:
    """The machine watch on a machine where nothing else runs (the shared test machine never is)."""

    noise = None
    others_memory = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _drift_run(demo_models, tmp_path, monkeypatch, *, clock_down: bool, gpu: bool = True):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9, physical_cores=2)
    if not gpu:
        hw = replace(hw, gpu_name="", vram_total_bytes=0, vram_free_bytes=0)
    sp = build_space(model, info, hw, ctx=1024, parallel=1, prompt_tokens=16, vram_margin_mib=0)
    card = FakeCardClock(clock_down)
    monkeypatch.setattr(study.bench, "run_bench_many", card.run_bench_many)
    monkeypatch.setattr(study.quiet, "watch_for", lambda cfgs, own=None: FakeQuietWatch())
    st = study.open_study(f"drift-{clock_down}-{gpu}", study.default_storage(tmp_path), study.Objective(), seed=3)
    out = study.run_search(st, sp, info, hw, build.locate_engine(), budget=study.Budget(trials=16), measure=TINY,
                           anchor_every=4 if gpu else None)
    return st, out, card


def test_a_gpu_run_reads_its_anchor_and_names_a_clock_down(demo_models, tmp_path, monkeypatch):
    st, out, card = _drift_run(demo_models, tmp_path, monkeypatch, clock_down=True)
    measured = [t for t in st.get_trials() if t.user_attrs.get("status") == "measured"]
    assert len(measured) == 16
    anchor = st.user_attrs["anchor"]
    # The anchor is the first measured config; it ran again alone after every 4 measured trials.
    assert anchor["config"] == measured[0].user_attrs["config"]
    alone = [c for c in card.calls if len(c) == 1 and c[0] == study.config_from_dict(anchor["config"])]
    assert len(alone) == len(anchor["readings"]) - 1 == 3
    assert [r["after_trials"] for r in anchor["readings"]] == [0, 4, 8, 12]
    gens = [r["gen_tok_s"] for r in anchor["readings"]]
    assert gens == sorted(gens, reverse=True) and gens[-1] < 0.9 * gens[0]
    assert out.drift is not None and out.drift == anchor["drift"]
    assert out.drift.startswith("thermal drift: the anchor config reads") and "% slower in generation" in out.drift
    assert "heating and boosting less" in out.drift
    # Trials measured once the drift was seen carry it; the first ones, before any second reading, do not.
    drifts = [t.user_attrs.get("drift") for t in measured]
    assert drifts[:4] == [None] * 4 and drifts[-1] is not None and drifts.count(None) < len(drifts)


def test_a_steady_card_shows_no_drift_and_a_cpu_run_reads_no_anchor(demo_models, tmp_path, monkeypatch):
    st, out, card = _drift_run(demo_models, tmp_path, monkeypatch, clock_down=False)
    assert out.drift is None and st.user_attrs["anchor"]["drift"] is None
    assert len(st.user_attrs["anchor"]["readings"]) == 4
    assert all(t.user_attrs.get("drift") is None for t in st.get_trials())
    st, out, card = _drift_run(demo_models, tmp_path / "cpu", monkeypatch, clock_down=True, gpu=False)
    assert out.drift is None and "anchor" not in st.user_attrs
    assert all(len(c) > 1 or c is card.calls[-1] for c in card.calls)  # trials only: no config measured alone
    assert all("drift" not in t.user_attrs for t in st.get_trials())
