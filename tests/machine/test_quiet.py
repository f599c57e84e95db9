"""A quiet machine for measuring: the measuring lock, the wait, and the interference a watch sees.

The suite runs with MOE_TUNE_MACHINE_SCOPE set to its own pid (tests/conftest.py): the competitors below are
this session's children, so the real detection sees them, and other suites on the machine stay out of view.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tuner.core.config import LaunchConfig
from tuner.core.errors import MachineBusyError
from tuner.engine import flags, runner
from tuner.engine.server_client import ServerClient
from tuner.machine import processes, quiet
from tuner.measure.workload import Workload, WorkloadKind
from tuner.search import finish


def _burner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def _claim_from_another_thread(**kwargs) -> BaseException | quiet.Claim:
    """A claim made by another thread of this process (it waits as another process would)."""
    got: list[BaseException | quiet.Claim] = []

    def claim() -> None:
        try:
            with quiet.claim_machine("bench", **kwargs) as c:
                got.append(c)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            got.append(exc)

    t = threading.Thread(target=claim)
    t.start()
    t.join(timeout=60)
    return got[0]


def test_a_second_measuring_run_waits_then_refuses_naming_the_first():
    waits: list[tuple[str, float]] = []
    with quiet.claim_machine("auto-tune") as first:
        assert first.locked and first.noise is None
        t0 = time.monotonic()
        refused = _claim_from_another_thread(wait_s=1.2, on_wait=lambda what, s: waits.append((what, s)))
        assert isinstance(refused, MachineBusyError), refused
        assert re.search(r"moe-tune auto-tune \(pid \d+\) is measuring; waited [12] s\): two measuring runs at once "
                         r"measure each other, --allow-busy or not", str(refused)), refused
        assert 1.2 <= time.monotonic() - t0 < 5
        assert waits and waits[0][0].startswith("waiting for moe-tune auto-tune")
        # --allow-busy measures beside other load, never beside another tuner: it waits for the lock too.
        also_refused = _claim_from_another_thread(wait_s=0.6, allow_busy=True)
        assert isinstance(also_refused, MachineBusyError) and "moe-tune auto-tune" in str(also_refused)
        with quiet.claim_machine("bench", wait_s=0) as nested:  # the same thread nests: it holds the machine
            assert nested.locked
    third = _claim_from_another_thread(wait_s=0)  # released: the next run goes at once
    assert isinstance(third, quiet.Claim) and third.locked


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


class _Rival(ServerClient):
    """A llama-server this test starts itself (not through the runner): someone else's, to the tool."""

    def __init__(self, engine_loc, model) -> None:
        self.host, self.port = "127.0.0.1", runner.free_port()
        self.argv = flags.server_argv(engine_loc.tool("llama-server"), LaunchConfig(model=model, ctx=256, threads=1))
        self.proc = subprocess.Popen([*self.argv, *flags.listen_argv(self.host, self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def log_tail(self) -> str:
        return ""

    @contextlib.contextmanager
    def under_load(self) -> Iterator[None]:
        """Requests one after another, from a thread, until the block ends: the user's server at work."""
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError, ValueError):
                    self.complete("the user's own chat", 48, timeout_s=60)

        loader = threading.Thread(target=serve, daemon=True)
        loader.start()
        try:
            time.sleep(0.5)
            yield
        finally:
            stop.set()
            loader.join(timeout=70)

    def stop(self) -> None:
        _stop(self.proc)


@contextlib.contextmanager
def _rival(engine_loc, model) -> Iterator[_Rival]:
    rival = _Rival(engine_loc, model)
    try:
        rival.wait_healthy(120)  # loading is work: the check looks at an idle server once it has loaded
        yield rival
    finally:
        rival.stop()


@contextlib.contextmanager
def _proxy(folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    """An idle process named ``llama-swap`` (a copy of ``sleep``): the proxy users put in front of servers."""
    exe = folder / "llama-swap"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    proc = subprocess.Popen([str(exe), "600"])
    try:
        yield proc
    finally:
        _stop(proc)


def test_an_idle_llama_server_and_a_proxy_are_residents_and_the_server_at_work_is_busy(engine_loc, demo_models,
                                                                                       tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    quick = ("bench", str(model), "--no-server", "-r", "1", "-p", "8", "-n", "8")
    with _rival(engine_loc, model) as rival, _proxy(tmp_path) as swap:
        [seen] = processes.other_llama_processes()  # the proxy runs no model: not an engine
        assert seen.pid == rival.pid and seen.name == "llama-server" and not seen.ours_earlier
        look = processes.observe(interval_s=1.0)
        assert not look.busy and look.llama == (), look.describe()
        assert set(look.idle_llama) == {f"llama-server pid {rival.pid}", f"llama-swap pid {swap.pid} (a proxy)"}
        t0 = time.monotonic()
        res = run_cli(*quick, "--busy-wait", "20s")
        assert res.returncode == 0, res.stderr
        assert "waiting" not in res.stderr and time.monotonic() - t0 < 20  # measured at once...
        said = [line for line in res.stderr.splitlines() if "idle here:" in line]
        assert len(said) == 1, res.stderr  # ...naming the residents, once
        assert f"llama-server pid {rival.pid}" in said[0] and f"llama-swap pid {swap.pid} (a proxy)" in said[0]
        with rival.under_load():
            busy = processes.observe(interval_s=1.0)
            [working] = busy.llama
            assert busy.busy and working.pid == rival.pid and working.cpu_cores >= processes.LLAMA_WORK_CORES
            assert f"llama-server pid {rival.pid} at work (" in busy.describe()
            refused = run_cli(*quick, "--busy-wait", "2s")
        assert refused.returncode == 1, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert f"llama-server pid {rival.pid} at work" in line and "waited" in line, refused.stderr
        assert f"llama-swap pid {swap.pid}" not in line  # the proxy is still no rival


def test_an_idle_server_on_the_gpu_is_named_with_its_vram_and_what_it_leaves(tmp_path):
    from tests.fakes import FakeNVML

    exe = tmp_path / "llama-server"  # a real process under the name (a copy of sleep): NVML is the fake here
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    server = subprocess.Popen([str(exe), "600"])
    try:
        card = [("NVIDIA GeForce RTX 4090", 24 * 2**30, 14 * 2**30)]
        idle = FakeNVML(card, processes=[(server.pid, 13 * 2**30)], process_sm={}, util_pct=0)
        seen = processes.observe(interval_s=0.2, nvml=idle)
        assert not seen.busy and seen.residents == (f"llama-server pid {server.pid} (13,312 MiB)",)
        assert seen.idle_llama == ()  # named once, with its VRAM
        line = seen.residents_line() or ""
        assert f"the GPU also holds llama-server pid {server.pid} (13,312 MiB)" in line
        assert "they hold 13,312 of 24,576 MiB, so the tune is for the 10,240 MiB left free" in line, line
        small = FakeNVML(card, processes=[(server.pid, 2 * 2**30)], process_sm={}, util_pct=0)
        assert "the tune is for" not in (processes.observe(interval_s=0.2, nvml=small).residents_line() or "")
        working = FakeNVML(card, processes=[(server.pid, 13 * 2**30)], process_sm={server.pid: 60})
        busy = processes.observe(interval_s=0.2, nvml=working)
        assert busy.gpu == (f"llama-server pid {server.pid} uses the GPU (60 % SM)",) and busy.residents == ()
    finally:
        _stop(server)


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
    """Two configs, one clearly slower (-t 1 with a long reply); a rival llama-server serves requests through the
    finish: every round is marked, and no verdict is decided from them."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    fast = LaunchConfig(model=model, ctx=512, parallel=1, threads=2)
    load = Workload(WorkloadKind.CUSTOM, 32, 32, rounds=1)
    with _rival(engine_loc, model) as rival, rival.under_load():  # serving requests: a rival, not a resident
        done = finish.finish(engine_loc, [(0, fast)], [("default", LaunchConfig(model=model, ctx=512, threads=1))],
                             load, log_dir=tmp_path, rounds=finish.Rounds(min=2, max=2))
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
