"""Other programs on this machine that would disturb a measurement: CPU time spent by others, other work on the
GPU (read through :mod:`tuner.machine.hardware`), and llama.cpp processes that are not ours while they work.

"Ours" is this process, the children the runner started (passed in as ``own``) and their descendants. Every
child the runner starts carries ``MOE_TUNE_OWNER=<pid>:<start time>`` in its environment (readable from /proc
by the same user), so a llama.cpp process whose owner is gone is known to be left by an earlier moe-tune run,
whoever adopted it.

What disturbs a measurement is other *work*: CPU time (the whole machine's work in processes' context, minus our
own tree, so a loop of short-lived processes counts too; named by the processes that spent the most), GPU kernels
that are not ours, or another process's VRAM growing. A graphics context (the display server, the desktop shell, a
browser) holds VRAM, which the budget already leaves out of what is free; holding it is not work, so a desktop
driving its monitor from the card is a quiet machine. The same goes for the llama-server a user keeps running (the
launch line this tool prints is one), and for a proxy such as ``llama-swap`` in front of several: idle, they are
residents, named with the VRAM they hold; they are rivals only while they work (CPU time, GPU kernels, VRAM
growth), like any other program.

The hypervisor's steal and the time spent serving interrupts (/proc/stat's ``steal``, ``irq`` and ``softirq`` in
``man 5 proc``; see :mod:`tuner.machine.cpu_time`) are no other program's work on this machine: steal is the host
withholding vCPUs our own threads keep busy, interrupts serve our own GPU, disk and loopback traffic too. They are
said when notable, never a reason to call a round disturbed (steal that varies shows in the rounds' spread, which
the decision rule judges). Counted as work, they read as others' 0.6-2.2 cores in nearly every round that kept the
16 vCPUs of an H100 VM busy, with nothing else running: the pattern of steal.

Whose CPU time and whose kernel work a look saw, whether others' memory use pressed on ours, and whether others' work
made our threads wait are the machine's books (:mod:`tuner.machine.books`); this module says whose each process is.

``MOE_TUNE_MACHINE_SCOPE=<pid>`` narrows what counts as "the machine" to the descendants of that process: a
test suite sharing a machine with other suites sets it to its own pid, so its busy tests see the competing
processes they start and nothing that other suites run beside them (CPU time is then summed over the scope's
processes, with the children they reaped, instead of read machine-wide).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import psutil

from tuner.core.errors import NvmlUnavailableError
from tuner.machine import books, cpu_time, hardware, pressure
from tuner.machine.books import BOOKS_LOG_ENV, NOTABLE_CORES, cpu_limit_cores  # noqa: F401 - re-exported
from tuner.machine.owner import OWNER_ENV, owner_gone, owner_marker, waiting_owner  # noqa: F401 - re-exported

SCOPE_ENV = "MOE_TUNE_MACHINE_SCOPE"
LLAMA_PREFIX = "llama-"  # llama-server, llama-bench, llama-perplexity, llama-cli, ...
PROXIES = frozenset({"llama-swap"})  # in front of llama.cpp servers: it starts them and forwards, it runs no model
# An engine using this much CPU while we look is serving or computing (an idle llama-server uses none): named as
# the rival it is, whatever the machine-wide CPU limit says.
LLAMA_WORK_CORES = 0.1
GPU_BUSY_PCT = 10  # SM share (or device utilization not ours) that is work, not a desktop's redraws
VRAM_GROWTH_BYTES = 64 * 2**20  # another process's VRAM growing by this much while we look


def is_engine(name: str) -> bool:
    """A llama.cpp program that runs a model (llama-server, llama-bench, ...), not a proxy in front of them."""
    return name.startswith(LLAMA_PREFIX) and name not in PROXIES


@dataclass(frozen=True, slots=True)
class LlamaProcess:
    pid: int
    name: str
    exe: str
    ours_earlier: bool  # started by a moe-tune run that has ended: left behind
    cpu_cores: float = 0.0  # CPU it used while we looked (0 when not looked at over time)

    def describe(self) -> str:
        why = " left by an earlier moe-tune run" if self.ours_earlier else ""
        work = f" at work ({self.cpu_cores:.1f} CPU cores)" if self.cpu_cores else ""
        return f"{self.name} pid {self.pid}{why}{work}"


@dataclass(frozen=True, slots=True)
class _Proc:
    pid: int
    ppid: int
    name: str
    cpu_s: float  # its own CPU time and that of the children it reaped (a short-lived child counts too)
    exited: bool = False  # a zombie: no longer running, its CPU time not yet handed to its parent
    anon_bytes: int = 0  # resident anonymous memory (statm: resident minus file-backed and shared)
    own_cpu_s: float = 0.0  # its own CPU time alone (utime + stime), without the children it reaped


def scope_root() -> int | None:
    value = os.environ.get(SCOPE_ENV, "").strip()
    return int(value) if value.isdigit() else None


def _snapshot() -> dict[int, _Proc]:
    procs: dict[int, _Proc] = {}
    for p in psutil.process_iter(["pid", "ppid", "name", "status", "cpu_times", "memory_info"]):
        info = p.info
        # A zombie is kept for its CPU time: left out, a child of ours that has exited but is not yet reaped took
        # its whole CPU time out of our sum, and the machine-wide check then counted it as someone else's work
        # (a benchmark once read "other processes used 352.6 cores" on 2).
        t = info.get("cpu_times")
        own = (t.user + t.system) if t else 0.0
        cpu = own + ((t.children_user + t.children_system) if t else 0.0)
        mem = info.get("memory_info")
        anon = max(0, mem.rss - getattr(mem, "shared", 0)) if mem else 0
        procs[info["pid"]] = _Proc(info["pid"], info.get("ppid") or 0, info.get("name") or "", cpu,
                                   info.get("status") == psutil.STATUS_ZOMBIE, anon, own)
    return procs


def _ancestors(pid: int, procs: dict[int, _Proc]) -> Iterable[int]:
    seen: set[int] = set()
    while pid in procs and pid not in seen:
        seen.add(pid)
        pid = procs[pid].ppid
        yield pid


class _View:
    """One snapshot, judged: which processes are someone else's, within the scope, and the books' reading of it."""

    def __init__(self, own: Collection[int] | Callable[[], Collection[int]]) -> None:
        cpu = cpu_time.read()  # the machine's: every core, every process, short-lived ones too
        self.procs = _snapshot()
        self.me = os.getpid()  # this process itself; its children count as ours only when the runner started them
        # Asked after the snapshot: a child the runner started while the snapshot was taken is already ours.
        self.own = set(own() if callable(own) else own)
        self.root = scope_root()
        kernel = {p.pid: p.cpu_s for p in self.procs.values() if pressure.is_kernel_thread(p.pid, p.ppid)}
        # Read now, with the snapshot (a later read would mix two moments). The machine's counters are read before
        # every process's and again after them: the two bracket the processes' reads (books.unaccounted_page_ins).
        vm = pressure.vmstat()
        psi = pressure.psi_totals()
        ours_traffic = {p: pressure.own_traffic(p) if p == self.owner else pressure.page_traffic(p) for p in self.ours}
        wait_ns = pressure.run_wait_ns(self.ours)
        theirs: dict[int, tuple[int, int]] = {}
        unread: set[int] = set()  # their page-ins unknown, which is not none (books.account)
        for p in self.others:
            if p.pid not in kernel:
                try:
                    theirs[p.pid] = pressure.read_traffic(p.pid)
                except (OSError, ValueError, IndexError):  # another user's io (permission), or gone since the list
                    unread.add(p.pid)
        self.look = books.Look(
            cpu, vm, psi, kernel,
            {p.pid: books.Proc(p.name, p.cpu_s, p.anon_bytes) for p in self.others if p.pid not in kernel},
            {p.pid: p.anon_bytes for p in self.procs.values() if p.pid not in kernel and not p.exited},
            self.ours_cpu_s(), {p: self.procs[p].anon_bytes for p in self.ours if p in self.procs}, ours_traffic,
            wait_ns, theirs, self.root is not None, frozenset(unread), pressure.vmstat())

    @cached_property
    def owner(self) -> int | None:
        """The parent waiting on this process that said so (:func:`waiting_owner`), asked once per look."""
        return waiting_owner()

    @cached_property
    def ours(self) -> set[int]:
        """This process, the runner's children and their descendants, and a parent waiting on it that said so."""
        return ({self.me} | self.own | {p for p in self.procs if set(_ancestors(p, self.procs)) & self.own}
                | ({self.owner} if self.owner is not None else set()))

    def ours_cpu_s(self) -> float:
        """Our processes' CPU time, with the children they reaped, except the waiting parent's: a harness's other
        children, run before this one or beside it, are not ours (``cutime``/``cstime``, fields 16 and 17 of
        ``/proc/<pid>/stat`` in ``man 5 proc``, are the time of "this process's waited-for children"), so it counts
        its own (``utime``/``stime``, fields 14 and 15), as its page-ins do (:func:`pressure.own_traffic`). This run
        is its child too, reaped only once the run has ended."""
        return sum(self.procs[p].own_cpu_s if p == self.owner else self.procs[p].cpu_s
                   for p in self.ours if p in self.procs)

    @cached_property
    def others(self) -> list[_Proc]:
        """Everyone else's processes, within the scope."""
        return [p for p in self.procs.values() if p.pid not in self.ours and not p.exited
                and (self.root is None or self.root in _ancestors(p.pid, self.procs))]


def _llama(pid: int, name: str, cpu_cores: float = 0.0) -> LlamaProcess:
    exe, marker = "", ""
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        exe = proc.exe()
        marker = proc.environ().get(OWNER_ENV, "")  # another user's process: not readable, and not ours
    return LlamaProcess(pid, name, exe, bool(marker) and owner_gone(marker), cpu_cores)


def other_llama_processes(own: Collection[int] = ()) -> list[LlamaProcess]:
    """Live llama.cpp engines on this machine that are not ours, at work or idle (proxies left out)."""
    view = _View(own)
    return [_llama(p.pid, p.name) for p in view.others if is_engine(p.name)]


def left_by_earlier_runs() -> list[LlamaProcess]:
    """llama.cpp processes an earlier moe-tune run left behind (their owner run is gone). The scope does not apply:
    a process left behind has lost its ancestry, so the whole machine is searched."""
    found = [_llama(p.pid, p.name) for p in _snapshot().values()
             if p.name.startswith(LLAMA_PREFIX) and not p.exited]
    return [p for p in found if p.ours_earlier]


RESIDENT_SHARE = 0.25  # residents holding this share of the card: the tune is said to be for what they leave


@dataclass(frozen=True, slots=True)
class Interference:
    """What else used the machine while (or just before) we measured."""

    llama: tuple[LlamaProcess, ...] = ()  # llama.cpp engines at work (idle ones are residents)
    cpu_cores: float = 0.0  # CPU time others spent per second of wall time
    gpu: tuple[str, ...] = ()  # other work on the GPU, described
    cpu_limit_cores: float = 0.5
    # Others' GPU contexts that hold VRAM and did no work (a desktop's display server, shell, browser, the user's
    # idle llama-server): said, not counted. ``vram_first``: others' VRAM by pid at the first look (a watch's
    # baseline for growth).
    residents: tuple[str, ...] = ()
    vram_first: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    idle_llama: tuple[str, ...] = ()  # llama.cpp processes (and proxies) idle here without VRAM seen: said
    resident_vram_bytes: int = field(default=0, compare=False)  # what the residents hold
    vram_total_bytes: int | None = field(default=None, compare=False)  # the first card's memory
    vram_free_bytes: int | None = field(default=None, compare=False)
    gpu_error: str | None = field(default=None, compare=False)  # NVML failed: the GPU was not watched, and why
    # The kernel's threads' CPU spent for our own page-ins, growth and dirtied pages: ours, not a rival's.
    kernel_for_us_cores: float = field(default=0.0, compare=False)
    our_wait_share: float = field(default=0.0, compare=False)  # our threads' run-queue wait per second of wall time
    # Others paging under memory pressure, or growing while the kernel reclaims, in words (tuner.machine.books).
    others_memory: str | None = None
    # Whose CPU time ``cpu_cores`` is: the other processes that spent the most, as (name, pid, cores), and what no
    # process alive at the end of the look accounts for (processes that came and went).
    cpu_named: tuple[tuple[str, int, float], ...] = field(default=(), compare=False)
    short_lived_cores: float = field(default=0.0, compare=False)
    # No program's work (see :mod:`tuner.machine.cpu_time`): evidence, never a reason to be busy.
    steal_cores: float = field(default=0.0, compare=False)  # the hypervisor withheld the vCPUs
    irq_cores: float = field(default=0.0, compare=False)  # serving interrupts (irq + softirq)
    # Others' CPU judged by what it did to our threads (tuner.machine.books.Books.cpu_busy); None: by the limit alone.
    cpu_busy: bool | None = None
    # Our threads' wait for a CPU per second they ran (None: they hardly ran in any look).
    wait_per_run: float | None = field(default=None, compare=False)
    kernel_for_them_cores: float = field(default=0.0, compare=False)  # the kernel's work for others, in cpu_cores

    @property
    def cpu_disturbed(self) -> bool:
        return self.cpu_busy if self.cpu_busy is not None else self.cpu_cores >= self.cpu_limit_cores

    @property
    def busy(self) -> bool:
        return bool(self.llama or self.gpu or self.others_memory) or self.cpu_disturbed

    def describe(self) -> str:
        parts = [p.describe() for p in self.llama]
        if self.others_memory:
            parts.append(self.others_memory)
        if self.cpu_disturbed:
            waited = f" (our threads waited {self.wait_per_run:.2f} s for a CPU per s they ran)" \
                if self.wait_per_run is not None else ""
            parts.append(f"other processes use {self.cpu_cores:.1f} CPU cores{self._whose()}{waited}")
        parts += list(self.gpu)
        if self.steal_cores >= NOTABLE_CORES:
            parts.append(f"the hypervisor withheld {self.steal_cores:.1f} cores (steal)")
        if self.irq_cores >= NOTABLE_CORES:
            parts.append(f"serving interrupts took {self.irq_cores:.1f} cores (irq, softirq)")
        return "; ".join(parts) or "quiet"

    def _whose(self) -> str:
        who = [f"{name} pid {pid} {cores:.1f}" for name, pid, cores in self.cpu_named]
        if self.kernel_for_them_cores >= NOTABLE_CORES:
            who.append(f"the kernel's reclaim and writeback for them {self.kernel_for_them_cores:.1f}")
        if self.short_lived_cores >= max(NOTABLE_CORES, 0.25 * self.cpu_cores):
            who.append(f"{'the rest ' if who else ''}{self.short_lived_cores:.1f} by short-lived processes")
        return f" ({', '.join(who)})" if who else ""

    def residents_line(self) -> str | None:
        """The idle residents in one line (None: there are none): what they hold, and why they are no rival."""
        parts = []
        if self.residents:
            line = (f"the GPU also holds {', '.join(self.residents)}: VRAM the budget leaves out, no work that "
                    "disturbs a measurement")
            total, free = self.vram_total_bytes, self.vram_free_bytes
            if total and free is not None and self.resident_vram_bytes >= RESIDENT_SHARE * total:
                line += (f"; they hold {self.resident_vram_bytes / 2**20:,.0f} of {total / 2**20:,.0f} MiB, so the "
                         f"tune is for the {free / 2**20:,.0f} MiB left free (stop them to tune for the whole card)")
            parts.append(line)
        if self.idle_llama:
            parts.append(f"{'also ' if parts else ''}idle here: {', '.join(self.idle_llama)}: no work while we "
                         "looked, so no reason to wait (a round in which they work is marked and decides nothing)")
        return "; ".join(parts) or None

    def worse(self, other: Interference) -> Interference:
        """Both observations together: every process seen, the larger CPU load (and whose it was)."""
        more = self if self.cpu_cores > other.cpu_cores else other
        llama = {p.pid: p for p in (*self.llama, *other.llama)}
        # One line per process (or card) and kind of work: a later look replaces an earlier one (VRAM growth
        # is judged from the watch's start, so the later figure holds the earlier).
        gpu = tuple({_gpu_key(g): g for g in (*self.gpu, *other.gpu)}.values())
        residents = tuple(dict.fromkeys((*self.residents, *other.residents)))
        idle_llama = tuple(dict.fromkeys((*self.idle_llama, *other.idle_llama)))
        return Interference(tuple(llama.values()), max(self.cpu_cores, other.cpu_cores), gpu,
                            min(self.cpu_limit_cores, other.cpu_limit_cores), residents,
                            self.vram_first or other.vram_first, idle_llama,
                            max(self.resident_vram_bytes, other.resident_vram_bytes),
                            other.vram_total_bytes or self.vram_total_bytes,
                            other.vram_free_bytes if other.vram_free_bytes is not None else self.vram_free_bytes,
                            self.gpu_error or other.gpu_error,
                            max(self.kernel_for_us_cores, other.kernel_for_us_cores),
                            max(self.our_wait_share, other.our_wait_share),
                            other.others_memory or self.others_memory, more.cpu_named, more.short_lived_cores,
                            max(self.steal_cores, other.steal_cores), max(self.irq_cores, other.irq_cores),
                            self.cpu_disturbed or other.cpu_disturbed,
                            max((w for w in (self.wait_per_run, other.wait_per_run) if w is not None), default=None),
                            more.kernel_for_them_cores)


def _gpu_key(line: str) -> str:
    who = re.search(r"(?:pid|GPU) \d+", line)
    kind = "vram" if " VRAM" in line else "work"
    return f"{who.group(0) if who else line} {kind}"


@dataclass(frozen=True, slots=True)
class _GpuLook:
    vram: dict[int, tuple[str, int]]  # others' VRAM by pid: (name, bytes)
    work: list[str]  # others' GPU work, described
    idle: dict[int, tuple[str, int]]  # others' contexts that did no work: (name, bytes)
    total_bytes: int | None = None  # the first card
    free_bytes: int | None = None


PROC_PID_INIT_INO = 0xEFFFFFFC  # the first PID namespace's inode number (linux/proc_ns.h)
HOST_PROCESS = "host process"  # what a pid NVML reports from outside our PID namespace is called


def in_pid_namespace() -> bool:
    """This process runs in a PID namespace of its own (Docker without ``--pid=host``, ``unshare --pid``): NVML
    reports the host's pids there, which are not ours to look up in /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino != PROC_PID_INIT_INO
    except OSError:
        return False


_ARRIVED: dict[int, float] = {}  # in a PID namespace: each pid on NVML's list, and when a look first saw it
_ARRIVED_LOCK = threading.Lock()


def _ours_by_arrival(on_gpu: set[int], view: _View) -> set[int]:
    """In a PID namespace, which of NVML's (host) pids are our processes: those that came onto the GPU after our
    oldest live child started, at most as many as we have children, the earliest first. A context that was there
    before our children is someone else's; so is one beyond their number."""
    now = time.time()
    with _ARRIVED_LOCK:
        for pid in [p for p in _ARRIVED if p not in on_gpu]:
            del _ARRIVED[pid]  # gone from the GPU: its pid may come back as another process
        for pid in on_gpu:
            _ARRIVED.setdefault(pid, now)
        arrived = dict(_ARRIVED)
    born = []
    for pid in view.ours - {view.me}:
        with contextlib.suppress(psutil.Error):
            born.append(psutil.Process(pid).create_time())
    if not born:
        return set()
    since = min(born)
    return {pid for _, pid in sorted((t, pid) for pid, t in arrived.items() if t >= since)[:len(born)]}


def _gpu_look(view: _View, nvml: object, window_s: float) -> _GpuLook:
    """Others' VRAM by pid, others' GPU work (described) and others' idle contexts. In a PID namespace NVML's pids
    are the host's: ours are told by when they came (see :func:`_ours_by_arrival`), the rest are named as host
    processes, and the suite's scope (our namespace's pids) does not hide them."""
    act = hardware.gpu_activity(nvml, since_s=window_s)
    holding = {g.pid for g in act.processes}
    namespaced = in_pid_namespace()
    mine = _ours_by_arrival(holding, view) if namespaced else view.ours
    allowed = None if view.root is None or namespaced else {p.pid for p in view.others}

    def theirs(pid: int) -> bool:
        return pid not in mine and (allowed is None or pid in allowed)

    def name(local: str) -> str:
        return HOST_PROCESS if namespaced else local

    vram = {g.pid: (name(g.name), g.used_bytes) for g in act.processes if theirs(g.pid)}
    # Samples reach seconds back: one of a process that has ended since (our own last trial, say) is no rival now.
    live = {pid: sm for pid, sm in act.process_sm_pct.items()
            if pid in holding or (not namespaced and psutil.pid_exists(pid))}
    busy = {pid: sm for pid, sm in sorted(live.items()) if sm >= GPU_BUSY_PCT and theirs(pid)}
    work = [f"{vram.get(pid, (name(hardware.process_name(pid)), 0))[0]} pid {pid} uses the GPU ({sm} % SM)"
            for pid, sm in busy.items()]
    ours_on_gpu = any(pid in mine for pid in holding)
    known = act.samples_known or (act.per_process_known,) * len(act.device_util_pct)
    if not ours_on_gpu:  # no samples on a card: its utilization says whether someone works there
        work += [f"GPU {i} is {u} % busy and none of it is ours" for i, (u, k) in
                 enumerate(zip(act.device_util_pct, known, strict=False)) if not k and u is not None
                 and u >= GPU_BUSY_PCT]
    idle = {pid: v for pid, v in vram.items() if pid not in busy}
    first = next(iter(zip(act.device_total_bytes, act.device_free_bytes, strict=True)), (None, None))
    return _GpuLook(vram, work, idle, *first)


def _grown(base: dict[int, int], now: dict[int, tuple[str, int]]) -> list[str]:
    out = []
    for pid, (name, used) in now.items():
        grew = used - base.get(pid, 0)
        if grew >= VRAM_GROWTH_BYTES:
            verb = f"grew its VRAM by {grew / 2**20:,.0f} MiB" if pid in base else \
                f"took {used / 2**20:,.0f} MiB of VRAM"
            out.append(f"{name} pid {pid} {verb}")
    return out


def observe(own: Collection[int] | Callable[[], Collection[int]] = (), interval_s: float = 0.5, nvml: object = None,
            wait: Callable[[float], object] = time.sleep, *, gpu: bool = True, threads: int | None = None,
            vram_base: dict[int, int] | None = None) -> Interference:
    """Look at the machine for ``interval_s``: others' CPU use, others' GPU work, llama.cpp engines at work (idle
    ones, and proxies, are residents).
    ``own`` names our children, or is asked for them at each look (a watch's children come and go).
    ``wait`` sleeps (a watch passes its stop event's wait, so it can end early). ``gpu`` False: the run measures
    the CPU on purpose (``--device none``), so the GPU is not looked at. ``threads``: the cores the trial uses.
    ``vram_base``: others' VRAM at the start of a longer watch (growth is judged against it)."""
    first = _View(own)
    vram_first: dict[int, tuple[str, int]] = {}
    gpu_error: str | None = None
    if gpu and vram_base is None:  # a watch's later looks judge growth against its first: no look needed here
        try:
            vram_first = _gpu_look(first, nvml, interval_s).vram
        except NvmlUnavailableError:
            gpu = False  # no driver: a CPU-only machine
        except Exception as exc:  # noqa: BLE001 - a driver that stops answering: said, never a spin or a crash
            gpu, gpu_error = False, _nvml_error(exc)
    t0 = time.monotonic()
    wait(interval_s)
    second = _View(own)
    elapsed = time.monotonic() - t0
    others = second.others
    ledger = books.account(first.look, second.look, elapsed)
    if os.environ.get(BOOKS_LOG_ENV):
        books.log_look(Path(os.environ[BOOKS_LOG_ENV]), first.look, second.look, ledger)
    used = ledger.used
    limit = cpu_limit_cores(threads)
    # An engine is a rival while it works, not while it idles (its CPU time is exact, whatever else runs).
    kin = [p for p in others if p.name.startswith(LLAMA_PREFIX)]
    llama = tuple(_llama(p.pid, p.name, used.get(p.pid, 0.0)) for p in kin
                  if is_engine(p.name) and used.get(p.pid, 0.0) >= LLAMA_WORK_CORES)
    at_work = {p.pid for p in llama}
    look = _GpuLook({}, [], {})
    if gpu:
        try:
            look = _gpu_look(second, nvml, elapsed)
            base = vram_base if vram_base is not None else {pid: used for pid, (_, used) in vram_first.items()}
            look.work.extend(_grown(base, look.vram))
        except NvmlUnavailableError:
            pass
        except Exception as exc:  # noqa: BLE001 - as above
            gpu_error = _nvml_error(exc)
    idle = {pid: v for pid, v in look.idle.items() if pid not in at_work}
    residents = tuple(f"{name} pid {pid} ({held / 2**20:,.0f} MiB)" for pid, (name, held) in idle.items())
    idle_llama = tuple(_kin_line(p.pid, p.name) for p in kin if p.pid not in at_work and p.pid not in look.vram)
    return Interference(llama, ledger.cores, tuple(dict.fromkeys(look.work)), limit, residents,
                        tuple((pid, used) for pid, (_, used) in vram_first.items()), idle_llama,
                        sum(held for _, held in idle.values()), look.total_bytes, look.free_bytes, gpu_error,
                        ledger.kernel_for_us_cores, ledger.our_wait_share, ledger.memory, ledger.named,
                        ledger.short_lived_cores, ledger.steal_cores, ledger.irq_cores, ledger.cpu_busy(limit),
                        ledger.wait_per_run, ledger.kernel_for_them_cores)


def _nvml_error(exc: Exception) -> str:
    return f"the GPU could not be watched (NVML: {exc or type(exc).__name__}): other programs' GPU work is not seen"


def _kin_line(pid: int, name: str) -> str:
    if not is_engine(name):
        return f"{name} pid {pid} (a proxy)"
    return _llama(pid, name).describe()
