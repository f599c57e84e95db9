"""An ordinary GPU owner's desktop, simulated at the NVML boundary only (a FAKE driver, named as one).

The card is an RTX 3090 that also drives the monitor: a display server (412 MiB), a desktop shell (180 MiB) and a
browser (260 MiB) hold graphics contexts, and the card idles at 2 % utilization. Those three are real processes
this module starts (copies of ``sleep`` under their names), so the tool sees real pids with real names, as it
would on the desktop. ``busy`` adds another program at work on the GPU (compute, 95 % SM); ``growing`` adds one
whose VRAM grows while we look, on a driver without per-process samples.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.fakes import FakeNVML

MIB = 2**20
GIB = 2**30
STANDIN = Path(__file__).resolve().parent / "standin"
CARD = "NVIDIA GeForce RTX 3090"
DISPLAY = (("Xorg", 412), ("gnome-shell", 180), ("firefox", 260))


@dataclass
class Desktop:
    """The scenario: as a FakeNVML for library calls, and as an environment for ``moe-tune`` commands."""

    scenario: dict
    file: Path
    pids: dict[str, int] = field(default_factory=dict)

    def nvml(self) -> FakeNVML:
        s = self.scenario
        return FakeNVML([tuple(c) for c in s["cards"]], processes=[tuple(p) for p in s.get("processes", [])],
                        graphics=[tuple(p) for p in s["graphics"]], util_pct=s.get("util_pct"),
                        process_sm=None if s.get("process_sm") is None else
                        {int(k): v for k, v in s["process_sm"].items()})

    @property
    def env(self) -> dict[str, str]:
        """What a ``moe-tune`` command needs to see this machine: the fake pynvml first on the import path."""
        path = os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, "MOE_TUNE_FAKE_NVML": str(self.file)}


def _program(folder: Path, name: str) -> subprocess.Popen[bytes]:
    """A real process whose name (``/proc/PID/comm``) is ``name``: a copy of ``sleep`` under that name."""
    exe = folder / name
    if not exe.exists():
        shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    return subprocess.Popen([str(exe), "600"])


@contextlib.contextmanager
def desktop(folder: Path, *, busy: bool = False, growing: bool = False) -> Iterator[Desktop]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        pids = {}
        for name, _ in DISPLAY:
            procs.append(_program(folder, name))
            pids[name] = procs[-1].pid
        graphics = [[pids[name], mib * MIB] for name, mib in DISPLAY]
        compute: list[list[int]] = []
        process_sm: dict[str, int] | None = {}
        if busy:
            procs.append(_program(folder, "trainer"))
            pids["trainer"] = procs[-1].pid
            compute.append([pids["trainer"], 6 * GIB])
            process_sm = {str(pids["trainer"]): 95}
        grow = None
        if growing:
            procs.append(_program(folder, "ollama"))
            pids["ollama"] = procs[-1].pid
            compute.append([pids["ollama"], 2 * GIB])
            process_sm = None  # an older driver: no per-process samples
            grow = [pids["ollama"], 400 * MIB]  # bytes per second
        used = 300 * MIB + sum(g[1] for g in graphics) + sum(c[1] for c in compute)
        scenario = {"cards": [[CARD, 24 * GIB, used]], "graphics": graphics, "processes": compute,
                    "util_pct": 2, "process_sm": process_sm, "grow": grow, "t0": time.time(),
                    "compute_capability": [8, 6]}
        file = folder / "nvml-scenario.json"
        file.write_text(json.dumps(scenario))
        yield Desktop(scenario, file, pids)
    finally:
        for p in procs:
            p.kill()
            p.wait()
