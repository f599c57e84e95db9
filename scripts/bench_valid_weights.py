"""Valid weights drawn directly (`shape-model --weights direct`) against the block-pool writer (`--weights random`,
blocks from the engine's llama-quantize): the write rate, llama-bench generation speed side by side, and the
experts one ubatch chooses per layer as the engine counted them (llama-imatrix over one 512-token chunk of the
bundled corpus, `tuner.quality.imatrix.expert_counts`), with zero weights beside them.

    .venv/bin/python scripts/bench_valid_weights.py [--target olmoe-1b-7b:Q4_K_M] [--rounds 6] \
        [--big qwen3-30b-a3b:Q4_K_M]

The speed rounds run the three files of ``--target`` once per round each, in an order that rotates, so drift
and bursts from other processes hit every arm alike; the parity figure is the per-round ratio direct/random of
llama-bench's tg (median of its samples), summarised as its median, range and a 95 % interval of the geometric
mean. ``--big`` (the GPU check's model; "" to skip) is written with direct weights once, for the write rate at
that scale and its experts per layer. The files are deleted at the end. Figures go to
results/benchmarks/valid-weights-writer.md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import harness
import psutil

from tuner.core.config import LaunchConfig
from tuner.engine import build
from tuner.machine import paths
from tuner.measure import bench
from tuner.models import block_pool, gguf_writer, shape_model
from tuner.quality import imatrix

OUT = harness.OUT / "valid-weights-writer.md"
ARMS = ("zero", "random", "direct")
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}  # Student t, n-1 dof


def write(target: str, weights: str, folder: Path, loc: build.EngineLocation, say: harness.Log) -> Path:
    spec, recipe = shape_model.resolve_target(target)
    path = folder / f"{target.partition(':')[0].lower()}-{recipe}-{weights}.gguf"
    if weights == "random":  # the pools are made once (llama-quantize) and cached: not part of the write
        t0 = time.perf_counter()
        block_pool.block_pools({t.typ for t in gguf_writer.planned_tensors(spec, recipe)}, loc)
        say(f"  block pools for --weights random ready in {time.perf_counter() - t0:.1f} s (cached after the first)")
    made, noise = harness.watched(lambda: shape_model.write_shape_model(spec, recipe, path, weights=weights,
                                                                        engine=loc))
    t = made.times
    assert t is not None
    gib = made.logical_bytes / 2**30
    parts = (f" = {gib / t.total_s:.2f} GiB/s (generate {t.generate_s:.1f} s = {gib / t.generate_s:.2f} GiB/s, "
             f"write calls {t.write_s:.1f} s, fsync {t.sync_s:.1f} s)") if t.generate_s else " (a sparse hole)"
    say(f"  {target} {weights:>6}: {gib:.2f} GiB logical, {made.disk_bytes / 2**30:.2f} GiB on disk, "
        f"{t.total_s:.1f} s{parts}{'' if noise is None else '; busy: ' + noise}")
    return path


def warm(path: Path) -> None:
    buf = bytearray(64 * 2**20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def routing(paths_by_arm: dict[str, Path], loc: build.EngineLocation, say: harness.Log) -> None:
    """Experts with at least one token, and the busiest expert's share, per layer and arm (engine-read)."""
    counts = {}
    for arm, path in paths_by_arm.items():
        counts[arm], noise = harness.watched(lambda path=path: imatrix.expert_counts(loc, path))
        if noise:
            say(f"  imatrix {arm}: busy: {noise}")
    first = next(iter(counts.values()))
    layers = sorted({int(k.split(".")[1]) for k in first if k.endswith("ffn_up_exps.weight")})
    n_expert = len(first[f"blk.{layers[0]}.ffn_up_exps.weight"])
    rows, used = [], {a: [] for a in counts}
    for i in layers:
        row: list[object] = [i]
        for arm, c in counts.items():
            layer = c[f"blk.{i}.ffn_up_exps.weight"]
            used[arm].append(int((layer > 0).sum()))
            row += [used[arm][-1], f"{layer.max() / 512:.2f}"]
        rows.append(row)
    heads = ["layer"] + [h for a in counts for h in (f"{a}: experts used (of {n_expert})", f"{a}: top share")]
    say("\n".join(harness.markdown_table(heads, rows)))
    picks = int(first[f"blk.{layers[0]}.ffn_up_exps.weight"].sum())
    for arm, u in used.items():
        say(f"  {arm}: experts used per layer min {min(u)}, median {statistics.median(u):.0f}, max {max(u)} "
            f"of {n_expert} ({picks} token-expert picks per layer)")


def speed(paths_by_arm: dict[str, Path], loc: build.EngineLocation, rounds: int, n_prompt: int, n_gen: int,
          threads: int, say: harness.Log) -> None:
    tg: dict[str, list[float]] = {a: [] for a in paths_by_arm}
    pp: dict[str, list[float]] = {a: [] for a in paths_by_arm}
    say(f"llama-bench -p {n_prompt} -n {n_gen} -r 3 -t {threads}, mmap, files in the page cache; the order rotates")
    say(f"{'round':>5} {'arm':>6} {'pp tok/s':>9} {'tg tok/s':>9} {'tg cv %':>7}  watch")
    arms = list(paths_by_arm)
    for r in range(rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            res, noise = harness.watched(lambda arm=arm: bench.run_bench(
                loc, LaunchConfig(model=paths_by_arm[arm], threads=threads), n_prompt=n_prompt, n_gen=n_gen,
                repetitions=3, timeout_s=1800))
            g = res.row("tg").spread
            p = res.row("pp").spread.median if n_prompt else math.nan
            tg[arm].append(g.median)
            pp[arm].append(p)
            say(f"{r + 1:>5} {arm:>6} {p:>9.2f} {g.median:>9.2f} {g.cv_pct:>7.1f}  {noise or 'quiet'}")
    ratios = [d / b for d, b in zip(tg["direct"], tg["random"], strict=True)]
    logs = [math.log(x) for x in ratios]
    mean = statistics.fmean(logs)
    half = T95.get(len(logs), 2.0) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    say(f"tg direct/random per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    say(f"tg direct/random: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, "
        f"geometric mean {math.exp(mean):.3f} (95 % interval {lo:.3f}-{hi:.3f}): "
        f"{'within' if lo >= 0.95 and hi <= 1.05 else 'NOT shown within'} 5 %")
    for arm in arms:
        say(f"  median {arm:>6}: " + (f"pp{n_prompt} {statistics.median(pp[arm]):.2f} tok/s, " if n_prompt else "")
            + f"tg{n_gen} {statistics.median(tg[arm]):.2f} tok/s")
    if n_prompt and "zero" in arms:
        say(f"pp{n_prompt} per round, direct/random: "
            f"{statistics.median([d / b for d, b in zip(pp['direct'], pp['random'], strict=True)]):.3f}, "
            f"direct/zero: {statistics.median([d / b for d, b in zip(pp['direct'], pp['zero'], strict=True)]):.3f} "
            "(medians; routing, not bytes, differs: every file holds the same tensors)")


@harness.bench("bench_valid_weights")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="olmoe-1b-7b:Q4_K_M", help="NAME:RECIPE of the speed and routing runs")
    ap.add_argument("--big", default="qwen3-30b-a3b:Q4_K_M", help="NAME:RECIPE written once at scale ('' to skip)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dir", type=Path, default=paths.cache_root() / "bench-valid-weights")
    ap.add_argument("--parity-only", action="store_true",
                    help="only the tg rounds of random vs direct, appended to the page (a re-measurement)")
    args = ap.parse_args()
    say = harness.Log()
    loc = build.locate_engine()
    args.dir.mkdir(parents=True, exist_ok=True)
    say(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; this machine's CPU ({os.cpu_count()} cores, "
        f"{platform.machine()}, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM), no GPU; llama.cpp "
        f"{build.PIN.commit} CPU build; files on {shutil.disk_usage(args.dir).free / 2**30:.0f} GiB free disk")
    spec, recipe = shape_model.resolve_target(args.target)
    say(f"## {spec.name} {recipe} shape ({spec.n_layer} layers, {spec.n_expert} experts, top-{spec.n_expert_used})")
    say("write:")
    files = {arm: write(args.target, arm, args.dir, loc, say) for arm in ARMS[args.parity_only:]}
    for path in files.values():
        warm(path)
    if not args.parity_only:
        say("experts one ubatch (one 512-token chunk of the bundled corpus) chose, per layer: llama-imatrix's "
            "counts")
        routing(files, loc, say)
    speed(files, loc, args.rounds, args.n_prompt, args.n_gen, args.threads, say)
    for path in files.values():
        path.unlink()
    if args.parity_only:
        say(f"load: {harness.held().describe()}")
        page = OUT.read_text() if OUT.is_file() else ""
        OUT.write_text(page + f"\n## Generation parity, re-measured\n\nMade by `{say.command}` on "
                       f"{time.strftime('%Y-%m-%d %H:%M')}.\n\n```text\n" + "\n".join(say.lines) + "\n```\n")
        print(f"appended to {OUT}")
        return
    if args.big:
        big, big_recipe = shape_model.resolve_target(args.big)
        say(f"## {big.name} {big_recipe} shape ({big.n_layer} layers, {big.n_expert} experts, "
            f"top-{big.n_expert_used}): the GPU check's model")
        say("write:")
        big_files = {arm: write(args.big, arm, args.dir, loc, say) for arm in ("zero", "direct")}
        say("experts one ubatch chose, per layer (llama-imatrix):")
        routing(big_files, loc, say)
        for path in big_files.values():
            path.unlink()
    say(f"load: {harness.held().describe()}")
    say.write(OUT, "Valid weights drawn directly vs the block-pool writer",
              "`--weights direct` (tuner/models/direct_blocks.py: blocks assembled in numpy, no llama-quantize) "
              "against `--weights random` (blocks sampled from pools llama-quantize made), with `--weights zero` "
              "(a sparse hole: the router ties) beside them. Expert counts are the engine's: llama-imatrix "
              "(`--check-tensors`, so every row was validated by `ggml_validate_row_data` first) over one "
              "512-token chunk, one ubatch; a layer's 'experts used' is how many experts got at least one token, "
              "'top share' the busiest expert's fraction of the 512 tokens. The block-pool pools' one-off "
              "llama-quantize time is said apart from the write.")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
