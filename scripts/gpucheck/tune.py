"""(b) of `scripts/gpu_check`: the tuner's own search at one budget and workload, run lean enough for a lease.

:func:`search` is auto-tune's search with a few trials (llama.cpp's default and ``--fit`` choice and the memory
model's pick are among the seeds) and no finish (``TuneRequest.search_only``): its best line goes on to
:mod:`gpucheck.versus`, which measures it against llama.cpp's default with both servers loaded. No KV quality
pricing (``--max-kld off``: pricing a real-scale model's KV types is the CPU suite's work).
Lease 2 ran the whole auto-tune here instead (its finish: two confirmation rounds of three arms, a server start per
arm and round: 87–180 s a run, and no verdict, since two rounds never decide one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner.engine import build, runner
from tuner.machine import ballast, hardware
from tuner.measure import workload
from tuner.search import autotune, study
from tuner.search.trials import config_to_dict

TRIALS = 3


def search(engine_dir: Path, model: Path, budget_mib: int, kind: str, ctx: int, prompt_tokens: int | None,
           results_dir: Path, log: Any, trials: int = TRIALS) -> dict[str, Any]:
    """With all but ``budget_mib`` of the card held by a ballast, auto-tune's search only: its best line (None when
    the best is llama.cpp's own default or --fit choice) and the default line, as config dicts."""
    loc = build.locate_engine(engine_dir)
    load = workload.preset(workload.WorkloadKind(kind), prompt_tokens=prompt_tokens)
    with ballast.hold_vram(budget_mib, runner) as b:
        hw = hardware.probe_hardware(host_bandwidth_s=0.5)
        req = autotune.TuneRequest(
            model=model, workload=load, min_ctx=ctx, max_kld=None, budget=study.Budget(trials=trials),
            measure=study.Measure.for_workload(load, repetitions=2), top_candidates=1, results_dir=results_dir,
            session=None, search_only=True)
        res = autotune.auto_tune(req, loc, hw, on_step=log)
    best = res.candidates[0] if res.candidates else None
    return {"free_mib": b.free_mib, "ballast_mib": b.held_mib, "workload": kind, "ctx": ctx,
            "prompt_tokens": load.prompt_tokens, "trials": trials, "result_dir": str(res.result_dir),
            "best": config_to_dict(best) if best is not None else None,
            "default": config_to_dict(res.default) if res.default is not None else None,
            "drift": res.search.drift}
