"""Which engine on this machine, as a user asks it: `moe-tune auto-tune MODEL --json` with both engines installed and
no `--engines`, run as a subprocess (the command users run: it holds the machine lock and watches its own rounds), its
JSON kept with the command, the wall time, the machine's load before and after, and its progress log.

    .venv/bin/python scripts/bench_which_engine.py ~/.cache/moe-tune/models/shapes/qwen3-30b-a3b-Q4_K_M-direct.gguf \\
        --out results/benchmarks/which-engine-cpu/qwen3-30b-a3b-chat.json -- --workload chat -p 512 -n 64 --trials 4
    .venv/bin/python scripts/bench_which_engine.py MODEL.gguf --out results/benchmarks/which-engine-cpu/agent.json \\
        -- --workload agent --depth 1024 -n 32 --trials 4

Everything after ``--`` goes to auto-tune as it is. The summary printed at the end (and kept in the JSON) is the
run's own: the printed line, its engine, its verdict against llama.cpp's default, every line's ratio to it, the time
each stage took.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import harness

from tuner.engine import build, cpu_isa
from tuner.engine.kinds import KINDS
from tuner.machine import processes
from tuner.search.verdict import Verdict

ROOT = Path(__file__).resolve().parent.parent


def engines_here() -> dict[str, Any]:
    """Each installed engine: what it is and how it was built (the stamp's flags: the ISA it was compiled for)."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        try:
            loc = build.locate_engine(kind=kind)
        except Exception as exc:  # noqa: BLE001 - an engine not installed is a fact to record, not a failure
            out[kind.name] = {"error": str(exc)}
            continue
        info = build.build_info(loc.bin_dir)
        out[kind.name] = {"describe": build.capabilities(loc).identity.describe(), "bin_dir": str(loc.bin_dir),
                          "cmake_flags": info.get("cmake_flags"), "build_s": info.get("build_s")}
    return out


def summary(run: dict[str, Any]) -> list[str]:
    """The run's answer in a few lines, from its JSON alone."""
    eng = run.get("engines") or {}
    lines = [f"printed: {eng.get('printed')} ({eng.get('printed_engine')})", f"why: {eng.get('reason')}"]
    for v in eng.get("verdicts_against_default") or []:
        busy = f", {v['busy_rounds']} busy left out" if v.get("busy_rounds") else ""
        lines.append(f"{v['a']} vs {v['b']}: {v['ratio']:.2f}x ({Verdict.from_dict(v).interval_words()}), "
                     f"{v['outcome']}{busy}")
    for note in eng.get("refused") or []:
        lines.append(f"left out: {note}")
    lines.append(f"time: {run.get('elapsed_s')} s " + json.dumps(run.get("stages_s")))
    return lines


def stamped(argv: list[str], env: dict[str, str], log: Any, t0: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv``: its stdout kept, each stderr line written to ``log`` behind the seconds since ``t0`` when it came
    ("[  123.4] trial 2/4: ..."), so the longest silence can be read back from the log (:func:`longest_gap`)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read() if proc.stdout else ""), daemon=True)
    reader.start()
    assert proc.stderr is not None
    for line in proc.stderr:
        log.write(f"[{time.time() - t0:7.1f}] {line}")
        log.flush()
    code = proc.wait()
    reader.join()
    return subprocess.CompletedProcess(argv, code, "".join(out), "")


def longest_gap(log: Path, wall_s: float) -> tuple[float, float]:
    """The longest time between two stamped lines of ``log`` (the start and the end count as lines), and where it
    began (seconds from the start)."""
    stamps = [0.0]
    for line in log.read_text().splitlines():
        if line.startswith("[") and "]" in line:
            try:
                stamps.append(float(line[1:line.index("]")]))
            except ValueError:
                continue
    stamps.append(wall_s)
    gaps = [(b - a, a) for a, b in zip(stamps, stamps[1:], strict=False)]
    return max(gaps) if gaps else (wall_s, 0.0)


@harness.bench("bench_which_engine", children_claim=True)  # auto-tune takes the machine lock itself
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write (its .log beside it)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]  # after --: auto-tune's own options
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results = a.out.with_suffix("")  # the run's own results folder, beside the JSON
    argv = [str(ROOT / ".venv" / "bin" / "moe-tune"), "auto-tune", str(a.model), "--json", "--results-dir",
            str(results), *extra]
    shown = shlex.join(["moe-tune", *argv[1:]])
    print(f"running: {shown}", flush=True)
    load_start = os.getloadavg()
    t0 = time.time()
    with a.out.with_suffix(".log").open("w") as log:
        # MOE_TUNE_OWNER: this script waits on the command, so its own watch's polling is the run's, not a rival's
        # (tuner.machine.owner.waiting_owner).
        env = {**os.environ, processes.OWNER_ENV: processes.owner_marker()}
        done, noise = harness.watched(lambda: stamped(argv, env, log, t0))
    wall = time.time() - t0
    load_end = os.getloadavg()
    try:
        run = json.loads(done.stdout)
    except json.JSONDecodeError:
        run = {"stdout": done.stdout[-4000:]}
    gap, gap_at = longest_gap(a.out.with_suffix(".log"), wall)
    record = {"command": shown, "returncode": done.returncode, "wall_s": round(wall, 1),
              "longest_silence_s": round(gap, 1), "longest_silence_at_s": round(gap_at, 1),
              "load": {"start_1min": load_start[0], "end_1min": load_end[0], "cores": os.cpu_count(),
                       "watch": noise or "quiet"},
              "machine": {"cpu_flags_granted": sorted(cpu_isa.granted())},
              "engines_built": engines_here(), "run": run, "summary": summary(run) if "engines" in run else None,
              "measured_at": time.strftime("%Y-%m-%d %H:%M")}
    a.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"exit {done.returncode} after {wall:,.0f} s; load {load_start[0]:.2f} -> {load_end[0]:.2f}; longest "
          f"silence on stderr {gap:,.1f} s (from {gap_at:,.0f} s)")
    for line in record["summary"] or [done.stdout[-2000:]]:
        print(line)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
