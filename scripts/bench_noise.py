"""How noisy is a llama-bench figure on this machine? CV per test for the demo model, under noise control.

Each config is measured with moe-tune's noise control (repeat until the relative standard error is <= 3 % or
the repetition cap), at two depths. Prints one line per figure and ends with `median CV: X %`.

    .venv/bin/python scripts/bench_noise.py [--n-prompt 256] [--n-gen 64] [--depth 0,1024] [-t 2]
"""

from __future__ import annotations

import argparse
import statistics

import harness

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.engine import build
from tuner.measure import bench
from tuner.models import demo


@harness.bench("bench_noise")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-prompt", type=int, default=256)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--depth", default="0,1024")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    loc = build.locate_engine()
    caps = build.capabilities(loc)
    model = demo.default_model(loc)
    depths = [int(d) for d in args.depth.split(",")]
    cfgs = [LaunchConfig(model=model, threads=args.threads, flash_attn=fa, cache_type_k=k, cache_type_v=k)
            for fa in (FlashAttn.ON, FlashAttn.OFF) for k in (CacheType.F16, CacheType.Q8_0)
            if not (fa is FlashAttn.OFF and k.is_quantized)]
    print(f"model {model.name}, llama.cpp {caps.commit}, target RSE {bench.RSE_TARGET_PCT} %, "
          f"cap {bench.MAX_REPETITIONS} repetitions")
    cvs: list[float] = []
    for cfg in cfgs:
        res, noise = harness.watched(lambda cfg=cfg: bench.run_bench(  # type: ignore[misc]
            loc, cfg, n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=None, depth=depths, caps=caps))
        for row in res.rows:
            s = row.spread
            test = f"pp{row.n_prompt}" if row.kind == "pp" else f"tg{row.n_gen}"
            print(f"fa {cfg.flash_attn.value:<3} kv {cfg.cache_type_k.value:<4} {test:>6} @ d{row.n_depth:<5} "
                  f"median {s.median:9.1f} tok/s  CV {s.cv_pct:5.1f} %  RSE {s.rse_pct:4.1f} %  n {s.n:2d}  "
                  f"({res.runs} runs, {res.elapsed_s:.1f} s){'  busy: ' + noise if noise else ''}")
            cvs.append(s.cv_pct)
    print(f"median CV: {statistics.median(cvs):.1f} %")


if __name__ == "__main__":
    main()
