"""The known-good configs a study starts from, and the finish: the top candidates and the baselines measured
again with llama-server at the chosen context and slots — the configuration the user will actually run.

Baselines: ``default`` is ``llama-server -m MODEL -c CTX -np N`` (llama.cpp's defaults, which include its own
``--fit on``); ``fit`` is what ``llama-fit-params`` prints for that launch, made explicit.
"""

from __future__ import annotations

import re
import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.core.errors import TunerError
from tuner.engine import flags, runner
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine import hardware
from tuner.machine.hardware import Hardware
from tuner.measure import bench, failures
from tuner.measure.workload import Workload
from tuner.models.gguf_reader import ModelInfo
from tuner.search import space

FIT_MARGIN_MIB = 1024  # llama.cpp's default -fitt
_OT_LAYER = re.compile(r"blk\\?\.\(?([0-9|]+)\)?\\?\.ffn_[a-z_()|]*exps")


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
    line = next((ln for ln in reversed(res.stdout.splitlines()) if ln.strip().startswith("-c ")), None)
    return parse_fit(line, base) if line else None


def parse_fit(line: str, base: LaunchConfig) -> LaunchConfig:
    tokens = shlex.split(line)
    cfg = base
    layers: set[int] = set()
    for flag, value in zip(tokens, tokens[1:], strict=False):
        if flag == "-c":
            cfg = replace(cfg, ctx=int(value))
        elif flag == "-ngl":
            cfg = replace(cfg, n_gpu_layers=None if int(value) < 0 else int(value))
        elif flag == "-ot":
            for part in value.split(","):
                for m in _OT_LAYER.finditer(part):
                    layers.update(int(x) for x in m.group(1).split("|") if x)
    if layers:
        cfg = replace(cfg, n_cpu_moe=max(layers) + 1)
    return cfg


def default_config(sp: space.SearchSpace) -> LaunchConfig:
    """What ``llama-server -m MODEL -c CTX -np N`` runs with: every other setting at the engine default."""
    return LaunchConfig(model=sp.model, ctx=sp.ctx, parallel=sp.parallel)


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
    """One config measured with llama-server under the user's workload."""

    label: str  # "candidate-1", "default", "fit"
    config: dict[str, Any]
    launch_line: str
    argv: list[str]
    gen_tok_s: float | None  # per request at concurrency 1 (median)
    gen_samples_tok_s: list[float]
    gen_cv_pct: float | None
    prompt_tok_s: float | None
    ttft_s: float | None
    aggregate_gen_tok_s: float | None  # at the highest concurrency
    rss_peak_bytes: int | None = None
    vram_peak_bytes: int | None = None
    spill: str | None = None
    tokens_per_joule: float | None = None
    roofline_pct: float | None = None
    failure: dict[str, Any] | None = None
    trial_number: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServerMeasurement:
        return cls(**d)


def _cv(samples: Sequence[float]) -> float | None:
    if len(samples) < 2:
        return None
    mean = statistics.fmean(samples)
    return 100 * statistics.stdev(samples) / mean if mean else None


def measure_server(loc: EngineLocation, cfg: LaunchConfig, load: Workload, *, label: str, log_dir: Path,
                   caps: Capabilities | None = None, roofline_tok_s: float | None = None,
                   trial_number: int | None = None, vram_budget_bytes: int | None = None) -> ServerMeasurement:
    from tuner.search.study import config_to_dict

    line = flags.launch_line(cfg)
    try:
        t = bench.run_server_trial(loc, cfg, load, log_dir=log_dir, caps=caps, roofline_tok_s=roofline_tok_s,
                                   vram_budget_bytes=vram_budget_bytes)
    except failures.TrialFailedError as exc:
        return ServerMeasurement(label, config_to_dict(cfg), line, [], None, [], None, None, None, None,
                                 failure=exc.failure.to_dict(), trial_number=trial_number)
    first, last = t.levels[0], t.levels[-1]
    samples = [r.gen_tok_s for r in first.requests]
    gen = first.per_request_gen_tok_s
    roof = 100 * gen / roofline_tok_s if roofline_tok_s else None
    return ServerMeasurement(
        label, config_to_dict(cfg), line, list(t.argv), gen, samples, _cv(samples), first.per_request_prompt_tok_s,
        first.ttft_s, last.aggregate_gen_tok_s, t.memory.rss_peak_bytes, t.memory.vram_peak_bytes,
        t.spill.kind.value, t.tokens_per_joule, roof, None, trial_number,
    )


@dataclass(frozen=True, slots=True)
class Finish:
    candidates: tuple[ServerMeasurement, ...]
    baselines: tuple[ServerMeasurement, ...]
    # The workload's request shape: with both known, configs are judged by the time a whole request takes
    # (prompt processing plus generation), so a config cannot win on tg while losing more on pp.
    prompt_tokens: int = 0
    gen_tokens: int = 0

    def score(self, m: ServerMeasurement) -> float | None:
        """Higher is better: requests per second at concurrency 1, or generation tok/s when pp is unknown."""
        if m.gen_tok_s is None:
            return None
        if self.prompt_tokens and self.gen_tokens and m.prompt_tok_s:
            return 1.0 / (self.prompt_tokens / m.prompt_tok_s + self.gen_tokens / m.gen_tok_s)
        return m.gen_tok_s

    @property
    def metric(self) -> str:
        if self.prompt_tokens and self.gen_tokens:
            return f"end-to-end request time (P={self.prompt_tokens}, G={self.gen_tokens})"
        return "generation tok/s"

    @property
    def winner(self) -> ServerMeasurement | None:
        """The config to launch: among those within the measured noise (the larger generation CV of the pair)
        of the best score, llama.cpp's own choice first (default, then --fit), else the simplest launch line.
        A launch line should not grow flags, or trade KV precision, for a gain the run cannot show.
        """
        scored = [(m, sc) for m in (*self.candidates, *self.baselines) if (sc := self.score(m)) is not None]
        if not scored:
            return None
        best, top = max(scored, key=lambda p: p[1])

        def within_noise(m: ServerMeasurement, sc: float) -> bool:
            noise = max(best.gen_cv_pct or 0.0, m.gen_cv_pct or 0.0) / 100
            return sc >= top * (1 - noise)

        order = {b.label: i for i, b in enumerate(self.baselines)}
        tied = [(m, sc) for m, sc in scored if within_noise(m, sc)]
        return min(tied, key=lambda p: (order.get(p[0].label, len(order)), len(p[0].launch_line.split()), -p[1]))[0]

    def speedup(self, baseline: str) -> float | None:
        """The winner's score over a baseline's (see :attr:`metric`)."""
        w = self.winner
        b = next((m for m in self.baselines if m.label == baseline), None)
        ws, bs = (self.score(w) if w else None), (self.score(b) if b else None)
        return ws / bs if ws is not None and bs else None

    def to_dict(self) -> dict[str, Any]:
        return {"candidates": [c.to_dict() for c in self.candidates],
                "baselines": [b.to_dict() for b in self.baselines],
                "prompt_tokens": self.prompt_tokens, "gen_tokens": self.gen_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finish:
        return cls(tuple(ServerMeasurement.from_dict(c) for c in d.get("candidates", [])),
                   tuple(ServerMeasurement.from_dict(b) for b in d.get("baselines", [])),
                   int(d.get("prompt_tokens", 0)), int(d.get("gen_tokens", 0)))


def finish(loc: EngineLocation, candidates: Sequence[tuple[int, LaunchConfig]],
           baselines: Sequence[tuple[str, LaunchConfig]], load: Workload, *, log_dir: Path,
           caps: Capabilities | None = None, roofline_of: Callable[[LaunchConfig], float | None] | None = None,
           on_step: Callable[[str], None] | None = None, vram_budget_bytes: int | None = None) -> Finish:
    """Measure baselines and candidates alternately (so slow drift of a shared machine hits both alike);
    ``vram_budget_bytes`` is the budget the spill verdict judges "full" by."""
    jobs: list[tuple[str, LaunchConfig, int | None]] = []
    cands = [(f"candidate-{i + 1}", cfg, num) for i, (num, cfg) in enumerate(candidates)]
    bases = [(label, cfg, None) for label, cfg in baselines]
    while cands or bases:
        if bases:
            jobs.append(bases.pop(0))
        if cands:
            jobs.append(cands.pop(0))
    done: list[ServerMeasurement] = []
    for label, cfg, num in jobs:
        if on_step:
            on_step(f"llama-server: {label} ({flags.launch_line(cfg)})")
        roof = roofline_of(cfg) if roofline_of else None
        done.append(measure_server(loc, cfg, load, label=label, log_dir=log_dir, caps=caps, roofline_tok_s=roof,
                                   trial_number=num, vram_budget_bytes=vram_budget_bytes))
    return Finish(tuple(m for m in done if m.label.startswith("candidate")),
                  tuple(m for m in done if not m.label.startswith("candidate")), load.prompt_tokens, load.gen_tokens)

