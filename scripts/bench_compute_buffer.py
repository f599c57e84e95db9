"""The compute buffer at big ubatches: the memory model against llama.cpp's projection, every architecture.

For the demo models (F16: the compute buffer does not depend on the weights' types), a small zero-weight shape
per architecture the shape writer knows (tuner.models.shape_model.small_spec: the layout of its catalog model at a
few MB) and GLM-4.5-Air's real shape at 64K, with flash attention on and off, ``-ub`` 512 to 8192 (``-b`` equal)
and two contexts: the host compute buffer as ``llama-fit-params -fitp on`` projects it (CPU build, ``-np 1``),
beside the memory model before this change (tuner.plan.memory.fitted_compute_bytes, the closed formula) and now
(tuner.plan.memory.compute_bytes: the reserve graph placed by ggml's allocator). A row agrees when it is within
tuner.plan.placement.engine_tolerance_mib (2 %, at least 4 MiB, 16 MiB for models of 1 GiB and more).

    .venv/bin/python scripts/bench_compute_buffer.py [--ubatches 512,4096] [--write]

``--write`` puts the table in results/benchmarks/compute-buffer-sweep.md.

Why the closed formula was off, read from the allocator: where the engine's buffer is larger, the tensor at the
peak lands above tensors still live, past freed holes too small for it (GLM-4.5-Air at 64K, -ub 4096: the
2,368 MiB of logits start at 768 MiB, below which 128 MiB are live and 640 MiB are holes: 3,136 MiB where the
formula said 2,560); where it is smaller (the demos with flash attention), the engine computes in place and
refills holes that the formula counted as live activations. The reserve graph placed by the same rules gets both.
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
from tuner.engine import breakdown, build
from tuner.machine import hardware
from tuner.models import demo, gguf_reader, shape_model
from tuner.models.model_spec import ARCHS
from tuner.plan import memory
from tuner.plan.placement import engine_agrees

MIB = 2**20
CPU_ONLY = hardware.Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 0.0, 8, "none")
UBATCHES = (512, 1024, 2048, 4096, 8192)
SMALL_CTX = (8192, 32768)
REAL = (("GLM-4.5-Air:Q4_K_M", 65536),)


def models(out: Path) -> list[tuple[str, Path, tuple[int, ...]]]:
    """(label, file, contexts): the demos, one small shape per architecture, the real shapes."""
    found = []
    for arch in ("qwen3moe", "qwen35moe", "gpt-oss"):
        f16 = demo.make_demo_models(arch=arch, out=out / "demo" / arch)[0].path
        found.append((f"demo {arch}", f16, SMALL_CTX))
    for arch in ARCHS:
        spec = shape_model.small_spec(arch)
        path = shape_model.write_shape_model(spec, "Q8_0", out / "small" / f"{arch}.gguf").path
        found.append((f"small {arch}", path, SMALL_CTX))
    for target, ctx in REAL:
        path = shape_model.write_catalog_model(target, out / "real" / f"{target.replace(':', '-')}.gguf").path
        found.append((target, path, (ctx,)))
    return found


def configs(path: Path, contexts: tuple[int, ...], ubatches: list[int]) -> list[tuple[str, LaunchConfig]]:
    """The sweep (ctx × flash attention × ubatch at one slot, f16 cache), then slots and quantized caches at the
    largest context and -ub 4096 (small shapes and demos only)."""
    out = []
    for ctx, fa, ub in itertools.product(contexts, (FlashAttn.ON, FlashAttn.OFF), ubatches):
        out.append(("", LaunchConfig(model=path, ctx=ctx, flash_attn=fa, ubatch=ub, batch=ub, parallel=1)))
    if len(contexts) > 1:
        base = LaunchConfig(model=path, ctx=contexts[-1], ubatch=4096, batch=4096, parallel=1, flash_attn=FlashAttn.ON)
        out += [("np3", replace(base, parallel=3)), ("np4", replace(base, parallel=4)),
                ("q8_0/q8_0", replace(base, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0)),
                ("q4_0/f16", replace(base, cache_type_k=CacheType.Q4_0, flash_attn=FlashAttn.OFF))]
    return out


@harness.bench("bench_compute_buffer")
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ubatches", default=",".join(map(str, UBATCHES)))
    ap.add_argument("--write", action="store_true", help="write results/benchmarks/compute-buffer-sweep.md")
    args = ap.parse_args()
    ubatches = [int(x) for x in args.ubatches.split(",")]
    loc = build.locate_engine()
    log = harness.Log()
    out = Path(tempfile.mkdtemp(prefix="moe-tune-compute-sweep-"))
    rows: list[list[object]] = []
    n = n_before = n_after = 0
    worst: tuple[float, str] = (-1.0, "")
    t0 = time.perf_counter()
    for name, path, contexts in models(out):
        info = gguf_reader.inspect_model(path)
        for extra, cfg in configs(path, contexts, ubatches):
            engine = breakdown.fit_params_breakdown(loc, cfg).host_total("compute")
            before = memory.fitted_compute_bytes(info, memory.resolve(info, cfg, "cpu")) // MIB
            after = memory.estimate(info, cfg, CPU_ONLY, fit_params=True).host.compute_bytes // MIB
            ok_before = engine_agrees(before, engine, info.tensor_bytes)
            ok_after = engine_agrees(after, engine, info.tensor_bytes)
            n, n_before, n_after = n + 1, n_before + ok_before, n_after + ok_after
            err = 100.0 * (after - engine) / engine if engine else 0.0
            where = f"{name} c{cfg.ctx} fa-{cfg.flash_attn.value} ub{cfg.ubatch} {extra}".strip()
            worst = max(worst, (abs(err), where))
            rows.append([name, cfg.ctx or 0, cfg.flash_attn.value, cfg.ubatch or 0, extra or "-", engine, before,
                         "yes" if ok_before else "NO", after, "yes" if ok_after else "NO", f"{err:+.1f}"])
            harness.progress(" ".join(map(str, rows[-1])))
    log(f"engine: {loc.bin_dir} ({loc.source})")
    log(f"{n} rows in {time.perf_counter() - t0:.0f} s; within tolerance before: {n_before}, after: {n_after}")
    log(f"largest error after: {worst[0]:.1f} % ({worst[1]})")
    table = harness.markdown_table(["model", "ctx", "fa", "ub", "slots / KV", "engine MiB", "before MiB", "ok",
                                    "after MiB", "ok", "after err %"], rows)
    print("\n".join(table))
    if args.write:
        parts = __doc__.split("\n\n")
        models_note = ("Models: zero-weight GGUFs (sparse files) and the F16 demos; CPU build of the pinned llama.cpp; "
                       "`llama-fit-params -fitp on`, `-np 1` unless the row says otherwise; `-b` equal to `-ub`. "
                       "Figures are MiB, rounded down as llama.cpp prints them.")
        preface = "\n\n".join([parts[1], parts[4].strip(), models_note, "\n".join(table)])
        log.write(harness.OUT / "compute-buffer-sweep.md", "Compute buffer sweep: memory model vs llama-fit-params",
                  preface=preface)
    return 0


if __name__ == "__main__":
    sys.exit(main())
