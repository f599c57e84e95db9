"""`moe-tune plan`: VRAM, RAM, verdict and speed ceilings for every --n-cpu-moe, without launching anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from tuner.catalog import cards
from tuner.cli.app import CacheTypeK, CacheTypeV, FlashAttnOpt, JsonFlag, UbatchOpt, app, err, friendly, mib, out
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.machine import hardware
from tuner.models import gguf_reader
from tuner.plan.placement import KV_CHOICES, EngineCheckRow, Plan, make_plan

MODEL_SOURCE = "moe-tune's memory model (tuner.plan.memory)"

HOST_BANDWIDTH_PROBE_S = 0.3


def _ctxs(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"-c takes token counts like 8192 or 8192,32768, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UsageError(f"-c values must be >= 1, got {text!r}")
    return values


def _rate(v: float | None) -> str:
    return "-" if not v else f"{v:,.0f}"


def _as_json(p: Plan) -> dict[str, Any]:
    return {
        "model": str(p.model.paths[0]), "hardware": p.hardware.describe(), "n_configs": p.n_configs,
        "vram_budget_bytes": p.hardware.vram_budget_bytes, "vram_budget_source": p.hardware.vram_budget_source,
        "rows": [{
            "n_cpu_moe": r.n_cpu_moe, "verdict": r.estimate.verdict.value,
            "vram_bytes": r.estimate.gpu.total_bytes, "ram_bytes": r.estimate.host.total_bytes,
            "gpu": _parts(r.estimate.gpu), "host": _parts(r.estimate.host),
            "gen_tok_s_ceiling": r.roofline.gen_tok_s, "prompt_tok_s_ceiling": r.roofline.prompt_tok_s,
        } for r in p.rows],
        "smallest_n_cpu_moe": [{"ctx": s.ctx, "cache_type_k": s.cache_type_k.value,
                                "cache_type_v": s.cache_type_v.value, "n_cpu_moe": s.n_cpu_moe}
                               for s in p.smallest_fits],
        "largest_ctx": [{"cache_type_k": c.cache_type_k.value, "cache_type_v": c.cache_type_v.value,
                         "n_cpu_moe": c.n_cpu_moe, "ctx": c.ctx} for c in p.largest_ctx],
    }


def _engine_check(info: gguf_reader.ModelInfo, base: LaunchConfig, hw: hardware.Hardware) -> tuple[EngineCheckRow, ...]:
    """llama.cpp's own projection (llama-fit-params: header only, nothing allocated) of ``base``."""
    from tuner.engine import build
    from tuner.measure.engine_check import engine_check

    rows, cpu_fallback = engine_check(build.locate_engine(), info, base, hw)
    if cpu_fallback:
        err.print("--engine-check: this llama.cpp build has no GPU backend, so it projects the CPU backend; "
                  "both columns below are for CPU only", highlight=False)
    return rows


def _check_json(rows: tuple[EngineCheckRow, ...]) -> list[dict[str, Any]]:
    return [{"component": r.component, "where": r.where, "model_mib": r.model_mib, "engine_mib": r.engine_mib,
             "error_mib": r.error_mib, "agrees": r.agrees} for r in rows]


def _parts(b: Any) -> dict[str, int]:
    return {"weights": b.weights_bytes, "kv": b.kv_bytes, "recurrent": b.recurrent_bytes,
            "compute": b.compute_bytes, "overhead": b.overhead_bytes}


@app.command("plan")
@friendly
def plan_cmd(
    model: Annotated[str, typer.Argument(
        help="GGUF file, owner/name:QUANT (header only, no download), or a catalog shape like qwen3-30b-a3b:Q4_K_M.")],
    gpu: Annotated[str | None, typer.Option("--gpu", help="Plan for this card, e.g. \"RTX 4060 Ti 16GB\".")] = None,
    ram: Annotated[float | None, typer.Option("--ram", help="Plan for this much host RAM, in GiB.")] = None,
    vram_budget: Annotated[float | None, typer.Option(
        "--vram-budget", help="MiB of VRAM the model may use (default: free VRAM now, or the whole --gpu card).")]
    = None,
    ctx: Annotated[str | None, typer.Option("-c", "--ctx-size", help="Context(s), e.g. 8192 or 8192,32768.")] = None,
    cache_type_k: CacheTypeK = CacheType.F16,
    cache_type_v: CacheTypeV = CacheType.F16,
    parallel: Annotated[int | None, typer.Option("-np", "--parallel", help="Slots (default: 4, unified KV).")] = None,
    flash_attn: FlashAttnOpt = FlashAttn.AUTO,
    ubatch: UbatchOpt = None,
    engine_check: Annotated[bool, typer.Option(
        "--engine-check", help="Also run llama.cpp's own projection (llama-fit-params) and show both.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """VRAM and RAM needed, verdict and speed ceilings for every --n-cpu-moe; works without a GPU.

    Example: moe-tune plan unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M --gpu "RTX 3060 12GB" -c 32768 --engine-check

    Example: moe-tune plan qwen3-30b-a3b:Q4_K_M --gpu "RTX 4090" --vram-budget 20000   # 4 GB held by the desktop
    """
    cache_type_k, cache_type_v = cache_type_k or CacheType.F16, cache_type_v or CacheType.F16
    flash_attn = flash_attn or FlashAttn.AUTO
    if ram is not None and ram <= 0:
        raise UsageError(f"--ram {ram:g} GiB leaves nothing to plan for: give the host RAM in GiB, e.g. --ram 64")
    from tuner.hub.resolve import resolve_model

    resolved = resolve_model(model, header_only=True)
    info = gguf_reader.inspect_model(resolved.path)
    if parallel is not None and parallel < 1:
        raise UsageError(f"-np must be >= 1, got {parallel}")
    if cache_type_v.is_quantized and flash_attn is FlashAttn.OFF:
        raise UsageError(f"V cache type {cache_type_v.value} needs flash attention: use -fa on or -ctv f16")
    hw = hardware.with_vram_budget(
        cards.machine(gpu, HOST_BANDWIDTH_PROBE_S, int(ram * 2**30) if ram is not None else None), vram_budget)
    ctxs = _ctxs(ctx)
    base = LaunchConfig(model=resolved.path, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                        flash_attn=flash_attn, parallel=parallel, ubatch=ubatch, ctx=ctxs[0] if ctxs else None)
    p = make_plan(info, base, hw, ctxs, KV_CHOICES)
    check = _engine_check(info, base, hw) if engine_check else ()
    if as_json:
        doc = _as_json(p)
        doc.update({"model_source": resolved.source, "figures_from": MODEL_SOURCE})
        if engine_check:
            doc["engine_check"] = _check_json(check)
        out.print_json(json.dumps(doc))
        return
    c = ctxs[0] if ctxs else info.ctx_train
    out.print(f"{Path(model).name}: {info.arch}, {info.n_layer} layers, {info.n_expert} experts; {hw.describe()}",
              highlight=False, soft_wrap=True)
    out.print(f"-c {c} -ctk {cache_type_k.value} -ctv {cache_type_v.value} -fa {flash_attn.value}", highlight=False)
    table = Table()
    for col in ("--n-cpu-moe", "VRAM", "RAM", "verdict", "tg ceiling tok/s", "pp bound tok/s"):
        table.add_column(col, justify="right")
    for r in p.rows:
        table.add_row(str(r.n_cpu_moe), mib(r.estimate.gpu.total_bytes), mib(r.estimate.host.total_bytes),
                      r.estimate.verdict.value, _rate(r.roofline.gen_tok_s), _rate(r.roofline.prompt_tok_s))
    out.print(table)
    for s in p.smallest_fits:
        n = "does not fit" if s.n_cpu_moe is None else f"--n-cpu-moe {s.n_cpu_moe}"
        out.print(f"smallest fit at -c {s.ctx} -ctk {s.cache_type_k.value} -ctv {s.cache_type_v.value}: {n}",
                  highlight=False)
    for lc in p.largest_ctx:
        out.print(f"largest ctx at -ctk {lc.cache_type_k.value} -ctv {lc.cache_type_v.value} "
                  f"(--n-cpu-moe {lc.n_cpu_moe}): {lc.ctx}", highlight=False)
    out.print(f"model header: {resolved.source}; figures: {MODEL_SOURCE}", highlight=False, soft_wrap=True)
    if check:
        _print_check(check, base)
    else:
        out.print("add --engine-check to compare them with llama.cpp's own projection (llama-fit-params)",
                  highlight=False)
    if not hw.has_gpu:
        err.print("no GPU: planned for the CPU backend; pass --gpu NAME to plan for a card", highlight=False)


def _print_check(rows: tuple[EngineCheckRow, ...], base: LaunchConfig) -> None:
    table = Table(title=f"llama.cpp projection (llama-fit-params -fitp on, -np {base.parallel or 1}) vs the model")
    for col in ("component", "where", "model MiB", "llama.cpp MiB", "diff MiB", "within 2 % / 16 MiB"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.component, r.where, f"{r.model_mib:,}", f"{r.engine_mib:,}", f"{r.error_mib:+,}",
                      "yes" if r.agrees else "NO")
    out.print(table)
