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

from tuner import bench, failures, flags, runner, space
from tuner.config import FlashAttn, LaunchConfig
from tuner.engine import Capabilities, EngineLocation
from tuner.errors import TunerError
from tuner.hardware import Hardware
from tuner.inspect import ModelInfo
from tuner.workload import Workload

_OT_LAYER = re.compile(r"blk\\?\.\(?([0-9|]+)\)?\\?\.ffn_[a-z_()|]*exps")


def fit_config(loc: EngineLocation, base: LaunchConfig, timeout_s: float = 120.0) -> LaunchConfig | None:
    """llama.cpp's own ``--fit`` choice for ``base`` as a LaunchConfig, or None when the tool is missing or fails.

    ``-ot`` overrides that keep the experts of whole layers on the CPU become ``--n-cpu-moe`` (their count);
    ``-ngl -1`` means "all layers" (the engine default).
    """
    if not loc.has("llama-fit-params"):
        return None
    argv = flags.server_argv(loc.tool("llama-fit-params"), base)
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
                   trial_number: int | None = None) -> ServerMeasurement:
    from tuner.study import config_to_dict

    line = flags.launch_line(cfg)
    try:
        t = bench.run_server_trial(loc, cfg, load, log_dir=log_dir, caps=caps, roofline_tok_s=roofline_tok_s)
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

    @property
    def winner(self) -> ServerMeasurement | None:
        """The fastest config measured here, baselines included. A baseline (llama.cpp's default first, then
        its --fit choice) wins when the fastest candidate is not faster by more than the measured noise (the
        larger CV of the two): a launch line should not change for a gain the run cannot show."""
        ok = [m for m in (*self.candidates, *self.baselines) if m.gen_tok_s is not None]
        fastest = max(ok, key=lambda m: m.gen_tok_s or 0.0, default=None)
        if fastest is None or fastest in self.baselines:
            return fastest
        for base in self.baselines:
            if base.gen_tok_s is None or fastest.gen_tok_s is None:
                continue
            noise = max(fastest.gen_cv_pct or 0.0, base.gen_cv_pct or 0.0) / 100
            if base.gen_tok_s >= fastest.gen_tok_s * (1 - noise):
                return base
        return fastest

    def speedup(self, baseline: str) -> float | None:
        w = self.winner
        b = next((m for m in self.baselines if m.label == baseline), None)
        if w is None or b is None or not b.gen_tok_s or w.gen_tok_s is None:
            return None
        return w.gen_tok_s / b.gen_tok_s

    def to_dict(self) -> dict[str, Any]:
        return {"candidates": [c.to_dict() for c in self.candidates],
                "baselines": [b.to_dict() for b in self.baselines]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finish:
        return cls(tuple(ServerMeasurement.from_dict(c) for c in d.get("candidates", [])),
                   tuple(ServerMeasurement.from_dict(b) for b in d.get("baselines", [])))


def finish(loc: EngineLocation, candidates: Sequence[tuple[int, LaunchConfig]],
           baselines: Sequence[tuple[str, LaunchConfig]], load: Workload, *, log_dir: Path,
           caps: Capabilities | None = None, roofline_of: Callable[[LaunchConfig], float | None] | None = None,
           on_step: Callable[[str], None] | None = None) -> Finish:
    """Measure baselines and candidates alternately (so slow drift of a shared machine hits both alike)."""
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
                                   trial_number=num))
    return Finish(tuple(m for m in done if m.label.startswith("candidate")),
                  tuple(m for m in done if not m.label.startswith("candidate")))

