"""A fake NVML whose readings change over time, for the sampler (hardware boundary only; named as a fake).

Each ``nvmlDeviceGetMemoryInfo`` call moves the fake one step along its timeline (and stays on the last
step), so a sampler that reads memory first in every sample sees the timeline in order, whatever the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fakes import FakeNVML


@dataclass
class FakeStep:
    used_bytes: int
    power_mw: int = 0
    proc_used_bytes: int | None = None


@dataclass
class _FakeProcess:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - mirrors pynvml


class FakeLiveNVML(FakeNVML):
    """One card of ``total_bytes`` whose used VRAM and power follow ``timeline``."""

    def __init__(self, timeline: list[FakeStep], total_bytes: int, *, pid: int | None = None,
                 energy_mj_per_step: int | None = None, name: str = "NVIDIA GeForce RTX 4060 Ti (fake)") -> None:
        super().__init__([(name, total_bytes, timeline[0].used_bytes)])
        self.timeline = timeline
        self.step = -1
        self.pid = pid
        self.energy_mj_per_step = energy_mj_per_step
        self.energy_mj = 0

    @property
    def current(self) -> FakeStep:
        return self.timeline[max(0, min(self.step, len(self.timeline) - 1))]

    def nvmlDeviceGetMemoryInfo(self, handle: int):  # noqa: N802
        self.step += 1
        if self.energy_mj_per_step is not None and self.step > 0:
            self.energy_mj += self.energy_mj_per_step
        name, total, _ = self.cards[handle]
        self.cards[handle] = (name, total, self.current.used_bytes)
        return super().nvmlDeviceGetMemoryInfo(handle)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:  # noqa: N802
        return self.current.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:  # noqa: N802
        if self.energy_mj_per_step is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # cards before Volta have no energy counter
        return self.energy_mj

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[_FakeProcess]:  # noqa: N802
        if self.pid is None:
            return []
        return [_FakeProcess(self.pid, self.current.proc_used_bytes)]
