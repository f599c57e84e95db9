"""The agent workload's last stage: whole sessions, scored by session time, decide the launch line.

llama-bench (the search) cannot send a second turn, so prompt reuse is judged here, on llama-server: the
engine's defaults (``default``), the finish's printed line (``tuned``, or ``default`` itself when the finish kept
llama.cpp's own choice), and that line with each prompt-reuse setting that applies to this model and engine
(:func:`tuner.search.space.reuse_arms`), each replaying the same session (the bundled one at the workload's depth,
or ``--session FILE``) in interleaved rounds. As in the finish (:mod:`tuner.search.decide`), a reuse setting enters
the launch line only when it was decided better than the line without it (the base), in rounds that did not
select it: with two or more reuse arms, :data:`SELECT_ROUNDS` rounds of every arm select the best, which is then
measured again beside the base and the defaults in fresh rounds. Arms the memory model says cannot fit (a full SWA
cache, more checkpoints) are never launched.

Both budgets hold here as in the finish: ``default`` is llama.cpp's bare launch told to leave what the VRAM budget
holds back (``-fitt``, :func:`tuner.search.known_good.bounded_default`) with the ``--cache-ram`` its placement needs
(an engine that does not fit the card by itself, ik_llama.cpp, runs its bare launch: its own placement), and an
arm whose own VRAM broke the budget in a round (sampled as the finish samples it), or that paged host RAM, is never
printed nor ranked. Nor is one measured under a budget without its VRAM sampled in every round it ran: unknown
is its own verdict (:attr:`ArmSessions.vram_unknown`), never read as within the budget.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import UnsupportedFlagError, UsageError
from tuner.core.machine_spec import Hardware
from tuner.engine import flags
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine.sampler import PagingVerdict
from tuner.measure import session as session_mod
from tuner.measure import session_run
from tuner.measure.session_run import Finding, SessionResult
from tuner.models.gguf_reader import ModelInfo
from tuner.search import decide, levers, space
from tuner.search.trials import config_to_dict
from tuner.search.verdict import BETTER, WORSE, Verdict, compare_quiet
from tuner.search.watched_round import shown_line, watched_round

DEFAULT_ROUNDS = 3
MIN_ROUNDS = 2  # with the one more an undecided verdict gets, the 3 a verdict needs (verdict.MIN_ROUNDS)


def check_rounds(rounds: int) -> None:
    """``--session-rounds``: 0 (no session stage) or enough rounds for a verdict; a stage that cannot decide would
    print a setting that was not decided."""
    if rounds != 0 and rounds < MIN_ROUNDS:
        raise UsageError(f"--session-rounds {rounds}: give 0 (no session stage) or {MIN_ROUNDS} or more: a verdict "
                         "needs 3 rounds (one more is measured while undecided)")
SELECT_ROUNDS = 2  # sessions per arm that choose among several reuse arms (they decide nothing)


@dataclass(frozen=True, slots=True)
class SessionRequest:
    session_file: Path | None = None  # --session: the user's own messages; None: the bundled session
    depth_tokens: int | None = None  # the bundled session's depth; None: session.DEFAULT_DEPTH
    gen_tokens: int = session_mod.DEFAULT_GEN_TOKENS  # generated per turn
    rounds: int = DEFAULT_ROUNDS  # confirmation rounds (one more while the verdict is undecided)
    agents: int = 1  # sessions replayed at once (-np 2: two agents); the score is their wall time


@dataclass(frozen=True, slots=True)
class ArmSessions:
    label: str
    config: LaunchConfig
    results: tuple[SessionResult | None, ...]  # one per round; None: that round failed
    failure: str | None = None
    finding: Finding | None = None
    # Per round (aligned with ``results``): what else kept the machine busy, None when it was quiet.
    interference: tuple[str | None, ...] = ()
    # Per round (aligned with ``results``): host RAM over the replay; None where the round failed.
    host_paging: tuple[PagingVerdict | None, ...] = ()
    # Per round (aligned with ``results``): the line's own VRAM (None: not sampled, or the round failed), and the
    # budget it was measured under (None: none set, or no GPU).
    vram_growth_bytes: tuple[int | None, ...] = ()
    vram_budget_bytes: int | None = None

    @property
    def over_budget(self) -> int | None:
        """The most VRAM the line took in a round, where that broke the budget (None: within it, or unknown)."""
        most = max((g for g in self.vram_growth_bytes if g is not None), default=None)
        budget = self.vram_budget_bytes
        return most if most is not None and budget is not None and most > budget else None

    @property
    def vram_unknown(self) -> bool:
        """Measured under a VRAM budget with a round whose VRAM was not sampled (no NVML reading of the line's own
        memory): whether it kept the budget is not known, so it is not taken as kept."""
        if self.vram_budget_bytes is None or self.over_budget is not None:
            return False
        n = len(self.results)
        growth = [*self.vram_growth_bytes[:n], *[None] * (n - len(self.vram_growth_bytes))]
        return any(r is not None and g is None for r, g in zip(self.results, growth, strict=True))

    @property
    def vram_verdict(self) -> str | None:
        """"over", "unknown" or "within" the budget it was measured under; None without a budget (no GPU)."""
        if self.vram_budget_bytes is None:
            return None
        return "over" if self.over_budget is not None else "unknown" if self.vram_unknown else "within"

    @property
    def paging(self) -> PagingVerdict | None:
        """A round that read the model back from disk while the session ran (such an arm is never the line)."""
        return next((v for v in self.host_paging if v is not None and v.paging), None)

    @property
    def scores(self) -> list[float | None]:
        return [r.score() if r is not None else None for r in self.results]

    def quiet_scores(self) -> list[float | None]:
        """The scores of the rounds measured on a quiet machine: a disturbed round decides nothing."""
        busy = self.interference
        return [None if i < len(busy) and busy[i] else s for i, s in enumerate(self.scores)]

    @property
    def median_session_s(self) -> float | None:
        times = [r.session_s for r in self.results if r is not None]
        return statistics.median(times) if times else None

    @property
    def typical_round(self) -> int | None:
        """The index of the round whose session time is the median (its per-turn table is the one shown)."""
        done = sorted((r.session_s, i) for i, r in enumerate(self.results) if r is not None)
        return done[(len(done) - 1) // 2][1] if done else None

    @property
    def typical(self) -> SessionResult | None:
        i = self.typical_round
        return None if i is None else self.results[i]

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "launch_line": shown_line(self.config),
                "config": config_to_dict(self.config),
                "median_session_s": self.median_session_s, "failure": self.failure,
                "rounds": [None if r is None else r.to_dict() for r in self.results],
                "typical_round": self.typical_round,
                "interference": list(self.interference),
                "host_paging": [None if v is None else v.to_dict() for v in self.host_paging],
                "paging": None if self.paging is None else self.paging.describe(),
                "vram_growth_bytes": list(self.vram_growth_bytes), "over_budget": self.over_budget,
                "vram_verdict": self.vram_verdict,
                "finding": None if self.finding is None else self.finding.describe()}


@dataclass(frozen=True, slots=True)
class SessionStage:
    arms: tuple[ArmSessions, ...]  # the selection rounds (with one reuse arm or none: every round)
    winner: str | None  # the arm whose line is printed
    verdict: Verdict | None  # the deciding one: the best reuse arm against its base (or the base against default)
    source: str
    notes: dict[str, str] = field(default_factory=dict)  # arms not launched, and why
    agents: int = 1
    confirmation: tuple[ArmSessions, ...] = ()  # fresh rounds of the defaults, the base and the selected arm
    best: str | None = None  # the best reuse arm of the selection
    reason: str = ""

    def arm(self, label: str) -> ArmSessions | None:
        """The arm as the decision judged it (its confirmation rounds when there were any)."""
        return next((a for a in (*self.confirmation, *self.arms) if a.label == label), None)

    def to_dict(self) -> dict[str, Any]:
        return {"metric": "session time (every turn, request sent to last token)", "source": self.source,
                "agents": self.agents,
                "winner": self.winner, "verdict": None if self.verdict is None else self.verdict.to_dict(),
                "verdict_text": None if self.verdict is None else self.verdict.describe(),
                "best": self.best, "reason": self.reason,
                "arms": [a.to_dict() for a in self.arms], "confirmation": [a.to_dict() for a in self.confirmation],
                "not_launched": self.notes}


def stage_arms(default: LaunchConfig, tuned: LaunchConfig, info: ModelInfo, hw: Hardware,
               caps: Capabilities | None, vram_margin_mib: float | None = None) -> tuple[list[tuple[str, LaunchConfig]],
                                                                                         dict[str, str]]:
    """``default``, ``tuned`` (when the finish printed another line than the default), and the base line (``tuned``,
    else ``default``) with each reuse setting that applies and fits, and with the op-offload threshold at its ubatch
    where its experts live in RAM beside a GPU (:func:`tuner.search.levers.session_threshold`)."""
    arms = [("default", default)]
    if tuned != default:
        arms.append(("tuned", tuned))
    base = base_label([label for label, _ in arms])
    notes: dict[str, str] = {}
    for arm in space.reuse_arms(info, lambda s: flags.server_accepts(caps, s), tuned.parallel or 1):
        cfg = arm.apply(tuned)
        try:  # a setting the line's engine does not read (ik: --cache-reuse) is no arm of its
            flags.launch_line(cfg)
        except UnsupportedFlagError as exc:
            notes[arm.label] = f"not launched: {exc}"
            continue
        if not space.reuse_fits(info, cfg, hw, vram_margin_mib):
            notes[arm.label] = "not launched: the memory model says it does not fit"
            continue
        arms.append((f"{base} + {arm.label}", cfg))
    threshold = levers.session_threshold(tuned, hw)
    if threshold is not None:  # short turns' experts on the CPU, full ubatches still copied up: same memory
        arms.append((f"{base} + op offload from {threshold} tokens", replace(tuned, op_offload_min_batch=threshold)))
    return arms, notes


def base_label(labels: Sequence[str]) -> str:
    """The line the reuse settings are added to: the finish's ``tuned`` line, or ``default`` when it kept that."""
    return "tuned" if "tuned" in labels else "default"


def reuse_labels(labels: Sequence[str]) -> list[str]:
    return [x for x in labels if x not in ("default", "tuned")]


def measure(loc: EngineLocation, arms: Sequence[tuple[str, LaunchConfig]], req: SessionRequest, info: ModelInfo, *,
            log_dir: Path, caps: Capabilities | None = None, on_step: Callable[[str], None] | None = None,
            vram_budget_bytes: int | None = None) -> tuple[list[ArmSessions], list[ArmSessions]]:
    """Selection rounds (with two or more reuse arms), then confirmation rounds of the defaults, the base and the
    selected reuse arm; every arm once per round, the order rotating, the same session for all. Returns the
    selection's arms (empty when there was none) and the confirmation's."""
    makers = session_mod.session_makers(req.session_file, req.depth_tokens, req.gen_tokens, req.agents)
    configs = dict(arms)
    labels = [label for label, _ in arms]
    reuse = reuse_labels(labels)
    n_select = SELECT_ROUNDS if len(reuse) >= 2 else 0
    results: dict[bool, dict[str, list[SessionResult | None]]] = {True: {}, False: {}}
    noise: dict[bool, dict[str, list[str | None]]] = {True: {}, False: {}}
    paged: dict[bool, dict[str, list[PagingVerdict | None]]] = {True: {}, False: {}}
    vram: dict[bool, dict[str, list[int | None]]] = {True: {}, False: {}}
    failed: dict[str, str] = {}

    def one(label: str, r: int) -> decide.Obs:
        selecting = r <= n_select
        phase = "selection" if selecting else "confirmation"
        if on_step:
            on_step(f"session round {r} ({phase}): {label}")
        # Watched as the finish's rounds are: a session measured while other work used the machine is kept
        # and shown, but decides nothing (ArmSessions.quiet_scores).
        got = watched_round(configs[label], label, f"session round {r}", lambda: session_run.run_session_trial(
            loc, configs[label], makers, req.gen_tokens, log_dir=log_dir / f"round{r}", caps=caps), on_step)
        if got.failure is not None:
            failed[label] = got.failure.summary()
        done = got.value.result if got.value is not None else None
        results[selecting].setdefault(label, []).append(done)
        noise[selecting].setdefault(label, []).append(got.noise)
        paged[selecting].setdefault(label, []).append(got.value.host_paging if got.value is not None else None)
        vram[selecting].setdefault(label, []).append(got.value.vram_growth_bytes if got.value is not None else None)
        if on_step and got.value is not None and got.value.host_paging.paging:
            on_step(f"session round {r}: {label} paged host RAM ({got.value.host_paging.evidence}): never the line")
        return (done.score() if done is not None else None), got.noise

    def arms_of(selecting: bool) -> list[ArmSessions]:
        return [ArmSessions(x, configs[x], tuple(results[selecting][x]), failed.get(x), None,
                            tuple(noise[selecting][x]), tuple(paged[selecting][x]), tuple(vram[selecting][x]),
                            vram_budget_bytes) for x in labels if x in results[selecting]]

    def to_confirm(_: dict[str, list[decide.Obs]]) -> list[str]:
        best = select(arms_of(True))
        base = base_label(labels)
        return [x for x in labels if x in ("default", base)] + ([best] if best else [])

    def settled(_: dict[str, list[decide.Obs]]) -> bool:
        stage = judge(arms_of(True), "", {}, confirmation=arms_of(False)) if n_select else judge(arms_of(False), "", {})
        return stage.verdict is None or stage.verdict.outcome in (BETTER, WORSE)

    decide.two_phase(labels, reuse, one, decide.Rounds(min=req.rounds, max=req.rounds + 1, select=n_select),
                     to_confirm=to_confirm, settled=settled)

    def diagnosed(arm: ArmSessions) -> ArmSessions:
        typical = arm.typical
        finding = session_run.diagnose(typical, info, arm.config) if typical is not None else None
        return replace(arm, finding=finding)

    selection = [diagnosed(a) for a in arms_of(True)]
    return selection, [diagnosed(a) for a in arms_of(False)]


def select(arms: Sequence[ArmSessions]) -> str | None:
    """The reuse arm with the shortest session over its quiet rounds (selection decides nothing); an arm that paged
    host RAM, broke the VRAM budget or is not known to have kept it is not chosen."""
    ok = [a for a in arms if a.paging is None and a.over_budget is None and not a.vram_unknown]
    return decide.best({a.label: decide.observations(a.scores, a.interference) for a in ok},
                       reuse_labels([a.label for a in ok]))


def usable(arm: ArmSessions | None) -> bool:
    """Measured, never read its model back from disk, within the VRAM budget (known to be): an arm the stage may
    print."""
    return (arm is not None and arm.median_session_s is not None and arm.paging is None and arm.over_budget is None
            and not arm.vram_unknown)


def _lost(arm: ArmSessions | None) -> str:
    """Why an arm cannot be printed, in words."""
    if arm is not None and arm.paging is not None:
        return "paged host RAM"
    if arm is not None and arm.over_budget is not None:
        return f"broke the VRAM budget ({arm.over_budget / 2**20:,.0f} MiB)"
    if arm is not None and arm.vram_unknown:
        return "had its VRAM unsampled (not known to keep the VRAM budget)"
    return "failed"


def judge(arms: Sequence[ArmSessions], source: str, notes: dict[str, str], agents: int = 1, *,
          confirmation: Sequence[ArmSessions] = ()) -> SessionStage:
    """The launch-line rule for sessions: the best reuse arm is printed only when its verdict against the base (the
    line without its setting), on the confirmation rounds, is "better"; otherwise the base is printed. ``arms``
    are the selection rounds' when ``confirmation`` is given, else every round's."""
    labels = [a.label for a in arms]
    pool = {a.label: a for a in (confirmation or arms)}
    base = pool.get(base_label(labels))
    chosen = select(arms)
    best = pool.get(chosen) if chosen else None

    def versus(a: ArmSessions, b: ArmSessions) -> Verdict:
        # Judged on the rounds quiet for both arms; the verdict says how many rounds were busy.
        return compare_quiet(a.label, b.label, a.scores, b.scores, a.quiet_scores(), b.quiet_scores())

    def stage(winner: str | None, verdict: Verdict | None, reason: str) -> SessionStage:
        return SessionStage(tuple(arms), winner, verdict, source, notes, agents, tuple(confirmation), chosen, reason)

    if base is None or not usable(base):
        # The line without the setting failed (or paged host RAM): the setting is judged against the defaults
        # instead, and printed only when decided faster than them (never undecided).
        lost = _lost(base)
        default = pool.get("default")
        ok = usable(default)
        if best is not None and usable(best) and default is not None and ok and best is not default:
            against = versus(best, default)
            if against.outcome == BETTER:
                return stage(best.label, against, f"the base line {lost}: {best.label} was decided faster than the "
                                                  "defaults")
            return stage("default", against, f"the base line {lost} and {best.label} was not shown faster than the "
                                             "defaults: the defaults are printed")
        if ok:
            return stage("default", None, f"the base line {lost}: the defaults are printed")
        if lost == _lost(default) == "failed":
            return stage(None, None, "the base line failed and so did the defaults")
        return stage(None, None, f"the base line {lost} and the defaults {_lost(default)}: no session line (a line "
                                 "that pages host RAM, breaks the VRAM budget or is not known to keep it is never "
                                 "printed)")
    if best is None or not usable(best):
        default = pool.get("default")
        verdict = versus(base, default) if default is not None and default is not base and usable(default) else None
        lost_reuse = [f"{a.label} {_lost(a)}" for a in arms if a.label in reuse_labels(labels)
                      and a.median_session_s is not None and not usable(a)]
        why = (f"{chosen} {_lost(best)}" if chosen is not None else
               f"no reuse arm could be printed ({'; '.join(lost_reuse)})" if lost_reuse else
               "no reuse setting applies")
        return stage(base.label, verdict, f"{why}: {base.label} is printed")
    verdict = versus(best, base)
    if verdict.outcome == BETTER:
        return stage(best.label, verdict, f"{best.label} was decided faster than {base.label}")
    how = "slower than" if verdict.outcome == WORSE else "not shown faster than"
    return stage(base.label, verdict, f"{best.label} was the best reuse arm but {how} {base.label}: "
                                      f"{base.label} is printed")


def run_stage(loc: EngineLocation, default: LaunchConfig, tuned: LaunchConfig, info: ModelInfo, hw: Hardware,
              req: SessionRequest, *, result_dir: Path, caps: Capabilities | None = None,
              vram_margin_mib: float | None = None, on_step: Callable[[str], None] | None = None,
              st: Any = None) -> SessionStage:
    """Measure and judge the session arms; record them (study attr ``session``, ``result_dir/session.json``)."""
    arms, notes = stage_arms(default, tuned, info, hw, caps, vram_margin_mib)
    selection, confirmation = measure(loc, arms, req, info, log_dir=result_dir / "logs" / "session", caps=caps,
                                      on_step=on_step, vram_budget_bytes=hw.vram_budget_bytes or None)
    source = str(req.session_file) if req.session_file else "bundled"
    stage = judge(selection, source, notes, req.agents, confirmation=confirmation) if selection else \
        judge(confirmation, source, notes, req.agents)
    record = stage.to_dict()
    if st is not None:
        st.set_user_attr("session", record)
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / "session.json").write_text(json.dumps(record, indent=2))
    return stage
