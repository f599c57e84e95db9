"""Whose a process is by its MOE_TUNE_OWNER marker (tuner.machine.owner): a parent that set the marker to its own and
waits on the run is ours, and only it, never the children it ran and reaped before the run or beside it. Real
process trees: the parent is a real script, its children take real CPU time and real major faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from tuner.machine import processes

pytestmark = pytest.mark.fast
FAULTS = 8192  # pages of a sparse file each child of the harness faults in, one major fault each (MADV_RANDOM)
BURN_S = 0.6  # CPU seconds each child of the harness spends

# A child of the harness: major faults on a file's holes (no read-ahead: one fault per page), then CPU.
CHILD = f"""
import mmap, sys, time
f = open(sys.argv[1], 'rb')
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_RANDOM)
s = sum(m[i] for i in range(0, len(m), 4096))
t = time.process_time()
while time.process_time() - t < {BURN_S}:
    pass
"""

# What the run sees at two looks: whether its parent is ours, and the CPU time and page-ins counted for it.
PROBE = """
import json, os, sys
from tuner.machine import processes

def look():
    v = processes._View(())
    parent = os.getppid()
    return v, {"ours": parent in v.ours, "cpu_s": v.look.ours_cpu_s - v.procs[v.me].cpu_s,
               "page_ins": v.look.ours_traffic[parent][0]}

a, said = look()
print(json.dumps(said), flush=True)
sys.stdin.readline()
b, said = look()
print(json.dumps(said), flush=True)
"""

# The harness: runs a child to completion, then the run with MOE_TUNE_OWNER set to its own marker, and while the run
# looks runs and reaps another child; says what the run saw and what it reaped, with its own CPU time and faults.
HARNESS = """
import json, os, subprocess, sys
from tuner.machine import owner

def reaped():
    t = os.times()
    text = open("/proc/self/stat").read()
    return t.children_user + t.children_system, int(text[text.rfind(")") + 2:].split()[10])  # cmajflt, field 13

child, probe, before, beside = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
subprocess.run([sys.executable, "-c", child, before], check=True)
cpu_before, faults_before = reaped()
run = subprocess.Popen([sys.executable, "-c", probe], env={**os.environ, owner.OWNER_ENV: owner.owner_marker()},
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
first = json.loads(run.stdout.readline())
subprocess.run([sys.executable, "-c", child, beside], check=True)
cpu_beside, faults_beside = reaped()
run.stdin.write("\\n")
run.stdin.flush()
second = json.loads(run.stdout.readline())
run.wait()
t = os.times()
print(json.dumps({"first": first, "second": second, "reaped_before": [cpu_before, faults_before],
                  "reaped_beside": [cpu_beside - cpu_before, faults_beside - faults_before],
                  "own_cpu_s": t.user + t.system, "run_pid": run.pid}))
"""


def test_a_parent_that_says_it_waits_on_the_run_is_ours_and_only_it():
    # The agent benchmark's harness polled /proc every second beside the `moe-tune auto-tune` it ran, and 4 of the
    # race's arm-rounds were "busy" for 0.1-0.2 cores and 18 MiB/s of page-ins by "python pid <the harness>". A parent
    # that sets MOE_TUNE_OWNER to its own marker in the command's environment is the run's; without it, it is other.
    probe = ("import json, os; from tuner.machine import processes; v = processes._View(()); "
             "print(json.dumps([os.getppid() in v.ours, processes.waiting_owner()]))")
    env = {k: v for k, v in os.environ.items() if k != processes.OWNER_ENV}
    said = subprocess.run([sys.executable, "-c", probe], env={**env, processes.OWNER_ENV: processes.owner_marker()},
                          capture_output=True, text=True, check=True)
    assert json.loads(said.stdout) == [True, os.getpid()]
    unsaid = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert json.loads(unsaid.stdout) == [False, None]
    # A marker naming a process that is not its parent (a stale or copied environment) makes nobody ours.
    init = f"1:{psutil.Process(1).create_time():.2f}"
    stale = subprocess.run([sys.executable, "-c", probe], env={**env, processes.OWNER_ENV: init}, capture_output=True,
                           text=True, check=True)
    assert json.loads(stale.stdout) == [False, None]


def test_the_children_a_waiting_parent_reaped_are_not_ours(tmp_path):
    # /proc/<pid>/stat's cutime, cstime and cmajflt (fields 16, 17, 13), and /proc/<pid>/io, hold what the children a
    # process waited for did: a harness's other programs, run before the run or beside it. Counted with the parent,
    # they were the run's own CPU time and page-ins, and left the books' share of others' work.
    holes = []
    for name in ("before", "beside"):
        path = tmp_path / f"{name}.bin"
        with path.open("wb") as f:
            f.truncate(FAULTS * 4096)  # holes: no page in the page cache, and no disk to read
        holes.append(str(path))
    env = {k: v for k, v in os.environ.items() if k != processes.OWNER_ENV}
    harness = subprocess.run([sys.executable, "-c", HARNESS, CHILD, PROBE, *holes], env=env, capture_output=True,
                             text=True, timeout=120)
    assert harness.returncode == 0, harness.stderr
    said = json.loads(harness.stdout)
    first, second = said["first"], said["second"]
    # The children did their work, and the harness reaped it: before the run, and while the run looked.
    for cpu_s, faults in (said["reaped_before"], said["reaped_beside"]):
        assert cpu_s >= BURN_S - 0.05 and faults >= FAULTS, said
    assert first["ours"] and second["ours"]
    # Before the run: the harness counts its own CPU time (a tick of rounding aside) and faults, not its child's.
    assert first["cpu_s"] <= said["own_cpu_s"] + 0.02, said
    assert first["page_ins"] < FAULTS // 2, said
    # Beside the run: the child it reaped between the run's two looks is not the run's either.
    assert second["cpu_s"] - first["cpu_s"] < BURN_S / 2, said
    assert second["page_ins"] - first["page_ins"] < FAULTS // 2, said
    assert not psutil.pid_exists(said["run_pid"])  # the harness waited on the run; the harness itself is reaped
