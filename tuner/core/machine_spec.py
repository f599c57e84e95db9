"""What the memory model and roofline plan for, as a plain value: one GPU (or none) and the host.

Pure: :mod:`tuner.machine.hardware` fills it by probing; the card catalog fills it from a spec sheet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the memory model and roofline plan for: one GPU (or none) and the host.

    ``source`` says where the GPU figures came from: "probed" (NVML), "catalog" (a card's spec sheet,
    for planning a card that is not present) or "none" (CPU only).
    """

    gpu_name: str
    vram_total_bytes: int
    vram_free_bytes: int
    gpu_bandwidth_bytes_s: float
    pcie_bandwidth_bytes_s: float
    ram_total_bytes: int
    ram_available_bytes: int
    swap_total_bytes: int
    host_bandwidth_bytes_s: float
    physical_cores: int
    source: str = "probed"
    # VRAM the run may use when ``--vram-budget`` names it; None: the VRAM free at start (vram_budget_bytes).
    vram_budget_override_bytes: int | None = None
    # Where host_bandwidth_bytes_s came from: "measured" here, "--host-bandwidth", or an assumed desktop.
    host_bandwidth_source: str = "measured"

    @property
    def has_gpu(self) -> bool:
        return self.vram_total_bytes > 0

    def cpu_only(self) -> Hardware:
        """This machine with its GPU left out: what ``--device none`` (or a CPU build) runs on."""
        return replace(self, gpu_name="", vram_total_bytes=0, vram_free_bytes=0, gpu_bandwidth_bytes_s=0.0,
                       pcie_bandwidth_bytes_s=0.0, source="none", vram_budget_override_bytes=None)

    @property
    def vram_budget_bytes(self) -> int:
        """What a config may occupy on the card, never its total (desktops, browsers, other models hold some):
        ``--vram-budget`` when given, else the VRAM free at start (a catalog card is empty); 0 without a GPU."""
        if not self.has_gpu:
            return 0
        if self.vram_budget_override_bytes is not None:
            return self.vram_budget_override_bytes
        return min(self.vram_free_bytes, self.vram_total_bytes)  # free can never exceed the card

    @property
    def vram_budget_source(self) -> str:
        if not self.has_gpu:
            return "no GPU"
        if self.vram_budget_override_bytes is not None:
            return "--vram-budget"
        return "free at start (NVML)" if self.source == "probed" else "the whole card (catalog)"

    def describe(self) -> str:
        host = f"{self.ram_total_bytes / 2**30:.0f} GiB RAM, {self.physical_cores} cores"
        if not self.has_gpu:
            return f"CPU only ({host})"
        return (f"{self.gpu_name}, {self.vram_total_bytes / 2**30:.1f} GiB VRAM ({self.source}), budget "
                f"{self.vram_budget_bytes / 2**20:,.0f} MiB ({self.vram_budget_source}); {host}")
