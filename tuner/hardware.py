"""The only module that probes the machine: NVIDIA GPUs through NVML, host memory and cores through psutil.

NVML is passed in as a module-like object so tests can hand in a fake at this boundary; by default the real
bindings (the ``nvidia-ml-py`` distribution, imported as ``pynvml``) are used. A machine without an NVIDIA
driver is a normal case ("CPU only"), never a crash.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


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


def probe_gpus(nvml: Any = None) -> GpuProbe:
    """List NVIDIA GPUs with their memory, or say why none could be listed."""
    if nvml is None:
        try:
            nvml = _load_nvml()
        except ImportError:
            return GpuProbe((), "no NVIDIA GPU found (NVML bindings not installed: pip install nvidia-ml-py)")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses vary by driver; all mean "no usable driver"
        return GpuProbe((), f"no NVIDIA GPU found (NVML: {exc})")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            except Exception:
                uuid = ""
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
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    if not gpus:
        return GpuProbe((), "no NVIDIA GPU found (the driver lists none)")
    return GpuProbe(tuple(gpus))


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


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free
