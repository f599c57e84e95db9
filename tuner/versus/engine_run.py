"""`auto-tune` across engines as one library call (the CLI, the MCP server and scripts/bench_which_engine.py call it;
each renders what it returns): every engine searched with its own levers, the lines that could be printed priced,
then raced against llama.cpp's default in fresh interleaved rounds on the workload, and the result recorded in each
engine's study folder.

Where the time goes, and what is not measured because it cannot change the answer (:mod:`tuner.versus.protocol`):

- **Searches**: each engine's trials, one at a time, each said as its tests end; short llama-bench measurements (they
  only propose lines: the race decides), no KV price per pair tried.
- **The screen**: an engine's best candidate that its search could not tell from that engine's default does not race.
- **Prices, before the race** (:func:`price_gate`): whether the model predicts text at all is learned from the first
  chunk of llama.cpp's own reference (an untrained model: no line's price would say anything, none is run); then each
  line that computes other numbers than llama.cpp's bare launch (another engine, a quantized KV cache) is priced, the
  price stopping once its verdict is clear. A refused line never races (so it never pushes another out); its engine's
  second candidate races in its place. A price that fails leaves its line unpriced, with why, racing all the same.
- **The race**: the lines left, in fresh interleaved rounds of one request each (the reply timed over a few tokens,
  the score the workload's sum of rates), no selection rounds; from the third round on it stops once no line still in
  could become the printed one (:func:`tuner.versus.rule.settled`), and it stops measuring a line decided slower than
  another. After the race only the rule and the records remain: nothing can lose it.
- **The clock** (:mod:`tuner.versus.clock`): what is left, learned from what was measured, and ``--time`` kept across
  the engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import CpuFallbackError, TunerError
from tuner.engine import build, flags
from tuner.machine import hardware
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.quality import engine_price
from tuner.search import autotune, decide, study
from tuner.search.finish import server_load
from tuner.search.result import write_result
from tuner.versus import judge, protocol, rule
from tuner.versus.clock import RunClock, clock_words, trial_tokens
from tuner.versus.engines import EngineChoice, EngineLine, EngineTune, record
from tuner.versus.lines import RESERVE, TUNED, lines_of, with_price
from tuner.versus.standing import Gates

StepFn = Callable[[str], None]
# Fresh rounds only: 3 at least (a verdict needs them), up to 5 while a line is undecided against the default.
RACE_ROUNDS = decide.Rounds(min=3, max=5, select=0)
# Chunks of the corpus a price reads at most (the reference's logits and the line's): the price refuses what differs
# grossly (an engine's bug read 0.6-18 nats a token, a 4-bit cache 0.05 against the 0.01 floor); 2,048 tokens give
# its mean to a few thousandths; the price stops sooner once its verdict is clear.
RACE_PRICE_CHUNKS = 4
CANDIDATES = 2  # each search's best configs beside its default: the best races, the next is its reserve


@dataclass(frozen=True, slots=True)
class SearchHooks:
    """What the run hands each engine's search: when to stop to keep the time budget, and each trial as it ends."""

    should_stop: Callable[[], str | None]
    on_trial: Callable[[study.Progress], None]


TuneFn = Callable[[autotune.TuneRequest, build.EngineLocation, SearchHooks], autotune.TuneResult]


@dataclass(frozen=True, slots=True)
class EnginesRun:
    """What :func:`tune_engines` did: each engine's search, the race and the choice (None: a search was interrupted;
    the rest was not run), the plan it said on start, and where the time went."""

    tunes: tuple[EngineTune, ...]
    choice: EngineChoice | None
    plan: str
    elapsed_s: float
    stages_s: dict[str, float] = field(default_factory=dict)
    clock: str = ""  # the time spent against --time, and what was cut to keep it

    def to_dict(self) -> dict[str, Any]:
        return {"engines": self.choice.to_dict() if self.choice else None, "plan": self.plan,
                "elapsed_s": round(self.elapsed_s, 1), "stages_s": {k: round(v, 1) for k, v in self.stages_s.items()},
                "clock": self.clock,
                "searches": {t.kind.name: {"study": t.result.study_name if t.result else None,
                                           "result_dir": str(t.result.result_dir) if t.result else None,
                                           "trials": t.result.search.trials_this_run if t.result else 0,
                                           "search_s": round(t.result.search.elapsed_s, 1) if t.result else None,
                                           "cut": t.result.search.cut if t.result else None,
                                           "error": t.error} for t in self.tunes}}


# Each engine's search takes at least this many trials when the default budget is split between engines: the seeds
# (the default, the memory model's guess, the engine's own promising levers) and one sampled config.
MIN_TRIALS_EACH = 4


def split_budget(budget: study.Budget, n_engines: int) -> study.Budget:
    """The run's default trial budget shared by ``n_engines`` searches (``--trials`` given: that many each); a time
    budget stays whole: the run's clock keeps it across the engines (:mod:`tuner.versus.clock`)."""
    trials = None if budget.trials is None else max(MIN_TRIALS_EACH, budget.trials // n_engines)
    if trials is None and budget.time_s is not None:
        trials = max(MIN_TRIALS_EACH, autotune.DEFAULT_TRIALS // n_engines)  # the clock cuts what the time lacks
    return study.Budget(trials=trials, time_s=budget.time_s)


def plan_words(req: autotune.TuneRequest, locs: Sequence[build.EngineLocation], rounds: decide.Rounds = RACE_ROUNDS
               ) -> str:
    """What the run will spend, and where, said on start."""
    names = [build.capabilities(loc).kind.name for loc in locs]
    trials, time_s = req.budget.trials, req.budget.time_s
    per = f"{trials} trials each" if trials is not None else "trials as the time allows"
    arms = 2 * len(locs)
    what = "whole agent sessions" if req.session is not None else "one request each"
    price = ("the lines that compute other numbers than llama.cpp's bare launch priced first against its f16 logits "
             f"(up to {price_chunks(req)} chunks of {req.kld_ctx} tokens, stopped once decided; none where the model "
             "predicts no text)") if req.max_kld is not None else "no quality price (--max-kld off)"
    budget = f"; --time {time_s / 60:,.0f} min kept across all of it" if time_s is not None else ""
    return (f"plan: search {', '.join(names)} ({per}); {price}; race up to {arms} lines (each engine's default and "
            f"best candidate, where its search tells them apart) in {rounds.min}-{rounds.max} fresh rounds of {what}, "
            f"stopping once decided{budget}; the time left is said as it is learned")


def tune_engines(req: autotune.TuneRequest, locs: Sequence[build.EngineLocation], hw: Hardware, *,
                 tune: TuneFn | None = None, on_step: StepFn = lambda _: None,
                 rounds: decide.Rounds = RACE_ROUNDS, clock: RunClock | None = None) -> EnginesRun:
    """The whole run across engines (module docstring). ``tune`` runs one engine's search (default: auto-tune's, with
    ``on_step``); the CLI passes its own to draw progress bars. ``clock``: the run's clock (one is made)."""
    start = time.monotonic()
    stages: dict[str, float] = {}
    names = tuple(build.capabilities(loc).kind.name for loc in locs)
    info = inspect_model(req.model)
    measure = req.measure or study.Measure.for_workload(req.workload)
    bare = LaunchConfig(model=req.model, ctx=max(req.workload.context_tokens, autotune.DEFAULT_CTX), parallel=1)
    smeasure = protocol.search_measure(measure, info, bare, hw)
    sent = protocol.race_request(req.workload) or server_load(req.workload)
    clock = clock or RunClock(names, req.budget.trials, rounds, sent.prompt_tokens, sent.gen_tokens, req.kld_ctx,
                              price_chunks(req), req.budget.time_s)
    plan = plan_words(req, locs, rounds)
    on_step(plan)
    one_process = smeasure.gen_depth == smeasure.prompt_depth
    tokens = trial_tokens(smeasure.n_prompt, smeasure.n_gen, smeasure.repetitions, smeasure.prompt_depth,
                          smeasure.gen_depth, one_process)
    if one_process and measure.gen_depth != measure.prompt_depth:
        on_step(f"search trials: one llama-bench process each, the reply timed at the prompt's depth "
                f"({smeasure.prompt_depth}): {measure.gen_depth - measure.prompt_depth} more tokens of context add "
                f"under {protocol.ONE_PROCESS_GROWTH:.0%} to what a token reads")
    # Trials sharing a model load share a llama-bench process (a load of a 17 GiB model with llama.cpp's CPU repack
    # took 45-75 s here, its tests 20): asked in the study's batches; under --time one at a time, so that the budget is
    # asked before each.
    search_req = replace(req, search_only=True, price_kv_in_search=False, top_candidates=CANDIDATES, session=None,
                         measure=smeasure, batch_trials=1 if req.budget.time_s is not None else None,
                         budget=study.Budget(trials=req.budget.trials))
    tunes: list[EngineTune] = []
    for i, loc in enumerate(locs):
        caps = build.capabilities(loc)
        name = caps.kind.name
        on_step(f"engine {i + 1} of {len(locs)}: {caps.identity.describe()}, its search ({loc.bin_dir})")

        def on_trial(p: study.Progress, name: str = name) -> None:
            last = p.last
            if last.elapsed_s is not None:
                clock.trial(name, last.elapsed_s, last.prompt_tok_s, last.gen_tok_s, tokens)

        hooks = SearchHooks(lambda name=name: clock.stop_search(name), on_trial)  # type: ignore[misc]
        run_one = tune or _default_tune(hw, on_step)
        clock.search_begins(name)
        t0 = time.monotonic()
        try:
            res = run_one(search_req, loc, hooks)
        except TunerError as exc:
            if caps.kind.numerics_reference or isinstance(exc, CpuFallbackError):
                raise  # the reference engine, or the machine itself: nothing to race without it
            on_step(f"{name} is left out: {exc}")
            tunes.append(EngineTune(caps.kind, loc, None, str(exc)))
            continue
        finally:
            stages[f"search {name}"] = time.monotonic() - t0
            clock.search_ends(name)
        tunes.append(EngineTune(caps.kind, loc, res))
        if res.search.interrupted:
            return EnginesRun(tuple(tunes), None, plan, time.monotonic() - start, stages, clock.end_words())
        write_result(res.result, res.result_dir)  # its measured configs readable before anything else runs
        if (words := clock.plan_words()) is not None:
            on_step(words)
    lines = lines_of(tunes, hw.physical_cores, _scorer(hw.physical_cores))
    gates = Gates(screened=protocol.screen(lines, rounds.max), held=protocol.reserves(lines))
    for label, why in gates.screened.items():
        on_step(f"{label} {why}")
    t0 = time.monotonic()
    gates, prices = price_gate(lines, gates, req, tunes, on_step, clock)
    stages["prices"] = time.monotonic() - t0
    behind = protocol.screen_behind(lines, gates)
    for label, why in behind.items():
        on_step(f"{label} {why}")
    gates = replace(gates, screened={**gates.screened, **behind})
    lines = list(with_price(lines, prices))
    racing = [x for x in lines if x.label not in {**gates.screened, **gates.refused, **gates.held}]
    clock.arms = len(racing)
    where = {t.kind.name: (t.loc, build.capabilities(t.loc)) for t in tunes}
    t0 = time.monotonic()
    versus = None
    if len(racing) >= 2:
        versus = _race(racing, lines, gates, where, req, rounds, tunes, clock, on_step, hw)
    stages["race"] = time.monotonic() - t0
    printed, reason, against = rule.choose(lines, versus, gates)
    if printed is not None and printed in gates.unpriced:
        reason += f" (unpriced: {gates.unpriced[printed]})"
    left = tuple(f"{t.kind.name}: not raced, its search measured nothing on this model ({t.error})"
                 for t in tunes if t.result is None)
    notes = (*left, *(f"{x}: {why}" for x, why in gates.refused.items()))
    choice = EngineChoice(tuple(lines), versus, printed, reason, notes, against, gates)
    try:
        record(tunes, choice)
    except OSError as exc:  # the answer is printed all the same; only its record is lost, and said
        on_step(f"the race's result could not be written ({exc}): the line below is its answer")
    on_step(f"time: {clock.end_words()}")
    return EnginesRun(tuple(tunes), choice, plan, time.monotonic() - start, stages, clock.end_words())


def _default_tune(hw: Hardware, on_step: StepFn) -> TuneFn:
    def run(r: autotune.TuneRequest, loc: build.EngineLocation, hooks: SearchHooks) -> autotune.TuneResult:
        return autotune.auto_tune(r, loc, hw, on_step=on_step, on_progress=hooks.on_trial,
                                  should_stop=hooks.should_stop)

    return run


def _scorer(cores: int) -> Callable[[EngineTune, LaunchConfig], float | None]:
    """A line's figure in its own engine's search (None: no trial ran as it does)."""
    cache: dict[str, dict[LaunchConfig, float]] = {}

    def score(t: EngineTune, cfg: LaunchConfig) -> float | None:
        if t.result is None:
            return None
        if t.kind.name not in cache:
            cache[t.kind.name] = protocol.search_scores(t.result.result.trials, cores)
        return cache[t.kind.name].get(protocol.search_key(cfg, cores))

    return score


def _race(racing: Sequence[EngineLine], lines: Sequence[EngineLine], gates: Gates,
          where: dict[str, tuple[build.EngineLocation, build.Capabilities]], req: autotune.TuneRequest,
          rounds: decide.Rounds, tunes: Sequence[EngineTune], clock: RunClock, on_step: StepFn,
          hw: Hardware) -> judge.HeadToHead:
    on_step(f"race: {', '.join(x.label for x in racing)}, in {rounds.min}-{rounds.max} fresh interleaved rounds")
    info = inspect_model(req.model)
    pages = {x.label: why for x in racing if (why := protocol.plan_pages(info, x.config, hw)) is not None}
    for label, why in pages.items():
        on_step(f"{label}: the plan says it pages ({why}): one round that reads its model back from disk rules it out")
    stop = rule.settled(lines, max(rounds.min, rounds.max), gates)
    out = rule.out_of_running(lines, gates)

    def settled(v: judge.HeadToHead) -> bool:
        clock.rounds_done = rule.rounds_so_far(v)
        if stop(v):
            return True
        still = len([x for x in racing if x.label not in out(v)])
        if clock.stop_race(still):
            on_step(f"the race stops at round {clock.rounds_done} to keep the time budget")
            return True
        return False

    def on_round(label: str, got: judge.Round, seconds: float) -> None:
        clock.race_round(seconds)
        if not got.score:
            score = "failed"
        elif req.session is None:
            score = f"{1 / got.score:,.1f} s a request"
        else:
            score = f"{got.session_s:,.1f} s a session" if got.session_s else f"score {got.score:,.4g}"
        on_step(f"  {label}: {score} in a {seconds:,.0f} s round; about {clock_words(clock.left_s())} left")

    return judge.head_to_head(
        where[racing[0].engine][0], [(x.label, x.config) for x in racing], req.workload, log_dir=_log_dir(tunes),
        rounds=rounds, session=session_of(req), on_step=on_step, engines={x.label: where[x.engine] for x in racing},
        vram_budget_bytes=hw.vram_budget_bytes or None, settled_by=settled, out_by=out,
        sent=protocol.race_request(req.workload), on_round=on_round, pages_by_plan=pages)


def _log_dir(tunes: Sequence[EngineTune]) -> Path:
    first = next(t.result for t in tunes if t.result is not None)
    return first.result_dir / "engines"


def price_chunks(req: autotune.TuneRequest) -> int:
    return min(req.kld_chunks, RACE_PRICE_CHUNKS)


def session_of(req: autotune.TuneRequest) -> tuple[Any, int | None, int, int] | None:
    """The agent session the race replays (as a single engine's session stage would), or None for single requests."""
    s = req.session
    if s is None:
        return None
    return s.session_file, s.depth_tokens, s.gen_tokens, s.agents


def price_gate(lines: Sequence[EngineLine], gates: Gates, req: autotune.TuneRequest, tunes: Sequence[EngineTune],
               on_step: StepFn = lambda _: None, clock: RunClock | None = None
               ) -> tuple[Gates, dict[str, dict[str, Any]]]:
    """Each line that could be printed and computes other numbers than llama.cpp's bare launch, priced before it
    races (module docstring): the gates with the refused and unpriced lines, and each price taken."""
    held = dict(gates.held)
    refused: dict[str, str] = {}
    unpriced: dict[str, str] = {}
    prices: dict[str, dict[str, Any]] = {}
    out = {**gates.screened}

    def wanted() -> list[EngineLine]:
        return [x for x in lines if x.label not in out and x.label not in held and x.label not in refused
                and x.label not in prices and x.label not in unpriced and engine_price.needs_price(x.config)]

    if not wanted():
        return gates, prices
    if req.max_kld is None:
        for x in wanted():
            unpriced[x.label] = "--max-kld off"
        return replace(gates, unpriced=unpriced), prices
    locs = {t.kind.name: t.loc for t in tunes}
    reference = next((t.loc for t in tunes if t.kind.numerics_reference), None)
    if reference is None:
        for x in wanted():
            unpriced[x.label] = "llama.cpp, whose logits are the reference, is not installed"
        return replace(gates, unpriced=unpriced), prices
    try:
        says = engine_price.reference_says(req.model, reference, ctx=req.kld_ctx, chunks=price_chunks(req),
                                           on_step=on_step)
    except (TunerError, OSError) as exc:
        for x in wanted():
            unpriced[x.label] = f"the reference could not be written ({exc})"
        on_step(f"no line is priced: the reference could not be written ({exc})")
        return replace(gates, unpriced=unpriced), prices
    if clock is not None:
        clock.prices_left = 0 if says.says_nothing else len(wanted())
    if says.says_nothing:
        for x in wanted():
            unpriced[x.label] = says.says_nothing
            prices[x.label] = {"says_nothing": says.says_nothing, "reference_ppl": says.reference_ppl,
                               "kld_mean": None}
        on_step(f"no line is priced: {says.says_nothing}")
        return replace(gates, unpriced=unpriced), prices
    while todo := wanted():
        x = todo[0]
        on_step(f"pricing {x.label} before it races")
        try:
            free = hardware.probe_host().ram_available_bytes
            got = engine_price.price_line(x.config, locs[x.engine], reference, ctx=req.kld_ctx,
                                          chunks=price_chunks(req), available_bytes=free, on_step=on_step,
                                          max_kld=req.max_kld)
        except (TunerError, OSError) as exc:  # a price that fails never loses the run: the line races unpriced
            unpriced[x.label] = f"could not be priced ({exc})"
            on_step(f"{x.label} races unpriced: {unpriced[x.label]}")
            continue
        prices[x.label] = got.to_dict()
        on_step(f"price: {got.describe()}")
        if got.refused_by(req.max_kld):
            refused[x.label] = (f"was refused by its price (mean KLD {got.kld_mean:.4g} against llama.cpp's f16 "
                                f"logits, above --max-kld {req.max_kld:g}): it does not race")
            on_step(f"{x.label} {refused[x.label]}")
            if x.role == TUNED:  # its engine's next candidate races in its place
                for y in lines:
                    if y.engine == x.engine and y.role == RESERVE and y.label in held:
                        del held[y.label]
                        on_step(f"{y.label} races in its place")
    return Gates(refused=refused, unpriced=unpriced, screened=gates.screened, held=held), prices


def price_single(line: LaunchConfig | None, loc: build.EngineLocation, req: autotune.TuneRequest,
                 on_step: StepFn = lambda _: None) -> tuple[engine_price.LinePrice | None, str]:
    """``--engines ik`` alone: the line its auto-tune printed, priced as it runs against llama.cpp's f16 logits where
    llama.cpp is installed; the price (None: not priced) and what to say of it."""
    if line is None or req.max_kld is None:
        return None, "unpriced: --max-kld off" if req.max_kld is None else "no line to price"
    if not engine_price.needs_price(line):
        return None, "no price needed"
    try:
        reference = build.locate_engine(kind=_reference_kind())
    except TunerError:
        return None, ("unpriced: llama.cpp is not installed here to price its numerics against (`moe-tune engine "
                      "install` builds it)")
    on_step(f"pricing the printed line as it runs against {build.capabilities(reference).identity.describe()}")
    got = engine_price.price_line(line, loc, reference, ctx=req.kld_ctx, chunks=req.kld_chunks,
                                  available_bytes=hardware.probe_host().ram_available_bytes, on_step=on_step,
                                  max_kld=req.max_kld)
    return got, got.describe()


def _reference_kind() -> Any:
    from tuner.engine.kinds import KINDS

    return next(k for k in KINDS if k.numerics_reference)


def launch_of(line: EngineLine) -> str:
    """The printed line as the user runs it: llama.cpp's as ``llama-server …`` (the user's own), another engine's by
    its binary's path (its server has the same name)."""
    from tuner.engine.kinds import kind_by_name

    binary = "llama-server" if kind_by_name(line.engine).server_on_path else str(line.binary)
    return flags.launch_line(line.config, binary)
