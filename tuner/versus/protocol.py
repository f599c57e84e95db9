"""What the engines' run measures, and no more: each search only proposes lines for the race, and the race's fresh
interleaved rounds decide, so the searches measure short and the race measures rates where the workload's time is a
sum of rates.

- **The searches** (:func:`search_measure`): one llama-bench process per trial where the context the reply adds
  changes the bytes a token reads by less than :data:`ONE_PROCESS_GROWTH` (the generation test then runs at the
  prompt's depth; the separate process it replaces loaded the model again and filled the reply's depth again); a
  prompt of at most :data:`SEARCH_PROMPT_TOKENS` where no ubatch above the default is searched (a prompt rate per token
  is the same over 256 tokens as over 512 at the default ubatch on the CPU: the matrix products see the same batch
  shape, one ubatch); one repetition after llama-bench's warm-up.
- **The screen** (:func:`screen`): an engine's best candidate races only where its search measured it far enough
  ahead of that engine's own default for the race to tell them apart within its rounds; otherwise the race could only
  leave it undecided, and llama.cpp's rule would print the default anyway.
- **The race** (:func:`race_request`): one request per round (the rounds are the repetitions), its reply timed over
  :data:`RACE_GEN_TOKENS` tokens, the score the workload's own: its prompt tokens over the prompt rate plus its
  generated tokens over the generation rate (:meth:`tuner.measure.workload.Workload.score`), as it always was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from tuner.core.config import LaunchConfig
from tuner.machine.hardware import Hardware
from tuner.measure.engine_memory import price
from tuner.measure.workload import Workload
from tuner.models.gguf_reader import ModelInfo
from tuner.plan.memory import DEFAULT_UBATCH, effective_config
from tuner.plan.ram import ram_side
from tuner.plan.roofline import roofline
from tuner.search import study
from tuner.search.finish import server_load
from tuner.search.trials import TrialRecord, config_from_dict
from tuner.search.verdict import MIN_ROUNDS, t995
from tuner.versus.lines import DEFAULT, REFERENCE, RESERVE, TUNED, EngineLine
from tuner.versus.standing import Gates

SEARCH_PROMPT_TOKENS = 256
SEARCH_GEN_TOKENS = 32
SEARCH_REPETITIONS = 1
# The reply's depth is measured apart only where it makes a token read this much more than at the prompt's depth.
ONE_PROCESS_GROWTH = 0.05
RACE_GEN_TOKENS = 32
# The race's round-to-round noise before it has measured its own: the chat race on the Qwen3-30B-A3B shape on this
# project's 2-core machine read ik tuned at 1.76x llama.cpp's default, 99 % 1.43-2.16x over 3 rounds
# (results/benchmarks/which-engine-cpu.md, run3): a per-round spread of ln(2.16/1.43)/2 * sqrt(3) / t995(2) = 3.6 %.
NOISE_PRIOR_PCT = 3.6
# How far one llama-bench repetition of a trial may stray from the line's figure (a 1-repetition ratio of two trials
# in one engine's search carries both errors).
SEARCH_ERROR_PCT = 2.0
# How far a line's search figure may trail the best line's before the race is spared it. Searches' figures come from
# separate processes, one repetition each, the page cache as the trial before left it: on the Qwen3-30B-A3B shape
# (results/benchmarks/which-engine-cpu.md, this turn's first chat run) they were 0.78-1.29x the race's medians of the
# same lines (ik's default, the first trial after llama.cpp's resident lines, the most pessimistic). A line 1.3x behind
# the best is left out: the race's answer changes only if both figures strayed to the ends of that spread.
CROSS_MARGIN = 1.3


def search_measure(req_measure: study.Measure, info: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> study.Measure:
    """The measurement each search trial makes (module docstring)."""
    m = req_measure
    n_prompt = m.n_prompt if m.n_prompt > DEFAULT_UBATCH else min(m.n_prompt, SEARCH_PROMPT_TOKENS)
    gen_depth = m.prompt_depth if reply_growth(info, cfg, hw, m.prompt_depth, m.gen_depth) < ONE_PROCESS_GROWTH \
        else m.gen_depth
    return replace(m, n_prompt=n_prompt, n_gen=min(m.n_gen, SEARCH_GEN_TOKENS), repetitions=SEARCH_REPETITIONS,
                   quiet_repetitions=SEARCH_REPETITIONS, gen_depth=gen_depth,
                   request_gen_tokens=m.request_gen_tokens or m.n_gen,
                   request_prompt_tokens=m.request_prompt_tokens or m.n_prompt)


def reply_growth(info: ModelInfo, cfg: LaunchConfig, hw: Hardware, prompt_depth: int, gen_depth: int) -> float:
    """How much more a generated token reads at ``gen_depth`` than at ``prompt_depth`` (the KV cache filled in
    between), as a share of what it reads at ``prompt_depth`` (:func:`tuner.plan.roofline.roofline`)."""
    if gen_depth <= prompt_depth:
        return 0.0
    at = roofline(info, cfg, hw, prompt_depth)
    later = roofline(info, cfg, hw, gen_depth)
    before = at.gpu_bytes_per_token + at.host_bytes_per_token
    after = later.gpu_bytes_per_token + later.host_bytes_per_token
    return (after - before) / before if before else math.inf


def race_request(load: Workload) -> Workload | None:
    """What each race round sends (None: the workload's whole request, as the finish sends it: a concurrent
    workload's score is its aggregate rate over whole requests)."""
    if load.concurrency > 1:
        return None
    sent = server_load(load)
    return replace(sent, gen_tokens=min(sent.gen_tokens, RACE_GEN_TOKENS), rounds=1)


def decidable_ratio(noise_pct: float, rounds: int) -> float:
    """The smallest ratio ``rounds`` rounds at ``noise_pct`` per-round spread can decide at 99 %
    (:func:`tuner.search.verdict.compare`'s interval: t * sd / sqrt(n) around the mean log ratio)."""
    n = max(MIN_ROUNDS, rounds)
    return math.exp(t995(n - 1) * noise_pct / 100 / math.sqrt(n))


def screen_margin(max_rounds: int, noise_pct: float = NOISE_PRIOR_PCT) -> float:
    """How far ahead of its engine's default a candidate's search figure must be to race: what the race could decide in
    ``max_rounds`` rounds, less what one search repetition of each may stray (7.4 % less 4 %: 1.035 with the priors)."""
    return decidable_ratio(noise_pct, max_rounds) / (1 + 2 * SEARCH_ERROR_PCT / 100)


def search_key(cfg: LaunchConfig, cores: int) -> LaunchConfig:
    """What a line runs as in llama-bench: its engine's defaults spelled out, the host prompt cache (which llama-bench
    has none of) left out."""
    return replace(effective_config(cfg, cores), cache_ram_mib=None)


def search_scores(trials: Sequence[TrialRecord], cores: int) -> dict[LaunchConfig, float]:
    """Each measured config's best search figure (requests per second), keyed as :func:`search_key`."""
    out: dict[LaunchConfig, float] = {}
    for r in trials:
        if r.status == "measured" and r.score is not None and r.config:
            key = search_key(config_from_dict(r.config), cores)
            out[key] = max(out.get(key, 0.0), r.score)
    return out


def screen(lines: Sequence[EngineLine], max_rounds: int) -> dict[str, str]:
    """The tuned lines not worth a race, label → why: each one whose search figure is within :func:`screen_margin` of
    its engine's default's (both measured, neither paged: a trial that paged is no candidate). An engine's reserve is
    never screened here: it races only where its best cannot (:mod:`tuner.versus.engine_run`)."""
    margin = screen_margin(max_rounds)
    defaults: Mapping[str, EngineLine] = {x.engine: x for x in lines if x.role == DEFAULT}
    out: dict[str, str] = {}
    for x in lines:
        base = defaults.get(x.engine)
        if x.role != TUNED or base is None or not x.search_score or not base.search_score:
            continue
        ratio = x.search_score / base.search_score
        if ratio < margin:
            out[x.label] = (f"not raced: its search measured it {ratio:.2f}x {base.label}, within the {margin:.3f}x "
                            f"that {max_rounds} rounds could decide at this machine's noise: the race could only "
                            "leave it undecided")
    return out


def screen_behind(lines: Sequence[EngineLine], gates: Gates) -> dict[str, str]:
    """The lines (llama.cpp's default aside: every verdict is against it) whose search figure trails the best line's
    still able to race by more than :data:`CROSS_MARGIN`, label → why: the race would decide them slower than that
    line, so it is spared their rounds. Asked after the prices (a refused line is no best)."""
    out_of = {**gates.screened, **gates.refused, **gates.held}
    able = [x for x in lines if x.label not in out_of and x.search_score]
    if len(able) < 2:
        return {}
    best = max(able, key=lambda x: x.search_score or 0.0)
    out: dict[str, str] = {}
    for x in able:
        ratio = (x.search_score or 0.0) / (best.search_score or 1.0)
        if x is not best and x.label != REFERENCE and ratio < 1 / CROSS_MARGIN:
            out[x.label] = (f"not raced: its search measured it {ratio:.2f}x {best.label}, further behind than a "
                            f"search's figure strays from the race's ({1 / CROSS_MARGIN:.2f}x): its rounds would be "
                            "spent on a line that trails")
    return out


def plan_pages(info: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> str | None:
    """Why the plan says ``cfg`` does not fit the RAM free (its resident host need and the prompt cache it can reach,
    :func:`tuner.plan.ram.ram_side`), or None: then one race round that pages is that round's noise
    (:attr:`tuner.versus.judge.Arm.paging`)."""
    side = ram_side(price(info, cfg, hw), cfg, hw)
    if side.headroom_bytes >= 0:
        return None
    cache = side.cache_ram_fit_mib * 2**20 if side.cache_ram_fit_mib is not None else side.cache_reach_bytes or 0
    return (f"its host need ({side.need_bytes / 2**30:.1f} GiB) and prompt cache ({cache / 2**30:.1f} GiB) exceed the "
            f"{side.available_bytes / 2**30:.1f} GiB of RAM free")


def reserves(lines: Sequence[EngineLine]) -> dict[str, str]:
    """Each engine's second candidate, held back while its best one can race."""
    return {x.label: "held back: its engine's best candidate races in its place" for x in lines if x.role == RESERVE}
