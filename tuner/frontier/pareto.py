"""The trade-off frontier: a multi-objective Optuna study whose axes add context size (and, for concurrent
workloads, parallel slots) to the axes searched today, answered by the study's own Pareto front.

Objectives, each from one measured trial:

- single-request workloads: the request's time at the depth its context allows (minimize), the context
  (maximize), the KV pair's mean KL-divergence against the f16 cache (minimize);
- concurrent workloads: the per-request time with every slot busy (minimize), the aggregate generated tok/s
  (maximize), the context (maximize), the KLD (minimize).

"The depth that context allows" is a full slot: the reply ends at the slot's last cell (history + prompt +
reply = context / slots), never shallower than the workload's own depth. So a larger context is measured at its
real cost: on a CPU that is memory and attention at depth; on a GPU also the experts pushed to the host.

A config that cannot fit at a context (the memory model's :func:`tuner.search.space.check`, with the planner's
feasible interval of ``--n-cpu-moe``), or whose slots are shorter than one request, is a constraint violation,
told PRUNED and never launched. The frontier is ``study.best_trials`` (Optuna's Pareto front of feasible,
measured trials): no hand-made Pareto code.

A time budget is kept by the pace of the trials measured so far (:class:`tuner.frontier.watched.Pace`): a trial
the pace says would not finish in the time left is not started (status ``unstarted``), and one still running when
the budget ends is stopped (``stopped``); neither is a verdict on its config, so the next run measures both.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.core.config import LaunchConfig
from tuner.frontier import watched
from tuner.frontier.result import (
    AGAIN,
    CTX_SHORT,
    PAGING,
    STOPPED,
    UNSTARTED,
    Frontier,
    FrontierPoint,
    paged_trial,
    unmeasured_reason,
)
from tuner.machine import interrupt
from tuner.machine.hardware import Hardware
from tuner.machine.interrupt import deferred, sigterm_as_ctrl_c
from tuner.machine.sampler import NOT_MEASURED, PagingVerdict
from tuner.measure import failures
from tuner.measure.workload import Workload
from tuner.models.gguf_reader import ModelInfo
from tuner.quality.kv_price import KvPrice
from tuner.search import dedup, space, study

LADDER_STEPS = 4  # contexts on the ladder from --min-ctx to the model's trained context
TRIALS_PER_POINT = 3  # default budget: this many trials per (context, slot count) of the space


def ctx_ladder(min_ctx: int, max_ctx: int, steps: int = LADDER_STEPS) -> tuple[int, ...]:
    """``steps`` contexts log-spaced from ``min_ctx`` to ``max_ctx`` (both kept), inner ones rounded to 256 (the
    engine pads its cache to 256 cells)."""
    if max_ctx <= min_ctx or steps < 2:
        return (min_ctx,)
    ratio = max_ctx / min_ctx
    inner = [round(min_ctx * ratio ** (i / (steps - 1)) / 256) * 256 for i in range(1, steps - 1)]
    return tuple(sorted({min_ctx, max_ctx, *(c for c in inner if min_ctx < c < max_ctx)}))


def depths(load: Workload, ctx: int, slots: int) -> tuple[int, int]:
    """(prompt depth, generation depth) of a request that fills its slot: the reply ends at the slot's end."""
    gen_depth = max(load.gen_depth, ctx // slots - load.gen_tokens)
    return gen_depth - load.prompt_tokens, gen_depth


@dataclass(frozen=True, slots=True)
class FrontierSpace:
    """Today's axes (``base``; its ``ctx``/``parallel`` replaced per trial), plus the context ladder and slots."""

    base: space.SearchSpace
    contexts: tuple[int, ...]
    slots: tuple[int, ...] = (1,)
    concurrent: bool = False  # measured as concurrent requests (aggregate throughput is an objective)

    def describe(self) -> dict[str, Any]:
        return {**self.base.describe(), "contexts": list(self.contexts), "slots": list(self.slots),
                "concurrent": self.concurrent}

    @property
    def points(self) -> list[tuple[int, int]]:
        return list(product(self.contexts, self.slots))


def build_frontier_space(model: Path, info: ModelInfo, hw: Hardware, load: Workload, contexts: Sequence[int], *,
                         slots: Sequence[int] = (1,), vram_margin_mib: float | None = None,
                         kv_pairs: Sequence[tuple[Any, Any]] = space.KV_PAIRS,
                         threads: Sequence[int | None] | None = None, device: str | None = None) -> FrontierSpace:
    """Today's space at every (context, slots); ``--n-cpu-moe`` (``-ngl`` for a dense model) spans the union of their
    fitting ranges (a value that does not fit at one context is a constraint violation there, not a gap in the
    space)."""
    spaces = [space.build_space(model, info, hw, ctx=c, parallel=n, prompt_tokens=load.prompt_tokens,
                                kv_pairs=kv_pairs, vram_margin_mib=vram_margin_mib, device=device)
              for c, n in product(contexts, slots)]
    base = spaces[0]
    for axis in ("n_cpu_moe", "n_gpu_layers"):  # a MoE's expert offload, or a dense model's layers on the GPU
        ranges = [getattr(s, axis) for s in spaces if getattr(s, axis)]
        if ranges:
            span = (min(r[0] for r in ranges), max(r[1] for r in ranges))
            base = replace(base, n_cpu_moe=span) if axis == "n_cpu_moe" else replace(base, n_gpu_layers=span)
    if threads is not None:
        base = replace(base, threads=tuple(threads))
    return FrontierSpace(base, tuple(sorted(set(contexts))), tuple(sorted(set(slots))),
                         concurrent=load.concurrency > 1)


def _at(fs: FrontierSpace, ctx: int, slots: int) -> space.SearchSpace:
    return replace(fs.base, ctx=ctx, parallel=slots)


def suggest(trial: Any, fs: FrontierSpace) -> LaunchConfig:
    ctx = trial.suggest_categorical("ctx", list(fs.contexts)) if len(fs.contexts) > 1 else fs.contexts[0]
    slots = trial.suggest_categorical("slots", list(fs.slots)) if len(fs.slots) > 1 else fs.slots[0]
    return space.suggest(trial, _at(fs, ctx, slots))


def params_of(fs: FrontierSpace, cfg: LaunchConfig) -> dict[str, Any]:
    params = space.params_of(_at(fs, cfg.ctx or fs.contexts[0], cfg.parallel or 1), cfg)
    if len(fs.contexts) > 1:
        params["ctx"] = cfg.ctx
    if len(fs.slots) > 1:
        params["slots"] = cfg.parallel
    return params


def iter_configs(fs: FrontierSpace) -> Iterator[LaunchConfig]:
    """Every config of the space (the exhaustive grid of the frontier benchmark)."""
    for ctx, n in fs.points:
        yield from space.iter_configs(_at(fs, ctx, n))


def seed_configs(fs: FrontierSpace, info: ModelInfo, hw: Hardware, vram_margin_mib: float | None = None
                 ) -> list[tuple[str, LaunchConfig]]:
    """The memory model's best guess at every (context, slots): the frontier's skeleton, measured first, from
    the smallest context up (the first trial of a time-bounded run learns the pace cheaply)."""
    out = []
    for ctx, n in fs.points:
        cfg = space.best_guess(_at(fs, ctx, n), info, hw, vram_margin_mib)
        if cfg is not None:
            out.append((f"best-guess c{ctx} np{n}", cfg))
    return out


# ------------------------------------------------------------------------------------------ objectives


@dataclass(frozen=True, slots=True)
class Axes:
    """The objectives of one frontier study, in order."""

    concurrent: bool = False
    kld: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return ("request_s", *(("aggregate_tok_s",) if self.concurrent else ()), "ctx",
                *(("kld",) if self.kld else ()))

    @property
    def directions(self) -> list[optuna.study.StudyDirection]:
        d = optuna.study.StudyDirection
        return [d.MAXIMIZE if n in ("aggregate_tok_s", "ctx") else d.MINIMIZE for n in self.names]

    def minimized(self, values: dict[str, float]) -> tuple[float, ...]:
        """The objective values with every axis turned to "smaller is better" (for hypervolumes)."""
        return tuple(-values[n] if n in ("aggregate_tok_s", "ctx") else values[n] for n in self.names)


@dataclass(frozen=True, slots=True)
class Plan:
    """One trial to measure: the config and the depths its context allows."""

    config: LaunchConfig
    prompt_depth: int
    gen_depth: int


@dataclass(frozen=True, slots=True)
class Measured:
    """What a trial measured. ``request_s``: one request's time (concurrent: with every slot busy)."""

    request_s: float
    gen_tok_s: float | None = None
    prompt_tok_s: float | None = None
    aggregate_tok_s: float | None = None
    cv_pct: float | None = None
    repetitions: int | None = None
    argv: tuple[str, ...] = ()
    # Host RAM over the timed generation: a trial that read its model back from disk is kept off the front.
    host_paging: PagingVerdict = NOT_MEASURED


@dataclass(frozen=True, slots=True)
class Stopped:
    """A trial the time budget stopped: still running when the budget ended, or its turn came after it. Not a
    failure of its config (told ``stopped``, measured again by the next run)."""

    after_s: float = 0.0  # how long it had run when stopped (0: it never started)


# Measures a batch of planned trials (in order); the real one is tuner.frontier.tune.engine_measure.
MeasureFn = Callable[[Sequence[Plan]], list["Measured | failures.Failure | Stopped"]]


# ---------------------------------------------------------------------------------------------- study


def study_name(model: Path, hw: Hardware, engine: str, fs: FrontierSpace, load: Workload, axes: Axes) -> str:
    card = "cpu" if not hw.has_gpu else "".join(ch if ch.isalnum() else "-" for ch in hw.gpu_name or "gpu")
    size = model.stat().st_size if model.exists() else 0
    inputs = {"size": size, "space": fs.describe() | {"model": model.name}, "workload": load.describe(),
              "axes": asdict(axes), "vram_budget": hw.vram_budget_override_bytes}
    digest = hashlib.sha256(repr(sorted(inputs.items())).encode()).hexdigest()[:8]
    stem = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in model.stem)
    return f"{stem}__{card}__{engine}__frontier-{digest}"


def make_sampler(seed: int | None = 0, kind: str = "tpe", *, n_startup_trials: int = 6
                 ) -> optuna.samplers.BaseSampler:
    """Optuna's own multi-objective samplers, constrained: MOTPE (``tpe``, the default) or NSGA-II
    (``nsga2``). Optuna 4 reads constraints through ``constraints_func``; Optuna 5 reads what
    :func:`tuner.search.study.set_constraints` stored on the trial."""
    kwargs: dict[str, Any] = {"seed": seed}
    if study.OPTUNA_MAJOR < 5:
        kwargs["constraints_func"] = lambda t: list(t.user_attrs.get(study.CONSTRAINTS_ATTR, {}).values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if kind == "nsga2":
            return optuna.samplers.NSGAIISampler(population_size=8, **kwargs)
        if kind == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(multivariate=True, group=True, n_startup_trials=n_startup_trials,
                                          constant_liar=True, **kwargs)


def create_or_load(name: str, storage: str | optuna.storages.BaseStorage, axes: Axes, *, seed: int | None = 0,
                   sampler: str = "tpe") -> tuple[optuna.Study, bool]:
    """The frontier study, and whether this call created it (the creator enqueues the seeds)."""
    try:
        return optuna.create_study(study_name=name, storage=storage, directions=axes.directions,
                                   sampler=make_sampler(seed, sampler)), True
    except optuna.exceptions.DuplicatedStudyError:
        pass
    st = optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(seed, sampler))
    if st.directions != axes.directions:
        raise study.StudyError(f"study {name} has other objectives: pass another --storage")
    return st, False


def enqueue_seeds(st: optuna.Study, fs: FrontierSpace, seeds: Sequence[tuple[str, LaunchConfig]]) -> int:
    for label, cfg in seeds:
        st.enqueue_trial(params_of(fs, cfg), user_attrs={"seed": label}, skip_if_exists=False)
    return len(seeds)


@sigterm_as_ctrl_c()  # a run stopped by SIGTERM tells its trials as Ctrl-C does
def run_frontier(st: optuna.Study, fs: FrontierSpace, info: ModelInfo, hw: Hardware, load: Workload,
                 measure: MeasureFn, *, budget: study.Budget, axes: Axes,
                 kld_of: Callable[[LaunchConfig], KvPrice | None] | None = None,
                 vram_margin_mib: float | None = None, on_progress: Callable[[study.Progress], None] | None = None,
                 on_step: Callable[[str], None] | None = None, watch: watched.WatchFn = watched.engine_watch,
                 quiet_now: watched.QuietFn = watched.machine_quiet,
                 batch_trials: int = study.BATCH_TRIALS) -> study.SearchOutcome:
    """Ask, gate by memory and slot length, measure the feasible ones together under a watch (a disturbed batch
    is measured again once the machine is quiet, else kept and marked: :mod:`tuner.frontier.watched`), tell —
    until the budget ends. With a time budget, a trial the pace (learnt from the trials measured so far) says
    would not finish in the time left is not started (``unstarted``), and the run ends at the first batch none of
    whose trials would; ``measure`` stops what still runs at its deadline (``stopped``). Ctrl-C: trials in flight
    are told FAIL (status ``interrupted``); the next run resumes the study and measures all three again.
    The outcome's ``kept``: this run's trials by status (``unstarted`` ones included, though not counted as done)."""
    start, done = time.monotonic(), 0
    pace = watched.Pace(load.prompt_tokens + load.gen_tokens, watched.Cost.of(info), gpu=hw.has_gpu,
                        cores=hw.physical_cores or None)
    st.set_user_attr("frontier_space", fs.describe())
    pending: list[tuple[optuna.Trial, Plan]] = []
    seen = study.seen_of(st, lambda: iter_configs(fs), lambda cfg: params_of(fs, cfg))
    kept: Counter[str] = Counter()

    def left_s() -> float:
        assert budget.time_s is not None
        return budget.time_s - (time.monotonic() - start)

    def told(trial: optuna.Trial) -> None:
        nonlocal done
        done += 1
        rec = study.TrialRecord.from_trial(st.get_trials(deepcopy=False)[trial.number])
        kept[rec.status] += 1
        if on_progress:
            on_progress(study.Progress(done, budget.trials, None, rec, None))

    try:
        while (budget.trials is None or done < budget.trials) and (budget.time_s is None or left_s() > 0):
            interrupt.check()  # a SIGTERM lost in a hook (tuner.machine.interrupt) stops the search here
            want = batch_trials if budget.trials is None else min(batch_trials, budget.trials - done)
            if budget.time_s is not None and not pace.ops:
                want = 1  # learn the pace on one trial (the seeds come smallest context first) before batching
            asked: tuple[optuna.Trial, LaunchConfig] | None = None
            study.hold(st, seen)  # a shared study holds other workers' trials too
            for _ in range(want):
                with deferred():  # no signal between creating the trial and holding it in ``pending``
                    asked = _ask_new(st, fs, seen)
                    if asked is not None:
                        trial, cfg = asked
                        ctx, slots = cfg.ctx or fs.contexts[0], cfg.parallel or 1
                        prompt_depth, gen_depth = depths(load, ctx, slots)
                        pending.append((trial, Plan(cfg, prompt_depth, gen_depth)))
                if asked is None:
                    break
                feas = space.check(info, cfg, hw, vram_margin_mib)
                constraints = feas.constraints | {CTX_SHORT: float(load.context_tokens - ctx // slots)}
                for key, value in (("worker", study.WORKER), ("config", study.config_to_dict(cfg)), ("ctx", ctx),
                                   ("slots", slots), ("memory", feas.to_dict()), ("prompt_depth", prompt_depth),
                                   ("gen_depth", gen_depth)):
                    trial.set_user_attr(key, value)
                study.set_constraints(trial, constraints)
                price = kld_of(cfg) if (kld_of and axes.kld and feas.feasible) else None
                if price is not None:
                    trial.set_user_attr("kld", price.kld_mean)
                    trial.set_user_attr("same_top_pct", price.same_top_pct)
                if any(v > 0 for v in constraints.values()):
                    with deferred():  # told and let go together: the Ctrl-C path must not tell it twice
                        study.tell_status(st, trial, "infeasible", state=TrialState.PRUNED)
                        pending.pop()
                    told(trial)
            if not pending and asked is None and seen.exhausted:
                break  # every config of the space has been tried
            if pending and budget.time_s is not None and not _keep_fitting(st, pending, pace, left_s(), kept,
                                                                           on_step):
                break  # not one of them would finish in the time left
            if pending:
                plans = [p for _, p in pending]
                if on_step:
                    on_step(f"measuring {len(plans)} trial(s): contexts "
                            f"{', '.join(str(p.config.ctx) for p in plans)}" + pace.eta(plans))
                with watched.heartbeat(on_step, f"{len(plans)} trial(s)"):
                    batch = watched.measure_watched(measure, plans, watch=watch, quiet_now=quiet_now,
                                                    on_step=on_step,
                                                    left_s=None if budget.time_s is None else left_s)
                if not any(isinstance(r, Stopped) for r in batch.results):
                    pace.took(plans, batch.seconds)  # a stopped trial's time says nothing of its cost
                for (trial, plan), res in zip(list(pending), batch.results, strict=True):
                    trial.set_user_attr("interference", batch.noise)
                    trial.set_user_attr("remeasured", batch.remeasured)
                    with deferred():
                        if isinstance(res, Stopped):
                            study.tell_status(st, trial, STOPPED, {"why": "time budget", "after_s": res.after_s},
                                              state=TrialState.FAIL)
                        elif isinstance(res, failures.Failure):
                            study.tell_status(st, trial, "failed", {"failure": study.failure_attr(res)})
                        else:
                            _tell_measured(st, trial, plan, res, axes)
                        pending.remove((trial, plan))
                    told(trial)
    except KeyboardInterrupt:
        interrupt.handled()
        return study.SearchOutcome(st.study_name, done, True, time.monotonic() - start, dict(kept))
    finally:
        for trial, _ in pending:
            study.tell_status(st, trial, "interrupted", state=TrialState.FAIL)
    return study.SearchOutcome(st.study_name, done, False, time.monotonic() - start, dict(kept), seen.exhausted)


def _keep_fitting(st: optuna.Study, pending: list[tuple[optuna.Trial, Plan]], pace: watched.Pace, left_s: float,
                  kept: Counter[str], on_step: Callable[[str], None] | None) -> bool:
    """Leave in ``pending`` the trials the pace says finish in ``left_s``; tell the others ``unstarted`` (the
    next run measures them). False when none is left."""
    plans = [p for _, p in pending]
    fits = set(pace.fitting(plans, left_s))
    cut = [(t, p) for i, (t, p) in enumerate(pending) if i not in fits]
    if not cut:
        return True
    est = pace.estimate_s([p for _, p in cut]) or 0.0
    why = f"about {est:,.0f} s at this run's pace, {max(0.0, left_s):,.0f} s of the time budget left"
    with deferred():
        for trial, plan in cut:
            study.tell_status(st, trial, UNSTARTED, {"why": why}, state=TrialState.FAIL)
            pending.remove((trial, plan))
            kept[UNSTARTED] += 1
    if on_step:
        what = ", ".join(f"-c {p.config.ctx} {p.config.cache_type_k.value}/{p.config.cache_type_v.value}"
                         for _, p in cut)
        on_step(f"not starting {len(cut)} trial(s) ({what}): {why}" + ("" if pending else "; the run ends here"))
    return bool(pending)


def _ask_new(st: optuna.Study, fs: FrontierSpace, seen: dedup.Seen) -> tuple[optuna.Trial, LaunchConfig] | None:
    """A trial whose config this study does not hold yet (None when it holds them all): the search's one
    duplicate mechanism (:mod:`tuner.search.dedup`), repeats told with their original's constraints."""
    return seen.ask(st, lambda t: suggest(t, fs), lambda t, first: study.tell_duplicate(st, t, first))


def _tell_measured(st: optuna.Study, trial: optuna.Trial, plan: Plan, res: Measured, axes: Axes) -> None:
    kld = trial.user_attrs.get("kld")
    if axes.kld and kld is None:  # f16/f16 is the reference: it costs nothing
        kld = 0.0 if not (plan.config.cache_type_k.is_quantized or plan.config.cache_type_v.is_quantized) else None
        if kld is None:
            study.tell_status(st, trial, "failed",
                              {"failure": {"kind": "not_priced", "reason": "KV pair has no KLD price"}})
            return
        trial.set_user_attr("kld", kld)
    values = {"request_s": res.request_s, "aggregate_tok_s": res.aggregate_tok_s or 0.0,
              "ctx": float(plan.config.ctx or 0), "kld": kld or 0.0}
    for key, value in (("request_s", res.request_s), ("gen_tok_s", res.gen_tok_s),
                       ("prompt_tok_s", res.prompt_tok_s), ("aggregate_tok_s", res.aggregate_tok_s),
                       ("gen_cv_pct", res.cv_pct), ("repetitions", res.repetitions), ("argv", list(res.argv)),
                       ("host_paging", res.host_paging.to_dict())):
        trial.set_user_attr(key, value)
    if res.host_paging.paging:
        # Its figures are the kernel reading weights from disk, not the config's: never a point of the front (a
        # pruned trial is not in Optuna's best_trials, and the sampler counts it among the bad ones).
        study.tell_status(st, trial, PAGING, state=TrialState.PRUNED)
        return
    if res.host_paging.beside_others:  # other programs' memory load made it page: measured again (dedup.again)
        return study.tell_status(st, trial, dedup.BESIDE_OTHERS, state=TrialState.PRUNED)
    trial.set_user_attr("status", "measured")
    st.tell(trial, [values[n] for n in axes.names])


# -------------------------------------------------------------------------------------------- the front


def measured_trials(st: optuna.Study) -> list[FrozenTrial]:
    return [t for t in st.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("status") == "measured"]


def frontier_of(st: optuna.Study, fs: FrontierSpace, has_gpu: bool, notes: Sequence[str] = ()) -> Frontier:
    """The study's Pareto front (Optuna's ``best_trials``: feasible, measured, non-dominated); ``notes``: how
    its figures were taken, said beside it."""
    axes = Axes(fs.concurrent, kld=len(st.directions) == (4 if fs.concurrent else 3))
    front = [FrontierPoint.from_trial(t, has_gpu) for t in st.best_trials if t.user_attrs.get("status") == "measured"]
    front.sort(key=lambda p: (p.slots, p.ctx, p.request_s))
    notes = list(notes)
    paged = tuple(paged_trial(t) for t in st.get_trials(deepcopy=False) if t.user_attrs.get("status") == PAGING)
    if paged:
        first = paged[0]
        notes.append(f"{len(paged)} measured trial(s) paged host RAM and are kept off the front (their figures are "
                     f"the disk's, and such a line would page again): trial {first['trial']} at -c {first['ctx']:,}: "
                     f"{first['evidence']}; to change: {first['fix']}.")
    busy = [p for p in front if p.interference]
    if busy:
        notes.append(f"{len(busy)} of {len(front)} points (marked !) were measured while other programs used the "
                     f"machine ({busy[0].interference}), which was still busy when they could have been measured "
                     "again: they may be slower than the config really is; run again on a quiet machine to confirm.")
    reached = {t.user_attrs.get("ctx") for t in measured_trials(st)} | {p["ctx"] for p in paged}
    missing = [c for c in fs.contexts if c not in reached]
    if front and missing:
        notes.append(f"no point measured at {', '.join(f'{c:,}' for c in missing)} within this run's budget: run "
                     "the same command again (it resumes the study) or give it more --time to reach them.")
    if not has_gpu:
        notes.append("CPU only: a larger context costs only memory and attention at depth (no experts move to the "
                     "host); a flat curve would mean context is nearly free here.")
    return Frontier(axes.names, tuple(front), fs.contexts, fs.slots, fs.concurrent, has_gpu,
                    len(measured_trials(st)) + len(paged), tuple(notes), unmeasured(st), paged)


def unmeasured(st: optuna.Study) -> tuple[tuple[str, int], ...]:
    """The study's trials not measured, counted by reason (:func:`tuner.frontier.result.unmeasured_reason`), most
    first; one stopped, not started or cut short whose config a later trial measured is not counted."""
    trials = st.get_trials(deepcopy=False)
    measured = {_same(t.user_attrs.get("config")) for t in trials if t.user_attrs.get("status") == "measured"}
    reasons: Counter[str] = Counter()
    for t in trials:
        a = t.user_attrs
        status = a.get("status") or ""
        if status == "interrupted" and a.get("why") == "time budget":
            status = UNSTARTED  # how studies measured before the ``unstarted`` status told one
        if status in AGAIN and _same(a.get("config")) in measured:
            continue
        reason = unmeasured_reason(status, a.get("failure"), a.get(study.CONSTRAINTS_ATTR))
        if reason is not None:
            reasons[reason] += 1
    return tuple(reasons.most_common())


def _same(config: dict[str, Any] | None) -> str:
    """A stored config as a key, its model by file name only (workers of a shared study hold it in other folders)."""
    c = dict(config or {})
    c["model"] = Path(str(c.get("model") or "")).name
    return repr(sorted(c.items(), key=lambda kv: kv[0]))
