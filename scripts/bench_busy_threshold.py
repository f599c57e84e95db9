"""When is another process's CPU a reason to call a measurement busy? A real second process at several loads beside
llama-bench: what it did to the figure, and what the watch said (issue 51).

A duty-cycled burner (busy for LOAD x 20 ms of every 20 ms; several for more than one core) runs beside a llama-bench
generation run of the demo model, at each load in turn and at two thread counts, the loads interleaved in rounds
(the order rotating) so that the other developers' work on this shared machine falls on every load alike; each
round also measures with no burner. Per measurement: the generation speed, its ratio to the same round's quiet
measurement, and the watch's look (tuner.machine.quiet.Watch, judged for the run's threads): others' cores, our
threads' wait for a CPU per second they ran, the verdict of the rule by our threads' wait
(tuner.machine.books.Books.cpu_busy) and of the absolute one it replaced (others' cores >= 0.5 plus half of each
physical core the run leaves idle).

The watch is scoped to this script's processes (MOE_TUNE_MACHINE_SCOPE, set after the machine's lock is held), so
it judges the burner alone; what else ran on the machine is in the load line.

    .venv/bin/python scripts/bench_busy_threshold.py [--loads 0.1,0.25,0.5,1,2] [--threads 2,1] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import harness

from tuner.core.config import LaunchConfig
from tuner.engine import build, runner
from tuner.machine import processes, quiet
from tuner.machine.books import WAIT_PER_RUN_LIMIT
from tuner.measure import bench
from tuner.models import demo

OUT = harness.OUT / "busy-threshold.md"
LOOK_S = 0.25
# Busy for ``duty`` of every 20 ms period; prints "ready" after its first period.
BURNER = ("import sys, time\nduty, period = float(sys.argv[1]), 0.02\nfirst = True\nwhile True:\n"
          "    start = time.monotonic()\n    while time.monotonic() - start < duty * period:\n        pass\n"
          "    time.sleep(max(0.0, period - (time.monotonic() - start)))\n"
          "    if first:\n        print('ready', flush=True)\n        first = False\n")


@contextmanager
def burning(load: float) -> Iterator[None]:
    """``load`` cores of busy work in other processes (whole cores, then one duty-cycled for the rest), stopped by
    pid however the block ends."""
    duties = [1.0] * int(load) + ([load - int(load)] if load - int(load) > 1e-9 else [])
    procs = [subprocess.Popen([sys.executable, "-c", BURNER, str(d)], stdout=subprocess.PIPE, text=True)
             for d in duties]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def measure(loc: build.EngineLocation, cfg: LaunchConfig, n_gen: int, reps: int, load: float
            ) -> tuple[float, processes.Interference]:
    # Ours: llama-bench (the runner's child); the burners are this script's children too, but someone else's to the
    # watch, as a browser beside the tuner would be.
    # Looks of LOOK_S: a run of a second or two on a quiet machine still spans several (a process's wait is read
    # while it lives: one that ends within a look is not counted in it).
    with burning(load), quiet.Watch(own=runner.own_pids, interval_s=LOOK_S, threads=cfg.threads) as watch:
        res = bench.run_bench(loc, cfg, n_prompt=0, n_gen=n_gen, repetitions=reps)
    harness.held().saw(watch.seen)
    return res.gen_tok_s, watch.seen


def _median(xs: Sequence[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


@harness.bench("bench_busy_threshold")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0.1,0.25,0.5,1,2", help="cores of the second process, besides 0")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n-gen", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped run stops its burners too (finally blocks)
    log = harness.Log()
    os.environ[processes.SCOPE_ENV] = str(os.getpid())  # the lock is held: from now on the watch judges our burner
    loc = build.locate_engine()
    model = demo.default_model(loc)
    loads = [0.0, *(float(x) for x in args.loads.split(","))]
    threads = [int(t) for t in args.threads.split(",")]
    log(f"model {model.name}, llama-bench tg{args.n_gen} x {args.reps} repetitions, {os.cpu_count()} logical CPUs, "
        f"{args.rounds} rounds; busy by our threads' wait from {WAIT_PER_RUN_LIMIT:.2f} s per s they ran")
    rows: dict[tuple[int, float], list[tuple[float, processes.Interference, float | None]]] = {}
    for r in range(args.rounds):
        for t in threads:
            cfg = LaunchConfig(model=model, threads=t)
            order = loads[r % len(loads):] + loads[:r % len(loads)]
            got = {load: measure(loc, cfg, args.n_gen, args.reps, load) for load in order}
            quiet_tok_s = got[0.0][0]
            for load, (tok_s, seen) in got.items():
                rows.setdefault((t, load), []).append((tok_s, seen, tok_s / quiet_tok_s if quiet_tok_s else None))
                log(f"round {r + 1} -t {t} load {load:g}: {tok_s:,.1f} tok/s, others {seen.cpu_cores:.2f} cores, "
                    f"wait/run {seen.wait_per_run}, busy {seen.busy}")
    log("")
    log("| -t | second process (cores) | gen tok/s | vs quiet (same round): median, range | others seen (cores) | "
        "our threads waited (s per s run) | busy, by wait | busy, old absolute rule |")
    log("|---:|---:|---:|---:|---:|---:|---|---|")
    for (t, load), got in sorted(rows.items()):
        tok_s = _median([g[0] for g in got])
        ratio = _median([g[2] for g in got])
        cores = _median([g[1].cpu_cores for g in got])
        wait = _median([g[1].wait_per_run for g in got])
        by_wait = sum(g[1].cpu_disturbed for g in got)
        old = sum(g[1].cpu_cores >= g[1].cpu_limit_cores for g in got)
        ratios = [g[2] for g in got if g[2] is not None]
        log(f"| {t} | {load:g} | {tok_s:,.1f} | {ratio:.3f}, {min(ratios):.2f}-{max(ratios):.2f} | {cores:.2f} | "
            f"{'-' if wait is None else f'{wait:.3f}'} | {by_wait} of {len(got)} | {old} of {len(got)} |")
    log("")
    log(f"load: {harness.held().describe()}")
    log.write(OUT, "The busy threshold: a real second process beside llama-bench", preface=__doc__.split("\n\n")[1])


if __name__ == "__main__":
    main()
