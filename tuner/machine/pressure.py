"""What the kernel says about host memory and CPU pressure, and whose it is (Linux; elsewhere nothing is known).

- Pressure stall information: ``/proc/pressure/{cpu,memory,io}`` and, under cgroup v2, this process's cgroup's
  ``*.pressure`` (what systemd-oomd acts on): the ``total=`` stall microseconds of "some" and "full" tasks.
- ``/proc/vmstat``: ``pgmajfault`` (major faults, machine-wide), ``pgpgin`` (KiB read from block devices),
  ``pgscan_*`` / ``pgsteal_*`` (pages the kernel scanned and reclaimed), ``nr_dirtied`` (pages made dirty, which the
  flusher's kworkers write back).
- ``/proc/<pid>/stat``: ``majflt`` and ``cmajflt`` (fields 12 and 13): a process's major faults and its reaped
  children's; ``/proc/<pid>/io`` ``read_bytes``: what it (and, like ``cmajflt``, the children it reaped:
  ``wait_task_zombie`` adds their counts to its own) made the kernel fetch from storage. One major fault on a
  file read in order starts a read-ahead of megabytes whose pages then fault in as minor ones (measured here: 2
  major faults and 4.3 GB read in 3 s), so "page-ins" count both: major faults plus pages read from storage. Its
  ``write_bytes`` is charged to the process that dirties a page, when it dirties it (``folio_account_dirtied`` →
  ``task_io_account_write``), not to the kworker that later writes it back: who made the writeback work.
- ``/proc/<pid>/task/*/schedstat``: per thread, time on a CPU and time waiting on a run queue (ns).

Every process's files are read through :func:`proc_text`. ``stat`` is anyone's to read; ``io`` only the process's
own user's (the kernel asks for ptrace access), so another user's page traffic cannot be read at all, and a process
that exits between the listing and the read has none to read: :func:`read_traffic` raises for both, and the books
count such a process's page-ins as unknown, never as zero (:mod:`tuner.machine.books`).

Kernel threads (kthreadd, pid 2, and its children: ``kswapd*``, ``kcompactd*``, ``kdamond``, kworkers) work for
whoever makes them: page-in I/O for the process that faults pages in, reclaim for whoever needs free pages (a page
brought in, or an anonymous page a program allocates), writeback for whoever dirtied the pages. :func:`kernel_share`
gives a look's kernel CPU to a side in proportion to its share of those causes (:mod:`tuner.machine.books`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

KTHREADD_PID = 2
PSI_RESOURCES = ("cpu", "memory", "io")
PROC = Path("/proc")
PAGE_BYTES = 4096


def is_kernel_thread(pid: int, ppid: int) -> bool:
    """kthreadd and its children: the kernel's own threads (no user program's)."""
    return pid == KTHREADD_PID or ppid == KTHREADD_PID


def kernel_share(kernel_s: float, theirs: int, machine: int) -> float:
    """The part of the kernel threads' CPU time (``kernel_s``) done for someone: their share of the machine's
    page-ins. With no page brought in for anyone, the kernel's work is housekeeping and counts for nobody."""
    if machine <= 0 or kernel_s <= 0:
        return 0.0
    return kernel_s * min(1.0, max(0.0, theirs / machine))


def proc_text(pid: int, name: str) -> str:
    """``/proc/<pid>/<name>``: every per-process file this package reads goes through here. Raises OSError: the
    process is gone (FileNotFoundError, ProcessLookupError), or the file is not ours to read (PermissionError:
    another user's ``io``)."""
    return (PROC / str(pid) / name).read_text()


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` from field 3 (state) on: ``fields[0]`` is field 3, so field N is ``fields[N - 3]``
    (``man 5 proc``). Raises OSError (see :func:`proc_text`)."""
    text = proc_text(pid, "stat")
    return text[text.rfind(")") + 2:].split()  # the name may hold spaces and ")": split after its last ")"


def majflt(pid: int) -> int:
    """Major faults of ``pid`` and of the children it reaped (0 when it is gone or unreadable)."""
    try:
        fields = _stat_fields(pid)
        return int(fields[9]) + int(fields[10])  # majflt (field 12) + cmajflt (field 13)
    except (OSError, IndexError, ValueError):
        return 0


def _io(text: str) -> tuple[int, int]:
    found = {"read_bytes": 0, "write_bytes": 0}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in found:
            found[key] = int(value)
    return found["read_bytes"], found["write_bytes"]


def io_bytes(pid: int) -> tuple[int, int]:
    """Bytes ``pid`` made the kernel read from storage and bytes it dirtied for writing back (``/proc/<pid>/io``
    ``read_bytes`` and ``write_bytes``; 0 when gone or not ours to read)."""
    with contextlib.suppress(OSError, ValueError):
        return _io(proc_text(pid, "io"))
    return 0, 0


def read_bytes(pid: int) -> int:
    """Bytes ``pid`` made the kernel read from storage (``/proc/<pid>/io``; 0 when gone or not ours to read)."""
    return io_bytes(pid)[0]


def page_ins(pid: int) -> int:
    """Pages ``pid`` brought in: its major faults plus the pages it had read from storage (read-ahead included)."""
    return page_traffic(pid)[0]


def page_traffic(pid: int) -> tuple[int, int]:
    """(pages ``pid`` brought in, pages it dirtied), read together; 0 for what cannot be read (our own processes:
    one that is gone brought nothing more in)."""
    read, written = io_bytes(pid)
    return majflt(pid) + read // PAGE_BYTES, written // PAGE_BYTES


def read_traffic(pid: int) -> tuple[int, int]:
    """:func:`page_traffic` of a process that is not ours, where what cannot be read is no zero: raises OSError
    (gone, or another user's ``io``), ValueError or IndexError (a file cut short)."""
    fields = _stat_fields(pid)
    read, written = _io(proc_text(pid, "io"))
    return int(fields[9]) + int(fields[10]) + read // PAGE_BYTES, written // PAGE_BYTES


def own_traffic(pid: int) -> tuple[int, int]:
    """:func:`page_traffic` of ``pid`` alone, without the children it reaped (0 for what cannot be read): its own
    ``majflt`` (field 12, not ``cmajflt``, field 13) and the ``io`` of its live threads
    (``/proc/<pid>/task/<tid>/io`` holds one thread's own; the process's ``io`` adds its exited threads' and its
    reaped children's). For a parent that is ours while its other children are not (:mod:`tuner.machine.owner`)."""
    faults, read, written = 0, 0, 0
    with contextlib.suppress(OSError, IndexError, ValueError):
        faults = int(_stat_fields(pid)[9])
    with contextlib.suppress(OSError):
        for task in (PROC / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                r, w = _io(proc_text(pid, f"task/{task.name}/io"))
                read, written = read + r, written + w
    return faults + read // PAGE_BYTES, written // PAGE_BYTES


def machine_page_ins(vm: Mapping[str, int]) -> int:
    """The same for the whole machine, from /proc/vmstat (``pgpgin`` is in KiB)."""
    return vm["pgmajfault"] + vm["pgpgin"] * 1024 // PAGE_BYTES


def run_wait_ns(pids: Iterable[int]) -> int:
    """Nanoseconds the threads of ``pids`` have spent runnable but waiting for a CPU (``schedstat`` field 2)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in (PROC / str(pid) / "task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int((task / "schedstat").read_text().split()[1])
    return total


def vmstat() -> dict[str, int]:
    """The counters of ``/proc/vmstat`` this module reads (the ``pgscan_*``/``pgsteal_*`` kinds summed)."""
    out = {"pgmajfault": 0, "pgpgin": 0, "pgscan": 0, "pgsteal": 0, "nr_dirtied": 0}
    with contextlib.suppress(OSError):
        for line in (PROC / "vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if not value.strip().isdigit():
                continue
            if key in ("pgmajfault", "pgpgin", "nr_dirtied"):
                out[key] = int(value)
            elif key.startswith(("pgscan_", "pgsteal_")) and not key.endswith(("_anon", "_file")):
                out[key.split("_")[0]] += int(value)  # pgscan_kswapd + _direct (+ _khugepaged): the kinds, once
    return out


def _cgroup_dir() -> Path | None:
    """This process's cgroup v2 folder, where it has pressure files (None: cgroup v1, or the root)."""
    with contextlib.suppress(OSError):
        for line in (PROC / "self" / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip().lstrip("/")
                folder = Path("/sys/fs/cgroup") / rel
                if rel and (folder / "memory.pressure").is_file():
                    return folder
    return None


def psi_totals(folder: Path | None = None) -> dict[str, tuple[int, int]] | None:
    """Stall microseconds per resource: (some, full) from the ``total=`` fields; None without PSI."""
    out: dict[str, tuple[int, int]] = {}
    for res in PSI_RESOURCES:
        path = (folder / f"{res}.pressure") if folder else PROC / "pressure" / res
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return None
        totals = {line.split()[0]: int(line.rsplit("total=", 1)[1]) for line in lines if "total=" in line}
        out[res] = (totals.get("some", 0), totals.get("full", 0))
    return out


@dataclass(frozen=True, slots=True)
class HostCounters:
    """One reading of the counters, for the processes ``ours`` names."""

    t_s: float
    vm: dict[str, int]
    psi: dict[str, tuple[int, int]] | None
    our_majflt: int
    our_read_bytes: int
    our_wait_ns: int
    psi_scope: str = "machine"  # "machine" (/proc/pressure) or "cgroup" (this process's cgroup v2)


def read_counters(ours: Iterable[int]) -> HostCounters:
    pids = list(ours)
    cgroup = _cgroup_dir()
    psi = psi_totals(cgroup) if cgroup else None
    scope = "cgroup" if psi is not None else "machine"
    return HostCounters(time.monotonic(), vmstat(), psi if psi is not None else psi_totals(),
                        sum(majflt(p) for p in pids), sum(read_bytes(p) for p in pids), run_wait_ns(pids), scope)


@dataclass(frozen=True, slots=True)
class HostPressure:
    """What happened to host memory between two readings; ``*_pct``: share of the window some (or all) tasks
    stalled on that resource (None without PSI)."""

    window_s: float
    our_majflt: int
    machine_majflt: int
    our_read_bytes: int
    pgpgin_bytes: int
    pgscan: int
    pgsteal: int
    memory_some_pct: float | None = None
    memory_full_pct: float | None = None
    cpu_some_pct: float | None = None
    io_some_pct: float | None = None
    our_wait_s: float = 0.0  # our threads' run-queue wait over the window (summed over threads)
    psi_scope: str = "machine"

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__slots__}


def between(a: HostCounters, b: HostCounters) -> HostPressure:
    window = max(1e-9, b.t_s - a.t_s)

    def pct(res: str, which: int) -> float | None:
        if a.psi is None or b.psi is None:
            return None
        return 100.0 * max(0, b.psi[res][which] - a.psi[res][which]) / 1e6 / window

    return HostPressure(window, max(0, b.our_majflt - a.our_majflt),
                        max(0, b.vm["pgmajfault"] - a.vm["pgmajfault"]), max(0, b.our_read_bytes - a.our_read_bytes),
                        1024 * max(0, b.vm["pgpgin"] - a.vm["pgpgin"]), max(0, b.vm["pgscan"] - a.vm["pgscan"]),
                        max(0, b.vm["pgsteal"] - a.vm["pgsteal"]), pct("memory", 0), pct("memory", 1),
                        pct("cpu", 0), pct("io", 0), max(0, b.our_wait_ns - a.our_wait_ns) / 1e9, b.psi_scope)


def combined(parts: Iterable[HostPressure | None]) -> HostPressure | None:
    """Several windows of one run as one (the timed parts of a process that also did other things between them):
    counts and times summed, each stall share weighted by its window; None when no window was read."""
    got = [p for p in parts if p is not None]
    if not got:
        return None
    if len(got) == 1:
        return got[0]
    window = sum(p.window_s for p in got)

    def pct(name: str) -> float | None:
        values = [(getattr(p, name), p.window_s) for p in got]
        if any(v is None for v, _ in values):
            return None
        return sum(v * w for v, w in values) / window if window > 0 else 0.0

    return HostPressure(window, sum(p.our_majflt for p in got), sum(p.machine_majflt for p in got),
                        sum(p.our_read_bytes for p in got), sum(p.pgpgin_bytes for p in got),
                        sum(p.pgscan for p in got), sum(p.pgsteal for p in got), pct("memory_some_pct"),
                        pct("memory_full_pct"), pct("cpu_some_pct"), pct("io_some_pct"),
                        sum(p.our_wait_s for p in got), got[0].psi_scope)


def available() -> bool:
    """The counters exist here (Linux with /proc)."""
    return os.path.exists(PROC / "vmstat")
