"""A GPU owner's desktop is a quiet machine; other work on the GPU, a VRAM grab or a loop of short processes
is not. NVML is the FAKE desktop of :mod:`tests.desktop` (the hardware boundary); every process is real."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.desktop import MIB, STANDIN, desktop
from tests.fakes import FakeNVML
from tuner.core.errors import MachineBusyError
from tuner.machine import processes, quiet

pytestmark = pytest.mark.fast


def test_a_desktop_driving_its_monitor_is_quiet_and_its_display_is_named(tmp_path):
    with desktop(tmp_path) as d:
        seen = processes.observe(interval_s=0.3, nvml=d.nvml())
        assert seen.gpu == () and not seen.busy, seen.describe()
        xorg = d.pids["Xorg"]
        assert f"Xorg pid {xorg} (412 MiB)" in seen.residents and len(seen.residents) == 3
        t0 = time.monotonic()
        with quiet.claim_machine("bench", wait_s=0, nvml=d.nvml()) as claim:
            assert claim.noise is None and len(claim.residents) == 3
        assert time.monotonic() - t0 < 5


def test_another_program_at_work_on_the_gpu_makes_a_run_wait_then_refuse(tmp_path):
    with desktop(tmp_path, busy=True) as d:
        trainer = d.pids["trainer"]
        seen = processes.observe(interval_s=0.3, nvml=d.nvml())
        assert seen.busy and seen.gpu == (f"trainer pid {trainer} uses the GPU (95 % SM)",), seen.gpu
        assert all("Xorg" not in g for g in seen.gpu)  # the display is still no rival
        assert not any(f"pid {trainer} " in r for r in seen.residents)  # at work: a rival, not a resident
        refused = rf"trainer pid {trainer} uses the GPU \(95 % SM\); waited [12] s"  # the first look past 1 s
        with pytest.raises(MachineBusyError, match=refused), quiet.claim_machine("bench", wait_s=1.0, nvml=d.nvml()):
            pass
        # Measuring the CPU on purpose (--device none): work on the GPU is no reason to wait.
        with quiet.claim_machine("bench", wait_s=0, nvml=d.nvml(), gpu=False) as claim:
            assert claim.noise is None


def test_device_utilization_that_is_not_ours_is_busy_where_the_driver_has_no_per_process_samples():
    nvml = FakeNVML([("NVIDIA GeForce RTX 3060", 12 * 2**30, 2**30)], util_pct=85, process_sm=None)
    assert processes.observe(interval_s=0.2, nvml=nvml).gpu == ("GPU 0 is 85 % busy and none of it is ours",)
    idle = FakeNVML([("NVIDIA GeForce RTX 3060", 12 * 2**30, 2**30)], util_pct=3, process_sm=None)
    assert not processes.observe(interval_s=0.2, nvml=idle).busy


def _standin(monkeypatch, scenario: Path):
    """The fake pynvml module itself, reading ``scenario`` as a ``moe-tune`` command would."""
    monkeypatch.setenv("MOE_TUNE_FAKE_NVML", str(scenario))
    spec = importlib.util.spec_from_file_location("fake_pynvml", STANDIN / "pynvml.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_another_process_growing_its_vram_while_we_measure_is_seen(tmp_path, monkeypatch):
    with desktop(tmp_path, growing=True) as d:
        nvml = _standin(monkeypatch, d.file)
        with quiet.Watch(interval_s=0.3, nvml=nvml) as watch:
            time.sleep(1.2)
        ollama = d.pids["ollama"]
        [grew] = [g for g in watch.seen.gpu if f"ollama pid {ollama}" in g]
        grown_mib = int(grew.split("by ")[1].split(" MiB")[0].replace(",", ""))
        assert 300 <= grown_mib <= 1200, grew  # 400 MiB/s over a watch of about 1.2-1.8 s
        assert watch.seen.busy and not any("Xorg" in g for g in watch.seen.gpu)


def _short_lived_loop() -> subprocess.Popen[bytes]:
    """A compile-like load: one short process after another, each busy for 50 ms and gone."""
    child = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 0.05: pass"
    return subprocess.Popen(["sh", "-c", f'while :; do "{sys.executable}" -S -c "{child}"; done'])


def _tree_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def test_a_loop_of_short_lived_processes_is_seen(monkeypatch):
    """No process of the loop lives through the window; its load must be seen anyway, as much of it as it took
    (on a shared machine the loop gets less than a core, so the figure is compared with what it really used:
    the shell's own time plus its reaped children's). Summing the processes seen at both ends of the window, as
    this check did before, saw ~0 of it."""
    loop = _short_lived_loop()
    shell = psutil.Process(loop.pid)
    try:
        time.sleep(0.5)
        for scoped in (True, False):
            if not scoped:
                monkeypatch.delenv(processes.SCOPE_ENV, raising=False)  # the whole machine minus our own tree
            used0, t0 = _tree_cpu_s(shell), time.monotonic()
            seen = processes.observe(interval_s=1.5, gpu=False)
            used = (_tree_cpu_s(shell) - used0) / (time.monotonic() - t0)
            assert used > 0.1, used  # the loop really ran
            assert seen.cpu_cores >= 0.7 * used, (scoped, seen.cpu_cores, used)
    finally:
        loop.kill()
        loop.wait()


def test_the_cpu_limit_is_judged_against_the_cores_the_trial_uses():
    physical = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    assert processes.cpu_limit_cores() == 0.5  # llama.cpp's default uses every physical core
    assert processes.cpu_limit_cores(physical) == 0.5
    assert processes.cpu_limit_cores(1) == pytest.approx(0.5 + 0.5 * (physical - 1))


def test_one_lock_per_machine_whatever_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(processes.SCOPE_ENV, raising=False)
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "a"))
    first = quiet.lock_path()
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "b"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert quiet.lock_path() == first == Path("/tmp/moe-tune-measuring.lock")


def test_vram_growth_threshold_ignores_a_few_mib():
    base = {7: 100 * MIB}
    assert processes._grown(base, {7: ("x", 100 * MIB + processes.VRAM_GROWTH_BYTES - MIB)}) == []
    assert processes._grown(base, {7: ("x", 100 * MIB + processes.VRAM_GROWTH_BYTES)}) == \
        ["x pid 7 grew its VRAM by 64 MiB"]
    assert processes._grown({}, {8: ("y", 512 * MIB)}) == ["y pid 8 took 512 MiB of VRAM"]


def test_a_watch_is_judged_for_the_configs_it_watches():
    from tuner.core.config import LaunchConfig

    one_thread = LaunchConfig(model=Path("m.gguf"), threads=1)
    with quiet.watch_for([one_thread]) as w:
        time.sleep(1.3)
    assert w.seen.cpu_limit_cores == processes.cpu_limit_cores(1)
    with quiet.watch_for([one_thread, LaunchConfig(model=Path("m.gguf"))]) as w:  # one uses every core
        time.sleep(1.3)
    assert w.seen.cpu_limit_cores == 0.5


def test_a_child_of_ours_that_exited_unreaped_keeps_its_cpu_in_our_sum():
    """A child that has exited but is not yet reaped (a zombie) still counts as ours: left out, its whole CPU time
    left our sum between two looks and the machine-wide check called it others' work (a benchmark here once
    read "other processes used 352.6 cores" on 2)."""
    code = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
            "print('burnt', flush=True)\nsys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"
        before = processes._View([child.pid]).ours_cpu_s()
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE  # exited, not reaped
        after = processes._View([child.pid]).ours_cpu_s()
        assert after >= before >= 0.5, (before, after)
    finally:
        child.wait()


CARD_24G = [("NVIDIA GeForce RTX 3090", 24 * 2**30, 8 * 2**30)]


@pytest.fixture
def trainer(tmp_path):
    """A real process named ``trainer`` (a copy of ``sleep``): the FAKE NVML says it computes."""
    exe = tmp_path / "trainer"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    proc = subprocess.Popen([str(exe), "600"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_process_at_95_percent_whose_samples_lag_seconds_is_still_seen(trainer):
    """NVML fills its per-process samples every few seconds: a look that asked for the last 0.3 s got none and
    took a training job at 95 % SM for an idle machine."""
    nvml = FakeNVML(CARD_24G, processes=[(trainer.pid, 6 * 2**30)], process_sm={trainer.pid: 95}, sample_lag_s=3.0,
                    util_pct=97)
    seen = processes.observe(interval_s=0.3, nvml=nvml)
    assert seen.busy and seen.gpu == (f"trainer pid {trainer.pid} uses the GPU (95 % SM)",), seen.gpu
    with pytest.raises(MachineBusyError, match=f"trainer pid {trainer.pid} uses the GPU"), \
            quiet.claim_machine("bench", wait_s=0, nvml=nvml):
        pass


def test_no_samples_at_all_is_unknown_and_the_device_utilization_decides(trainer):
    """Samples older than any window (or none kept): "no samples" says nothing, so the card's utilization does."""
    stale = FakeNVML(CARD_24G, processes=[(trainer.pid, 6 * 2**30)], process_sm={trainer.pid: 95}, sample_lag_s=60,
                     util_pct=97)
    assert processes.observe(interval_s=0.3, nvml=stale).gpu == ("GPU 0 is 97 % busy and none of it is ours",)
    none_found = FakeNVML(CARD_24G, processes=[(trainer.pid, 6 * 2**30)], process_sm={}, util_pct=97)
    assert processes.observe(interval_s=0.3, nvml=none_found).busy  # "not found" is not "idle"
    idle = FakeNVML(CARD_24G, processes=[(trainer.pid, 6 * 2**30)], process_sm={}, util_pct=3)
    assert not processes.observe(interval_s=0.3, nvml=idle).busy


def test_samples_of_a_process_that_has_ended_are_no_rival(monkeypatch):
    """A window seconds long still holds samples of a process that has ended (our own last trial, say): it works
    no more, and the card's utilization (its last second) is not read as someone else's either. Unscoped: the
    suite's scope would leave the ended process out anyway."""
    monkeypatch.delenv(processes.SCOPE_ENV, raising=False)
    gone = subprocess.Popen(["true"])
    gone.wait()
    nvml = FakeNVML(CARD_24G, process_sm={gone.pid: 90}, util_pct=90)
    assert processes.observe(interval_s=0.3, nvml=nvml).gpu == ()  # the CPU is other suites' to use meanwhile
    here = subprocess.Popen(["sleep", "60"])  # the same samples of a live process: a rival
    try:
        live = FakeNVML(CARD_24G, process_sm={here.pid: 90}, util_pct=90)
        assert processes.observe(interval_s=0.3, nvml=live).gpu == (f"sleep pid {here.pid} uses the GPU (90 % SM)",)
    finally:
        here.kill()
        here.wait()


def test_an_nvml_error_is_said_once_and_the_watch_does_not_spin(capsys, monkeypatch):
    monkeypatch.setattr(quiet, "_SAID", set())
    nvml = FakeNVML(CARD_24G, lost="GPU is lost")
    with quiet.Watch(interval_s=0.2, nvml=nvml) as watch:
        time.sleep(1.5)
    assert nvml.queries <= 3, nvml.queries  # looked once, then backed off (it once looped without waiting)
    assert not watch.seen.busy and "GPU is lost" in (watch.seen.gpu_error or "")
    with quiet.Watch(interval_s=0.2, nvml=nvml):  # the next trial's watch: not said again
        time.sleep(0.5)
    err = capsys.readouterr().err
    assert err.count("the GPU could not be watched (NVML: GPU is lost)") == 1, err
    monkeypatch.setattr(quiet, "_SAID", set())
    with quiet.claim_machine("bench", wait_s=0, nvml=nvml) as claim:  # the command says the claim's note
        assert "the GPU could not be watched (NVML: GPU is lost)" in (claim.note or "") and claim.noise is None
