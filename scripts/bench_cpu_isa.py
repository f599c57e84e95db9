"""What building llama.cpp for the CPU it runs on changes: the pinned llama.cpp built portable
(``MOE_TUNE_CPU_ISA=avx2``, AVX2 at most: the managed build before issue 61) and built for this CPU (the default: every
x86 option the kernel grants, tuner.engine.cpu_isa), beside ik_llama.cpp (native, default and ``-rtr``), in
interleaved llama-bench rounds on one model, under the machine lock and the watch (scripts/harness.py). Each build's
time is its stamp's.

    .venv/bin/python scripts/bench_cpu_isa.py ~/.cache/moe-tune/models/shapes/qwen3-30b-a3b-Q4_K_M-direct.gguf \\
        --rounds 3 -p 256 -n 32 --about "the Qwen3-30B-A3B Q4_K_M shape, valid untrained weights"

The portable build is made here when it is missing (about as long as the other: its time is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

from tuner.engine import build, cpu_isa
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP
from tuner.measure import bench

OUT = harness.OUT / "cpu-isa-build.md"


def portable_build(log: harness.Log) -> build.EngineLocation:
    """The AVX2 build of the pin (made once: MOE_TUNE_CPU_ISA=avx2 is its own cache key)."""
    env = dict(os.environ, **{cpu_isa.ISA_ENV: cpu_isa.PORTABLE})
    t0 = time.time()
    subprocess.run([str(Path(sys.executable).parent / "moe-tune"), "engine", "install"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    key = build._build_key(build.Backend.CPU)  # the native key here; the portable one is the other llama.cpp stamp
    found = [p for p in build.managed_builds(LLAMA_CPP) if key not in str(p)]
    if not found:
        raise SystemExit("no portable llama.cpp build was found after `engine install` with MOE_TUNE_CPU_ISA=avx2")
    log(f"portable build ready in {time.time() - t0:,.0f} s (its stamp: {build.build_info(found[0]).get('build_s')} s)")
    return build.EngineLocation(found[0], "managed")


@harness.bench("bench_cpu_isa")
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=256)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--about", default="", help="what the model is (its weights: zero, valid or trained), for the page")
    a = ap.parse_args()
    log = harness.Log()
    native = build.locate_engine(kind=LLAMA_CPP)
    portable = portable_build(log)
    ik = build.locate_engine(kind=IK_LLAMA)
    from tuner.core.config import LaunchConfig

    arms = {
        "llama.cpp avx2": (portable, LaunchConfig(model=a.model, threads=a.threads)),
        "llama.cpp native": (native, LaunchConfig(model=a.model, threads=a.threads)),
        "ik_llama.cpp default": (ik, LaunchConfig(model=a.model, threads=a.threads, engine=IK_LLAMA.name)),
        "ik_llama.cpp -rtr": (ik, LaunchConfig(model=a.model, threads=a.threads, engine=IK_LLAMA.name,
                                               run_time_repack=True, mmap=False)),
    }
    for label, (loc, _) in arms.items():
        info = build.build_info(loc.bin_dir)
        isa = [f for f in info.get("cmake_flags", []) if "NATIVE" in str(f) or "AVX512=" in str(f)]  # type: ignore
        log(f"{label}: {loc.bin_dir.parent.name}, build {info.get('build_s')} s, {' '.join(map(str, isa))}")
    log(f"machine: {', '.join(sorted(f for f in cpu_isa.granted() if f.startswith('avx')))}; "
        f"llama-bench -p {a.n_prompt} -n {a.n_gen} -t {a.threads} -r 1, {a.rounds} interleaved rounds")
    figures: dict[str, dict[str, list[float]]] = {k: {"pp": [], "tg": []} for k in arms}
    for r in range(a.rounds):
        order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
        for label in order:
            loc, cfg = arms[label]
            res, noise = harness.watched(lambda loc=loc, cfg=cfg: bench.run_bench_many(
                loc, [cfg], n_prompt=a.n_prompt, n_gen=a.n_gen, repetitions=1, timeout_s=1800)[0])
            if not isinstance(res, bench.BenchResult):
                log(f"round {r + 1} {label}: failed ({res})")
                continue
            figures[label]["pp"].append(res.prompt_tok_s or 0.0)
            figures[label]["tg"].append(res.gen_tok_s or 0.0)
            log(f"round {r + 1} {label}: pp {res.prompt_tok_s:.2f} tg {res.gen_tok_s:.2f} tok/s"
                + (f" (busy: {noise})" if noise else ""))
    log("")
    log("line | prompt tok/s (median, range) | generation tok/s (median, range)")
    for label, f in figures.items():
        if f["pp"]:
            log(f"{label} | {statistics.median(f['pp']):.2f} ({min(f['pp']):.2f}-{max(f['pp']):.2f}) | "
                f"{statistics.median(f['tg']):.2f} ({min(f['tg']):.2f}-{max(f['tg']):.2f})")
    base = figures["llama.cpp avx2"]
    for label in list(arms)[1:]:
        if figures[label]["pp"] and base["pp"]:
            pp = [x / y for x, y in zip(figures[label]["pp"], base["pp"], strict=False)]
            tg = [x / y for x, y in zip(figures[label]["tg"], base["tg"], strict=False)]
            log(f"{label} / llama.cpp avx2, per round: prompt {', '.join(f'{x:.2f}' for x in pp)}; generation "
                f"{', '.join(f'{x:.2f}' for x in tg)}")
    log(f"load: {harness.held().describe()}")
    log.write(OUT, "llama.cpp built for this CPU vs portable, beside ik_llama.cpp",
              f"Model: {a.model.name}{f' ({a.about})' if a.about else ''}. Device: this machine's CPU alone "
              f"({os.cpu_count()} cores, no GPU offload), prompts and generation from an empty cache (depth 0). Each "
              "round runs every line once, the order rotating.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
