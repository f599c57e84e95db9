"""The CPU check a user's run makes, unscoped: the whole machine's CPU time minus our own process tree.

The suite is scoped to its own processes (tests/conftest.py); these tests opt out (the ``unscoped`` fixture) and
face the real machine, other test suites' load included, so each bound is judged against what the machine really
did in the very window the check judged (its reads of /proc/stat spied on, the processes read beside them), not
against a fixed figure.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from tuner.machine import processes

pytestmark = pytest.mark.fast
WINDOW_S = 3.0
TICK_SLACK_S = 0.05  # CPU times come in 10 ms clock ticks, read a few ms apart
LOOK_S = 0.5  # what the check's second look at the process table may take on a loaded machine


def _machine_busy_s() -> float:
    """CPU time the whole machine spent working so far (every core; /proc/stat through psutil)."""
    t = psutil.cpu_times()
    fields = t._asdict()
    return sum(v for k, v in fields.items() if k not in ("idle", "iowait", "guest", "guest_nice"))


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _burner(exit_after_s: float | None = None) -> subprocess.Popen[str]:
    """A process busy on one core: it prints "ready" after its first 0.3 s of CPU, then burns on, forever or for
    ``exit_after_s`` of wall time (then it exits, and is not reaped until the test says so)."""
    code = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print('ready', flush=True)\nend = time.monotonic() + float(sys.argv[1])\n"
            "while time.monotonic() < end: pass\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(exit_after_s or "inf")], stdout=subprocess.PIPE, text=True)
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
    over the very window it judged: (seen, machine busy s, watched s, ours s, kernel s). The check's reads of the
    machine's CPU time are spied on (passed through unchanged), and the processes are read at the same moments,
    independently of the check."""
    me = psutil.Process()
    reads: list[tuple[float, float, float, float]] = []
    real = processes._busy_cpu_s

    def spied() -> float:
        value = real()
        reads.append((value, _cpu_s(watched), _cpu_s(me), _kernel_threads_s()))
        return value

    monkeypatch.setattr(processes, "_busy_cpu_s", spied)
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
