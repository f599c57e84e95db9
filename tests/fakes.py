"""Fakes at the hardware boundary only: NVML for machines without an NVIDIA GPU."""

from __future__ import annotations

from dataclasses import dataclass


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
                 init_error: str | None = None) -> None:
        self.cards = cards or []
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
