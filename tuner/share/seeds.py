"""`auto-tune --seed-from REPO`: the lines others shared for this model file on this card, as search seeds
(:class:`tuner.search.proposals.Proposal`). A seed is a hypothesis measured here like any other, so the pool
proposes few: at most :data:`MAX_SEEDS` distinct lines, those more Hub accounts agree on first (a record's own
sharer id never counts: :mod:`tuner.share.accounts`). Each seed's label names its record whole, so no two seeds
share one.

Each record proposes its printed line; where it printed llama.cpp's own choice (the default or ``--fit``, already a
seed), its best measured candidate instead, the hypothesis it measured but did not decide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.engine.flags import parse_command
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions
from tuner.machine.hardware import Hardware
from tuner.search.proposals import Proposal
from tuner.share.gate import SharedRecord, shown
from tuner.share.lookup import UNVERIFIED, agreement, lookup
from tuner.share.match import CardQuery, Matched, ModelQuery

BASELINES = ("default", "fit")
MAX_SEEDS = 4


@dataclass
class _Seed:
    line: str
    what: str  # "printed line" or "best candidate (it printed …)"
    first: Matched
    voices: set[str] = field(default_factory=set)


def _best_candidate(r: SharedRecord) -> dict[str, Any] | None:
    lines = [ln for ln in r.data["lines"] if ln["label"] not in BASELINES and ln["failure"] is None
             and ln["gen_tok_s"] is not None]
    confirmed = [ln for ln in lines if ln["round"] == "confirmation"] or lines
    return max(confirmed, key=lambda ln: ln["gen_tok_s"], default=None)


def proposals(matched: Sequence[Matched], repo_id: str) -> list[Proposal]:
    """The records' lines as at most :data:`MAX_SEEDS` seeds: distinct lines, by how many accounts propose each."""
    seeds: dict[str, _Seed] = {}
    for m in matched:
        r = m.record
        line, what = r.data["printed"]["line"], "printed line"
        if r.data["printed"]["label"] in BASELINES:
            best = _best_candidate(r)
            if best is None:
                continue
            line, what = best["line"], f"best candidate (it printed {shown(r.data['printed']['label'], 20)})"
        seeds.setdefault(line, _Seed(line, what, m)).voices.add(m.account or UNVERIFIED)
    ranked = sorted(seeds.values(), key=lambda s: (-len(s.voices), s.line))[:MAX_SEEDS]
    out = []
    for s in ranked:
        r = s.first.record
        out.append(Proposal(
            f"shared-{r.record_id}", parse_command(s.line).config,  # the gate's rendering: it reads back
            f"{s.what} of shared record {r.record_id} in {repo_id}: {shown(r.card['name'], 60)} "
            f"({s.first.relation}), engine {shown(r.engine_commit, 40)}, {shown(r.data['workload']['kind'], 20)} "
            f"workload; {agreement(len(s.voices), UNVERIFIED in s.voices)}",
            None if r.engine_commit == "unknown" else shown(r.engine_commit, 40), r.card.get("vram_budget_bytes")))
    return out


def seeds_from(repo_id: str, model: Path, hw: Hardware, options: HubOptions = DEFAULT_OPTIONS,
               on_step: Callable[[str], None] | None = None) -> list[Proposal]:
    """The records of ``repo_id`` for ``model`` on this machine's card (or a sibling), as seeds."""
    answer = lookup(repo_id, ModelQuery.parse(str(model)), CardQuery.of(hw), options)
    seeds = proposals(answer.matched, repo_id)
    if on_step:
        for line in answer.skipped:
            on_step(line)
        on_step(f"--seed-from {repo_id}: {len(answer.matched)} of {answer.records_read:,} shared records read are "
                f"for this model on this card or a sibling; {len(seeds)} distinct line(s) proposed as seeds")
    return seeds
