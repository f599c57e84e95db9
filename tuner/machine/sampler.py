"""Memory and power sampled DURING a trial, and the spill verdicts drawn from them: VRAM (:func:`spill_verdict`)
and host RAM (:func:`paging_verdict`: the model's pages read back from disk while it generates).

A background thread reads NVML (VRAM used on the device, VRAM used by the watched process where the driver
reports it, power draw, the energy counter) and psutil (RSS of the watched process tree, host swap) every
``interval_s``. NVML is passed in as a module-like object so tests hand in a fake at this hardware boundary;
without a driver the GPU fields stay ``None`` and the host figures are still sampled.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import psutil

from tuner.core.errors import NvmlUnavailableError
from tuner.core.units import MIB
from tuner.machine import hardware, pressure, processes
from tuner.machine.pressure import HostCounters, HostPressure

DEFAULT_INTERVAL_S = 0.2
# VRAM this close to the card's total counts as "at capacity" (drivers keep a little for themselves).
CAPACITY_MARGIN_BYTES = 256 * 2**20
# Measured generation below this fraction of the roofline while VRAM is full: a spill, not a slow config.
CLIFF_FRACTION = 0.25
SWAP_GROWTH_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    proc_vram_bytes: int | None = None
    power_w: float | None = None
    energy_mj: int | None = None  # the driver's cumulative energy counter, where the card has one
    rss_bytes: int | None = None
    swap_used_bytes: int = 0


@dataclass(frozen=True, slots=True)
class MemoryReport:
    n_samples: int
    duration_s: float
    vram_total_bytes: int | None
    vram_baseline_bytes: int | None  # first sample: what other processes already held
    vram_peak_bytes: int | None
    proc_vram_peak_bytes: int | None
    power_peak_w: float | None
    energy_j: float | None
    rss_peak_bytes: int | None
    swap_growth_bytes: int

    def tokens_per_joule(self, tokens: int) -> float | None:
        return tokens / self.energy_j if self.energy_j else None


def summarize(samples: list[Sample]) -> MemoryReport:
    """Peaks, growth and energy from a run's samples (pure: no clock, no I/O)."""
    if not samples:
        return MemoryReport(0, 0.0, None, None, None, None, None, None, None, 0)

    def peak(values: list[Any]) -> Any:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    vram = [s.vram_used_bytes for s in samples]
    return MemoryReport(
        n_samples=len(samples),
        duration_s=samples[-1].t_s - samples[0].t_s,
        vram_total_bytes=peak([s.vram_total_bytes for s in samples]),
        vram_baseline_bytes=next((v for v in vram if v is not None), None),
        vram_peak_bytes=peak(vram),
        proc_vram_peak_bytes=peak([s.proc_vram_bytes for s in samples]),
        power_peak_w=peak([s.power_w for s in samples]),
        energy_j=energy_j(samples),
        rss_peak_bytes=peak([s.rss_bytes for s in samples]),
        swap_growth_bytes=max(0, max(s.swap_used_bytes for s in samples) - samples[0].swap_used_bytes),
    )


def energy_j(samples: list[Sample]) -> float | None:
    """Joules over the run: the driver's counter when it has one, else power integrated over time."""
    counters = [s.energy_mj for s in samples if s.energy_mj is not None]
    if len(counters) >= 2:
        return (counters[-1] - counters[0]) / 1000.0
    powered = [s for s in samples if s.power_w is not None]
    if len(powered) < 2:
        return None
    total = 0.0
    for a, b in zip(powered, powered[1:], strict=False):
        total += (b.t_s - a.t_s) * ((a.power_w or 0.0) + (b.power_w or 0.0)) / 2
    return total


class Sampler:
    """Samples in a daemon thread between :meth:`start` and :meth:`stop`; use as a context manager."""

    def __init__(self, nvml: Any = None, *, gpu_index: int = 0, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.gpu_index = gpu_index
        self.samples: list[Sample] = []
        self._nvml = nvml
        self._handle: Any = None
        self._pid: int | None = None
        self._before: set[int] = set()  # NVML's compute pids when sampling started (before our process)
        self._arrived: dict[int, float] = {}  # in a PID namespace: NVML pids that came later, first seen when
        self._namespaced = processes.in_pid_namespace()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._timed_from: HostCounters | None = None
        self.host: HostPressure | None = None  # host memory over the timed part (see :meth:`begin_timed`)

    def begin_timed(self) -> None:
        """The timed part starts (after the warm-up): host counters are read now and at :meth:`end_timed`."""
        if pressure.available():
            self._timed_from = pressure.read_counters(p.pid for p in self._tree())

    def end_timed(self) -> HostPressure | None:
        if self._timed_from is not None:
            self.host = pressure.between(self._timed_from, pressure.read_counters(p.pid for p in self._tree()))
        return self.host

    def attach(self, pid: int) -> None:
        """Watch this process (and its children) from now on."""
        self._pid = pid
        self.sample_now()

    def sample_now(self) -> None:
        """One extra sample outside the schedule (short runs can fit between two ticks)."""
        if self._thread is not None:
            self.samples.append(self.read_once())

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._open_nvml()
        if self._namespaced and self._handle is not None:
            with contextlib.suppress(Exception):
                self._before = {int(p.pid) for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)}
        self.samples.append(self.read_once())
        self._thread = threading.Thread(target=self._loop, name="moe-tune-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> MemoryReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            self.samples.append(self.read_once())
        if self._nvml is not None and self._handle is not None:
            hardware.close_nvml(self._nvml)
            self._handle = None
        return self.report()

    def report(self) -> MemoryReport:
        return summarize(list(self.samples))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.read_once())

    def _open_nvml(self) -> None:
        try:
            self._nvml = hardware.open_nvml(self._nvml)
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
        except NvmlUnavailableError:
            return  # a CPU-only run
        except Exception:  # no such card
            self._handle = None

    def read_once(self) -> Sample:
        now = self.clock()
        used = total = proc_used = energy = None
        power = None
        nv, handle = self._nvml, self._handle
        if nv is not None and handle is not None:
            with contextlib.suppress(Exception):
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                used, total = int(mem.used), int(mem.total)
            with contextlib.suppress(Exception):
                power = float(nv.nvmlDeviceGetPowerUsage(handle)) / 1000.0  # mW
            with contextlib.suppress(Exception):
                energy = int(nv.nvmlDeviceGetTotalEnergyConsumption(handle))  # mJ
            proc_used = self._proc_vram(nv, handle)
        return Sample(now, used, total, proc_used, power, energy, self._rss(), int(psutil.swap_memory().used))

    def _tree(self) -> list[psutil.Process]:
        if self._pid is None:
            return []
        try:
            root = psutil.Process(self._pid)
            return [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return []

    def _rss(self) -> int | None:
        tree = self._tree()
        total = 0
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += int(proc.memory_info().rss)
        return total if tree else None

    def _proc_vram(self, nv: Any, handle: Any) -> int | None:
        pids = {p.pid for p in self._tree()}
        if not pids:
            return None
        try:
            running = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        # usedGpuMemory is None where the driver cannot attribute memory (Windows WDDM).
        mine = [int(p.usedGpuMemory) for p in running if p.pid in pids and p.usedGpuMemory is not None]
        if not mine and self._namespaced:
            # In a PID namespace NVML reports the host's pids, none of them ours to match: ours are the contexts
            # that came after sampling started, the earliest first, as many as our processes (as
            # tuner.machine.processes._ours_by_arrival tells ours from theirs; the watch names a later newcomer).
            now = self.clock()
            for p in running:
                if int(p.pid) not in self._before:
                    self._arrived.setdefault(int(p.pid), now)
            ours = set(sorted(self._arrived, key=lambda pid: self._arrived[pid])[:len(pids)])
            mine = [int(p.usedGpuMemory) for p in running if p.pid in ours and p.usedGpuMemory is not None]
        return sum(mine) if mine else None


# ----------------------------------------------------------------------------------------------- verdict


class SpillKind(str, Enum):
    NONE = "none"
    OOM_AT_LOAD = "oom_at_load"
    VRAM_AT_CAPACITY = "vram_at_capacity"
    THROUGHPUT_CLIFF = "throughput_cliff"
    HOST_SWAP = "host_swap"


@dataclass(frozen=True, slots=True)
class SpillVerdict:
    kind: SpillKind
    evidence: str


def spill_verdict(
    memory: MemoryReport | None,
    *,
    oom_reason: str | None = None,
    gen_tok_s: float | None = None,
    roofline_tok_s: float | None = None,
    margin_bytes: int = CAPACITY_MARGIN_BYTES,
    vram_budget_bytes: int | None = None,
) -> SpillVerdict:
    """Did this run spill out of VRAM, and what shows it. ``oom_reason``: the engine failed to allocate.
    ``vram_budget_bytes``: full means what others held at the first sample plus this budget (a big card
    standing in for a small one), not the card's total."""
    if oom_reason is not None:
        return SpillVerdict(SpillKind.OOM_AT_LOAD, f"the engine failed to allocate: {oom_reason}")
    if memory is None or memory.n_samples == 0:
        return SpillVerdict(SpillKind.NONE, "nothing was sampled")
    swap = f"host swap +{memory.swap_growth_bytes / MIB:,.0f} MiB"
    peak, total = memory.vram_peak_bytes, memory.vram_total_bytes
    if peak is not None and total:
        full = total if not vram_budget_bytes else min(total, (memory.vram_baseline_bytes or 0) + vram_budget_bytes)
        of = "" if full == total else f" (budget {(vram_budget_bytes or 0) / MIB:,.0f} MiB over {total / MIB:,.0f})"
        vram = f"VRAM peaked at {peak / MIB:,.0f} of {full / MIB:,.0f} MiB{of}"
        if peak >= full - margin_bytes:
            if gen_tok_s is not None and roofline_tok_s and gen_tok_s < CLIFF_FRACTION * roofline_tok_s:
                share = 100 * gen_tok_s / roofline_tok_s
                return SpillVerdict(
                    SpillKind.THROUGHPUT_CLIFF,
                    f"generation {gen_tok_s:,.1f} tok/s is {share:.0f} % of the {roofline_tok_s:,.0f} tok/s "
                    f"roofline while {vram}",
                )
            return SpillVerdict(SpillKind.VRAM_AT_CAPACITY, f"{vram} (within {margin_bytes / MIB:.0f} MiB of full)")
    else:
        vram = "no NVIDIA GPU sampled"
    if memory.swap_growth_bytes >= SWAP_GROWTH_BYTES:
        return SpillVerdict(SpillKind.HOST_SWAP, f"{swap} during the run; {vram}")
    return SpillVerdict(SpillKind.NONE, f"{vram}; {swap}; {memory.n_samples} samples")


class PagingKind(str, Enum):
    NONE = "none"
    HOST_PAGING = "host_paging"
    # The engine read its model back while other programs' memory load pressed on it (tuner.machine.books): their
    # doing, interference to measure again, not a property of the config.
    BESIDE_OTHERS = "paging_beside_others"


# A config that fits RAM takes no major fault while it generates: llama.cpp maps the model with MAP_POPULATE and
# POSIX_MADV_WILLNEED at load (src/llama-mmap.cpp, llama_mmap::impl), so every page is in RAM before the warm-up.
# Faults during the timed part are pages the kernel evicted and the engine read back: host paging.
PAGING_FAULTS_PER_TOKEN = 1.0
PAGING_MIN_FAULTS = 64  # fewer is a lazily loaded library page or two, not a model being read back
# Read-ahead brings most of a file read in order as minor faults after one major one: the bytes the engine had read
# from storage are the other half of the evidence.
PAGING_READ_BYTES_PER_TOKEN = 2**20
PAGING_MIN_READ_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class PagingVerdict:
    kind: PagingKind
    evidence: str
    faults_per_token: float | None = None
    fix: str | None = None  # what to change, in the user's flags (filled in where flags are spelled)

    @property
    def paging(self) -> bool:
        return self.kind is PagingKind.HOST_PAGING

    @property
    def beside_others(self) -> bool:
        return self.kind is PagingKind.BESIDE_OTHERS

    def beside(self, others_memory: str | None) -> PagingVerdict:
        """This verdict with its cause judged: paging measured while a watch saw ``others_memory`` (other programs
        paging, or taking RAM while the kernel reclaimed, or processes we could not read that could have paged:
        :mod:`tuner.machine.books`) is theirs, not the config's; else unchanged."""
        if not self.paging or not others_memory:
            return self
        return PagingVerdict(PagingKind.BESIDE_OTHERS, f"{self.evidence}; meanwhile {others_memory}",
                             self.faults_per_token)

    @property
    def measured(self) -> bool:
        """The counters were read over a timed part (a "none" verdict is then a finding, not a blank)."""
        return not self.evidence.startswith(NOT_MEASURED_WORDS)

    def describe(self) -> str:
        return f"{self.kind.value} ({self.evidence}){f': {self.fix}' if self.fix else ''}"

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.kind.value, "evidence": self.evidence, "major_faults_per_token": self.faults_per_token,
                "fix": self.fix}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> PagingVerdict:
        """From :meth:`to_dict` (None: a record stored before the verdict was kept)."""
        if not d:
            return NOT_MEASURED
        return cls(PagingKind(d.get("verdict", PagingKind.NONE.value)), str(d.get("evidence") or NOT_MEASURED_WORDS),
                   d.get("major_faults_per_token"), d.get("fix"))


NOT_MEASURED_WORDS = "not measured"
NOT_MEASURED = PagingVerdict(PagingKind.NONE, NOT_MEASURED_WORDS)


def paging_verdict(host: HostPressure | None, gen_tokens: int) -> PagingVerdict:
    """Did the engine read its model back from disk while it generated: its major faults, or the bytes it had read
    from storage, per generated token over the timed part; the machine's memory pressure and page-ins beside them."""
    if host is None:
        return PagingVerdict(PagingKind.NONE, "not measured (no /proc here, or no timed part)")
    per_token = host.our_majflt / gen_tokens if gen_tokens > 0 else None
    psi = "" if host.memory_some_pct is None else (f"; memory pressure some {host.memory_some_pct:.1f} % / full "
                                                   f"{host.memory_full_pct or 0:.1f} % ({host.psi_scope})")
    rate = "" if per_token is None else f"{per_token:,.1f} per generated token, "
    read = host.our_read_bytes / gen_tokens if gen_tokens > 0 else 0.0
    seen = (f"{host.our_majflt:,} major faults ({rate}{host.machine_majflt:,} on the machine), "
            f"{host.our_read_bytes / MIB:,.0f} MiB read from storage by the engine ({read / MIB:,.1f} per token; "
            f"{host.pgpgin_bytes / MIB:,.0f} on the machine), "
            f"{host.pgsteal:,} pages reclaimed over {host.window_s:.1f} s{psi}")
    faulting = per_token is not None and host.our_majflt >= PAGING_MIN_FAULTS and per_token >= PAGING_FAULTS_PER_TOKEN
    reading = host.our_read_bytes >= PAGING_MIN_READ_BYTES and read >= PAGING_READ_BYTES_PER_TOKEN
    if faulting or reading:
        return PagingVerdict(PagingKind.HOST_PAGING, f"the engine read its model back from disk while generating: "
                                                     f"{seen}", per_token)
    return PagingVerdict(PagingKind.NONE, seen, per_token)
