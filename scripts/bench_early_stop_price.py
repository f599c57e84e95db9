"""What a price stopped once its verdict is clear saves, and what it costs in decisions (issue 65, stopping.py):
each line priced twice on the trained SmolLM2 MoE, every chunk (``max_kld`` None) and held to the default floor
(``max_kld`` 0.01, stopping once its verdict is clear), its seconds and its verdict side by side; the reference of an
untrained model cut after the chunk where it clearly predicts no text, against the whole reference and a line's run
that the old price spent on it; and whether one chunk per pass (``-b`` = ``-c``, which the stop needs to read each
chunk as it ends) changes the bytes or the seconds of a whole run.

    .venv/bin/python scripts/bench_early_stop_price.py [--model MOE.gguf] [--chunks 4,8]

The model: ``moe-tune demo-model --trained --quant Q8_0`` (SmolLM2-135M-Instruct split exactly into 8 experts, llama
architecture: ik_llama.cpp's MoE there adds back the normalised input, its KLD ~18). Fresh caches (a temporary
MOE_TUNE_CACHE): every figure is measured, none read back.
"""

from __future__ import annotations

import argparse
import filecmp
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import harness

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.quality.test_engine_price import untrained_model  # noqa: E402
from tuner.core.config import CacheType, FlashAttn, LaunchConfig  # noqa: E402
from tuner.engine import build, flags, runner  # noqa: E402
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP  # noqa: E402
from tuner.machine import paths  # noqa: E402
from tuner.quality import corpus, engine_price, kv_price, stopping  # noqa: E402

OUT = harness.OUT / "early-stop-price.md"
FLOOR = kv_price.DEFAULT_MAX_KLD
TRAINED_MOE = paths.models_dir() / "trained" / "SmolLM2-135M-Instruct-moe8-Q8_0.gguf"


def timed(fn):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    out, noise = harness.watched(fn)
    return out, time.monotonic() - start, noise


def verdict(p: engine_price.LinePrice) -> str:
    return "says nothing" if p.kld_mean is None else "refused" if p.refused_by(FLOOR) else "passes"


@harness.bench("bench_early_stop_price")
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=TRAINED_MOE)
    ap.add_argument("--chunks", default="4,8")
    args = ap.parse_args()
    log = harness.Log()
    ref, ik = build.locate_engine(kind=LLAMA_CPP), build.locate_engine(kind=IK_LLAMA)
    model: Path = args.model
    log(f"engines: {build.capabilities(ref).identity.describe()}; {build.capabilities(ik).identity.describe()}")
    log(f"model: {model.name}; floor --max-kld {FLOOR:g}; ctx {kv_price.PRICE_CTX}; 2 threads of 2 cores")
    lines = [("ik_llama.cpp default", LaunchConfig(model=model, engine=IK_LLAMA.name), ik),
             ("llama.cpp -ctk q8_0 -ctv q8_0 -fa on", LaunchConfig(model=model, cache_type_k=CacheType.Q8_0,
                                                                  cache_type_v=CacheType.Q8_0,
                                                                  flash_attn=FlashAttn.ON), ref),
             ("llama.cpp -ctk q4_0 -ctv q4_0 -fa on", LaunchConfig(model=model, cache_type_k=CacheType.Q4_0,
                                                                  cache_type_v=CacheType.Q4_0,
                                                                  flash_attn=FlashAttn.ON), ref)]
    with tempfile.TemporaryDirectory(prefix="early-stop-") as tmp:
        os.environ["MOE_TUNE_CACHE"] = tmp
        log()
        log("trained MoE: line | chunks | every chunk: s, mean KLD, verdict | early stop: s, chunks read, mean KLD, "
            "verdict, why | saved s | same verdict")
        saved_total = 0.0
        for chunks in (int(c) for c in args.chunks.split(",")):
            said, ref_s, _ = timed(lambda chunks=chunks: engine_price.reference_says(model, ref, chunks=chunks))
            log(f"reference ({chunks} chunks, written whole before the prices: PPL {said.reference_ppl:.2f} over "
                f"{said.chunks_read} chunks) | {ref_s:.1f} s")
            for name, line, loc in lines:
                full, full_s, n1 = timed(lambda line=line, loc=loc, c=chunks: engine_price.price_line(
                    line, loc, ref, chunks=c, use_cache=False))
                early, early_s, n2 = timed(lambda line=line, loc=loc, c=chunks: engine_price.price_line(
                    line, loc, ref, chunks=c, use_cache=False, max_kld=FLOOR))
                saved_total += full_s - early_s
                busy = "; ".join(n for n in (n1, n2) if n)
                log(f"{name} | {chunks} | {full_s:.1f} s, {full.kld_mean:.4g}, {verdict(full)} | {early_s:.1f} s, "
                    f"{early.chunks_used}, {early.kld_mean:.4g}, {verdict(early)}, {early.stopped} | "
                    f"{full_s - early_s:.1f} | {'yes' if verdict(full) == verdict(early) else 'NO'}"
                    + (f" | busy: {busy}" if busy else ""))
        log(f"saved on the trained MoE, all rows: {saved_total:.1f} s")

        log()
        log("untrained (Qwen3-30B-A3B's layout at width 2048, 2 layers, 8,192 tokens, drawn weights): what the price "
            "spent before (the whole reference, then the line's run) and now (the reference cut)")
        shape = untrained_model(Path(tmp))
        q8 = LaunchConfig(model=shape, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
                          flash_attn=FlashAttn.ON)
        for chunks in (int(c) for c in args.chunks.split(",")):
            cut, cut_s, _ = timed(lambda c=chunks: engine_price.reference_says(shape, ref, chunks=c))
            then, then_s, _ = timed(lambda c=chunks: engine_price.price_line(q8, ref, ref, chunks=c))
            before = _old_price_s(shape, q8, ref, chunks)
            log(f"{chunks} chunks | before: {before:.1f} s (reference and line, every chunk) | now: {cut_s:.1f} s "
                f"(reference read {cut.chunks_read} chunk, PPL {cut.reference_ppl:,.0f}), then each price "
                f"{then_s:.3f} s ({verdict(then)}) | saved {before - cut_s:.1f} s")
            os.environ["MOE_TUNE_CACHE"] = tempfile.mkdtemp(dir=tmp)  # the next count starts from nothing kept

        log()
        log("untrained models, 8 chunks: how far one chunk's mean log-likelihood lies from the others' (the spread of "
            "the chunk means against the engine's per-token error of the first chunk; the reference's stop takes "
            "that error x 2.5)")
        for line in _untrained_spread(ref, Path(tmp)):
            log(line)
        log()
        log("one chunk per pass (-b 512) against the default batch (2048: 4 chunks a pass), the whole reference run "
            "(8 chunks), 2 interleaved rounds:")
        for line in _batch_check(ref, model, Path(tmp)):
            log(line)
    log()
    log("what the rule costs in decisions, simulated: chunk means drawn log-normal around a true mean (0.3x to 5x the "
        "floor, 8 values, 3,000 draws each); 'changed': the early verdict differs from the whole run's")
    for line in _simulate():
        log(line)
    log(f"load: {harness.held().describe()}")
    log.write(OUT, "A price stopped once its verdict is clear",
              "Each line priced with every chunk and with the early stop (tuner.quality.stopping), fresh caches; "
              "'saved' is the difference of the two prices' seconds (the reference written once before them).")
    return 0


def _old_price_s(shape: Path, line: LaunchConfig, ref: build.EngineLocation, chunks: int) -> float:
    """What the price spent on this model before the cut: the whole reference, then the line's run over every chunk
    (perplexity.measure, which prices with no verdict read first), in a cache of its own."""
    from tuner.quality import perplexity

    keep = os.environ["MOE_TUNE_CACHE"]
    os.environ["MOE_TUNE_CACHE"] = tempfile.mkdtemp(dir=keep)
    try:
        start = time.monotonic()
        perplexity.measure(ref, shape, reference=shape, chunks=chunks, line=line, use_cache=False)
        return time.monotonic() - start
    finally:
        os.environ["MOE_TUNE_CACHE"] = keep


def _batch_check(ref: build.EngineLocation, model: Path, folder: Path) -> list[str]:
    """The same reference written at -b 2048 and at -b 512, interleaved: whether the files are the same bytes, and
    each run's wall and CPU seconds (the CPU's, from the reaped child: other programs' load moves the wall's)."""
    rows, files = [], {}
    for rnd in (1, 2):
        for batch in (2048, kv_price.PRICE_CTX):
            cfg = replace(LaunchConfig(model=model), batch=batch)
            files[batch] = folder / f"ref-b{batch}.logits"
            argv = flags.perplexity_argv(ref.tool("llama-perplexity"), cfg, text_file=corpus.text_file(),
                                         ctx=kv_price.PRICE_CTX, chunks=8, kld_base=files[batch])
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            _, wall_s, noise = timed(lambda argv=argv: runner.run_process(
                argv, timeout_s=3600, what="llama-perplexity", fix="check the engine"))
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            rows.append(f"round {rnd} -b {batch}: {wall_s:.1f} s wall, {cpu_s:.1f} s CPU"
                        + (f" | busy: {noise}" if noise else ""))
    same = filecmp.cmp(files[2048], files[kv_price.PRICE_CTX], shallow=False)
    return [*rows, f"the logits files are {'the same bytes' if same else 'DIFFERENT'}"]


def _untrained_spread(ref: build.EngineLocation, folder: Path) -> list[str]:
    from tuner.models import demo, shape_model
    from tuner.quality import kld

    small = shape_model.small_spec("qwen3moe")
    models = [("demo qwen3moe Q8_0 (random weights, vocabulary 4,096)", demo.default_model(ref)),
              ("Qwen3-30B-A3B layout, width 512, 4 layers (drawn weights, 8,192)", shape_model.write_shape_model(
                  small, "Q8_0", folder / "w512.gguf", weights="direct").path),
              ("Qwen3-30B-A3B layout, width 2048, 2 layers (the test's untrained model)", untrained_model(folder))]
    out = []
    for name, path in models:
        argv = flags.perplexity_argv(ref.tool("llama-perplexity"), LaunchConfig(model=path, batch=kv_price.PRICE_CTX),
                                     text_file=corpus.text_file(), ctx=kv_price.PRICE_CTX, chunks=8)
        res = runner.run_process(argv + flags.chunk_rows_argv(), timeout_s=3600, what="llama-perplexity",
                                 fix="check the engine")
        rows = [r for line in res.stdout.splitlines() if (r := kld.ppl_row(line)) is not None]
        means = kld.per_chunk_means([r.nll_mean for r in rows])
        spread = statistics.stdev(means)
        out.append(f"{name} | PPL {rows[-1].ppl:,.0f} (first chunk {rows[0].ppl:,.0f}) | chunk means' spread "
                   f"{spread:.4f} nats, the first chunk's per-token error {rows[0].nll_error:.4f}: "
                   f"{spread / rows[0].nll_error:.2f}x")
    return out


def _simulate() -> list[str]:
    """How often the stop changes the whole run's verdict, for chunk means of a given spread (CV: the q8_0 cache on
    the trained MoE read 0.16) around true means from well below to well above the floor."""
    out = []
    for cv in (0.16, 0.5, 1.0):
        sigma = math.sqrt(math.log(1 + cv * cv))
        for chunks in (4, 8):
            rnd = random.Random(int(cv * 100) + chunks)
            changed = used = total = 0
            for ratio in (0.3, 0.5, 0.8, 0.95, 1.05, 1.2, 2.0, 5.0):
                mu = math.log(ratio * FLOOR) - sigma * sigma / 2
                for _ in range(3000):
                    x = [rnd.lognormvariate(mu, sigma) for _ in range(chunks)]
                    whole = statistics.fmean(x) > FLOOR
                    n, early = chunks, whole
                    for k in range(1, chunks):
                        if why := stopping.kld_clear(x[:k], FLOOR, chunks):
                            n, early = k, why.startswith("refused")
                            break
                    used, changed, total = used + n, changed + (early != whole), total + 1
            out.append(f"CV {cv} | {chunks} chunks | read {used / total:.2f} of {chunks} on average | verdict changed "
                       f"{changed / total:.2%}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
