"""moe-tune in a PID namespace (Docker without ``--pid=host``): NVML reports the host's pids, so our own
llama-server is a pid we cannot see. It must still read as ours, and a host process computing on the GPU as busy.

The namespace is real (``unshare --pid --fork --mount-proc``, root only); the tool runs inside it as pid 1, with
the FAKE NVML of tests/standin reporting pids as the host sees them (this test, outside, reads the host pid of
the server started inside and writes it into the scenario). The server is a real llama-server of the engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.desktop import CARD, GIB, MIB, STANDIN
from tuner.machine import processes

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="a PID namespace of our own is made with unshare: needs root")

INSIDE = """
import json, os, sys, time
from pathlib import Path
from tuner.core.config import LaunchConfig
from tuner.engine import build, flags, runner
from tuner.machine import processes, quiet
from tuner.machine.sampler import Sampler

def say(what):
    print(json.dumps(what), flush=True)

def watched(seconds):
    with quiet.Watch(runner.own_pids, interval_s=0.3) as watch:
        time.sleep(seconds)
    return {"gpu": list(watch.seen.gpu), "noise": watch.noise, "residents": list(watch.seen.residents)}

say({"pid": os.getpid(), "namespaced": processes.in_pid_namespace()})
sys.stdin.readline()  # the host's trainer computes
seen = processes.observe(runner.own_pids, interval_s=0.5)
say({"gpu": list(seen.gpu)})
sys.stdin.readline()  # the trainer has stopped
argv = flags.server_argv(build.locate_engine().tool("llama-server"), LaunchConfig(model=Path(sys.argv[1]), ctx=256,
                         threads=1))
sampler = Sampler(interval_s=0.2)
sampler.start()
with runner.serve(argv, log_dir=Path(sys.argv[2])) as server:
    sampler.attach(server.proc.pid)
    say({"server": server.proc.pid})
    sys.stdin.readline()  # NVML lists our server, by its host pid, computing
    say(watched(2.0))
    sys.stdin.readline()  # the trainer computes again, beside our server
    say(watched(2.0))
say({"proc_vram_peak": sampler.stop().proc_vram_peak_bytes})
"""


class Host:
    """The NVML the host's driver would show: the scenario file the stand-in reads at every nvmlInit."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.show({})

    def show(self, computing: dict[int, int]) -> None:
        procs = [[pid, 2 * GIB] for pid in computing]
        used = 300 * MIB + sum(p[1] for p in procs)
        self.file.write_text(json.dumps({"cards": [[CARD, 24 * GIB, used]], "graphics": [], "processes": procs,
                                         "util_pct": 90 if computing else 0,
                                         "process_sm": {str(pid): sm for pid, sm in computing.items()}}))


def _host_process(folder: Path, name: str) -> subprocess.Popen[bytes]:
    exe = folder / name
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    return subprocess.Popen([str(exe), "600"])


def _nspid(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def test_our_server_in_a_pid_namespace_is_ours_and_a_host_trainer_is_busy(demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    host = Host(tmp_path / "nvml-scenario.json")
    trainer = _host_process(tmp_path, "trainer")  # outside the namespace: a pid the tool cannot see
    env = {k: v for k, v in os.environ.items() if k != processes.SCOPE_ENV}  # inside, the machine is the namespace
    env |= {"PYTHONPATH": os.pathsep.join((str(STANDIN), str(Path(__file__).resolve().parents[2]))),
            "MOE_TUNE_FAKE_NVML": str(host.file)}
    inside = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INSIDE, str(model),
                               str(tmp_path / "logs")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)
    assert inside.stdin is not None and inside.stdout is not None

    def step() -> dict:
        inside.stdin.write("\n")
        inside.stdin.flush()
        return json.loads(inside.stdout.readline())

    try:
        start = json.loads(inside.stdout.readline())
        assert start == {"pid": 1, "namespaced": True}
        host.show({trainer.pid: 95})
        assert step()["gpu"] == [f"host process pid {trainer.pid} uses the GPU (95 % SM)"]  # seen, though unseeable
        host.show({})
        ours = step()["server"]
        [server] = [p for p in psutil.Process(inside.pid).children(recursive=True) if p.name() == "llama-server"]
        assert _nspid(server.pid) == [server.pid, ours] and server.pid != ours  # the host's pid is another number
        host.show({server.pid: 90})
        alone = step()
        assert alone["gpu"] == [], alone  # our own server at work is no rival: no disturbed round
        assert "GPU" not in (alone["noise"] or ""), alone
        host.show({server.pid: 90, trainer.pid: 95})
        beside = step()
        assert beside["gpu"] == [f"host process pid {trainer.pid} uses the GPU (95 % SM)"], beside
        # The trial's own VRAM peak is our server's 2 GiB, found by its arrival: not the trainer's beside it, and
        # not unknown (NVML's pids are the host's; it was missing before).
        assert step() == {"proc_vram_peak": 2 * GIB}
        inside.stdin.close()
        assert inside.wait(timeout=60) == 0
    finally:
        if inside.poll() is None:
            inside.kill()
            inside.wait()
        trainer.kill()
        trainer.wait()
