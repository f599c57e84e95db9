"""`auto-tune` as a library call: space → seeded constrained search → server re-measure → stored result.

A Python user can call :func:`auto_tune` directly; the CLI only parses options and prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.config import CacheType, LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import build
from tuner.engine.identity import REPLAY_COMMIT, replay_note
from tuner.machine.hardware import Hardware
from tuner.machine.interrupt import sigterm_as_ctrl_c
from tuner.measure import engine_memory, failures, gpu_use
from tuner.measure.engine_memory import EngineMemory
from tuner.measure.workload import Workload
from tuner.models import fingerprint
from tuner.models.gguf_reader import ModelInfo, inspect_model
from tuner.plan.memory import FIT_MARGIN_BYTES, MIB, effective_config
from tuner.plan.placement import largest_fitting_ctx, placed_by_fit
from tuner.plan.pricing import Price
from tuner.plan.roofline import Roofline, roofline
from tuner.quality import kv_price
from tuner.quality.kv_price import KvPrice
from tuner.search import finish, proposals, session_stage, space, speculation, study
from tuner.search import result as study_result
from tuner.search.budget import DEFAULT_TRIALS

DEFAULT_CTX = 4096
UNSUPPORTED = failures.FailureKind.UNSUPPORTED_MODEL.value
TOP_CANDIDATES = 2


FINISH_PENDING = "finish_pending"  # study attribute: the search ended, its finish has not (Ctrl-C, a crash)


@dataclass(frozen=True, slots=True)
class TuneRequest:
    model: Path
    workload: Workload
    min_ctx: int | None = None
    goal_context: bool = False
    parallel: int | None = None
    # Quality floor: the largest mean KLD (vs the f16 cache) a KV pair may cost; None: no floor (--max-kld off).
    max_kld: float | None = kv_price.DEFAULT_MAX_KLD
    # How the KL-divergence is measured (llama-perplexity over the bundled corpus, once per model and KV pair).
    kld_ctx: int = kv_price.PRICE_CTX
    kld_chunks: int = kv_price.PRICE_CHUNKS
    vram_margin_mib: float | None = None
    pareto: bool = False
    budget: study.Budget = study.Budget(trials=DEFAULT_TRIALS)
    measure: study.Measure | None = None  # None: study.Measure.for_workload(workload)
    min_tok_s: float | None = None  # per-request generation floor for concurrent workloads
    rounds: finish.Rounds = finish.DEFAULT_ROUNDS
    storage: str | None = None
    results_dir: Path = Path("results")
    top_candidates: int = TOP_CANDIDATES
    seed: int | None = 0
    # Speculative decoding judged on the winner after the finish (tuner.search.speculation); None: not tried.
    speculation: speculation.SpeculationRequest | None = None
    device: str | None = None  # -dev of every config: "none" measures the CPU on purpose
    # The agent workload: whole sessions decide between the defaults, the winner and its prompt-reuse settings.
    session: session_stage.SessionRequest | None = None
    # Lines others measured (`--seed-from`): seeds beside the default, --fit and the memory model's guess.
    proposals: tuple[proposals.Proposal, ...] = ()
    # Stop after the search with its best configs (``TuneResult.candidates``), for a caller that judges them
    # itself (the GPU check's interleaved comparison on live servers); no finish, no session stage.
    search_only: bool = False
    # Price each KV pair when a trial first tries it (the single engine's search: the gate refuses a pair over
    # --max-kld before it is measured). False: the search measures speed only and the caller prices the lines it
    # would print (the engines' race: tuner.versus.engine_run), one price per printed pair, not one per pair tried.
    price_kv_in_search: bool = True
    # Trials asked and measured together (configs sharing a model load share a llama-bench process); None: the
    # study's batch. The engines' run asks one at a time: each trial told as it ends, its time budget kept per trial.
    batch_trials: int | None = None


@dataclass(frozen=True, slots=True)
class TuneResult:
    study_name: str
    storage: str
    result_dir: Path
    result: study_result.StudyResult
    search: study.SearchOutcome
    session: session_stage.SessionStage | None = None
    # With ``search_only``: the search's best configs, best first, and the engine's own launch they are judged against
    # (the bare default; under a VRAM budget that the bare launch would not keep, --fit's placement within it).
    candidates: tuple[LaunchConfig, ...] = ()
    default: LaunchConfig | None = None


def choose_ctx(req: TuneRequest, info: ModelInfo, hw: Hardware, parallel: int) -> int:
    need = req.workload.context_tokens
    if req.goal_context:
        # The largest context the memory model lets fit with compact q8_0 KV at any --n-cpu-moe that fits
        # (host RAM may cap how many experts can go to the host).
        probe = LaunchConfig(model=req.model, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
                             parallel=parallel)
        ctx, _ = largest_fitting_ctx(info, probe, hw, engine_memory.in_force())
        if ctx < need * parallel:
            raise UsageError(f"no context of {need * parallel} tokens fits this machine: use a smaller model")
        return ctx
    ctx = req.min_ctx or max(DEFAULT_CTX, need) * parallel
    if ctx > info.ctx_train:
        raise UsageError(f"--min-ctx {ctx} is beyond the model's training context {info.ctx_train}: lower it")
    if ctx // parallel < need:
        raise UsageError(f"{ctx} tokens over {parallel} slots leave less than the workload's {need} per request: "
                         "raise --min-ctx")
    return ctx


def kv_pricer(loc: build.EngineLocation, req: TuneRequest, st: Any, on_step: Callable[[str], None] | None = None
              ) -> Callable[[LaunchConfig], KvPrice | None]:
    """The KV pair's quality cost, priced once per model and pair (and cached on disk across runs), the prices
    kept on the study; None for every pair with ``--max-kld off``."""
    prices: dict[tuple[CacheType, CacheType], KvPrice] = {}

    def kld_of(cfg: LaunchConfig) -> KvPrice | None:
        if req.max_kld is None:
            return None
        key = (cfg.cache_type_k, cfg.cache_type_v)
        if key not in prices:
            prices[key] = kv_price.price(loc, req.model, *key, ctx=req.kld_ctx, chunks=req.kld_chunks,
                                         on_step=on_step)
            st.set_user_attr("kv_prices", [p.to_dict() for p in prices.values()])
        return prices[key]

    return kld_of


@sigterm_as_ctrl_c()  # a run stopped by SIGTERM tells its trials as Ctrl-C does
def auto_tune(req: TuneRequest, loc: build.EngineLocation, hw: Hardware, *,
              on_progress: Callable[[study.Progress], None] | None = None,
              on_step: Callable[[str], None] | None = None,
              should_stop: Callable[[], str | None] | None = None) -> TuneResult:
    """The whole tune; every memory verdict in it (the space's --n-cpu-moe range, the gate before each trial, the
    seeds) follows the engine's own projection (:mod:`tuner.measure.engine_memory`), the replay its first guess.
    ``should_stop``: asked before each trial batch (:func:`tuner.search.study.run_search`)."""
    mem = EngineMemory.of(loc)
    with engine_memory.deciding(mem):
        return _auto_tune(req, loc, hw, mem, on_progress, on_step, should_stop)


def _memory_steps(mem: EngineMemory, said: set[str], on_step: Callable[[str], None] | None) -> None:
    """Say each memory note once: the replay's commit where the engine is another build, each drift."""
    whose = replay_note(mem.engine)
    for note in ([whose] if whose else []) + mem.notes:
        if on_step and note not in said:
            on_step(note)
        said.add(note)


def _auto_tune(req: TuneRequest, loc: build.EngineLocation, hw: Hardware, mem: EngineMemory,
               on_progress: Callable[[study.Progress], None] | None,
               on_step: Callable[[str], None] | None,
               should_stop: Callable[[], str | None] | None = None) -> TuneResult:
    hw = gpu_use.preflight(loc, hw, req.device)  # a GPU rig measured on the CPU stops here, not after
    caps = build.capabilities(loc)
    info = inspect_model(req.model)
    parallel = req.parallel or req.workload.concurrency
    if on_step and caps.kind.projects_memory:
        on_step(f"memory: {mem.engine.name}'s own projection (llama-fit-params) decides what fits, each distinct "
                "config asked once and cached; the replay's figures are its first guess")
    elif on_step:
        on_step(f"memory: {mem.engine.name} has no projection of its own (no llama-fit-params): the replay of "
                f"llama.cpp {REPLAY_COMMIT} decides what fits; each load's own buffer sizes are kept with its trial")
    ctx = choose_ctx(req, info, hw, parallel)

    def space_by(price: Price) -> space.SearchSpace:
        with engine_memory.deciding(price):
            return space.build_space(req.model, info, hw, ctx=ctx, parallel=parallel,
                                     prompt_tokens=req.workload.prompt_tokens, concurrency=req.workload.concurrency,
                                     vram_margin_mib=req.vram_margin_mib, device=req.device,
                                     fa_kernels=caps.fa_kernels, kind=caps.kind)

    # A card's --n-cpu-moe bounds ask a projection per end and KV pair and ubatch: made several at a time, as many as
    # the card holds beside the run's margin (tuner.measure.projection_load).
    margin = int(req.vram_margin_mib * MIB) if req.vram_margin_mib is not None else FIT_MARGIN_BYTES
    sp = mem.prefetched(space_by, margin_bytes=margin) if hw.has_gpu else space_by(mem)
    said: set[str] = set()
    _memory_steps(mem, said, on_step)
    if on_step:
        for note in (sp.n_cpu_moe_why, *sp.left_out):  # what the space spans and what it leaves out, and why
            if note:
                on_step(note)
    objective = study.Objective(pareto=req.pareto, max_kld=req.max_kld)
    measure = req.measure or study.Measure.for_workload(req.workload)
    name = study.study_name(req.model, hw, caps, sp, measure, objective)
    storage = req.storage or study.default_storage(req.results_dir)
    if on_step and loc.has("llama-fit-params"):
        on_step("asking llama-fit-params for llama.cpp's own --fit choice")
    fit = finish.fit_config(loc, finish.default_config(sp), info.n_layer,
                            fit_target=finish.fit_target_mib(hw, req.vram_margin_mib))
    seeds = finish.seed_configs(sp, info, hw, fit, req.vram_margin_mib)
    default, fit = finish.own_choice(sp, info, hw, fit, req.vram_margin_mib)  # both budgets kept
    shared = proposals.adapt(req.proposals, sp, info, hw, engine_commit=caps.commit,
                             vram_margin_mib=req.vram_margin_mib, known=[s for s in seeds if s[0] != "memory-model"])
    for note in shared.notes:
        if on_step:
            on_step(note)
    # Proposed lines go right after llama.cpp's own choices (inside a small budget they are measured); the memory
    # model's guess, when it is the same config as one, is measured once under the proposal's label.
    seeds = [s for s in seeds if s[0] != "memory-model"] + list(shared.seeds) + [
        s for s in seeds if s[0] == "memory-model" and all(s[1] != c for _, c in shared.seeds)]
    # Seeds go in right after creation, by the creating process only: a shared study gets them once. Proposals are
    # new labels: a study made before gets them too.
    st, created = study.create_or_load(name, storage, objective, seed=req.seed)
    if created:
        study.enqueue_seeds(st, sp, seeds)
    elif shared.seeds:
        study.enqueue_seeds(st, sp, shared.seeds)
    if shared.origins:
        origins = st.user_attrs.get(proposals.SEED_ORIGINS_ATTR, {}) | shared.origins
        st.set_user_attr(proposals.SEED_ORIGINS_ATTR, origins)
    st.set_user_attr("model", str(req.model))
    st.set_user_attr("model_fingerprint", fingerprint.fingerprint(req.model))  # what `serve` checks the file by
    st.set_user_attr("hardware", {"describe": hw.describe(), "gpu": hw.gpu_name, "has_gpu": hw.has_gpu,
                                  "vram_total_bytes": hw.vram_total_bytes, "ram_total_bytes": hw.ram_total_bytes,
                                  "vram_budget_bytes": hw.vram_budget_bytes, "physical_cores": hw.physical_cores,
                                  "ram_available_bytes": hw.ram_available_bytes,
                                  "n_cpu_moe_why": sp.n_cpu_moe_why})
    # Where the engine's binaries were: a line of an engine other than llama.cpp names its server by this path.
    st.set_user_attr("engine", caps.identity.to_dict() | {"bin_dir": str(loc.bin_dir)})
    st.set_user_attr("memory_figures", mem.summary())
    st.set_user_attr("workload", req.workload.describe())
    st.set_user_attr("measure", {"n_prompt": measure.n_prompt, "n_gen": measure.n_gen,
                                 "prompt_depth": measure.prompt_depth, "gen_depth": measure.gen_depth,
                                 "repetitions": measure.repetitions, "quiet_repetitions": measure.quiet_repetitions})
    st.set_user_attr("objective", {"pareto": req.pareto, "max_kld": req.max_kld,
                                   "max_kld_default": kv_price.DEFAULT_MAX_KLD, "min_tok_s": req.min_tok_s,
                                   "goal": "context" if req.goal_context else "speed"})

    kld_of = kv_pricer(loc, req, st, on_step)

    if st.user_attrs.get(FINISH_PENDING):
        # The last run's search ended and its finish was cut short: finish it, do not spend a new budget.
        if on_step:
            on_step("this study's search is complete and its finish was interrupted: going straight to the finish")
        outcome = study.SearchOutcome(st.study_name, 0, False, 0.0)
    else:
        outcome = study.run_search(st, sp, info, hw, loc, budget=req.budget, measure=measure, objective=objective,
                                   caps=caps, vram_margin_mib=req.vram_margin_mib,
                                   kld_of=kld_of if req.price_kv_in_search else None,
                                   on_progress=on_progress, should_stop=should_stop, on_test=on_step,
                                   **({"batch_trials": req.batch_trials} if req.batch_trials else {}))
        if on_step and outcome.cut:
            on_step(f"search stopped after {outcome.trials_this_run} trials: {outcome.cut}")
        if on_step and outcome.exhausted:
            on_step("every config of the search space is in the study: the search stopped early")
        if on_step and outcome.drift:
            on_step(outcome.drift)
        _memory_steps(mem, said, on_step)
        st.set_user_attr("memory_figures", mem.summary())
        if on_step:
            on_step(mem.describe())
    result_dir = req.results_dir / name
    if outcome.interrupted:
        return TuneResult(name, storage, result_dir, study_result.result_from_study(st), outcome)
    recs = study.records(st)
    if not any(r.status == "measured" for r in recs):
        kld = f", raise --max-kld (now {req.max_kld})" if req.max_kld is not None else ""
        first = next((r.failure for r in recs if r.failure and r.failure.get("reason")), None)
        if first is not None and first.get("kind") == UNSUPPORTED and all(
                (r.failure or {}).get("kind") == UNSUPPORTED for r in recs if r.status == "failed"):
            raise UsageError(f"{caps.identity.name} cannot run {req.model.name}: {first['reason']}; tune it with "
                             "another engine (--engines llama.cpp)")
        failed = str(first["reason"]) if first is not None else None
        first_words = f" (the first failure: {failed[:300]})" if failed else ""
        raise UsageError(f"no config could be measured{first_words}: see the failures in the report, or raise "
                         f"--vram-margin / lower --min-ctx{kld}")
    st.set_user_attr(FINISH_PENDING, True)
    baselines = finish.baseline_configs(sp, hw, fit, req.vram_margin_mib, default)
    # A candidate that runs exactly as a baseline (its flags only spell the engine's defaults) is the baseline:
    # measured once, under the baseline's simpler launch line. Concurrent workloads keep their best candidate,
    # whose slot counts the finish measures.
    same_as_baseline = [cfg for _, cfg in baselines] if len(sp.slots) < 2 else []
    top = study.top_configs(recs, req.top_candidates, exclude=same_as_baseline, model=req.model,
                            same=lambda cfg: effective_config(cfg, hw.physical_cores))
    if req.search_only:
        st.set_user_attr(FINISH_PENDING, False)
        own = baselines[0][1] if baselines else default
        return TuneResult(name, storage, result_dir, study_result.result_from_study(st), outcome,
                          candidates=tuple(cfg for _, cfg in top), default=own)

    roofs: dict[LaunchConfig, Roofline] = {}

    def roof(cfg: LaunchConfig) -> Roofline:
        # A line that leaves placement to llama.cpp's --fit is priced as fit places it, not as every weight on the card,
        # by the engine's own projection of the card's need.
        if cfg not in roofs:
            roofs[cfg] = roofline(info, placed_by_fit(info, cfg, hw, engine_memory.in_force(), engine=caps.kind), hw)
        return roofs[cfg]

    done = finish.finish(loc, [(rec.number, cfg) for rec, cfg in top], baselines, req.workload,
                         log_dir=result_dir / "logs", caps=caps, roofline_of=roof, kld_of=kld_of, slots=sp.slots,
                         min_tok_s=req.min_tok_s, rounds=req.rounds, on_step=on_step,
                         vram_budget_bytes=hw.vram_budget_bytes or None)
    if req.speculation is not None:
        done = speculation.after_finish(loc, st, done, info, hw, req.speculation, req.workload, result_dir=result_dir,
                                        caps=caps, on_step=on_step)
    st.set_user_attr("finish", done.to_dict())
    sessions = None
    if req.session is not None and done.winner is not None:
        sessions = session_stage.run_stage(loc, default, study.config_from_dict(done.winner.config),
                                           info, hw, req.session, result_dir=result_dir, caps=caps,
                                           vram_margin_mib=req.vram_margin_mib, on_step=on_step, st=st)
    st.set_user_attr(FINISH_PENDING, False)
    result = study_result.result_from_study(st)
    study_result.write_result(result, result_dir)  # the data; report.md and plots are the caller's to draw
    return TuneResult(name, storage, result_dir, result, outcome, sessions)
