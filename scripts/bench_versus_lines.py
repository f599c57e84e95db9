"""The head-to-head of compare-models, on launch lines a compare-models run already tuned: its own judge
(:func:`tuner.versus.judge.head_to_head`: interleaved rounds, the watch, the verdicts) replaying the bundled agent
session at ``--depth``, under the machine lock and the watch (scripts/harness.py). For when the tuning is done and
the judging is to be measured (again) at another depth.

    .venv/bin/python scripts/bench_versus_lines.py results/compare-models-x/compare-models.json --depth 2048 \
        --gen 32 --out results/compare-models-x/versus-2048.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import harness

from tuner.engine import build, flags
from tuner.measure import workload
from tuner.versus import judge


@harness.bench("bench_versus_lines")
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("comparison", type=Path)
    ap.add_argument("--depth", type=int, required=True)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    doc = json.loads(args.comparison.read_text())
    lines = [(r["plan"]["label"], flags.parse_command(r["launch_line"]).config)
             for r in doc["rows"] if r["launch_line"]]
    loc = build.locate_engine()
    load = workload.preset(workload.WorkloadKind.AGENT, min(256, args.depth), args.gen, depth_tokens=args.depth)

    def say(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    start = time.time()
    h2h = judge.head_to_head(loc, lines, load, log_dir=args.out.parent / "logs" / f"versus-{args.depth}",
                             caps=build.capabilities(loc), session=(None, args.depth, args.gen, 1), on_step=say)
    out = {"comparison": str(args.comparison), "depth": args.depth, "gen": args.gen,
           "elapsed_s": round(time.time() - start, 1), "head_to_head": h2h.to_dict()}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    say(h2h.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
