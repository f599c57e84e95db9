"""The host-RAM side of a plan: what a config leaves of RAM, when that is too little to be safe, what llama-server's
prompt cache can still take, and who holds the rest of the machine's memory.

A MoE with most experts in RAM leaves a few GiB of a 32 GB desktop for everything else; below that the kernel
pages the mapped experts back in from disk on every token, silently (issue 41). The memory model's host need
(:attr:`MemoryEstimate.host_need_bytes`) is what must stay resident; two things come on top of it:

- llama-server's host prompt cache (``server_prompt_cache``: idle prompts' states, evicted oldest first above
  ``--cache-ram`` MiB, 8192 by default in ``common_params::cache_ram_mib``). It fills with distinct conversations,
  so a plan counts it at the size it can reach; where that would not fit, the line sets ``--cache-ram`` to what
  does.
- a margin for what the rest of the desktop grows by while the model runs (a browser tab, an IDE's indexer):
  a config that leaves less than :data:`TIGHT_MARGIN_BYTES` is "tight".

The load mode decides what "tight" costs. Under mmap (llama.cpp's default) host experts are the file's mapped
pages: short of RAM, the kernel drops them and reads them back on every token (slow, not fatal). Under
``--load-mode none`` on a CUDA build they are one pinned copy (CUDA_Host, ``cudaHostAlloc``): page-locked, it can be
neither dropped nor swapped, so short of RAM the load fails or the kernel kills a process (a 128 GB box running
out while pinning its experts was OOM-killed mid-load, noonghunna/club-3090 issue 978). A pinned copy is planned
only where it leaves the margin (:func:`lock_fits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.plan.memory import DEFAULT_CACHE_RAM_MIB, MemoryEstimate

MIB = 2**20
GIB = 2**30
TIGHT_MARGIN_BYTES = 2 * GIB  # what is left beside the model, below which a row is "tight"
CACHE_RAM_STEP_MIB = 256  # a fitted --cache-ram is rounded down to this


@dataclass(frozen=True, slots=True)
class RamSide:
    available_bytes: int  # RAM the plan is for (MemAvailable here, or --ram)
    need_bytes: int  # resident host need of the config (the memory model)
    cache_reach_bytes: int | None  # what the prompt cache can still add (None: --cache-ram -1, no limit)
    cache_ram_fit_mib: int | None  # the --cache-ram that fits, where the default would not (None: no change)
    locked_bytes: int = 0  # part of ``need_bytes`` pinned (CUDA_Host): it cannot be paged out

    @property
    def headroom_bytes(self) -> int:
        """RAM left beside the config with its prompt cache at the size it can reach (the fitted one if set)."""
        cache = (self.cache_ram_fit_mib * MIB if self.cache_ram_fit_mib is not None
                 else self.cache_reach_bytes or 0)
        return self.available_bytes - self.need_bytes - cache

    @property
    def exceeds(self) -> bool:
        return self.need_bytes > self.available_bytes

    @property
    def tight(self) -> bool:
        return not self.exceeds and self.headroom_bytes < TIGHT_MARGIN_BYTES

    def describe(self) -> str:
        left = self.headroom_bytes / GIB
        if self.exceeds:
            return f"exceeds RAM by {-(self.available_bytes - self.need_bytes) / GIB:.1f} GiB"
        text = f"{left:.1f} GiB of RAM left"
        if self.cache_ram_fit_mib is not None:
            text += (f" with --cache-ram {self.cache_ram_fit_mib} (the default {DEFAULT_CACHE_RAM_MIB} MiB prompt "
                     "cache would not fit)")
        if self.locked_bytes:
            text += f" ({self.locked_bytes / GIB:.1f} GiB of the need pinned: it cannot be paged out)"
        if self.tight:
            text += f": tight (under the {TIGHT_MARGIN_BYTES / GIB:.0f} GiB margin)"
        return text


def prompt_cache_reach_bytes(cfg: LaunchConfig) -> int | None:
    """What llama-server's prompt cache can add beyond the memory model's need: the default limit when none is
    set; nothing when one is set (the memory model counts a set limit, ``prompt_cache_bytes``) or the cache is
    off; None for ``--cache-ram -1`` (no limit: it cannot be counted)."""
    if cfg.cache_ram_mib is None:
        return DEFAULT_CACHE_RAM_MIB * MIB
    return None if cfg.cache_ram_mib < 0 else 0


def ram_side(est: MemoryEstimate, cfg: LaunchConfig, hw: Hardware) -> RamSide:
    """The RAM side of ``cfg`` as estimated: headroom, and the ``--cache-ram`` that fits where the default
    prompt cache would push the machine under the margin (0 turns the cache off when nothing is left)."""
    avail, need = hw.ram_available_bytes, est.host_need_bytes
    reach = prompt_cache_reach_bytes(cfg)
    fit: int | None = None
    if cfg.cache_ram_mib is None and reach is not None and avail - need - reach < TIGHT_MARGIN_BYTES:
        room_mib = max(0, (avail - need - TIGHT_MARGIN_BYTES) // MIB)
        fit = int(room_mib // CACHE_RAM_STEP_MIB * CACHE_RAM_STEP_MIB)
    return RamSide(avail, need, reach, fit, est.pinned_bytes)


def lock_fits(est: MemoryEstimate, cfg: LaunchConfig, hw: Hardware) -> bool:
    """Can ``cfg``'s pinned host copy be held: with the prompt cache at the size it can reach (or the --cache-ram
    that fits), at least :data:`TIGHT_MARGIN_BYTES` of RAM stays free beside it. A pinned copy never pages, so where
    this fails it does not slow down like a mapped one: it fails to load or pushes other processes out."""
    side = ram_side(est, cfg, hw)
    return not side.exceeds and not side.tight


def holders_line(holders: tuple[tuple[str, int], ...], hw: Hardware) -> str | None:
    """One line naming what holds the RAM the plan does not have; None when nothing sizeable does."""
    shown = [f"{name} {rss / GIB:.1f} GiB" for name, rss in holders if rss >= 256 * MIB]
    if not shown:
        return None
    used = (hw.ram_total_bytes - hw.ram_available_bytes) / GIB
    return (f"RAM in use by others: {used:.1f} GiB of {hw.ram_total_bytes / GIB:.1f} GiB, the most by "
            + ", ".join(shown))

