"""Two auto-tunes of the same model and workload, each in fresh storage, one after the other: do they crown the
same winner? (Issue 15: "two runs of the same study agree on the winner when the machine is quiet".)

    .venv/bin/python scripts/bench_repeat_winner.py [MODEL] [--workload chat] [--trials 8] [--runs 2]

Prints each run's winner, its verdicts against the baselines and the launch line; last line
``winners agree: yes|no (N runs)``. Run it on a quiet machine: it measures the quiet case.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import harness

from tuner.engine import build
from tuner.machine import hardware
from tuner.measure import workload
from tuner.models import demo
from tuner.report import study_report
from tuner.search import autotune, study


@harness.bench("bench_repeat_winner")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--workload", default="chat", choices=[k.value for k in workload.WorkloadKind])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    loc = build.locate_engine()
    model = args.model or demo.default_model(loc)
    load = workload.preset(workload.WorkloadKind(args.workload))
    hw = hardware.probe_hardware(host_bandwidth_s=0.3)
    print(f"model {model.name}; workload {load.kind.value} (P={load.prompt_tokens}, G={load.gen_tokens}, depth "
          f"{load.gen_depth}); {hw.describe()}; {args.trials} trials per run", flush=True)
    lines = []
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="repeat-winner-") as tmp:
            t0 = time.monotonic()
            req = autotune.TuneRequest(model=model, workload=load, budget=study.Budget(trials=args.trials),
                                       results_dir=Path(tmp))
            res, noise = harness.watched(lambda req=req: autotune.auto_tune(req, loc, hw))  # type: ignore[misc]
            winner = res.result.winner
            line = study_report.launch_line(res.result)
            lines.append(line)
            verdicts = "; ".join(v.describe() for v in res.result.finish.verdicts) or "no verdicts"
            print(f"run {run}: {time.monotonic() - t0:.0f} s, winner {winner.label if winner else None}: {line}"
                  f"{'; busy: ' + noise if noise else ''}")
            print(f"  {verdicts}", flush=True)
    agree = len(set(lines)) == 1
    print(f"winners agree: {'yes' if agree else 'no'} ({args.runs} runs)")


if __name__ == "__main__":
    main()
