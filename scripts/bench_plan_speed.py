"""How fast the planner prices configs: memory model + roofline over 1,000 configs of a real-scale shape.

Writes a shape-true Qwen3-30B-A3B Q4_K_M (sparse, a few MB on disk), then times estimate() and roofline()
over ctx × KV type × n-cpu-moe for an RTX 3090 with 64 GiB RAM. Last line: `1000 configs planned in X s`.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import harness

from tuner.catalog import cards
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.models import shape_model
from tuner.models.gguf_reader import inspect_model
from tuner.plan import memory, roofline

N_CONFIGS = 1000


@harness.bench("bench_plan_speed")
def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3-30b-a3b-Q4_K_M.gguf"
        shape_model.write_catalog_model("qwen3-30b-a3b:Q4_K_M", path)
        start = time.perf_counter()
        model = inspect_model(path)
        inspect_s = time.perf_counter() - start
    hw = cards.find_card("RTX 3090").hardware(64 << 30, 60 << 30, 50e9)
    kv = (CacheType.F16, CacheType.Q8_0, CacheType.Q5_1, CacheType.Q4_0)
    ctxs = (4096, 8192, 16384, 32768, 65536, 131072)
    grid = itertools.product(ctxs, kv, FlashAttn, range(model.n_layer + 1))
    cfgs = [LaunchConfig(model=path, ctx=c, cache_type_k=k, cache_type_v=k, flash_attn=fa, n_cpu_moe=n)
            for c, k, fa, n in itertools.islice(grid, N_CONFIGS)]
    def plan_all() -> float:
        start = time.perf_counter()
        for cfg in cfgs:
            memory.estimate(model, cfg, hw)
            roofline.roofline(model, cfg, hw)
        return time.perf_counter() - start

    elapsed, noise = harness.watched(plan_all)  # a timing: under the lock and the watch too
    if noise:
        print(f"timed on a busy machine: {noise}")
    print(f"model: {model.name or model.arch}, {len(model.tensors)} tensors, header read in {inspect_s:.3f} s")
    print(f"{len(cfgs)} configs planned in {elapsed:.3f} s")


if __name__ == "__main__":
    main()
