"""Memory model vs llama.cpp's own breakdown on the demo models (CPU backend), as an error table.

For each config of a grid (ctx, K/V types, slots, unified KV, ubatch, flash attention) on both demo
architectures, compare tuner.memory's host weights / context / compute with the engine's figures:
``--full``: llama-server's at-exit record (actual) for every config; default: llama-server's actual for a
subset, ``llama-fit-params -fitp on`` (projection, header only) for the rest. Figures are MiB rounded
down by llama.cpp, so a 1 MiB difference is rounding.

    .venv/bin/python scripts/bench_memory_model.py [--size tiny|large] [--full]

Ends with ``max component error: X % (Y MiB)``: the component with the largest error that is outside
"2 % or 4 MiB" (or the largest relative error overall when every component is inside).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from tuner import breakdown, demo, engine, hardware, inspect, memory
from tuner.config import CacheType, FlashAttn, LaunchConfig

MIB = 2**20
CPU_ONLY = hardware.Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 0.0, 8, "none")


def grid(model: Path) -> list[tuple[str, LaunchConfig]]:
    base = LaunchConfig(model=model)
    configs = []
    for ctx, (ctk, ctv), fa, ub in itertools.product(
        (512, 4096, 16384), ((CacheType.F16, CacheType.F16), (CacheType.Q8_0, CacheType.Q8_0),
                             (CacheType.Q4_0, CacheType.F16)),
        (FlashAttn.ON, FlashAttn.OFF), (128, 512),
    ):
        if ctv.is_quantized and fa is FlashAttn.OFF:
            continue
        configs.append(replace(base, ctx=ctx, cache_type_k=ctk, cache_type_v=ctv, flash_attn=fa, ubatch=ub))
    for np_, unified in ((1, None), (2, None), (4, None), (2, True)):
        configs.append(replace(base, ctx=8192, parallel=np_, kv_unified=unified))
    configs.append(replace(base, ctx=4096, ubatch=2048, batch=2048, flash_attn=FlashAttn.OFF))
    configs.append(replace(base, ctx=4096, repack=False))
    return [(label(c), c) for c in configs]


def label(c: LaunchConfig) -> str:
    parts = [f"c{c.ctx}", f"{c.cache_type_k.value}/{c.cache_type_v.value}", f"fa-{c.flash_attn.value}"]
    if c.ubatch:
        parts.append(f"ub{c.ubatch}")
    if c.parallel:
        parts.append(f"np{c.parallel}{'u' if c.kv_unified else ''}")
    if not c.repack:
        parts.append("norepack")
    return " ".join(parts)


def compare(info: inspect.ModelInfo, cfg: LaunchConfig, truth: breakdown.MemoryBreakdown,
            projected: bool) -> list[tuple[str, int, int]]:
    """(component, predicted MiB, llama.cpp MiB) for weights, context and compute on the host side."""
    if projected and cfg.parallel is None:
        cfg = replace(cfg, parallel=1)  # llama-fit-params defaults to one slot; llama-server to 4
    est = memory.estimate(info, cfg, CPU_ONLY)
    h = est.host
    weights = h.weights_bytes
    if projected:
        # The projection sizes the mapped buffer without the repacked tensors (the loaded model maps the
        # whole range), and llama-fit-params' plain table leaves the CPU_REPACK row out.
        weights -= est.repack_bytes if cfg.mmap else 0
        if truth.row("CPU_REPACK") is None:
            weights -= est.repack_bytes
    return [
        ("weights", weights // MIB, truth.host_total("model")),
        ("context", h.context_bytes // MIB, truth.host_total("context")),
        ("compute", h.compute_bytes // MIB, truth.host_total("compute")),
    ]


def within(pred: int, real: int) -> bool:
    # Truncated MiB on both sides: allow the 4 MiB and 2 % of the engine's figure.
    return abs(pred - real) <= max(4, 0.02 * real)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=("tiny", "large"))
    ap.add_argument("--full", action="store_true", help="llama-server actual figures for every config")
    args = ap.parse_args()
    loc = engine.locate_engine()
    out = Path(tempfile.mkdtemp(prefix="moe-tune-bench-mem-"))
    worst: tuple[float, int, str] = (0.0, 0, "")
    worst_out: tuple[float, int, str] | None = None
    n_rows = n_bad = 0
    print(f"{'model':<28} {'config':<40} {'src':<6} {'component':<9} "
          f"{'pred':>7} {'llama':>7} {'err MiB':>8} {'err %':>7}")
    for arch in ("qwen3moe", "qwen35moe"):
        files = demo.make_demo_models(arch=arch, size=args.size, quants=["Q4_K_M"], out=out / arch, engine=loc)
        for f in files:
            info = inspect.inspect_model(f.path)
            for i, (name, cfg) in enumerate(grid(f.path)):
                cfg = replace(cfg, model=f.path)
                # llama-fit-params rejects --kv-unified: those configs need a server run.
                actual = args.full or i % 6 == 0 or not cfg.repack or cfg.kv_unified is not None
                if actual:
                    try:
                        truth = breakdown.server_breakdown(loc, cfg, out / "logs")[1]
                    except breakdown.BreakdownParseError as exc:
                        # A server killed during a slow shutdown loses its buffered exit record.
                        print(f"  skipped {name}: {exc}")
                        continue
                else:
                    truth = breakdown.fit_params_breakdown(loc, cfg)
                for comp, pred, real in compare(info, cfg, truth, projected=not actual):
                    err = pred - real
                    pct = 100.0 * abs(err) / real if real else (0.0 if err == 0 else 100.0)
                    ok = within(pred, real)
                    n_rows += 1
                    n_bad += not ok
                    tag = f"{arch} {f.quant}"
                    print(f"{tag:<28} {name:<40} {'actual' if actual else 'fit':<6} {comp:<9} "
                          f"{pred:>7} {real:>7} {err:>+8} {pct:>6.1f}%{'' if ok else '  OUT'}")
                    key = (pct, abs(err), f"{tag} {name} {comp}")
                    worst = max(worst, key)
                    if not ok and (worst_out is None or key > worst_out):
                        worst_out = key
    print(f"{n_rows} components compared, {n_bad} outside 2 % / 4 MiB")
    pct, mib, where = worst_out or worst
    print(f"worst: {where}")
    print(f"max component error: {pct:.1f} % ({mib} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
