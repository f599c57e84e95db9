"""The levers only one engine has, as axes of its search: for ik_llama.cpp (:mod:`tuner.engine.kinds`), run-time
repacking (``-rtr``), its fused MoE op (on by default), experts' up and gate merged at load (``-muge``) and, with a
GPU and experts in RAM, copying only the experts a batch routes to (on by default).

Each axis is a LaunchConfig field and its values, the engine's default first (a seed that does not name it keeps
the default); the kind says which of its levers are measured (``EngineKind.measured_levers``: the pool's gate
refuses a shared line that sets any other, :mod:`tuner.share.gate`). Levers left out are said, with why: ``-amb``
bounds attention's batch only without flash attention (ik's common.h) and the search runs it on; ``-gr`` off
rebuilds the graph every token, which only costs; ``-ser`` drops experts and so changes outputs: it is a quality
trade, not a speed setting, and is not searched yet.
"""

from __future__ import annotations

from typing import Any

from tuner.core.model import ModelInfo
from tuner.engine.kinds import EngineKind
from tuner.machine.hardware import Hardware

Axes = tuple[tuple[str, tuple[Any, ...]], ...]
# Where a seed starts the engine's own levers: -rtr took ik_llama.cpp's prompt speed on this project's 2-core CPU from
# 25.5-27.0 to 38.9-40.5 tok/s and its generation from 10.6-10.9 to 12.3-13.0 on the Qwen3-30B-A3B shape (llama-bench,
# -fmoe 1 on in both: ../shared/DESIGN.md §16). The sampler goes on from there.
PROMISING = {"run_time_repack": True}


def engine_axes(kind: EngineKind, info: ModelInfo, hw: Hardware, device: str | None, host_experts: bool
                ) -> tuple[Axes, tuple[str, ...]]:
    """The kind's own axes for this model and machine, and a note on the levers it leaves out."""
    axes: list[tuple[str, tuple[Any, ...]]] = []
    if kind.measures("run_time_repack"):
        axes.append(("run_time_repack", (False, True)))
    if info.n_expert:
        if kind.measures("fused_moe"):
            axes.append(("fused_moe", (True, False)))
        if kind.measures("merge_up_gate"):
            axes.append(("merge_up_gate", (False, True)))
        on_gpu = hw.has_gpu and device != "none"
        if on_gpu and host_experts and kind.measures("only_active_experts"):
            axes.append(("only_active_experts", (True, False)))
    if not axes:
        return (), ()
    note = (f"{kind.name}'s own levers searched: {', '.join(name for name, _ in axes)}; left at their defaults: "
            "-amb (only without flash attention), -gr (graph reuse on), -ser (changes outputs: not a speed setting)")
    return tuple(axes), (note,)


def promising(axes: Axes) -> dict[str, Any]:
    """The values a seed gives the axes of this space that are known to pay (none: no such seed)."""
    names = {name for name, _ in axes}
    return {k: v for k, v in PROMISING.items() if k in names}


def axis_values(axes: Axes, params: dict[str, Any]) -> dict[str, Any]:
    """The LaunchConfig fields a set of parameter values gives the engine's axes (the default where unnamed)."""
    return {name: params.get(name, values[0]) for name, values in axes}
