"""`auto-tune --frontier` as a library call: the context ladder, the frontier study, its trials measured with the
real engine at the depth each context allows, and the front stored in result.json.

Single-request trials are llama-bench runs, scored by one request's time as every trial is; concurrent trials are
llama-batched-bench runs of ``slots`` requests at once (:mod:`tuner.measure.batched`).

The cost of a frontier trial is the history it fills before timing anything: at a 32k context that is 32k tokens
of prompt, far more than the request itself. llama-bench keeps the filled context and restores it, instead of
filling it again, for every repetition and for every later test of the same depth whose K/V cache it fits
(``ctx_state`` in tools/llama-bench/llama-bench.cpp, ``llama_state_seq_get_data``/``set_data``). So a trial is
one llama-bench process with both tests at one depth — the reply's (the slot's end less the reply): the history
is filled once per process and K/V pair instead of once per test. The prompt is therefore timed its own length
deeper than its history: a request's time errs on the slow side by that much attention, and the front says so.
llama-batched-bench keeps no such state (each batch fills its sequences again), so concurrent trials cost their
full depth every time; the default budget is therefore bounded in time too (:func:`time_budget_s`), and that
bound holds: the pace starts no trial it says would not finish (:mod:`tuner.frontier.pareto`), and a process still
running a little past the budget (:data:`DEADLINE_GRACE`) is stopped, its trials told ``stopped``, not failed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import groupby

from tuner.core.config import LaunchConfig
from tuner.core.errors import TrialFailedError, UsageError
from tuner.core.stats import cv_pct
from tuner.engine import build
from tuner.frontier import pareto
from tuner.frontier.result import STOPPED, UNSTARTED, counted
from tuner.machine.hardware import Hardware
from tuner.measure import batched, bench, failures, gpu_use
from tuner.measure.engine_memory import EngineMemory, deciding
from tuner.measure.workload import Workload
from tuner.models.gguf_reader import inspect_model
from tuner.quality.kv_price import KvPrice
from tuner.search import result as study_result
from tuner.search import space, study
from tuner.search.autotune import TuneRequest, TuneResult, choose_ctx, kv_pricer

MAX_GEN_TOKENS = 64  # generation timed per trial; speed at a depth does not depend on how many tokens are timed
DEFAULT_TIME_S = 420.0  # without --trials or --time: a front within minutes (the pace trims the last batch to fit)
DEADLINE_GRACE = 0.05  # share of the time budget after which a trial still running is stopped


Result = pareto.Measured | failures.Failure | pareto.Stopped


def engine_measure(loc: build.EngineLocation, load: Workload, *, caps: build.Capabilities | None = None,
                   repetitions: int = 2, timeout_s: float = 1800.0,
                   deadline: float | None = None) -> pareto.MeasureFn:
    """The real measurement of frontier trials (the fake runner in the tests replaces only this). ``deadline``
    (``time.monotonic()``): no process runs past it, none starts after it — such a trial is
    :class:`tuner.frontier.pareto.Stopped`, so a time budget bounds the run even when one trial alone would
    outlast it."""
    request = replace(load, depth_tokens=None)
    timed = min(load.gen_tokens, MAX_GEN_TOKENS)

    def limit_s() -> float:
        return timeout_s if deadline is None else max(1.0, min(timeout_s, deadline - time.monotonic()))

    def past_deadline() -> bool:
        return deadline is not None and time.monotonic() >= deadline - 1.0  # the last second: a limit of 1 s

    def bench_one_depth(cfgs: Sequence[LaunchConfig], gd: int) -> list[bench.BenchResult | failures.Failure
                                                                       | pareto.Stopped]:
        """As :func:`tuner.measure.bench.run_bench_many` (a failed group is retried one config at a time to find
        the culprit), each process limited to the deadline as it starts, none started past it."""
        out: dict[LaunchConfig, bench.BenchResult | failures.Failure | pareto.Stopped] = {}

        def run(group: Sequence[LaunchConfig]) -> list[bench.BenchResult]:
            return bench.run_bench_group(loc, group, n_prompt=load.prompt_tokens, n_gen=timed, depth=gd,
                                         gen_depth=gd, repetitions=repetitions, timeout_s=limit_s(), caps=caps)

        for group in bench.group_configs(cfgs):
            t0 = time.monotonic()
            if past_deadline():
                out.update((c, pareto.Stopped()) for c in group)
                continue
            try:
                out.update((r.config, r) for r in run(group) if r.config is not None)
            except TrialFailedError as exc:
                if past_deadline():
                    out.update((c, pareto.Stopped(time.monotonic() - t0)) for c in group)
                elif len(group) == 1:
                    out[group[0]] = exc.failure
                else:
                    for cfg in group:
                        t1 = time.monotonic()
                        if past_deadline():
                            out[cfg] = pareto.Stopped()
                            continue
                        try:
                            out[cfg] = run([cfg])[0]
                        except TrialFailedError as one:
                            out[cfg] = pareto.Stopped(time.monotonic() - t1) if past_deadline() else one.failure
        return [out[c] for c in cfgs]

    def single(plans: Sequence[pareto.Plan]) -> list[Result]:
        out: dict[int, Result] = {}
        keyed = sorted(enumerate(plans), key=lambda ip: ip[1].gen_depth)
        for gd, group in groupby(keyed, key=lambda ip: ip[1].gen_depth):
            items = list(group)
            # Both tests at the reply's depth: one process, the history filled once (see the module docstring).
            results = bench_one_depth([p.config for _, p in items], gd)
            for (i, _), res in zip(items, results, strict=True):
                if isinstance(res, failures.Failure | pareto.Stopped):
                    out[i] = res
                    continue
                pp, tg = res.row("pp").spread, res.row("tg").spread
                out[i] = pareto.Measured(request.request_s(pp.median, tg.median), tg.median, pp.median,
                                           cv_pct=max(pp.cv_pct, tg.cv_pct), repetitions=repetitions,
                                           argv=res.argv, host_paging=res.host_paging)
        return [out[i] for i in range(len(plans))]

    def concurrent(plans: Sequence[pareto.Plan]) -> list[Result]:
        out: list[Result] = []
        for p in plans:
            t0 = time.monotonic()
            if past_deadline():
                out.append(pareto.Stopped())
                continue
            try:
                # The whole history is each request's prompt, as the finish's server trials send it; the reply
                # is timed on its first ``timed`` tokens and its time scaled to the whole reply (derived: said
                # in the front's notes, see timing_note).
                r = batched.run_batched(loc, p.config, n_prompt=p.gen_depth, n_gen=timed,
                                        repetitions=repetitions, timeout_s=limit_s(), caps=caps)
            except TrialFailedError as exc:
                out.append(pareto.Stopped(time.monotonic() - t0) if past_deadline() else exc.failure)
                continue
            totals = [run.prompt_s + run.gen_s * load.gen_tokens / timed for run in r.runs]
            request_s = statistics.median(totals)
            slots = p.config.parallel or 1
            out.append(pareto.Measured(request_s, r.per_request_gen_tok_s, None, slots * load.gen_tokens / request_s,
                                       cv_pct(totals), repetitions, r.argv, r.host_paging))
        return out

    return concurrent if load.concurrency > 1 else single


def default_trials(fs: pareto.FrontierSpace) -> int:
    return pareto.TRIALS_PER_POINT * len(fs.points)


def time_budget_s(req: TuneRequest, trials: int | None) -> float | None:
    """``--time``; with neither ``--trials`` nor ``--time``, :data:`DEFAULT_TIME_S`, so an answer comes in minutes."""
    if req.budget.time_s is not None:
        return req.budget.time_s
    return None if trials else DEFAULT_TIME_S


def timing_note(load: Workload) -> str:
    """How the front's request times were taken, said beside it."""
    if load.concurrency > 1:
        scaled = (f"; the reply is timed on its first {min(load.gen_tokens, MAX_GEN_TOKENS)} tokens and that time "
                  f"scaled to all {load.gen_tokens} (derived, not measured: it errs slightly on the fast side, the "
                  "rest of the reply sitting deeper)" if load.gen_tokens > MAX_GEN_TOKENS else "")
        return (f"request time: every slot at once, each slot's whole history as its prompt, then {load.gen_tokens} "
                f"tokens generated for every slot (llama-batched-bench), median of the repetitions{scaled}")
    return (f"request time: the prompt ({load.prompt_tokens} tokens) and the reply (timed on "
            f"{min(load.gen_tokens, MAX_GEN_TOKENS)} of {load.gen_tokens} tokens) both timed at the reply's depth, "
            f"with the history filled once per llama-bench process: the prompt is timed {load.prompt_tokens} tokens "
            "(its own length) deeper than it sits, so request times err slightly on the slow side")


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def budget_note(outcome: study.SearchOutcome, time_s: float) -> str:
    """This run's time against its time budget, and what the budget left unmeasured, said beside the front."""
    kept = outcome.kept
    parts = [f"this run took {_clock(outcome.elapsed_s)} of its {_clock(time_s)} time budget"]
    if kept.get(STOPPED):
        parts.append(f"{kept[STOPPED]} trial(s) still running at its end were stopped")
    if kept.get(UNSTARTED):
        parts.append(f"{kept[UNSTARTED]} were not started, the pace of its earlier trials saying they would "
                     "not finish in the time left")
    again = "" if len(parts) == 1 else "; the same command again resumes the study and measures them"
    return "; ".join(parts) + again + "."


def tune_frontier(req: TuneRequest, loc: build.EngineLocation, hw: Hardware, *, max_ctx: int | None = None,
                  steps: int = pareto.LADDER_STEPS, trials: int | None = None,
                  measure: pareto.MeasureFn | None = None,
                  kld_of: Callable[[LaunchConfig], KvPrice | None] | None = None,
                  on_progress: Callable[[study.Progress], None] | None = None,
                  on_step: Callable[[str], None] | None = None) -> TuneResult:
    """The frontier study for ``req``'s model and workload; ``trials`` None: :func:`default_trials`. Its memory
    gate follows the engine's own projection, as auto-tune's does (:mod:`tuner.measure.engine_memory`)."""
    with deciding(EngineMemory.of(loc)):
        return _tune_frontier(req, loc, hw, max_ctx=max_ctx, steps=steps, trials=trials, measure=measure,
                              kld_of=kld_of, on_progress=on_progress, on_step=on_step)


def _tune_frontier(req: TuneRequest, loc: build.EngineLocation, hw: Hardware, *, max_ctx: int | None,
                   steps: int, trials: int | None, measure: pareto.MeasureFn | None,
                   kld_of: Callable[[LaunchConfig], KvPrice | None] | None,
                   on_progress: Callable[[study.Progress], None] | None,
                   on_step: Callable[[str], None] | None) -> TuneResult:
    hw = gpu_use.preflight(loc, hw, req.device)  # a GPU rig measured on the CPU stops here, not after
    caps = build.capabilities(loc)
    info = inspect_model(req.model)
    min_ctx = choose_ctx(req, info, hw, 1)
    top = max_ctx or info.ctx_train
    if top > info.ctx_train:
        raise UsageError(f"--max-ctx {top} is beyond the model's training context {info.ctx_train}: lower it")
    if top < min_ctx:
        raise UsageError(f"--max-ctx {top} is below the smallest context {min_ctx}: raise it or lower --min-ctx")
    slots = space.slot_counts(req.workload.concurrency)
    fs = pareto.build_frontier_space(req.model, info, hw, req.workload, pareto.ctx_ladder(min_ctx, top, steps),
                                       slots=slots, vram_margin_mib=req.vram_margin_mib, device=req.device)
    axes = pareto.Axes(fs.concurrent, kld=req.max_kld is not None)
    name = pareto.study_name(req.model, hw, f"{caps.commit or 'unknown'}-{caps.backend}", fs, req.workload, axes)
    storage = req.storage or study.default_storage(req.results_dir)
    st, created = pareto.create_or_load(name, storage, axes, seed=req.seed)
    if created:
        pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, hw, req.vram_margin_mib))
    st.set_user_attr("model", str(req.model))
    st.set_user_attr("hardware", {"describe": hw.describe(), "gpu": hw.gpu_name, "has_gpu": hw.has_gpu,
                                  "vram_budget_bytes": hw.vram_budget_bytes, "physical_cores": hw.physical_cores})
    st.set_user_attr("engine", caps.identity.to_dict())
    st.set_user_attr("workload", req.workload.describe())
    st.set_user_attr("objective", {"frontier": list(axes.names), "max_kld": req.max_kld})
    time_s = time_budget_s(req, trials)
    budget = study.Budget(trials=trials or default_trials(fs), time_s=time_s)
    if on_step:
        bound = "" if time_s is None else f" or {time_s / 60:.0f} min, whichever ends first"
        on_step(f"frontier: contexts {', '.join(map(str, fs.contexts))}; slots {', '.join(map(str, fs.slots))}; "
                f"{budget.trials} trials{bound}; objectives {', '.join(axes.names)}")
    deadline = None if time_s is None else time.monotonic() + time_s * (1 + DEADLINE_GRACE)
    outcome = pareto.run_frontier(st, fs, info, hw, req.workload,
                                    measure or engine_measure(loc, req.workload, caps=caps, deadline=deadline),
                                    budget=budget,
                                    axes=axes, kld_of=kld_of or kv_pricer(loc, req, st, on_step),
                                    vram_margin_mib=req.vram_margin_mib, on_progress=on_progress,
                                    on_step=on_step)
    notes = [timing_note(req.workload)] if measure is None else []
    if time_s is not None:
        notes.append(budget_note(outcome, time_s))
    front = pareto.frontier_of(st, fs, hw.has_gpu, notes=notes)
    st.set_user_attr("frontier", front.to_dict())
    result = study_result.result_from_study(st)
    result_dir = req.results_dir / name
    if not outcome.interrupted:
        if not front.points and front.paged:
            first = front.paged[0]
            raise UsageError(f"no frontier point: every measured config paged host RAM (trial {first['trial']}: "
                             f"{first['evidence']}); a line that reads its model back from disk is never printed: "
                             f"{first['fix'] or 'free RAM'}")
        if not front.points:
            more = "" if time_s is None else f", or give it more than --time {time_s / 60:.0f}m"
            tried = f" ({counted(front.unmeasured)})" if front.unmeasured else ""
            raise UsageError(f"no frontier config could be measured{tried}: the trial lines say why; lower "
                             f"--max-ctx / raise --vram-margin{more}")
        study_result.write_result(result, result_dir)
    return TuneResult(name, storage, result_dir, result, outcome)
