"""How many ``llama-fit-params`` projections run at once when a plan or a tune prefetches them
(:meth:`tuner.measure.engine_memory.EngineMemory.prefetched`), so that they never crowd the user's card.

A projection allocates no weights or buffers (``llama_params_fit`` sets ``no_alloc``), so on a CPU build it is a
core's work for a fraction of a second and the prefetch runs all cores at a time. On a CUDA build it still asks every
device for its free memory (common/fit.cpp → ``ggml_backend_dev_memory`` → ``ggml_backend_cuda_device_get_memory``:
``cudaSetDevice`` then ``cudaMemGetInfo``), which creates the CUDA primary context on the card and holds it until the
process exits. Published costs of that context: 107 MiB on an RTX 4060 Ti, 555 MiB on an RTX PRO 6000 Blackwell
(llama.cpp PR 23604, measured with ``cudaMemGetInfo``; PR 20595 says 120-550 MB, growing with the card's SM count).
Sixteen at once on a 16-thread desktop could take most of a 12 GB card beside its display and browser.

So on a card the first projection runs alone while NVML reads the VRAM its process holds (per process, as a trial's
sampler reads a server's: :class:`tuner.machine.sampler.Sampler`), and the rest run as many at a time as that cost fits
in the VRAM free now less the margin the run keeps (``--vram-margin``, else llama.cpp's 1 GiB), never more than the
cores. Where NVML attributes no VRAM to the process (a PID namespace it cannot see into, a driver that does not
say), the planned cost stands: :data:`PLANNED_CONTEXT_BYTES`, the largest published one rounded up. That default is
an estimate until a GPU lease measures it (``scripts/gpu_check``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tuner.core.machine_spec import Hardware
from tuner.core.units import MIB
from tuner.machine import hardware
from tuner.machine.sampler import Sampler

T = TypeVar("T")

# A CUDA primary context as published (555 MiB, RTX PRO 6000 Blackwell: llama.cpp PR 23604), rounded up to 64 MiB.
PLANNED_CONTEXT_BYTES = 576 * MIB
PLANNED_SOURCE = "planned: the largest published CUDA context, 555 MiB (llama.cpp PR 23604), rounded up"
# How often the lone first projection's VRAM is read: it lives a few tenths of a second.
SAMPLE_INTERVAL_S = 0.02


@dataclass(frozen=True, slots=True)
class ProjectionLoad:
    """How a prefetch ran its projections: ``jobs`` at a time; on a card, each process's VRAM and where that figure
    came from, and the room they shared."""

    jobs: int
    on_card: bool = False
    per_process_bytes: int | None = None
    source: str = ""  # "read (NVML: ...)" or the planned figure's source
    room_bytes: int | None = None  # VRAM free when they started, less the margin

    def describe(self) -> str:
        if not self.on_card:
            return f"projections run {self.jobs} at a time ({self.source or 'on the CPU'})"
        each = f"{(self.per_process_bytes or 0) / MIB:,.0f} MiB of VRAM each ({self.source})"
        room = ("" if self.room_bytes is None else
                f" within {self.room_bytes / MIB:,.0f} MiB (free VRAM less the margin)")
        return f"projections run {self.jobs} at a time on the card: {each}{room}"

    def to_dict(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "on_card": self.on_card, "per_process_bytes": self.per_process_bytes,
                "source": self.source, "room_bytes": self.room_bytes}


def jobs_on_card(room_bytes: int, per_process_bytes: int, cores: int) -> int:
    """As many projections as their contexts fit in ``room_bytes``, at most one per core, and at least one (a plan
    needs its figures; one context beside the margin is what the later server's own start costs too)."""
    return max(1, min(cores, room_bytes // max(1, per_process_bytes)))


def card_room_bytes(hw: Hardware, margin_bytes: int) -> int | None:
    """VRAM free on the card the engine projects on, read now (NVML), less ``margin_bytes``; the run's budget caps
    it where ``hw`` is this machine's card. None: NVML lists no card here (a CUDA build then projects on the CPU)."""
    gpus = hardware.probe_gpus().gpus
    if not gpus:
        return None
    free = gpus[0].free_bytes
    if hw.source == "probed":  # this card, planned within its budget (a named card is another machine's)
        free = min(free, hw.vram_budget_bytes)
    return max(0, free - margin_bytes)


def watched(run: Callable[[], T]) -> tuple[T, int | None]:
    """``run()`` with NVML reading the VRAM this process's children hold on the card (the peak), or None where it
    attributes none to them."""
    with Sampler(interval_s=SAMPLE_INTERVAL_S) as sampler:
        sampler.attach(os.getpid())
        got = run()
        sampler.sample_now()
    return got, sampler.report().proc_vram_peak_bytes


def plan_load(backend: str, on_card: bool, hw: Hardware | None, margin_bytes: int, cores: int,
              first: Callable[[], int | None] | None = None) -> ProjectionLoad:
    """How many projections to run at once. ``first`` runs one projection alone and returns the VRAM its process
    held (None: not attributed); it is called only where the projections land on an NVIDIA card."""
    if not on_card or hw is None:
        return ProjectionLoad(cores, source="a CPU build: a core each" if backend == "cpu" else "nothing on a card")
    if backend != "cuda":  # Vulkan, ROCm, Metal: no NVML reading of that card's memory
        return ProjectionLoad(1, True, None, f"a {backend} build: no NVML reading of its card, one at a time")
    room = card_room_bytes(hw, margin_bytes)
    if room is None:
        return ProjectionLoad(cores, source="no NVIDIA card listed here: the CUDA build projects on the CPU")
    seen = first() if first is not None else None
    per, source = (seen, "read: the first projection's own, NVML per process") if seen else (
        PLANNED_CONTEXT_BYTES, PLANNED_SOURCE)
    return ProjectionLoad(jobs_on_card(room, per, cores), True, per, source, room)
