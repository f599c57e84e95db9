"""llama-bench pp/tg on the zero-filled and the valid-weight version of the same real model shape, side by side.

A zero-filled shape file (a sparse hole where the weights would be) loads and runs, but its router ties every
expert, so every token of a batch takes the same experts: prompt processing touches n_expert_used experts per
layer instead of nearly all of them. The valid-weight file (``moe-tune shape-model NAME --weights random``)
routes like a trained model. This runs both, alternating (the order flips every round, so drift and bursts
from other processes hit both alike), and prints the ratio of the per-arm medians.

Both files live in ``--dir`` (default ~/.cache/moe-tune/real) and are written there if missing (the valid
one at its full size: 17.3 GiB for qwen3-30b-a3b:Q4_K_M). Before each run the other file's pages are
dropped; where both files fit in RAM twice over (OLMoE on 24 GiB) this one is also read once first, so the
run times compute, not page faults. Where they do not (Qwen3-30B on 24 GiB), reading it first only makes
llama.cpp's load evict it again (measured: 5 tok/s pp, 0.3 tok/s tg), so it is not read. llama-bench runs
-r 2 and the second sample of each test is the figure (the first pays for the pages it touches first).

    flock /tmp/moe-tune-cpu.lock .venv/bin/python scripts/bench_real_scale.py qwen3-30b-a3b:Q4_K_M \
        -p 64 -n 16 --rounds 3

Last line: ``pp valid/zero: X.XXx, tg valid/zero: Y.YYx``. Output is also written to
results/benchmarks/real_scale_<model>.txt, the command in its first lines.

``--check`` instead loads each named valid-weight model in llama-bench, llama-server (one completion) and
llama-perplexity (bundled corpus) and prints their figures (results/benchmarks/real_scale_checks.txt):

    flock /tmp/moe-tune-cpu.lock .venv/bin/python scripts/bench_real_scale.py --check \
        qwen3-30b-a3b:Q4_K_M gpt-oss-20b:MXFP4_MOE
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import psutil

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags, runner
from tuner.machine import paths
from tuner.measure import bench
from tuner.models import shape_model
from tuner.quality import perplexity

OUT = Path(__file__).resolve().parent.parent / "results" / "benchmarks"


class Tee:
    def __init__(self, path: Path) -> None:
        self.lines: list[str] = []
        self.path = path

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        self.path.write_text("\n".join(self.lines) + "\n")


def ensure(target: str, weights: str, folder: Path, loc: build.EngineLocation, say: Tee) -> Path:
    spec, recipe = shape_model.resolve_target(target)
    path = folder / f"{target.partition(':')[0].lower()}-{recipe}-{'valid' if weights == 'random' else weights}.gguf"
    if not path.is_file():
        made = shape_model.write_shape_model(spec, recipe, path, weights=weights, engine=loc)
        t = made.times
        say(f"wrote {path.name}: {made.disk_bytes / 2**30:.2f} GiB on disk in {t.total_s:.1f} s"
            f" (generate {t.generate_s:.1f} s, write calls {t.write_s:.1f} s, fsync {t.sync_s:.1f} s)" if t else "")
    return path


def warm(path: Path) -> float:
    """Read the whole file once so its pages are in RAM: llama-bench then times compute, not page faults
    (a valid model's tokens reach new experts all the time; a cold file reads them from disk mid-run)."""
    t0 = time.monotonic()
    buf = bytearray(64 * 2**20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.monotonic() - t0


def drop_cache(path: Path) -> None:
    """Give the file's clean pages back, so the other arm's file can stay in RAM."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check(targets: list[str], folder: Path, threads: int, n_prompt: int, n_gen: int) -> None:
    """Each valid-weight model through llama-bench, llama-server and llama-perplexity; finite figures or fail."""
    say = Tee(OUT / "real_scale_checks.txt")
    say("$ flock /tmp/moe-tune-cpu.lock .venv/bin/python scripts/bench_real_scale.py "
        + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    loc = build.locate_engine()
    say(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device: this machine's CPU "
        f"({os.cpu_count()} cores), {threads} threads, no GPU; valid-weight real-scale shape models, depth 0")
    for target in targets:
        path = ensure(target, "random", folder, loc, say)
        say(f"## {target}: {path} ({path.stat().st_size / 2**30:.2f} GiB)")
        t0 = time.monotonic()
        res = bench.run_bench(loc, LaunchConfig(model=path, threads=threads), n_prompt=n_prompt, n_gen=n_gen,
                              repetitions=1, timeout_s=900)
        say(f"llama-bench -p {n_prompt} -n {n_gen} -r 1 -t {threads}: pp {res.prompt_tok_s:.2f} tok/s, "
            f"tg {res.gen_tok_s:.2f} tok/s ({time.monotonic() - t0:.0f} s with load)")
        cfg = LaunchConfig(model=path, ctx=2048, parallel=1, threads=threads)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as logs, runner.serve(flags.server_argv(loc.tool("llama-server"), cfg),
                                                                 log_dir=Path(logs), load_timeout_s=900) as server:
            body = server.complete("The quick brown fox", n_predict=n_gen)
        timings = body["timings"]
        say(f"llama-server -c 2048 -np 1 -t {threads}, one /completion of {n_gen} tokens: "
            f"{timings['predicted_n']} tokens at {timings['predicted_per_second']:.2f} tok/s, prompt "
            f"{timings['prompt_n']} tokens at {timings['prompt_per_second']:.2f} tok/s "
            f"({time.monotonic() - t0:.0f} s with load); text {body['content'][:40]!r}")
        t0 = time.monotonic()
        q = perplexity.measure(loc, path, auto_reference=False, ctx=128, chunks=2, threads=threads,
                               use_cache=False)
        say(f"llama-perplexity -c 128 --chunks 2 (bundled corpus): PPL {q.ppl:.1f} ± {q.ppl_error:.1f} "
            f"(vocabulary {shape_model.resolve_target(target)[0].n_vocab}; {time.monotonic() - t0:.0f} s with load)")
        for name, value in (("pp", res.prompt_tok_s), ("tg", res.gen_tok_s), ("ppl", q.ppl),
                            ("server tg", timings["predicted_per_second"])):
            if not math.isfinite(value) or value <= 0:
                raise SystemExit(f"{target}: {name} is {value}, not a finite positive figure")
    say(f"all {len(targets)} models: finite figures in llama-bench, llama-server and llama-perplexity")


@harness.bench("bench_real_scale")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", nargs="*", default=["qwen3-30b-a3b:Q4_K_M"], help="NAME:RECIPE of shape models")
    ap.add_argument("--check", action="store_true", help="load each valid model in bench, server and perplexity")
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    ap.add_argument("-n", "--n-gen", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (each arm once per round)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dir", type=Path, default=paths.cache_root() / "real")
    args = ap.parse_args()
    if args.check:
        check(args.target, args.dir, args.threads, args.n_prompt, args.n_gen)
        return
    args.target = args.target[0]
    spec, recipe = shape_model.resolve_target(args.target)
    OUT.mkdir(parents=True, exist_ok=True)
    say = Tee(OUT / f"real_scale_{args.target.partition(':')[0].lower()}-{recipe}.txt")
    say("$ flock /tmp/moe-tune-cpu.lock .venv/bin/python scripts/bench_real_scale.py "
        + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    loc = build.locate_engine()
    say(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device: this machine's CPU "
        f"({os.cpu_count()} cores, {platform.machine()}), {args.threads} threads, no GPU; engine {loc.bin_dir}")
    files = {w: ensure(args.target, w, args.dir, loc, say) for w in ("zero", "random")}
    info = {w: f"{p.stat().st_size / 2**30:.2f} GiB logical, {p.stat().st_blocks * 512 / 2**30:.2f} GiB on disk"
            for w, p in files.items()}
    say(f"# model: {spec.name} {recipe} shape ({spec.n_layer} layers, {spec.n_expert} experts, "
        f"top-{spec.n_expert_used}); zero: {info['zero']}; valid: {info['random']}")
    say(f"# llama-bench -p {args.n_prompt} -n {args.n_gen} -r 2 -t {args.threads} per arm per round, depth 0, "
        "default batch/ubatch, mmap; figure = 2nd sample; the order flips every round")
    ram = psutil.virtual_memory().total
    fits = 4 * files["random"].stat().st_size < ram
    say(f"# RAM {ram / 2**30:.1f} GiB: {'read once before each run' if fits else 'not read first (too big)'}")
    say(f"{'round':>5} {'arm':>6} {'pp tok/s':>9} {'tg tok/s':>9} {'1st pp':>7} {'1st tg':>7} {'warm s':>7} "
        f"{'wall s':>7}")
    pp: dict[str, list[float]] = {"zero": [], "random": []}
    tg: dict[str, list[float]] = {"zero": [], "random": []}
    for r in range(args.rounds):
        for w in (("zero", "random") if r % 2 == 0 else ("random", "zero")):
            other = files["random" if w == "zero" else "zero"]
            drop_cache(other)
            t0 = time.monotonic()
            warm_s = warm(files[w]) if fits else 0.0
            res = bench.run_bench(loc, LaunchConfig(model=files[w], threads=args.threads), n_prompt=args.n_prompt,
                                  n_gen=args.n_gen, repetitions=2, timeout_s=900)
            p_s, g_s = res.row("pp").samples_tok_s, res.row("tg").samples_tok_s
            pp[w].append(p_s[-1])
            tg[w].append(g_s[-1])
            name = "valid" if w == "random" else w
            say(f"{r + 1:>5} {name:>6} {p_s[-1]:>9.2f} {g_s[-1]:>9.2f} {p_s[0]:>7.2f} {g_s[0]:>7.2f} {warm_s:>7.1f} "
                f"{time.monotonic() - t0:>7.1f}")
    med = {k: {w: statistics.median(v[w]) for w in v} for k, v in (("pp", pp), ("tg", tg))}
    for w in ("zero", "random"):
        say(f"median {('valid' if w == 'random' else w):>6}: pp{args.n_prompt} {med['pp'][w]:.2f} tok/s, "
            f"tg{args.n_gen} {med['tg'][w]:.2f} tok/s")
    say(f"pp valid/zero: {med['pp']['random'] / med['pp']['zero']:.2f}x, "
        f"tg valid/zero: {med['tg']['random'] / med['tg']['zero']:.2f}x")


if __name__ == "__main__":
    main()
