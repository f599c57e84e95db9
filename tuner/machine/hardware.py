"""The only module that probes the machine: NVIDIA GPUs through NVML, host memory and cores through psutil.

NVML is passed in as a module-like object so tests can hand in a fake at this boundary; by default the real
bindings (the ``nvidia-ml-py`` distribution, imported as ``pynvml``) are used. A machine without an NVIDIA
driver is a normal case ("CPU only"), never a crash.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from tuner.core.errors import NvmlUnavailableError, UsageError
from tuner.core.machine_spec import Hardware


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    driver_version: str
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class GpuDetails:
    """What the roofline needs beyond memory size; 0 where the driver does not say."""

    index: int
    # bandwidth = 2 (double data rate) x memory clock x bus width / 8
    memory_bus_width_bits: int = 0
    memory_clock_mhz: int = 0
    pcie_generation: int = 0
    pcie_width: int = 0
    power_limit_w: float = 0.0

    @property
    def bandwidth_bytes_s(self) -> float:
        return 2.0 * self.memory_clock_mhz * 1e6 * self.memory_bus_width_bits / 8

    @property
    def pcie_bandwidth_bytes_s(self) -> float:
        return pcie_bandwidth_bytes_s(self.pcie_generation, self.pcie_width)


@dataclass(frozen=True, slots=True)
class GpuProbe:
    gpus: tuple[GpuInfo, ...]
    # Why no GPU was listed, in the user's words; empty when GPUs were found.
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HostInfo:
    ram_total_bytes: int
    ram_available_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    physical_cores: int
    logical_cores: int


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _load_nvml() -> Any:
    import pynvml

    return pynvml


def open_nvml(nvml: Any = None) -> Any:
    """NVML, initialised (``nvml``: a stand-in such as the tests' fake); the caller shuts it down."""
    if nvml is None:
        try:
            nvml = _load_nvml()
        except ImportError:
            raise NvmlUnavailableError("NVML bindings not installed: pip install nvidia-ml-py") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses vary by driver; all mean "no usable driver"
        raise NvmlUnavailableError(f"NVML: {exc}") from None
    return nvml


def close_nvml(nvml: Any) -> None:
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


def probe_gpus(nvml: Any = None) -> GpuProbe:
    """List NVIDIA GPUs with their memory, or say why none could be listed."""
    try:
        nvml = open_nvml(nvml)
    except NvmlUnavailableError as exc:
        return GpuProbe((), f"no NVIDIA GPU found ({exc})")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            uuid = _text(_optional(nvml, "nvmlDeviceGetUUID", handle, ""))
            gpus.append(
                GpuInfo(
                    index=index,
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    total_bytes=int(mem.total),
                    free_bytes=int(mem.free),
                    used_bytes=int(mem.used),
                    driver_version=driver,
                    uuid=uuid,
                )
            )
    finally:
        close_nvml(nvml)
    if not gpus:
        return GpuProbe((), "no NVIDIA GPU found (the driver lists none)")
    return GpuProbe(tuple(gpus))


def probe_gpu_details(nvml: Any = None) -> tuple[GpuDetails, ...]:
    """Bus width, memory clock, PCIe link and power limit of each GPU; empty without a driver."""
    try:
        nvml = open_nvml(nvml)
    except NvmlUnavailableError:
        return ()
    try:
        details = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            # NVML's memory clock is the base clock of the double-data-rate bus; see bandwidth_bytes_s.
            mem_clock = _optional(nvml, "nvmlDeviceGetMaxClockInfo", h, 0, getattr(nvml, "NVML_CLOCK_MEM", 2))
            details.append(GpuDetails(
                index=index,
                memory_bus_width_bits=int(_optional(nvml, "nvmlDeviceGetMemoryBusWidth", h, 0)),
                memory_clock_mhz=int(mem_clock),
                pcie_generation=int(_optional(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h, 0)),
                pcie_width=int(_optional(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h, 0)),
                power_limit_w=float(_optional(nvml, "nvmlDeviceGetPowerManagementLimit", h, 0)) / 1000,
            ))
    finally:
        close_nvml(nvml)
    return tuple(details)


def compute_capability(nvml: Any = None) -> tuple[int, int] | None:
    """The first GPU's CUDA compute capability (8, 6) for an RTX 3090; None without a GPU or driver."""
    try:
        nvml = open_nvml(nvml)
    except NvmlUnavailableError:
        return None
    try:
        if int(nvml.nvmlDeviceGetCount()) < 1:
            return None
        cc = _optional(nvml, "nvmlDeviceGetCudaComputeCapability", nvml.nvmlDeviceGetHandleByIndex(0), None)
    finally:
        close_nvml(nvml)
    return (int(cc[0]), int(cc[1])) if cc else None


def driver_cuda_version(nvml: Any = None) -> tuple[int, int] | None:
    """The newest CUDA release the installed driver runs, (13, 0) for driver 580; None without a driver."""
    try:
        nvml = open_nvml(nvml)
    except NvmlUnavailableError:
        return None
    try:
        version = nvml.nvmlSystemGetCudaDriverVersion()
    except Exception:  # a driver too old to say
        version = None
    finally:
        close_nvml(nvml)
    # NVML encodes it as the driver API does: 1000 * major + 10 * minor (13000 for 13.0, 12080 for 12.8).
    return (int(version) // 1000, int(version) % 1000 // 10) if version else None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int
    gpu_index: int
    graphics: bool = False  # a graphics context (display server, desktop shell, browser): VRAM, not work


def process_name(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).name()
    return "?"


def gpu_processes(nvml: Any = None) -> list[GpuProcess]:
    """Processes holding a GPU context (compute or graphics), any card; raises NvmlUnavailableError without
    NVML. A process with both contexts is listed once, as compute."""
    nvml = open_nvml(nvml)
    found: dict[int, GpuProcess] = {}
    try:
        for index in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            for fn, graphics in (("nvmlDeviceGetGraphicsRunningProcesses", True),
                                 ("nvmlDeviceGetComputeRunningProcesses", False)):
                for p in _optional(nvml, fn, h, []) or []:
                    pid = int(p.pid)
                    found[pid] = GpuProcess(pid, process_name(pid), int(getattr(p, "usedGpuMemory", 0) or 0), index,
                                            graphics)
    finally:
        close_nvml(nvml)
    return list(found.values())


# NVML fills its per-process SM samples every few seconds, so a look asks for this much history: asked for the last
# 0.3-1 s, a process at 95 % SM often had no sample yet and passed as idle.
PROCESS_SAMPLE_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class GpuActivity:
    """One look at what the GPUs are doing: every context with its VRAM, the device utilization, each card's memory
    and, where the driver keeps them, per-process SM samples over the last :data:`PROCESS_SAMPLE_WINDOW_S`."""

    processes: tuple[GpuProcess, ...]
    device_util_pct: tuple[int | None, ...]  # per card; None where the driver does not say
    process_sm_pct: dict[int, int]  # pid → highest SM share sampled in the window; empty where unsupported
    # The driver returned per-process samples in the window, so a pid without one ran no kernel. No samples at all
    # ("not found", "not supported") says nothing: device utilization is the fallback.
    per_process_known: bool
    device_total_bytes: tuple[int | None, ...] = ()
    device_free_bytes: tuple[int | None, ...] = ()
    samples_known: tuple[bool, ...] = ()  # per card: ``per_process_known`` for that card alone


def gpu_activity(nvml: Any = None, since_s: float = 1.0) -> GpuActivity:
    """GPU contexts, utilization, memory and per-process samples (``nvmlDeviceGetProcessUtilization``) since
    ``since_s`` ago, or :data:`PROCESS_SAMPLE_WINDOW_S` where that is longer. Raises NvmlUnavailableError without
    a driver; another NVML error (a card that stops answering) propagates."""
    procs = tuple(gpu_processes(nvml))
    nvml = open_nvml(nvml)
    utils: list[int | None] = []
    totals: list[int | None] = []
    frees: list[int | None] = []
    sm: dict[int, int] = {}
    known: list[bool] = []
    try:
        since_us = int((time.time() - max(since_s, PROCESS_SAMPLE_WINDOW_S)) * 1e6)
        for index in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            rates = _optional(nvml, "nvmlDeviceGetUtilizationRates", h, None)
            utils.append(None if rates is None else int(rates.gpu))
            mem = _optional(nvml, "nvmlDeviceGetMemoryInfo", h, None)
            totals.append(None if mem is None else int(mem.total))
            frees.append(None if mem is None else int(mem.free))
            try:
                samples = nvml.nvmlDeviceGetProcessUtilization(h, since_us) or []
            except Exception:  # NVMLError_NotFound: no sample in the window; NotSupported: none kept
                samples = []
            known.append(bool(samples))
            for s in samples:
                sm[int(s.pid)] = max(sm.get(int(s.pid), 0), int(s.smUtil))
    finally:
        close_nvml(nvml)
    return GpuActivity(procs, tuple(utils), sm, any(known), tuple(totals), tuple(frees), tuple(known))


def _optional(nvml: Any, fn: str, handle: Any, default: Any, *args: Any) -> Any:
    """One NVML query that older drivers or laptop parts may not answer: ``default`` then."""
    try:
        return getattr(nvml, fn)(handle, *args)
    except Exception:
        return default


def pcie_bandwidth_bytes_s(generation: int, width: int) -> float:
    """Usable one-way PCIe bandwidth: per-lane GT/s after line encoding, times lanes."""
    per_lane = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}.get(generation, 0.0)
    return per_lane * width


def measure_host_bandwidth(seconds: float = 1.0, block_bytes: int = 256 * 2**20, threads: int | None = None) -> float:
    """Host RAM read+write bandwidth in bytes/s: copies of a buffer larger than any CPU cache, split over one thread
    per core (``threads``; default: the physical cores) copying at once, as llama.cpp's threads read host experts.

    One thread reaches a fraction of a server's RAM bandwidth: lease 2's H100 host measured 19-23 GB/s that way
    while llama.cpp's 16 threads read its host experts at 26-33 GB/s, so every line with experts on the host read
    107-145 % of its generation ceiling (results/benchmarks/gpu-lease-2). numpy releases the GIL while it copies."""
    import numpy as np

    n = max(1, threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    part = max(1, block_bytes // n // 8)
    src = [np.ones(part, dtype=np.float64) for _ in range(n)]
    dst = [np.empty_like(a) for a in src]
    moved = 2 * 8 * part * n  # one read plus one write per byte copied

    def copy(i: int) -> None:
        np.copyto(dst[i], src[i])

    best = 0.0
    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(copy, range(n)))  # touch pages first
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            list(pool.map(copy, range(n)))
            best = max(best, moved / (time.perf_counter() - t0))
    return best


def probe_host() -> HostInfo:
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    return HostInfo(
        ram_total_bytes=int(vm.total),
        ram_available_bytes=int(vm.available),
        swap_total_bytes=int(sw.total),
        swap_used_bytes=int(sw.used),
        physical_cores=int(physical),
        logical_cores=int(logical),
    )


CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path | None = None) -> frozenset[str]:
    """The instruction-set flags the kernel grants this process (``/proc/cpuinfo``'s first ``flags`` line on x86,
    ``Features`` on ARM: the kernel's HWCAP names). Not CPUID's list: the kernel drops a feature whose register state
    it does not enable (XCR0), and a VM's CPUID may list AMX that faults when used (seen on a Xeon VM of this
    project: SIGILL in ``tilezero``). Empty where the file is missing or names no flags (not Linux)."""
    with contextlib.suppress(OSError):
        for line in (cpuinfo or CPUINFO).read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    return frozenset()


NVCC_DIRS = (Path("/usr/local/cuda/bin"), Path("/opt/cuda/bin"))  # where installers put the toolkit, off PATH
NVCC_ENV_ROOTS = ("CUDA_HOME", "CUDA_PATH")


def nvcc_candidates() -> list[tuple[Path, str]]:
    """Every place nvcc may be, in the order they are tried, with where each came from."""
    out: list[tuple[Path, str]] = []
    on_path = shutil.which("nvcc")
    if on_path:
        out.append((Path(on_path), "PATH"))
    for var in NVCC_ENV_ROOTS:
        root = os.environ.get(var)
        if root:
            out.append((Path(root).expanduser() / "bin" / "nvcc", var))
    return out + [(d / "nvcc", str(d)) for d in NVCC_DIRS]


def find_nvcc() -> Path | None:
    """The first executable nvcc of :func:`nvcc_candidates`."""
    return next((p for p, _ in nvcc_candidates() if p.is_file() and os.access(p, os.X_OK)), None)


def nvcc_looked_in() -> str:
    return "PATH, " + ", ".join(f"${v}/bin" for v in NVCC_ENV_ROOTS) + ", " + ", ".join(str(d) for d in NVCC_DIRS)


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def probe_hardware(nvml: Any = None, host_bandwidth_s: float = 1.0) -> Hardware:
    """The machine as it is: the first NVIDIA GPU (or CPU only), RAM, and a measured host bandwidth."""
    probe = probe_gpus(nvml)
    host = probe_host()
    bw = measure_host_bandwidth(host_bandwidth_s) if host_bandwidth_s > 0 else 0.0
    gpu = probe.gpus[0] if probe.gpus else None
    details = probe_gpu_details(nvml) if gpu else ()
    detail = details[0] if details else GpuDetails(0)
    return Hardware(
        gpu_name=gpu.name if gpu else "", vram_total_bytes=gpu.total_bytes if gpu else 0,
        vram_free_bytes=gpu.free_bytes if gpu else 0,
        gpu_bandwidth_bytes_s=detail.bandwidth_bytes_s, pcie_bandwidth_bytes_s=detail.pcie_bandwidth_bytes_s,
        ram_total_bytes=host.ram_total_bytes, ram_available_bytes=host.ram_available_bytes,
        swap_total_bytes=host.swap_total_bytes, host_bandwidth_bytes_s=bw,
        physical_cores=host.physical_cores, source="probed" if gpu else "none",
    )


def with_vram_budget(hw: Hardware, budget_mib: float | None) -> Hardware:
    """``hw`` planning for ``budget_mib`` MiB of VRAM instead of what is free (None: unchanged).

    A budget above the free VRAM is allowed (the user may be about to close what holds it); one above the
    card's total cannot be met. On a big card a budget below the free VRAM emulates a smaller card.
    """
    if budget_mib is None:
        return hw
    if not hw.has_gpu:
        raise UsageError("--vram-budget needs an NVIDIA GPU and none was found: drop --vram-budget "
                         "(plan can name a card with --gpu)")
    budget = int(budget_mib * 2**20)
    if budget <= 0:
        raise UsageError(f"--vram-budget must be a positive number of MiB, got {budget_mib:g}")
    if budget > hw.vram_total_bytes:
        raise UsageError(f"--vram-budget {budget_mib:g} MiB is more than the card's "
                         f"{hw.vram_total_bytes / 2**20:,.0f} MiB: lower it")
    return replace(hw, vram_budget_override_bytes=budget)


def vram_held_back_bytes(hw: Hardware) -> int:
    """Free VRAM the budget leaves unused (a big card emulating a small one); 0 when the budget is all free."""
    return max(0, hw.vram_free_bytes - hw.vram_budget_bytes) if hw.has_gpu else 0


def with_ram_budget(hw: Hardware, ram_gib: float | None) -> Hardware:
    """``hw`` planning for ``ram_gib`` GiB of host RAM instead of what is available (None: unchanged): room kept
    for other programs, or a smaller machine simulated. It cannot exceed the RAM that is there."""
    if ram_gib is None:
        return hw
    ram = int(ram_gib * 2**30)
    if ram <= 0:
        raise UsageError(f"--ram must be more than 0 GiB, got {ram_gib:g}: e.g. --ram 32")
    if ram > hw.ram_total_bytes:
        raise UsageError(f"--ram {ram_gib:g} GiB is more than this machine's {hw.ram_total_bytes / 2**30:.1f} GiB: "
                         "name at most what is installed (plan --ram can plan for another machine)")
    # Never more than is free now: the gate must not launch what the machine cannot hold today.
    return replace(hw, ram_available_bytes=min(ram, hw.ram_available_bytes))



def ram_holders(limit: int = 3, exclude: frozenset[int] = frozenset()) -> tuple[tuple[str, int], ...]:
    """The processes holding the most RAM on this machine (name, resident bytes, summed per name), this one and
    ``exclude`` left out: what holds the rest of RAM, as the VRAM side names its residents."""
    own = {os.getpid(), *exclude}
    held: dict[str, int] = {}
    for p in psutil.process_iter(["pid", "name", "memory_info"]):
        info = p.info
        if info["pid"] in own or info.get("memory_info") is None:
            continue
        name = info.get("name") or f"pid {info['pid']}"
        held[name] = held.get(name, 0) + int(info["memory_info"].rss)
    return tuple(sorted(held.items(), key=lambda kv: -kv[1])[:limit])
