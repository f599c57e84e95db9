"""The known-good configs a study starts from and the finish measures against: llama.cpp's own launch
(``default``: ``llama-server -m MODEL -c CTX -np N``, with its own ``--fit on``), ``--fit``'s choice under the
budget made explicit (``fit``, from ``llama-fit-params``), and the memory model's best guess.

Both of llama.cpp's arms keep both budgets (:func:`own_choice`): each carries the ``--cache-ram`` its placement
leaves room for (:mod:`tuner.search.cache_ram`), and the bare launch, which ``--fit`` fills to all the free VRAM,
carries ``-fitt`` from the VRAM budget wherever that budget holds free VRAM back (the session stage measures it).
An engine that does not fit the card by itself (ik_llama.cpp: ``EngineKind.fits_by_default``) has no ``-fitt`` and
no ``fit`` arm: its bare launch is its own placement under any budget, measured like every arm.
"""

from __future__ import annotations

from dataclasses import replace

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.core.errors import TunerError
from tuner.core.model import ModelInfo
from tuner.engine import flags, runner
from tuner.engine.build import EngineLocation
from tuner.engine.kinds import kind_by_name
from tuner.machine import hardware
from tuner.machine.hardware import Hardware
from tuner.plan.placement import placed_by_fit
from tuner.search import cache_ram, engine_axes, space

FIT_MARGIN_MIB = 1024  # llama.cpp's default -fitt


def fit_target_mib(hw: Hardware, vram_margin_mib: float | None = None) -> int:
    """The ``-fitt`` margin that makes llama.cpp's --fit fill the VRAM budget, not all the free VRAM: its own
    margin (1024 MiB, or --vram-margin) plus what the budget holds back of the free memory it will see."""
    margin = vram_margin_mib if vram_margin_mib is not None else FIT_MARGIN_MIB
    return int(margin + hardware.vram_held_back_bytes(hw) // 2**20)


def fit_config(loc: EngineLocation, base: LaunchConfig, n_layers: int, timeout_s: float = 120.0, *,
               fit_target: int | None = None) -> LaunchConfig | None:
    """llama.cpp's own ``--fit`` choice for ``base`` as a LaunchConfig, or None when the tool is missing or fails.

    ``-ot`` overrides that put layers' experts on the CPU become ``--n-cpu-moe`` (their count, of the model's
    ``n_layers``: :func:`tuner.engine.flags.parse_fit_line`); ``-ngl -1`` means "all layers" (the engine default).
    ``fit_target`` is the ``-fitt`` margin in MiB (see :func:`fit_target_mib`); None leaves llama.cpp's default.
    """
    if not loc.has("llama-fit-params"):
        return None
    argv = flags.server_argv(loc.tool("llama-fit-params"), base)
    if fit_target is not None:
        argv = flags.with_fit_target(argv, fit_target)
    try:
        res = runner.run_process(argv, timeout_s=timeout_s, what="llama-fit-params", fix="check the model file",
                                 env=flags.server_env(base))
    except TunerError:
        return None
    line = flags.fit_choice_line(res.stdout)
    return flags.parse_fit_line(line, base, n_layers) if line else None


def default_config(sp: space.SearchSpace) -> LaunchConfig:
    """What ``llama-server -m MODEL -c CTX -np N`` runs with, on the space's engine: every other setting at that
    engine's default."""
    return LaunchConfig(model=sp.model, ctx=sp.ctx, parallel=sp.parallel, device=sp.device, engine=sp.engine)


def bounded_default(sp: space.SearchSpace, hw: Hardware, vram_margin_mib: float | None = None) -> LaunchConfig:
    """The bare launch told what to leave free: ``-fitt`` from the budget where it holds back free VRAM or asks a
    wider margin than --fit's own (common/fit.cpp fits each device until its projected free memory is at least the
    target), so --fit fills the budget, not the card; else the bare launch itself. An engine that does not fit by
    default (ik_llama.cpp, whose dialect refuses -fitt) always gets its bare launch: it fills nothing by itself."""
    target = fit_target_mib(hw, vram_margin_mib)
    bare = default_config(sp)
    fits = kind_by_name(sp.engine).fits_by_default
    return replace(bare, fit_target_mib=target) if fits and hw.has_gpu and target > FIT_MARGIN_MIB else bare


def own_choice(sp: space.SearchSpace, info: ModelInfo, hw: Hardware, fit: LaunchConfig | None,
               vram_margin_mib: float | None = None) -> tuple[LaunchConfig, LaunchConfig | None]:
    """llama.cpp's own launch within the budget (:func:`bounded_default`) and --fit's placement, each with the
    --cache-ram its placement needs: the bare launch priced where --fit puts it (without llama-fit-params, at the
    most host weights the space tries; an engine that does not fit by default, where it places the line itself)."""
    bare = bounded_default(sp, hw, vram_margin_mib)
    kind = kind_by_name(sp.engine)
    if fit is not None:
        at = fit
    elif kind.fits_by_default:
        at = replace(bare, n_cpu_moe=sp.n_cpu_moe[1] if sp.n_cpu_moe else None,
                     n_gpu_layers=sp.n_gpu_layers[0] if sp.n_gpu_layers else None)
    else:
        at = placed_by_fit(info, bare, hw, engine=kind)
    return cache_ram.with_cap(info, bare, hw, at), cache_ram.with_cap(info, fit, hw) if fit is not None else None


def baseline_configs(sp: space.SearchSpace, hw: Hardware, fit: LaunchConfig | None,
                     vram_margin_mib: float | None = None, default: LaunchConfig | None = None
                     ) -> list[tuple[str, LaunchConfig]]:
    """llama.cpp's own choice, as the finish's reference arms: ``default`` (the bare launch) and ``fit``
    (llama-fit-params' placement under ``-fitt`` from the budget, made explicit) when it differs.

    The bare launch runs ``--fit on`` with a 1024 MiB margin of *all* the free VRAM (common/fit.cpp
    ``common_params_fit_impl``: the margin is per device, the free memory is what the device reports). Under a
    budget that holds back free VRAM or a wider margin (``fit_target_mib`` above the default), it would fill the VRAM
    the user kept out, so it is not an arm: llama.cpp's choice under that budget is ``fit``, and ``fit`` is the
    reference (:attr:`Finish.reference`). ``default``: the bare launch as measured (:func:`own_choice`).

    An engine that does not fit the card by itself (ik_llama.cpp: nothing on the GPU unless -ngl) fills none of the
    VRAM the budget keeps out: its bare launch is its own choice under any budget, an arm like the others (one whose
    own VRAM breaks the budget is never printed, and the finish says so)."""
    default = default or default_config(sp)
    within = not kind_by_name(sp.engine).fits_by_default or fit_target_mib(hw, vram_margin_mib) <= FIT_MARGIN_MIB
    arms = [("default", default)] if within else []
    if fit is not None and (fit != default or not within):
        arms.append(("fit", fit))
    return arms


def fewest_on_host(sp: space.SearchSpace, cfg: LaunchConfig, info: ModelInfo, hw: Hardware,
                   vram_margin_mib: float | None = None) -> LaunchConfig:
    """``cfg`` with the fewest host experts of the space at which it fits, as it is (its own KV types and ubatch:
    the space's lower bound is that of its smallest pair, where a seed with f16 KV would be refused untried, as the
    default seed once was on an H100 at 12 GiB free); unchanged when it fits nowhere or the space has no axis."""
    if not sp.n_cpu_moe:
        return cfg
    lo, hi = sp.n_cpu_moe
    for n in range(lo, hi + 1):
        placed = space.make_config(sp, {**space.params_of(sp, cfg), "n_cpu_moe": n})  # with its own --cache-ram
        if space.check(info, placed, hw, vram_margin_mib).feasible:
            return placed
    return cfg


def seed_configs(sp: space.SearchSpace, info: ModelInfo, hw: Hardware, fit: LaunchConfig | None,
                 vram_margin_mib: float | None = None) -> list[tuple[str, LaunchConfig]]:
    """Known-good starting points, as configs of the space: the defaults, --fit's choice, the memory model's."""
    d = default_config(sp)
    # llama.cpp's default keeps every expert on the card and lets --fit move some: in the space, the fewest moved
    # that still fit with the default's own f16 KV (its n_cpu_moe None maps to the space's bound, which is that
    # of the smallest KV pair).
    on = space.make_config(sp, {**space.params_of(sp, replace(d, flash_attn=FlashAttn.ON)), "threads": sp.threads[-1]})
    seeds = [("default", fewest_on_host(sp, on, info, hw, vram_margin_mib))]
    if fit is not None:
        seeds.append(("fit", space.make_config(sp, space.params_of(sp, replace(fit, flash_attn=FlashAttn.ON)))))
    guess = space.best_guess(sp, info, hw, vram_margin_mib)
    if guess is not None:
        seeds.append(("memory-model", guess))
    promising = engine_axes.promising(sp.engine_levers)
    if promising:  # the engine's own levers where they were measured to pay (tuner.search.engine_axes)
        base = guess or seeds[0][1]
        seeds.append(("engine-levers", space.make_config(sp, {**space.params_of(sp, base), **promising})))
    if "none" in sp.load_mode and not (hw.has_gpu and sp.device != "none"):
        # On the CPU alone a resident copy is what keeps a model off the disk when other work takes the page cache
        # (tuner.search.levers); another engine's line that loads its weights into RAM (ik's -rtr) races this one.
        base = guess or seeds[0][1]
        seeds.append(("resident", space.make_config(sp, {**space.params_of(sp, base), "load_mode": "none"})))
    out: list[tuple[str, LaunchConfig]] = []
    for label, cfg in seeds:
        if all(cfg != c for _, c in out):
            out.append((label, cfg))
    return out
