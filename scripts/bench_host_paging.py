"""Host paging, measured: one config with `moe-tune bench` (llama-bench, then the llama-server workload) on a quiet
machine and again beside a RAM balloon that leaves less available than the model, in one run under the lock.

The model is an OLMoE-1B-7B-shaped Q4_K_M with valid random weights (written once with `moe-tune shape-model
olmoe-1b-7b:Q4_K_M --weights random`, 4.2 GB on disk; tokens spread over its 64 experts, so every expert is read).
The balloon (tuner.machine.ram_ballast.hold_ram) holds anonymous memory until MemAvailable is down to --leave MiB;
it is the OOM killer's first pick, and a row measured after it was killed says so.

    .venv/bin/python scripts/bench_host_paging.py [--model PATH] [--leave 4096] [-p 128] [-n 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import harness

from tuner.core.config import LaunchConfig
from tuner.engine import build, runner
from tuner.machine import paths, ram_ballast
from tuner.measure import one_config, workload
from tuner.models import shape_model

OUT = harness.OUT / "host-paging-balloon.md"


def _model(path: Path | None, loc: build.EngineLocation) -> Path:
    if path is not None:
        return path
    made = paths.cache_root() / "models" / "shape" / "olmoe-1b-7b-Q4_K_M-random.gguf"
    if not made.is_file():
        harness.progress(f"writing {made.name} (random weights, 4.2 GB)")
        made.parent.mkdir(parents=True, exist_ok=True)
        shape_model.write_catalog_model("olmoe-1b-7b:Q4_K_M", made, weights="random", engine=loc)
    return made


def _brief(noise: str | None) -> str:
    """The watch's finding for a table cell: its first two parts and how many more (the full text is above)."""
    if not noise:
        return "quiet"
    parts = noise.split("; ")
    return "; ".join(parts[:2]) + (f"; and {len(parts) - 2} more" if len(parts) > 2 else "")


@harness.bench("bench_host_paging")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--leave", type=int, default=4096, help="MiB the balloon leaves available")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    args = ap.parse_args()
    say = harness.Log()
    loc = build.locate_engine()
    model = _model(args.model, loc)
    cfg = LaunchConfig(model=model, ctx=1024, parallel=1, threads=2)
    load = workload.preset(workload.WorkloadKind.CUSTOM, args.n_prompt, args.n_gen, rounds=2)
    say(f"model {model.name} ({model.stat().st_size / 1e9:.1f} GB), llama.cpp {build.PIN.commit} CPU build, "
        f"{args.n_prompt} prompt + {args.n_gen} generated tokens, 2 rounds; RAM available at start "
        f"{ram_ballast.mem_available_mib():,} MiB")
    rows = []
    for case in ("quiet", "balloon"):
        def measure(case: str = case) -> tuple[one_config.BenchReport, str]:
            if case == "quiet":
                return one_config.bench_config(loc, cfg, load, repetitions=2, on_step=harness.progress), ""
            with ram_ballast.hold_ram(args.leave, runner) as held:
                harness.progress(f"balloon holds {held.held_mib:,} MiB, {held.available_mib:,} MiB left")
                rep = one_config.bench_config(loc, cfg, load, repetitions=2, on_step=harness.progress)
                alive = "" if held.holding() else " (KILLED by the OOM killer during the run: figures void)"
                return rep, f"{held.held_mib:,} MiB held, {held.available_mib:,} left{alive}"
        (rep, note), noise = harness.watched(measure)
        trial = rep.server
        assert trial is not None
        lvl = trial.levels[0]
        tg = rep.bench.row("tg").spread.median
        paging = trial.host_paging
        rows.append([case, f"{tg:,.1f}", f"{lvl.per_request_gen_tok_s:,.1f}", f"{1000 * lvl.ttft_s:,.0f}",
                     f"{(trial.memory.rss_peak_bytes or 0) / 2**30:,.2f}",
                     "-" if paging.faults_per_token is None else f"{paging.faults_per_token:,.1f}",
                     paging.kind.value, trial.spill.kind.value, _brief(noise)])
        say(f"{case}: {note or 'no balloon'}")
        say(f"  host paging: {paging.describe()}")
        say(f"  watch: {noise or 'quiet'}")
    say("")
    say("\n".join(harness.markdown_table(
        ["case", "llama-bench tg tok/s", "server gen tok/s", "TTFT ms", "server RSS GiB", "major faults/token",
         "host paging", "VRAM spill", "watch"], rows)))
    say.write(OUT, "Host paging beside a RAM balloon",
              "One config measured by `moe-tune bench` (library call `one_config.bench_config`) on a quiet "
              "machine and beside a process holding anonymous RAM, in one run under the machine lock "
              "(scripts/harness.py). The host paging verdict is the engine's major faults and storage reads per "
              "generated token over the timed part (tuner.machine.sampler.paging_verdict); the watch judges "
              "interference by cause (the kernel's reclaim for our own faults is ours).")


if __name__ == "__main__":
    main()
