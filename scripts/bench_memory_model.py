"""Memory model vs llama.cpp's own breakdown on the demo models (CPU backend), as an error table.

For each config of a grid (ctx, K/V types, slots, unified KV, ubatch, flash attention) on both demo
architectures, compare tuner.plan.memory's host weights / context / compute with the engine's figures:
``--full``: llama-server's at-exit record (actual) for every config; default: llama-server's actual for a
subset, ``llama-fit-params -fitp on`` (projection, header only) for the rest. Figures are MiB rounded
down by llama.cpp, so a 1 MiB difference is rounding.

    .venv/bin/python scripts/bench_memory_model.py [--size tiny|large] [--full]

Real-scale rows: six shape-true models (tuner.models.shape_model: real tensor shapes and quant types, sparse
data) of Qwen3-30B-A3B, Qwen3.5/3.6-35B-A3B, gpt-oss-20b/120b and GLM-4.5-Air, each over a grid of ctx
4k–256k, K/V types, slots, ubatch, flash attention and repack, against ``llama-fit-params -fitp on``
(goal: 2 % or 16 MiB). ``--real-only`` / ``--demo-only`` pick one part.

Ends with ``max component error: X % (Y MiB)``: the component with the largest error that is outside
its tolerance (tuner.plan.placement.engine_tolerance_mib: 2 %, at least 4 MiB, 16 MiB for models of 1 GiB
and more), or the largest relative error overall when every component is inside.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import harness

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import BreakdownParseError
from tuner.engine import breakdown, build
from tuner.machine import hardware
from tuner.models import demo, gguf_reader, shape_model
from tuner.plan import memory
from tuner.plan.placement import engine_agrees

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


REAL_MODELS = ("Qwen3-30B-A3B:Q4_K_M", "Qwen3.5-35B-A3B:Q4_K_M", "Qwen3.6-35B-A3B:Q8_0",
               "gpt-oss-20b:MXFP4_MOE", "gpt-oss-120b:MXFP4_MOE", "GLM-4.5-Air:Q4_K_M")


def real_grid(model: Path) -> list[tuple[str, LaunchConfig]]:
    """The sizes users run: long contexts, quantized KV, slots, big ubatches, repack off."""
    base = LaunchConfig(model=model, parallel=1)
    configs = []
    for ctx, (ctk, ctv), fa in itertools.product(
        (4096, 32768, 131072, 262144),
        ((CacheType.F16, CacheType.F16), (CacheType.Q8_0, CacheType.Q8_0), (CacheType.Q4_0, CacheType.Q4_0)),
        (FlashAttn.ON, FlashAttn.OFF),
    ):
        if ctv.is_quantized and fa is FlashAttn.OFF:
            continue
        configs.append(replace(base, ctx=ctx, cache_type_k=ctk, cache_type_v=ctv, flash_attn=fa))
    for ub in (128, 1024, 2048):
        configs.append(replace(base, ctx=32768, ubatch=ub, batch=max(ub, 2048)))
        configs.append(replace(base, ctx=32768, ubatch=ub, batch=max(ub, 2048), flash_attn=FlashAttn.OFF))
    for np_ in (2, 4):
        configs.append(replace(base, ctx=65536, parallel=np_))
    configs.append(replace(base, ctx=32768, repack=False))
    configs.append(replace(base, ctx=131072, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
                           ubatch=2048, batch=2048, repack=False))
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


def compare(info: gguf_reader.ModelInfo, cfg: LaunchConfig, truth: breakdown.MemoryBreakdown,
            projected: bool) -> list[tuple[str, int, int]]:
    """(component, predicted MiB, llama.cpp MiB) for weights, context and compute on the host side."""
    if projected and cfg.parallel is None:
        cfg = replace(cfg, parallel=1)  # llama-fit-params defaults to one slot; llama-server to 4
    est = memory.estimate(info, cfg, CPU_ONLY, fit_params=projected)
    h = est.host
    weights = est.engine_host_weights_bytes
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


class Table:
    """Rows printed as they come; the worst error kept for the summary line."""

    def __init__(self) -> None:
        self.worst: tuple[float, int, str] = (0.0, 0, "")
        self.worst_out: tuple[float, int, str] | None = None
        self.n_rows = self.n_bad = 0
        self.per_model: dict[str, dict[str, tuple[int, float, int]]] = {}  # model → comp → (rows, pct, MiB)
        print(f"{'model':<28} {'config':<40} {'src':<6} {'component':<9} "
              f"{'pred':>7} {'llama':>7} {'err MiB':>8} {'err %':>7}")

    def add(self, tag: str, name: str, src: str, comp: str, pred: int, real: int, model_bytes: int) -> None:
        err = pred - real
        pct = 100.0 * abs(err) / real if real else (0.0 if err == 0 else 100.0)
        ok = engine_agrees(pred, real, model_bytes)
        self.n_rows += 1
        self.n_bad += not ok
        print(f"{tag:<28} {name:<40} {src:<6} {comp:<9} "
              f"{pred:>7} {real:>7} {err:>+8} {pct:>6.1f}%{'' if ok else '  OUT'}")
        key = (pct, abs(err), f"{tag} {name} {comp}")
        self.worst = max(self.worst, key)
        if not ok and (self.worst_out is None or key > self.worst_out):
            self.worst_out = key
        n, p, m = self.per_model.setdefault(tag, {}).get(comp, (0, 0.0, 0))
        self.per_model[tag][comp] = (n + 1, max(p, pct), max(m, abs(err)))


def demo_rows(table: Table, loc: build.EngineLocation, out: Path, size: str, full: bool) -> None:
    for arch in ("qwen3moe", "qwen35moe"):
        files = demo.make_demo_models(arch=arch, size=size, quants=["Q4_K_M"], out=out / arch, engine=loc)
        for f in files:
            info = gguf_reader.inspect_model(f.path)
            for i, (name, cfg) in enumerate(grid(f.path)):
                cfg = replace(cfg, model=f.path)
                # llama-fit-params rejects --kv-unified: those configs need a server run.
                actual = full or i % 6 == 0 or not cfg.repack or cfg.kv_unified is not None
                if actual:
                    try:
                        truth = breakdown.server_breakdown(loc, cfg, out / "logs")[1]
                    except BreakdownParseError as exc:
                        # A server killed during a slow shutdown loses its buffered exit record.
                        print(f"  skipped {name}: {exc}")
                        continue
                else:
                    truth = breakdown.fit_params_breakdown(loc, cfg)
                for comp, pred, real in compare(info, cfg, truth, projected=not actual):
                    table.add(f"{arch} {f.quant}", name, "actual" if actual else "fit", comp, pred, real,
                              info.tensor_bytes)


def real_rows(table: Table, loc: build.EngineLocation, out: Path) -> None:
    for target in REAL_MODELS:
        t0 = time.perf_counter()
        shape = shape_model.write_catalog_model(target, out / "real" / f"{target.replace(':', '-')}.gguf")
        print(f"# {target}: {shape.logical_bytes / 2**30:.1f} GiB logical, {shape.disk_bytes / 1e6:.1f} MB on disk, "
              f"written in {time.perf_counter() - t0:.2f} s")
        info = gguf_reader.inspect_model(shape.path)
        for name, cfg in real_grid(shape.path):
            truth = breakdown.fit_params_breakdown(loc, cfg)
            for comp, pred, real in compare(info, cfg, truth, projected=True):
                table.add(target, name, "fit", comp, pred, real, info.tensor_bytes)


@harness.bench("bench_memory_model")
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=("tiny", "large"))
    ap.add_argument("--full", action="store_true", help="llama-server actual figures for every demo config")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--real-only", action="store_true", help="only the real-scale shape-true rows")
    part.add_argument("--demo-only", action="store_true", help="only the demo-model rows")
    args = ap.parse_args()
    loc = build.locate_engine()
    out = Path(tempfile.mkdtemp(prefix="moe-tune-bench-mem-"))
    table = Table()
    if not args.real_only:
        demo_rows(table, loc, out, args.size, args.full)
    if not args.demo_only:
        real_rows(table, loc, out)
    print("per model: rows, worst error per component (% / MiB)")
    for tag, comps in table.per_model.items():
        n = sum(v[0] for v in comps.values())
        parts = ", ".join(f"{c} {p:.1f} % / {m} MiB" for c, (_, p, m) in comps.items())
        print(f"  {tag:<26} {n:>4} rows: {parts}")
    print(f"{table.n_rows} components compared, {table.n_bad} outside tolerance "
          "(engine_tolerance_mib: 2 %, at least 4 MiB, 16 MiB at >= 1 GiB)")
    pct, mib, where = table.worst_out or table.worst
    print(f"worst: {where}")
    print(f"max component error: {pct:.1f} % ({mib} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
