"""The tuned lines of several models against each other, in interleaved rounds on the workload's own metric: one
request's end-to-end time (or, with slots, aggregate throughput) for chat and batch; a whole agent session's time
for agents, with each turn's time to first token. The best median is judged against every other model with the
finish's verdicts (:func:`tuner.search.verdict.compare_quiet`): a model is called faster only when decided;
undecided stays undecided, with the best named.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import flags
from tuner.engine.build import Capabilities, EngineLocation
from tuner.measure import bench, session_run
from tuner.measure import session as session_mod
from tuner.measure.workload import Workload
from tuner.search import decide
from tuner.search.finish import round_score, server_load
from tuner.search.verdict import BETTER, UNDECIDED, Verdict, compare_quiet
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


@dataclass(frozen=True, slots=True)
class Arm:
    label: str
    launch_line: str
    rounds: tuple[Round, ...] = ()
    failure: str | None = None

    def _median(self, name: str) -> float | None:
        xs = [getattr(r, name) for r in self.rounds if getattr(r, name) is not None]
        return statistics.median(xs) if xs else None

    @property
    def scores(self) -> list[float | None]:
        return [r.score for r in self.rounds]

    def quiet_scores(self) -> list[float | None]:
        return [None if r.noise else r.score for r in self.rounds]

    @property
    def paging(self) -> str | None:
        """Host paging seen in any round (its evidence): the model does not fit this machine's RAM as tuned."""
        return next((r.host_paging for r in self.rounds if r.host_paging), None)

    @property
    def score(self) -> float | None:
        return decide.quiet_median([(r.score, r.noise) for r in self.rounds])

    def figures(self) -> dict[str, float | None]:
        return {name: self._median(name) for name in ("gen_tok_s", "prompt_tok_s", "ttft_s", "session_s")}

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "launch_line": self.launch_line, "failure": self.failure,
                "rounds": [asdict(r) for r in self.rounds], "score": self.score, "host_paging": self.paging,
                **self.figures()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Arm:
        return cls(d["label"], d["launch_line"], tuple(Round(**r) for r in d.get("rounds", [])), d.get("failure"))


@dataclass(frozen=True, slots=True)
class HeadToHead:
    arms: tuple[Arm, ...]
    metric: str
    verdicts: tuple[Verdict, ...] = field(default_factory=tuple)  # the best against every other model

    @property
    def best(self) -> Arm | None:
        ok = [a for a in self.arms if a.score is not None]
        return max(ok, key=lambda a: a.score or 0.0) if ok else None

    @property
    def decided(self) -> bool:
        """The best was decided faster than every other measured model."""
        return bool(self.verdicts) and all(v.outcome == BETTER for v in self.verdicts)

    def summary(self) -> str:
        best = self.best
        if best is None:
            why = "; ".join(f"{a.label}: {a.failure}" for a in self.arms if a.failure)
            return "no model could be measured" + (f" ({why})" if why else "")
        if len(self.arms) < 2 or not self.verdicts:
            return f"{best.label} was the only model measured"
        if self.decided:
            return f"{best.label} is faster than every other model here (by {self.metric})"
        open_ = [v.b for v in self.verdicts if v.outcome != BETTER]
        return (f"undecided: {best.label} had the best median, but was not shown faster than {', '.join(open_)} "
                f"(by {self.metric})")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "arms": [a.to_dict() for a in self.arms],
                "verdicts": [v.to_dict() for v in self.verdicts], "best": self.best.label if self.best else None,
                "decided": self.decided, "summary": self.summary()}


ROUNDS = decide.Rounds(select=0)  # no selection: every model is a contender; 3 rounds, a 4th while undecided


def verdicts_of(arms: Sequence[Arm]) -> tuple[Verdict, ...]:
    ok = [a for a in arms if a.score is not None]
    if len(ok) < 2:
        return ()
    best = max(ok, key=lambda a: a.score or 0.0)
    return tuple(compare_quiet(best.label, a.label, best.scores, a.scores, best.quiet_scores(), a.quiet_scores())
                 for a in ok if a is not best)


def metric_of(load: Workload, agent: bool) -> str:
    if agent:
        return "agent session time (every turn, request sent to last token)"
    if load.concurrency > 1:
        return f"aggregate generated tok/s with every slot busy ({load.concurrency} users)"
    return f"end-to-end request time (P={load.prompt_tokens}, G={load.gen_tokens})"


def head_to_head(loc: EngineLocation, lines: Sequence[tuple[str, LaunchConfig]], load: Workload, *, log_dir: Path,
                 caps: Capabilities | None = None, rounds: decide.Rounds = ROUNDS,
                 session: tuple[Path | None, int | None, int, int] | None = None,
                 on_step: Callable[[str], None] | None = None) -> HeadToHead:
    """Every model's tuned line once per round, the order rotating, ``rounds.min`` rounds and more (up to
    ``rounds.max``) until the best is decided against every other. ``session`` (file, depth, gen tokens, agents):
    replay an agent session instead of single requests."""
    configs = dict(lines)
    runs: dict[str, list[Round]] = {label: [] for label, _ in lines}
    failed: dict[str, str] = {}
    sent = server_load(load)
    makers = session_mod.session_makers(*session) if session else None

    def measure(label: str, r: int) -> decide.Obs:
        cfg = configs[label]
        if on_step:
            on_step(f"round {r}: {label} ({flags.launch_line(cfg)})")
        w = watched_round(cfg, label, f"round {r}",
                          lambda: _one(loc, cfg, sent, load, makers, session, log_dir / f"round{r}", caps), on_step)
        if w.failure is not None:
            failed[label] = w.failure.summary()
        got = replace(w.value or Round(None), noise=w.noise)
        runs[label].append(got)
        return got.score, got.noise

    def arms() -> list[Arm]:
        return [Arm(label, flags.launch_line(cfg), tuple(runs[label]), failed.get(label)) for label, cfg in lines]

    def settled(_: dict[str, list[decide.Obs]]) -> bool:
        return all(v.outcome != UNDECIDED for v in verdicts_of(arms()))

    decide.interleave([label for label, _ in lines], measure, first=1, at_least=rounds.min,
                      at_most=max(rounds.min, rounds.max), settled=settled)
    done = arms()
    return HeadToHead(tuple(done), metric_of(load, session is not None), verdicts_of(done))


def _one(loc: EngineLocation, cfg: LaunchConfig, sent: Workload, load: Workload,
         makers: list[Any] | None, session: tuple[Path | None, int | None, int, int] | None, log_dir: Path,
         caps: Capabilities | None) -> Round:
    if makers is not None and session is not None:
        trial = session_run.run_session_trial(loc, cfg, makers, session[2], log_dir=log_dir, caps=caps)
        res = trial.result
        return Round(res.score(), ttft_s=res.median_ttft_s, session_s=res.session_s)
    t = bench.run_server_trial(loc, cfg, replace(sent, concurrency=cfg.parallel or 1), log_dir=log_dir, caps=caps)
    first = t.levels[0]
    return Round(round_score(t.levels, load), gen_tok_s=first.per_request_gen_tok_s,
                 prompt_tok_s=first.per_request_prompt_tok_s, ttft_s=first.ttft_s,
                 host_paging=t.host_paging.describe() if t.host_paging.paging else None)
