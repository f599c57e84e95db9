"""Start-up time of the commands that only read, plan or print: this checkout beside another (by default the
main checkout, /work/main), each command run in turn by both, a fresh interpreter each time, and which heavy
libraries each one loaded.

    .venv/bin/python scripts/bench_startup.py [--other /work/main] [--runs 9] [--write]

Commands: ``--help``, ``engine path``, ``doctor --json``, ``launch-line`` of a real result (a two-trial tune of the
demo model, made first), and ``plan`` of a catalog shape (its engine projections cached by a first run, so the
time is the plan's own). Each checkout runs its own code with its own ``.venv``; wall time, median of the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

from tuner.engine import build

HERE = Path(__file__).resolve().parent.parent
HEAVY = ("numpy", "gguf", "huggingface_hub", "optuna", "matplotlib", "psutil")
PROBE = (
    "import json, sys\n"
    "sys.argv = ['moe-tune', *json.loads(sys.argv[1])]\n"
    "from tuner.cli import main\n"
    "try:\n    main()\nexcept SystemExit:\n    pass\n"
    f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)\n"
)


def timed(checkout: Path, args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(checkout / ".venv" / "bin" / "moe-tune"), *args], capture_output=True, env=env, timeout=600,
                   check=False)
    return time.perf_counter() - t0


def heavy_loaded(checkout: Path, args: list[str], env: dict[str, str]) -> list[str]:
    # From the checkout's own folder: `python -c` puts the working directory first on sys.path.
    run = subprocess.run([str(checkout / ".venv" / "bin" / "python"), "-c", PROBE, json.dumps(args)],
                         capture_output=True, text=True, env=env, timeout=600, check=False, cwd=checkout)
    lines = run.stderr.strip().splitlines()
    return json.loads(lines[-1]) if lines else ["?"]


@harness.bench("bench_startup")
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, default=Path("/work/main"), help="the checkout to compare with")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--write", action="store_true", help="write results/benchmarks/startup.md")
    args = ap.parse_args()
    log = harness.Log()
    work = Path(tempfile.mkdtemp(prefix="moe-tune-startup-"))
    sys.path.insert(0, str(HERE))
    from tests.demo_result import tune_demo  # a real result for launch-line, made with this checkout

    result = tune_demo(build.locate_engine(), work / "demo")
    env = {**os.environ, "COLUMNS": "100", "MOE_TUNE_CACHE": os.environ.get("MOE_TUNE_CACHE", "")}
    env = {k: v for k, v in env.items() if v}
    commands = {
        "--help": ["--help"],
        "engine path": ["engine", "path"],
        "doctor --json": ["doctor", "--json"],
        "launch-line": ["launch-line", str(result)],
        "plan (catalog shape)": ["plan", "qwen3-30b-a3b:Q4_K_M", "-c", "8192", "--json"],
    }
    checkouts = {"this": HERE, "other": args.other.resolve()}
    for checkout in checkouts.values():  # warm: compiled bytecode, page cache, cached engine projections
        for cmd in commands.values():
            timed(checkout, cmd, env)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            for who, checkout in checkouts.items():  # in turn: both see the same load
                times.setdefault((name, who), []).append(timed(checkout, cmd, env))
    log(f"this checkout: {HERE}; other: {checkouts['other']}; {args.runs} runs each, in turn, median wall time")
    rows = []
    for name, cmd in commands.items():
        this, other = (statistics.median(times[(name, w)]) for w in ("this", "other"))
        rows.append([name, f"{other:.2f}", f"{this:.2f}", f"{other / this:.1f}x",
                     ", ".join(heavy_loaded(checkouts["other"], cmd, env)) or "-",
                     ", ".join(heavy_loaded(HERE, cmd, env)) or "-"])
    table = harness.markdown_table(["command", "other s", "this s", "other/this", "other loads", "this loads"], rows)
    for line in table:
        log(line)
    log(f"load: {harness.held().describe()}")
    if args.write:
        log.write(harness.OUT / "startup.md", "Start-up time: commands that read, plan or print",
                  preface=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
