"""The agent workload's last stage: whole sessions, scored by session time, decide the launch line.

llama-bench (the search) cannot send a second turn, so prompt reuse is judged here, on llama-server: the
engine's defaults (``default``), the finish's winner as it is (``tuned``), and the winner with each prompt-reuse
setting that applies to this model and engine (:func:`tuner.search.space.reuse_arms`), each replaying the same
session (the bundled one at the workload's depth, or ``--session FILE``) in interleaved rounds. The arm with the
shortest median session wins; it is judged against ``default`` on the per-round ratios
(:func:`tuner.search.verdict.compare`), so the report says "decided" only when the interval excludes 1.
Arms the memory model says cannot fit (a full SWA cache, more checkpoints) are never launched.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import TrialFailedError
from tuner.core.machine_spec import Hardware
from tuner.engine import flags, runner
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine import quiet
from tuner.measure import session as session_mod
from tuner.measure import session_run
from tuner.measure.session_run import Finding, SessionResult
from tuner.models.gguf_reader import ModelInfo
from tuner.search import space
from tuner.search.trials import config_to_dict
from tuner.search.verdict import Verdict, compare_quiet

DEFAULT_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class SessionRequest:
    session_file: Path | None = None  # --session: the user's own messages; None: the bundled session
    depth_tokens: int | None = None  # the bundled session's depth; None: session.DEFAULT_DEPTH
    gen_tokens: int = session_mod.DEFAULT_GEN_TOKENS  # generated per turn
    rounds: int = DEFAULT_ROUNDS
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
        return {"label": self.label, "launch_line": flags.launch_line(self.config),
                "config": config_to_dict(self.config),
                "median_session_s": self.median_session_s, "failure": self.failure,
                "rounds": [None if r is None else r.to_dict() for r in self.results],
                "typical_round": self.typical_round,
                "interference": list(self.interference),
                "finding": None if self.finding is None else self.finding.describe()}


@dataclass(frozen=True, slots=True)
class SessionStage:
    arms: tuple[ArmSessions, ...]
    winner: str | None
    verdict: Verdict | None  # winner against default
    source: str
    notes: dict[str, str] = field(default_factory=dict)  # arms not launched, and why
    agents: int = 1

    def arm(self, label: str) -> ArmSessions | None:
        return next((a for a in self.arms if a.label == label), None)

    def to_dict(self) -> dict[str, Any]:
        return {"metric": "session time (every turn, request sent to last token)", "source": self.source,
                "agents": self.agents,
                "winner": self.winner, "verdict": None if self.verdict is None else self.verdict.to_dict(),
                "verdict_text": None if self.verdict is None else self.verdict.describe(),
                "arms": [a.to_dict() for a in self.arms], "not_launched": self.notes}


def stage_arms(default: LaunchConfig, tuned: LaunchConfig, info: ModelInfo, hw: Hardware,
               caps: Capabilities | None, vram_margin_mib: float | None = None) -> tuple[list[tuple[str, LaunchConfig]],
                                                                                         dict[str, str]]:
    """``default``, ``tuned``, and ``tuned`` with each reuse setting that applies and fits."""
    arms = [("default", default)]
    if tuned != default:
        arms.append(("tuned", tuned))
    notes: dict[str, str] = {}
    for arm in space.reuse_arms(info, lambda s: flags.server_accepts(caps, s), tuned.parallel or 1):
        cfg = arm.apply(tuned)
        if not space.reuse_fits(info, cfg, hw, vram_margin_mib):
            notes[arm.label] = "not launched: the memory model says it does not fit"
            continue
        arms.append((f"tuned + {arm.label}", cfg))
    return arms, notes


def measure(loc: EngineLocation, arms: Sequence[tuple[str, LaunchConfig]], req: SessionRequest, info: ModelInfo, *,
            log_dir: Path, caps: Capabilities | None = None,
            on_step: Callable[[str], None] | None = None) -> list[ArmSessions]:
    """Every arm once per round, the order rotating each round, the same session for all."""
    makers = session_mod.session_makers(req.session_file, req.depth_tokens, req.gen_tokens, req.agents)
    results: dict[str, list[SessionResult | None]] = {label: [] for label, _ in arms}
    noise: dict[str, list[str | None]] = {label: [] for label, _ in arms}
    failed: dict[str, str] = {}
    for r in range(req.rounds):
        order = list(arms[r % len(arms):]) + list(arms[:r % len(arms)])
        for label, cfg in order:
            if label in failed:
                results[label].append(None)
                noise[label].append(None)
                continue
            if on_step:
                on_step(f"session round {r + 1}/{req.rounds}: {label}")
            # Watched as the finish's rounds are: a session measured while other work used the machine is kept
            # and shown, but decides nothing (ArmSessions.quiet_scores).
            with quiet.watch_for([cfg], runner.own_pids) as watch:
                try:
                    trial = session_run.run_session_trial(loc, cfg, makers, req.gen_tokens,
                                                          log_dir=log_dir / f"round{r + 1}", caps=caps)
                    results[label].append(trial.result)
                except TrialFailedError as exc:
                    failed[label] = exc.failure.summary()
                    results[label].append(None)
            noise[label].append(watch.noise)
            if watch.noise and on_step:
                on_step(f"session round {r + 1}: {label} was measured on a busy machine ({watch.noise}): "
                        "it decides nothing")
    out = []
    for label, cfg in arms:
        arm = ArmSessions(label, cfg, tuple(results[label]), failed.get(label), None, tuple(noise[label]))
        typical = arm.typical
        finding = session_run.diagnose(typical, info, cfg) if typical is not None else None
        out.append(replace(arm, finding=finding))
    return out


def judge(arms: Sequence[ArmSessions], source: str, notes: dict[str, str], agents: int = 1) -> SessionStage:
    """The shortest median session wins; it is compared with ``default`` round by round."""
    timed = [a for a in arms if a.median_session_s is not None]
    if not timed:
        return SessionStage(tuple(arms), None, None, source, notes, agents)
    best = min(timed, key=lambda a: a.median_session_s or float("inf"))
    default = next((a for a in arms if a.label == "default"), None)
    verdict = None
    if default is not None and best is not default:
        # Judged on the rounds quiet for both arms; the faster median still wins an undecided comparison (as in
        # the finish: noise never hands the win to the defaults), and the verdict says how many rounds were busy.
        verdict = compare_quiet(best.label, default.label, best.scores, default.scores, best.quiet_scores(),
                                default.quiet_scores())
    return SessionStage(tuple(arms), best.label, verdict, source, notes, agents)


def run_stage(loc: EngineLocation, default: LaunchConfig, tuned: LaunchConfig, info: ModelInfo, hw: Hardware,
              req: SessionRequest, *, result_dir: Path, caps: Capabilities | None = None,
              vram_margin_mib: float | None = None, on_step: Callable[[str], None] | None = None,
              st: Any = None) -> SessionStage:
    """Measure and judge the session arms; record them (study attr ``session``, ``result_dir/session.json``)."""
    arms, notes = stage_arms(default, tuned, info, hw, caps, vram_margin_mib)
    measured = measure(loc, arms, req, info, log_dir=result_dir / "logs" / "session", caps=caps, on_step=on_step)
    stage = judge(measured, str(req.session_file) if req.session_file else "bundled", notes, req.agents)
    record = stage.to_dict()
    if st is not None:
        st.set_user_attr("session", record)
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / "session.json").write_text(json.dumps(record, indent=2))
    return stage
