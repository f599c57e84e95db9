"""Spec sheets of consumer NVIDIA cards (quant_catalog/cards.json), for planning a card that is not present.

``find_card("RTX 4060 Ti 16GB")`` matches loosely: vendor words, spacing and case do not matter; the model
number and the Ti/Super variant must match; a memory size picks between variants of one model.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import quant_catalog
from tuner.core.errors import UnknownCardError, UsageError
from tuner.machine import hardware
from tuner.machine.hardware import Hardware, pcie_bandwidth_bytes_s

CATALOG = quant_catalog.FOLDER / "cards.json"
_NOISE = re.compile(r"\b(nvidia|geforce|rtx|gtx|graphics|card)\b")
_VRAM = re.compile(r"(\d+)\s*(?:gb|gib|g)\b")
_MODEL = re.compile(r"\b(\d{4})\b")


@dataclass(frozen=True, slots=True)
class Card:
    name: str
    aliases: tuple[str, ...]
    vram_bytes: int
    bandwidth_bytes_s: float
    bus_width_bits: int
    pcie_generation: int
    pcie_width: int
    source: str

    def hardware(self, ram_total_bytes: int, ram_available_bytes: int, host_bandwidth_bytes_s: float,
                 physical_cores: int = 8, swap_total_bytes: int = 0) -> Hardware:
        """This card in a machine with the given host: the card is assumed empty (all VRAM free)."""
        return Hardware(
            gpu_name=self.name, vram_total_bytes=self.vram_bytes, vram_free_bytes=self.vram_bytes,
            gpu_bandwidth_bytes_s=self.bandwidth_bytes_s,
            pcie_bandwidth_bytes_s=pcie_bandwidth_bytes_s(self.pcie_generation, self.pcie_width),
            ram_total_bytes=ram_total_bytes, ram_available_bytes=ram_available_bytes,
            swap_total_bytes=swap_total_bytes, host_bandwidth_bytes_s=host_bandwidth_bytes_s,
            physical_cores=physical_cores, source="catalog",
        )


@lru_cache(maxsize=1)
def load_cards(path: Path = CATALOG) -> tuple[Card, ...]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"card catalog {path} is unreadable ({exc}): reinstall moe-tune") from exc
    return tuple(
        Card(name=c["name"], aliases=tuple(c.get("aliases", [])), vram_bytes=int(c["vram_gib"]) * 2**30,
             bandwidth_bytes_s=float(c["bandwidth_gb_s"]) * 1e9, bus_width_bits=int(c["bus_bits"]),
             pcie_generation=int(c["pcie"][0]), pcie_width=int(c["pcie"][1]), source=c["source"])
        for c in data["cards"]
    )


def _parts(text: str) -> tuple[str | None, frozenset[str], int | None]:
    low = _NOISE.sub(" ", text.lower().replace("-", " "))
    low = re.sub(r"(\d{4})(ti|super)\b", r"\1 \2", low)
    vram = _VRAM.search(low)
    model = _MODEL.search(_VRAM.sub(" ", low))
    variant = frozenset(w for w in ("ti", "super") if re.search(rf"\b{w}\b", low))
    return (model.group(1) if model else None, variant, int(vram.group(1)) if vram else None)


def find_card(query: str, cards: tuple[Card, ...] | None = None) -> Card:
    cards = cards if cards is not None else load_cards()
    number, variant, vram = _parts(query)
    matches = [c for c in cards if _parts(c.name)[:2] == (number, variant)] if number else []
    if vram is not None:
        matches = [c for c in matches if c.vram_bytes == vram * 2**30]
    if len(matches) > 1:
        # An unsized query means the base variant, which lists the bare model name as an alias.
        bare = " ".join(filter(None, [number, *sorted(variant)]))
        matches = [c for c in matches if any(_parts(a)[:2] == (number, variant) or a == bare for a in c.aliases)] \
            or matches[:1]
    if not matches:
        names = [c.name.removeprefix("GeForce ") for c in cards]
        close = difflib.get_close_matches(query.upper().replace("GEFORCE ", ""), [n.upper() for n in names], n=3)
        hint = f" (closest: {', '.join(close)})" if close else ""
        raise UnknownCardError(
            f"no card matches {query!r}{hint}: name a card from the catalog, e.g. \"RTX 4060 Ti 16GB\""
        )
    return matches[0]


# The host a planned card sits in when it is not this machine and --host-bandwidth is not given: a typical
# desktop with dual-channel DDR5-5600, 2 channels x 8 bytes x 5600 MT/s. A peak figure, as a ceiling wants.
DESKTOP_HOST_BANDWIDTH_BYTES_S = 2 * 8 * 5600e6
DESKTOP_HOST = "assumed: dual-channel DDR5-5600 desktop; --host-bandwidth GB/s to set"


def machine(gpu: str | None, host_bandwidth_s: float = 0.0, ram_bytes: int | None = None,
            host_bandwidth_gb_s: float | None = None) -> Hardware:
    """This machine as probed, or the named card put into it (its host cores, the card empty).

    ``ram_bytes`` plans for another amount of host RAM (all of it taken as available). Host bandwidth: the
    ``host_bandwidth_gb_s`` given, else with a named card a typical desktop's (this machine's RAM is not the
    user's), else this machine's, measured for ``host_bandwidth_s`` seconds.
    """
    if host_bandwidth_gb_s is not None and host_bandwidth_gb_s <= 0:
        raise UsageError(f"--host-bandwidth must be > 0 GB/s, got {host_bandwidth_gb_s:g}: e.g. 89.6 for "
                         "dual-channel DDR5-5600")
    host = hardware.probe_host()
    ram = ram_bytes if ram_bytes is not None else host.ram_total_bytes
    avail = ram_bytes if ram_bytes is not None else host.ram_available_bytes
    if host_bandwidth_gb_s is not None:
        bw, bw_source = host_bandwidth_gb_s * 1e9, "--host-bandwidth"
    elif gpu:
        bw, bw_source = DESKTOP_HOST_BANDWIDTH_BYTES_S, DESKTOP_HOST
    else:
        bw = hardware.measure_host_bandwidth(host_bandwidth_s) if host_bandwidth_s > 0 else 0.0
        bw_source = "measured here" if bw else "not measured"
    if gpu:
        hw = find_card(gpu).hardware(ram, avail, bw, host.physical_cores, host.swap_total_bytes)
    else:
        hw = replace(hardware.probe_hardware(host_bandwidth_s=0), ram_total_bytes=ram, ram_available_bytes=avail,
                     host_bandwidth_bytes_s=bw)
    return replace(hw, host_bandwidth_source=bw_source)
