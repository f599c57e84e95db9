"""Each model planned for the card before anything is fetched or launched: does it fit at the workload's context,
with what offload (``--n-cpu-moe`` for a MoE model, ``-ngl`` for a dense one), the speed ceilings there, and how
much KV the card holds. Headers only (a Hub quant's header is read with range requests), so a user can ask before
downloading 20 GB.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tuner.catalog import families
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.models.gguf_reader import ModelInfo
from tuner.plan import memory, placement
from tuner.plan.roofline import roofline

KV_ORDER = ((CacheType.F16, CacheType.F16), (CacheType.Q8_0, CacheType.Q8_0))


@dataclass(frozen=True, slots=True)
class ModelPlan:
    label: str  # what the tables call it (the file's stem)
    name: str  # as the user named it
    source: str  # where the header came from
    arch: str
    dense: bool
    file_bytes: int
    ctx: int  # total context over the slots
    parallel: int
    fits: bool
    offload: str  # "all on the GPU", "--n-cpu-moe 12", "-ngl 40", or why nothing fits
    kv: str | None  # the most precise KV pair that fits ("f16/f16"); None: none fits
    gen_ceiling_tok_s: float | None  # the roofline's generation ceiling at that placement (empty context)
    prompt_ceiling_tok_s: float | None  # the PCIe bound on prompts with host weights; None: all on the GPU
    kv_bytes_per_token: int  # at that KV pair, over the layers that keep KV
    max_ctx: int  # the largest context that fits at that KV pair (any offload)
    active_bytes_per_token: int  # weights read per generated token (the active experts of a MoE)
    published: str | None = None  # the catalog's quality figures for this quant, labelled and sourced

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelPlan:
        return cls(**d)


def _published(info: ModelInfo, name: str) -> str | None:
    known = families.find_model(name) or families.find_model(info.name or "")
    if known is None:
        return None
    quant = name.rsplit(":", 1)[1] if ":" in name else Path(name).stem.rsplit("-", 1)[-1]
    figs = known.figures_for(quant)
    if not figs:
        return None
    f = figs[0]
    shown = ", ".join(f"{k} {v:g}" for k, v in f.figures.items())
    return f"{known.name} {f.quant}: {shown} ({f.gpu or '?'}; {known.sources.get(f.source, f.source)})"


def plan_model(name: str, info: ModelInfo, source: str, hw: Hardware, ctx: int, parallel: int = 1) -> ModelPlan:
    """``info`` planned for ``hw`` at ``ctx`` tokens over ``parallel`` slots: the most precise KV pair at which
    some offload fits, the fewest host weights there."""
    axis = placement.offload_of(info)
    path = info.paths[0]
    base = LaunchConfig(model=path, ctx=ctx, parallel=parallel, flash_attn=FlashAttn.ON)
    label = Path(path).stem
    for k, v in KV_ORDER:
        cfg = replace(base, cache_type_k=k, cache_type_v=v)
        interval = placement.fit_interval(info, cfg, hw)
        if interval.lo is None:
            continue
        placed = axis.apply(cfg, interval.lo) if interval.lo else cfg
        roof = roofline(info, placed, hw)
        where = "all on the GPU" if interval.lo == 0 else axis.span(interval.lo, interval.lo)
        if not hw.has_gpu:
            where = "host RAM (no GPU)"
        max_ctx, _ = placement.largest_fitting_ctx(info, replace(cfg, ctx=None), hw)
        return ModelPlan(label, name, source, info.arch, axis.dense, info.file_bytes, ctx, parallel, True, where,
                         f"{k.value}/{v.value}", roof.gen_tok_s or None, roof.prompt_tok_s,
                         _kv_per_token(info, k, v), max_ctx, roof.gpu_bytes_per_token + roof.host_bytes_per_token,
                         _published(info, name))
    why = placement.fit_interval(info, replace(base, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0),
                                 hw).describe()
    roof = roofline(info, base, hw)
    return ModelPlan(label, name, source, info.arch, axis.dense, info.file_bytes, ctx, parallel, False, why, None,
                     None, None, _kv_per_token(info, CacheType.F16, CacheType.F16), 0,
                     roof.gpu_bytes_per_token + roof.host_bytes_per_token, _published(info, name))


def _kv_per_token(info: ModelInfo, k: CacheType, v: CacheType) -> int:
    return round(sum(memory.kv_bytes_per_cell(info, il, k, v) for il in range(info.n_layer)))


def plan_all(names: list[str], hw: Hardware, ctx: int, parallel: int,
             resolve: Callable[[str], tuple[ModelInfo, str]]) -> list[ModelPlan]:
    """Every model planned for the same card and context; ``resolve`` reads a name's header."""
    out = []
    for name in names:
        info, source = resolve(name)
        out.append(plan_model(name, info, source, hw, ctx, parallel))
    return out
