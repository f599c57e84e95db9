"""`compare-models` as a library call: plan every model for the card (headers only), tune each that fits with
auto-tune (the same card, workload, context and slots), then judge the printed lines head to head
(:mod:`tuner.versus.judge`). Quality across different models is not comparable by KL-divergence (each model's KLD
is against itself); the table shows the catalog's published figures where it has them, labelled and sourced.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import CpuFallbackError, TunerError, UsageError
from tuner.core.machine_spec import Hardware
from tuner.engine import build, flags, tokenizer
from tuner.machine.fileio import atomic_write
from tuner.measure import session as session_mod
from tuner.measure.workload import Workload, WorkloadKind
from tuner.models.gguf_reader import ModelInfo, inspect_model
from tuner.quality import kv_price
from tuner.search import autotune, decide, session_stage, study
from tuner.search.study import config_from_dict
from tuner.versus import judge
from tuner.versus.plan import ModelPlan, plan_model

StepFn = Callable[[str], None]
QUALITY_NOTE = ("quality across different models is not comparable by KL-divergence (each model's KLD is measured "
                "against its own higher-precision cache); the published figures shown are the catalog's, not "
                "measured here")


@dataclass(frozen=True, slots=True)
class CompareModelsRequest:
    models: tuple[str, ...]
    workload: Workload
    ctx: int | None = None  # total context; None: the workload's need (at least autotune.DEFAULT_CTX) × slots
    parallel: int | None = None  # slots; None: the workload's concurrency
    trials: int = 6  # auto-tune trials per model
    out_dir: Path | None = None
    device: str | None = None
    plan_only: bool = False
    rounds: decide.Rounds = judge.ROUNDS
    tune_rounds: decide.Rounds = decide.Rounds()
    max_kld: float | None = kv_price.DEFAULT_MAX_KLD  # the quality floor every model's KV cache is held to
    kld_ctx: int | None = None  # KV pricing per model (None: auto-tune's defaults)
    kld_chunks: int | None = None
    session_rounds: int = session_stage.DEFAULT_ROUNDS


@dataclass(frozen=True, slots=True)
class ModelRow:
    plan: ModelPlan
    launch_line: str | None = None
    study: str | None = None
    decision: str | None = None  # why auto-tune printed that line
    error: str | None = None  # why this model was not tuned or measured

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "launch_line": self.launch_line, "study": self.study,
                "decision": self.decision, "error": self.error}


@dataclass(frozen=True, slots=True)
class ModelComparison:
    rows: tuple[ModelRow, ...]
    hardware: str
    workload: dict[str, Any]
    out_dir: Path
    versus: judge.HeadToHead | None = None  # None: --plan-only, or fewer than one model measured
    notes: tuple[str, ...] = field(default_factory=lambda: (QUALITY_NOTE,))

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "workload": self.workload, "rows": [r.to_dict() for r in self.rows],
                "head_to_head": self.versus.to_dict() if self.versus else None, "notes": list(self.notes)}


def default_out_dir(models: Sequence[str]) -> Path:
    stems = [Path(m.split(":", 1)[0]).stem.split("/")[-1] for m in models]
    return Path("results") / ("compare-models-" + "-vs-".join(s[:24] for s in stems[:3]))


def context_of(req: CompareModelsRequest) -> tuple[int, int]:
    parallel = req.parallel or req.workload.concurrency
    need = req.workload.context_tokens
    return req.ctx or max(autotune.DEFAULT_CTX, need) * parallel, parallel


def head_to_head_session(req: CompareModelsRequest) -> tuple[Path | None, int | None, int, int] | None:
    """The agent session the head to head replays (file, depth, gen tokens, agents), checked now (the bundled
    session must leave room for a turn at the depth); None for other workloads. :func:`plan` calls it, so a bad
    depth stops before the machine is claimed or any model tuned, not after the tunes."""
    if req.workload.kind is not WorkloadKind.AGENT:
        return None
    session = (None, req.workload.depth_tokens, req.workload.gen_tokens, context_of(req)[1])
    session_mod.session_makers(*session)
    return session


def plan(req: CompareModelsRequest, hw: Hardware, resolve: Callable[[str], tuple[ModelInfo, str]],
         loc: build.EngineLocation | None = None) -> list[ModelPlan]:
    """Every model planned for ``hw`` (headers only), after the inputs are checked; a model named twice is
    refused. With the engine (``loc``), an agent session's depth is checked in each model's own tokens (its
    header's vocabulary, through llama-tokenize): a real run once tuned two models for 44 minutes and then found
    that the byte-level vocabulary of their shape files left no room for a turn at --depth 512."""
    if len(req.models) < 2:
        raise UsageError("compare-models needs two or more models: name each as a .gguf, owner/name:QUANT or "
                         "a catalog shape")
    if len(set(req.models)) < len(req.models):
        raise UsageError("a model is named twice: name each model once")
    session = head_to_head_session(req)
    ctx, parallel = context_of(req)
    plans = []
    for name in req.models:
        info, source = resolve(name)
        plans.append(plan_model(name, info, source, hw, ctx, parallel))
        if session is not None and session[0] is None and tokenizer.available(loc) and info.paths:
            assert loc is not None
            session_mod.check_room(session[1], session[2], tokenizer.model_tokenizer(loc, info.paths[0]),
                                   info.paths[0].name)
    labels = [p.label for p in plans]
    if len(set(labels)) < len(labels):  # two files of the same name in different folders: tell them apart
        plans = [replace(p, label=f"{p.label} ({i + 1})") for i, p in enumerate(plans)]
    return plans


def compare_models(req: CompareModelsRequest, loc: build.EngineLocation | None, hw: Hardware, *,
                   resolve_header: Callable[[str], tuple[ModelInfo, str]],
                   resolve_file: Callable[[str], Path], on_step: StepFn = lambda _: None) -> ModelComparison:
    """Plan, then (unless ``plan_only``) tune each fitting model and judge the printed lines head to head."""
    plans = plan(req, hw, resolve_header, loc)
    out_dir = req.out_dir or default_out_dir(req.models)
    wl = req.workload.describe()
    if req.plan_only or loc is None:
        return _written(ModelComparison(tuple(ModelRow(p) for p in plans), hw.describe(), wl, out_dir))
    ctx, parallel = context_of(req)
    session = head_to_head_session(req)
    rows: list[ModelRow] = []
    lines = []
    for p in plans:
        if not p.fits:
            rows.append(ModelRow(p, error=f"not tuned: {p.offload}"))
            continue
        on_step(f"{p.label}: auto-tune, {req.trials} trial(s) at -c {ctx} -np {parallel}")
        try:
            path = resolve_file(p.name)
            label = p.label

            def progress(pr: study.Progress, label: str = label) -> None:
                on_step(f"{label}: {pr.describe()}")

            res = autotune.auto_tune(_tune_request(req, path, ctx, parallel, out_dir), loc, hw, on_step=on_step,
                                     on_progress=progress)
        except CpuFallbackError:
            raise  # the engine is not on the GPU: every row would be a CPU figure
        except TunerError as exc:
            rows.append(ModelRow(p, error=str(exc)))
            continue
        if res.search.interrupted:  # Ctrl-C or SIGTERM stops the comparison, not only this model's search
            raise KeyboardInterrupt(f"{p.label}: auto-tune interrupted; its study resumes when run again")
        cfg, decision = printed(res)
        if cfg is None:
            rows.append(ModelRow(p, study=res.study_name, error="auto-tune measured no config"))
            continue
        rows.append(ModelRow(p, flags.launch_line(cfg), res.study_name, decision))
        lines.append((p.label, cfg))
    versus = None
    if lines:
        on_step(f"head to head: {', '.join(label for label, _ in lines)} in interleaved rounds")
        versus = judge.head_to_head(loc, lines, req.workload, log_dir=out_dir / "logs" / "versus",
                                    caps=build.capabilities(loc), rounds=req.rounds, session=session,
                                    on_step=on_step)
    return _written(ModelComparison(tuple(rows), hw.describe(), wl, out_dir, versus))


def printed(res: autotune.TuneResult) -> tuple[LaunchConfig | None, str | None]:
    """The line auto-tune printed (the session stage's where it decided) and why."""
    stage = res.session
    if stage is not None and stage.winner is not None:
        arm = stage.arm(stage.winner)
        if arm is not None:
            return arm.config, stage.reason or None
    d = res.result.finish.decision
    return (config_from_dict(d.shipped.config), d.reason) if d.shipped is not None else (None, None)


def _tune_request(req: CompareModelsRequest, path: Path, ctx: int, parallel: int,
                  out_dir: Path) -> autotune.TuneRequest:
    extra: dict[str, Any] = {}
    if req.kld_ctx is not None:
        extra["kld_ctx"] = req.kld_ctx
    if req.kld_chunks is not None:
        extra["kld_chunks"] = req.kld_chunks
    sessions = None
    if req.workload.kind is WorkloadKind.AGENT and req.session_rounds:
        sessions = session_stage.SessionRequest(depth_tokens=req.workload.depth_tokens,
                                                gen_tokens=req.workload.gen_tokens, rounds=req.session_rounds,
                                                agents=parallel)
    return autotune.TuneRequest(model=path, workload=req.workload, min_ctx=ctx, parallel=parallel,
                                budget=study.Budget(trials=req.trials), rounds=req.tune_rounds, max_kld=req.max_kld,
                                results_dir=out_dir / "tune", device=req.device, session=sessions, **extra)


def _written(cmp: ModelComparison) -> ModelComparison:
    cmp.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(cmp.out_dir / "compare-models.json", json.dumps(cmp.to_dict(), indent=2) + "\n")
    return cmp


def header_resolver(header_only: bool = True) -> Callable[[str], tuple[ModelInfo, str]]:
    """A name's header through the hub's resolver (files, Hub quants by range requests, catalog shapes), read once
    per name however often the comparison plans (the CLI plans before holding the machine, then again inside)."""
    from tuner.hub.resolve import resolve_model

    @functools.cache
    def resolve(name: str) -> tuple[ModelInfo, str]:
        got = resolve_model(name, header_only=header_only)
        return inspect_model(got.path), got.source

    return resolve
