"""Fakes at the hardware boundary only: NVML for machines without an NVIDIA GPU."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace


@dataclass
class _Memory:
    total: int
    free: int
    used: int


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Stands in for the ``pynvml`` module: a driver with the given cards, or none at all."""

    def __init__(self, cards: list[tuple[str, int, int]] | None = None, driver: str = "570.86.10",
                 init_error: str | None = None, extras: dict[str, float | None] | None = None,
                 processes: list[tuple[int, int]] | None = None) -> None:
        self.cards = cards or []
        self.processes = processes or []  # (pid, used bytes) holding a context on every card
        self.extras = extras or {}
        self.driver = driver
        self.init_error = init_error
        self.initialized = False

    def nvmlInit(self) -> None:  # noqa: N802 - mirrors pynvml
        if self.init_error:
            raise FakeNVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return self.driver

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return self.cards[handle][0].encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Memory:  # noqa: N802
        _, total, used = self.cards[handle]
        return _Memory(total=total, free=total - used, used=used)

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return f"GPU-fake-{handle}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes]

    # Spec-like figures of an RTX 3090 (384-bit GDDR6X, NVML reports 9751 MHz memory clock), unless
    # ``extras`` says otherwise; a key mapped to None raises, as a driver that lacks the query does.
    NVML_CLOCK_MEM = 2

    def _extra(self, key: str, default: float) -> float:
        value = self.extras.get(key, default)
        if value is None:
            raise FakeNVMLError(f"{key} not supported")
        return value

    def nvmlDeviceGetMemoryBusWidth(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("bus_width", 384))

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock: int) -> int:  # noqa: N802
        assert clock == self.NVML_CLOCK_MEM
        return int(self._extra("mem_clock", 9751))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("pcie_gen", 4))

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("pcie_width", 16))

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:  # noqa: N802
        return int(self._extra("power_mw", 350_000))
