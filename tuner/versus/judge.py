"""The tuned lines of several models against each other, in interleaved rounds on the workload's own metric: one
request's end-to-end time (or, with slots, aggregate throughput) for chat and batch; a whole agent session's time
for agents, with each turn's time to first token.

The finish's two phases (:mod:`tuner.search.decide`): selection rounds over every model choose the one with the
best median; fresh confirmation rounds then judge it against every other model with the finish's verdicts
(:func:`tuner.search.verdict.compare_quiet`). Judging the best median on the rounds that made it best is the
winner's curse. A model is called faster only when decided in rounds that did not select it; undecided stays
undecided, with the selected model named.

A model whose engine read its weights back from disk in any round (host paging: it does not fit this machine's RAM as
tuned) is never selected nor declared faster, as auto-tune never prints such a line; the others are judged without
it. Every round carries its paging verdict; paging while other programs' memory load pressed on it is theirs (the
round is busy, :mod:`tuner.search.watched_round`), not the model's. Paging rules a line out only when it repeats, or
when one round pages and the plan says the line does not fit the RAM free (``pages_by_plan``): one round that paged
after another arm had evicted the page cache is that round's noise (said, left out like a busy round). The race on
the Qwen3-30B-A3B shape once marked llama.cpp's default "does not fit" for good from one round that read 373 MiB back
at 0.1 % memory pressure, right after a resident line had taken the page cache.

Rounds are paired by their number, not their position: a line that sat rounds out (out of the running, then back in
when the line that displaced it left) is compared on the rounds both ran.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import flags
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine import activity
from tuner.machine.sampler import NOT_MEASURED_WORDS
from tuner.measure import bench, session_run
from tuner.measure import session as session_mod
from tuner.measure.workload import Workload
from tuner.search import decide
from tuner.search.finish import round_score, server_load, vram_growth_bytes
from tuner.search.verdict import BETTER, UNDECIDED, WORSE, Verdict, compare_quiet
from tuner.search.watched_round import watched_round


@dataclass(frozen=True, slots=True)
class Round:
    """One model's one round."""

    score: float | None  # higher is better; None: failed
    noise: str | None = None  # what disturbed the machine (None: quiet)
    gen_tok_s: float | None = None
    prompt_tok_s: float | None = None
    ttft_s: float | None = None  # median over the round's requests or turns
    session_s: float | None = None  # agent workload: the whole session
    host_paging: str | None = None  # the round read the model back from disk while generating: the evidence
    paging_verdict: str = "not measured"  # the round's host-paging verdict (tuner.machine.sampler.PagingKind)
    # How far the card's use grew over the sampler's first look, taken before the server started: the line's own
    # VRAM (None: no GPU sampled).
    vram_growth_bytes: int | None = None
    number: int = 0  # the round it was measured in (1-based; 0: a record written before rounds were numbered)


@dataclass(frozen=True, slots=True)
class Arm:
    label: str
    launch_line: str
    rounds: tuple[Round, ...] = ()  # the confirmation rounds (every round when nothing was selected)
    failure: str | None = None
    selection: tuple[Round, ...] = ()  # the selection rounds: they chose, they decide nothing
    # Why the plan says this line does not fit the RAM free (its model and prompt cache beside what it holds); None:
    # it fits, and one round's paging is that round's noise.
    plan_pages: str | None = None

    def _median(self, name: str) -> float | None:
        xs = [getattr(r, name) for r in (self.rounds or self.selection) if getattr(r, name) is not None]
        return statistics.median(xs) if xs else None

    @property
    def scores(self) -> list[float | None]:
        return [r.score for r in self.rounds]

    def quiet_scores(self) -> list[float | None]:
        return [None if self.noise_of(r) else r.score for r in self.rounds]

    def noise_of(self, r: Round) -> str | None:
        """What disturbed round ``r``: the machine (busy), or a paging the line does not own (one round alone, the plan
        saying it fits): left out of verdicts and medians like a busy round."""
        if r.noise:
            return r.noise
        if r.host_paging and self.paging is None:
            return f"paged in this round alone ({r.host_paging}): that round's noise, not the line's"
        return None

    @property
    def paged_rounds(self) -> int:
        return sum(1 for r in (*self.selection, *self.rounds) if r.host_paging)

    @property
    def paging(self) -> str | None:
        """Host paging that is the line's (its evidence): seen in two rounds or more, or in one where the plan says the
        line does not fit this machine's RAM. None: it never paged, or paged once beside a plan that says it fits."""
        every = (*self.selection, *self.rounds)
        first = next((r.host_paging for r in every if r.host_paging), None)
        if first is None or (self.paged_rounds < 2 and self.plan_pages is None):
            return None
        return first

    @property
    def vram_growth_bytes(self) -> int | None:
        """The most its rounds grew the card's use (None: no measured round sampled the card)."""
        seen = [r.vram_growth_bytes for r in (*self.selection, *self.rounds) if r.vram_growth_bytes is not None]
        return max(seen) if seen else None

    def budget_words(self, budget_bytes: int | None) -> str | None:
        """Why this line does not keep a VRAM budget (None: it does, or no budget was set): it grew the card's use past
        the budget, or a round that measured it did not read the card, so keeping the budget is not known (the
        finish's rule, :meth:`tuner.search.finish.Finish.vram_unknown`)."""
        if budget_bytes is None:
            return None
        grew = self.vram_growth_bytes
        if grew is not None and grew > budget_bytes:
            return f"used {grew / 2**20:,.0f} MiB of VRAM, over the {budget_bytes / 2**20:,.0f} MiB budget"
        measured = [r for r in (*self.selection, *self.rounds) if r.score is not None]
        if measured and any(r.vram_growth_bytes is None for r in measured):
            return "its VRAM was not read (not known to keep the VRAM budget)"
        return None

    @property
    def score(self) -> float | None:
        """The quiet median of the confirmation rounds (of the selection rounds when it had none)."""
        return decide.quiet_median([(r.score, self.noise_of(r)) for r in (self.rounds or self.selection)])

    def figures(self) -> dict[str, float | None]:
        return {name: self._median(name) for name in ("gen_tok_s", "prompt_tok_s", "ttft_s", "session_s")}

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "launch_line": self.launch_line, "failure": self.failure,
                "selection": [asdict(r) for r in self.selection], "rounds": [asdict(r) for r in self.rounds],
                "score": self.score, "host_paging": self.paging, "paged_rounds": self.paged_rounds,
                "plan_pages": self.plan_pages, **self.figures()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Arm:
        return cls(d["label"], d["launch_line"], tuple(Round(**r) for r in d.get("rounds", [])), d.get("failure"),
                   tuple(Round(**r) for r in d.get("selection", [])), d.get("plan_pages"))


@dataclass(frozen=True, slots=True)
class HeadToHead:
    arms: tuple[Arm, ...]
    metric: str
    verdicts: tuple[Verdict, ...] = field(default_factory=tuple)  # the best against every other model
    selected: str | None = None  # the model the selection rounds chose (None: no selection)
    vram_budget_bytes: int | None = None  # the budget every line was held to (None: none)

    @property
    def best(self) -> Arm | None:
        """The selected model; without selection rounds, the best median; never one that paged host RAM or did not
        keep the VRAM budget."""
        return _best(self.arms, self.selected, self.vram_budget_bytes)

    def arm(self, label: str) -> Arm | None:
        return next((a for a in self.arms if a.label == label), None)

    def runnable(self) -> list[Arm]:
        """The lines a comparison may print: measured, never paging host RAM, within the VRAM budget."""
        return _runnable(self.arms, self.vram_budget_bytes)

    def pair(self, a: str, b: str) -> Verdict:
        """``a`` against ``b`` on their confirmation rounds (the quiet ones where any was busy)."""
        x, y = self.arm(a), self.arm(b)
        assert x is not None and y is not None, (a, b)
        return paired(x, y)

    @property
    def decided(self) -> bool:
        """The best was decided faster than every other measured model."""
        return bool(self.verdicts) and all(v.outcome == BETTER for v in self.verdicts)

    def summary(self) -> str:
        best = self.best
        paged = [a.label for a in self.arms if a.paging]
        if best is None and self.selected:
            how = "paged host RAM in" if self.selected in paged else "failed"
            return f"undecided: {self.selected} was selected, then {how} its confirmation rounds ({self.metric})"
        if best is None and paged:
            return (f"no model ran without paging host RAM ({', '.join(paged)}): none fits this machine's RAM as "
                    "tuned")
        if best is None:
            why = "; ".join(f"{a.label}: {a.failure}" for a in self.arms if a.failure)
            return "no model could be measured" + (f" ({why})" if why else "")
        if len(self.arms) < 2 or not self.verdicts:
            if paged:
                return (f"{best.label} was the only model measured without paging host RAM ({', '.join(paged)} "
                        "paged: not a line to run on this machine as tuned)")
            return f"{best.label} was the only model measured"
        if self.decided:
            how = " in rounds that did not select it" if self.selected else ""
            return f"{best.label} is faster than every other model here{how} (by {self.metric})"
        faster = [v.b for v in self.verdicts if v.outcome == WORSE]
        open_ = [v.b for v in self.verdicts if v.outcome == UNDECIDED]
        chosen = "was selected (the best median of the selection rounds)" if self.selected else "had the best median"
        parts = ([f"was not shown faster than {', '.join(open_)}"] if open_ else []) + \
            ([f"{', '.join(faster)} measured faster in the fresh rounds"] if faster else [])
        return f"undecided: {best.label} {chosen}, but {'; '.join(parts)} (by {self.metric})"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "arms": [a.to_dict() for a in self.arms],
                "verdicts": [v.to_dict() for v in self.verdicts], "best": self.best.label if self.best else None,
                "selected": self.selected, "decided": self.decided, "summary": self.summary(),
                "vram_budget_bytes": self.vram_budget_bytes}


# The finish's rule: 2 selection rounds over every model, then the selected model and every other in 3 fresh
# confirmation rounds, a 4th while a verdict is undecided.
ROUNDS = decide.Rounds()
SELECT, CONFIRM = "selection", "confirmation"


def _runnable(arms: Sequence[Arm], budget_bytes: int | None = None) -> list[Arm]:
    """The measured models that never paged host RAM and kept the VRAM budget: the only ones a comparison may crown."""
    return [a for a in arms if a.score is not None and not a.paging and a.budget_words(budget_bytes) is None]


def _best(arms: Sequence[Arm], selected: str | None, budget_bytes: int | None = None) -> Arm | None:
    ok = _runnable(arms, budget_bytes)
    if selected is not None:
        return next((a for a in ok if a.label == selected), None)
    return max(ok, key=lambda a: a.score or 0.0) if ok else None


def verdicts_of(arms: Sequence[Arm], selected: str | None = None, budget_bytes: int | None = None
                ) -> tuple[Verdict, ...]:
    """The best (``selected``, else the best median) against every other measured model that did not page host RAM
    and kept the VRAM budget, on their confirmation rounds."""
    ok = _runnable(arms, budget_bytes)
    best = _best(arms, selected, budget_bytes)
    if len(ok) < 2 or best is None:
        return ()
    return tuple(paired(best, a) for a in ok if a is not best)


def paired(x: Arm, y: Arm) -> Verdict:
    """``x`` against ``y`` on the rounds both ran, paired by round number (by position for records written before
    rounds were numbered), the rounds either found disturbed left out as busy."""
    if any(r.number == 0 for r in (*x.rounds, *y.rounds)):
        return compare_quiet(x.label, y.label, x.scores, y.scores, x.quiet_scores(), y.quiet_scores())
    by_y = {r.number: r for r in y.rounds}
    both = [(r, by_y[r.number]) for r in x.rounds if r.number in by_y]
    return compare_quiet(x.label, y.label, [a.score for a, _ in both], [b.score for _, b in both],
                         [None if x.noise_of(a) else a.score for a, _ in both],
                         [None if y.noise_of(b) else b.score for _, b in both])


def metric_of(load: Workload, agent: bool) -> str:
    if agent:
        return "agent session time (every turn, request sent to last token)"
    if load.concurrency > 1:
        return f"aggregate generated tok/s with every slot busy ({load.concurrency} users)"
    return f"end-to-end request time (P={load.prompt_tokens}, G={load.gen_tokens})"


def head_to_head(loc: EngineLocation, lines: Sequence[tuple[str, LaunchConfig]], load: Workload, *, log_dir: Path,
                 caps: Capabilities | None = None, rounds: decide.Rounds = ROUNDS,
                 session: tuple[Path | None, int | None, int, int] | None = None,
                 on_step: Callable[[str], None] | None = None,
                 engines: Mapping[str, tuple[EngineLocation, Capabilities | None]] | None = None,
                 vram_budget_bytes: int | None = None,
                 settled_by: Callable[[HeadToHead], bool] | None = None,
                 out_by: Callable[[HeadToHead], Collection[str]] | None = None,
                 pages_by_plan: Mapping[str, str] | None = None, sent: Workload | None = None,
                 on_round: Callable[[str, Round, float], None] | None = None) -> HeadToHead:
    """Every model's tuned line once per round, the order rotating: ``rounds.select`` selection rounds choose the
    best median, then ``rounds.min`` fresh rounds and more (up to ``rounds.max``) judge it against every other
    until decided. ``session`` (file, depth, gen tokens, agents): replay an agent session instead of single
    requests. ``engines``: the engine each line runs on, by label, where the lines are not all ``loc``'s (the
    engines' head-to-head: :mod:`tuner.versus.engines`). ``vram_budget_bytes``: a line that grows the card's use past
    it, or whose VRAM a round did not read, is never crowned. ``settled_by``: when the rounds may stop (asked after
    each confirmation round from ``rounds.min`` on, with the rounds so far); default: the best decided against every
    other. ``out_by``: the lines the rounds so far put out of the running (asked before each round after the first):
    they are not measured again (and measured again should a later round let them back). ``pages_by_plan``: why the
    plan says a line does not fit the RAM free, by label (one paging round then rules it out). ``sent``: what each
    round sends (default: the workload's request, :func:`tuner.search.finish.server_load`). ``on_round``: told each
    line's round as it ends, with its seconds."""
    configs = dict(lines)
    labels = [label for label, _ in lines]
    n_select = rounds.select if len(labels) >= 2 else 0
    runs: dict[str, dict[str, list[Round]]] = {phase: {x: [] for x in labels} for phase in (SELECT, CONFIRM)}
    failed: dict[str, str] = {}
    sent = sent or server_load(load)
    makers = session_mod.session_makers(*session) if session else None
    what = "session" if session else f"request ({sent.prompt_tokens} prompt tokens, {sent.gen_tokens} generated)"
    chosen: list[str] = []

    def measure(label: str, r: int) -> decide.Obs:
        cfg = configs[label]
        phase = SELECT if r <= n_select else CONFIRM
        if on_step:
            which = f"round {r} ({phase})" if n_select else f"round {r} of {rounds.min}-{max(rounds.min, rounds.max)}"
            on_step(f"{which}: {label} ({flags.launch_line(cfg)})")
        where, its_caps = (engines or {}).get(label, (loc, caps))
        t0 = time.monotonic()
        with activity.while_doing(f"round {r}: {label}, its server loading then its {what}"):
            w = watched_round(cfg, label, f"round {r}",
                              lambda: _trial(where, cfg, sent, makers, session, log_dir / f"round{r}", its_caps),
                              on_step)
        if w.failure is not None:
            failed[label] = w.failure.summary()
        got = replace(_round(w.value, load) if w.value is not None else Round(None), noise=w.noise, number=r)
        runs[phase][label].append(got)
        if on_round is not None:
            on_round(label, got, time.monotonic() - t0)
        return got.score, got.noise

    def arms() -> list[Arm]:
        return [Arm(label, flags.launch_line(cfg), tuple(runs[CONFIRM][label]), failed.get(label),
                    tuple(runs[SELECT][label]), (pages_by_plan or {}).get(label)) for label, cfg in lines]

    def to_confirm(sel: dict[str, list[decide.Obs]]) -> list[str]:
        best = decide.best(sel, labels, lambda x: not any(r.host_paging for r in runs[SELECT][x]))
        measured = [x for x in labels if any(s is not None for s, _ in sel[x])]
        if best is None or len(measured) < 2:
            return []  # nothing to judge: the one model measured, or none
        chosen.append(best)
        if on_step:
            on_step(f"selected: {best} (the best median of {n_select} selection rounds); fresh rounds judge it")
        return measured

    def settled(_: dict[str, list[decide.Obs]]) -> bool:
        so_far = arms()
        if settled_by is not None:
            sel = chosen[0] if chosen else None
            return settled_by(HeadToHead(tuple(so_far), metric_of(load, session is not None),
                                         verdicts_of(so_far, sel, vram_budget_bytes), sel, vram_budget_bytes))
        return all(v.outcome != UNDECIDED for v in verdicts_of(so_far, chosen[0] if chosen else None,
                                                                vram_budget_bytes))

    def out_of_it() -> Collection[str]:
        if out_by is None:
            return ()
        gone = set(out_by(HeadToHead(tuple(arms()), metric_of(load, session is not None), (), None,
                                     vram_budget_bytes)))
        for label in sorted(gone - said_out):
            if on_step:
                on_step(f"{label} is out of the running: not measured again")
        for label in sorted(said_out - gone):
            if on_step:
                on_step(f"{label} is back in the running (the line it was decided slower than is out): measured again")
        said_out.clear()
        said_out.update(gone)
        return gone

    said_out: set[str] = set()
    decide.two_phase(labels, labels, measure, replace(rounds, select=n_select), to_confirm=to_confirm,
                     settled=settled, out_of_it=out_of_it)
    done = arms()
    selected = chosen[0] if chosen else None
    return HeadToHead(tuple(done), metric_of(load, session is not None), verdicts_of(done, selected, vram_budget_bytes),
                      selected, vram_budget_bytes)


def _trial(loc: EngineLocation, cfg: LaunchConfig, sent: Workload, makers: list[Any] | None,
           session: tuple[Path | None, int | None, int, int] | None, log_dir: Path,
           caps: Capabilities | None) -> bench.ServerTrial | session_run.SessionTrial:
    if makers is not None and session is not None:
        return session_run.run_session_trial(loc, cfg, makers, session[2], log_dir=log_dir, caps=caps)
    return bench.run_server_trial(loc, cfg, replace(sent, concurrency=cfg.parallel or 1), log_dir=log_dir, caps=caps)


def _round(trial: bench.ServerTrial | session_run.SessionTrial, load: Workload) -> Round:
    """One round's figures and its paging verdict (already judged against what the watch saw)."""
    paging = trial.host_paging
    evidence = paging.describe() if paging.paging else None
    kind = paging.kind.value if paging.measured else NOT_MEASURED_WORDS
    if isinstance(trial, session_run.SessionTrial):
        res = trial.result
        return Round(res.score(), ttft_s=res.median_ttft_s, session_s=res.session_s, host_paging=evidence,
                     paging_verdict=kind, vram_growth_bytes=trial.vram_growth_bytes)
    first = trial.levels[0]
    grew = vram_growth_bytes(trial.memory.vram_peak_bytes, trial.memory.vram_baseline_bytes)
    return Round(round_score(trial.levels, load), gen_tok_s=first.per_request_gen_tok_s,
                 prompt_tok_s=first.per_request_prompt_tok_s, ttft_s=first.ttft_s, host_paging=evidence,
                 paging_verdict=kind, vram_growth_bytes=grew)
