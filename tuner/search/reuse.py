"""The prompt-reuse settings the agent workload's session stage tries on a tuned config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.model import ModelInfo


@dataclass(frozen=True, slots=True)
class ReuseArm:
    """One prompt-reuse setting tried on a config: a label and the LaunchConfig fields it sets."""

    label: str
    changes: tuple[tuple[str, Any], ...]

    def apply(self, cfg: LaunchConfig) -> LaunchConfig:
        return replace(cfg, **dict(self.changes))


def reuse_arms(info: ModelInfo, accepts: Callable[[str], bool], slots: int = 1) -> list[ReuseArm]:
    """The prompt-reuse settings worth a session for this model, among those the engine accepts (``accepts``:
    setting name → whether its llama-server takes the flag). Which apply follows ``server-context.cpp``:
    checkpoints are made only for memory that cannot be rolled back (recurrent state, a sliding window), where
    their count and spacing decide whether a turn restores one or re-processes everything; ``--swa-full``
    removes the need for SWA checkpoints at the price of a full-size cache; ``--cache-reuse`` shifts KV and
    only works where the memory can shift (not recurrent); the host prompt cache only matters when sessions
    share slots."""
    arms: list[ReuseArm] = []
    swa = bool(info.n_swa and any(info.swa_layers))
    if (info.is_hybrid or swa) and accepts("ctx_checkpoints"):
        arms.append(ReuseArm("checkpoints 8", (("ctx_checkpoints", 8),)))
        if accepts("checkpoint_min_step"):
            arms.append(ReuseArm("checkpoints 64, every 1024",
                                 (("ctx_checkpoints", 64), ("checkpoint_min_step", 1024))))
    if swa and accepts("swa_full"):
        arms.append(ReuseArm("swa-full", (("swa_full", True),)))
    if not info.is_hybrid and accepts("cache_reuse"):
        arms.append(ReuseArm("cache-reuse 256", (("cache_reuse", 256),)))
    if slots > 1 and accepts("cache_ram_mib"):
        arms.append(ReuseArm("prompt cache 2048 MiB", (("cache_ram_mib", 2048),)))
    return arms
