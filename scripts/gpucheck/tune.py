"""(b) of `scripts/gpu_check`: tuned vs llama.cpp's ``--fit`` vs its default at one budget, one workload, as
auto-tune decides it, run lean enough for a lease: a few trials (the memory model's pick and llama.cpp's --fit
choice are among them), one candidate, three or four confirmation rounds of the three arms (the fewest a verdict
takes), no KV quality pricing (``--max-kld off``: pricing a real-scale model's KV types is the CPU suite's work)
and no session stage. The result is auto-tune's own JSON (what ``moe-tune auto-tune --json`` prints), so the
table reads the same fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner.engine import build, runner
from tuner.machine import ballast, hardware
from tuner.measure import workload
from tuner.search import autotune, study
from tuner.search.decide import Rounds
from tuner.search.verdict import MIN_ROUNDS

TRIALS = 3
# One candidate: nothing to select. A verdict needs MIN_ROUNDS fresh rounds (tuner/search/verdict.py); the first
# lease ran two, so no tune could be shown faster than llama.cpp's default, whatever the gap.
LEAN_ROUNDS = Rounds(min=MIN_ROUNDS, max=MIN_ROUNDS + 1, select=0)


def tune(engine_dir: Path, model: Path, budget_mib: int, kind: str, ctx: int, prompt_tokens: int | None,
         results_dir: Path, log: Any, trials: int = TRIALS) -> dict[str, Any]:
    """With all but ``budget_mib`` of the card held by a ballast, auto-tune ``kind`` at ``-c ctx``."""
    loc = build.locate_engine(engine_dir)
    load = workload.preset(workload.WorkloadKind(kind), prompt_tokens=prompt_tokens)
    with ballast.hold_vram(budget_mib, runner) as b:
        hw = hardware.probe_hardware(host_bandwidth_s=0.5)
        req = autotune.TuneRequest(
            model=model, workload=load, min_ctx=ctx, max_kld=None, budget=study.Budget(trials=trials),
            measure=study.Measure.for_workload(load, repetitions=2), rounds=LEAN_ROUNDS, top_candidates=1,
            results_dir=results_dir, session=None)
        res = autotune.auto_tune(req, loc, hw, on_step=log)
    doc = res.result.to_dict()
    return {"free_mib": b.free_mib, "ballast_mib": b.held_mib, "ballast_method": b.method, "workload": kind,
            "ctx": ctx, "prompt_tokens": load.prompt_tokens, "trials": trials,
            "rounds": {"min": LEAN_ROUNDS.min, "max": LEAN_ROUNDS.max, "select": LEAN_ROUNDS.select},
            "tune": {k: doc.get(k) for k in ("winner", "finish", "speedup", "space")} | {
                "result_dir": str(res.result_dir), "drift": res.search.drift}}
