"""(a) of `scripts/gpu_check`: the memory model against llama.cpp's own CUDA breakdown at one budget, component by
component: the model's weights, context and compute on the card and on the host, beside llama.cpp's projection
(``llama-fit-params -fitp on``) and its figures at exit from a llama-server that loaded the config
(``--log-jsonl`` ``fit_memory_breakdown``). The config is the memory model's own pick at the budget: the fewest
host experts that fit at f16 KV with flash attention, one slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.engine import breakdown, build, flags, runner
from tuner.engine.breakdown import MemoryBreakdown
from tuner.machine import ballast, hardware
from tuner.models.gguf_reader import inspect_model
from tuner.plan import memory
from tuner.plan.memory import MemoryEstimate
from tuner.plan.placement import engine_tolerance_mib, fit_interval

MIB = 2**20


def compare(est: MemoryEstimate, truth: MemoryBreakdown, model_bytes: int, src: str) -> list[dict[str, Any]]:
    """One row per device and component: the memory model's MiB beside llama.cpp's, and whether they agree
    within the tolerance every component is held to (2 %, at least 16 MiB for a model of 1 GiB and more). The
    CUDA context (driver, cuBLAS workspace) is outside llama.cpp's breakdown and is left out here too."""
    ours = {("GPU", "model"): est.gpu.weights_bytes, ("GPU", "context"): est.gpu.context_bytes,
            ("GPU", "compute"): est.gpu.compute_bytes, ("host", "model"): est.engine_host_weights_bytes,
            ("host", "context"): est.host.context_bytes, ("host", "compute"): est.host.compute_bytes}
    rows = []
    for (device, part), value in ours.items():
        engine = truth.device_total(part) if device == "GPU" else truth.host_total(part)
        tol = engine_tolerance_mib(engine, model_bytes)
        rows.append({"src": src, "device": device, "component": part, "model_mib": value // MIB,
                     "engine_mib": engine, "tolerance_mib": round(tol), "agrees": abs(value // MIB - engine) <= tol})
    return rows


def memory_check(engine_dir: Path, model: Path, budget_mib: int, ctx: int, log_dir: Path) -> dict[str, Any]:
    """With all but ``budget_mib`` of the card held by a ballast: the model's pick, projected and loaded."""
    loc = build.locate_engine(engine_dir)
    info = inspect_model(model)
    with ballast.hold_vram(budget_mib, runner) as b:
        hw = hardware.probe_hardware(host_bandwidth_s=0)
        base = LaunchConfig(model=model, ctx=ctx, parallel=1, flash_attn=FlashAttn.ON)
        fits = fit_interval(info, base, hw)
        if fits.lo is None:
            return {"free_mib": b.free_mib, "rows": [], "note": f"nothing fits {b.free_mib} MiB at -c {ctx}"}
        cfg = LaunchConfig(model=model, ctx=ctx, parallel=1, flash_attn=FlashAttn.ON, n_cpu_moe=fits.lo)
        est = memory.estimate(info, cfg, hw)
        projected = breakdown.fit_params_breakdown(loc, cfg)
        _, actual = breakdown.server_breakdown(loc, cfg, log_dir)
    rows = compare(est, projected, info.tensor_bytes, "llama-fit-params") + \
        compare(est, actual, info.tensor_bytes, "llama-server at exit")
    return {"free_mib": b.free_mib, "ballast_mib": b.held_mib, "ctx": ctx, "launch_line": flags.launch_line(cfg),
            "cuda_context_mib": memory.CUDA_CONTEXT_BYTES // MIB, "rows": rows,
            "agree": sum(r["agrees"] for r in rows), "of": len(rows)}
