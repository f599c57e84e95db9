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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
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
from tuner.machine.interrupt import check as check_interrupt
from tuner.machine.interrupt import deferred, sigterm_as_ctrl_c
from tuner.machine.interrupt import handled as interrupt_handled
from tuner.machine.sampler import PagingKind, PagingVerdict
from tuner.measure import bench, failures
from tuner.measure.workload import Workload, WorkloadKind
from tuner.models.gguf_reader import ModelInfo
from tuner.quality.kv_price import KvPrice
from tuner.search import dedup, space
from tuner.search.anchor import ANCHOR_EVERY, Anchor, AnchorReading
from tuner.search.budget import Budget, parse_duration  # noqa: F401 - the study's public names since the start
from tuner.search.dedup import STALE_RUNNING_S, worker_alive  # noqa: F401 - as above
from tuner.search.progress import Progress, SearchOutcome, test_words  # noqa: F401 - the study's public names
from tuner.search.trials import (  # noqa: F401 - the study's public names since the start
    CONSTRAINTS_ATTR,
    TrialRecord,
    best_measured,
    config_from_dict,
    config_to_dict,
    non_dominated,
    pareto_front,
    records,
    top_configs,
)

OPTUNA_MAJOR = int(optuna.__version__.split(".")[0])
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
    # The prompt the score charges where the test times a shorter one (the engines' searches time 256 tokens of a
    # 512-token request: the rate is the same, the request's time is not); None: n_prompt.
    request_prompt_tokens: int | None = None

    @classmethod
    def for_workload(cls, load: Workload, *, max_gen_tokens: int = 64, repetitions: int = 3,
                     timeout_s: float = 1800.0) -> Measure:
        return cls(n_prompt=load.prompt_tokens, n_gen=min(load.gen_tokens, max_gen_tokens), repetitions=repetitions,
                   timeout_s=timeout_s, prompt_depth=load.prompt_depth, gen_depth=load.gen_depth,
                   request_gen_tokens=load.gen_tokens)

    @property
    def request(self) -> Workload:
        """The request the score times."""
        prompt = self.request_prompt_tokens or self.n_prompt
        return Workload(WorkloadKind.CUSTOM, prompt, self.request_gen_tokens or self.n_gen,
                        depth_tokens=self.prompt_depth + prompt)

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
    measured = {k: v for k, v in asdict(measure).items() if v is not None or k != "request_prompt_tokens"}
    inputs = {"size": size, "space": sp.describe() | {"model": model_path.name}, "measure": measured,
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



# ------------------------------------------------------------------------------- what a study holds (dedup)

def _live(t: FrozenTrial) -> bool:
    return t.state == TrialState.RUNNING and worker_alive(t.user_attrs.get("worker"), t.datetime_start)


def _config_of(t: FrozenTrial) -> LaunchConfig | None:
    return config_from_dict(t.user_attrs["config"]) if t.user_attrs.get("config") else None


def seen_of(study: optuna.Study, configs: Callable[[], Iterable[LaunchConfig]],
            params_of: Callable[[LaunchConfig], dict[str, Any]]) -> dedup.Seen:
    """The dedup record of ``study`` (:mod:`tuner.search.dedup`), holding what the study holds now."""
    seen = dedup.Seen(configs, params_of, _config_of)
    hold(study, seen)
    return seen


def hold(study: optuna.Study, seen: dedup.Seen) -> None:
    """Hold what the study holds, and queue again what paged beside others' memory load (dedup.again)."""
    seen.hold(study.get_trials(deepcopy=False), _live)
    seen.queue_again(study, study.get_trials(deepcopy=False), _live)


def tell_duplicate(study: optuna.Study, trial: optuna.Trial, first: int) -> None:
    """End a repeat of trial ``first`` unmeasured: FAIL (the sampler ignores it), its constraints copied from
    ``first`` so that no reader takes a repeat of an infeasible config for a feasible one."""
    original = study.get_trials(deepcopy=False)[first]
    constraints = original.user_attrs.get(CONSTRAINTS_ATTR)
    if constraints:
        set_constraints(trial, constraints)
    tell_status(study, trial, dedup.DUPLICATE, {"duplicate_of": first}, TrialState.FAIL)


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


def _tell_measured(study: optuna.Study, trial: optuna.Trial, result: bench.BenchResult, paging: PagingVerdict,
                   measure: Measure, objective: Objective, reps: int) -> None:
    """``paging``: the result's paging verdict judged against what the watch saw (PagingVerdict.beside)."""
    tg, pp = result.row("tg"), result.row("pp")
    gen, prompt = tg.spread, pp.spread
    score = measure.score(prompt.median, gen.median)
    assert score is not None  # llama-bench rows carry positive speeds
    for key, value in (("gen_tok_s", gen.median), ("prompt_tok_s", prompt.median),
                       ("gen_cv_pct", gen.cv_pct), ("prompt_cv_pct", prompt.cv_pct), ("argv", list(result.argv)),
                       ("request_s", 1.0 / score), ("prompt_depth", pp.n_depth), ("gen_depth", tg.n_depth),
                       ("repetitions", reps), ("host_paging", paging.to_dict())):
        trial.set_user_attr(key, value)
    if paging.paging:  # read its model back from disk: the speed is the disk's, never a candidate
        return tell_status(study, trial, dedup.PAGING)  # held like a config the memory gate refused
    if paging.beside_others:  # others' memory load made it page: measured again (dedup.again)
        return tell_status(study, trial, dedup.BESIDE_OTHERS)
    trial.set_user_attr("status", "measured")
    study.tell(trial, [gen.median, prompt.median] if objective.pareto else score)


def tell_status(study: optuna.Study, trial: optuna.Trial, status: str, extra: dict[str, Any] | None = None,
                state: TrialState = TrialState.PRUNED) -> None:
    """End a trial that was not measured (refused, failed, skipped): its status and details as user attrs."""
    trial.set_user_attr("status", status)
    for key, value in (extra or {}).items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=state)


@sigterm_as_ctrl_c()  # a run stopped by SIGTERM tells its trials as Ctrl-C does
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
    anchor_every: int | None = None,
    should_stop: Callable[[], str | None] | None = None,
    on_test: Callable[[str], None] | None = None,
) -> SearchOutcome:
    """Ask, gate by memory (and quality), measure in grouped llama-bench runs, tell — until the budget ends.

    Ctrl-C: trials in flight are told FAIL with status ``interrupted`` (so none stays RUNNING) and the call
    returns with ``interrupted=True`` and what this run left in the study; the next run continues the count.
    A config the study already holds is not measured again (:mod:`tuner.search.dedup`).

    GPU runs measure the first measured config again every ``anchor_every`` measured trials
    (:mod:`tuner.search.anchor`; default :data:`~tuner.search.anchor.ANCHOR_EVERY`, 0: off, the default on CPU
    runs) and name a thermal drift on the trials it touched (user attr ``drift``), on the study (``anchor``) and
    in the outcome.

    ``should_stop``: asked before each batch (a run's time budget kept across engines: tuner.versus.clock); a reason
    ends the search there, kept in the outcome's ``cut``. ``on_test``: a line as each llama-bench test ends, naming the
    trial and its settings (a trial on a 12-17 GiB model takes minutes on a CPU; its tests end every minute or so).
    """
    start = time.monotonic()
    cut: str | None = None
    done = 0
    best = best_measured(records(study))
    study.set_user_attr("space", sp.describe())
    gpu_run = hw.has_gpu and sp.device != "none"
    anchor = Anchor(anchor_every if anchor_every is not None else (ANCHOR_EVERY if gpu_run else 0))

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
    seen = seen_of(study, lambda: space.iter_configs(sp), lambda cfg: space.params_of(sp, cfg))
    interrupted = False
    try:
        while ((n_left := left()) is None or n_left > 0) and not seen.exhausted and (
                budget.time_s is None or time.monotonic() - start < budget.time_s):
            check_interrupt()  # a SIGTERM lost in a hook (tuner.machine.interrupt) stops the search here
            if should_stop is not None and (cut := should_stop()) is not None:
                break
            want = batch_trials if left() is None else min(batch_trials, left() or 0)
            if anchor.due:
                _read_anchor(study, anchor, loc, measure, caps, start)
            hold(study, seen)  # a shared study holds other workers' trials too
            for _ in range(want):
                with deferred():  # no signal between creating the trial and holding it in ``pending``
                    asked = seen.ask(study, lambda t: space.suggest(t, sp),
                                     lambda t, first: tell_duplicate(study, t, first))
                    if asked is not None:
                        pending.append(asked)
                if asked is None:
                    break
                trial, cfg = asked
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
                    with deferred():  # told and let go together: the Ctrl-C path must not tell it twice
                        tell_status(study, trial, "infeasible", {})
                        pending.remove((trial, cfg))
                    report(trial)
            if pending:
                reps = repetitions_now(records(study), measure)
                batch = list(pending)
                # numbered as they will be told: group by group, in the order llama-bench runs them
                order = [c for group in bench.group_configs([c for _, c in batch]) for c in group]
                numbers = {cfg: done + 1 + i for i, cfg in enumerate(order)}
                with quiet.watch_for([c for _, c in batch], runner.own_pids) as watch:  # kept with the figures

                    def tell(cfg: LaunchConfig, res: bench.BenchResult | failures.Failure, batch: list[Any] = batch,
                             reps: int = reps, watch: Any = watch) -> None:
                        trial = next(t for t, c in batch if c == cfg)
                        trial.set_user_attr("interference", watch.noise)
                        with deferred():
                            if isinstance(res, failures.Failure):
                                tell_status(study, trial, "failed", {"failure": failure_attr(res)})
                            else:
                                # its share of the process (configs sharing a load share its seconds)
                                trial.set_user_attr("elapsed_s", round(res.elapsed_s / res.group, 2))
                                paging = res.host_paging.beside(watch.others_memory)
                                if paging.kind is PagingKind.NONE:  # paging: no anchor, its figures are the disk's
                                    anchor.measured(cfg, AnchorReading.of(res, anchor.trials_measured,
                                                                          time.monotonic() - start, watch.noise))
                                if anchor.on:
                                    trial.set_user_attr("drift", anchor.noise)
                                _tell_measured(study, trial, res, paging, measure, objective, reps)
                            pending.remove((trial, cfg))
                        report(trial)

                    def row(r: bench.BenchRow, group: Sequence[LaunchConfig],
                            numbers: dict[LaunchConfig, int] = numbers) -> None:
                        if on_test is None:
                            return
                        # the process's own configs: a row names no load setting, so another group's would match
                        mine = [c for c in group if bench.rows_for(c, [r])] or list(group)
                        which = f"trial {numbers[mine[0]]}" if len(mine) == 1 else "trials " + ", ".join(
                            str(numbers[c]) for c in mine)
                        of = f"/{budget.trials}" if budget.trials else ""
                        on_test(f"  {which}{of}: {test_words(r)}")

                    bench.run_bench_many(loc, [c for _, c in batch], n_prompt=measure.n_prompt, n_gen=measure.n_gen,
                                         depth=measure.prompt_depth, gen_depth=measure.gen_depth, repetitions=reps,
                                         timeout_s=measure.timeout_s, caps=caps, on_done=tell, on_row=row)
                hold(study, seen)  # a config that paged beside others' load is queued again: not exhausted
    except KeyboardInterrupt:
        interrupt_handled()
        interrupted = True
    finally:
        # Ctrl-C while asking or gating: nothing may stay RUNNING in the storage.
        for trial, _ in pending:
            trial.set_user_attr("status", "interrupted")
            study.tell(trial, state=TrialState.FAIL)
    if anchor.on and anchor.config is not None:
        study.set_user_attr("anchor", anchor.to_dict())
    return SearchOutcome(study.study_name, done, interrupted, time.monotonic() - start,
                         seen.kept(records(study)), seen.exhausted, anchor.noise, cut)


def _read_anchor(study: optuna.Study, anchor: Anchor, loc: EngineLocation, measure: Measure,
                 caps: Capabilities | None, start: float) -> None:
    """Measure the anchor config alone, as its trial was measured, and keep the reading on the study."""
    assert anchor.config is not None
    with quiet.watch_for([anchor.config], runner.own_pids) as watch:
        (res,) = bench.run_bench_many(loc, [anchor.config], n_prompt=measure.n_prompt, n_gen=measure.n_gen,
                                      depth=measure.prompt_depth, gen_depth=measure.gen_depth,
                                      repetitions=measure.repetitions, timeout_s=measure.timeout_s, caps=caps)
    anchor.add(None if isinstance(res, failures.Failure) else
               AnchorReading.of(res, anchor.trials_measured, time.monotonic() - start, watch.noise))
    study.set_user_attr("anchor", anchor.to_dict())


def failure_attr(f: failures.Failure) -> dict[str, Any]:
    d = f.to_dict()
    d["stderr_tail"] = d["stderr_tail"][-2000:]
    return d
