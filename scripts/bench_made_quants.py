"""Made quants vs their KLD and speed: compare-quants --make on a real-shape, valid-weight model.

    .venv/bin/python scripts/bench_made_quants.py [--model olmoe-1b-7b:Q8_0] [--make Q4_0,Q5_0,Q4_0/Q8_0]
        [--trials 1] [--chunks 4] [--ctx 512] [--disk-budget 10] [--min-tok-s 5] [--max-kld 0.5]

Writes the source with `moe-tune shape-model MODEL --weights random` into ~/.cache/moe-tune/real/ (never the
repo) once, then runs `moe-tune compare-quants --from SOURCE --make ...` and prints its table, its answer and
the commands, with the command line that produced them and how long it took. The random weights make every
quant's KLD a measure of quantization noise on this shape, not of a trained model's quality. The default
types are quick to make from Q8_0 on a small CPU (a k-quant of this 7 GB source took ~20 min per type on the
project's shared 2-core machine); pass --make for others (IQ types want --imatrix).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import harness

EXE = Path(sys.executable).parent / "moe-tune"
REAL = Path(os.environ.get("MOE_TUNE_CACHE", Path.home() / ".cache" / "moe-tune")) / "real"


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    print("$", shlex.join(argv), flush=True)
    return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "240"})


@harness.bench("bench_made_quants", children_claim=True)
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="olmoe-1b-7b:Q8_0")
    ap.add_argument("--make", default="Q4_0,Q5_0,Q4_0/Q8_0")
    ap.add_argument("--trials", default="1")
    ap.add_argument("--chunks", default="4")
    ap.add_argument("--ctx", default="512")
    ap.add_argument("--disk-budget", default="10")
    ap.add_argument("--min-tok-s", default="5")
    ap.add_argument("--max-kld", default="0.5")
    args = ap.parse_args()
    source = REAL / f"{args.model.replace(':', '-')}-random.gguf"
    if not source.is_file():
        REAL.mkdir(parents=True, exist_ok=True)
        made = run([str(EXE), "shape-model", args.model, "--weights", "random", "--out", str(source)])
        if made.returncode != 0:
            sys.exit(made.stderr[-2000:])
    out = REAL / f"compare-{source.stem}"
    argv = [str(EXE), "compare-quants", "--from", str(source), "--make", args.make, "--trials", args.trials,
            "--chunks", args.chunks, "-c", args.ctx, "-p", "128", "-n", "32", "--min-ctx", "2048",
            "--disk-budget", args.disk_budget, "--min-tok-s", args.min_tok_s, "--max-kld", args.max_kld,
            "--out", str(out), "--json"]
    start = time.monotonic()
    # compare-quants holds the machine's lock itself; the harness watches it and records the load.
    proc, noise = harness.watched(lambda: run(argv))
    elapsed = time.monotonic() - start
    if noise:
        print(f"measured on a busy machine: {noise}")
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    data = json.loads(proc.stdout)
    print(f"model: {args.model} shape, random (valid) weights, source {source.name} "
          f"({source.stat().st_size / 2**30:.2f} GiB); CPU only ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores); KLD over {args.chunks} chunks of {args.ctx} tokens of the bundled corpus; "
          f"{elapsed / 60:.1f} min")
    print(f"{'quant':<14} {'origin':<10} {'size GiB':>8} {'gen tok/s @ depth':>22} {'mean KLD ± 90%':>20} "
          f"{'same top %':>10}  verdict")
    for r in data["rows"]:
        gen = f"{r['gen_tok_s']:.2f} ± {r['gen_tok_s_error'] or 0:.2f} @ {r['depth_tokens']}" \
            if r["gen_tok_s"] else r["error"] or ""
        kld = f"{r['kld_mean']:.4f} ± {r['kld_mean_error'] or 0:.4f}" if r["kld_mean"] is not None else ""
        top = f"{r['same_top_pct']:.1f}" if r["same_top_pct"] is not None else ""
        print(f"{r['quant']:<14} {r['origin']:<10} {r['size_bytes'] / 2**30:>8.2f} {gen:>22} {kld:>20} {top:>10}  "
              f"{r['verdict']}{'' if r['kept'] else ' (file dropped)'}")
    print(f"answer: {data['pick']}; {data['binding']}" if data["pick"] else f"answer: {data['binding']}")
    print(f"disk kept by the comparison: {data['disk_used_bytes'] / 2**30:.2f} GiB of {args.disk_budget} GiB")
    for r in data["rows"]:
        if r["command"]:
            print(f"made: {r['command']}")


if __name__ == "__main__":
    main()
