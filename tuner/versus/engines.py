"""Which engine for this rig: each engine tuned with its own levers (auto-tune once per engine), then the line each
printed and llama.cpp's own default judged head to head on the workload (:func:`tuner.versus.judge.head_to_head`:
selection rounds choose, fresh rounds decide).

llama.cpp is the reference: its default launch is always an arm, and another engine's line is printed only when fresh
rounds decide it faster than every other arm, llama.cpp's default among them; otherwise llama.cpp's own choice (its
auto-tune's printed line) stays. An engine is also a numeric change: where the engine's logits differ from
llama.cpp's by more than the quality floor (``--max-kld``, the KL-divergence priced by
:mod:`tuner.quality.engine_price`), its lines are not judged at all, and that is said.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.engine.kinds import LLAMA_CPP, EngineKind
from tuner.measure.workload import Workload
from tuner.search import autotune
from tuner.search.trials import config_to_dict
from tuner.search.verdict import BETTER
from tuner.versus import judge
from tuner.versus.compare import printed

StepFn = Callable[[str], None]
REFERENCE = f"{LLAMA_CPP.name} default"


@dataclass(frozen=True, slots=True)
class EngineTune:
    """One engine's auto-tune: where it ran and what it printed."""

    kind: EngineKind
    loc: build.EngineLocation
    result: autotune.TuneResult
    # The engine's logits against llama.cpp's on this model (mean KLD, nats/token); None: the reference itself, or
    # not priced (--max-kld off).
    kld: float | None = None


@dataclass(frozen=True, slots=True)
class EngineLine:
    label: str  # "ik_llama.cpp tuned", "llama.cpp default"
    engine: str
    config: LaunchConfig
    study: str
    result_dir: Path
    binary: Path
    decision: str | None = None  # why that engine's auto-tune printed it
    kld: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "engine": self.engine, "config": config_to_dict(self.config),
                "study": self.study, "result_dir": str(self.result_dir), "binary": str(self.binary),
                "decision": self.decision, "engine_kld": self.kld,
                "launch_line": flags.launch_line(self.config, str(self.binary))}


@dataclass(frozen=True, slots=True)
class EngineChoice:
    lines: tuple[EngineLine, ...]
    versus: judge.HeadToHead | None
    printed: str  # the label of the line to run
    reason: str
    refused: tuple[str, ...] = ()  # engines left out by the quality floor, each with its figure

    @property
    def line(self) -> EngineLine:
        return next(x for x in self.lines if x.label == self.printed)

    def to_dict(self) -> dict[str, Any]:
        return {"lines": [x.to_dict() for x in self.lines], "head_to_head": self.versus.to_dict() if self.versus
                else None, "printed": self.printed, "printed_engine": self.line.engine, "reason": self.reason,
                "refused": list(self.refused)}


def lines_of(tunes: Sequence[EngineTune]) -> list[EngineLine]:
    """The arms: each engine's printed line, and llama.cpp's default launch where llama.cpp printed another."""
    out: list[EngineLine] = []
    for t in tunes:
        cfg, decision = printed(t.result)
        binary = t.loc.tool("llama-server")
        default = _default_of(t.result)
        if cfg is None:
            continue
        same = default is not None and flags.launch_line(cfg) == flags.launch_line(default)
        out.append(EngineLine(f"{t.kind.name} {'default' if same else 'tuned'}", t.kind.name, cfg,
                              t.result.study_name, t.result.result_dir, binary, decision, t.kld))
        if t.kind is LLAMA_CPP and default is not None and not same:
            out.append(EngineLine(REFERENCE, t.kind.name, default, t.result.study_name, t.result.result_dir, binary,
                                  "llama.cpp's own launch"))
    return out


def _default_of(res: autotune.TuneResult) -> LaunchConfig | None:
    """The bare launch the engine's finish measured as ``default`` (its baseline)."""
    from tuner.search.study import config_from_dict

    arm = next((m for m in res.result.finish.baselines if m.label == "default"), None)
    return config_from_dict(arm.config) if arm is not None else None


def choose(lines: Sequence[EngineLine], versus: judge.HeadToHead | None) -> tuple[str, str]:
    """The line to print and why: the selected line when fresh rounds decided it faster than every other arm;
    otherwise llama.cpp's own choice."""
    own = next((x for x in lines if x.engine == LLAMA_CPP.name and x.label != REFERENCE), None)
    fallback = own.label if own is not None else REFERENCE
    if versus is None or versus.best is None:
        return fallback, "no head to head was measured: llama.cpp's own choice is printed"
    best = versus.best.label
    if versus.decided:
        return best, f"{best} was decided faster than every other line in rounds that did not select it"
    if best == fallback:
        return fallback, f"{best} was selected and is llama.cpp's own choice ({versus.summary()})"
    beaten = [v.b for v in versus.verdicts if v.outcome == BETTER]
    why = f"{best} was selected, but not decided faster than every other line" + (
        f" (faster than {', '.join(beaten)} only)" if beaten else "")
    return fallback, f"{why}: llama.cpp's own choice, {fallback}, is printed"


def decide(tunes: Sequence[EngineTune], load: Workload, *, log_dir: Path, max_kld: float | None,
           session: tuple[Path | None, int | None, int, int] | None = None, rounds: Any = judge.ROUNDS,
           on_step: StepFn = lambda _: None) -> EngineChoice:
    """Judge every engine's printed line and llama.cpp's default head to head; print the decided one."""
    lines = lines_of(tunes)
    refused = tuple(f"{x.engine}: its logits differ from llama.cpp's by a mean KLD of {x.kld:.4g}, above the "
                    f"quality floor {max_kld:g} (--max-kld): its lines are not judged"
                    for x in lines if x.kld is not None and max_kld is not None and x.kld > max_kld)
    judged = [x for x in lines if not any(r.startswith(f"{x.engine}:") for r in refused)]
    for note in refused:
        on_step(note)
    versus = None
    if len(judged) >= 2:
        where = {t.kind.name: t.loc for t in tunes}
        engines = {x.label: (where[x.engine], build.capabilities(where[x.engine])) for x in judged}
        on_step(f"engines head to head: {', '.join(x.label for x in judged)} in interleaved rounds")
        first = judged[0]
        versus = judge.head_to_head(engines[first.label][0], [(x.label, x.config) for x in judged], load,
                                    log_dir=log_dir, rounds=rounds, session=session, on_step=on_step,
                                    engines=engines)
    shown, reason = choose(judged or lines, versus)
    return EngineChoice(tuple(lines), versus, shown, reason, refused)


def levers_of(kind: EngineKind, cfg: LaunchConfig) -> dict[str, Any]:
    """The kind's own levers a line sets away from their defaults (what its engine price runs with)."""
    default = LaunchConfig(model=cfg.model)
    return {name: getattr(cfg, name) for name in kind.levers if getattr(cfg, name) != getattr(default, name)}


def session_of(req: autotune.TuneRequest) -> tuple[Path | None, int | None, int, int] | None:
    """The agent session the engines replay (as their own session stages did), or None for single requests."""
    s = req.session
    if s is None:
        return None
    return s.session_file, s.depth_tokens, s.gen_tokens, s.agents


def tune_engines(req: autotune.TuneRequest, locs: Sequence[build.EngineLocation], *,
                 tune: Callable[[build.EngineLocation], autotune.TuneResult],
                 on_step: StepFn = lambda _: None) -> tuple[list[EngineTune], EngineChoice | None]:
    """Each engine tuned (``tune``: auto-tune on that engine), each non-reference engine priced against llama.cpp's
    numerics, then the head to head; None for the choice when a tune was interrupted (the rest is not run)."""
    from tuner.quality import engine_price

    tunes: list[EngineTune] = []
    reference = next((loc for loc in locs if build.capabilities(loc).kind is LLAMA_CPP), None)
    for i, loc in enumerate(locs):
        caps = build.capabilities(loc)
        on_step(f"engine {i + 1} of {len(locs)}: {caps.identity.describe()} at {loc.bin_dir}")
        res = tune(loc)
        if res.search.interrupted:
            return tunes + [EngineTune(caps.kind, loc, res)], None
        kld = None
        cfg, _ = printed(res)
        if caps.kind is not LLAMA_CPP and reference is not None and req.max_kld is not None and cfg is not None:
            got = engine_price.price(loc, reference, req.model, ctx=req.kld_ctx, chunks=req.kld_chunks,
                                     levers=levers_of(caps.kind, cfg), on_step=on_step)
            on_step(f"engine price: {got.describe()}")
            kld = got.kld_mean
        tunes.append(EngineTune(caps.kind, loc, res, kld))
    log_dir = tunes[0].result.result_dir / "engines"
    choice = decide(tunes, req.workload, log_dir=log_dir, max_kld=req.max_kld, session=session_of(req),
                    rounds=judge.ROUNDS, on_step=on_step)
    return tunes, choice


def record(tunes: Sequence[EngineTune], choice: EngineChoice) -> list[autotune.TuneResult]:
    """Each engine's result.json with the head to head in it (``engines``, ``chosen`` where that engine printed the
    line), the chosen one written last: the newest result of the model is the one to serve."""
    from dataclasses import replace

    from tuner.search.result import write_result

    block = choice.to_dict()
    out = []
    for t in sorted(tunes, key=lambda t: t.kind.name == choice.line.engine):
        chosen = t.kind.name == choice.line.engine
        result = replace(t.result.result, engines={**block, "chosen": chosen})
        write_result(result, t.result.result_dir)
        out.append(replace(t.result, result=result))
    return out
