"""Leftovers of a gpu_check run cut by the device's command limit: helpers started in their own sessions
(llama-server, llama-bench, the VRAM ballast, the engine build) outlive the killed command and would hold
VRAM or the build folder. The next run ends them, by pid, before it starts; only orphans (their parent gone:
the command that started them was killed) whose command line names this check's engine, build folder or
ballast are touched, never a process someone else's live command still owns."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil

BALLAST_MARKS = ("moe-tune-ballast", "cupy.cuda.Memory", "torch.cuda.mem_get_info")


def leftovers(out: Path, engine_bin: Path | None) -> list[psutil.Process]:
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    marks = [str(out / "engine-build"), *BALLAST_MARKS, *([str(engine_bin)] if engine_bin else [])]
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if proc.info["pid"] not in mine and any(m in cmd for m in marks) and _orphan(proc):
            found.append(proc)
    return found


def end_leftovers(out: Path, engine_bin: Path | None) -> list[str]:
    """Kill what :func:`leftovers` finds; returns what was ended, for the log."""
    ended = []
    for proc in leftovers(out, engine_bin):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            name = " ".join(proc.cmdline()[:2])
            proc.kill()
            proc.wait(timeout=10)
            ended.append(f"{proc.pid} {name}")
    return ended


def _orphan(proc: psutil.Process) -> bool:
    try:
        return proc.ppid() <= 1 or not psutil.pid_exists(proc.ppid())
    except psutil.NoSuchProcess:
        return False
