"""Frontier trials under the watch: a trial measured while another program burns a core is measured again once
the machine is quiet, or stands on the front marked; the watch is judged for the trials' own configs (a
``--device none`` frontier is blind to work on the GPU); a time budget is kept by the pace of earlier trials
(weighed further in tests/frontier/test_budget.py).

The competitor is a real process (this session's child: the suite's machine scope sees it, tests/conftest.py);
the measurement is the fake runner (the hardware boundary), slowed to last long enough for the watch to look.
Work on the GPU comes from the FAKE desktop of :mod:`tests.desktop` (NVML is the boundary; its processes are real).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.desktop import STANDIN, desktop
from tests.fakes import FakeFrontierRunner
from tests.frontier.test_frontier import CPU, fake_kld
from tuner.cli.cmd_frontier import eta_s
from tuner.core.config import LaunchConfig
from tuner.frontier import pareto, watched
from tuner.measure.workload import WorkloadKind, preset
from tuner.models.gguf_reader import inspect_model
from tuner.report import frontier_report
from tuner.search import study

WATCH_S = 3.0  # a fake batch lasts this long: the watch looks once a second, slower on a loaded machine


@pytest.fixture(scope="module")
def model(demo_models):
    return demo_models[("qwen3moe", "Q4_K_M")]


class Burners:
    """A competing program: another llama.cpp process (not started by the runner, so not ours), which a watch
    calls interference whatever the CPU share it gets on a loaded machine."""

    def __init__(self, engine_loc, model) -> None:
        argv = [str(engine_loc.tool("llama-bench")), "-m", str(model), "-p", "0", "-n", "8", "-r", "100000",
                "-t", "1"]
        self.procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

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


def _frontier(model, tmp_path, runner, trials=2, device=None, **kw):
    load = preset(WorkloadKind.CHAT, 128, 32)
    info = inspect_model(model)
    fs = pareto.build_frontier_space(model, info, CPU, load, (512, 1024), threads=(2,), device=device)
    st, _ = pareto.create_or_load("w", study.default_storage(tmp_path), pareto.Axes(), seed=0)
    pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, CPU))
    steps: list[str] = []
    out = pareto.run_frontier(st, fs, info, CPU, load, runner, budget=study.Budget(trials=trials, **kw),
                              axes=pareto.Axes(), kld_of=fake_kld, on_step=steps.append)
    return st, pareto.frontier_of(st, fs, False), out, steps


def test_a_trial_measured_on_a_busy_machine_that_stays_busy_stands_on_the_front_marked(model, tmp_path, engine_loc):
    hogs = Burners(engine_loc, model)
    try:
        st, front, _, steps = _frontier(model, tmp_path, SlowRunner())
    finally:
        hogs.stop()
    assert front.points and all(p.interference and "llama-bench pid" in p.interference for p in front.points)
    assert not any(p.remeasured for p in front.points)  # the machine was still busy: measuring again is futile
    assert any("still busy: kept, marked" in s for s in steps)
    assert any("were measured while other programs used the machine" in n for n in front.notes)
    assert all(row[3].endswith(frontier_report.BUSY_MARK) for row in frontier_report.rows(front))


def test_a_disturbed_batch_is_measured_again_once_the_machine_is_quiet(model, tmp_path, engine_loc):
    hogs = Burners(engine_loc, model)
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
        others_memory = None  # no other program's memory load: the figures' paging verdicts stand

        def __init__(self, noise):
            self.noise = noise

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    plans = [pareto.Plan(LaunchConfig(model=Path("m.gguf"), ctx=512), 352, 480)] * 3
    figures = iter([[pareto.Measured(2.0), pareto.Measured(1.0), pareto.Stopped(1.0)],
                    [pareto.Measured(1.5), pareto.Measured(3.0), pareto.Measured(4.0)]])
    got = watched.measure_watched(lambda plans: next(figures), plans, watch=lambda cfgs: Noisy("busy"),
                                  quiet_now=lambda cfgs: True)
    assert [m.request_s for m in got.results] == [1.5, 1.0, 4.0] and got.noise == "busy" and got.remeasured
    # The time budget would not hold a second measurement: the first is kept, marked, and not repeated.
    steps: list[str] = []
    once = watched.measure_watched(lambda plans: [pareto.Measured(2.0)] * 3, plans, watch=lambda cfgs: Noisy("busy"),
                                   quiet_now=lambda cfgs: True, on_step=steps.append, left_s=lambda: -1.0)
    assert once.noise == "busy" and not once.remeasured and "no time left to measure them again" in steps[0]


def _standin_nvml(monkeypatch, scenario: Path):
    """The FAKE pynvml module reading ``scenario``, imported where the tool imports ``pynvml``."""
    monkeypatch.setenv("MOE_TUNE_FAKE_NVML", str(scenario))
    spec = importlib.util.spec_from_file_location("fake_pynvml", STANDIN / "pynvml.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)


def test_a_device_none_frontier_is_not_disturbed_by_work_on_the_gpu(model, tmp_path, monkeypatch):
    """Another program at work on the GPU (95 % SM) disturbs a frontier whose trials may use the GPU, and is no
    concern of one measuring the CPU on purpose (``--device none``): the default watch and the quiet look are
    judged for the batch's configs."""
    with desktop(tmp_path, busy=True) as d:
        _standin_nvml(monkeypatch, d.file)
        trainer = d.pids["trainer"]
        _, on_cpu, _, cpu_steps = _frontier(model, tmp_path / "none", SlowRunner(), device="none")
        _, any_dev, _, gpu_steps = _frontier(model, tmp_path / "gpu", SlowRunner())
        on_gpu = LaunchConfig(model=Path("m.gguf"))
        quiet_for_cpu = watched.machine_quiet([replace(on_gpu, device="none")])
        quiet_for_gpu = watched.machine_quiet([on_gpu])
    assert on_cpu.points and all(p.interference is None for p in on_cpu.points), on_cpu.points
    assert not any("busy machine" in s for s in cpu_steps)
    assert any_dev.points and all(f"trainer pid {trainer} uses the GPU" in (p.interference or "")
                                  for p in any_dev.points), any_dev.points
    assert any("still busy: kept, marked" in s for s in gpu_steps)
    assert quiet_for_cpu and not quiet_for_gpu


def test_a_time_budget_ends_the_run_by_the_pace_of_earlier_trials(model, tmp_path):
    """Each fake batch lasts at least WATCH_S (more on a loaded machine, with the watch's own looks): a 5-second
    budget holds at most 5 / WATCH_S of them, however many trials the budget would allow."""
    runner = SlowRunner()
    st, front, out, _ = _frontier(model, tmp_path, runner, trials=40, time_s=5.0)
    assert 1 <= runner.batches <= int(5.0 / WATCH_S) and out.trials_this_run < 40
    assert out.elapsed_s < 5.0 + 2 * WATCH_S + 10  # a batch admitted by the pace may overrun by its own length
    cut = [t for t in st.trials if t.user_attrs.get("status") == "unstarted"]
    assert all("s at this run's pace" in t.user_attrs["why"] for t in cut)


def test_pace_counts_the_depth_and_the_eta_never_passes_the_time_budget():
    load = preset(WorkloadKind.CHAT, 128, 32)
    pace = watched.Pace(load.prompt_tokens + load.gen_tokens)
    cfg = LaunchConfig(model=Path(__file__), ctx=1024)
    shallow = pareto.Plan(cfg, 864, 992)
    deep = pareto.Plan(cfg, 7000, 8000)
    assert pace.fitting([deep, deep], 1.0) == [0, 1] and pace.estimate_s([deep]) is None  # nothing learnt yet
    pace.took([shallow], 1.0)  # 992 + 160 tokens in one second
    assert pace.estimate_s([deep]) == pytest.approx(8160 / 1152)
    assert pace.fitting([shallow, deep, shallow], 9.0) == [0, 1] and pace.fitting([shallow], 0.0) == []
    # One that would not fit is passed over; a cheaper one after it still goes.
    assert pace.fitting([deep, shallow, deep], 8.5) == [0, 1]
    assert pace.fitting([deep, shallow], 2.0) == [1]
    assert eta_s(2, 10, 60.0, None) == pytest.approx(240.0)
    assert eta_s(2, 10, 60.0, 120.0) == pytest.approx(60.0)  # the budget ends first
    assert eta_s(0, 10, 5.0, None) is None


def test_a_long_list_of_other_processes_is_named_briefly():
    noise = "; ".join(f"llama-bench pid {i}" for i in range(40)) + "; other processes use 1.9 CPU cores"
    assert watched.brief(noise) == ("llama-bench pid 0; llama-bench pid 1; llama-bench pid 2; 37 more processes; "
                                    "other processes use 1.9 CPU cores")
    assert watched.brief("other processes use 0.7 CPU cores") == "other processes use 0.7 CPU cores"
    cpu = "other processes use 1.9 CPU cores (cc1plus pid 7 1.2)"  # the CPU line's names are no process line
    assert watched.brief(noise.replace("other processes use 1.9 CPU cores", cpu)).endswith("37 more processes; " + cpu)
    assert watched.brief(None) is None


def test_a_run_cut_by_its_budget_names_the_contexts_it_did_not_reach(model, tmp_path):
    load = preset(WorkloadKind.CHAT, 128, 32)
    info = inspect_model(model)
    fs = pareto.build_frontier_space(model, info, CPU, load, (512, 1024, 2048), threads=(2,))
    st, _ = pareto.create_or_load("cut", study.default_storage(tmp_path), pareto.Axes(), seed=0)
    pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, CPU))
    pareto.run_frontier(st, fs, info, CPU, load, FakeFrontierRunner(), budget=study.Budget(trials=1),
                        axes=pareto.Axes(), kld_of=fake_kld, batch_trials=1)
    front = pareto.frontier_of(st, fs, False)
    assert [p.ctx for p in front.points] == [512]
    assert any(n.startswith("no point measured at 1,024, 2,048 within this run's budget") for n in front.notes)


def test_a_long_batch_says_it_is_still_measuring():
    """Off a terminal a batch of deep trials ran 322 s without a line: a heartbeat line comes every interval while
    it runs, none after it ends, and none when nobody listens."""
    lines: list[str] = []
    with watched.heartbeat(lines.append, "4 trial(s)", every_s=0.1):
        time.sleep(0.35)
    count = len(lines)
    time.sleep(0.25)
    assert 2 <= count <= 4 and len(lines) == count, lines
    assert lines[0].startswith("still measuring 4 trial(s): 0:00 so far")
    with watched.heartbeat(None, "x", every_s=0.01):
        time.sleep(0.05)


def test_the_pace_weighs_attention_at_depth_as_measured_on_the_demo_model(tmp_path):
    """Batch times logged by `auto-tune --frontier` on the demo model, 2 quiet cores, in
    results/benchmarks/frontier-time-to-answer.md (chat: a 4,096 trial in 6 s, then 8,192, 16,384, 32,768 and
    8,192 in 322 s; batch: 4,096 in 8 s, then 4,096 x2 slots, 4,096 x4, 8,192, 8,192 x2 in 43 s, then 8,192 x4,
    16,384, 16,384 x2, 16,384 x4 in 179 s). Learnt from the earlier batches, the estimate of each later one is
    within 25 % of what it took; counting tokens alone puts the deep chat batch at less than 60 % of its time."""
    from tuner.models import demo

    [f16] = demo.make_demo_models(out=tmp_path)
    cost = watched.Cost.of(inspect_model(f16.path))

    def plans(load, points):
        cfgs = [LaunchConfig(model=f16.path, ctx=c, parallel=n) for c, n in points]
        return [pareto.Plan(cfg, *pareto.depths(load, cfg.ctx, cfg.parallel)) for cfg in cfgs]

    def estimates(kind, batches, c):
        load = preset(kind)
        pace = watched.Pace(load.prompt_tokens + load.gen_tokens, c)
        out = []
        for points, took in batches:
            out.append((pace.estimate_s(plans(load, points)), took))
            pace.took(plans(load, points), took)
        return out[1:]

    chat = [([(4096, 1)], 6), ([(8192, 1), (16384, 1), (32768, 1), (8192, 1)], 322)]
    batch = [([(4096, 1)], 8), ([(4096, 2), (4096, 4), (8192, 1), (8192, 2)], 43),
             ([(8192, 4), (16384, 1), (16384, 2), (16384, 4)], 179)]
    for kind, batches in ((WorkloadKind.CHAT, chat), (WorkloadKind.BATCH, batch)):
        assert all(abs(est / took - 1) < 0.25 for est, took in estimates(kind, batches, cost)), kind
    [(est, took)] = estimates(WorkloadKind.CHAT, chat, watched.Cost())  # tokens alone
    assert est / took < 0.6
