"""What the search may try: the settings the detected engine accepts, shaped by the card and the workload,
with the memory model as the gate that keeps configs which cannot fit from ever being launched.

Dependent choices are encoded in the space rather than repaired afterwards: a quantized V cache needs flash
attention, so ``flash_attn`` is only asked for when V is f16/bf16/f32 (otherwise it is on). Settings that do
not pay on this machine are not searched: ``--n-cpu-moe`` only with a GPU (on a CPU build every expert is on
the host anyway), ubatch only when the prompt is longer than the default ubatch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import ModelInfo
from tuner.plan.memory import DEFAULT_UBATCH, MIB, MemoryEstimate, estimate

# Every KV cache type llama-server's -ctk/-ctv accepts at the pinned commit (common/arg.cpp kv_cache_types),
# f32 left out: it is never faster than f16 and doubles the cache.
KV_TYPES: tuple[CacheType, ...] = (
    CacheType.F16, CacheType.Q8_0, CacheType.Q5_1, CacheType.Q5_0, CacheType.Q4_1, CacheType.Q4_0,
    CacheType.IQ4_NL, CacheType.BF16,
)
UBATCH_CHOICES = (1024, 2048)


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """The axes of one study. A tuple with a single value is fixed, not searched."""

    model: Path
    ctx: int
    parallel: int
    n_cpu_moe: tuple[int, int] | None  # inclusive range; None: not searched (CPU build)
    cache_types_k: tuple[CacheType, ...]
    cache_types_v: tuple[CacheType, ...]
    flash_attn: tuple[FlashAttn, ...]
    threads: tuple[int | None, ...]
    ubatch: tuple[int | None, ...]

    def describe(self) -> dict[str, Any]:
        return {
            "model": str(self.model), "ctx": self.ctx, "parallel": self.parallel,
            "n_cpu_moe": list(self.n_cpu_moe) if self.n_cpu_moe else None,
            "cache_type_k": [t.value for t in self.cache_types_k],
            "cache_type_v": [t.value for t in self.cache_types_v],
            "flash_attn": [f.value for f in self.flash_attn], "threads": list(self.threads),
            "ubatch": list(self.ubatch),
        }

    @property
    def size(self) -> int:
        """Distinct configs in the space (dependent choices counted once)."""
        return sum(1 for _ in iter_configs(self))


def build_space(model_path: Path, info: ModelInfo, hw: Hardware, *, ctx: int, parallel: int, prompt_tokens: int,
                kv_types: Sequence[CacheType] = KV_TYPES, search_n_cpu_moe: bool | None = None) -> SearchSpace:
    """The space for this model on this machine, serving ``parallel`` slots of ``ctx`` tokens in total."""
    if ctx < 1 or parallel < 1:
        raise UsageError("context and slots must be >= 1: fix --min-ctx / --parallel")
    if not kv_types:
        raise UsageError("no KV cache types to search: name at least one")
    with_moe = hw.has_gpu if search_n_cpu_moe is None else search_n_cpu_moe
    cores = max(1, hw.physical_cores)
    threads = tuple(sorted({max(1, cores // 2), cores}))
    ubatch: tuple[int | None, ...] = (None, *(u for u in UBATCH_CHOICES if u <= prompt_tokens)) \
        if prompt_tokens > DEFAULT_UBATCH else (None,)
    kv = tuple(dict.fromkeys(kv_types))
    return SearchSpace(
        model=model_path, ctx=ctx, parallel=parallel,
        n_cpu_moe=(0, info.n_layer) if with_moe and info.n_expert else None,
        cache_types_k=kv, cache_types_v=kv, flash_attn=(FlashAttn.ON, FlashAttn.OFF),
        threads=threads, ubatch=ubatch,
    )


def make_config(space: SearchSpace, params: dict[str, Any]) -> LaunchConfig:
    """The launch config a set of parameter values stands for (the one function both directions agree on)."""
    ctv = CacheType(params.get("cache_type_v", space.cache_types_v[0].value))
    fa = FlashAttn.ON if ctv.is_quantized else FlashAttn(params.get("flash_attn", space.flash_attn[0].value))
    return LaunchConfig(
        model=space.model,
        n_cpu_moe=params.get("n_cpu_moe") if space.n_cpu_moe else None,
        cache_type_k=CacheType(params.get("cache_type_k", space.cache_types_k[0].value)),
        cache_type_v=ctv, flash_attn=fa, ctx=space.ctx, parallel=space.parallel,
        threads=params.get("threads", space.threads[-1]), ubatch=params.get("ubatch", space.ubatch[0]),
    )


def params_of(space: SearchSpace, cfg: LaunchConfig) -> dict[str, Any]:
    """The parameter values that :func:`make_config` turns back into ``cfg`` (for enqueueing seeds)."""
    params: dict[str, Any] = {}
    if space.n_cpu_moe:
        lo, hi = space.n_cpu_moe
        params["n_cpu_moe"] = min(max(cfg.n_cpu_moe or 0, lo), hi)
    if len(space.cache_types_k) > 1:
        params["cache_type_k"] = _nearest(cfg.cache_type_k, space.cache_types_k).value
    ctv = _nearest(cfg.cache_type_v, space.cache_types_v)
    if len(space.cache_types_v) > 1:
        params["cache_type_v"] = ctv.value
    if not ctv.is_quantized and len(space.flash_attn) > 1:
        fa = FlashAttn.ON if cfg.flash_attn is FlashAttn.AUTO else cfg.flash_attn
        params["flash_attn"] = fa.value if fa in space.flash_attn else space.flash_attn[0].value
    if len(space.threads) > 1:
        params["threads"] = cfg.threads if cfg.threads in space.threads else space.threads[-1]
    if len(space.ubatch) > 1:
        params["ubatch"] = cfg.ubatch if cfg.ubatch in space.ubatch else None
    return params


def _nearest(t: CacheType, choices: tuple[CacheType, ...]) -> CacheType:
    return t if t in choices else choices[0]


def suggest(trial: Any, space: SearchSpace) -> LaunchConfig:
    """Ask an Optuna trial for one config. Fixed axes are not suggested, so they take no budget."""
    params: dict[str, Any] = {}
    if space.n_cpu_moe:
        params["n_cpu_moe"] = trial.suggest_int("n_cpu_moe", *space.n_cpu_moe)
    if len(space.cache_types_k) > 1:
        params["cache_type_k"] = trial.suggest_categorical("cache_type_k", [t.value for t in space.cache_types_k])
    if len(space.cache_types_v) > 1:
        params["cache_type_v"] = trial.suggest_categorical("cache_type_v", [t.value for t in space.cache_types_v])
    ctv = CacheType(params.get("cache_type_v", space.cache_types_v[0].value))
    if not ctv.is_quantized and len(space.flash_attn) > 1:
        params["flash_attn"] = trial.suggest_categorical("flash_attn", [f.value for f in space.flash_attn])
    if len(space.threads) > 1:
        params["threads"] = trial.suggest_categorical("threads", list(space.threads))
    if len(space.ubatch) > 1:
        params["ubatch"] = trial.suggest_categorical("ubatch", list(space.ubatch))
    return make_config(space, params)


def iter_configs(space: SearchSpace) -> Iterator[LaunchConfig]:
    """Every distinct config of the space, in a fixed order (the grid of the search benchmark)."""
    moe: Sequence[int | None] = range(space.n_cpu_moe[0], space.n_cpu_moe[1] + 1) if space.n_cpu_moe else [None]
    seen: set[LaunchConfig] = set()
    for n, k, v, fa, t, u in product(moe, space.cache_types_k, space.cache_types_v, space.flash_attn,
                                     space.threads, space.ubatch):
        params: dict[str, Any] = {"n_cpu_moe": n, "cache_type_k": k.value, "cache_type_v": v.value,
                                  "flash_attn": fa.value, "threads": t, "ubatch": u}
        cfg = make_config(space, params)
        if cfg not in seen:
            seen.add(cfg)
            yield cfg


# ------------------------------------------------------------------------------------------ feasibility


@dataclass(frozen=True, slots=True)
class Feasibility:
    """The memory model's word on a config. Constraint values are <= 0 when satisfied (Optuna's convention)."""

    estimate: MemoryEstimate
    vram_over_mib: float  # needed + margin - card; only meaningful with a GPU
    ram_over_mib: float  # host side - available RAM

    @property
    def feasible(self) -> bool:
        return self.vram_over_mib <= 0 and self.ram_over_mib <= 0

    @property
    def constraints(self) -> dict[str, float]:
        return {"vram_over_mib": round(self.vram_over_mib, 3), "ram_over_mib": round(self.ram_over_mib, 3)}

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {**self.constraints, "feasible": self.feasible, "verdict": e.verdict.value,
                "gpu_total_bytes": e.gpu.total_bytes, "host_total_bytes": e.host.total_bytes,
                "kv_bytes": e.gpu.kv_bytes + e.host.kv_bytes}


def check(info: ModelInfo, cfg: LaunchConfig, hw: Hardware, vram_margin_mib: float | None = None) -> Feasibility:
    """Would ``cfg`` fit? ``vram_margin_mib`` replaces llama.cpp's own 1 GiB --fit margin when given."""
    est = estimate(info, cfg, hw)
    if hw.has_gpu:
        margin_bytes = (vram_margin_mib if vram_margin_mib is not None else 1024) * MIB
        vram_over = (est.gpu.total_bytes + margin_bytes - hw.vram_budget_bytes) / MIB
    else:
        vram_over = -1.0  # nothing goes to a GPU: satisfied by construction
    ram_over = (est.host.total_bytes - hw.ram_available_bytes) / MIB
    return Feasibility(est, vram_over, ram_over)


def best_guess(space: SearchSpace, info: ModelInfo, hw: Hardware, vram_margin_mib: float | None = None
               ) -> LaunchConfig | None:
    """The memory model's pick: f16 KV (q8_0 if f16 cannot fit), flash attention on, the fewest offloaded
    experts that still fit (more experts on the GPU = fewer bytes read over the slow path), all cores."""
    for kv in (CacheType.F16, CacheType.Q8_0, CacheType.Q4_0):
        if kv not in space.cache_types_k or kv not in space.cache_types_v:
            continue
        base = make_config(space, {"cache_type_k": kv.value, "cache_type_v": kv.value, "flash_attn": "on",
                                   "threads": space.threads[-1], "ubatch": space.ubatch[-1]})
        lo, hi = space.n_cpu_moe or (0, 0)
        for n in range(lo, hi + 1):
            cfg = replace(base, n_cpu_moe=n) if space.n_cpu_moe else base
            if check(info, cfg, hw, vram_margin_mib).feasible:
                return cfg
    return None
