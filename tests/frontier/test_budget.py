"""The frontier's time budget is a promise it keeps: the pace weighs what a trial will cost (the KV pair and the
threads on the CPU, beside the depth), no trial starts that the pace says will not finish, a trial still running
when the budget ends is stopped and called so, and every trial not measured is counted with its reason on the
trial lines, in the summary and in report.md.

The pace and the rule are pure code on recorded figures and a fake clock; the stop is a real llama-bench process
on the demo model, stopped by the deadline a few seconds in.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tests.fakes import FakeFrontierRunner
from tests.frontier.test_frontier import CPU, fake_kld
from tuner.cli.cmd_frontier import outcome
from tuner.core.config import CacheType, LaunchConfig
from tuner.engine import runner
from tuner.frontier import pareto, tune, watched
from tuner.measure.workload import WorkloadKind, preset
from tuner.models import demo
from tuner.models.gguf_reader import inspect_model
from tuner.report import frontier_report
from tuner.search import result as study_result
from tuner.search import study

F16, Q8, Q4 = CacheType.F16, CacheType.Q8_0, CacheType.Q4_0
CHAT = preset(WorkloadKind.CHAT)  # 512 prompt + 128 generated tokens, as the demo frontier runs by default
NOT_STARTED = "not started: would not finish in the time left"


@pytest.fixture(scope="module")
def demo_f16(tmp_path_factory):
    [f16] = demo.make_demo_models(out=tmp_path_factory.mktemp("demo-f16"))
    return f16.path


@pytest.fixture(scope="module")
def cost(demo_f16):
    return watched.Cost.of(inspect_model(demo_f16))


def _plan(ctx, k=F16, v=F16, threads=2, device=None):
    cfg = LaunchConfig(model=Path("m.gguf"), ctx=ctx, parallel=1, cache_type_k=k, cache_type_v=v, threads=threads,
                       device=device)
    return pareto.Plan(cfg, *pareto.depths(CHAT, ctx, 1))


def _pace(cost, **kw):
    return watched.Pace(CHAT.prompt_tokens + CHAT.gen_tokens, cost, **kw)


# Prompt tok/s at the reply's depth, flash attention on, 1 thread, quiet: the demo grid
# (results/benchmarks/frontier_grid_moe-tune-demo-qwen3moe-tiny-Q4_K_M_chat.json).
GRID_PROMPT_TOK_S = {
    2048: {(F16, F16): 681.1, (F16, Q8): 154.1, (Q8, Q8): 186.0, (F16, Q4): 113.1, (Q8, Q4): 124.8, (Q4, Q4): 123.7},
    4096: {(F16, F16): 469.4, (F16, Q8): 91.6, (Q8, Q8): 103.6, (F16, Q4): 63.3, (Q8, Q4): 69.3, (Q4, Q4): 67.3},
}


def test_the_pace_weighs_the_kv_pair_and_the_threads_on_the_cpu(cost):
    """What one more token of history costs by the pace, a quantized pair against f16 at the same depth, is what
    the grid measured (within 20 %); counted as f16 it would be 3-7x too cheap. A trial at -t 1 of 2 cores costs
    twice its -t 2 twin; on a GPU the KV pair is not weighed, unless the trial runs with -dev none."""
    pace = _pace(cost, cores=2)
    pace.took([_plan(4096)], 6.0)

    def per_token_s(ctx, k, v):  # the pace's cost of the last 64 tokens of the fill, per token
        deeper = _plan(ctx, k, v)
        shallower = pareto.Plan(deeper.config, deeper.prompt_depth - 64, deeper.gen_depth - 64)
        return ((pace.estimate_s([deeper]) or 0.0) - (pace.estimate_s([shallower]) or 0.0)) / 64

    for ctx, speeds in GRID_PROMPT_TOK_S.items():
        for (k, v), tok_s in speeds.items():
            measured = speeds[(F16, F16)] / tok_s
            paced = per_token_s(ctx, k, v) / per_token_s(ctx, F16, F16)
            assert abs(paced / measured - 1) < 0.2, (ctx, k, v, paced, measured)
    # frontier-time-to-answer.md, 2 quiet cores: from the 4,096 f16 trial (6 s), the 8,192 q8_0/q4_0 -t 2 trial
    # was announced at 20 s and took 84 s. Weighed, the pace errs on the side of the budget.
    took = 84.0
    weighed = pace.estimate_s([_plan(8192, Q8, Q4)]) or 0.0
    unweighed = pace.estimate_s([_plan(8192)]) or 0.0
    assert took <= weighed <= 1.5 * took and unweighed < 0.25 * took
    assert pace.estimate_s([_plan(8192, threads=1)]) == pytest.approx(2 * unweighed)
    assert pace.estimate_s([_plan(8192, threads=None)]) == pytest.approx(unweighed)  # every core
    gpu = _pace(cost, gpu=True, cores=2)
    gpu.took([_plan(4096)], 6.0)
    assert gpu.estimate_s([_plan(8192, Q8, Q4)]) == pytest.approx(unweighed)
    assert gpu.estimate_s([_plan(8192, Q8, Q4, device="none")]) == pytest.approx(weighed)


class Clock:
    """A fake ``time`` module: the fake runner below moves it on by each trial's recorded duration."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


# Seconds a demo chat trial takes on 2 quiet cores at -t 2 (frontier-time-to-answer.md): f16 at 4,096 6 s, and
# the 8,192-32,768 f16 batch 355 s less its -t 1 q8_0/q4_0 trial (about 70 s), split by depth as the pace splits
# it; q8_0/q4_0 at 8,192 84 s (4.7x its f16 twin), the other q8_0/q4_0 trials 4.7x their f16 twins.
RECORDED_S = {(4096, F16): 6.0, (8192, F16): 18.0, (16384, F16): 55.0, (32768, F16): 212.0,
              (4096, Q4): 28.0, (8192, Q4): 84.0, (16384, Q4): 259.0, (32768, Q4): 996.0}


class RecordedRunner(FakeFrontierRunner):
    """The fake runner, each trial lasting its recorded duration on the fake clock."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.batches: list[tuple[int, float]] = []  # (trials, seconds) of each batch

    def __call__(self, plans):
        start = self.clock.now
        for p in plans:
            self.clock.now += RECORDED_S[(p.config.ctx, p.config.cache_type_v)]
        self.batches.append((len(plans), self.clock.now - start))
        return super().__call__(plans)


def test_a_trial_the_pace_says_will_not_finish_is_not_started(tmp_path, monkeypatch, demo_f16):
    """The demo chat frontier with its default 7-minute budget, on recorded trial durations, its trials in a set
    order (f16 at 4,096; then 8,192 and 16,384 f16, 8,192 and 4,096 q8_0/q4_0; then 32,768 f16, 16,384 and 32,768
    q8_0/q4_0): the run ends within the budget, and the trials that would not have fitted are told ``unstarted``
    with the pace's figures and counted on the front; a later run measures them. Counted as f16, the 16,384
    q8_0/q4_0 trial looks like it fits in the 229 s left, and takes 259."""
    clock = Clock()
    monkeypatch.setattr(pareto, "time", clock)
    monkeypatch.setattr(watched, "time", clock)
    info = inspect_model(demo_f16)
    fs = pareto.build_frontier_space(demo_f16, info, CPU, CHAT, (4096, 8192, 16384, 32768), threads=(2,),
                                     kv_pairs=[(F16, F16), (Q8, Q4)])
    st, _ = pareto.create_or_load("budget", study.default_storage(tmp_path), pareto.Axes(), seed=0)
    f16 = {cfg.ctx: cfg for _, cfg in pareto.seed_configs(fs, info, CPU)}
    q4 = {ctx: replace(cfg, cache_type_k=Q8, cache_type_v=Q4) for ctx, cfg in f16.items()}
    order = [f16[4096], f16[8192], f16[16384], q4[8192], q4[4096], f16[32768], q4[16384], q4[32768]]
    pareto.enqueue_seeds(st, fs, [(f"order {i}", cfg) for i, cfg in enumerate(order)])
    recorded = RecordedRunner(clock)
    steps: list[str] = []
    out = pareto.run_frontier(st, fs, info, CPU, CHAT, recorded, budget=study.Budget(trials=8, time_s=420.0),
                              axes=pareto.Axes(), kld_of=fake_kld, on_step=steps.append,
                              watch=watched.Unwatched)
    assert out.elapsed_s <= 420.0, (out.elapsed_s, recorded.batches, steps)
    assert [n for n, _ in recorded.batches] == [1, 4, 1] and out.kept["measured"] == 6
    cut = [s for s in steps if s.startswith("not starting ")]
    assert cut[0].startswith("not starting 2 trial(s) (-c 16384 q8_0/q4_0, -c 32768 q8_0/q4_0): about "), steps
    assert cut[-1].endswith("s of the time budget left; the run ends here"), steps  # the sampler's next ones
    unstarted = [t for t in st.trials if t.user_attrs.get("status") == "unstarted"]
    assert len(unstarted) == out.kept["unstarted"] >= 2
    assert all(t.user_attrs["why"].endswith("s of the time budget left") for t in unstarted)
    front = pareto.frontier_of(st, fs, False)
    assert front.unmeasured == ((NOT_STARTED, len(unstarted)),)
    # A later run measures them (an unstarted config is not held: here the whole space), and they are no longer
    # counted.
    pareto.run_frontier(st, fs, info, CPU, CHAT, FakeFrontierRunner(), budget=study.Budget(trials=40),
                        axes=pareto.Axes(), kld_of=fake_kld, watch=watched.Unwatched)
    measured = {str(t.user_attrs["config"]) for t in pareto.measured_trials(st)}
    assert {str(t.user_attrs["config"]) for t in unstarted} <= measured
    assert pareto.frontier_of(st, fs, False).unmeasured == ()


def _ours_running() -> list[str]:
    return [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("llama-")]


def test_a_trial_still_running_when_the_budget_ends_is_stopped_and_counted(engine_loc, demo_models, tmp_path):
    """A deep q8_0/q4_0 trial on one thread (minutes of work) under a 3-second budget: the first trial starts
    whatever the pace (it has learnt nothing yet), and the deadline stops its llama-bench a little past the
    budget. It is told ``stopped``, never ``failed`` (so the next run measures it), its process is gone, and
    the trial line, the summary and report.md say so."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = inspect_model(model)
    fs = pareto.build_frontier_space(model, info, CPU, CHAT, (16384,), threads=(1,), kv_pairs=[(Q8, Q4)])
    st, _ = pareto.create_or_load("stop", study.default_storage(tmp_path), pareto.Axes(), seed=0)
    pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, CPU))
    budget_s = 3.0
    t0 = time.monotonic()
    measure = tune.engine_measure(engine_loc, CHAT, deadline=t0 + budget_s * (1 + tune.DEADLINE_GRACE))
    out = pareto.run_frontier(st, fs, info, CPU, CHAT, measure, budget=study.Budget(trials=3, time_s=budget_s),
                              axes=pareto.Axes(), kld_of=fake_kld, watch=watched.Unwatched)
    took = time.monotonic() - t0
    assert budget_s <= took < budget_s * (1 + tune.DEADLINE_GRACE) + 5, took
    assert not runner.own_pids() and not _ours_running()
    [trial] = st.trials
    assert trial.user_attrs["status"] == "stopped" and trial.user_attrs["why"] == "time budget"
    assert 2.0 <= trial.user_attrs["after_s"] <= took and out.kept == {"stopped": 1}
    line = outcome(study.TrialRecord.from_trial(trial))
    assert line == "stopped at the time budget; the next run measures it"
    front = pareto.frontier_of(st, fs, False, notes=[tune.budget_note(out, budget_s)])
    assert front.unmeasured == (("stopped at the time budget", 1),)
    summary = frontier_report.summary_lines(front)
    assert summary[0] == ("this run took 0:03 of its 0:03 time budget; 1 trial(s) still running at its end were "
                          "stopped; the same command again resumes the study and measures them.")
    assert ("1 of 1 trials not measured: 1 stopped at the time budget; the same command again measures the ones "
            "stopped, not started or cut short.") in summary
    st.set_user_attr("frontier", front.to_dict())
    st.set_user_attr("model", str(model))
    report = frontier_report.markdown(study_result.result_from_study(st))
    assert "- 1 of 1 trials not measured: 1 stopped at the time budget;" in report
    assert pareto.Frontier.from_dict(front.to_dict()) == front


def _record(status, **attrs):
    return study.TrialRecord(0, status, {}, failure=attrs.get("failure"), constraints=attrs.get("constraints", {}))


def test_every_trial_line_says_why_its_trial_was_not_measured():
    timed_out = {"kind": "timed_out", "reason": "it did not finish in time"}
    assert outcome(_record("failed", failure=timed_out)) == "failed: timed out (it did not finish in time)"
    long = {"kind": "crashed", "reason": "exit code 1; last output: " + "x" * 300}
    assert len(outcome(_record("failed", failure=long))) == len("failed: crashed ()") + 160
    assert outcome(_record("unstarted")) == NOT_STARTED + "; the next run measures it"
    assert outcome(_record("infeasible", constraints={pareto.CTX_SHORT: 96.0, "vram_over": -1.0})) == \
        "slots shorter than one request"
    assert outcome(_record("infeasible", constraints={pareto.CTX_SHORT: -1.0, "vram_over": 2.0})) == \
        "does not fit in memory"
    assert outcome(_record("interrupted")) == "cut short by Ctrl-C; the next run measures it"
    assert outcome(SimpleNamespace(status="measured", request_s=1.25, failure=None, constraints={})) == \
        "1.250 s/request"
