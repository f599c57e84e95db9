"""The Optuna search: constrained TPE over a :class:`~tuner.search.space.SearchSpace`, measured with llama-bench.

Everything a report needs is stored in the study itself (JSON-safe user attrs on trials and on the study),
so a result can be rebuilt from the storage URL alone, and a second run with the same inputs resumes the same
study: its name is derived from the model, the card, the engine and the measurement settings.

Trials are asked in small batches and measured together (configs sharing a model load run in one llama-bench
process). A config the memory model says cannot fit is never launched: it is told as PRUNED with its
constraint values; a trial the engine fails is told as PRUNED with its failure class. Neither gets a score.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import socket
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.core.config import LaunchConfig
from tuner.core.errors import StudyError
from tuner.engine import runner
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine import quiet
from tuner.machine.hardware import Hardware
from tuner.measure import bench, failures
from tuner.measure.workload import Workload, WorkloadKind
from tuner.models.gguf_reader import ModelInfo
from tuner.quality.kv_price import KvPrice
from tuner.search import dedup, space
from tuner.search.budget import Budget, parse_duration  # noqa: F401 - the study's public names since the start

OPTUNA_MAJOR = int(optuna.__version__.split(".")[0])
CONSTRAINTS_ATTR = "constraints"  # user attr holding the constraint dict (and Optuna 4's constraints_func input)
BATCH_TRIALS = 4  # trials asked at once and measured together
QUIET_CV_PCT = 5.0  # median trial CV below which the machine counts as quiet (fewer repetitions)
OPEN_ATTEMPTS = 5  # tries at opening a storage that another process may be creating at the same moment
# Which process asked a trial: several machines (or processes) may work on one shared study.
WORKER = f"{socket.gethostname()}:{os.getpid()}"

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@dataclass(frozen=True, slots=True)
class Objective:
    """What is maximized. ``pareto``: generation and prompt tok/s together (a Pareto front)."""

    pareto: bool = False
    max_kld: float | None = None

    @property
    def directions(self) -> list[optuna.study.StudyDirection]:
        return [optuna.study.StudyDirection.MAXIMIZE] * (2 if self.pareto else 1)


@dataclass(frozen=True, slots=True)
class Measure:
    """How each trial is measured with llama-bench: the workload's request, at the workload's depths.

    The prompt test runs ``n_prompt`` tokens on top of ``prompt_depth`` tokens of history; the generation test
    runs ``n_gen`` tokens at ``gen_depth``. The score is the time of one whole request of ``n_prompt`` prompt
    and ``request_gen_tokens`` generated tokens (:meth:`tuner.measure.workload.Workload.score`): a config
    cannot win on generation while losing more on the prompt. ``n_gen`` may be shorter than the request's
    reply: generation speed at a depth does not depend on how many tokens are timed.
    """

    n_prompt: int = 512
    n_gen: int = 128
    repetitions: int = 3
    timeout_s: float = 600.0
    prompt_depth: int = 0
    gen_depth: int = 0
    request_gen_tokens: int | None = None  # None: n_gen
    # Once the machine's noise is known to be small (median CV of the measured trials below QUIET_CV_PCT),
    # trials take this many repetitions instead: on a real model each one costs a prompt at depth.
    quiet_repetitions: int | None = 2

    @classmethod
    def for_workload(cls, load: Workload, *, max_gen_tokens: int = 64, repetitions: int = 3,
                     timeout_s: float = 1800.0) -> Measure:
        return cls(n_prompt=load.prompt_tokens, n_gen=min(load.gen_tokens, max_gen_tokens), repetitions=repetitions,
                   timeout_s=timeout_s, prompt_depth=load.prompt_depth, gen_depth=load.gen_depth,
                   request_gen_tokens=load.gen_tokens)

    @property
    def request(self) -> Workload:
        """The request the score times."""
        return Workload(WorkloadKind.CUSTOM, self.n_prompt, self.request_gen_tokens or self.n_gen,
                        depth_tokens=self.prompt_depth + self.n_prompt)

    def score(self, prompt_tok_s: float | None, gen_tok_s: float | None) -> float | None:
        return self.request.score(prompt_tok_s, gen_tok_s)


def _slug(text: str) -> str:
    """Letters of any script, digits and ``._-`` kept (a model named модель keeps its name); the rest is ``-``."""
    return re.sub(r"[^\w.-]+", "-", text).strip("-") or "x"


def study_name(model_path: Path, hw: Hardware, caps: Capabilities, sp: space.SearchSpace, measure: Measure,
               objective: Objective) -> str:
    """model + card + engine, plus a short hash of what else makes two studies incomparable."""
    card = _slug(hw.gpu_name) if hw.has_gpu else "cpu"
    size = model_path.stat().st_size if model_path.exists() else 0
    inputs = {"size": size, "space": sp.describe() | {"model": model_path.name}, "measure": asdict(measure),
              "objective": asdict(objective)}
    if hw.vram_budget_override_bytes is not None:  # --vram-budget: a smaller card, another study
        inputs["vram_budget_bytes"] = hw.vram_budget_override_bytes
    digest = hashlib.sha256(repr(sorted(inputs.items())).encode()).hexdigest()[:8]
    return f"{_slug(model_path.stem)}__{card}__{caps.commit or 'unknown'}-{caps.backend}__{digest}"


def default_storage(results_dir: Path) -> str:
    results_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(results_dir / 'studies.db').resolve()}"


# ------------------------------------------------------------------------------ Optuna version bridge


def _constraints_from_attrs(trial: FrozenTrial) -> Sequence[float]:
    return list(trial.user_attrs.get(CONSTRAINTS_ATTR, {}).values())


def make_sampler(seed: int | None = None, *, n_startup_trials: int = 6) -> optuna.samplers.BaseSampler:
    """Constrained multivariate TPE. Optuna 4 reads constraints through ``constraints_func``; Optuna 5 reads
    what :func:`set_constraints` stored on the trial."""
    kwargs: dict[str, Any] = {"seed": seed, "multivariate": True, "group": True,
                              "n_startup_trials": n_startup_trials, "constant_liar": True}
    if OPTUNA_MAJOR < 5:
        kwargs["constraints_func"] = _constraints_from_attrs
    with warnings.catch_warnings():  # multivariate/group/constant_liar are "experimental" in Optuna 4 and 5
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(**kwargs)


def set_constraints(trial: optuna.Trial, values: dict[str, float]) -> None:
    """Record constraint values (<= 0: satisfied) the way the installed Optuna expects, and as a user attr."""
    trial.set_user_attr(CONSTRAINTS_ATTR, {k: float(v) for k, v in values.items()})
    if OPTUNA_MAJOR >= 5:
        for key, value in values.items():
            trial.set_constraint(key, float(value))


def open_study(name: str, storage: str, objective: Objective, seed: int | None = None) -> optuna.Study:
    """Create the study, or load it when it exists (so an interrupted run resumes with its trial count)."""
    return create_or_load(name, storage, objective, seed)[0]


def create_or_load(name: str, storage: str, objective: Objective, seed: int | None = None
                   ) -> tuple[optuna.Study, bool]:
    """The study, and whether this call created it. Creation is atomic in the database (unique study name), so
    of several processes opening one new shared study at once exactly one gets True: that one enqueues the seeds.

    Two processes that open a fresh database at the same moment race on creating Optuna's tables (an
    IntegrityError from the database); the loser retries after a short random pause.
    """
    for attempt in range(1, OPEN_ATTEMPTS + 1):
        try:
            return _create_or_load(name, storage, objective, seed)
        except (ImportError, ModuleNotFoundError) as exc:
            raise StudyError(f"storage {storage} needs a database driver ({exc}): install it, e.g. "
                             "psycopg2-binary") from None
        except ValueError as exc:
            raise StudyError(f"study {name} in {storage} cannot be used ({exc}): pass another --storage") from None
        except Exception as exc:  # SQLAlchemy's errors are not TunerErrors; retry a race, name the fix otherwise
            if _is_creation_race(exc) and attempt < OPEN_ATTEMPTS:
                time.sleep(0.1 + random.random() * 0.4 * attempt)
                continue
            if type(exc).__module__.startswith(("sqlalchemy", "optuna")):
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise StudyError(f"cannot open storage {storage} ({first}): check the URL") from None
            raise
    raise AssertionError("unreachable")  # the loop returns or raises


def _create_or_load(name: str, storage: str, objective: Objective, seed: int | None) -> tuple[optuna.Study, bool]:
    store = optuna.storages.get_storage(storage)
    try:
        return optuna.create_study(study_name=name, storage=store, directions=objective.directions,
                                   sampler=make_sampler(seed)), True
    except optuna.exceptions.DuplicatedStudyError:
        pass
    st = optuna.load_study(study_name=name, storage=store, sampler=make_sampler(seed))
    if st.directions != objective.directions:
        raise ValueError(f"it has {len(st.directions)} objective(s), this run {len(objective.directions)}")
    return st, False


def _is_creation_race(exc: BaseException) -> bool:
    """An error two processes creating the same tables or rows at once can get (the retry then sees them)."""
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    return bool(names & {"IntegrityError", "UniqueViolation", "DuplicateTable", "DuplicateObject",
                         "StorageInternalError"})



def config_to_dict(cfg: LaunchConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in asdict(cfg).items():
        out[key] = value.value if hasattr(value, "value") else (str(value) if isinstance(value, Path) else value)
    return out


def config_from_dict(data: dict[str, Any]) -> LaunchConfig:
    from tuner.core.config import CacheType, FlashAttn

    d = dict(data)
    d["model"] = Path(d["model"])
    d["cache_type_k"] = CacheType(d["cache_type_k"])
    d["cache_type_v"] = CacheType(d["cache_type_v"])
    d["flash_attn"] = FlashAttn(d["flash_attn"])
    return LaunchConfig(**d)


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One trial as stored: what was tried and what came of it."""

    number: int
    status: str  # measured | infeasible | failed | interrupted | running
    config: dict[str, Any]
    seed: str | None = None  # which known-good config this was, for enqueued seeds
    gen_tok_s: float | None = None
    prompt_tok_s: float | None = None
    gen_cv_pct: float | None = None
    prompt_cv_pct: float | None = None
    constraints: dict[str, float] = field(default_factory=dict)
    failure: dict[str, Any] | None = None
    argv: list[str] = field(default_factory=list)
    worker: str | None = None  # host:pid of the process that ran it
    request_s: float | None = None  # one workload request at the measured speeds (the score's inverse)
    prompt_depth: int | None = None  # context filled before the prompt test
    gen_depth: int | None = None  # context filled before the generation test
    repetitions: int | None = None
    kld: float | None = None  # mean KLD of the config's KV pair against f16 KV (None: not priced)
    same_top_pct: float | None = None

    @classmethod
    def from_trial(cls, t: FrozenTrial) -> TrialRecord:
        a = t.user_attrs
        running = {TrialState.RUNNING: "running", TrialState.WAITING: "running"}
        status = a.get("status") or running.get(t.state, "failed")
        return cls(t.number, status, a.get("config", {}), a.get("seed"), a.get("gen_tok_s"), a.get("prompt_tok_s"),
                   a.get("gen_cv_pct"), a.get("prompt_cv_pct"), a.get(CONSTRAINTS_ATTR, {}), a.get("failure"),
                   a.get("argv", []), a.get("worker"), a.get("request_s"), a.get("prompt_depth"),
                   a.get("gen_depth"), a.get("repetitions"), a.get("kld"), a.get("same_top_pct"))

    @property
    def score(self) -> float | None:
        """Requests per second (higher is better); generation tok/s for trials stored before the score."""
        if self.request_s:
            return 1.0 / self.request_s
        return self.gen_tok_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial of the study but the sampler's skipped repeats (:mod:`tuner.search.dedup`)."""
    return [TrialRecord.from_trial(t) for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("status") != dedup.DUPLICATE]


def best_measured(recs: Sequence[TrialRecord]) -> TrialRecord | None:
    measured = [r for r in recs if r.status == "measured" and r.score is not None]
    return max(measured, key=lambda r: r.score or 0.0, default=None)


def repetitions_now(recs: Sequence[TrialRecord], measure: Measure) -> int:
    """Fewer repetitions once three measured trials show the machine is quiet."""
    cvs = [max(r.gen_cv_pct or 0.0, r.prompt_cv_pct or 0.0) for r in recs
           if r.status == "measured" and r.gen_cv_pct is not None]
    if measure.quiet_repetitions and len(cvs) >= 3 and statistics.median(cvs) < QUIET_CV_PCT:
        return min(measure.quiet_repetitions, measure.repetitions)
    return measure.repetitions



def enqueue_seeds(study: optuna.Study, sp: space.SearchSpace, seeds: Sequence[tuple[str, LaunchConfig]]) -> int:
    """Enqueue known-good configs first, once per study (a resumed study does not get them again).

    On a shared study only the process that created it calls this (see :func:`create_or_load`): two processes
    checking for the labels at the same moment would otherwise both enqueue them.
    """
    done = {t.user_attrs.get("seed") for t in study.get_trials(deepcopy=False)}
    n = 0
    for label, cfg in seeds:
        if label in done:
            continue
        study.enqueue_trial(space.params_of(sp, cfg), user_attrs={"seed": label}, skip_if_exists=False)
        n += 1
    return n


# -------------------------------------------------------------------------------------------- search


@dataclass(frozen=True, slots=True)
class Progress:
    done: int  # trials finished in this run
    total: int | None
    best_gen_tok_s: float | None  # generation tok/s of the best-scoring trial
    last: TrialRecord
    best_request_s: float | None = None  # one workload request at the best trial's speeds


@dataclass(frozen=True, slots=True)
class SearchOutcome:
    study_name: str
    trials_this_run: int
    interrupted: bool
    elapsed_s: float
    kept: dict[str, int] = field(default_factory=dict)  # this run's trials left in the study, by status
    exhausted: bool = False  # every config of the space was tried: the search stopped early


def _tell_measured(study: optuna.Study, trial: optuna.Trial, result: bench.BenchResult, measure: Measure,
                   objective: Objective, reps: int) -> None:
    tg, pp = result.row("tg"), result.row("pp")
    gen, prompt = tg.spread, pp.spread
    score = measure.score(prompt.median, gen.median)
    assert score is not None  # llama-bench rows carry positive speeds
    for key, value in (("status", "measured"), ("gen_tok_s", gen.median), ("prompt_tok_s", prompt.median),
                       ("gen_cv_pct", gen.cv_pct), ("prompt_cv_pct", prompt.cv_pct), ("argv", list(result.argv)),
                       ("request_s", 1.0 / score), ("prompt_depth", pp.n_depth), ("gen_depth", tg.n_depth),
                       ("repetitions", reps)):
        trial.set_user_attr(key, value)
    study.tell(trial, [gen.median, prompt.median] if objective.pareto else score)


def tell_status(study: optuna.Study, trial: optuna.Trial, status: str, extra: dict[str, Any] | None = None,
                state: TrialState = TrialState.PRUNED) -> None:
    """End a trial that was not measured (refused, failed, skipped): its status and details as user attrs."""
    trial.set_user_attr("status", status)
    for key, value in (extra or {}).items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=state)


def run_search(
    study: optuna.Study,
    sp: space.SearchSpace,
    info: ModelInfo,
    hw: Hardware,
    loc: EngineLocation,
    *,
    budget: Budget,
    measure: Measure = Measure(),
    objective: Objective = Objective(),
    caps: Capabilities | None = None,
    vram_margin_mib: float | None = None,
    kld_of: Callable[[LaunchConfig], KvPrice | None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    batch_trials: int = BATCH_TRIALS,
) -> SearchOutcome:
    """Ask, gate by memory (and quality), measure in grouped llama-bench runs, tell — until the budget ends.

    Ctrl-C: trials in flight are told FAIL with status ``interrupted`` (so none stays RUNNING) and the call
    returns with ``interrupted=True`` and what this run left in the study; the next run continues the count.
    A config the study already holds is not measured again (:mod:`tuner.search.dedup`).
    """
    start = time.monotonic()
    done = 0
    best = best_measured(records(study))
    study.set_user_attr("space", sp.describe())

    def left() -> int | None:
        return None if budget.trials is None else budget.trials - done

    def report(trial: optuna.Trial) -> None:
        nonlocal done, best
        done += 1
        rec = TrialRecord.from_trial(study.get_trials(deepcopy=False)[trial.number])
        if rec.status == "measured" and rec.score is not None and (best is None or rec.score > (best.score or 0)):
            best = rec
        if on_progress:
            on_progress(Progress(done, budget.trials, best.gen_tok_s if best else None, rec,
                                 best.request_s if best else None))

    pending: list[tuple[optuna.Trial, LaunchConfig]] = []
    seen = dedup.Seen(sp, ())
    interrupted = False
    try:
        while ((n_left := left()) is None or n_left > 0) and not seen.exhausted and (
                budget.time_s is None or time.monotonic() - start < budget.time_s):
            want = batch_trials if left() is None else min(batch_trials, left() or 0)
            seen.hold((r.number, config_from_dict(r.config)) for r in records(study) if r.config)  # shared studies
            for _ in range(want):
                trial = study.ask()
                cfg = space.suggest(trial, sp)
                if (first := seen.repeat_of(trial.number, cfg)) is not None:  # measure nothing twice
                    tell_status(study, trial, dedup.DUPLICATE, {"duplicate_of": first}, TrialState.FAIL)
                    if (fresh := seen.untried()) is None:
                        break
                    study.enqueue_trial(fresh, user_attrs={"queued_for": dedup.DUPLICATE})
                    continue
                pending.append((trial, cfg))
                trial.set_user_attr("worker", WORKER)
                trial.set_user_attr("config", config_to_dict(cfg))
                feas = space.check(info, cfg, hw, vram_margin_mib)
                constraints = feas.constraints
                kld = kld_of(cfg) if (kld_of and feas.feasible) else None
                if kld is not None:
                    trial.set_user_attr("kld", kld.kld_mean)
                    trial.set_user_attr("same_top_pct", kld.same_top_pct)
                    if objective.max_kld is not None:
                        constraints["kld_over"] = kld.kld_mean - objective.max_kld
                set_constraints(trial, constraints)
                trial.set_user_attr("memory", feas.to_dict())
                if any(v > 0 for v in constraints.values()):
                    tell_status(study, trial, "infeasible", {})
                    pending.remove((trial, cfg))
                    report(trial)
            if pending:
                reps = repetitions_now(records(study), measure)
                with quiet.watch_for([c for _, c in pending], runner.own_pids) as watch:  # kept with the figures
                    results = bench.run_bench_many(loc, [c for _, c in pending], n_prompt=measure.n_prompt,
                                                   n_gen=measure.n_gen, depth=measure.prompt_depth,
                                                   gen_depth=measure.gen_depth, repetitions=reps,
                                                   timeout_s=measure.timeout_s, caps=caps)
                for (trial, cfg), res in zip(list(pending), results, strict=True):
                    trial.set_user_attr("interference", watch.noise)
                    if isinstance(res, failures.Failure):
                        tell_status(study, trial, "failed", {"failure": failure_attr(res)})
                    else:
                        _tell_measured(study, trial, res, measure, objective, reps)
                    pending.remove((trial, cfg))
                    report(trial)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        # Ctrl-C while asking or gating: nothing may stay RUNNING in the storage.
        for trial, _ in pending:
            trial.set_user_attr("status", "interrupted")
            study.tell(trial, state=TrialState.FAIL)
    return SearchOutcome(study.study_name, done, interrupted, time.monotonic() - start,
                         seen.kept(records(study)), seen.exhausted)


def failure_attr(f: failures.Failure) -> dict[str, Any]:
    d = f.to_dict()
    d["stderr_tail"] = d["stderr_tail"][-2000:]
    return d


def top_configs(recs: Sequence[TrialRecord], n: int, *, same: Callable[[LaunchConfig], LaunchConfig] = lambda c: c,
                exclude: Sequence[LaunchConfig] = ()) -> list[tuple[TrialRecord, LaunchConfig]]:
    """The ``n`` best measured configs, by score, distinct by what they run as (``same``), none running as one
    of ``exclude`` (the baselines the finish measures anyway)."""
    ranked = sorted((r for r in recs if r.status == "measured" and r.score is not None),
                    key=lambda r: r.score or 0.0, reverse=True)
    out: list[tuple[TrialRecord, LaunchConfig]] = []
    seen: set[LaunchConfig] = {same(c) for c in exclude}
    for rec in ranked:
        cfg = config_from_dict(rec.config)
        if same(cfg) not in seen:
            seen.add(same(cfg))
            out.append((rec, cfg))
        if len(out) == n:
            break
    return out


def non_dominated(points: Sequence[tuple[float, ...] | None]) -> list[bool]:
    """For each point (every axis: higher is better; None: not measured), whether no other point is at least
    as good on every axis and better on one."""
    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return a != b and all(x >= y for x, y in zip(a, b, strict=True))

    return [p is not None and not any(o is not None and dominates(o, p) for o in points) for p in points]


def pareto_front(study: optuna.Study) -> list[TrialRecord]:
    if len(study.directions) < 2:
        return []
    numbers = {t.number for t in study.best_trials}
    return [r for r in records(study) if r.number in numbers]
