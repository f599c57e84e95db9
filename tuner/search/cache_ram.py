"""The --cache-ram each config carries: llama-server's host prompt cache (``server_prompt_cache``, 8192 MiB by default
in ``common_params::cache_ram_mib``) fills with distinct conversations beside the model, so where the default would
not fit beside a config's host need with the margin kept free (:mod:`tuner.plan.ram`), the config carries the cap that
does. The host need is the one the search gate judges by: the engine's own projection where a command put it in force
(:func:`tuner.measure.engine_memory.price`), the replay its first guess; a cap priced on the replay alone could let a
newer build's larger need refuse the line it was meant to fit.

Priced per config, never once for a whole space: each layer's experts moved to the host take RAM from the cache, so a
config with more host experts carries a smaller cap than one with fewer. The search space prices each placement it
tries (the ``--n-cpu-moe`` or ``-ngl`` value) at its most host-hungry settings; llama.cpp's own arms (the bare launch
and ``--fit``'s placement) are priced at the placement ``--fit`` chooses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.engine import flags
from tuner.measure.engine_memory import price
from tuner.plan.memory import DEFAULT_CACHE_RAM_MIB
from tuner.plan.ram import TIGHT_MARGIN_BYTES, ram_side

Caps = tuple[tuple[int | None, int], ...]


def cap(info: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> int | None:
    """The --cache-ram ``cfg`` needs where llama-server's default prompt cache would not fit beside its host need
    with the margin kept free (0, the cache off, where its need alone exceeds the RAM: a lighter config priced by it
    may still fit, with no room for a cache); None where the default fits or the config sets its own."""
    side = ram_side(price(info, cfg, hw), cfg, hw)
    return 0 if side.exceeds and cfg.cache_ram_mib is None else side.cache_ram_fit_mib


def with_cap(info: ModelInfo, cfg: LaunchConfig, hw: Hardware, at: LaunchConfig | None = None) -> LaunchConfig:
    """``cfg`` carrying the --cache-ram it needs, priced at the placement of ``at`` when given: a bare launch leaves
    the placement to llama.cpp's --fit, whose choice ``at`` is."""
    if cfg.cache_ram_mib is not None:
        return cfg
    priced = cfg if at is None else replace(cfg, n_cpu_moe=at.n_cpu_moe, n_gpu_layers=at.n_gpu_layers)
    return replace(cfg, cache_ram_mib=cap(info, priced, hw))


def caps(info: ModelInfo, hw: Hardware, cfg: LaunchConfig, axis: str | None, places: Iterable[int | None]
         ) -> tuple[Caps, tuple[str, ...]]:
    """The cap of each placement (``axis``: the LaunchConfig field it sets, None: no axis) that needs one, priced at
    ``cfg``, and the note that says so (empty where the default cache fits everywhere)."""
    found = []
    for n in places:
        got = cap(info, flags.with_overrides(cfg, **{axis: n}) if axis else cfg, hw)
        if got is not None:
            found.append((n, got))
    if not found:
        return (), ()
    each = ", ".join(f"{mib} at {flags.spelled(axis, n)}" if axis else str(mib) for n, mib in found)
    return tuple(found), (
        f"--cache-ram {each}: llama-server's default prompt cache ({DEFAULT_CACHE_RAM_MIB} MiB) does not fit beside "
        f"those configs' host need in {hw.ram_available_bytes / 2**30:.1f} GiB of RAM "
        f"({TIGHT_MARGIN_BYTES / 2**30:.0f} GiB kept free)",)


def placement_caps(info: ModelInfo, hw: Hardware, cfg: LaunchConfig, moe: tuple[int, int] | None,
                   ngl: tuple[int, int] | None) -> tuple[Caps, tuple[str, ...]]:
    """The --cache-ram of each placement a search space tries (its ``--n-cpu-moe`` or ``-ngl`` range), priced at
    ``cfg``."""
    if moe:
        return caps(info, hw, cfg, "n_cpu_moe", range(moe[0], moe[1] + 1))
    if ngl:
        return caps(info, hw, cfg, "n_gpu_layers", range(ngl[0], ngl[1] + 1))
    return caps(info, hw, cfg, None, [None])
