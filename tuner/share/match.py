"""Which gated records speak of this model on this card. Pure matching: nothing here reads the network.

A model matches by its fingerprint (a local file) or by Hub repo and quant; without a quant, every quant of the
repo matches. A card matches by name (the catalog's, or exactly the name this machine's card reports), or as a
*sibling*: another card of the same VRAM class (whole GiB) that the card catalog knows, sized as the catalog
sizes it. A card the catalog does not know is nobody's sibling. ``cpu`` names results measured without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.catalog.cards import Card, find_card
from tuner.core.errors import UsageError
from tuner.hub.repos import parse_hub_ref
from tuner.machine.hardware import Hardware
from tuner.models import fingerprint
from tuner.share.gate import CPU_CARD, SharedRecord
from tuner.share.record import model_identity

# A CPU record's generation is bound by host memory: more than any desktop or workstation moves (12-channel
# DDR5 servers peak near 0.6 TB/s).
HOST_CEILING_BYTES_S = 1.0e12


@dataclass(frozen=True, slots=True)
class ModelQuery:
    text: str
    hub_repo: str | None = None
    quant: str | None = None  # None: every quant of the repo
    sha: tuple[int, str, str] | None = None  # a local file's (size, head, tail)
    path: Path | None = None  # the local file, when one was given

    @classmethod
    def parse(cls, text: str) -> ModelQuery:
        path = Path(text).expanduser()
        if path.is_file():
            ident = model_identity(path, fingerprint.fingerprint(path))
            if ident["hub_repo"]:
                return cls(text, ident["hub_repo"], ident["quant"], _sha(ident), path)
            return cls(text, sha=_sha(ident), path=path)
        ref = parse_hub_ref(text)
        if ref is None:
            raise UsageError(f"model {text} not found: give a .gguf path or a Hugging Face name like "
                             "unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
        return cls(text, ref.repo_id, ref.quant)

    @property
    def keys(self) -> frozenset[str]:
        """The model keys a consolidated shard sorts rows by (:func:`model_key`) that may hold this model."""
        keys = {f"hub:{self.hub_repo.lower()}"} if self.hub_repo else set()
        if self.sha is not None:
            keys.add(f"sha:{self.sha[1]}")
        return frozenset(keys)

    def matches(self, model: dict[str, Any]) -> bool:
        if self.sha is not None and _sha(model) == self.sha:
            return True
        if self.hub_repo is None or (model.get("hub_repo") or "").lower() != self.hub_repo.lower():
            return False
        return self.quant is None or (model.get("quant") or "").upper() == self.quant.upper()


def model_key(model: dict[str, Any]) -> str:
    """A record's model as one sortable key: its Hub repo when it names one, else its fingerprint's head."""
    return f"hub:{model['hub_repo'].lower()}" if model.get("hub_repo") else f"sha:{model.get('head_sha256') or ''}"


def _sha(model: dict[str, Any]) -> tuple[int, str, str] | None:
    head, tail = model.get("head_sha256"), model.get("tail_sha256")
    return (int(model.get("size_bytes") or 0), head, tail) if head and tail else None


def vram_class(vram_bytes: int) -> int:
    return round(vram_bytes / 2**30)


def catalog_card(name: str, vram_bytes: int) -> Card | None:
    """The catalog's card that ``name`` with ``vram_bytes`` is, or None (the catalog does not know it)."""
    try:
        return find_card(f"{name} {vram_class(vram_bytes)}GB")
    except UsageError:
        return None


@dataclass(frozen=True, slots=True)
class CardQuery:
    name: str  # the catalog's name, the card's own (this machine's), or "cpu"
    vram_class_gib: int  # 0: no GPU
    bandwidth_bytes_s: float = 0.0  # the card's (0: unknown)

    @classmethod
    def parse(cls, text: str) -> CardQuery:
        if text.strip().lower() in (CPU_CARD, "none"):
            return cls(CPU_CARD, 0, HOST_CEILING_BYTES_S)
        card = find_card(text)
        return cls(card.name, vram_class(card.vram_bytes), card.bandwidth_bytes_s)

    @classmethod
    def of(cls, hw: Hardware) -> CardQuery:
        if not hw.has_gpu:
            return cls(CPU_CARD, 0, HOST_CEILING_BYTES_S)
        known = catalog_card(hw.gpu_name, hw.vram_total_bytes)
        if known is not None:
            return cls(known.name, vram_class(known.vram_bytes), known.bandwidth_bytes_s)
        return cls(hw.gpu_name, vram_class(hw.vram_total_bytes), hw.gpu_bandwidth_bytes_s)

    def relation(self, card: dict[str, Any]) -> tuple[str, float] | None:
        """("same card" or "sibling", the card's memory bandwidth for the roofline), or None."""
        name = card["name"]
        if name == CPU_CARD or self.name == CPU_CARD:
            return ("same card", HOST_CEILING_BYTES_S) if name == self.name else None
        known = catalog_card(name, card["vram_total_bytes"])
        if known is None:
            same = name.strip().lower() == self.name.strip().lower()
            return ("same card", self.bandwidth_bytes_s) if same else None
        if known.name == self.name:
            return "same card", known.bandwidth_bytes_s
        return ("sibling", known.bandwidth_bytes_s) if vram_class(known.vram_bytes) == self.vram_class_gib else None


@dataclass(frozen=True, slots=True)
class Matched:
    record: SharedRecord
    relation: str  # same card | sibling
    bandwidth_bytes_s: float  # of the record's card (0: unknown)
    account: str | None = None  # the Hub account that brought it into the pool (None: unverified)


def wanted(model: ModelQuery, card: CardQuery) -> Callable[[SharedRecord], bool]:
    """Whether a record speaks of ``model`` on ``card`` or a sibling (a pool drops the others as it reads)."""
    return lambda r: model.matches(r.model) and card.relation(r.card) is not None


def matching(records: Sequence[SharedRecord], model: ModelQuery, card: CardQuery,
             accounts: Mapping[str, str | None] | None = None) -> list[Matched]:
    out = []
    for r in records:
        rel = card.relation(r.card)
        if rel is not None and model.matches(r.model):
            out.append(Matched(r, *rel, (accounts or {}).get(r.record_id)))
    return out
