"""Other programs on this machine that would disturb a measurement: llama.cpp processes that are not ours
(left by an earlier run, or a server the user keeps running), CPU time spent by other processes, and other
processes on the GPU (read through :mod:`tuner.machine.hardware`).

"Ours" is this process, the children the runner started (passed in as ``own``) and their descendants.
``MOE_TUNE_MACHINE_SCOPE=<pid>`` narrows what counts as "the machine" to the descendants of that process: a
test suite sharing a machine with other suites sets it to its own pid, so its busy tests see the competing
processes they start and nothing that other suites run beside them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import psutil

from tuner.core.errors import NvmlUnavailableError
from tuner.machine import hardware, paths

SCOPE_ENV = "MOE_TUNE_MACHINE_SCOPE"
LLAMA_PREFIX = "llama-"  # llama-server, llama-bench, llama-perplexity, llama-cli, ...
MIN_CPU_WINDOW_S = 0.1  # a shorter look says nothing about CPU load
ADOPTERS = {"systemd", "init", "tini", "dumb-init", "process_api"}  # who adopts an orphan (pid 1 or a subreaper)


@dataclass(frozen=True, slots=True)
class LlamaProcess:
    pid: int
    name: str
    exe: str
    orphan: bool  # its starter is gone (adopted by init or a subreaper)
    ours_earlier: bool  # an orphan running a binary from moe-tune's own engine cache: left by an earlier run

    def describe(self) -> str:
        why = " left by an earlier moe-tune run" if self.ours_earlier else " orphaned" if self.orphan else ""
        return f"{self.name} pid {self.pid}{why}"


@dataclass(frozen=True, slots=True)
class _Proc:
    pid: int
    ppid: int
    name: str
    exe: str
    cpu_s: float


def scope_root() -> int | None:
    value = os.environ.get(SCOPE_ENV, "").strip()
    return int(value) if value.isdigit() else None


def _snapshot() -> dict[int, _Proc]:
    procs: dict[int, _Proc] = {}
    for p in psutil.process_iter(["pid", "ppid", "name", "exe", "status", "cpu_times"]):
        info = p.info
        if info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        times = info.get("cpu_times")
        cpu = (times.user + times.system) if times else 0.0
        procs[info["pid"]] = _Proc(info["pid"], info.get("ppid") or 0, info.get("name") or "", info.get("exe") or "",
                                   cpu)
    return procs


def _ancestors(pid: int, procs: dict[int, _Proc]) -> Iterable[int]:
    seen: set[int] = set()
    while pid in procs and pid not in seen:
        seen.add(pid)
        pid = procs[pid].ppid
        yield pid


class _View:
    """One snapshot, judged: which processes are someone else's, within the scope."""

    def __init__(self, own: Collection[int] | Callable[[], Collection[int]]) -> None:
        self.procs = _snapshot()
        self.me = os.getpid()  # this process itself; its children count as ours only when the runner started them
        # Asked after the snapshot: a child the runner started while the snapshot was taken is already ours.
        self.own = set(own() if callable(own) else own)
        self.root = scope_root()

    def others(self) -> list[_Proc]:
        out = []
        for p in self.procs.values():
            up = set(_ancestors(p.pid, self.procs))
            if p.pid == self.me or p.pid in self.own or up & self.own:
                continue
            if self.root is not None and self.root not in up:
                continue
            out.append(p)
        return out


def _is_orphan(p: _Proc, procs: dict[int, _Proc]) -> bool:
    parent = procs.get(p.ppid)
    return p.ppid == 1 or (parent is not None and parent.name in ADOPTERS)


def _llama(p: _Proc, procs: dict[int, _Proc]) -> LlamaProcess:
    orphan = _is_orphan(p, procs)
    engine = str(paths.engine_root().resolve())
    return LlamaProcess(p.pid, p.name, p.exe, orphan, orphan and p.exe.startswith(engine))


def other_llama_processes(own: Collection[int] = ()) -> list[LlamaProcess]:
    """Live llama.cpp processes on this machine that are not ours (see the module docstring)."""
    view = _View(own)
    return [_llama(p, view.procs) for p in view.others() if p.name.startswith(LLAMA_PREFIX)]


def left_by_earlier_runs() -> list[LlamaProcess]:
    """llama.cpp processes an earlier moe-tune run left behind (orphans running our engine's binaries). An
    orphan has lost its ancestry, so the scope does not apply: the whole machine is searched."""
    procs = _snapshot()
    found = [_llama(p, procs) for p in procs.values() if p.name.startswith(LLAMA_PREFIX)]
    return [p for p in found if p.ours_earlier]


@dataclass(frozen=True, slots=True)
class Interference:
    """What else used the machine while (or just before) we measured."""

    llama: tuple[LlamaProcess, ...] = ()
    cpu_cores: float = 0.0  # CPU time other processes spent per second of wall time
    gpu: tuple[str, ...] = ()  # other processes on the GPU, described
    cpu_limit_cores: float = 0.5

    @property
    def busy(self) -> bool:
        return bool(self.llama or self.gpu) or self.cpu_cores >= self.cpu_limit_cores

    def describe(self) -> str:
        parts = [p.describe() for p in self.llama]
        if self.cpu_cores >= self.cpu_limit_cores:
            parts.append(f"other processes use {self.cpu_cores:.1f} CPU cores")
        parts += list(self.gpu)
        return "; ".join(parts) or "quiet"

    def worse(self, other: Interference) -> Interference:
        """Both observations together: every process seen, the larger CPU load."""
        llama = {p.pid: p for p in (*self.llama, *other.llama)}
        gpu = tuple(dict.fromkeys((*self.gpu, *other.gpu)))
        return Interference(tuple(llama.values()), max(self.cpu_cores, other.cpu_cores), gpu,
                            min(self.cpu_limit_cores, other.cpu_limit_cores))


def cpu_limit_cores() -> float:
    """Other processes' CPU use that makes a measurement noisy: half a core, or a tenth of a large machine."""
    return max(0.5, 0.1 * (psutil.cpu_count(logical=True) or 1))


def observe(own: Collection[int] | Callable[[], Collection[int]] = (), interval_s: float = 0.5, nvml: object = None,
            wait: Callable[[float], object] = time.sleep) -> Interference:
    """Look at the machine for ``interval_s``: other llama.cpp processes, others' CPU use, others on the GPU.
    ``own`` names our children, or is asked for them at each look (a watch's children come and go).
    ``wait`` sleeps (a watch passes its stop event's wait, so it can end early)."""
    first = _View(own)
    before = {p.pid: p.cpu_s for p in first.others()}
    t0 = time.monotonic()
    wait(interval_s)
    second = _View(own)
    elapsed = time.monotonic() - t0
    others = second.others()
    spent = sum(max(0.0, p.cpu_s - before.get(p.pid, 0.0)) for p in others if p.pid in before)
    cores = spent / elapsed if elapsed >= MIN_CPU_WINDOW_S else 0.0
    llama = tuple(_llama(p, second.procs) for p in others if p.name.startswith(LLAMA_PREFIX))
    gpu: tuple[str, ...] = ()
    with contextlib.suppress(NvmlUnavailableError):
        mine = {second.me} | second.own | {p for p in second.procs if set(_ancestors(p, second.procs)) & second.own}
        allowed = None if second.root is None else {p.pid for p in others}
        gpu = tuple(f"{g.name} pid {g.pid} on the GPU ({g.used_bytes / 2**20:,.0f} MiB)"
                    for g in hardware.gpu_processes(nvml) if g.pid not in mine
                    and (allowed is None or g.pid in allowed))
    return Interference(llama, cores, gpu, cpu_limit_cores())
