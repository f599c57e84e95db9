"""moe-tune: measured llama.cpp settings for Mixture-of-Experts models on one consumer GPU.

The library behind the ``moe-tune`` command. What a Python user calls is re-exported here and imported on first
use, so ``import tuner`` stays cheap (no optuna, psutil or Hub client until a name needs them)::

    import tuner

    info = tuner.inspect_model(tuner.resolve_model("qwen3-30b-a3b:Q4_K_M", header_only=True).path)
    hw = tuner.card_hardware("RTX 4060 Ti 16GB", ram_bytes=64 * 2**30)
    plan = tuner.make_plan(info, tuner.LaunchConfig(model=info.paths[0], ctx=32768), hw)

    loc = tuner.locate_engine()
    load = tuner.workload_preset(tuner.WorkloadKind.AGENT)
    result = tuner.auto_tune(tuner.TuneRequest(model=path, workload=load), loc, tuner.probe_hardware())
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name → (module, attribute). `make_plan` stands for "plan": `tuner.plan` is the planning package.
_API: dict[str, tuple[str, str]] = {
    "LaunchConfig": ("tuner.core.config", "LaunchConfig"),
    "CacheType": ("tuner.core.config", "CacheType"),
    "FlashAttn": ("tuner.core.config", "FlashAttn"),
    "TunerError": ("tuner.core.errors", "TunerError"),
    "ModelInfo": ("tuner.core.model", "ModelInfo"),
    "Hardware": ("tuner.core.machine_spec", "Hardware"),
    "resolve_model": ("tuner.hub.resolve", "resolve_model"),
    "inspect_model": ("tuner.models.gguf_reader", "inspect_model"),
    "probe_hardware": ("tuner.machine.hardware", "probe_hardware"),
    "card_hardware": ("tuner.catalog.cards", "machine"),
    "locate_engine": ("tuner.engine.build", "locate_engine"),
    "make_plan": ("tuner.plan.placement", "make_plan"),
    "estimate": ("tuner.plan.memory", "estimate"),
    "Workload": ("tuner.measure.workload", "Workload"),
    "WorkloadKind": ("tuner.measure.workload", "WorkloadKind"),
    "workload_preset": ("tuner.measure.workload", "preset"),
    "bench": ("tuner.measure.one_config", "bench_config"),
    "BenchReport": ("tuner.measure.one_config", "BenchReport"),
    "measure_quality": ("tuner.quality.perplexity", "measure"),
    "TuneRequest": ("tuner.search.autotune", "TuneRequest"),
    "auto_tune": ("tuner.search.autotune", "auto_tune"),
    "tune_frontier": ("tuner.frontier.tune", "tune_frontier"),
    "CompareRequest": ("tuner.quants.compare", "CompareRequest"),
    "compare_quants": ("tuner.quants.compare", "compare"),
    "load_result": ("tuner.search.result", "load_result"),
    "write_report": ("tuner.report.study_report", "write"),
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'tuner' has no attribute {name!r}")
    module, attr = _API[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
