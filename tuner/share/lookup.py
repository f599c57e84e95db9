"""Which shared records speak of this model on this card: matching, grouping by engine commit, agreement; and
the matching records' lines as search seeds (:class:`tuner.search.proposals.Proposal`). Measures nothing.

A model matches by its fingerprint (a local file) or by Hub repo and quant; without a quant, every quant of the
repo matches. A card matches by name, or as a sibling: another card of the same VRAM class (whole GiB, as the
card reports it). ``cpu`` names results measured without a GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.catalog.cards import find_card
from tuner.core.errors import UsageError
from tuner.engine.flags import parse_command
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions, parse_hub_ref
from tuner.machine.hardware import Hardware
from tuner.models import fingerprint
from tuner.search.proposals import Proposal
from tuner.share.record import CPU_CARD, SharedRecord, model_identity

BASELINES = ("default", "fit")


@dataclass(frozen=True, slots=True)
class ModelQuery:
    text: str
    hub_repo: str | None = None
    quant: str | None = None  # None: every quant of the repo
    sha: tuple[int, str, str] | None = None  # a local file's (size, head, tail)

    @classmethod
    def parse(cls, text: str) -> ModelQuery:
        path = Path(text).expanduser()
        if path.is_file():
            ident = model_identity(path, fingerprint.fingerprint(path))
            if ident["hub_repo"]:
                return cls(text, ident["hub_repo"], ident["quant"], _sha(ident))
            return cls(text, sha=_sha(ident))
        ref = parse_hub_ref(text)
        if ref is None:
            raise UsageError(f"model {text} not found: give a .gguf path or a Hugging Face name like "
                             "unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
        return cls(text, ref.repo_id, ref.quant)

    def matches(self, model: dict[str, Any]) -> bool:
        if self.sha is not None and _sha(model) == self.sha:
            return True
        if self.hub_repo is None or (model.get("hub_repo") or "").lower() != self.hub_repo.lower():
            return False
        return self.quant is None or (model.get("quant") or "").upper() == self.quant.upper()


def _sha(model: dict[str, Any]) -> tuple[int, str, str] | None:
    head, tail = model.get("head_sha256"), model.get("tail_sha256")
    return (int(model.get("size_bytes") or 0), head, tail) if head and tail else None


@dataclass(frozen=True, slots=True)
class CardQuery:
    name: str  # the catalog's name, or "cpu"
    vram_class_gib: int  # 0: no GPU

    @classmethod
    def parse(cls, text: str) -> CardQuery:
        if text.strip().lower() in (CPU_CARD, "none"):
            return cls(CPU_CARD, 0)
        card = find_card(text)
        return cls(card.name, vram_class(card.vram_bytes))

    @classmethod
    def of(cls, hw: Hardware) -> CardQuery:
        return cls(hw.gpu_name, vram_class(hw.vram_total_bytes)) if hw.has_gpu else cls(CPU_CARD, 0)

    def relation(self, card: dict[str, Any]) -> str | None:
        """"same card", "sibling" (same VRAM class) or None."""
        name = card["name"]
        if name == CPU_CARD or self.name == CPU_CARD:
            return "same card" if name == self.name else None
        if _canonical(name) == _canonical(self.name):
            return "same card"
        return "sibling" if vram_class(card["vram_total_bytes"]) == self.vram_class_gib else None


def vram_class(vram_bytes: int) -> int:
    return round(vram_bytes / 2**30)


def _canonical(name: str) -> str:
    try:
        return find_card(name).name
    except UsageError:
        return name.strip().lower()


@dataclass(frozen=True, slots=True)
class Matched:
    record: SharedRecord
    relation: str  # same card | sibling


def matching(records: Sequence[SharedRecord], model: ModelQuery, card: CardQuery) -> list[Matched]:
    out = []
    for r in records:
        rel = card.relation(r.card)
        if rel is not None and model.matches(r.model):
            out.append(Matched(r, rel))
    return out


# -- the look-up's answer -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LineGroup:
    """One printed line (the same flags) and the records that printed it under one engine commit."""

    line: str
    label: str
    records: list[str] = field(default_factory=list)
    cards: list[str] = field(default_factory=list)
    quants: list[str] = field(default_factory=list)
    workloads: list[str] = field(default_factory=list)
    gen_tok_s: list[float] = field(default_factory=list)
    prompt_tok_s: list[float] = field(default_factory=list)
    why: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        med = statistics.median
        return {"line": self.line, "label": self.label, "records": len(self.records), "record_ids": self.records,
                "cards": sorted(set(self.cards)), "quants": sorted(set(self.quants)),
                "workloads": sorted(set(self.workloads)),
                "median_gen_tok_s": med(self.gen_tok_s) if self.gen_tok_s else None,
                "median_prompt_tok_s": med(self.prompt_tok_s) if self.prompt_tok_s else None,
                "why": list(dict.fromkeys(self.why)), "verdicts": list(dict.fromkeys(self.verdicts))}


def group(matched: Sequence[Matched]) -> dict[str, list[LineGroup]]:
    """Engine commit → the printed lines under it, the line most records agree on first."""
    out: dict[str, dict[str, LineGroup]] = {}
    for m in matched:
        r = m.record
        printed = r.data["printed"]
        g = out.setdefault(r.engine_commit, {}).setdefault(printed["line"], LineGroup(printed["line"],
                                                                                     printed["label"]))
        g.records.append(r.record_id)
        g.cards.append(f"{r.card['name']} ({m.relation})")
        g.quants.append(r.model.get("quant") or r.model["file_name"])
        g.workloads.append(r.data["workload"]["kind"])
        g.why.append(printed["why"])
        g.verdicts.extend(f"{v['a']} vs {v['b']}: {v['outcome']} ({v['ratio']:.2f}x, {v['low']:.2f}-{v['high']:.2f} "
                          f"over {v['rounds']} rounds)" for v in r.data["verdicts"])
        measured = r.line(printed["label"])
        if measured and measured["gen_tok_s"] is not None:
            g.gen_tok_s.append(measured["gen_tok_s"])
        if measured and measured["prompt_tok_s"] is not None:
            g.prompt_tok_s.append(measured["prompt_tok_s"])
    return {commit: sorted(lines.values(), key=lambda g: -len(g.records)) for commit, lines in out.items()}


# -- seeds --------------------------------------------------------------------------------------------------


def proposals(matched: Sequence[Matched], repo_id: str) -> list[Proposal]:
    """The records' printed lines as seeds; where a record printed llama.cpp's own choice (already a seed), its
    best candidate instead, the hypothesis it measured but did not decide."""
    out: list[Proposal] = []
    for m in matched:
        r = m.record
        label = r.data["printed"]["label"]
        line = r.data["printed"]["line"]
        what = "printed line"
        if label in BASELINES:
            best = _best_candidate(r)
            if best is None:
                continue
            label, line, what = best["label"], best["line"], f"best candidate (it printed {r.data['printed']['label']})"
        budget = r.card.get("vram_budget_bytes")
        out.append(Proposal(f"shared-{r.record_id[:8]}", parse_command(line).config,  # the gate parsed it
                            f"{what} of shared record {r.record_id} in {repo_id}: {r.card['name']} ({m.relation}), "
                            f"engine {r.engine_commit}, {r.data['workload']['kind']} workload",
                            None if r.engine_commit == "unknown" else r.engine_commit, budget))
    return out


def _best_candidate(r: SharedRecord) -> dict[str, Any] | None:
    lines = [ln for ln in r.data["lines"] if ln["label"] not in BASELINES and ln["failure"] is None
             and ln["gen_tok_s"] is not None]
    confirmed = [ln for ln in lines if ln["round"] == "confirmation"] or lines
    return max(confirmed, key=lambda ln: ln["gen_tok_s"], default=None)


def seeds_from(repo_id: str, model: Path, hw: Hardware, options: HubOptions = DEFAULT_OPTIONS,
               on_step: Callable[[str], None] | None = None) -> list[Proposal]:
    """`auto-tune --seed-from REPO`: the records of ``repo_id`` for this model file on this card, as seeds."""
    from tuner.share.store import fetch

    got = fetch(repo_id, options)
    matched = matching(got.records, ModelQuery.parse(str(model)), CardQuery.of(hw))
    if on_step:
        for line in got.skipped:
            on_step(line)
        on_step(f"--seed-from {repo_id}: {len(matched)} of {len(got.records)} shared records are for this model "
                "on this card or a sibling")
    return proposals(matched, repo_id)
