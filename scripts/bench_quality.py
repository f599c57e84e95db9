"""Quality figures on the demo models: KLD per quant and per KV type, cache-hit time, the too-short error,
and how many tokens the bundled corpus gives with a real 150k-token vocabulary.

    .venv/bin/python scripts/bench_quality.py [--chunks 8] [--ctx 512] [--arch qwen3moe] [--vocab-gguf PATH]

The vocabulary count needs llama.cpp's models/ggml-vocab-qwen2.gguf (in the llama.cpp source tree); it is
skipped when the file is not found. Results go to a private cache folder, so every figure is measured fresh.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

from tuner.core.config import CacheType
from tuner.engine import build
from tuner.models import demo
from tuner.models.vocab import byte_to_unicode, pretokenize
from tuner.quality import corpus, kld, perplexity

VOCAB_CANDIDATES = (
    Path("/tmp/sd/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"),
)


def count_tokens(vocab_gguf: Path, text: str) -> tuple[int, int]:
    """(n_vocab, tokens of ``text``) with the GGUF's byte-level BPE merges and the Qwen2 pre-tokenizer."""
    import gguf

    reader = gguf.GGUFReader(vocab_gguf)

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(strings("tokenizer.ggml.merges"))}
    to_char = byte_to_unicode()
    cache: dict[str, int] = {}
    total = 0
    for word in pretokenize(text):
        if word not in cache:
            symbols = [to_char[b] for b in word.encode("utf-8")]
            while len(symbols) > 1:
                pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
                best, i = min(pairs)
                if best == 1 << 30:
                    break
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            cache[word] = len(symbols)
        total += cache[word]
    return len(tokens), total


@harness.bench("bench_quality")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--arch", default="qwen3moe")
    parser.add_argument("--vocab-gguf", type=Path, default=None)
    args = parser.parse_args()

    loaded = corpus.load()
    print(f"corpus: {len(loaded.documents)} documents, {loaded.n_bytes:,} bytes, sha256 {loaded.sha256}")
    for kind in corpus.DocumentKind:
        docs = loaded.of_kind(kind)
        print(f"  {kind.value:<9} {len(docs):2d} documents {sum(len(d.text.encode()) for d in docs):9,} bytes")
    vocab = args.vocab_gguf or next((p for p in VOCAB_CANDIDATES if p.is_file()), None)
    if vocab and vocab.is_file():
        t = time.monotonic()
        n_vocab, n_tokens = count_tokens(vocab, loaded.text)
        print(f"  {vocab.name}: {n_vocab:,}-token vocabulary → {n_tokens:,} tokens = {n_tokens // 512} chunks "
              f"of 512 ({loaded.n_bytes / n_tokens:.2f} bytes/token, counted in {time.monotonic() - t:.1f} s)")
    else:
        print("  (no ggml-vocab-qwen2.gguf found: pass --vocab-gguf to count tokens at a 150k vocabulary)")

    loc = build.locate_engine()
    work = Path(tempfile.mkdtemp(prefix="moe-tune-bench-quality-"))
    os.environ["MOE_TUNE_CACHE"] = str(work / "cache")
    os.environ["LLAMA_CPP_DIR"] = str(loc.bin_dir)
    files = {f.quant: f.path for f in demo.make_demo_models(arch=args.arch, quants=["Q8_0", "Q4_K_M"],
                                                             out=work / "models", engine=loc)}
    print(f"\n{args.arch} tiny demo, reference F16, {args.chunks} chunks × {args.ctx} tokens, llama.cpp {loc.bin_dir}")
    print(f"{'model':<8} {'KV k/v':<10} {'PPL':>22} {'mean KLD':>24} {'KLD p99':>10} {'same top %':>16} {'s':>6}")
    runs = [("Q8_0", CacheType.F16, CacheType.F16), ("Q4_K_M", CacheType.F16, CacheType.F16),
            ("F16", CacheType.Q8_0, CacheType.Q8_0), ("F16", CacheType.Q4_0, CacheType.Q4_0),
            ("Q4_K_M", CacheType.Q8_0, CacheType.Q8_0), ("Q4_K_M", CacheType.Q4_0, CacheType.Q4_0),
            ("F16", CacheType.F16, CacheType.F16)]
    for quant, k, v in runs:
        r = perplexity.measure(loc, files[quant], cache_type_k=k, cache_type_v=v, ctx=args.ctx, chunks=args.chunks)
        print(f"{quant:<8} {k.value + '/' + v.value:<10} {r.ppl:>12.4f} ± {r.ppl_error:<7.4f} "
              f"{r.kld_mean or 0:>11.6f} ± {r.kld_mean_error or 0:<10.6f} {r.kld_p99 or 0:>10.6f} "
              f"{r.same_top_pct or 0:>7.3f} ± {r.same_top_pct_error or 0:<5.3f} {r.elapsed_s:>6.1f}")
    ref = next(perplexity.logits_dir().glob("*.logits"))
    print(f"reference logits: {ref.stat().st_size:,} bytes "
          f"(formula {kld.logits_bytes(4096, args.ctx, args.chunks):,}; at a 151,936-token vocabulary "
          f"{kld.logits_bytes(151_936, args.ctx, 1) / 2**20:,.1f} MiB per chunk)")

    t = time.monotonic()
    hit = perplexity.measure(loc, files["Q4_K_M"], ctx=args.ctx, chunks=args.chunks)
    print(f"\nrepeat request, library: {time.monotonic() - t:.3f} s (from cache: {hit.from_cache})")
    exe = Path(sys.executable).parent / "moe-tune"
    cmd = [str(exe), "quality", str(files["Q4_K_M"]), "-c", str(args.ctx), "--chunks", str(args.chunks), "--json"]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(f"repeat request, CLI process start to exit: {time.monotonic() - t:.3f} s (exit {proc.returncode})")

    short = work / "short.txt"
    short.write_text("Far too short.\n")
    proc = subprocess.run([str(exe), "quality", str(files["Q4_K_M"]), "-f", str(short)], capture_output=True,
                          text=True)
    print(f"too-short text: exit {proc.returncode}, {len(proc.stderr.strip().splitlines())} line: "
          f"{proc.stderr.strip()}")


if __name__ == "__main__":
    main()
