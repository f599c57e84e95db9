"""`moe-tune plan`: VRAM, RAM, verdict and speed ceilings for every --n-cpu-moe, without launching anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from tuner import cards, hardware, inspect
from tuner.cli.app import JsonFlag, app, err, friendly, mib, out
from tuner.config import CacheType, FlashAttn, LaunchConfig
from tuner.errors import UsageError
from tuner.plan import KV_CHOICES, Plan, make_plan

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


def _hardware(gpu: str | None, ram_gib: float | None) -> hardware.Hardware:
    host = hardware.probe_host()
    ram = int(ram_gib * 2**30) if ram_gib is not None else host.ram_total_bytes
    avail = ram if ram_gib is not None else host.ram_available_bytes
    bw = hardware.measure_host_bandwidth(HOST_BANDWIDTH_PROBE_S)
    if gpu:
        return cards.find_card(gpu).hardware(ram, avail, bw, host.physical_cores, host.swap_total_bytes)
    hw = hardware.probe_hardware(host_bandwidth_s=0)
    return hardware.Hardware(
        hw.gpu_name, hw.vram_total_bytes, hw.vram_free_bytes, hw.gpu_bandwidth_bytes_s, hw.pcie_bandwidth_bytes_s,
        ram, avail, hw.swap_total_bytes, bw, hw.physical_cores, hw.source,
    )


def _rate(v: float | None) -> str:
    return "-" if not v else f"{v:,.0f}"


def _as_json(p: Plan) -> dict[str, Any]:
    return {
        "model": str(p.model.paths[0]), "hardware": p.hardware.describe(), "n_configs": p.n_configs,
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


def _parts(b: Any) -> dict[str, int]:
    return {"weights": b.weights_bytes, "kv": b.kv_bytes, "recurrent": b.recurrent_bytes,
            "compute": b.compute_bytes, "overhead": b.overhead_bytes}


@app.command("plan")
@friendly
def plan_cmd(
    model: Annotated[Path, typer.Argument(help="GGUF file (first part of a split model).")],
    gpu: Annotated[str | None, typer.Option("--gpu", help="Plan for this card, e.g. \"RTX 4060 Ti 16GB\".")] = None,
    ram: Annotated[float | None, typer.Option("--ram", help="Plan for this much host RAM, in GiB.")] = None,
    ctx: Annotated[str | None, typer.Option("-c", "--ctx-size", help="Context(s), e.g. 8192 or 8192,32768.")] = None,
    cache_type_k: Annotated[CacheType, typer.Option("-ctk", "--cache-type-k")] = CacheType.F16,
    cache_type_v: Annotated[CacheType, typer.Option("-ctv", "--cache-type-v")] = CacheType.F16,
    parallel: Annotated[int | None, typer.Option("-np", "--parallel", help="Slots (default: 4, unified KV).")] = None,
    flash_attn: Annotated[FlashAttn, typer.Option("-fa", "--flash-attn")] = FlashAttn.AUTO,
    ubatch: Annotated[int | None, typer.Option("-ub", "--ubatch-size")] = None,
    as_json: JsonFlag = False,
) -> None:
    """VRAM and RAM needed, verdict and speed ceilings for every --n-cpu-moe; works without a GPU.

    Example: moe-tune plan model.gguf --gpu "RTX 4060 Ti 16GB" --ram 64 -c 32768 -ctk q8_0 -ctv q8_0
    """
    info = inspect.inspect_model(model)
    if parallel is not None and parallel < 1:
        raise UsageError(f"-np must be >= 1, got {parallel}")
    if cache_type_v.is_quantized and flash_attn is FlashAttn.OFF:
        raise UsageError(f"V cache type {cache_type_v.value} needs flash attention: use -fa on or -ctv f16")
    hw = _hardware(gpu, ram)
    ctxs = _ctxs(ctx)
    base = LaunchConfig(model=model, cache_type_k=cache_type_k, cache_type_v=cache_type_v, flash_attn=flash_attn,
                        parallel=parallel, ubatch=ubatch, ctx=ctxs[0] if ctxs else None)
    p = make_plan(info, base, hw, ctxs, KV_CHOICES)
    if as_json:
        out.print_json(json.dumps(_as_json(p)))
        return
    c = ctxs[0] if ctxs else info.ctx_train
    out.print(f"{model.name}: {info.arch}, {info.n_layer} layers, {info.n_expert} experts; {hw.describe()}",
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
    if not hw.has_gpu:
        err.print("no GPU: planned for the CPU backend; pass --gpu NAME to plan for a card", highlight=False)
