"""`auto-tune` across engines as one library call (the CLI, the MCP server and scripts/bench_which_engine.py call it;
each renders what it returns): every engine searched with its own levers, its default launch and best candidate
raced against llama.cpp's default in interleaved rounds on the workload, the line the rule prints priced as it runs,
and the result recorded in each engine's study folder.

Where the time goes, and what is cut because it cannot change the answer:

- **Searches**: each engine's trials (llama-bench on the workload), as a single-engine auto-tune runs them, but with no
  KV price per pair tried: a pair is priced only when a line carrying it would be printed.
- **The race**: the lines of :func:`tuner.versus.engines.lines_of` in fresh interleaved rounds, no selection rounds
  (the searches chose the candidates on their own measurements); from the third round on, the rounds stop once every
  line is decided against llama.cpp's default and the faster ones among themselves
  (:func:`tuner.versus.engines.settled`). A single-engine auto-tune's own finish and session stage are not run: the
  race is the finish.
- **Prices**: one reference per model (llama.cpp's f16 logits, shared with every KV price), then only the line the
  rule would print, as it runs (:func:`tuner.quality.engine_price.price_line`); a refused or unpriceable line leaves
  the race with its reason and the rule picks again among the rest, never re-measuring.
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
from tuner.quality import engine_price
from tuner.search import autotune, decide, study
from tuner.versus import judge
from tuner.versus.engines import (
    EngineChoice,
    EngineLine,
    EngineTune,
    choose,
    lines_of,
    out_of_running,
    record,
    settled,
)

StepFn = Callable[[str], None]
TuneFn = Callable[[autotune.TuneRequest, build.EngineLocation], autotune.TuneResult]
# Fresh rounds only: 3 at least (a verdict needs them), up to 5 while a line is undecided against the default.
RACE_ROUNDS = decide.Rounds(min=3, max=5, select=0)
# Chunks of the corpus a race's price reads (the reference's logits and the line's): the price refuses what differs
# grossly (an engine's bug read 0.6-18 nats a token, a 4-bit cache 0.05 against the 0.01 floor); 2,048 tokens give
# its mean to a few thousandths, at half the 8 chunks' time (a 17 GiB model reads ~20 prompt tokens a second here).
RACE_PRICE_CHUNKS = 4
CANDIDATES = 2  # each search's best configs kept (the race takes the best; the next is in the result)
# llama-bench repetitions per search trial: the search only ranks candidates for the race, which decides; two give a
# spread to judge a trial's noise by, and cost a third less than a single engine's three.
SEARCH_REPETITIONS = 2


@dataclass(frozen=True, slots=True)
class EnginesRun:
    """What :func:`tune_engines` did: each engine's search, the race and the choice (None: a search was interrupted;
    the rest was not run), the plan it said on start, and where the time went."""

    tunes: tuple[EngineTune, ...]
    choice: EngineChoice | None
    plan: str
    elapsed_s: float
    stages_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"engines": self.choice.to_dict() if self.choice else None, "plan": self.plan,
                "elapsed_s": round(self.elapsed_s, 1), "stages_s": {k: round(v, 1) for k, v in self.stages_s.items()},
                "searches": {t.kind.name: {"study": t.result.study_name if t.result else None,
                                           "result_dir": str(t.result.result_dir) if t.result else None,
                                           "trials": t.result.search.trials_this_run if t.result else 0,
                                           "search_s": round(t.result.search.elapsed_s, 1) if t.result else None,
                                           "error": t.error} for t in self.tunes}}


# Each engine's search takes at least this many trials when the default budget is split between engines: the seeds
# (the default, the memory model's guess, the engine's own promising levers) and one sampled config.
MIN_TRIALS_EACH = 4


def split_budget(budget: study.Budget, n_engines: int) -> study.Budget:
    """The run's default budget shared by ``n_engines`` searches (``--trials`` given: that many each): a run across
    engines answers in about the time one engine's auto-tune would, the race and its prices on top."""
    trials = None if budget.trials is None else max(MIN_TRIALS_EACH, budget.trials // n_engines)
    time_s = None if budget.time_s is None else budget.time_s / n_engines
    return study.Budget(trials=trials, time_s=time_s)


def plan_words(req: autotune.TuneRequest, locs: Sequence[build.EngineLocation], rounds: decide.Rounds = RACE_ROUNDS
               ) -> str:
    """What the run will spend, and where, said on start."""
    names = [build.capabilities(loc).kind.name for loc in locs]
    trials, time_s = req.budget.trials, req.budget.time_s
    per = ", ".join(x for x in (f"{trials} trials" if trials is not None else "",
                                f"{time_s / 60:.0f} min" if time_s is not None else "") if x) + " each"
    arms = 2 * len(locs)
    what = "whole agent sessions" if req.session is not None else "one request each"
    price = ("then the line to print priced as it runs against llama.cpp's f16 logits (one reference per model; "
             f"{price_chunks(req)} chunks of {req.kld_ctx} tokens a price)") if req.max_kld is not None else \
        "no quality price (--max-kld off)"
    return (f"plan: search {', '.join(names)} ({per}); race up to {arms} lines (each engine's default and best "
            f"candidate) in {rounds.min}-{rounds.max} fresh rounds of {what}, up to {arms * rounds.max} server "
            f"starts, stopping once decided; {price}")


def tune_engines(req: autotune.TuneRequest, locs: Sequence[build.EngineLocation], hw: Hardware, *,
                 tune: TuneFn | None = None, on_step: StepFn = lambda _: None,
                 rounds: decide.Rounds = RACE_ROUNDS) -> EnginesRun:
    """The whole run across engines (module docstring). ``tune`` runs one engine's search (default: auto-tune's, with
    ``on_step``); the CLI passes its own to draw progress bars."""
    start = time.monotonic()
    stages: dict[str, float] = {}
    plan = plan_words(req, locs, rounds)
    on_step(plan)
    run_one = tune or (lambda r, loc: autotune.auto_tune(r, loc, hw, on_step=on_step))
    measure = req.measure or study.Measure.for_workload(req.workload)
    search_req = replace(req, search_only=True, price_kv_in_search=False, top_candidates=CANDIDATES, session=None,
                         measure=replace(measure, repetitions=min(measure.repetitions, SEARCH_REPETITIONS)))
    tunes: list[EngineTune] = []
    for i, loc in enumerate(locs):
        caps = build.capabilities(loc)
        on_step(f"engine {i + 1} of {len(locs)}: {caps.identity.describe()}, its search ({loc.bin_dir})")
        t0 = time.monotonic()
        try:
            res = run_one(search_req, loc)
        except TunerError as exc:
            if caps.kind.numerics_reference or isinstance(exc, CpuFallbackError):
                raise  # the reference engine, or the machine itself: nothing to race without it
            on_step(f"{caps.kind.name} is left out: {exc}")
            tunes.append(EngineTune(caps.kind, loc, None, str(exc)))
            continue
        finally:
            stages[f"search {caps.kind.name}"] = time.monotonic() - t0
        tunes.append(EngineTune(caps.kind, loc, res))
        if res.search.interrupted:
            return EnginesRun(tuple(tunes), None, plan, time.monotonic() - start, stages)
    lines = lines_of(tunes)
    where = {t.kind.name: (t.loc, build.capabilities(t.loc)) for t in tunes}
    t0 = time.monotonic()
    versus = None
    if len(lines) >= 2:
        on_step(f"race: {', '.join(x.label for x in lines)}, in {rounds.min}-{rounds.max} fresh interleaved rounds")
        versus = judge.head_to_head(
            where[lines[0].engine][0], [(x.label, x.config) for x in lines], req.workload,
            log_dir=_log_dir(tunes), rounds=rounds, session=session_of(req), on_step=on_step,
            engines={x.label: where[x.engine] for x in lines}, vram_budget_bytes=hw.vram_budget_bytes or None,
            settled_by=settled(lines, max(rounds.min, rounds.max)), out_by=out_of_running(lines))
    stages["race"] = time.monotonic() - t0
    t0 = time.monotonic()
    choice = price_and_choose(lines, versus, req, tunes, on_step)
    stages["prices"] = time.monotonic() - t0
    left = tuple(f"{t.kind.name}: not raced, its search measured nothing on this model ({t.error})"
                 for t in tunes if t.result is None)
    choice = replace(choice, refused=(*left, *choice.refused))
    record(tunes, choice)
    return EnginesRun(tuple(tunes), choice, plan, time.monotonic() - start, stages)


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


def price_and_choose(lines: Sequence[EngineLine], versus: judge.HeadToHead | None, req: autotune.TuneRequest,
                     tunes: Sequence[EngineTune], on_step: StepFn = lambda _: None) -> EngineChoice:
    """The rule's line, priced as it runs before it is printed; a line refused by its price (or that cannot be priced)
    leaves with its reason and the rule picks again from the same rounds."""
    locs = {t.kind.name: t.loc for t in tunes}
    reference = next((t.loc for t in tunes if t.kind.numerics_reference), None)
    refused: dict[str, str] = {}
    prices: dict[str, dict[str, Any]] = {}
    while True:
        label, reason, against = choose(lines, versus, refused)
        line = next((x for x in lines if x.label == label), None)
        if line is None or req.max_kld is None or label in prices or not engine_price.needs_price(line.config):
            break
        if reference is None:
            refused[line.label] = "could not be priced: llama.cpp, whose logits are the reference, is not installed"
            continue
        on_step(f"pricing {line.label} as it runs, before it is printed")
        try:
            free = hardware.probe_host().ram_available_bytes
            got = engine_price.price_line(line.config, locs[line.engine], reference, ctx=req.kld_ctx,
                                          chunks=price_chunks(req), available_bytes=free, on_step=on_step)
        except TunerError as exc:
            refused[line.label] = f"could not be priced ({exc})"
            on_step(f"{line.label} leaves the race: {refused[line.label]}")
            continue
        prices[line.label] = got.to_dict()
        on_step(f"price: {got.describe()}")
        if got.refused_by(req.max_kld):
            refused[line.label] = (f"was refused by its price (mean KLD {got.kld_mean:.4g} against llama.cpp's f16 "
                                   f"logits, above --max-kld {req.max_kld:g})")
            on_step(f"{line.label} {refused[line.label]}")
    priced = tuple(replace(x, price=prices.get(x.label)) for x in lines)
    shown = next((x for x in priced if x.label == label), None)
    if shown is not None and req.max_kld is None and engine_price.needs_price(shown.config):
        reason += " (unpriced: --max-kld off)"
    elif shown is not None and shown.price and shown.price.get("says_nothing"):
        reason += f" (unpriced: {shown.price['says_nothing']})"
    notes = tuple(f"{x}: {why}" for x, why in refused.items())
    return EngineChoice(priced, versus, label, reason, notes, against)


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
                                  available_bytes=hardware.probe_host().ram_available_bytes, on_step=on_step)
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
