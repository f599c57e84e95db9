"""The machine's books over one look: whose CPU time it was (others', ours, the hypervisor's), whose work the kernel's
own threads did, whether others' memory use pressed on ours, and whether others' work made our threads wait.

Two readings of the machine (:class:`Look`, taken by :mod:`tuner.machine.processes`, which knows whose each process
is) go in; :func:`account` gives what happened between them.

- **Others' CPU** is the whole machine's work in processes' context (:mod:`tuner.machine.cpu_time`) minus our own
  tree's, so short-lived processes count too; under a scope (``MOE_TUNE_MACHINE_SCOPE``) it is summed over the
  scope's processes instead.
- **The kernel's threads** (``kswapd*``, ``kcompactd*``, kworkers: children of kthreadd) work for whoever makes them
  work, and their CPU time is split by cause (:class:`Causes`): pages brought in (page-in I/O, and the reclaim that
  frees a page for each), anonymous pages gained (each needs a free page: with memory full, the kernel reclaims one
  for it; no page-in is involved) and pages dirtied (the flusher's kworkers write each back: ``/proc/<pid>/io``
  ``write_bytes`` is charged to the process that dirtied it). Our share is ours (a config that pages host RAM: a
  property of the config, which the trial's paging verdict names); the rest of the causes' share is others' work;
  with no cause on any side it is housekeeping, nobody's. Judged by page-ins alone, another program allocating
  gigabytes (a browser, a second model loading) drove reclaim with almost no page-in, and that CPU vanished from the
  books: the round read quiet while kswapd competed with llama.cpp's threads.
- **Others' memory load**: another program paging under memory pressure, or growing its anonymous memory while the
  kernel reclaims, evicts our pages and shares the disk whatever little CPU it uses. Either makes a look busy, and a
  paging verdict measured beside it is blamed on that load (:meth:`tuner.machine.sampler.PagingVerdict.beside`):
  interference to measure again, not a property of the config.
- **Others we cannot read**: another user's process's ``/proc/<pid>/io`` is not ours to read, and a process that
  exits between the listing and the read has nothing to read. Its page-ins are unknown, not zero: counted as zero,
  another user's program paging beside ours went unseen and the paging it caused was pinned on the config. What the
  readable processes leave of the machine's page-ins bounds what the unread ones brought in
  (:func:`unaccounted_page_ins`); where that could be paging under memory pressure, the look says so in ``memory``,
  so a paging verdict measured beside it is theirs as well as it might be (:meth:`PagingVerdict.beside`).
- **Whether others' CPU disturbed us** is judged by what it did to our threads while they ran: the run-queue wait
  ``/proc/<pid>/task/*/schedstat`` counts (our threads waited … s for a CPU per s they ran). On 2 cores half a core
  of a browser makes llama.cpp's threads wait and slows the figure; on 16 the scheduler puts it on an idle core and
  nothing waits. Where our threads did not run in the look (the check before a measurement, a server between
  requests) the absolute limit :func:`cpu_limit_cores` stands in. scripts/bench_busy_threshold.py measured the limit
  on this project's machine (results/benchmarks/busy-threshold.md). Hyperthread siblings share a core without a
  run-queue wait, so a rig whose threads take one logical CPU per physical core sees less of a sibling's work here
  than it feels.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tuner.machine import pressure
from tuner.machine.cpu_time import CpuTime

MIB = 2**20
BOOKS_LOG_ENV = "MOE_TUNE_BOOKS_LOG"  # a file: each look's page-ins, whose they were, and its verdict (diagnosis)
MIN_CPU_WINDOW_S = 0.1  # a shorter look says nothing about CPU load
# Others bringing pages in this fast while memory is under pressure: a program paging beside us, which evicts our
# pages and shares the disk, whatever little CPU it uses while it waits for its reads.
OTHERS_PAGING_MIB_S = 16.0
MEMORY_PRESSURE_PCT = 1.0  # share of the look in which some task stalled on memory (PSI "some")
# Others' anonymous memory growing this fast while the kernel reclaims at least RECLAIM_MIB_S: with memory full, each
# page they take is one the kernel evicts from someone (a model's mapped weights among them).
OTHERS_GROWTH_MIB_S = 16.0
RECLAIM_MIB_S = 16.0
NOTABLE_CORES = 0.2  # steal, interrupts, a named process or short-lived ones: worth saying from this much on
NAMED_AT_MOST = 3  # the other processes named in a busy look, the most CPU first
# Our threads ran at least this many cores' worth in the look: their wait is a measurement of what others did to them.
OUR_MIN_CORES = 0.5
# Others' CPU disturbs a measurement when our threads waited this long for a CPU per second they ran (and others did
# some work): results/benchmarks/busy-threshold.md, a real second process at several loads beside llama-bench.
WAIT_PER_RUN_LIMIT = 0.10
# Others' CPU and ours together used this share of the machine's logical CPUs (and others at least NOTABLE_CORES):
# someone waited for a CPU, whatever the wait read. The kernel adds a thread's run-queue wait to ``schedstat`` only
# when the thread next runs (sched_info_arrive), so in a short look, the finish's 0.2-0.3 s rounds on the demo, two
# busy loops beside a 2-thread llama-server read 0.00-0.10 s per s run in 5 of 15 looks and about 1.0 in the
# 1-second ones (tests/search/test_finish.py, this 2-core machine).
SATURATED_SHARE = 0.95
OTHERS_MIN_CORES = 0.05  # below this, a wait is our own threads' (our tree, the kernel's timers), not others'


def cpu_limit_cores(threads: int | None = None) -> float:
    """Others' CPU use that would make a measurement noisy where our threads' wait cannot say (nothing of ours ran in
    the look), judged against the cores the trial uses: half a core when the trial uses every physical core
    (llama.cpp's default), plus half of each physical core it leaves idle (hyperthread siblings share a core, so the
    logical count would be too lenient)."""
    physical = psutil.cpu_count(logical=False) or psutil.cpu_count(logical=True) or 1
    spare = max(0, physical - (threads or physical))
    return 0.5 + 0.5 * spare


@dataclass(frozen=True, slots=True)
class Causes:
    """What makes the kernel's threads work, in pages: brought in (major faults, pages read from storage),
    anonymous pages gained, pages dirtied."""

    page_ins: int = 0
    grown: int = 0
    dirtied: int = 0

    @property
    def pages(self) -> int:
        return self.page_ins + self.grown + self.dirtied

    def __add__(self, other: Causes) -> Causes:
        return Causes(self.page_ins + other.page_ins, self.grown + other.grown, self.dirtied + other.dirtied)

    def less(self, other: Causes) -> Causes:
        """What is left of ``self`` without ``other`` (counters read a moment apart: never below 0)."""
        return Causes(max(0, self.page_ins - other.page_ins), max(0, self.grown - other.grown),
                      max(0, self.dirtied - other.dirtied))


@dataclass(frozen=True, slots=True)
class Proc:
    """One process as a look saw it."""

    name: str
    cpu_s: float  # its own CPU time and that of the children it reaped
    anon_bytes: int  # resident anonymous memory (statm's resident minus shared)


@dataclass(frozen=True, slots=True)
class Look:
    """One reading of the machine, sorted into ours and everyone else's."""

    cpu: CpuTime  # the whole machine's
    vm: Mapping[str, int]  # /proc/vmstat (tuner.machine.pressure.vmstat)
    psi: Mapping[str, tuple[int, int]] | None
    kernel_cpu: Mapping[int, float]  # the kernel's threads' CPU time by pid
    others: Mapping[int, Proc]  # everyone else's live processes, within the scope
    anon: Mapping[int, int]  # every user process's resident anonymous bytes (the machine's growth)
    ours_cpu_s: float
    ours_anon: Mapping[int, int]
    ours_traffic: Mapping[int, tuple[int, int]]  # our processes' (pages brought in, pages dirtied)
    ours_wait_ns: int
    # Every other process's (pages brought in, pages dirtied) we could read: who pages beside us, by name.
    others_traffic: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    scoped: bool = False
    unread: frozenset[int] = frozenset()  # other processes whose page traffic could not be read: unknown, not zero
    # /proc/vmstat again, read after every process's counters (``vm`` is read before them): None, not read.
    vm_after: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Books:
    """What happened between two looks, per second of the look."""

    elapsed_s: float
    cores: float  # others' work: their own CPU and the kernel's work for them
    used: dict[int, float]  # each other process's own CPU, per second
    named: tuple[tuple[str, int, float], ...]  # the other processes that spent the most: (name, pid, cores)
    short_lived_cores: float  # what no process alive at the end accounts for
    kernel_for_us_cores: float
    kernel_for_them_cores: float
    our_cores: float  # our tree's CPU
    our_wait_share: float  # our threads' run-queue wait per second of wall time, summed over threads
    memory: str | None  # others' memory load, in words (None: none that presses on ours)
    steal_cores: float
    irq_cores: float
    cpus: int = field(default_factory=lambda: psutil.cpu_count(logical=True) or 1)  # the machine's logical CPUs
    unread: int = 0  # other processes whose page-ins are unknown (their counters could not be read)
    unaccounted_mib_s: float = 0.0  # the machine's page-ins no process we read brought in, at least

    @property
    def wait_per_run(self) -> float | None:
        """Our threads' wait for a CPU per second they ran; None when they hardly ran (nothing to judge by)."""
        return self.our_wait_share / self.our_cores if self.our_cores >= OUR_MIN_CORES else None

    @property
    def saturated(self) -> bool:
        """Others' work and ours filled the machine's CPUs (others at least :data:`NOTABLE_CORES`)."""
        return self.cores >= NOTABLE_CORES and self.cores + self.our_cores >= SATURATED_SHARE * self.cpus

    def cpu_busy(self, limit_cores: float) -> bool:
        """Others' CPU disturbed the measurement: by what it did to our threads while they ran (their wait, or every
        CPU taken), else (nothing of ours ran) by ``limit_cores``."""
        per_run = self.wait_per_run
        if per_run is None:
            return self.cores >= limit_cores
        return self.cores >= OTHERS_MIN_CORES and (per_run >= WAIT_PER_RUN_LIMIT or self.saturated)


def _grown(before: Mapping[int, int], after: Mapping[int, int]) -> dict[int, int]:
    """Anonymous bytes each process gained (processes that shrank or came and went count nothing)."""
    return {pid: n - before[pid] for pid, n in after.items() if pid in before and n > before[pid]}


def _traffic(before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]]) -> Causes:
    ins = sum(max(0, a[0] - before.get(pid, (0, 0))[0]) for pid, a in after.items())
    dirtied = sum(max(0, a[1] - before.get(pid, (0, 0))[1]) for pid, a in after.items())
    return Causes(ins, 0, dirtied)


def unaccounted_page_ins(a: Look, b: Look) -> int:
    """Pages the machine brought in between looks ``a`` and ``b`` that none of the processes we read did, at least.

    The machine's counters are read before every process's (``vm``) and again after them (``vm_after``), so the
    machine's window from ``a.vm_after`` to ``b.vm`` lies inside each process's: whatever order the reads fell in, a
    process we read cannot have brought in more of it than its own counters say. Read at one moment beside ours at
    another, a look whose engine read its model at 2 GB/s showed 8-32 MiB that were nobody's, in whole read-ahead
    windows (results/benchmarks/which-engine-cpu/*-books.jsonl.gz): the engine's own, read a few ms apart. A new
    process counts all it brought in, and a parent that reaps a child in the look all the child did (its ``io``
    holds its reaped children's): both can only lower the figure. What is left is the unread processes', the
    kernel's threads' and that of processes that came and went."""
    machine = pressure.machine_page_ins(b.vm) - pressure.machine_page_ins(a.vm_after or a.vm)
    read = _traffic(a.ours_traffic, b.ours_traffic).page_ins + _traffic(a.others_traffic, b.others_traffic).page_ins
    return max(0, machine - read)


def account(a: Look, b: Look, elapsed_s: float) -> Books:
    """The books between looks ``a`` and ``b``, ``elapsed_s`` apart (see the module's docstring)."""
    timed = elapsed_s >= MIN_CPU_WINDOW_S
    per_s = 1 / elapsed_s if timed else 0.0
    used = {pid: max(0.0, p.cpu_s - a.others[pid].cpu_s) if pid in a.others else p.cpu_s
            for pid, p in b.others.items()}
    machine = b.cpu - a.cpu
    kernel_s = sum(max(0.0, t - a.kernel_cpu.get(pid, 0.0)) for pid, t in b.kernel_cpu.items())
    page = pressure.PAGE_BYTES
    grown_all = _grown(a.anon, b.anon)
    their_growth = _grown(*({pid: x.anon_bytes for pid, x in look.others.items()} for look in (a, b)))
    on_machine = Causes(max(0, pressure.machine_page_ins(b.vm) - pressure.machine_page_ins(a.vm)),
                        sum(grown_all.values()) // page, max(0, b.vm.get("nr_dirtied", 0) - a.vm.get("nr_dirtied", 0)))
    ours = _traffic(a.ours_traffic, b.ours_traffic) + Causes(0, sum(_grown(a.ours_anon, b.ours_anon).values()) // page)
    ours_cpu = max(0.0, b.ours_cpu_s - a.ours_cpu_s)
    if not b.scoped:  # the whole machine's work and causes, minus ours (short-lived processes are in both sums)
        theirs = on_machine.less(ours)
        own_work = machine.work_s - ours_cpu - kernel_s
    else:
        theirs = _traffic(a.others_traffic, b.others_traffic) + Causes(0, sum(their_growth.values()) // page)
        own_work = sum(used.values())
    for_them = pressure.kernel_share(kernel_s, theirs.pages, on_machine.pages)
    cores = max(0.0, own_work + for_them) * per_s
    top = sorted(used, key=lambda pid: used[pid], reverse=True)[:NAMED_AT_MOST]
    named = tuple((b.others[pid].name, pid, used[pid] * per_s) for pid in top if used[pid] * per_s >= NOTABLE_CORES)
    reclaimed = max(0, b.vm.get("pgsteal", 0) - a.vm.get("pgsteal", 0)) * page
    stalled = (b.psi["memory"][0] - a.psi["memory"][0]) / 1e4 / elapsed_s if timed and a.psi and b.psi else 0.0
    pagers = _paged_in(a.others_traffic, b.others_traffic)
    # Under a scope the machine's page-ins hold other suites' too, which the scope exists not to see: what the
    # scope's readable processes leave of them says nothing of its unread ones (a child that exited mid-read).
    unread = 0 if b.scoped else len(a.unread | b.unread)
    unaccounted = unaccounted_page_ins(a, b) * page / MIB * per_s if unread else 0.0
    memory = _memory_load(pagers, their_growth, b.others, reclaimed, stalled, elapsed_s) if timed else None
    if timed and (unknown := _unknown_load(unread, unaccounted, stalled)):
        memory = "; ".join(x for x in (memory, unknown) if x)
    return Books(elapsed_s, cores, {pid: s * per_s for pid, s in used.items()}, named,
                 max(0.0, cores - (sum(used.values()) + for_them) * per_s),
                 pressure.kernel_share(kernel_s, ours.pages, on_machine.pages) * per_s, for_them * per_s,
                 ours_cpu * per_s, max(0, b.ours_wait_ns - a.ours_wait_ns) / 1e9 * per_s, memory,
                 max(0.0, machine.steal_s) * per_s, max(0.0, machine.interrupts_s) * per_s,
                 unread=unread, unaccounted_mib_s=unaccounted)


def _unknown_load(unread: int, unaccounted_mib_s: float, stalled_pct: float) -> str | None:
    """Processes we could not read that could have paged beside ours, in words; None: they could not have.

    The machine's page-ins that no process we read brought in (:func:`unaccounted_page_ins`) are at most theirs, and
    they could be theirs where they pass the bar a named process's paging must pass (:data:`OTHERS_PAGING_MIB_S`
    under :data:`MEMORY_PRESSURE_PCT`). Then a paging verdict measured beside them is not pinned on the line
    (:meth:`tuner.machine.sampler.PagingVerdict.beside`): they are said, as a named pager is. Below the bar, or with
    every process read, the remainder is nobody's (issue 61: the kernel's threads, processes that came and went)."""
    if not unread or unaccounted_mib_s < OTHERS_PAGING_MIB_S or stalled_pct < MEMORY_PRESSURE_PCT:
        return None
    who = "1 process could not be read: its" if unread == 1 else f"{unread:,} processes could not be read: their"
    return (f"{who} page-ins are unknown ({unaccounted_mib_s:,.0f} MiB/s of the machine's page-ins are no readable "
            f"process's; memory pressure {stalled_pct:.0f} %)")


def _paged_in(before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]]) -> dict[int, int]:
    """Pages each other process brought in between two looks (those seen in both)."""
    return {pid: n[0] - before[pid][0] for pid, n in after.items() if pid in before and n[0] > before[pid][0]}


def _memory_load(pagers: Mapping[int, int], growth: Mapping[int, int], procs: Mapping[int, Proc],
                 reclaimed_bytes: int, stalled_pct: float, elapsed_s: float) -> str | None:
    """Others' paging under memory pressure, or others' growth while the kernel reclaims, in words; None: neither.

    Paging is others' only where other processes are seen bringing pages in (their own fault and read counters),
    never the machine's page-ins less ours: that remainder also holds what no process is charged for, and on this
    project's machine it read 16-33 MiB/s while nothing ran beside a 17 GiB model's llama-server, so the round was
    called busy for the rig's own RAM pressure, which is the host-paging verdict's to judge (issue 61)."""
    parts = []
    paging_mib_s = sum(pagers.values()) * pressure.PAGE_BYTES / MIB / elapsed_s
    if paging_mib_s >= OTHERS_PAGING_MIB_S and stalled_pct >= MEMORY_PRESSURE_PCT:
        most = sorted(pagers, key=lambda pid: pagers[pid], reverse=True)[:NAMED_AT_MOST]
        who = ", ".join(f"{procs[pid].name if pid in procs else '?'} pid {pid} "
                        f"{pagers[pid] * pressure.PAGE_BYTES / MIB / elapsed_s:,.0f} MiB/s" for pid in most)
        parts.append(f"other processes page in {paging_mib_s:,.0f} MiB/s from disk ({who}; memory pressure "
                     f"{stalled_pct:.0f} %)")
    grown_mib = sum(growth.values()) / MIB
    reclaim_mib = reclaimed_bytes / MIB
    if grown_mib / elapsed_s >= OTHERS_GROWTH_MIB_S and reclaim_mib / elapsed_s >= RECLAIM_MIB_S:
        most = sorted(growth, key=lambda pid: growth[pid], reverse=True)[:NAMED_AT_MOST]
        who = ", ".join(f"{procs[pid].name} pid {pid} +{growth[pid] / MIB:,.0f} MiB" for pid in most)
        parts.append(f"other processes took {grown_mib:,.0f} MiB of RAM ({who}) while the kernel reclaimed "
                     f"{reclaim_mib:,.0f} MiB")
    return "; ".join(parts) or None


def log_look(path: Path, a: Look, b: Look, ledger: Books) -> None:
    """One JSON line per look: the machine's page-ins beside ours and each other process's, what no process we read
    brought in and how many we could not read, the memory stall and what the books made of it (MOE_TUNE_BOOKS_LOG;
    how issue 61's "others page in" on a quiet machine was traced)."""
    mib = pressure.PAGE_BYTES / MIB
    elapsed_s = ledger.elapsed_s
    theirs = _paged_in(a.others_traffic, b.others_traffic)
    ours = sum(max(0, n[0] - a.ours_traffic.get(pid, (0, 0))[0]) for pid, n in b.ours_traffic.items())
    gone = [pid for pid in a.ours_traffic if pid not in b.ours_traffic]
    row = {"t": round(time.time(), 2), "window_s": round(elapsed_s, 3),
           "machine_page_ins_mib": round((pressure.machine_page_ins(b.vm) - pressure.machine_page_ins(a.vm)) * mib, 1),
           "ours_mib": round(ours * mib, 1), "ours_gone": gone,
           "others_mib": {f"{b.others[pid].name if pid in b.others else '?'}:{pid}": round(n * mib, 1)
                          for pid, n in theirs.items()},
           "unaccounted_mib": round(unaccounted_page_ins(a, b) * mib, 1), "unread": len(a.unread | b.unread),
           "memory_stall_pct": round((b.psi["memory"][0] - a.psi["memory"][0]) / 1e4 / elapsed_s, 1)
           if a.psi and b.psi else None, "memory_verdict": ledger.memory}
    with contextlib.suppress(OSError), path.open("a") as f:
        f.write(json.dumps(row) + "\n")
