"""Time to an answer: `moe-tune auto-tune --frontier` with its default budget on the demo model, chat and batch,
output to a file (not a terminal), as a person would run it. Prints each run's wall time, its progress lines
(how many, and the longest silence between two lines), the front it answered with, and the load it ran under.

    .venv/bin/python scripts/bench_frontier_time.py [--workloads chat,batch] [--extra "--time 5m"]
        [--out results/benchmarks/frontier-time-to-answer.md]

The machine is shared with other agents, so each run passes --allow-busy (without it, auto-tune waits for a
quiet machine); its watch marks the trials that other programs disturbed. Last line:
``time to an answer: chat N s, batch M s``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

EXE = Path(sys.executable).parent / "moe-tune"


def run(argv: list[str], start: float) -> tuple[int, str, list[str], list[float]]:
    """The command, its stderr read line by line as it comes (when each line came is the point)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "120"})
    assert proc.stderr is not None and proc.stdout is not None
    lines, stamps = [], []
    for line in proc.stderr:
        stamps.append(time.monotonic() - start)
        lines.append(line.rstrip("\n"))
    out = proc.stdout.read()
    return proc.wait(), out, lines, stamps


@harness.bench("bench_frontier_time", children_claim=True)
def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workloads", default="chat,batch")
    ap.add_argument("--extra", default="", help="more auto-tune options, e.g. \"--time 5m\"")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    say = harness.Log()
    took: dict[str, float] = {}
    for kind in args.workloads.split(","):
        with tempfile.TemporaryDirectory(prefix="frontier-time-") as tmp:
            argv = [str(EXE), "auto-tune", "--frontier", "--workload", kind, "--allow-busy", "--results-dir", tmp,
                    *shlex.split(args.extra)]
            start = time.monotonic()
            (code, out, lines, stamps), noise = harness.watched(
                lambda argv=argv, start=start: run(argv, start))  # type: ignore[misc]
            took[kind] = time.monotonic() - start
            gaps = [b - a for a, b in zip([0.0, *stamps], [*stamps, took[kind]], strict=True)]
            trials = [x for x in lines if x.startswith("trial ")]
            say(f"$ moe-tune auto-tune --frontier --workload {kind} --allow-busy {args.extra}".rstrip())
            say(f"  exit {code} after {took[kind]:.0f} s; {len(lines)} lines on stderr ({len(trials)} trial lines), "
                f"longest silence {max(gaps):.0f} s; 1-min load {os.getloadavg()[0]:.2f} at the end; watch: "
                f"{noise or 'quiet'}")
            for x in lines:
                if x.startswith(("frontier:", "trial ", "measuring ")) or "busy" in x:
                    say(f"  | {x}")
            front = next(Path(tmp).glob("*frontier*/result.json"), None)
            if front:
                data = json.loads(front.read_text())["frontier"]
                say(f"  front: {len(data['points'])} points of {data['trials_measured']} measured trials; contexts "
                    f"{sorted({p['ctx'] for p in data['points']})}; "
                    f"{sum(bool(p.get('interference')) for p in data['points'])} marked busy")
            say("  " + "\n  ".join(out.strip().splitlines()[-8:]))
    say("time to an answer: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))
    if args.out:
        say.write(args.out, "Time to an answer: auto-tune --frontier on the demo model",
                  "Each run is `moe-tune auto-tune --frontier` with its default budget, output to a file (as in a "
                  "log or a pipe), on the project's shared 2-core machine: other agents' builds and tests ran "
                  "beside it (the load line says how much), so each run passes --allow-busy.")


if __name__ == "__main__":
    main()
