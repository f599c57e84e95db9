"""What the search may try: the settings the detected engine accepts, shaped by the card, the workload and the
physics of MoE inference, with the memory model as the gate that keeps configs which cannot fit from ever
being launched.

The space holds only configs that can win, so a trial (a model load on a real 20 GB model) is not spent on
one that physics already rules out:

- ``--n-cpu-moe`` near the memory model's fitting boundary: the smallest value that fits (at any KV pair and
  ubatch of the space) up to a few above the largest such boundary, to absorb the model's error. Every value
  above is slower by physics (more expert bytes read over the slow path); below it does not fit. A dense
  model has no experts to move: when it does not fit the card whole, ``-ngl`` (layers on the GPU) takes that
  place, from the most layers that fit down to a few below the fewest such boundary.
- K/V cache types as a short list of pairs: same-type pairs and K-more-precise-than-V pairs (attention is
  more sensitive to K error than to V error), not 8 × 8 types; on a CUDA build only the pairs it compiled a
  flash-attention vector kernel for (another pair converts the cache to f16 at every token).
- threads among the physical-core counts that can win; ubatch only where prompts are longer than the default
  ubatch (a larger one changes nothing for a short prompt; with host experts, each ubatch copies them), up to
  4096 and 8192 for prompts that long, with ``-b`` as large.
- a quantized V cache needs flash attention: ``flash_attn`` is only asked for when V is f16/bf16/f32.
- slots (``-np``) for concurrent workloads: llama-bench cannot run parallel sequences, so slot counts are
  measured by the finish step's llama-server runs (:attr:`SearchSpace.slots`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.core.model import ModelInfo
from tuner.engine.caps import FaKernels
from tuner.engine.kinds import DEFAULT_KIND, EngineKind, kind_by_name
from tuner.machine.hardware import Hardware
from tuner.measure.engine_memory import in_force, price
from tuner.plan.memory import (
    DEFAULT_BATCH,
    DEFAULT_UBATCH,
    FIT_MARGIN_BYTES,
    MIB,
    MemoryEstimate,
)
from tuner.plan.placement import fit_interval, offload_of, overs
from tuner.plan.ram import prompt_cache_reach_bytes
from tuner.search import cache_ram
from tuner.search.engine_axes import Axes, axis_values, engine_axes
from tuner.search.levers import host_levers, levers_note, load_mode_axis
from tuner.search.reuse import ReuseArm, reuse_arms  # noqa: F401 - space.reuse_arms, as the session stage knows it

F16, Q8, Q4 = CacheType.F16, CacheType.Q8_0, CacheType.Q4_0
# Same-type pairs and K-more-precise-than-V pairs over f16 > q8_0 > q4_0, most precise first. The exotic
# types (q4_1, q5_x, iq4_nl, bf16) sit between these in size and quality and have never been the answer.
KV_PAIRS: tuple[tuple[CacheType, CacheType], ...] = (
    (F16, F16), (F16, Q8), (Q8, Q8), (F16, Q4), (Q8, Q4), (Q4, Q4),
)
# Ubatches above the default, each offered where the prompt is at least that long: with host experts llama.cpp
# copies them to the GPU once per ubatch, so long prompts run fastest at 4096 or 8192 (the compute buffer grows
# with the ubatch: the memory model prices it).
UBATCH_CHOICES = (1024, 2048, 4096, 8192)
# --n-cpu-moe values searched above the largest fitting boundary (-ngl values below the smallest), to absorb the
# memory model's error.
N_CPU_MOE_ABOVE = 3
# -ngl for every layer, where the engine offloads none unless told (more than any model has).
ALL_LAYERS = 999


def kv_label(k: CacheType, v: CacheType) -> str:
    return f"{k.value}/{v.value}"


def _kv_from_label(label: str) -> tuple[CacheType, CacheType]:
    k, v = label.split("/")
    return CacheType(k), CacheType(v)


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """The axes of one study. A tuple with a single value is fixed, not searched."""

    model: Path
    ctx: int
    parallel: int
    n_cpu_moe: tuple[int, int] | None  # inclusive range; None: not searched (CPU build)
    kv_pairs: tuple[tuple[CacheType, CacheType], ...]
    flash_attn: tuple[FlashAttn, ...]
    threads: tuple[int | None, ...]
    ubatch: tuple[int | None, ...]
    slots: tuple[int, ...] = (1,)  # -np values the finish measures (concurrent workloads)
    device: str | None = None  # -dev of every config ("none": the CPU on purpose)
    # Why --n-cpu-moe (-ngl) spans what it spans, in words (which memory bounds it); not part of the study's identity.
    n_cpu_moe_why: str = ""
    n_gpu_layers: tuple[int, int] | None = None  # a dense model that does not fit whole: -ngl, inclusive range
    # What the space leaves out and why (K/V pairs the engine has no kernel for, ubatches that cannot fit); not
    # part of the study's identity.
    left_out: tuple[str, ...] = ()
    # --cache-ram per placement (the --n-cpu-moe or -ngl value; None: the space has no such axis), set where
    # llama-server's default prompt cache would not fit beside that placement's host need (tuner.plan.ram); a
    # placement not listed keeps the engine's default. More host weights leave less room: a smaller cap.
    cache_ram_caps: tuple[tuple[int | None, int], ...] = ()
    # The prompt-side levers of a CUDA rig with experts in RAM (:mod:`tuner.search.levers`): op offload on/off and
    # the host buffer; a single value is fixed, not searched. Op offload's threshold is no axis: llama-bench cannot
    # tell thresholds apart, so the session stage measures it as one arm (levers.session_threshold).
    op_offload: tuple[bool, ...] = (True,)
    no_host: tuple[bool, ...] = (False,)
    load_mode: tuple[str, ...] = ("mmap",)  # --load-mode: mmap, or none (pinned host experts): levers.load_mode_axis
    engine: str = DEFAULT_KIND.name  # whose search this is (tuner.engine.kinds); its configs carry it
    # That engine's own levers (tuner.search.engine_axes): LaunchConfig field and values, its default first.
    engine_levers: Axes = ()
    # Every layer on the GPU stated with -ngl: an engine whose server offloads none unless told (ik_llama.cpp).
    all_layers: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "model": str(self.model), "ctx": self.ctx, "parallel": self.parallel,
            "n_cpu_moe": list(self.n_cpu_moe) if self.n_cpu_moe else None,
            "kv": [kv_label(k, v) for k, v in self.kv_pairs],
            "flash_attn": [f.value for f in self.flash_attn], "threads": list(self.threads),
            "ubatch": list(self.ubatch), "slots": list(self.slots),
            **({"device": self.device} if self.device is not None else {}),
            **({"n_gpu_layers": list(self.n_gpu_layers)} if self.n_gpu_layers else {}),
            **({"cache_ram_mib": [list(c) for c in self.cache_ram_caps]} if self.cache_ram_caps else {}),
            **({"op_offload": list(self.op_offload)} if len(self.op_offload) > 1 else {}),
            **({"no_host": list(self.no_host)} if len(self.no_host) > 1 else {}),
            **({"load_mode": list(self.load_mode)} if len(self.load_mode) > 1 else {}),
            **({"engine": self.engine} if kind_by_name(self.engine) is not DEFAULT_KIND else {}),
            **{name: list(values) for name, values in self.engine_levers},
        }

    @property
    def size(self) -> int:
        """Distinct configs in the space (dependent choices counted once)."""
        return sum(1 for _ in iter_configs(self))

    def cache_ram_at(self, n_cpu_moe: int | None, n_gpu_layers: int | None) -> int | None:
        """The --cache-ram of a config at this placement (None: llama-server's default fits beside it)."""
        where = n_cpu_moe if self.n_cpu_moe else n_gpu_layers if self.n_gpu_layers else None
        return dict(self.cache_ram_caps).get(where)


def _physical_threads(cores: int) -> tuple[int, ...]:
    """All cores; one fewer (leaves one for the server's HTTP and sampling threads, or for the GPU driver);
    half (with experts offloaded, memory bandwidth saturates before the cores do)."""
    return tuple(sorted({max(1, cores // 2), max(1, cores - 1), cores}))


def slot_counts(concurrency: int) -> tuple[int, ...]:
    """Powers of two up to the workload's concurrency, and the concurrency itself: 1, 2, 4, ... N."""
    counts = {1, concurrency}
    n = 2
    while n < concurrency:
        counts.add(n)
        n *= 2
    return tuple(sorted(counts))


def feasible_n_cpu_moe(info: ModelInfo, cfg: LaunchConfig, hw: Hardware,
                       vram_margin_mib: float | None = None) -> tuple[int, int] | None:
    """The ``--n-cpu-moe`` values at which ``cfg`` fits, as an inclusive interval, or None when none does.

    VRAM bounds it from below (each layer's experts moved to the host free VRAM) and host RAM from above
    (they need RAM there), so the feasible set is an interval that can be empty in the middle of the range.
    """
    interval = fit_interval(info, cfg, hw, _margin_bytes(vram_margin_mib), in_force())
    return (interval.lo, interval.hi) if interval.lo is not None and interval.hi is not None else None


def fitting_boundary(info: ModelInfo, cfg: LaunchConfig, hw: Hardware,
                     vram_margin_mib: float | None = None) -> int | None:
    """The smallest ``--n-cpu-moe`` at which ``cfg`` fits, or None when no value does."""
    interval = feasible_n_cpu_moe(info, cfg, hw, vram_margin_mib)
    return interval[0] if interval else None


def build_space(model_path: Path, info: ModelInfo, hw: Hardware, *, ctx: int, parallel: int, prompt_tokens: int,
                kv_pairs: Sequence[tuple[CacheType, CacheType]] = KV_PAIRS, search_n_cpu_moe: bool | None = None,
                concurrency: int = 1, vram_margin_mib: float | None = None, device: str | None = None,
                fa_kernels: FaKernels | None = None, kind: EngineKind = DEFAULT_KIND) -> SearchSpace:
    """The space for this model on this machine, serving ``parallel`` slots of ``ctx`` tokens in total.

    ``fa_kernels``: the engine's flash-attention vector kernels (:attr:`Capabilities.fa_kernels`); a K/V pair
    without one is left out, with the reason and the build flag that adds it in :attr:`SearchSpace.left_out`.
    ``kind``: whose search it is: its own levers join the axes (:mod:`tuner.search.engine_axes`), llama.cpp's
    host levers and load mode only for llama.cpp.
    """
    if ctx < 1 or parallel < 1:
        raise UsageError("context and slots must be >= 1: fix --min-ctx / --parallel")
    if not kv_pairs:
        raise UsageError("no KV cache types to search: name at least one")
    offload = hw.has_gpu if search_n_cpu_moe is None else search_n_cpu_moe
    with_moe = offload and bool(info.n_expert)
    pairs, left_out = _pairs_with_kernels(tuple(dict.fromkeys(kv_pairs)), fa_kernels)
    ubatch = ubatch_choices(prompt_tokens, ctx)
    moe: tuple[int, int] | None = None
    why = ""
    if with_moe:
        by_ubatch = {u: [feasible_n_cpu_moe(info, ubatch_config(model_path, k, v, ctx, parallel, u), hw,
                                            vram_margin_mib) for k, v in pairs] for u in ubatch}
        # A ubatch above the default batch that fits at no --n-cpu-moe with any pair would only be refused, trial
        # after trial: it is left out, and said.
        for u in [u for u in ubatch if u is not None and u > DEFAULT_BATCH and not any(by_ubatch[u])]:
            ubatch = tuple(x for x in ubatch if x != u)
            left_out += (f"-ub {u} left out: its compute buffer fits at no --n-cpu-moe on this card at -c {ctx}",)
        intervals = [i for u in ubatch for i in by_ubatch[u]]
        fits = [i for i in intervals if i is not None]
        if fits:
            lo = min(i[0] for i in fits)
            # A few above the largest lower bound absorb the memory model's error, never past where RAM ends.
            ram_cap = max(i[1] for i in fits)
            hi = min(ram_cap, max(i[0] for i in fits) + N_CPU_MOE_ABOVE)
            moe = (lo, max(lo, hi))
            why = _n_cpu_moe_why(info, hw, ctx, moe, ram_cap)
        else:
            moe = (info.n_layer, info.n_layer)
            why = f"no --n-cpu-moe fits at -c {ctx}: every trial will be refused by the memory gate"
    ngl: tuple[int, int] | None = None
    if offload and not info.n_expert:
        ngl, why = _gpu_layers(info, hw, model_path, ctx, parallel, pairs, ubatch, vram_margin_mib)
    caps, note = cache_ram.placement_caps(info, hw, _hungriest(model_path, pairs, ubatch, ctx, parallel), moe, ngl)
    levers = host_levers(hw, device, moe if with_moe else None) if kind.host_buffer_levers else False
    # The pinned copy is judged where it weighs most: the most host experts, their own prompt-cache cap.
    most_host = replace(ubatch_config(model_path, *pairs[0], ctx, parallel, ubatch[-1]),
                        cache_ram_mib=dict(caps).get(moe[1] if moe else None), n_cpu_moe=moe[1] if moe else None)
    load_modes, load_note = load_mode_axis(info, hw, device, moe if with_moe else None, most_host) \
        if kind.reads_load_mode else (("mmap",), ())
    own, own_note = engine_axes(kind, info, hw, device, bool(with_moe and moe and moe[1] > 0))
    return SearchSpace(
        model=model_path, ctx=ctx, parallel=parallel, n_cpu_moe=moe, kv_pairs=pairs,
        flash_attn=(FlashAttn.ON, FlashAttn.OFF), threads=_physical_threads(max(1, hw.physical_cores)),
        ubatch=ubatch, slots=slot_counts(concurrency), n_cpu_moe_why=why, device=device, n_gpu_layers=ngl,
        left_out=left_out + note + (levers_note() if levers else ()) + load_note + own_note, cache_ram_caps=caps,
        op_offload=(True, False) if levers else (True,), no_host=(False, True) if levers else (False,),
        load_mode=load_modes, engine=kind.name, engine_levers=own, all_layers=offload and not kind.offloads_by_default,
    )


def _hungriest(model: Path, pairs: Sequence[tuple[CacheType, CacheType]], ubatch: Sequence[int | None], ctx: int,
              parallel: int) -> LaunchConfig:
    """The config of the space that needs the most host RAM at a placement: the widest KV pair (the KV of host
    layers), the largest ubatch and, where the V type lets it, flash attention off (the host compute buffers)."""
    k, v = pairs[0]
    cfg = ubatch_config(model, k, v, ctx, parallel, ubatch[-1])
    return cfg if v.is_quantized else replace(cfg, flash_attn=FlashAttn.OFF)


def ubatch_choices(prompt_tokens: int, ctx: int) -> tuple[int | None, ...]:
    """The default ubatch, and each larger one the prompt fills (a ubatch larger than the prompt changes nothing;
    with host experts it matters most: fewer expert copies) and the context holds (``llama_context`` caps the
    batch at the context, ``n_batch = min(n_ctx, n_batch)``, then ``n_ubatch = min(n_batch, n_ubatch)``)."""
    if prompt_tokens <= DEFAULT_UBATCH:
        return (None,)
    return (None, *(u for u in UBATCH_CHOICES if u <= prompt_tokens and u <= ctx))


def batch_for(ubatch: int | None) -> int | None:
    """``-b`` for a ubatch: llama.cpp clamps ``-ub`` to ``-b`` (2048 unless given), so a larger ubatch brings a
    batch as large; below that the engine's default batch stays (no flag)."""
    return ubatch if ubatch is not None and ubatch > DEFAULT_BATCH else None


def ubatch_config(model: Path, k: CacheType, v: CacheType, ctx: int, parallel: int, ubatch: int | None
                  ) -> LaunchConfig:
    """The config the memory gate prices a KV pair and ubatch at (flash attention on, ``-b`` >= ``-ub``)."""
    return LaunchConfig(model=model, cache_type_k=k, cache_type_v=v, flash_attn=FlashAttn.ON, ctx=ctx,
                        parallel=parallel, ubatch=ubatch, batch=batch_for(ubatch))


def _pairs_with_kernels(pairs: tuple[tuple[CacheType, CacheType], ...], fa: FaKernels | None
                        ) -> tuple[tuple[tuple[CacheType, CacheType], ...], tuple[str, ...]]:
    """The pairs the engine has a flash-attention vector kernel for, and a note per pair left out."""
    if fa is None:
        return pairs, ()
    kept = tuple((k, v) for k, v in pairs if fa.has(k.value, v.value))
    notes = tuple(fa.why_missing(k.value, v.value) for k, v in pairs if (k, v) not in kept)
    if not kept:  # every CUDA build compiles f16/f16 (``ggml_cuda_fattn_vec_instances``)
        kept = ((F16, F16),)
    return kept, notes


def _gpu_layers(info: ModelInfo, hw: Hardware, model_path: Path, ctx: int, parallel: int,
                pairs: Sequence[tuple[CacheType, CacheType]], ubatch: Sequence[int | None],
                vram_margin_mib: float | None) -> tuple[tuple[int, int] | None, str]:
    """A dense model's ``-ngl`` range: None (not searched: llama.cpp's default, every layer on the GPU) when the
    whole model fits at every KV pair, else from the most layers that fit at any pair down to a few below the
    fewest such most (more layers on the host only read more bytes over the slow path)."""
    axis = offload_of(info)
    intervals = [fit_interval(info, ubatch_config(model_path, k, v, ctx, parallel, u), hw,
                              _margin_bytes(vram_margin_mib), in_force()) for (k, v), u in product(pairs, ubatch)]
    fits = [i for i in intervals if i.lo is not None and i.hi is not None]
    if fits and all(i.lo == 0 for i in intervals):
        return None, f"the whole model fits the card at -c {ctx}: -ngl is left to llama.cpp (every layer)"
    if not fits:
        return (0, 0), f"no -ngl fits at -c {ctx}: every trial will be refused by the memory gate"
    most = axis.value(min(i.lo for i in fits if i.lo is not None))
    fewest_most = axis.value(max(i.lo for i in fits if i.lo is not None))
    floor = axis.value(min(i.hi for i in fits if i.hi is not None))  # host RAM caps how few stay on the GPU
    lo = max(floor, fewest_most - N_CPU_MOE_ABOVE, 0)
    return (min(lo, most), most), (
        f"-ngl searched {min(lo, most)}..{most} at -c {ctx}: a dense model has no experts for --n-cpu-moe to move; "
        f"the card ({hw.vram_budget_bytes / 2**30:.1f} GiB budget) holds at most {most} of its {info.n_layer + 1} "
        "layers (the output head counted as one)")


def _n_cpu_moe_why(info: ModelInfo, hw: Hardware, ctx: int, moe: tuple[int, int], ram_cap: int) -> str:
    lo, hi = moe
    low = "every layer's experts fit on the card" if lo == 0 else \
        f"the card ({hw.vram_budget_bytes / 2**30:.1f} GiB budget) needs at least {lo} layers' experts on the host"
    if ram_cap < info.n_layer:
        high = (f"host RAM ({hw.ram_available_bytes / 2**30:.1f} GiB available) holds at most {ram_cap} "
                "layers' experts")
    else:
        high = f"more host experts only read more bytes over the slow path (searched up to {hi})"
    return f"--n-cpu-moe searched {lo}..{hi} at -c {ctx}: {low}; {high}"


def make_config(space: SearchSpace, params: dict[str, Any]) -> LaunchConfig:
    """The launch config a set of parameter values stands for (the one function both directions agree on)."""
    ctk, ctv = _kv_from_label(params["kv"]) if "kv" in params else space.kv_pairs[0]
    fa = FlashAttn.ON if ctv.is_quantized else FlashAttn(params.get("flash_attn", space.flash_attn[0].value))
    ubatch = params.get("ubatch", space.ubatch[0])
    own = axis_values(space.engine_levers, params)
    layers = params.get("n_gpu_layers") if space.n_gpu_layers else (ALL_LAYERS if space.all_layers else None)
    return LaunchConfig(
        model=space.model,
        n_cpu_moe=params.get("n_cpu_moe") if space.n_cpu_moe else None,
        n_gpu_layers=layers,
        cache_type_k=ctk, cache_type_v=ctv, flash_attn=fa, ctx=space.ctx, parallel=space.parallel,
        threads=params.get("threads", space.threads[-1]), ubatch=ubatch, batch=batch_for(ubatch),
        device=space.device, cache_ram_mib=space.cache_ram_at(params.get("n_cpu_moe"), params.get("n_gpu_layers")),
        op_offload=params.get("op_offload", space.op_offload[0]), no_host=params.get("no_host", space.no_host[0]),
        # --no-host leaves no pinned buffer to choose: the load mode is asked only without it. An engine's unmapping
        # levers (ik's -rtr) read the weights into its own buffers (tuner.engine.kinds.EngineKind.unmapping_levers).
        mmap=(params.get("no_host", space.no_host[0]) or params.get("load_mode", space.load_mode[0]) == "mmap")
        and not any(own.get(lever) for lever in kind_by_name(space.engine).unmapping_levers),
        engine=space.engine, **own,
    )


def params_of(space: SearchSpace, cfg: LaunchConfig) -> dict[str, Any]:
    """The parameter values that :func:`make_config` turns back into ``cfg`` (for enqueueing seeds); a
    setting outside the space becomes the nearest value inside it."""
    params: dict[str, Any] = {}
    if space.n_cpu_moe:
        lo, hi = space.n_cpu_moe
        params["n_cpu_moe"] = min(max(cfg.n_cpu_moe or 0, lo), hi)
    if space.n_gpu_layers:
        lo, hi = space.n_gpu_layers
        params["n_gpu_layers"] = min(max(hi if cfg.n_gpu_layers is None else cfg.n_gpu_layers, lo), hi)
    pair = (cfg.cache_type_k, cfg.cache_type_v)
    if pair not in space.kv_pairs:
        pair = next((p for p in space.kv_pairs if p[1] == cfg.cache_type_v), space.kv_pairs[0])
    if len(space.kv_pairs) > 1:
        params["kv"] = kv_label(*pair)
    if not pair[1].is_quantized and len(space.flash_attn) > 1:
        fa = FlashAttn.ON if cfg.flash_attn is FlashAttn.AUTO else cfg.flash_attn
        params["flash_attn"] = fa.value if fa in space.flash_attn else space.flash_attn[0].value
    if len(space.threads) > 1:
        params["threads"] = cfg.threads if cfg.threads in space.threads else space.threads[-1]
    if len(space.ubatch) > 1:
        params["ubatch"] = cfg.ubatch if cfg.ubatch in space.ubatch else None
    if len(space.op_offload) > 1:
        params["op_offload"] = cfg.op_offload
    if len(space.no_host) > 1:
        params["no_host"] = cfg.no_host
    if len(space.load_mode) > 1 and not cfg.no_host:
        params["load_mode"] = "mmap" if cfg.mmap else "none"
    for name, values in space.engine_levers:
        params[name] = getattr(cfg, name) if getattr(cfg, name) in values else values[0]
    return params


def suggest(trial: Any, space: SearchSpace) -> LaunchConfig:
    """Ask an Optuna trial for one config. Fixed axes are not suggested, so they take no budget."""
    params: dict[str, Any] = {}
    if space.n_cpu_moe:
        params["n_cpu_moe"] = trial.suggest_int("n_cpu_moe", *space.n_cpu_moe)
    if space.n_gpu_layers:
        params["n_gpu_layers"] = trial.suggest_int("n_gpu_layers", *space.n_gpu_layers)
    if len(space.kv_pairs) > 1:
        params["kv"] = trial.suggest_categorical("kv", [kv_label(k, v) for k, v in space.kv_pairs])
    ctv = _kv_from_label(params["kv"])[1] if "kv" in params else space.kv_pairs[0][1]
    if not ctv.is_quantized and len(space.flash_attn) > 1:
        params["flash_attn"] = trial.suggest_categorical("flash_attn", [f.value for f in space.flash_attn])
    if len(space.threads) > 1:
        params["threads"] = trial.suggest_categorical("threads", list(space.threads))
    if len(space.ubatch) > 1:
        params["ubatch"] = trial.suggest_categorical("ubatch", list(space.ubatch))
    if len(space.op_offload) > 1:
        params["op_offload"] = trial.suggest_categorical("op_offload", list(space.op_offload))
    if len(space.no_host) > 1:
        params["no_host"] = trial.suggest_categorical("no_host", list(space.no_host))
    if len(space.load_mode) > 1 and not params.get("no_host", space.no_host[0]):
        params["load_mode"] = trial.suggest_categorical("load_mode", list(space.load_mode))
    for name, values in space.engine_levers:
        params[name] = trial.suggest_categorical(name, list(values))
    return make_config(space, params)


def iter_configs(space: SearchSpace) -> Iterator[LaunchConfig]:
    """Every distinct config of the space, in a fixed order (the grid of the search benchmark)."""
    moe: Sequence[int | None] = range(space.n_cpu_moe[0], space.n_cpu_moe[1] + 1) if space.n_cpu_moe else [None]
    ngl: Sequence[int | None] = range(space.n_gpu_layers[1], space.n_gpu_layers[0] - 1, -1) \
        if space.n_gpu_layers else [None]
    seen: set[LaunchConfig] = set()
    names = [name for name, _ in space.engine_levers]
    for n, g, kv, fa, t, u, po, nh, lm, *own in product(moe, ngl, space.kv_pairs, space.flash_attn, space.threads,
                                                        space.ubatch, space.op_offload, space.no_host,
                                                        space.load_mode, *(v for _, v in space.engine_levers)):
        params: dict[str, Any] = {"n_cpu_moe": n, "n_gpu_layers": g, "kv": kv_label(*kv), "flash_attn": fa.value,
                                  "threads": t, "ubatch": u, "op_offload": po, "no_host": nh, "load_mode": lm,
                                  **dict(zip(names, own, strict=True))}
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
    """Would ``cfg`` fit? ``vram_margin_mib`` replaces llama.cpp's own 1 GiB --fit margin when given. The figures
    are the engine's own projection where a tune put it in force (:mod:`tuner.measure.engine_memory`), else the
    replay's."""
    est = price(info, cfg, hw)
    vram_over, ram_over = overs(est, hw, _margin_bytes(vram_margin_mib))
    # llama-server's prompt cache grows to its default limit where the config sets none (a set limit is in the
    # estimate): it counts, or a line whose cache can outgrow the RAM would pass.
    ram_over += prompt_cache_reach_bytes(cfg) or 0
    # Without a GPU nothing goes to one: satisfied by construction.
    return Feasibility(est, vram_over / MIB if hw.has_gpu else -1.0, ram_over / MIB)


def _margin_bytes(vram_margin_mib: float | None) -> int:
    return int(vram_margin_mib * MIB) if vram_margin_mib is not None else FIT_MARGIN_BYTES


def best_guess(space: SearchSpace, info: ModelInfo, hw: Hardware, vram_margin_mib: float | None = None
               ) -> LaunchConfig | None:
    """The memory model's pick: the most precise KV pair that fits, flash attention on, the fewest offloaded
    experts that still fit (more experts on the GPU = fewer bytes read over the slow path), all cores."""
    for k, v in space.kv_pairs:
        base = {"kv": kv_label(k, v), "flash_attn": "on", "threads": space.threads[-1], "ubatch": space.ubatch[-1]}
        lo, hi = space.n_cpu_moe or (0, 0)
        glo, ghi = space.n_gpu_layers or (0, 0)
        for n, g in product(range(lo, hi + 1), range(ghi, glo - 1, -1)):  # the fewest weights on the host first
            cfg = make_config(space, {**base, "n_cpu_moe": n, "n_gpu_layers": g})  # with that placement's --cache-ram
            if check(info, cfg, hw, vram_margin_mib).feasible:
                return cfg
    return None


# --- prompt reuse (the agent workload's session stage): the arms live in tuner.search.reuse --------------------


def reuse_fits(info: ModelInfo, cfg: LaunchConfig, hw: Hardware, vram_margin_mib: float | None = None) -> bool:
    """The memory model's gate, with what reuse costs counted (full SWA cache, checkpoints, prompt cache)."""
    return check(info, cfg, hw, vram_margin_mib).feasible
