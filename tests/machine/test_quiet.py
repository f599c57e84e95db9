"""A quiet machine for measuring: the measuring lock, the wait, and the interference a watch sees.

The suite runs with MOE_TUNE_MACHINE_SCOPE set to its own pid (tests/conftest.py): the competitors below are
this session's children, so the real detection sees them, and other suites on the machine stay out of view.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import run_cli
from tuner.core.config import LaunchConfig
from tuner.core.errors import MachineBusyError
from tuner.engine import flags, runner
from tuner.machine import processes, quiet
from tuner.measure.workload import Workload, WorkloadKind
from tuner.search import finish


def _burner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def test_a_second_measuring_run_waits_then_refuses_naming_the_first():
    waits: list[tuple[str, float]] = []
    with quiet.claim_machine("auto-tune") as first:
        assert first.locked and first.noise is None
        t0 = time.monotonic()
        with pytest.raises(MachineBusyError, match=r"moe-tune auto-tune \(pid \d+\) is measuring.*--allow-busy"), \
                quiet.claim_machine("bench", wait_s=1.2, on_wait=lambda what, s: waits.append((what, s))):
            pass
        assert 1.2 <= time.monotonic() - t0 < 5
        assert waits and waits[0][0].startswith("waiting for moe-tune auto-tune")
        with quiet.claim_machine("bench", allow_busy=True) as second:
            assert not second.locked and "moe-tune auto-tune" in (second.noise or "")
    with quiet.claim_machine("bench", wait_s=0) as third:  # released: the next run goes at once
        assert third.locked


def test_cpu_load_of_another_process_is_seen_and_our_own_child_is_not():
    hog = _burner()
    try:
        time.sleep(0.2)
        seen = processes.observe(interval_s=1.0)
        assert seen.cpu_cores > 0.2, seen
        # The same load started by the runner is ours: it is not interference.
        with runner.hold([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"],
                         ready_timeout_s=10, what="burner", fix="none") as held:
            assert held.pid in runner.own_pids()
            _stop(hog)
            ours = processes.observe(runner.own_pids(), interval_s=1.0)
        assert ours.cpu_cores < 0.2, ours
        assert held.pid not in runner.own_pids()
    finally:
        if hog.poll() is None:
            _stop(hog)


def test_gpu_work_of_others_is_interference_and_ours_is_not():
    from tests.fakes import FakeNVML

    other = _burner()
    try:
        nvml = FakeNVML(cards=[("NVIDIA GeForce RTX 3090", 24 * 2**30, 3 * 2**30)],
                        processes=[(os.getpid(), 2**30), (other.pid, 2**31)],
                        process_sm={os.getpid(): 90, other.pid: 40})
        seen = processes.observe(interval_s=0.2, nvml=nvml)
        [gpu] = seen.gpu  # ours is not listed
        assert seen.busy and gpu == f"python pid {other.pid} uses the GPU (40 % SM)" or \
            gpu.endswith(f"pid {other.pid} uses the GPU (40 % SM)"), gpu
        # The same context holding VRAM and running nothing is a resident, not a rival.
        idle = FakeNVML(cards=[("NVIDIA GeForce RTX 3090", 24 * 2**30, 3 * 2**30)],
                        processes=[(other.pid, 2**31)], process_sm={})
        quiet_look = processes.observe(interval_s=0.2, nvml=idle)
        assert quiet_look.gpu == () and any(f"pid {other.pid} (2,048 MiB)" in r for r in quiet_look.residents)
    finally:
        _stop(other)


def _competitor(engine_loc, model) -> subprocess.Popen[bytes]:
    """A llama-server this test starts itself (not through the runner): someone else's, to the tool."""
    argv = flags.server_argv(engine_loc.tool("llama-server"), LaunchConfig(model=model, ctx=256, threads=1))
    proc = subprocess.Popen([*argv, *flags.listen_argv("127.0.0.1", runner.free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return proc


def test_another_llama_process_makes_the_cli_wait_then_refuse(engine_loc, demo_models):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    rival = _competitor(engine_loc, model)
    try:
        [seen] = processes.other_llama_processes()
        assert seen.pid == rival.pid and seen.name == "llama-server" and not seen.ours_earlier
        t0 = time.monotonic()
        res = run_cli("bench", str(model), "--no-server", "-r", "1", "-p", "8", "-n", "8", "--busy-wait", "2s")
        assert res.returncode == 1, res.stderr
        # Output is not a terminal: one line when the wait starts, then the refusal.
        started, *_, line = res.stderr.strip().splitlines()
        assert started.startswith(f"waiting for a quiet machine: llama-server pid {rival.pid}"), started
        # The wait ends at the first look past 2 s (on a loaded machine a look takes a while): 2 or 3 s.
        assert f"llama-server pid {rival.pid}" in line and "--allow-busy" in line, res.stderr
        assert "waited 2 s" in line or "waited 3 s" in line, line
        assert time.monotonic() - t0 < 30
        ok = run_cli("bench", str(model), "--no-server", "-r", "1", "-p", "8", "-n", "8", "--allow-busy")
        assert ok.returncode == 0, ok.stderr
        assert f"warning: measuring on a busy machine: llama-server pid {rival.pid}" in ok.stderr
    finally:
        _stop(rival)


def test_ctrl_c_while_waiting_exits_cleanly(demo_models):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    exe = os.path.join(os.path.dirname(sys.executable), "moe-tune")
    with quiet.claim_machine("auto-tune"):
        proc = subprocess.Popen([exe, "bench", str(model), "--no-server", "--busy-wait", "1m"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=os.environ | {"COLUMNS": "200"})
        assert proc.stderr is not None
        first = proc.stderr.readline()  # not a terminal: one line when the wait starts
        assert first.startswith("waiting for moe-tune auto-tune"), first
        assert proc.poll() is None  # still waiting for us
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 130 and stderr.strip().endswith("interrupted"), stderr
    assert "Traceback" not in stderr


def test_finish_rounds_under_a_competitor_decide_nothing(engine_loc, demo_models, tmp_path):
    """Two configs, one clearly slower (-t 1 with a long reply); a rival llama-server runs through the finish:
    every round is marked, and no verdict is decided from them."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    fast = LaunchConfig(model=model, ctx=512, parallel=1, threads=2)
    load = Workload(WorkloadKind.CUSTOM, 32, 32, rounds=1)
    rival = _competitor(engine_loc, model)
    try:
        done = finish.finish(engine_loc, [(0, fast)], [("default", LaunchConfig(model=model, ctx=512, threads=1))],
                             load, log_dir=tmp_path, rounds=finish.Rounds(min=2, max=2))
    finally:
        _stop(rival)
    [cand], [default] = done.candidates, done.baselines
    assert all(f"llama-server pid {rival.pid}" in (n or "") for n in (*cand.interference, *default.interference))
    [v] = done.verdicts
    assert v.outcome == "undecided" and v.busy_rounds == 2 and "busy machine" in v.describe()


def test_verdict_leaves_out_disturbed_rounds():
    def arm(label: str, scores: list[float], busy: list[str | None]) -> finish.ServerMeasurement:
        return finish.ServerMeasurement(label, {}, "", [], 1.0, [], None, None, None, None, scores=list(scores),
                                        interference=busy)

    quiet_rounds = [None] * 4
    a = arm("candidate-1", [2.0, 2.1, 1.9, 2.0], quiet_rounds)
    b = arm("default", [1.0] * 4, quiet_rounds)
    assert finish.Finish((a,), (b,)).verdict(a, b).outcome == "better"
    disturbed = arm("candidate-1", [2.0, 2.1, 1.9, 2.0], ["llama-server pid 7", None, "llama-server pid 7", None])
    v = finish.Finish((disturbed,), (b,)).verdict(disturbed, b)
    assert v.rounds == 2 and v.busy_rounds == 2 and v.ratio == pytest.approx(2.05)  # the quiet rounds only
    assert "2 rounds measured on a busy machine left out" in v.describe()
    all_busy = arm("candidate-1", [2.0, 2.1, 1.9, 2.0], ["1.2 CPU cores"] * 4)
    v = finish.Finish((all_busy,), (b,)).verdict(all_busy, b)
    assert v.outcome == "undecided" and v.busy_rounds == 4 and "every round" in v.describe()


def test_a_second_run_runs_no_engine_before_it_holds_the_machine(demo_models, tmp_path):
    """A second auto-tune while the first measures: it waits, and while it waits nothing of the engine runs
    (no llama-fit-params, KV pricing or demo model), so the first run's figures are not disturbed."""
    import psutil

    model = demo_models[("qwen3moe", "Q4_K_M")]
    exe = os.path.join(os.path.dirname(sys.executable), "moe-tune")
    with quiet.claim_machine("auto-tune"):
        proc = subprocess.Popen([exe, "auto-tune", str(model), "--trials", "2", "--busy-wait", "4s",
                                 "--results-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=os.environ | {"COLUMNS": "200"})
        spawned: set[str] = set()
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                spawned |= {c.name() for c in psutil.Process(proc.pid).children(recursive=True)}
            time.sleep(0.05)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "is measuring" in stderr and "waited 4 s" in stderr, stderr
    assert not {n for n in spawned if n.startswith("llama-")}, spawned
    assert stderr.splitlines()[0].startswith("waiting for moe-tune auto-tune"), stderr  # one line when it starts
