"""The induced spill of `scripts/gpu_check`: a ballast leaves less VRAM than a config needs, and the tool must
classify what follows every time: an OOM at load (Linux CUDA), or with ``GGML_CUDA_ENABLE_UNIFIED_MEMORY=1``
a load that spills into host memory with generation collapsing against the same config unspilled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.core.errors import TrialFailedError
from tuner.engine import build, runner
from tuner.machine import ballast, hardware
from tuner.machine.sampler import SpillKind, spill_verdict

UNIFIED_ENV = "GGML_CUDA_ENABLE_UNIFIED_MEMORY"


def _trial(loc: build.EngineLocation, cfg: LaunchConfig, log_dir: Path, roof: float | None,
           budget_bytes: int | None) -> tuple[Any, float | None, str | None]:
    """(verdict or None, gen tok/s, failure kind when it failed for another reason than memory)."""
    from tuner.measure import bench, failures, workload

    load = workload.preset(workload.WorkloadKind.CHAT, 512, 128, rounds=1)
    try:
        t = bench.run_server_trial(loc, cfg, load, log_dir=log_dir, roofline_tok_s=roof,
                                   vram_budget_bytes=budget_bytes)
        return t.spill, t.levels[0].per_request_gen_tok_s, None
    except TrialFailedError as exc:
        if exc.failure.kind is failures.FailureKind.OUT_OF_MEMORY:
            return spill_verdict(None, oom_reason=exc.failure.reason), None, None
        return None, None, f"{exc.failure.kind.value}: {exc.failure.reason}"


def spill_run(model: Path, engine_dir: Path | None, log_dir: Path, need_mib: int, *, unified: bool, ctx: int,
              tries: int, short_mib: int) -> dict[str, Any]:
    """Every expert on the GPU at ``ctx``, with ``short_mib`` less VRAM free than the memory model says it
    needs; ``tries`` times. With ``unified``, the same config unspilled first, as the reference speed."""
    from tuner.models.gguf_reader import inspect_model
    from tuner.plan.roofline import roofline

    loc = build.locate_engine(engine_dir)
    cfg = LaunchConfig(model=model, n_cpu_moe=0, ctx=ctx, parallel=1, flash_attn=FlashAttn.ON)
    hw = hardware.probe_hardware(host_bandwidth_s=0.5)
    roof = roofline(inspect_model(model), cfg, hw).gen_tok_s or None
    ref_tok_s = None
    if unified and hw.vram_free_bytes > (need_mib + 4096) * 2**20:
        ref_tok_s = _trial(loc, cfg, log_dir, roof, None)[1]
    runs = []
    for attempt in range(1, tries + 1):
        with ballast.hold_vram(max(0, need_mib - short_mib), runner) as b:
            if unified:
                os.environ[UNIFIED_ENV] = "1"
            try:
                verdict, gen, other = _trial(loc, cfg, log_dir, roof, b.free_mib * 2**20)
            finally:
                os.environ.pop(UNIFIED_ENV, None)
        row: dict[str, Any] = {"attempt": attempt, "unified": unified, "free_mib": b.free_mib, "need_mib": need_mib}
        if verdict is None:
            row.update(verdict=f"failed: {other}", evidence=other, detected=False)
        else:
            row.update(verdict=verdict.kind.value, evidence=verdict.evidence, gen_tok_s=gen,
                       vs_reference=gen / ref_tok_s if gen and ref_tok_s else None,
                       detected=verdict.kind is not SpillKind.NONE)
        runs.append(row)
    return {"runs": runs, "reference_gen_tok_s": ref_tok_s, "roofline_tok_s": roof}
