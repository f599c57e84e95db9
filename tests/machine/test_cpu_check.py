"""The CPU check a user's run makes, unscoped: the whole machine's CPU time minus our own process tree; and whose
that time is, and what is no program's (the hypervisor's steal, interrupts).

The suite is scoped to its own processes (tests/conftest.py); these tests opt out (the ``unscoped`` fixture) and
face the real machine, other test suites' load included, so each bound is judged against what the machine really
did in the very window the check judged (its reads of /proc/stat spied on, the processes read beside them), not
against a fixed figure.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tuner.machine import cpu_time, processes

pytestmark = pytest.mark.fast
WINDOW_S = 3.0
TICK_SLACK_S = 0.05  # CPU times come in 10 ms clock ticks, read a few ms apart
LOOK_S = 0.5  # what the check's second look at the process table may take on a loaded machine


def _machine_work_s() -> float:
    """CPU time the whole machine spent in processes' context so far (/proc/stat's user, nice and system, through
    psutil): what a program's work shows as, and no hypervisor's steal nor interrupts."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _burner(exit_after_s: float | None = None, python: str = sys.executable) -> subprocess.Popen[str]:
    """A process busy on one core: it prints "ready" after its first 0.3 s of CPU, then burns on, forever or for
    ``exit_after_s`` of wall time (then it exits, and is not reaped until the test says so). ``python``: the
    interpreter to run it with (its file name is the process's name)."""
    code = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print('ready', flush=True)\nend = time.monotonic() + float(sys.argv[1])\n"
            "while time.monotonic() < end: pass\n")
    proc = subprocess.Popen([python, "-c", code, str(exit_after_s or "inf")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _kernel_threads_s() -> float:
    """CPU time of the kernel's threads (kthreadd, pid 2, and its children), read from /proc through psutil."""
    total = 0.0
    for p in psutil.process_iter(["pid", "ppid", "cpu_times"]):
        if (p.info["pid"] == 2 or p.info["ppid"] == 2) and p.info["cpu_times"] is not None:
            total += p.info["cpu_times"].user + p.info["cpu_times"].system
    return total


def _look(own: list[int], watched: psutil.Process, monkeypatch) -> tuple[processes.Interference, float, float,
                                                                          float, float]:
    """The check's figure, with what the machine, the watched process, this process and the kernel's threads did
    over the very window it judged: (seen, machine work s, watched s, ours s, kernel s). The check's reads of the
    machine's CPU time are spied on (passed through unchanged), and the machine and the processes are read at the
    same moments, independently of the check."""
    me = psutil.Process()
    reads: list[tuple[float, float, float, float]] = []
    real = cpu_time.read

    def spied() -> cpu_time.CpuTime:
        value = real()
        reads.append((_machine_work_s(), _cpu_s(watched), _cpu_s(me), _kernel_threads_s()))
        return value

    monkeypatch.setattr(cpu_time, "read", spied)
    seen = processes.observe(own, interval_s=WINDOW_S, gpu=False)
    (b0, w0, m0, k0), (b1, w1, m1, k1) = reads
    return seen, b1 - b0, w1 - w0, m1 - m0, max(0.0, k1 - k0)


def test_a_strangers_load_is_counted_and_never_more_than_the_machine_did(unscoped, monkeypatch):
    stranger = _burner()  # not started by the runner: someone else's, to the check
    try:
        seen, machine_s, stranger_s, me_s, kernel_s = _look([], psutil.Process(stranger.pid), monkeypatch)
    finally:
        stranger.kill()
        stranger.wait()
    others_s = machine_s - me_s  # the stranger included
    assert stranger_s / WINDOW_S > 0.1, stranger_s  # it really ran
    # The window the check divides by is the one it judged plus the time its second look took: a little longer.
    # The kernel's threads count only for the share of major faults others took: at least user programs' work.
    assert seen.cpu_cores >= (stranger_s - TICK_SLACK_S) / (WINDOW_S + LOOK_S), (seen.cpu_cores, stranger_s)
    assert seen.cpu_cores >= (others_s - kernel_s - TICK_SLACK_S) / (WINDOW_S + LOOK_S), (seen.cpu_cores, others_s)
    # Upper bound: no more than everyone but us did (a zombie's CPU once left our sum: "352.6 cores" on 2).
    assert seen.cpu_cores <= (others_s + TICK_SLACK_S) / WINDOW_S, (seen.cpu_cores, others_s)
    assert seen.cpu_cores <= (psutil.cpu_count() or 1)


def test_our_own_busy_child_is_left_out_even_when_it_exits_during_the_look(unscoped, monkeypatch):
    """Our child burns a core through most of the window and exits in it, unreaped (a zombie): neither its work
    nor its CPU time leaving the process table may count as someone else's."""
    child = _burner(exit_after_s=2.0)  # it exits about 2 s into the 3 s window
    watched = psutil.Process(child.pid)
    try:
        seen, machine_s, child_s, me_s, kernel_s = _look([child.pid], watched, monkeypatch)
        assert watched.status() == psutil.STATUS_ZOMBIE  # exited during the look, not yet reaped
    finally:
        child.wait()
    assert child_s > 10 * TICK_SLACK_S, child_s  # it really worked in the window (else the test shows nothing)
    others_s = machine_s - child_s - me_s  # what everyone else did in the window the check judged
    assert seen.cpu_cores <= (others_s + TICK_SLACK_S) / WINDOW_S, (seen.cpu_cores, others_s, child_s)
    assert seen.cpu_cores >= (others_s - kernel_s - TICK_SLACK_S) / (WINDOW_S + LOOK_S), (seen.cpu_cores, others_s)
    if others_s / WINDOW_S < 0.2:  # the machine was otherwise idle: the check reads it as quiet
        assert not seen.busy, seen.describe()


STEAL_CORES = 2.0
SOFTIRQ_CORES = 0.6


def _fake_steal_accounting(monkeypatch) -> None:
    """FAKE of the hypervisor's steal accounting (the kernel/hypervisor boundary, which no test here can drive): the
    machine's /proc/stat reading, through psutil, with the hypervisor withholding STEAL_CORES vCPUs from now on and
    SOFTIRQ_CORES of interrupt work on top (what our own GPU, disk and loopback traffic raise). Every other column
    is the real machine's."""
    real, start = psutil.cpu_times, time.monotonic()

    def cpu_times(percpu: bool = False):
        t = real(percpu)
        if percpu:
            return t
        held = time.monotonic() - start
        return t._replace(steal=t.steal + STEAL_CORES * held, softirq=t.softirq + SOFTIRQ_CORES * held)

    monkeypatch.setattr(psutil, "cpu_times", cpu_times)


def test_steal_with_nothing_else_running_is_said_never_counted_as_others(unscoped, monkeypatch):
    """A VM whose vCPUs our llama-server keeps busy: the hypervisor withholds 2 of them. That is no other program's
    work: counted as such, every round of an H100 VM running nothing else was "disturbed" and the tune decided
    nothing."""
    _fake_steal_accounting(monkeypatch)
    me = psutil.Process()
    seen, machine_s, _, me_s, _ = _look([], me, monkeypatch)
    others_s = machine_s - me_s  # the real machine's work by everyone but us, in the window the check judged
    assert seen.cpu_cores <= (others_s + TICK_SLACK_S) / WINDOW_S, (seen.cpu_cores, others_s)
    low, high = WINDOW_S / (WINDOW_S + LOOK_S), (WINDOW_S + LOOK_S) / WINDOW_S
    assert STEAL_CORES * low <= seen.steal_cores <= STEAL_CORES * high, seen.steal_cores
    assert SOFTIRQ_CORES * low <= seen.irq_cores, seen.irq_cores  # the real interrupts on top
    said = seen.describe()
    assert f"the hypervisor withheld {seen.steal_cores:.1f} cores (steal)" in said, said
    assert f"serving interrupts took {seen.irq_cores:.1f} cores (irq, softirq)" in said, said
    if others_s / WINDOW_S < 0.2:  # the machine was otherwise idle: quiet, steal or not
        assert not seen.busy and "other processes" not in said, said


def test_another_process_burning_cpu_is_busy_and_named(tmp_path):
    """A real rival on one core, under the suite's scope: busy, and named by its process name and pid."""
    python = tmp_path / "moe-rival"
    python.symlink_to(sys.executable)  # the process's name is its program's file name
    rival = _burner(python=str(python))
    try:
        seen = processes.observe(interval_s=1.0, gpu=False)
    finally:
        rival.kill()
        rival.wait()
    assert not psutil.pid_exists(rival.pid)
    name, pid, cores = seen.cpu_named[0]
    assert (name, pid) == ("moe-rival", rival.pid) and cores >= processes.NOTABLE_CORES, seen.cpu_named
    assert seen.busy and f"CPU cores (moe-rival pid {rival.pid} {cores:.1f}" in seen.describe(), seen.describe()


def test_whose_cpu_time_and_no_ones_are_said_and_kept_by_a_watch():
    compiling = processes.Interference(cpu_cores=1.5, cpu_named=(("cc1plus", 123, 0.4),), short_lived_cores=1.1)
    assert compiling.describe() == ("other processes use 1.5 CPU cores (cc1plus pid 123 0.4, the rest 1.1 by "
                                    "short-lived processes)")
    stolen = processes.Interference(cpu_cores=0.1, steal_cores=1.2, irq_cores=0.1)
    assert not stolen.busy and stolen.describe() == "the hypervisor withheld 1.2 cores (steal)"
    both = stolen.worse(compiling)  # a watch's looks: the heavier CPU look's names, the most steal seen
    assert both.cpu_named == compiling.cpu_named and both.short_lived_cores == 1.1 and both.steal_cores == 1.2
    assert both.describe().endswith("short-lived processes); the hypervisor withheld 1.2 cores (steal)")
    assert compiling.worse(stolen).cpu_named == compiling.cpu_named
