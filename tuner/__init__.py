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

The measuring calls (``bench``, ``measure_quality``, ``auto_tune``, ``tune_frontier``, ``compare_quants``) hold
the machine's measuring lock as the commands do: a second tuner, a command or a script, waits for the first (up
to 10 minutes, then :class:`~tuner.core.errors.MachineBusyError`). They measure beside other programs' load, as
``--allow-busy`` does (each trial's watch marks the rounds it disturbs); to wait for a quiet machine first, or to
choose the wait, hold it yourself around them (they nest)::

    with tuner.hold_machine("my sweep", wait_s=3600):
        for cfg in configs:
            tuner.bench(loc, cfg, load)
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
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
    "hold_machine": ("tuner.machine.quiet", "claim_machine"),
}
__all__ = ["__version__", *_API]
MEASURING = frozenset({"bench", "measure_quality", "auto_tune", "tune_frontier", "compare_quants"})


def _holding_the_machine(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run holding the machine's measuring lock (see the module docstring)."""

    @functools.wraps(fn)
    def measured(*args: Any, **kwargs: Any) -> Any:
        from tuner.engine import runner
        from tuner.machine import quiet

        with quiet.claim_machine(f"{name} (Python API)", allow_busy=True, own=runner.own_pids) as claim:
            if claim.note:
                quiet.say_once(claim.note, claim.note)
            return fn(*args, **kwargs)

    return measured


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'tuner' has no attribute {name!r}")
    module, attr = _API[name]
    value = getattr(importlib.import_module(module), attr)
    if name in MEASURING:
        value = _holding_the_machine(name, value)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
