"""`auto-tune --frontier` as a library call: the context ladder, the frontier study, its trials measured with the
real engine at the depth each context allows, and the front stored in result.json.

Single-request trials are llama-bench runs (the prompt at its depth, generation at the slot's end), scored by
one request's time as every trial is; concurrent trials are llama-batched-bench runs of ``slots`` requests at
once (:mod:`tuner.measure.batched`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import groupby

from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import build
from tuner.frontier import pareto
from tuner.machine.hardware import Hardware
from tuner.measure import batched, bench, failures
from tuner.measure.workload import Workload
from tuner.models.gguf_reader import inspect_model
from tuner.quality.kv_price import KvPrice
from tuner.search import result as study_result
from tuner.search import space, study
from tuner.search.autotune import TuneRequest, TuneResult, choose_ctx, kv_pricer

MAX_GEN_TOKENS = 64  # generation timed per trial; speed at a depth does not depend on how many tokens are timed


def engine_measure(loc: build.EngineLocation, load: Workload, *, caps: build.Capabilities | None = None,
                   repetitions: int = 2, timeout_s: float = 1800.0) -> pareto.MeasureFn:
    """The real measurement of frontier trials (the fake runner in the tests replaces only this)."""
    request = replace(load, depth_tokens=None)

    def single(plans: Sequence[pareto.Plan]) -> list[pareto.Measured | failures.Failure]:
        out: dict[int, pareto.Measured | failures.Failure] = {}
        keyed = sorted(enumerate(plans), key=lambda ip: (ip[1].prompt_depth, ip[1].gen_depth))
        for (pd, gd), group in groupby(keyed, key=lambda ip: (ip[1].prompt_depth, ip[1].gen_depth)):
            items = list(group)
            results = bench.run_bench_many(loc, [p.config for _, p in items], n_prompt=load.prompt_tokens,
                                           n_gen=min(load.gen_tokens, MAX_GEN_TOKENS), depth=pd, gen_depth=gd,
                                           repetitions=repetitions, timeout_s=timeout_s, caps=caps)
            for (i, _), res in zip(items, results, strict=True):
                if isinstance(res, failures.Failure):
                    out[i] = res
                    continue
                pp, tg = res.row("pp").spread, res.row("tg").spread
                out[i] = pareto.Measured(request.request_s(pp.median, tg.median), tg.median, pp.median,
                                           cv_pct=max(pp.cv_pct, tg.cv_pct), repetitions=repetitions,
                                           argv=res.argv)
        return [out[i] for i in range(len(plans))]

    def concurrent(plans: Sequence[pareto.Plan]) -> list[pareto.Measured | failures.Failure]:
        out: list[pareto.Measured | failures.Failure] = []
        for p in plans:
            try:
                # The whole history is each request's prompt, as the finish's server trials send it.
                r = batched.run_batched(loc, p.config, n_prompt=p.gen_depth, n_gen=load.gen_tokens,
                                        repetitions=repetitions, timeout_s=timeout_s, caps=caps)
            except failures.TrialFailedError as exc:
                out.append(exc.failure)
                continue
            out.append(pareto.Measured(r.request_s, r.per_request_gen_tok_s, None, r.aggregate_gen_tok_s,
                                         r.cv_pct, repetitions, r.argv))
        return out

    return concurrent if load.concurrency > 1 else single


def default_trials(fs: pareto.FrontierSpace) -> int:
    return pareto.TRIALS_PER_POINT * len(fs.points)


def tune_frontier(req: TuneRequest, loc: build.EngineLocation, hw: Hardware, *, max_ctx: int | None = None,
                  steps: int = pareto.LADDER_STEPS, trials: int | None = None,
                  measure: pareto.MeasureFn | None = None,
                  kld_of: Callable[[LaunchConfig], KvPrice | None] | None = None,
                  on_progress: Callable[[study.Progress], None] | None = None,
                  on_step: Callable[[str], None] | None = None) -> TuneResult:
    """The frontier study for ``req``'s model and workload; ``trials`` None: :func:`default_trials`."""
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
                                       slots=slots, vram_margin_mib=req.vram_margin_mib)
    axes = pareto.Axes(fs.concurrent, kld=req.max_kld is not None)
    name = pareto.study_name(req.model, hw, f"{caps.commit or 'unknown'}-{caps.backend}", fs, req.workload, axes)
    storage = req.storage or study.default_storage(req.results_dir)
    st, created = pareto.create_or_load(name, storage, axes, seed=req.seed)
    if created:
        pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, hw, req.vram_margin_mib))
    st.set_user_attr("model", str(req.model))
    st.set_user_attr("hardware", {"describe": hw.describe(), "gpu": hw.gpu_name, "has_gpu": hw.has_gpu,
                                  "vram_budget_bytes": hw.vram_budget_bytes, "physical_cores": hw.physical_cores})
    st.set_user_attr("engine", {"commit": caps.commit, "version": caps.version, "backend": caps.backend})
    st.set_user_attr("workload", req.workload.describe())
    st.set_user_attr("objective", {"frontier": list(axes.names), "max_kld": req.max_kld})
    budget = study.Budget(trials=trials or default_trials(fs), time_s=req.budget.time_s)
    if on_step:
        on_step(f"frontier: contexts {', '.join(map(str, fs.contexts))}; slots {', '.join(map(str, fs.slots))}; "
                f"{budget.trials} trials; objectives {', '.join(axes.names)}")
    outcome = pareto.run_frontier(st, fs, info, hw, req.workload,
                                    measure or engine_measure(loc, req.workload, caps=caps), budget=budget,
                                    axes=axes, kld_of=kld_of or kv_pricer(loc, req, st, on_step),
                                    vram_margin_mib=req.vram_margin_mib, on_progress=on_progress)
    front = pareto.frontier_of(st, fs, hw.has_gpu)
    st.set_user_attr("frontier", front.to_dict())
    result = study_result.result_from_study(st)
    result_dir = req.results_dir / name
    if not outcome.interrupted:
        if not front.points:
            raise UsageError("no frontier config could be measured: see the failures in the report, or lower "
                             "--max-ctx / raise --vram-margin")
        study_result.write_result(result, result_dir)
    return TuneResult(name, storage, result_dir, result, outcome)
