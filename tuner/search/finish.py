"""The known-good configs a study starts from, and the finish: the top candidates and the baselines measured
again with llama-server at the chosen context and slots — the configuration the user will actually run.

Baselines: ``default`` is ``llama-server -m MODEL -c CTX -np N`` (llama.cpp's defaults, which include its own
``--fit on``); ``fit`` is what ``llama-fit-params`` prints for that launch, made explicit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.core.errors import TrialFailedError, TunerError
from tuner.core.stats import cv_pct
from tuner.engine import flags, runner
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine import hardware, quiet
from tuner.machine.hardware import Hardware
from tuner.measure import bench, failures
from tuner.measure.workload import LevelResult, Workload
from tuner.models.gguf_reader import ModelInfo
from tuner.quality.kv_price import KvPrice
from tuner.search import space
from tuner.search.verdict import BETTER, UNDECIDED, Verdict, compare, compare_quiet

FIT_MARGIN_MIB = 1024  # llama.cpp's default -fitt


def fit_target_mib(hw: Hardware, vram_margin_mib: float | None = None) -> int:
    """The ``-fitt`` margin that makes llama.cpp's --fit fill the VRAM budget, not all the free VRAM: its own
    margin (1024 MiB, or --vram-margin) plus what the budget holds back of the free memory it will see."""
    margin = vram_margin_mib if vram_margin_mib is not None else FIT_MARGIN_MIB
    return int(margin + hardware.vram_held_back_bytes(hw) // 2**20)


def fit_config(loc: EngineLocation, base: LaunchConfig, timeout_s: float = 120.0, *,
               fit_target: int | None = None) -> LaunchConfig | None:
    """llama.cpp's own ``--fit`` choice for ``base`` as a LaunchConfig, or None when the tool is missing or fails.

    ``-ot`` overrides that keep the experts of whole layers on the CPU become ``--n-cpu-moe`` (their count);
    ``-ngl -1`` means "all layers" (the engine default). ``fit_target`` is the ``-fitt`` margin in MiB
    (see :func:`fit_target_mib`); None leaves llama.cpp's default.
    """
    if not loc.has("llama-fit-params"):
        return None
    argv = flags.server_argv(loc.tool("llama-fit-params"), base)
    if fit_target is not None:
        argv = flags.with_fit_target(argv, fit_target)
    try:
        res = runner.run_process(argv, timeout_s=timeout_s, what="llama-fit-params", fix="check the model file")
    except TunerError:
        return None
    line = flags.fit_choice_line(res.stdout)
    return flags.parse_fit_line(line, base) if line else None


def default_config(sp: space.SearchSpace) -> LaunchConfig:
    """What ``llama-server -m MODEL -c CTX -np N`` runs with: every other setting at the engine default."""
    return LaunchConfig(model=sp.model, ctx=sp.ctx, parallel=sp.parallel, device=sp.device)


def seed_configs(sp: space.SearchSpace, info: ModelInfo, hw: Hardware, fit: LaunchConfig | None,
                 vram_margin_mib: float | None = None) -> list[tuple[str, LaunchConfig]]:
    """Known-good starting points, as configs of the space: the defaults, --fit's choice, the memory model's."""
    d = default_config(sp)
    seeds = [("default", space.make_config(sp, {**space.params_of(sp, replace(d, flash_attn=FlashAttn.ON)),
                                                  "threads": sp.threads[-1]}))]
    if fit is not None:
        seeds.append(("fit", space.make_config(sp, space.params_of(sp, replace(fit, flash_attn=FlashAttn.ON)))))
    guess = space.best_guess(sp, info, hw, vram_margin_mib)
    if guess is not None:
        seeds.append(("memory-model", guess))
    out: list[tuple[str, LaunchConfig]] = []
    for label, cfg in seeds:
        if all(cfg != c for _, c in out):
            out.append((label, cfg))
    return out


# -------------------------------------------------------------------------------------------- finish


@dataclass(frozen=True, slots=True)
class ServerMeasurement:
    """One config measured with llama-server under the user's workload, over interleaved rounds."""

    label: str  # "candidate-1", "candidate-1 np2", "default", "fit"
    config: dict[str, Any]
    launch_line: str
    argv: list[str]
    gen_tok_s: float | None  # per request at concurrency 1 (median over rounds)
    gen_samples_tok_s: list[float]  # per round
    gen_cv_pct: float | None  # across rounds
    prompt_tok_s: float | None
    ttft_s: float | None
    aggregate_gen_tok_s: float | None  # at the arm's slot count, generation wall time only
    rss_peak_bytes: int | None = None
    vram_peak_bytes: int | None = None
    spill: str | None = None
    tokens_per_joule: float | None = None
    roofline_pct: float | None = None
    failure: dict[str, Any] | None = None
    trial_number: int | None = None
    slots: int = 1
    loaded_gen_tok_s: float | None = None  # per request with every slot busy
    end_to_end_gen_tok_s: float | None = None  # generated tokens per second of wall time, prompts included
    scores: list[float | None] = field(default_factory=list)  # the workload's score per round
    kld_mean: float | None = None  # quality cost of the config's KV pair (vs f16 KV); None: not priced
    same_top_pct: float | None = None
    # Per round (aligned with ``scores``): what else kept the machine busy, None when it was quiet.
    interference: list[str | None] = field(default_factory=list)

    def quiet_scores(self) -> list[float | None]:
        """The scores of the rounds measured on a quiet machine (None for a disturbed round)."""
        busy = self.interference
        return [None if i < len(busy) and busy[i] else s for i, s in enumerate(self.scores)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServerMeasurement:
        return cls(**d)


def _median(xs: Sequence[float | None]) -> float | None:
    ok = [x for x in xs if x is not None]
    return statistics.median(ok) if ok else None


def server_load(load: Workload) -> Workload:
    """What a server trial sends for ``load``: with a history deeper than the prompt, the whole history is the
    prompt (so generation happens at the workload's depth); the score still charges only the new prompt."""
    return replace(load, prompt_tokens=load.gen_depth, depth_tokens=None)


def round_score(levels: Sequence[LevelResult], load: Workload) -> float | None:
    """One round's score: requests per second for one user, or for concurrent workloads the generated tokens
    per second of wall time with every slot busy (prompts and queueing included)."""
    if not levels:
        return None
    if load.concurrency > 1:
        return levels[-1].end_to_end_gen_tok_s or None
    first = levels[0]
    return load.score(first.per_request_prompt_tok_s, first.per_request_gen_tok_s)


def summarize(label: str, cfg: LaunchConfig, runs: Sequence[bench.ServerTrial | failures.Failure], load: Workload,
              *, roofline_tok_s: float | None = None, trial_number: int | None = None,
              kld: KvPrice | None = None, noise: Sequence[str | None] = ()) -> ServerMeasurement:
    """An arm's rounds as one measurement: medians over rounds, the per-round scores kept for the verdict."""
    from tuner.search.study import config_to_dict

    line = flags.launch_line(cfg)
    ok = [t for t in runs if isinstance(t, bench.ServerTrial)]
    quality: dict[str, Any] = {"kld_mean": kld.kld_mean, "same_top_pct": kld.same_top_pct} if kld else {}
    quality["interference"] = list(noise)
    if not ok:
        failed = next(f for f in runs if isinstance(f, failures.Failure))
        return ServerMeasurement(label, config_to_dict(cfg), line, [], None, [], None, None, None, None,
                                 failure=failed.to_dict(), trial_number=trial_number, slots=cfg.parallel or 1,
                                 scores=[None] * len(runs), **quality)
    samples = [t.levels[0].per_request_gen_tok_s for t in ok]
    gen = _median(samples)
    last = ok[-1]
    return ServerMeasurement(
        label, config_to_dict(cfg), line, list(last.argv), gen, samples, cv_pct(samples),
        _median([t.levels[0].per_request_prompt_tok_s for t in ok]), _median([t.levels[0].ttft_s for t in ok]),
        _median([t.levels[-1].aggregate_gen_tok_s for t in ok]), max(t.memory.rss_peak_bytes or 0 for t in ok) or None,
        max(t.memory.vram_peak_bytes or 0 for t in ok) or None, last.spill.kind.value, last.tokens_per_joule,
        100 * gen / roofline_tok_s if roofline_tok_s and gen else None, None, trial_number, cfg.parallel or 1,
        _median([t.levels[-1].per_request_gen_tok_s for t in ok]),
        _median([t.levels[-1].end_to_end_gen_tok_s for t in ok]),
        [round_score(t.levels, load) if isinstance(t, bench.ServerTrial) else None for t in runs], **quality,
    )


@dataclass(frozen=True, slots=True)
class Finish:
    candidates: tuple[ServerMeasurement, ...]
    baselines: tuple[ServerMeasurement, ...]
    # The workload's request shape: with both known, configs are judged by the time a whole request takes
    # (prompt processing plus generation), so a config cannot win on tg while losing more on pp.
    prompt_tokens: int = 0
    gen_tokens: int = 0
    concurrency: int = 1
    min_tok_s: float | None = None  # per-request generation floor with every slot busy

    def score(self, m: ServerMeasurement) -> float | None:
        """Higher is better: the median of the per-round scores (see :func:`round_score`); for measurements
        without rounds, requests per second from the medians (or generation tok/s when pp is unknown)."""
        if m.gen_tok_s is None:
            return None
        if m.scores:
            return _median(m.scores)
        if self.prompt_tokens and self.gen_tokens and m.prompt_tok_s:
            return 1.0 / (self.prompt_tokens / m.prompt_tok_s + self.gen_tokens / m.gen_tok_s)
        return m.gen_tok_s

    @property
    def metric(self) -> str:
        if self.concurrency > 1:
            floor = f", per request >= {self.min_tok_s:g} tok/s" if self.min_tok_s else ""
            return f"aggregate generated tok/s with every slot busy, prompts included ({self.concurrency} users{floor})"
        if self.prompt_tokens and self.gen_tokens:
            return f"end-to-end request time (P={self.prompt_tokens}, G={self.gen_tokens})"
        return "generation tok/s"

    def eligible(self, m: ServerMeasurement) -> bool:
        """Measured, and each user still gets at least --min-tok-s."""
        if self.score(m) is None:
            return False
        per_request = m.loaded_gen_tok_s if m.loaded_gen_tok_s is not None else m.gen_tok_s
        return self.min_tok_s is None or (per_request or 0.0) >= self.min_tok_s

    def verdict(self, a: ServerMeasurement, b: ServerMeasurement) -> Verdict:
        """Judged on the rounds where the machine was quiet for both arms: a disturbed round decides nothing."""
        if a.scores and b.scores:
            return compare_quiet(a.label, b.label, a.scores, b.scores, a.quiet_scores(), b.quiet_scores())
        sa, sb = self.score(a), self.score(b)
        return compare(a.label, b.label, [sa], [sb])  # one figure each: never decided

    @property
    def winner(self) -> ServerMeasurement | None:
        """The config to launch: the best median score among eligible arms. Noise never hands the win to a
        baseline: an undecided comparison keeps the faster median and says so (:attr:`verdicts`). Quality does:
        a lossy KV cache (measured KLD > 0) only wins when it is decidedly faster than the best lossless arm.
        """
        ok = [m for m in (*self.candidates, *self.baselines) if self.eligible(m)]
        if not ok:
            return None
        best = max(ok, key=lambda m: self.score(m) or 0.0)
        lossless = [m for m in ok if not m.kld_mean]
        if best.kld_mean and lossless:
            safe = max(lossless, key=lambda m: self.score(m) or 0.0)
            if self.verdict(best, safe).outcome != BETTER:
                return safe
        return best

    @property
    def verdicts(self) -> list[Verdict]:
        """The winner against every other measured arm, baselines first."""
        w = self.winner
        if w is None:
            return []
        return [self.verdict(w, m) for m in (*self.baselines, *self.candidates)
                if m is not w and self.score(m) is not None]

    def speedup(self, baseline: str) -> float | None:
        """The winner's score over a baseline's (see :attr:`metric`): the median of the per-round ratios."""
        w = self.winner
        b = next((m for m in self.baselines if m.label == baseline), None)
        if w is None or b is None or self.score(b) is None:
            return None
        if w is b:
            return 1.0
        v = self.verdict(w, b)
        return v.ratio if v.rounds else None

    def to_dict(self) -> dict[str, Any]:
        return {"candidates": [c.to_dict() for c in self.candidates],
                "baselines": [b.to_dict() for b in self.baselines],
                "prompt_tokens": self.prompt_tokens, "gen_tokens": self.gen_tokens,
                "concurrency": self.concurrency, "min_tok_s": self.min_tok_s,
                "verdicts": [v.to_dict() for v in self.verdicts]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finish:
        return cls(tuple(ServerMeasurement.from_dict(c) for c in d.get("candidates", [])),
                   tuple(ServerMeasurement.from_dict(b) for b in d.get("baselines", [])),
                   int(d.get("prompt_tokens", 0)), int(d.get("gen_tokens", 0)), int(d.get("concurrency", 1)),
                   d.get("min_tok_s"))


@dataclass(frozen=True, slots=True)
class Rounds:
    """How many interleaved rounds the finish measures: at least ``min``, more (up to ``max``) while the
    winner's comparison with a baseline is undecided."""

    min: int = 3
    max: int = 4


def slot_arms(candidates: Sequence[tuple[int, LaunchConfig]], slots: Sequence[int]
              ) -> list[tuple[str, LaunchConfig, int | None]]:
    """Candidates as arms; with several slot counts the best candidate is measured at each (context per slot
    kept), the others at the workload's own slot count."""
    arms: list[tuple[str, LaunchConfig, int | None]] = []
    for i, (num, cfg) in enumerate(candidates):
        label = f"candidate-{i + 1}"
        if i > 0 or len(slots) < 2:
            arms.append((label, cfg, num))
            continue
        per_slot = (cfg.ctx or 0) // (cfg.parallel or 1)
        for n in slots:
            arms.append((f"{label} np{n}", replace(cfg, parallel=n, ctx=per_slot * n or None), num))
    return arms


def finish(loc: EngineLocation, candidates: Sequence[tuple[int, LaunchConfig]],
           baselines: Sequence[tuple[str, LaunchConfig]], load: Workload, *, log_dir: Path,
           caps: Capabilities | None = None, roofline_of: Callable[[LaunchConfig], float | None] | None = None,
           kld_of: Callable[[LaunchConfig], KvPrice | None] | None = None, slots: Sequence[int] = (1,),
           min_tok_s: float | None = None, rounds: Rounds = Rounds(),
           on_step: Callable[[str], None] | None = None, vram_budget_bytes: int | None = None) -> Finish:
    """Measure baselines and candidates in interleaved rounds (the order rotating each round, so slow drift and
    bursts on a shared machine hit every arm alike) until the winner's verdicts are decided or the rounds run
    out. An arm whose server fails to start in the first round is not measured again."""
    arms = [(label, cfg, None) for label, cfg in baselines] + slot_arms(candidates, slots)
    runs: dict[str, list[bench.ServerTrial | failures.Failure]] = {label: [] for label, _, _ in arms}
    noise: dict[str, list[str | None]] = {label: [] for label, _, _ in arms}
    sent = server_load(load)

    def build() -> Finish:
        done = [summarize(label, cfg, runs[label], load, roofline_tok_s=roofline_of(cfg) if roofline_of else None,
                          trial_number=num, kld=kld_of(cfg) if kld_of else None, noise=noise[label])
                for label, cfg, num in arms]
        return Finish(tuple(m for m in done if m.label.startswith("candidate")),
                      tuple(m for m in done if not m.label.startswith("candidate")), load.prompt_tokens,
                      load.gen_tokens, load.concurrency, min_tok_s)

    for r in range(rounds.max):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for label, cfg, _ in order:
            if r > 0 and not any(isinstance(t, bench.ServerTrial) for t in runs[label]):
                continue
            if on_step:
                on_step(f"round {r + 1}: llama-server {label} ({flags.launch_line(cfg)})")
            roof = roofline_of(cfg) if roofline_of else None
            concurrency = cfg.parallel or 1
            with quiet.watch_for([cfg], runner.own_pids) as watch:
                try:
                    runs[label].append(bench.run_server_trial(loc, cfg, replace(sent, concurrency=concurrency),
                                                              log_dir=log_dir, caps=caps, roofline_tok_s=roof,
                                                              vram_budget_bytes=vram_budget_bytes))
                except TrialFailedError as exc:
                    runs[label].append(exc.failure)
            noise[label].append(watch.noise)
            if watch.noise and on_step:
                on_step(f"round {r + 1}: {label} was measured on a busy machine ({watch.noise}): it decides nothing")
        if r + 1 >= rounds.min and all(v.outcome != UNDECIDED for v in build().verdicts):
            break
    return build()
