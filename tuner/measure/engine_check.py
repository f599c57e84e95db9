"""The memory model beside llama.cpp's own projection of the same launch (``llama-fit-params``: header only,
nothing allocated), component by component, judged by the one tolerance (:func:`engine_tolerance_mib`)."""

from __future__ import annotations

from dataclasses import replace

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo
from tuner.engine import breakdown
from tuner.engine.build import EngineLocation
from tuner.plan.memory import estimate
from tuner.plan.placement import EngineCheckRow, engine_check_rows


def engine_check(loc: EngineLocation, info: ModelInfo, base: LaunchConfig, hw: Hardware
                 ) -> tuple[tuple[EngineCheckRow, ...], bool]:
    """Rows for ``base``, and whether the engine projected only the CPU backend (a build without a GPU backend,
    so the comparison is for CPU only even when ``hw`` has a card)."""
    # llama-fit-params takes no --kv-unified; one slot unless -np says otherwise keeps both sides equal.
    cfg = replace(base, parallel=base.parallel or 1, kv_unified=None)
    truth = breakdown.fit_params_breakdown(loc, cfg)
    host = {part: truth.host_total(part) for part in ("model", "context", "compute")}
    gpu = {part: truth.device_total(part) for part in ("model", "context", "compute")} if truth.devices else None
    cpu_fallback = gpu is None and hw.has_gpu
    if cpu_fallback:
        hw = hw.cpu_only()
    est = estimate(info, cfg, hw, fit_params=True)
    return engine_check_rows(est, cfg.mmap, host, gpu, info.tensor_bytes), cpu_fallback
