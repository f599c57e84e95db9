"""Plans without launching: for each offload step, what a config needs in VRAM and RAM, whether it fits, and its
speed ceilings; the steps that fit each ctx/KV combination; the largest context that fits at each KV type. Pure,
like tuner.plan.memory.

The offload axis is a count of layers' weights moved to the host (:class:`Offload`): for a MoE model the routed
experts of the first N layers (``--n-cpu-moe N``), for a dense model whole layers (``-ngl``: the last
``n_layer + 1 - N`` layers, the output head counted as one, stay on the GPU). Feasibility along it is an
interval: each step frees VRAM and takes RAM, so VRAM bounds it from below and host RAM from above; it can be
empty with neither end at the edge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.core.units import MIB
from tuner.plan.memory import CTX_PAD, FIT_MARGIN_BYTES, MemoryEstimate, Verdict, estimate
from tuner.plan.pricing import Price
from tuner.plan.roofline import Roofline, roofline

KV_CHOICES: tuple[tuple[CacheType, CacheType], ...] = (
    (CacheType.F16, CacheType.F16), (CacheType.Q8_0, CacheType.Q8_0), (CacheType.Q4_0, CacheType.Q4_0),
)


@dataclass(frozen=True, slots=True)
class Offload:
    """How a model moves weights to the host, step by step. ``--n-cpu-moe`` moves routed experts only, so for a
    dense model (no experts) it moves nothing: there the axis is ``-ngl``, whole layers (``llama_model_base::
    load_tensors``: ``i_gpu_start = n_layer + 1 - n_gpu_layers``, the output head being the last of them)."""

    dense: bool
    n_layer: int
    gpu: bool = True  # no card: every weight on the CPU whatever the flag says, so one step (a plan prints one row)

    @property
    def setting(self) -> str:
        """The LaunchConfig field the axis sets (``tuner.engine.flags`` spells it)."""
        return "n_gpu_layers" if self.dense else "n_cpu_moe"

    @property
    def steps(self) -> int:
        """Step 0 keeps everything on the GPU; the last moves every layer's (experts') weights to the host."""
        if not self.gpu:
            return 1
        return self.n_layer + (2 if self.dense else 1)

    def value(self, step: int) -> int:
        """The flag's value at ``step``: ``--n-cpu-moe step``, or ``-ngl n_layer + 1 - step``."""
        return self.n_layer + 1 - step if self.dense else step

    def step(self, cfg: LaunchConfig) -> int:
        """Where ``cfg`` sits on the axis (unset flags: everything on the GPU, llama.cpp's default)."""
        if self.dense:
            return 0 if cfg.n_gpu_layers is None else max(0, self.n_layer + 1 - cfg.n_gpu_layers)
        return cfg.n_cpu_moe or 0

    def apply(self, cfg: LaunchConfig, step: int) -> LaunchConfig:
        if self.dense:
            return replace(cfg, n_gpu_layers=self.value(step))
        return replace(cfg, n_cpu_moe=step)

    def span(self, lo: int, hi: int) -> str:
        """Steps ``lo..hi`` in words, the fastest first: ``--n-cpu-moe 3..7`` or ``-ngl 40..36``."""
        if not self.gpu:
            return "everything on the CPU"
        a, b = self.value(lo), self.value(hi)
        values = f"{a}" + ("" if a == b else f"..{b}")
        return f"-ngl {values}" if self.dense else f"--n-cpu-moe {values}"


def offload_of(model: ModelInfo) -> Offload:
    return Offload(dense=not model.n_expert, n_layer=model.n_layer)


def plan_axis(model: ModelInfo, hw: Hardware) -> Offload:
    """The axis a plan's table walks on ``hw``: the model's offload axis, or its one step where no GPU is there."""
    return Offload(dense=not model.n_expert, n_layer=model.n_layer, gpu=hw.has_gpu)


@dataclass(frozen=True, slots=True)
class PlanRow:
    step: int  # on the model's offload axis (plan_rows' Offload)
    estimate: MemoryEstimate
    roofline: Roofline
    offload: Offload = Offload(False, 0)

    @property
    def n_cpu_moe(self) -> int | None:
        return None if self.offload.dense else self.step

    @property
    def n_gpu_layers(self) -> int | None:
        return self.offload.value(self.step) if self.offload.dense else None

    @property
    def fits(self) -> bool:
        return self.estimate.verdict is Verdict.FITS


@dataclass(frozen=True, slots=True)
class FitInterval:
    """The --n-cpu-moe values at which a config fits, ``lo``..``hi`` inclusive; both None when none does.

    When none does, ``ram_short_bytes`` is the RAM missing at the fewest host experts VRAM allows (None: even
    every expert on the host overflows the card) and ``vram_short_bytes`` the VRAM missing at the most host
    experts RAM allows (None: even every expert on the card overflows the RAM). Either fix alone would do.
    """

    lo: int | None
    hi: int | None
    ram_short_bytes: int | None = None
    vram_short_bytes: int | None = None
    offload: Offload = Offload(False, 0)  # what the steps lo..hi stand for

    @property
    def fits(self) -> bool:
        return self.lo is not None

    def describe(self) -> str:
        if self.lo is not None:
            return f"fits with {self.offload.span(self.lo, self.hi if self.hi is not None else self.lo)}"
        fixes = []
        if self.ram_short_bytes is not None:
            fixes.append(f"{_gib(self.ram_short_bytes)} more RAM")
        if self.vram_short_bytes is not None:
            fixes.append(f"a {_gib(self.vram_short_bytes)} larger card")
        return "does not fit: needs " + (" or ".join(fixes) if fixes else "more VRAM and more RAM")

    def to_dict(self) -> dict[str, int | str | None]:
        """``lo``/``hi`` are steps; ``flag_lo``/``flag_hi`` the same ends as values of the axis's ``setting``."""
        ends = {"setting": self.offload.setting,
                "flag_lo": None if self.lo is None else self.offload.value(self.lo),
                "flag_hi": None if self.hi is None else self.offload.value(self.hi)}
        return {"lo": self.lo, "hi": self.hi, "ram_short_bytes": self.ram_short_bytes,
                "vram_short_bytes": self.vram_short_bytes, **ends}


def _gib(n_bytes: int) -> str:
    return f"{max(n_bytes, 1) / 2**30:.1f} GiB"


def overs(est: MemoryEstimate, hw: Hardware, margin_bytes: int = FIT_MARGIN_BYTES) -> tuple[int, int]:
    """(VRAM over the budget with the margin, host need over the available RAM), in bytes; <= 0 fits."""
    vram = est.gpu.total_bytes + margin_bytes - hw.vram_budget_bytes if hw.has_gpu else -1
    return vram, est.host.total_bytes - hw.ram_available_bytes


def fit_interval(model: ModelInfo, cfg: LaunchConfig, hw: Hardware,
                 margin_bytes: int = FIT_MARGIN_BYTES, price: Price | None = None) -> FitInterval:
    """Which offload steps fit ``cfg`` on ``hw`` (:func:`offload_of`), and, when none does, what is short by how
    much: :func:`interval_of` over every step, from a handful of estimates.

    Each step moves one layer's weights from the card to the host, so the card's need falls and the host's rises
    step by step (the compute buffer may grow by a host weight's copy, less than the layer it moved): the steps
    that fit the card are a suffix, those that fit the RAM a prefix, and a bisection finds each end. On a 30B MoE
    that is 12 compute-graph replays instead of 49. With ``price`` (an engine's own projection: :mod:`tuner.plan.
    pricing`) the replay's ends are the first guess and the price settles each end from there: two projections per
    end when the replay was right, a few more when it drifted."""
    axis = offload_of(model)
    last = axis.steps - 1
    replay, decided = _overs_by(model, cfg, hw, margin_bytes, price)
    lo = _end(lambda o: o[0] <= 0, replay, decided, last)  # the fewest steps the card holds
    hi = _end(lambda o: o[1] > 0, replay, decided, last)  # the first step the RAM does not hold
    over = decided or replay
    hi = last if hi is None else hi - 1 if hi > 0 else None
    if lo is not None and hi is not None and lo <= hi:
        return FitInterval(lo, hi, offload=axis)
    return FitInterval(None, None, ram_short_bytes=over(lo)[1] if lo is not None else None,
                       vram_short_bytes=over(hi)[0] if hi is not None else None, offload=axis)


Over = Callable[[int], tuple[int, int]]  # an offload step's (VRAM, RAM) over the budgets, as :func:`overs` says


def _overs_by(model: ModelInfo, cfg: LaunchConfig, hw: Hardware, margin_bytes: int, price: Price | None
              ) -> tuple[Over, Over | None]:
    """:func:`overs` at each offload step of ``cfg``, memoized: by the replay, and by ``price`` where one is given."""
    axis = offload_of(model)

    def by(priced: Price) -> Over:
        seen: dict[int, tuple[int, int]] = {}

        def over(n: int) -> tuple[int, int]:
            if n not in seen:
                seen[n] = overs(priced(model, axis.apply(cfg, n), hw), hw, margin_bytes)
            return seen[n]

        return over

    return by(estimate), (by(price) if price is not None else None)


def _end(holds: Callable[[tuple[int, int]], bool], replay: Over, decided: Over | None, last: int) -> int | None:
    """The first step whose overs ``holds``: bisected on the replay, then settled by the deciding figures from there
    (:func:`_settle`) where there are any."""
    guess = _first(lambda n: holds(replay(n)), last)
    return guess if decided is None else _settle(lambda n: holds(decided(n)), guess, last)


class DefaultPlacement(Protocol):
    """How an engine places a line that leaves the placement open (:class:`tuner.engine.kinds.EngineKind` answers;
    this pure module asks it as given)."""

    @property
    def fits_by_default(self) -> bool: ...

    @property
    def offloads_by_default(self) -> bool: ...


def placed_by_fit(model: ModelInfo, cfg: LaunchConfig, hw: Hardware, price: Price | None = None,
                  engine: DefaultPlacement | None = None) -> LaunchConfig:
    """``cfg`` as its engine places it where the line leaves the placement open. llama.cpp (``engine`` None, or one
    that fits by default) places a line with no ``--n-cpu-moe`` and no ``-ngl`` by its ``--fit`` (on by default):
    the card keeps everything it can within the 1 GiB margin of the VRAM free at start (not of a ``--vram-budget``:
    fit does not know it), the rest of the experts (layers, for a dense model) go to the host. Priced as written,
    such a line reads as every weight on the card: lease 2's default lines read 2 % of that ceiling. For a bound, one
    step fewer than the fewest that fit whole: fit may keep the up and gate matrices of one more layer on the card
    (common/fit.cpp, LAYER_FRACTION_UP/GATE).

    Fit sizes the devices alone (``common_params_fit_impl`` fits each device to its own free memory and never asks
    the host's), so host RAM moves nothing here; the card's need is ``price``'s where one is given (the engine's own
    projection), the replay making the first guess.

    An engine with no fit of its own places a line with no ``-ngl`` at its default layer count whatever
    ``--n-cpu-moe`` says: every layer on the host where it does not offload by default (ik_llama.cpp,
    ``llama_model_default_params``: ``n_gpu_layers`` 0), every layer on the card where it does."""
    if not hw.has_gpu or cfg.device == "none":
        return cfg
    if engine is not None and not engine.fits_by_default:
        keeps = cfg.n_gpu_layers is not None or engine.offloads_by_default
        return cfg if keeps else replace(cfg, n_gpu_layers=0)
    if cfg.n_cpu_moe is not None or cfg.n_gpu_layers is not None:
        return cfg
    axis = offload_of(model)
    replay, decided = _overs_by(model, cfg, replace(hw, vram_budget_override_bytes=None), FIT_MARGIN_BYTES, price)
    lo = _end(lambda o: o[0] <= 0, replay, decided, axis.steps - 1)
    return axis.apply(cfg, lo - 1) if lo else cfg


def _first(holds: Callable[[int], bool], last: int) -> int | None:
    """The smallest step in 0..last where ``holds`` (false below it, true from it on), or None."""
    if not holds(last):
        return None
    return _bisect(holds, 0, last)


def _bisect(holds: Callable[[int], bool], a: int, b: int) -> int:
    """The smallest step in a..b where ``holds``, given that it holds at b."""
    while a < b:
        mid = (a + b) // 2
        if holds(mid):
            b = mid
        else:
            a = mid + 1
    return a


def _settle(holds: Callable[[int], bool], guess: int | None, last: int) -> int | None:
    """:func:`_first` starting from a guess (None: the guess was that it holds nowhere): it gallops away from the
    guess, 1, 2, 4 steps, until the answer is bracketed, then bisects; the guess right costs two calls."""
    start = last if guess is None else guess
    if holds(start):
        ok, step, bad = start, 1, -1
        while ok > 0:
            probe = max(0, ok - step)
            if not holds(probe):
                bad = probe
                break
            ok, step = probe, step * 2
        return _bisect(holds, bad + 1, ok)
    bad, step = start, 1
    while bad < last:
        probe = min(last, bad + step)
        if holds(probe):
            return _bisect(holds, bad + 1, probe)
        bad, step = probe, step * 2
    return None


def interval_of(estimates: Sequence[MemoryEstimate], hw: Hardware,
                margin_bytes: int = FIT_MARGIN_BYTES, axis: Offload = Offload(False, 0)) -> FitInterval:
    """:func:`fit_interval` from estimates already made, one per offload step from 0 up."""
    rows = [overs(est, hw, margin_bytes) for est in estimates]
    ok = [n for n, (v, h) in enumerate(rows) if v <= 0 and h <= 0]
    if ok:
        return FitInterval(ok[0], ok[-1], offload=axis)
    vram_ok = [n for n, (v, _) in enumerate(rows) if v <= 0]
    ram_ok = [n for n, (_, h) in enumerate(rows) if h <= 0]
    return FitInterval(None, None,
                       ram_short_bytes=min(rows[n][1] for n in vram_ok) if vram_ok else None,
                       vram_short_bytes=min(rows[n][0] for n in ram_ok) if ram_ok else None, offload=axis)


@dataclass(frozen=True, slots=True)
class SmallestFit:
    """The --n-cpu-moe values that fit at one ctx and KV pair (the name is kept from when it was one bound)."""

    ctx: int
    cache_type_k: CacheType
    cache_type_v: CacheType
    interval: FitInterval

    @property
    def n_cpu_moe(self) -> int | None:
        """The fastest step that fits: the fewest weights on the host (``--n-cpu-moe`` for a MoE model)."""
        return self.interval.lo


@dataclass(frozen=True, slots=True)
class LargestCtx:
    cache_type_k: CacheType
    cache_type_v: CacheType
    n_cpu_moe: int | None  # the fewest host experts that fit at that context; None when nothing fits
    ctx: int  # 0: not even the smallest context fits


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelInfo
    hardware: Hardware
    base: LaunchConfig
    rows: tuple[PlanRow, ...]
    smallest_fits: tuple[SmallestFit, ...]
    largest_ctx: tuple[LargestCtx, ...]
    n_configs: int


def plan_rows(model: ModelInfo, base: LaunchConfig, hw: Hardware, price: Price | None = None
              ) -> tuple[PlanRow, ...]:
    axis = plan_axis(model, hw)
    priced = price or estimate
    rows = []
    for n in range(axis.steps):
        cfg = axis.apply(base, n)
        rows.append(PlanRow(n, priced(model, cfg, hw), roofline(model, cfg, hw), axis))
    return tuple(rows)


def load_mode_note(model: ModelInfo, base: LaunchConfig, hw: Hardware, fit: SmallestFit,
                   price: Price | None = None) -> str | None:
    """A sentence when the other load mode (``--load-mode none`` vs mmap) changes which --n-cpu-moe fit at the
    context and KV pair of ``fit`` (a summary of :func:`make_plan` for ``base``)."""
    other = replace(_with_kv(replace(base, ctx=fit.ctx), fit.cache_type_k, fit.cache_type_v), mmap=not base.mmap)
    alt = fit_interval(model, other, hw, price=price)
    if (alt.lo, alt.hi) == (fit.interval.lo, fit.interval.hi):
        return None
    flag = "--load-mode mmap" if other.mmap else "--load-mode none"
    return f"with {flag}: {alt.describe()}"


def smallest_fitting_n_cpu_moe(model: ModelInfo, cfg: LaunchConfig, hw: Hardware) -> int | None:
    """Fewest layers' experts on the host that still fit (the low end of :func:`fit_interval`)."""
    return fit_interval(model, cfg, hw).lo


def largest_fitting_ctx(model: ModelInfo, cfg: LaunchConfig, hw: Hardware,
                        price: Price | None = None) -> tuple[int, int | None]:
    """Largest context (a multiple of 256, at most the training context) at which some offload step fits, and the
    fewest host weights (the lowest step) that fit there. More context only adds memory on both sides, so this is
    monotone: bisected on the replay, then settled by ``price`` (an engine's projection) when one is given."""
    def fitting(ctx: int, by: Price | None = None) -> int | None:
        return fit_interval(model, replace(cfg, ctx=ctx), hw, price=by).lo

    steps = max(1, model.ctx_train // CTX_PAD)
    lo, hi = 0, steps
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fitting(mid * CTX_PAD) is not None:
            lo = mid
        else:
            hi = mid - 1
    if price is not None:  # the first of 1..steps that does not fit, as index k - 1
        fails = _settle(lambda i: fitting((i + 1) * CTX_PAD, price) is None, lo if lo < steps else None, steps - 1)
        lo = steps if fails is None else fails
    return lo * CTX_PAD, (fitting(lo * CTX_PAD, price) if lo else None)


def make_plan(model: ModelInfo, base: LaunchConfig, hw: Hardware, ctxs: Sequence[int] = (),
              kv_choices: Sequence[tuple[CacheType, CacheType]] = (), price: Price | None = None) -> Plan:
    """The table for ``base`` (its ctx and KV types) at every n_cpu_moe, plus the two summaries; ``price``: the
    figures that decide (an engine's projection, :mod:`tuner.plan.pricing`), else the replay's."""
    ctxs = list(ctxs) or [base.ctx or model.ctx_train]
    kv = list(dict.fromkeys([(base.cache_type_k, base.cache_type_v), *kv_choices]))
    table = replace(base, ctx=ctxs[0])
    rows = plan_rows(model, table, hw, price)
    axis = plan_axis(model, hw)
    n = len(rows)
    smallest = []
    for ctx in ctxs:
        for ctk, ctv in kv:
            cfg = _with_kv(replace(base, ctx=ctx), ctk, ctv)
            if cfg == table:  # the table's own ctx/KV pair: its rows are these estimates already
                interval = interval_of([r.estimate for r in rows], hw, axis=axis)
            elif not axis.gpu:  # one step: the one estimate says it
                interval = interval_of([(price or estimate)(model, cfg, hw)], hw, axis=axis)
            else:
                interval = fit_interval(model, cfg, hw, price=price)
            n += 0 if cfg == table else axis.steps
            smallest.append(SmallestFit(ctx, ctk, ctv, interval))
    largest = []
    for ctk, ctv in kv:
        ctx_max, n_cpu_moe = largest_fitting_ctx(model, _with_kv(base, ctk, ctv), hw, price)
        largest.append(LargestCtx(ctk, ctv, n_cpu_moe, ctx_max))
        n += ((model.ctx_train // CTX_PAD).bit_length() + 2) * axis.steps
    return Plan(model, hw, base, rows, tuple(smallest), tuple(largest), n)


def _with_kv(cfg: LaunchConfig, ctk: CacheType, ctv: CacheType) -> LaunchConfig:
    # A quantized V cache needs flash attention: turn it on rather than plan a config the engine refuses.
    fa = FlashAttn.ON if ctv.is_quantized and cfg.flash_attn is FlashAttn.OFF else cfg.flash_attn
    return replace(cfg, cache_type_k=ctk, cache_type_v=ctv, flash_attn=fa)


def engine_tolerance_mib(engine_mib: float, model_bytes: int) -> float:
    """How far the memory model may sit from llama.cpp's own figure for one component and still agree: 2 % of
    the engine's figure, and never less than 4 MiB (both sides are whole MiB) or, for models of 1 GiB and more,
    16 MiB (per-layer graph rounding adds up: the worst real-scale row measured was 12 MiB, GLM-4.5-Air compute).
    The one tolerance: ``plan --engine-check``, the tests and scripts/bench_memory_model.py all use it."""
    floor_mib = 16 if model_bytes >= 2**30 else 4
    return max(floor_mib, 0.02 * engine_mib)


def engine_agrees(model_mib: float, engine_mib: float, model_bytes: int) -> bool:
    return abs(model_mib - engine_mib) <= engine_tolerance_mib(engine_mib, model_bytes)


@dataclass(frozen=True, slots=True)
class EngineCheckRow:
    """One memory component: the tool's model beside llama.cpp's own projection (``llama-fit-params``)."""

    component: str  # "weights", "context", "compute"
    where: str  # "host" or "gpu"
    model_mib: int
    engine_mib: int
    tolerance_mib: float  # engine_tolerance_mib for this component and model

    @property
    def error_mib(self) -> int:
        return self.model_mib - self.engine_mib

    @property
    def agrees(self) -> bool:
        return abs(self.error_mib) <= self.tolerance_mib


def engine_check_rows(est: MemoryEstimate, mmap: bool, engine_host: dict[str, int],
                      engine_gpu: dict[str, int] | None, model_bytes: int) -> tuple[EngineCheckRow, ...]:
    """Compare ``est`` with llama.cpp's projection (MiB per component, host side including CPU_REPACK).

    The projection sizes the mapped weights without the tensors it will repack (the loaded model maps
    the whole range), so the model's host weights are compared without that double count.
    """
    host_w = est.engine_host_weights_bytes - (est.repack_bytes if mmap else 0)
    sides = [("host", (host_w, est.host.context_bytes, est.host.compute_bytes), engine_host)]
    if engine_gpu is not None:
        sides.append(("gpu", (est.gpu.weights_bytes, est.gpu.context_bytes, est.gpu.compute_bytes), engine_gpu))
    return tuple(
        EngineCheckRow(comp, where, ours // MIB, theirs[part], engine_tolerance_mib(theirs[part], model_bytes))
        for where, figures, theirs in sides
        for comp, part, ours in zip(("weights", "context", "compute"), ("model", "context", "compute"), figures,
                                    strict=True)
    )


def scaled(model: ModelInfo, ratio: float) -> ModelInfo:
    """Another quant of the same model, priced from this one's header: every tensor scaled by the ratio of the
    two files' sizes (same shapes, other types), which is what the files differ by."""
    if ratio == 1.0:
        return model
    return replace(model, tensors=tuple(replace(t, n_bytes=round(t.n_bytes * ratio)) for t in model.tensors))


def fit_verdict(model: ModelInfo, ctx_tokens: int, hw: Hardware) -> str:
    """Whether ``model`` runs on ``hw`` at ``ctx_tokens`` (one slot), in the user's words: "VRAM" (all on the
    GPU), "offload N" (with --n-cpu-moe N, the fewest that fit) or "offload N..M" (when host RAM caps it),
    "-ngl N" (a dense model: the most layers that fit on the GPU),
    "RAM (no GPU)" (a machine without a GPU holds it) or "no"."""
    cfg = LaunchConfig(model=model.paths[0], ctx=ctx_tokens, parallel=1)
    if not hw.has_gpu:
        return "RAM (no GPU)" if estimate(model, cfg, hw).verdict is Verdict.FITS else "no"
    interval = fit_interval(model, cfg, hw)
    if interval.lo is None:
        return "no"
    if interval.lo == 0:
        return "VRAM"
    axis = interval.offload
    if axis.dense:  # the most layers that fit on the GPU
        return f"-ngl {axis.value(interval.lo)}"
    capped = interval.hi is not None and interval.hi < model.n_layer
    return f"offload {interval.lo}..{interval.hi}" if capped else f"offload {interval.lo}"
