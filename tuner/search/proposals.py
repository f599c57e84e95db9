"""Seeds proposed from outside the search (`auto-tune --seed-from`: lines others measured and shared): each is
a hypothesis, put into this run's search space and measured here like any seed, never taken as the answer.

A proposal keeps only what the space searches (offloaded experts, KV pair, flash attention, threads, ubatch):
every other setting of the shared line is this run's own (model, context, slots, device). One from another
engine commit or a card with less VRAM than it was measured on is said so; every proposal is re-checked by the
memory model on this machine, and one that would not fit is left out with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tuner.core.config import LaunchConfig
from tuner.core.units import MIB
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import ModelInfo
from tuner.search import space

SEED_ORIGINS_ATTR = "seed_origins"  # study attr: seed label → where the seed came from, in words


@dataclass(frozen=True, slots=True)
class Proposal:
    label: str  # the trial's seed label, e.g. "shared-3f2a9c1e"
    config: LaunchConfig  # as the shared line reads (its model is whatever the line named)
    origin: str  # where it came from, in words
    engine_commit: str | None = None  # of the engine that measured it
    vram_budget_bytes: int | None = None  # VRAM it was measured with (None: a CPU run)


@dataclass(frozen=True, slots=True)
class Adapted:
    seeds: tuple[tuple[str, LaunchConfig], ...]  # to enqueue, in order
    origins: dict[str, str]  # seed label → origin, for the report
    notes: tuple[str, ...]  # what was adapted or left out, and why


def adapt(proposals: Sequence[Proposal], sp: space.SearchSpace, info: ModelInfo, hw: Hardware, *,
          engine_commit: str | None, known: Sequence[tuple[str, LaunchConfig]] = (),
          vram_margin_mib: float | None = None) -> Adapted:
    """``proposals`` as seeds of ``sp``: re-checked by the memory model here, none the same as a ``known`` seed."""
    seeds: list[tuple[str, LaunchConfig]] = []
    origins: dict[str, str] = {}
    notes: list[str] = []
    taken = list(known)
    for p in proposals:
        cfg = space.make_config(sp, space.params_of(sp, p.config))
        why: list[str] = []
        if p.engine_commit and engine_commit and p.engine_commit != engine_commit:
            why.append(f"measured on engine {p.engine_commit}, this one is {engine_commit}")
        budget = hw.vram_budget_bytes if hw.has_gpu else None
        if p.vram_budget_bytes and budget is not None and budget < p.vram_budget_bytes:
            why.append(f"measured with {p.vram_budget_bytes / MIB:,.0f} MiB of VRAM, this card has "
                       f"{budget / MIB:,.0f} MiB free")
        fit = space.check(info, cfg, hw, vram_margin_mib)
        if not fit.feasible:
            over = max(fit.vram_over_mib, fit.ram_over_mib)
            notes.append(f"seed {p.label} ({p.origin}) left out: the memory model says it does not fit here "
                         f"({over:,.0f} MiB over){'; ' + '; '.join(why) if why else ''}")
            continue
        same = next((label for label, c in taken if c == cfg), None)
        if same is not None:
            notes.append(f"seed {p.label} ({p.origin}) is the same config here as seed {same}: measured once, "
                         f"as {same}")
            continue
        if why:
            notes.append(f"seed {p.label}: {'; '.join(why)}; the memory model re-checked it: it fits")
        seeds.append((p.label, cfg))
        taken.append((p.label, cfg))
        origins[p.label] = p.origin
    return Adapted(tuple(seeds), origins, tuple(notes))
