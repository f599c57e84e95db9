"""Frontier trials under the watch: a trial measured while another program burns a core is measured again once
the machine is quiet, or stands on the front marked; a time budget is kept by the pace of earlier trials.

The competitor is a real process (this session's child: the suite's machine scope sees it, tests/conftest.py);
the measurement is the fake runner (the hardware boundary), slowed to last long enough for the watch to look.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes import FakeFrontierRunner
from tests.frontier.test_frontier import CPU, fake_kld
from tuner.cli.cmd_frontier import eta_s
from tuner.core.config import LaunchConfig
from tuner.frontier import pareto, watched
from tuner.measure.workload import WorkloadKind, preset
from tuner.models.gguf_reader import inspect_model
from tuner.report import frontier_report
from tuner.search import study

WATCH_S = 1.5  # a fake batch lasts this long: the watch looks at the machine once a second


@pytest.fixture(scope="module")
def model(demo_models):
    return demo_models[("qwen3moe", "Q4_K_M")]


class Burners:
    """Competing programs: several busy loops, so that even on a loaded 2-core machine they take more than the
    half core a watch calls busy."""

    def __init__(self, n: int = 4) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class SlowRunner(FakeFrontierRunner):
    """The fake runner, each batch lasting WATCH_S; ``on_batch(n)`` runs after batch n (0-based)."""

    def __init__(self, on_batch=None) -> None:
        super().__init__()
        self.batches = 0
        self.on_batch = on_batch

    def __call__(self, plans):
        time.sleep(WATCH_S)
        out = super().__call__(plans)
        if self.on_batch:
            self.on_batch(self.batches)
        self.batches += 1
        return out


def _frontier(model, tmp_path, runner, trials=2, **kw):
    load = preset(WorkloadKind.CHAT, 128, 32)
    info = inspect_model(model)
    fs = pareto.build_frontier_space(model, info, CPU, load, (512, 1024), threads=(2,))
    st, _ = pareto.create_or_load("w", study.default_storage(tmp_path), pareto.Axes(), seed=0)
    pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, CPU))
    steps: list[str] = []
    out = pareto.run_frontier(st, fs, info, CPU, load, runner, budget=study.Budget(trials=trials, **kw),
                              axes=pareto.Axes(), kld_of=fake_kld, on_step=steps.append)
    return st, pareto.frontier_of(st, fs, False), out, steps


def test_a_trial_measured_on_a_busy_machine_that_stays_busy_stands_on_the_front_marked(model, tmp_path):
    hogs = Burners()
    try:
        st, front, _, steps = _frontier(model, tmp_path, SlowRunner())
    finally:
        hogs.stop()
    assert front.points and all(p.interference and "CPU cores" in p.interference for p in front.points)
    assert not any(p.remeasured for p in front.points)  # the machine was still busy: measuring again is futile
    assert any("still busy: kept, marked" in s for s in steps)
    assert any("were measured while other programs used the machine" in n for n in front.notes)
    assert all(row[3].endswith(frontier_report.BUSY_MARK) for row in frontier_report.rows(front))


def test_a_disturbed_batch_is_measured_again_once_the_machine_is_quiet(model, tmp_path):
    hogs = Burners()
    runner = SlowRunner(on_batch=lambda n: hogs.stop() if n == 0 else None)
    try:
        st, front, _, steps = _frontier(model, tmp_path, runner)
    finally:
        hogs.stop()
    assert runner.batches == 2  # the batch, then once more on the quiet machine
    assert front.points and all(p.interference is None and p.remeasured for p in front.points)
    assert any("quiet now: measuring again" in s for s in steps)
    assert not any(r[3].endswith(frontier_report.BUSY_MARK) for r in frontier_report.rows(front))


def test_a_quiet_batch_is_measured_once_and_unmarked(model, tmp_path):
    runner = FakeFrontierRunner()
    _, front, _, _ = _frontier(model, tmp_path, runner)
    assert len(runner.plans) == 2 and all(p.interference is None and not p.remeasured for p in front.points)


def test_both_measurements_disturbed_keep_the_faster_and_stay_marked():
    class Noisy:
        def __init__(self, noise):
            self.noise = noise

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    figures = iter([[pareto.Measured(2.0), pareto.Measured(1.0)], [pareto.Measured(1.5), pareto.Measured(3.0)]])
    got = watched.measure_watched(lambda plans: next(figures), [0, 1], watch=lambda: Noisy("busy"),
                                  quiet_now=lambda: True)
    assert [m.request_s for m in got.results] == [1.5, 1.0] and got.noise == "busy" and got.remeasured


def test_a_time_budget_ends_the_run_by_the_pace_of_earlier_trials(model, tmp_path):
    """Each fake batch lasts WATCH_S; a 5-second budget holds a few, never a batch that would overrun it."""
    runner = SlowRunner()
    t0 = time.monotonic()
    st, front, out, _ = _frontier(model, tmp_path, runner, trials=40, time_s=5.0)
    took = time.monotonic() - t0
    assert took < 5.0 + WATCH_S, took  # the last batch was cut to what fitted
    assert runner.batches >= 2 and len(runner.plans) >= 2 and out.trials_this_run < 40
    cut = [t for t in st.trials if t.user_attrs.get("why") == "time budget"]
    assert all(t.user_attrs["status"] == "interrupted" for t in cut)


def test_pace_counts_the_depth_and_the_eta_never_passes_the_time_budget():
    load = preset(WorkloadKind.CHAT, 128, 32)
    pace = watched.Pace(load.prompt_tokens + load.gen_tokens)
    cfg = LaunchConfig(model=Path(__file__), ctx=1024)
    shallow = pareto.Plan(cfg, 864, 992)
    deep = pareto.Plan(cfg, 7000, 8000)
    assert pace.fitting([deep, deep], 1.0) == 2 and pace.estimate_s([deep]) is None  # nothing learnt yet
    pace.took([shallow], 1.0)  # 992 + 160 tokens in one second
    assert pace.estimate_s([deep]) == pytest.approx(8160 / 1152)
    assert pace.fitting([shallow, deep, shallow], 9.0) == 2 and pace.fitting([shallow], 0.0) == 0
    assert eta_s(2, 10, 60.0, None) == pytest.approx(240.0)
    assert eta_s(2, 10, 60.0, 120.0) == pytest.approx(60.0)  # the budget ends first
    assert eta_s(0, 10, 5.0, None) is None
