"""What the engine-first memory rule costs: seconds per distinct config that llama-fit-params projects (the
real-scale Qwen3-30B-A3B shape, cold and from the projection cache), and how many distinct configs a search asks
for on a card, counted (the space's --n-cpu-moe bounds settle each end from the replay's guess).

    .venv/bin/python scripts/bench_engine_memory.py [--llama-cpp-dir DIR]

The engine's figures decide every verdict where one is found (tuner.measure.engine_memory); each distinct config
(engine build, model file, memory-relevant flags) is projected once and cached on disk. A CUDA build's
llama-fit-params also initializes the driver: its time per call is not measured here (no GPU on this machine).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

from tuner.catalog import cards
from tuner.core.config import CacheType, LaunchConfig
from tuner.engine import build
from tuner.machine import hardware
from tuner.measure import engine_memory
from tuner.models import gguf_reader, shape_model
from tuner.plan.memory import estimate
from tuner.plan.placement import KV_CHOICES, make_plan
from tuner.search import space

TARGET = "Qwen3-30B-A3B:Q4_K_M"
CPU_ONLY = hardware.Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 0.0, 8, "none")
KV = ((CacheType.F16, CacheType.F16), (CacheType.Q8_0, CacheType.Q8_0), (CacheType.Q4_0, CacheType.Q4_0))


class Counting:
    """The replay, counting the distinct configs an engine would be asked to project."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def __call__(self, model, cfg, hw):  # noqa: ANN001, ANN204 - a price, as tuner.plan.pricing.Price
        self.asked.add(repr(engine_memory.projectable(cfg, hw)))
        return estimate(model, cfg, hw)


@harness.bench("bench_engine_memory")
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-dir", type=Path, help="the engine (default: as moe-tune finds it)")
    ap.add_argument("--write", action="store_true", help="write results/benchmarks/engine-memory-cost.md")
    args = ap.parse_args()
    log = harness.Log()
    loc = build.locate_engine(args.llama_cpp_dir)
    work = Path(tempfile.mkdtemp(prefix="moe-tune-engine-memory-"))
    os.environ["MOE_TUNE_CACHE"] = str(work / "cache")  # a cold projection cache of its own
    shape = shape_model.write_catalog_model(TARGET, work / "q30.gguf")
    info = gguf_reader.inspect_model(shape.path)
    mem = engine_memory.EngineMemory.of(loc)
    log(f"engine: {mem.engine.describe()} at {loc.bin_dir}; model: {TARGET} shape ({shape.logical_bytes / 2**30:.1f} "
        "GiB logical, zero weights)")
    configs = [LaunchConfig(model=shape.path, ctx=ctx, cache_type_k=k, cache_type_v=v, ubatch=ub, parallel=1)
               for ctx, (k, v), ub in itertools.product((8192, 32768), KV, (512, 4096))]
    for label in ("cold (llama-fit-params runs)", "cached (read from disk)", "in memory (the same run)"):
        if label.startswith("cached"):
            mem = engine_memory.EngineMemory.of(loc)
        times = []
        for cfg in configs:
            t0 = time.perf_counter()
            mem(info, cfg, CPU_ONLY)
            times.append(time.perf_counter() - t0)
        log(f"{label}: {len(configs)} distinct configs, median {statistics.median(times):.3f} s per config "
            f"(min {min(times):.3f}, max {max(times):.3f}); projections run: {mem.calls}")
    replay = []
    for cfg in configs:
        t0 = time.perf_counter()
        estimate(info, cfg, CPU_ONLY)
        replay.append(time.perf_counter() - t0)
    log(f"the replay alone: median {statistics.median(replay):.3f} s per config (compute-graph replay, memoized)")
    for card_name, ctx in (("RTX 3060 12GB", 32768), ("RTX 4090", 65536)):
        card = cards.find_card(card_name).hardware(64 * 2**30, 64 * 2**30, 60e9)
        counting = Counting()
        t0 = time.perf_counter()
        with engine_memory.deciding(counting):  # type: ignore[arg-type]
            sp = space.build_space(shape.path, info, card, ctx=ctx, parallel=1, prompt_tokens=8192)
        log(f"search space on an {card_name} at -c {ctx} (8K prompts): {len(counting.asked)} distinct configs asked "
            f"for its --n-cpu-moe bounds ({sp.n_cpu_moe}; {len(sp.kv_pairs)} KV pairs x {len(sp.ubatch)} ubatches), "
            f"{time.perf_counter() - t0:.1f} s with the replay standing in for the engine")
        counting = Counting()
        t0 = time.perf_counter()
        make_plan(info, LaunchConfig(model=shape.path, ctx=ctx), card, [ctx], KV_CHOICES, price=counting)
        log(f"plan on an {card_name} at -c {ctx}: {len(counting.asked)} distinct configs asked (the table's "
            f"{info.n_layer + 1} rows, the fit intervals and the largest contexts), {time.perf_counter() - t0:.1f} s "
            "with the replay standing in for the engine")
    counting = Counting()
    make_plan(info, LaunchConfig(model=shape.path, ctx=32768), CPU_ONLY, [32768], KV_CHOICES, price=counting)
    log(f"plan without a GPU at -c 32768: {len(counting.asked)} distinct configs asked (the offload axis places "
        "nothing on the CPU backend)")
    log(f"load: {harness.held().describe()}")
    if args.write:
        log.write(harness.OUT / "engine-memory-cost.md", "What the engine's own memory figures cost a search",
                  preface=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
