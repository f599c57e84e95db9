"""`moe-tune lookup`: what others measured for a model on a card, as lines and how many Hub *accounts* agree on
each. Measures nothing.

Reading the pool is :mod:`tuner.share.pool`'s (who uploaded each record: :mod:`tuner.share.accounts`); matching
:mod:`tuner.share.match`'s; the roofline bound on figures :mod:`tuner.share.physics`' (a record that breaks it is
refused, counted with the pool's refusals; a record nothing bounds shows no figure). Here the matched records become
lines: grouped by engine commit and
printed line, counted by distinct accounts (one account's copies of a line count once, whatever sharer ids its
records claim; every record whose uploader the Hub did not say counts together as one *unverified* account), with
each account's median figures and the median of those. Lines two or more accounts agree on come first; a line only
one account reports is shown after them, marked unconfirmed (docs/sharing.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tuner.core.errors import TunerError
from tuner.hub import client
from tuner.hub.repos import DEFAULT_OPTIONS, HubOptions
from tuner.share import physics, pool
from tuner.share.gate import refusal, shown
from tuner.share.match import CardQuery, Matched, ModelQuery, matching, wanted
from tuner.share.pool import Fetched, PoolQuery, fetch
from tuner.share.refusals import Refusals

MAX_SHOWN = 5  # distinct reasons and verdicts shown per line


UNVERIFIED = "(unverified)"  # the one voice of every record whose uploader the Hub did not say


@dataclass
class LineGroup:
    """One printed line (the flag layer's rendering) under one engine commit, and who printed it."""

    line: str
    label: str
    voices: dict[str, list[str]] = field(default_factory=dict)  # Hub account (or UNVERIFIED) → its record ids
    sharer_ids: set[str] = field(default_factory=set)  # what the records call their sharers: labels, never counted
    gen_by_voice: dict[str, list[float]] = field(default_factory=dict)
    prompt_by_voice: dict[str, list[float]] = field(default_factory=dict)
    cards: set[str] = field(default_factory=set)
    quants: set[str] = field(default_factory=set)
    workloads: set[str] = field(default_factory=set)
    why: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    @property
    def n_accounts(self) -> int:
        return len(self.voices)

    def add(self, m: Matched, figures: bool = True) -> None:
        """``m`` among those who print this line; its speeds only where physics bounds them (``figures``)."""
        r = m.record
        voice = m.account or UNVERIFIED
        self.voices.setdefault(voice, []).append(r.record_id)
        self.sharer_ids.add(r.sharer)
        self.cards.add(f"{shown(r.card['name'], 60)} ({m.relation})")
        self.quants.add(shown(r.model.get("quant") or r.model["file_name"], 60))
        self.workloads.add(shown(r.data["workload"]["kind"], 40))
        if len(self.why) < MAX_SHOWN:
            _add_once(self.why, shown(r.data["printed"]["why"], 600))
        for v in r.data["verdicts"]:
            if len(self.verdicts) < MAX_SHOWN:
                _add_once(self.verdicts, shown(f"{v['a']} vs {v['b']}: {v['outcome']} ({v['ratio']:.2f}x, "
                                               f"{v['low']:.2f}-{v['high']:.2f} over {v['rounds']} rounds)", 300))
        measured = r.line(r.data["printed"]["label"]) if figures else None
        if measured and measured["gen_tok_s"] is not None:
            self.gen_by_voice.setdefault(voice, []).append(measured["gen_tok_s"])
        if measured and measured["prompt_tok_s"] is not None:
            self.prompt_by_voice.setdefault(voice, []).append(measured["prompt_tok_s"])

    def to_dict(self) -> dict[str, Any]:
        verified = sorted(v for v in self.voices if v != UNVERIFIED)
        return {"line": self.line, "label": shown(self.label, 60), "accounts": self.n_accounts,
                "account_names": verified, "unverified": UNVERIFIED in self.voices,
                "single_account": self.n_accounts == 1,
                "records": sum(len(ids) for ids in self.voices.values()),
                "record_ids": sorted(i for ids in self.voices.values() for i in ids),
                "sharer_ids": sorted(self.sharer_ids),
                "cards": sorted(self.cards), "quants": sorted(self.quants), "workloads": sorted(self.workloads),
                "median_gen_tok_s": _median_of_voices(self.gen_by_voice),
                "median_prompt_tok_s": _median_of_voices(self.prompt_by_voice),
                "why": self.why[:MAX_SHOWN], "verdicts": self.verdicts[:MAX_SHOWN]}


def agreement(n_accounts: int, unverified: bool) -> str:
    """How many accounts stand behind a line, in words: ``2 accounts agree``, ``1 account (unconfirmed)``."""
    if n_accounts == 1:
        return "1 unverified account (unconfirmed)" if unverified else "1 account (unconfirmed)"
    return f"{n_accounts} accounts agree" + (" (1 of them unverified)" if unverified else "")


def _add_once(items: list[str], text: str) -> None:
    if text not in items:
        items.append(text)


def _median_of_voices(by_voice: dict[str, list[float]]) -> float | None:
    """Each account's median, then the median of those: one account's many copies move it as much as one."""
    per = [statistics.median(v) for v in by_voice.values() if v]
    return statistics.median(per) if per else None


def group(matched: Sequence[Matched], unbounded: Collection[str] = ()) -> dict[str, list[LineGroup]]:
    """Engine commit → its printed lines: those more accounts agree on first, then by line (a tie is not decided
    by what a record claims). The records named in ``unbounded`` (ids: nothing bounds their figures) count as
    voices and show no figure."""
    out: dict[str, dict[str, LineGroup]] = {}
    for m in matched:
        printed = m.record.data["printed"]
        commit = shown(m.record.engine_label, 60)
        out.setdefault(commit, {}).setdefault(printed["line"], LineGroup(printed["line"], printed["label"])).add(
            m, figures=m.record.record_id not in unbounded)
    return {commit: sorted(lines.values(), key=lambda g: (-g.n_accounts, g.line)) for commit, lines in out.items()}


def model_bound(model: ModelQuery, options: HubOptions = DEFAULT_OPTIONS) -> physics.ModelBound:
    """What this machine can learn of ``model``'s bytes per token: its header (a local file, or a Hub quant's,
    read with range requests), and for a Hub repo every quant's listed size."""
    from tuner.models.gguf_reader import inspect_model

    if model.path is not None:
        return physics.ModelBound(exact_bytes=physics.bytes_per_token(inspect_model(model.path)))
    from tuner.hub import remote_header, repos

    assert model.hub_repo is not None  # parse() gives a path or a repo
    try:
        listing = repos.list_quants(model.hub_repo, options=options)
        sizes = {q.name.upper(): q.total_bytes for q in listing.quants}
        # Without a quant, any quant's header tells the architecture's active share: the default one, else the first.
        quant = listing.get(model.quant) if model.quant else next(
            (q for q in listing.quants if q.name.upper() == repos.DEFAULT_QUANT), listing.quants[0])
        info = remote_header.read_quant_headers(model.hub_repo, quant, commit=listing.commit or "main",
                                                options=options).model_info()
    except (TunerError, IndexError) as exc:
        return physics.ModelBound(unknown=shown(exc, 200))
    return physics.ModelBound(physics.bytes_per_token(info), quant.name, physics.active_share(info), sizes)


@dataclass(frozen=True, slots=True)
class Answer:
    fetched: Fetched  # what the pool read; its records those kept (within physics), its refusals every other
    matched: tuple[Matched, ...]  # those within physics
    refusals: Refusals  # the pool's, then the records whose figures break physics
    groups: dict[str, list[LineGroup]]
    unbounded: frozenset[str] = frozenset()  # ids of the records kept whose figures nothing bounds (none shown)

    @property
    def skipped(self) -> tuple[str, ...]:
        return self.refusals.lines()

    @property
    def records_read(self) -> int:
        """Every record the look-up took up: each one kept or counted under a refusal's reason."""
        return self.fetched.records_read


def lookup(repo_id: str, model: ModelQuery, card: CardQuery, options: HubOptions = DEFAULT_OPTIONS,
           bound: physics.ModelBound | None = None) -> Answer:
    """The records of ``repo_id`` for ``model`` on ``card`` or a sibling, within physics, as lines; within
    :data:`tuner.share.pool.DEADLINE_S` whatever the server does (the model's header read included)."""
    with client.bounded(pool.DEADLINE_S, request_s=pool.REQUEST_S, max_bytes=pool.MAX_RESPONSE_BYTES,
                        what=f"the look-up's {pool.DEADLINE_S:.0f} s"):
        got = fetch(repo_id, options, PoolQuery(card.vram_class_gib, model.keys, model.sha[1] if model.sha else None),
                    keep=wanted(model, card))
        candidates = matching(got.records, model, card, got.accounts)
        refusals = got.refusals
        kept: list[Matched] = []
        unbounded: dict[str, str] = {}  # record id → why nothing bounds its figures
        if candidates:
            bound = bound or model_bound(model, options)
            for m in candidates:
                why = physics.refused(m, bound)
                if why is not None:
                    refusals.refuse(refusal(m.record.record_id, why, "above physics"))
                    continue
                kept.append(m)
                loose = physics.unbounded(m, bound)
                if loose is not None:
                    unbounded[m.record.record_id] = loose
            for why in dict.fromkeys(unbounded.values()):
                n = sum(1 for w in unbounded.values() if w == why)
                refusals.note(f"{why}: nothing bounds what {n:,} record(s) claim, so none of their figures is shown")
    fetched = replace(got, records=tuple(m.record for m in kept))
    return Answer(fetched, tuple(kept), refusals, group(kept, unbounded), frozenset(unbounded))
