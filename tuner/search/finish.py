"""The finish: the top candidates and the baselines measured again with llama-server at the chosen context and
slots — the configuration the user will actually run — and the rule that picks the printed line.

Baselines (:mod:`tuner.search.known_good`): ``default`` is ``llama-server -m MODEL -c CTX -np N`` (llama.cpp's
defaults, which include its own ``--fit on``) when the budget is all the free VRAM; ``fit`` is what
``llama-fit-params`` prints for that launch under ``-fitt`` from the budget, made explicit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.stats import cv_pct
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine.sampler import PagingKind
from tuner.measure import bench, failures
from tuner.measure.workload import LevelResult, Workload
from tuner.plan.roofline import Roofline
from tuner.quality.kv_price import KvPrice
from tuner.search import decide
from tuner.search.known_good import (  # noqa: F401 - re-exported: callers know them as finish.*
    FIT_MARGIN_MIB,
    baseline_configs,
    bounded_default,
    default_config,
    fit_config,
    fit_target_mib,
    own_choice,
    seed_configs,
)
from tuner.search.verdict import BETTER, UNDECIDED, WORSE, Verdict, compare, compare_quiet
from tuner.search.watched_round import shown_line, watched_round


def vram_growth_bytes(peak_bytes: int | None, baseline_bytes: int | None) -> int | None:
    """A run's own VRAM: how far the card's use grew over the sampler's first look (taken before the server
    started); None without both figures."""
    return None if peak_bytes is None or baseline_bytes is None else max(0, peak_bytes - baseline_bytes)


# -------------------------------------------------------------------------------------------- finish


@dataclass(frozen=True, slots=True)
class ServerMeasurement:
    """One config measured with llama-server under the user's workload, over interleaved rounds."""

    label: str  # "candidate-1", "candidate-1 np2", "default", "fit"
    config: dict[str, Any]
    launch_line: str
    argv: list[str]
    gen_tok_s: float | None  # per request at concurrency 1 (median over rounds)
    gen_samples_tok_s: list[float]  # per round
    gen_cv_pct: float | None  # across rounds
    prompt_tok_s: float | None
    ttft_s: float | None
    aggregate_gen_tok_s: float | None  # at the arm's slot count, generation wall time only
    rss_peak_bytes: int | None = None
    vram_peak_bytes: int | None = None
    spill: str | None = None
    tokens_per_joule: float | None = None
    roofline_pct: float | None = None
    failure: dict[str, Any] | None = None
    trial_number: int | None = None
    slots: int = 1
    loaded_gen_tok_s: float | None = None  # per request with every slot busy
    end_to_end_gen_tok_s: float | None = None  # generated tokens per second of wall time, prompts included
    scores: list[float | None] = field(default_factory=list)  # the workload's score per round
    kld_mean: float | None = None  # quality cost of the config's KV pair (vs f16 KV); None: not priced
    same_top_pct: float | None = None
    # Per round (aligned with ``scores``): what else kept the machine busy, None when it was quiet.
    interference: list[str | None] = field(default_factory=list)
    quiet_gen_samples_tok_s: list[float] = field(default_factory=list)  # per quiet round that measured
    # The line's own VRAM: the most the card's use grew over the sampler's first look, taken before the server
    # started (``vram_peak_bytes`` is the whole card's, a desktop's and the driver's share included). None: no GPU,
    # or a result written before it was kept.
    vram_growth_bytes: int | None = None
    # Host RAM (tuner.machine.sampler.paging_verdict): "host_paging" when any round read the model back from disk
    # while it generated, with that round's evidence and what to change; such a config is never the printed line.
    host_paging: str | None = None
    host_paging_evidence: str | None = None
    # The median prompt speed as a share of the link bound for host weights copied per ubatch (tuner.plan.roofline);
    # None where no such bound applies (every weight on the card, op offload off).
    prompt_roofline_pct: float | None = None

    @property
    def paging(self) -> bool:
        return self.host_paging == PagingKind.HOST_PAGING.value

    def quiet_scores(self) -> list[float | None]:
        """The scores of the rounds measured on a quiet machine (None for a disturbed round)."""
        busy = self.interference
        return [None if i < len(busy) and busy[i] else s for i, s in enumerate(self.scores)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServerMeasurement:
        return cls(**d)


def _median(xs: Sequence[float | None]) -> float | None:
    ok = [x for x in xs if x is not None]
    return statistics.median(ok) if ok else None


def server_load(load: Workload) -> Workload:
    """What a server trial sends for ``load``: with a history deeper than the prompt, the whole history is the
    prompt (so generation happens at the workload's depth); the score still charges only the new prompt."""
    return replace(load, prompt_tokens=load.gen_depth, depth_tokens=None)


def round_score(levels: Sequence[LevelResult], load: Workload) -> float | None:
    """One round's score: requests per second for one user, or for concurrent workloads the generated tokens
    per second of wall time with every slot busy (prompts and queueing included)."""
    if not levels:
        return None
    if load.concurrency > 1:
        return levels[-1].end_to_end_gen_tok_s or None
    first = levels[0]
    return load.score(first.per_request_prompt_tok_s, first.per_request_gen_tok_s)


def summarize(label: str, cfg: LaunchConfig, runs: Sequence[bench.ServerTrial | failures.Failure], load: Workload,
              *, roofline_tok_s: float | None = None, prompt_roofline_tok_s: float | None = None,
              trial_number: int | None = None,
              kld: KvPrice | None = None, noise: Sequence[str | None] = ()) -> ServerMeasurement:
    """An arm's rounds as one measurement: medians over rounds, the per-round scores kept for the verdict."""
    from tuner.search.study import config_to_dict

    line = shown_line(cfg)
    ok = [t for t in runs if isinstance(t, bench.ServerTrial)]
    quality: dict[str, Any] = {"kld_mean": kld.kld_mean, "same_top_pct": kld.same_top_pct} if kld else {}
    quality["interference"] = list(noise)
    quality["quiet_gen_samples_tok_s"] = [t.levels[0].per_request_gen_tok_s for i, t in enumerate(runs)
                                          if isinstance(t, bench.ServerTrial) and not (i < len(noise) and noise[i])]
    if not ok:
        failed = next(f for f in runs if isinstance(f, failures.Failure))
        return ServerMeasurement(label, config_to_dict(cfg), line, [], None, [], None, None, None, None,
                                 failure=failed.to_dict(), trial_number=trial_number, slots=cfg.parallel or 1,
                                 scores=[None] * len(runs), **quality)
    samples = [t.levels[0].per_request_gen_tok_s for t in ok]
    gen = _median(samples)
    prompt = _median([t.levels[0].per_request_prompt_tok_s for t in ok])
    if prompt and prompt_roofline_tok_s:
        quality["prompt_roofline_pct"] = 100 * prompt / prompt_roofline_tok_s
    last = ok[-1]
    paged = next((t.host_paging for t in ok if t.host_paging.paging), last.host_paging)
    quality |= {"host_paging": paged.kind.value, "host_paging_evidence": paged.describe()}
    return ServerMeasurement(
        label, config_to_dict(cfg), line, list(last.argv), gen, samples, cv_pct(samples),
        prompt, _median([t.levels[0].ttft_s for t in ok]),
        _median([t.levels[-1].aggregate_gen_tok_s for t in ok]), max(t.memory.rss_peak_bytes or 0 for t in ok) or None,
        max(t.memory.vram_peak_bytes or 0 for t in ok) or None, last.spill.kind.value, last.tokens_per_joule,
        100 * gen / roofline_tok_s if roofline_tok_s and gen else None, None, trial_number, cfg.parallel or 1,
        _median([t.levels[-1].per_request_gen_tok_s for t in ok]),
        _median([t.levels[-1].end_to_end_gen_tok_s for t in ok]),
        [round_score(t.levels, load) if isinstance(t, bench.ServerTrial) else None for t in runs], **quality,
        vram_growth_bytes=max((g for t in ok if (g := vram_growth_bytes(t.memory.vram_peak_bytes,
                                                                        t.memory.vram_baseline_bytes)) is not None),
                              default=None),
    )


@dataclass(frozen=True, slots=True)
class Decision:
    """Which line is printed, and why: the best candidate enters it only when decided better than llama.cpp's own
    choice in rounds that did not select it (:mod:`tuner.search.decide`)."""

    shipped: ServerMeasurement | None  # the arm whose launch line is printed (None: nothing could be measured)
    best: ServerMeasurement | None  # the best candidate of the selection rounds (None: no candidate was measured)
    reason: str
    verdicts: tuple[Verdict, ...] = ()

    @property
    def taken(self) -> bool:
        """The best candidate is the printed line (it was decided better than the reference)."""
        return self.best is not None and self.shipped is not None and self.shipped.label == self.best.label


@dataclass(frozen=True, slots=True)
class Finish:
    # The table: every arm as measured in the selection rounds (or, with one candidate, in every round).
    candidates: tuple[ServerMeasurement, ...]
    baselines: tuple[ServerMeasurement, ...]
    # The workload's request shape: with both known, configs are judged by the time a whole request takes
    # (prompt processing plus generation), so a config cannot win on tg while losing more on pp.
    prompt_tokens: int = 0
    gen_tokens: int = 0
    concurrency: int = 1
    min_tok_s: float | None = None  # per-request generation floor with every slot busy
    # Fresh rounds after the selection: the baselines and the selected candidate measured again (empty: one
    # candidate, so the table's rounds were all confirmation rounds).
    confirmation: tuple[ServerMeasurement, ...] = ()
    selected: str | None = None  # the candidate the selection rounds chose (None: the table's best, see select())
    # Speculation judged on the printed line after the finish: its ``none`` arm and its best arm, in fresh rounds.
    speculation: tuple[ServerMeasurement, ...] = ()
    # The VRAM budget the arms were measured under (None: none set, or no GPU): an arm whose own VRAM broke it is
    # never printed.
    vram_budget_bytes: int | None = None

    def score(self, m: ServerMeasurement) -> float | None:
        """Higher is better: the median of the per-round scores (see :func:`round_score`); for measurements
        without rounds, requests per second from the medians (or generation tok/s when pp is unknown)."""
        if m.gen_tok_s is None:
            return None
        if m.scores:
            return _median(m.scores)
        if self.prompt_tokens and self.gen_tokens and m.prompt_tok_s:
            return 1.0 / (self.prompt_tokens / m.prompt_tok_s + self.gen_tokens / m.gen_tok_s)
        return m.gen_tok_s

    def rank(self, m: ServerMeasurement) -> float | None:
        """What the selection ranks by: the median over quiet rounds (every round when none was quiet)."""
        if m.gen_tok_s is None:
            return None
        if m.scores:
            return decide.quiet_median(decide.observations(m.scores, m.interference))
        return self.score(m)

    @property
    def metric(self) -> str:
        if self.concurrency > 1:
            floor = f", per request >= {self.min_tok_s:g} tok/s" if self.min_tok_s else ""
            return f"aggregate generated tok/s with every slot busy, prompts included ({self.concurrency} users{floor})"
        if self.prompt_tokens and self.gen_tokens:
            return f"end-to-end request time (P={self.prompt_tokens}, G={self.gen_tokens})"
        return "generation tok/s"

    def over_budget(self, m: ServerMeasurement) -> bool:
        """The arm's own VRAM (its growth over the sampler's first look, as the spill verdict counts it) broke the
        budget it was measured under."""
        return (self.vram_budget_bytes is not None and m.vram_growth_bytes is not None
                and m.vram_growth_bytes > self.vram_budget_bytes)

    def vram_unknown(self, m: ServerMeasurement) -> bool:
        """Measured under a VRAM budget with no reading of the arm's own VRAM (NVML gave no figure): whether it kept
        the budget is not known, so it is never taken as kept (the session stage's rule, ArmSessions.vram_unknown)."""
        return self.vram_budget_bytes is not None and m.gen_tok_s is not None and m.vram_growth_bytes is None

    def eligible(self, m: ServerMeasurement) -> bool:
        """Measured, not paging host RAM, known to be within the VRAM budget, and each user still gets at least
        --min-tok-s."""
        if self.score(m) is None or m.paging or self.over_budget(m) or self.vram_unknown(m):
            return False
        per_request = m.loaded_gen_tok_s if m.loaded_gen_tok_s is not None else m.gen_tok_s
        return self.min_tok_s is None or (per_request or 0.0) >= self.min_tok_s

    def verdict(self, a: ServerMeasurement, b: ServerMeasurement) -> Verdict:
        """Judged on the rounds where the machine was quiet for both arms: a disturbed round decides nothing."""
        if a.scores and b.scores:
            return compare_quiet(a.label, b.label, a.scores, b.scores, a.quiet_scores(), b.quiet_scores())
        sa, sb = self.score(a), self.score(b)
        return compare(a.label, b.label, [sa], [sb])  # one figure each: never decided

    def judged(self, label: str) -> ServerMeasurement | None:
        """The measurement verdicts use: from the confirmation rounds when there were any, else from the table
        (never one arm from each: their rounds would not pair)."""
        pool = self.confirmation or (*self.candidates, *self.baselines)
        return next((m for m in pool if m.label == label), None)

    def select(self) -> ServerMeasurement | None:
        """The best eligible candidate of the table (what the selection rounds chose)."""
        if self.selected is not None:
            return next((m for m in self.candidates if m.label == self.selected), None)
        ok = [m for m in self.candidates if self.eligible(m)]
        return max(ok, key=lambda m: self.rank(m) or 0.0) if ok else None

    def lossless_alternative(self, best: ServerMeasurement) -> ServerMeasurement | None:
        """For a lossy best candidate: the best lossless one beside it (it must beat that too)."""
        if not best.kld_mean:
            return None
        ok = [m for m in self.candidates if m is not best and not m.kld_mean and self.eligible(m)]
        return max(ok, key=lambda m: self.rank(m) or 0.0) if ok else None

    def to_confirm(self) -> list[str]:
        """The arms of the confirmation rounds: the measured baselines, the selected candidate and, when it is
        lossy, the best lossless candidate."""
        best = self.select()
        if best is None:
            return []
        alt = self.lossless_alternative(best)
        return [m.label for m in self.baselines if self.score(m) is not None] + [best.label] + (
            [alt.label] if alt else [])

    @property
    def own(self) -> str:
        """Whose own choice the baselines are: the engine their lines run on (llama.cpp, or ik_llama.cpp)."""
        return next((str(m.config.get("engine") or "llama.cpp") for m in self.baselines), "llama.cpp")

    @property
    def reference(self) -> ServerMeasurement | None:
        """llama.cpp's own choice: the default launch, or --fit's placement made explicit when the default failed."""
        for label in ("default", "fit"):
            m = self.judged(label)
            if m is not None and self.score(m) is not None and not self.over_budget(m):
                return m
        return None

    @property
    def decision(self) -> Decision:
        """The launch-line rule (docs/how-it-decides.md): the best candidate is printed only when its verdict
        against the reference, on rounds that did not select it, is "better"; otherwise llama.cpp's own choice.
        Speculation joins the same way: only when decided faster than the printed line without it."""
        d = self._candidate_decision()
        if len(self.speculation) != 2 or d.shipped is None:
            return d
        none, spec = self.speculation
        v = self.verdict(spec, none)
        if v.outcome == BETTER and none.config == d.shipped.config and not self.over_budget(spec):
            return replace(d, shipped=spec, reason=f"{d.reason}; {spec.label} was decided faster than the line "
                                                   "without it", verdicts=(*d.verdicts, v))
        return replace(d, verdicts=(*d.verdicts, v))

    def _candidate_decision(self) -> Decision:
        ref, chosen = self.reference, self.select()
        best = self.judged(chosen.label) if chosen is not None else None
        if best is None or not self.eligible(best):
            if ref is not None and ref.paging:
                return Decision(None, best, f"no line: {self.own}'s own choice ({ref.label}) pages host RAM and no "
                                            f"candidate was measured without paging: {ref.host_paging_evidence}")
            if ref is None:
                return Decision(None, best, "nothing could be measured: see the failures")
            measured = (m for m in self.candidates if self.score(m) is not None)  # none eligible: say why the fastest
            lost = best if chosen is not None else max(measured, key=lambda m: self.rank(m) or 0.0, default=None)
            if lost is None:
                why = "no candidate could be measured" if chosen is None else f"{chosen.label} failed its confirmation"
            else:
                why = f"{lost.label} " + (
                    f"paged host RAM ({lost.host_paging_evidence})" if lost.paging else
                    "broke the VRAM budget" if self.over_budget(lost) else
                    "had its VRAM unsampled (not known to keep the VRAM budget)" if self.vram_unknown(lost) else
                    "misses --min-tok-s per request" if self.score(lost) is not None else "failed its confirmation")
            return Decision(ref, best, f"{why}: {self.own}'s own choice ({ref.label}) is printed")
        if ref is None or not self.eligible(ref):
            broke = [m.label for m in map(self.judged, ("default", "fit")) if m is not None and self.over_budget(m)]
            miss = ("pages host RAM" if ref is not None and ref.paging else
                    "misses --min-tok-s per request" if ref is not None else
                    f"broke the VRAM budget ({', '.join(broke)})" if broke else "could not be measured")
            return Decision(best, best, f"{self.own}'s own choice {miss}: {best.label} is printed")
        verdicts = [self.verdict(best, ref)]
        shipped, reason = best, f"{best.label} was decided faster than {ref.label}"
        if verdicts[0].outcome != BETTER:
            how = "slower than" if verdicts[0].outcome == WORSE else "not shown faster than"
            shipped, reason = ref, (f"{best.label} was the best candidate but {how} {ref.label} in the confirmation "
                                    f"rounds: {self.own}'s own choice is printed")
        alt_of = self.lossless_alternative(chosen) if chosen is not None else None
        alt = self.judged(alt_of.label) if alt_of is not None else None
        if shipped is best and alt is not None and self.eligible(alt):
            verdicts.append(self.verdict(best, alt))
            if verdicts[-1].outcome != BETTER:
                verdicts.append(self.verdict(alt, ref))
                shipped, reason = (alt, f"{best.label} (lossy KV) was not shown faster than the lossless {alt.label}, "
                                   f"which was decided faster than {ref.label}") if verdicts[-1].outcome == BETTER \
                    else (ref, f"{best.label} (lossy KV) was not shown faster than the lossless {alt.label}, nor was "
                               f"{alt.label} than {ref.label}: {self.own}'s own choice is printed")
        pool = self.confirmation or (*self.candidates, *self.baselines)
        verdicts += [self.verdict(shipped, m) for m in pool if m.label in {b.label for b in self.baselines}
                     and m is not shipped and m is not ref and self.score(m) is not None]
        return Decision(shipped, best, reason, tuple(verdicts))

    @property
    def winner(self) -> ServerMeasurement | None:
        """The config to launch (:attr:`decision`)."""
        return self.decision.shipped

    @property
    def verdicts(self) -> list[Verdict]:
        """The verdicts the decision rests on: the best candidate against the reference (and a lossless
        alternative), the printed line against the other baselines, speculation against the line without it."""
        return list(self.decision.verdicts)

    def speedup(self, baseline: str) -> float | None:
        """The printed line's score over a baseline's (see :attr:`metric`), from rounds both were measured in."""
        w = self.winner
        b = self.judged(baseline)
        if w is None or b is None or self.score(b) is None:
            return None
        if w.label == baseline:
            return 1.0
        mine = self.judged(w.label)
        if mine is None:
            return None
        v = self.verdict(mine, b)
        return v.ratio if v.rounds else None

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {"candidates": [c.to_dict() for c in self.candidates],
                "baselines": [b.to_dict() for b in self.baselines],
                "confirmation": [c.to_dict() for c in self.confirmation], "selected": self.selected,
                "speculation": [s.to_dict() for s in self.speculation],
                "prompt_tokens": self.prompt_tokens, "gen_tokens": self.gen_tokens,
                "concurrency": self.concurrency, "min_tok_s": self.min_tok_s,
                "vram_budget_bytes": self.vram_budget_bytes,
                "decision": {"shipped": d.shipped.label if d.shipped else None,
                             "best": d.best.label if d.best else None, "taken": d.taken, "reason": d.reason},
                "verdicts": [v.to_dict() for v in d.verdicts]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finish:
        def arms(key: str) -> tuple[ServerMeasurement, ...]:
            return tuple(ServerMeasurement.from_dict(x) for x in d.get(key) or [])

        return cls(arms("candidates"), arms("baselines"), int(d.get("prompt_tokens", 0)), int(d.get("gen_tokens", 0)),
                   int(d.get("concurrency", 1)), d.get("min_tok_s"), arms("confirmation"), d.get("selected"),
                   arms("speculation"), d.get("vram_budget_bytes"))


Rounds = decide.Rounds
DEFAULT_ROUNDS = Rounds()  # 2 selection rounds, then 3 confirmation rounds and a 4th while undecided


def _ceiling(roofline_of: Callable[[LaunchConfig], Roofline | None] | None, cfg: LaunchConfig
             ) -> tuple[float | None, float | None]:
    """(generation, prompt) ceilings of ``cfg`` in tok/s, None where unknown."""
    roof = roofline_of(cfg) if roofline_of else None
    return (roof.gen_tok_s or None, roof.prompt_tok_s) if roof else (None, None)


def finish(loc: EngineLocation, candidates: Sequence[tuple[int, LaunchConfig]],
           baselines: Sequence[tuple[str, LaunchConfig]], load: Workload, *, log_dir: Path,
           caps: Capabilities | None = None, roofline_of: Callable[[LaunchConfig], Roofline | None] | None = None,
           kld_of: Callable[[LaunchConfig], KvPrice | None] | None = None, slots: Sequence[int] = (1,),
           min_tok_s: float | None = None, rounds: Rounds = DEFAULT_ROUNDS,
           on_step: Callable[[str], None] | None = None, vram_budget_bytes: int | None = None) -> Finish:
    """Measure baselines and candidates with llama-server in two phases (:func:`tuner.search.decide.two_phase`):
    selection rounds over every arm when several candidates compete, then the baselines and the selected candidate
    in fresh confirmation rounds until its verdicts are decided or the rounds run out. An arm whose server fails to
    start in its first round is not measured again."""
    arms = [(label, cfg, None) for label, cfg in baselines] + decide.slot_arms(candidates, slots)
    by_label = {label: (cfg, num) for label, cfg, num in arms}
    runs: dict[str, dict[str, list[bench.ServerTrial | failures.Failure]]] = {SELECT: {}, CONFIRM: {}}
    noise: dict[str, dict[str, list[str | None]]] = {SELECT: {}, CONFIRM: {}}
    sent = server_load(load)

    def measure(label: str, r: int, phase: str) -> decide.Obs:
        cfg = by_label[label][0]
        if on_step:
            on_step(f"round {r} ({phase}): llama-server {label} ({shown_line(cfg)})")
        got = watched_round(cfg, label, f"round {r}", lambda: bench.run_server_trial(
            loc, cfg, replace(sent, concurrency=cfg.parallel or 1), log_dir=log_dir, caps=caps,
            roofline_tok_s=_ceiling(roofline_of, cfg)[0], vram_budget_bytes=vram_budget_bytes), on_step)
        run = got.value if got.value is not None else got.failure
        assert run is not None  # a round either measured or failed
        runs[phase].setdefault(label, []).append(run)
        noise[phase].setdefault(label, []).append(got.noise)
        return (round_score(got.value.levels, load) if got.value is not None else None), got.noise

    def table(phase: str) -> Finish:
        done = [summarize(label, cfg, runs[phase][label], load, roofline_tok_s=_ceiling(roofline_of, cfg)[0],
                          prompt_roofline_tok_s=_ceiling(roofline_of, cfg)[1], trial_number=num,
                          kld=kld_of(cfg) if kld_of else None, noise=noise[phase][label])
                for label, cfg, num in arms if label in runs[phase]]
        return Finish(tuple(m for m in done if m.label.startswith("candidate")),
                      tuple(m for m in done if not m.label.startswith("candidate")), load.prompt_tokens,
                      load.gen_tokens, load.concurrency, min_tok_s, vram_budget_bytes=vram_budget_bytes)

    return two_phase_finish([label for label, _, _ in arms], measure, table, rounds)


SELECT, CONFIRM = "selection", "confirmation"


def two_phase_finish(labels: Sequence[str], measure: Callable[[str, int, str], decide.Obs],
                     table: Callable[[str], Finish], rounds: Rounds) -> Finish:
    """The finish's rounds and rule, whatever measures them: ``measure(label, round, phase)`` measures one arm once
    (``phase`` is :data:`SELECT` or :data:`CONFIRM`); ``table(phase)`` is that phase's arms so far as a Finish.
    Selection when two or more candidates compete; then the baselines, the selected candidate (and a lossless
    alternative to a lossy one) in fresh rounds until :attr:`Finish.verdicts` are decided or the rounds run out."""
    n_select = rounds.select if sum(x.startswith("candidate") for x in labels) >= 2 else 0

    def assembled() -> Finish:
        if not n_select:
            return table(CONFIRM)
        sel, conf = table(SELECT), table(CONFIRM)
        best = sel.select()
        return replace(sel, selected=best.label if best else None, confirmation=(*conf.baselines, *conf.candidates))

    decide.two_phase(labels, [x for x in labels if x.startswith("candidate")],
                     lambda label, r: measure(label, r, SELECT if r <= n_select else CONFIRM),
                     replace(rounds, select=n_select), to_confirm=lambda _: table(SELECT).to_confirm(),
                     settled=lambda _: all(v.outcome != UNDECIDED for v in assembled().verdicts))
    return assembled()
