"""`moe-tune plan`: VRAM, RAM, verdict and speed ceilings for every --n-cpu-moe (a dense model: every -ngl),
without launching anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tuner.cli.app import CacheTypeK, CacheTypeV, FlashAttnOpt, JsonFlag, LlamaDir, UbatchOpt, app, err, friendly, out
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError

if TYPE_CHECKING:  # the command's own modules load when it runs (start-up: see cli/__init__)
    from tuner.core.model import ModelInfo
    from tuner.engine.identity import EngineIdentity
    from tuner.measure.engine_memory import Projection
    from tuner.plan.placement import Plan


LOAD_MODES = ("mmap", "none")


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


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.0f}"


@app.command("plan", short_help="VRAM, RAM and fit per --n-cpu-moe (dense: -ngl); needs no GPU.")
@friendly
def plan_cmd(
    model: Annotated[str, typer.Argument(
        help="GGUF file, owner/name:QUANT (header only, no download), or a catalog shape like qwen3-30b-a3b:Q4_K_M.")],
    gpu: Annotated[str | None, typer.Option("--gpu", help="Plan for this card, e.g. \"RTX 4060 Ti 16GB\".")] = None,
    ram: Annotated[float | None, typer.Option("--ram", help="Plan for this much host RAM, in GiB.")] = None,
    host_bandwidth: Annotated[float | None, typer.Option(
        "--host-bandwidth", help="Host RAM bandwidth in GB/s for the speed ceilings (default with --gpu: "
        "dual-channel DDR5-5600, 89.6).")] = None,
    vram_budget: Annotated[float | None, typer.Option(
        "--vram-budget", help="MiB of VRAM the model may use (default: free VRAM now, or the whole --gpu card).")]
    = None,
    ctx: Annotated[str | None, typer.Option("-c", "--ctx-size", help="Context(s), e.g. 8192 or 8192,32768.")] = None,
    cache_type_k: CacheTypeK = CacheType.F16,
    cache_type_v: CacheTypeV = CacheType.F16,
    parallel: Annotated[int | None, typer.Option("-np", "--parallel", help="Slots (default: 4, unified KV).")] = None,
    flash_attn: FlashAttnOpt = FlashAttn.AUTO,
    ubatch: UbatchOpt = None,
    load_mode: Annotated[str, typer.Option(
        "-lm", "--load-mode", help="How weights are loaded: mmap (llama.cpp's default) or none.")] = "mmap",
    no_host: Annotated[bool, typer.Option("--no-host", help="No pinned host buffer (as llama-server --no-host).")]
    = False,
    no_repack: Annotated[bool, typer.Option("--no-repack", help="No CPU repacking (as llama-server --no-repack).")]
    = False,
    engine_check: Annotated[bool, typer.Option(
        "--engine-check", help="Show the replay beside llama.cpp's own projection (llama-fit-params), "
        "component by component.")] = False,
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
) -> None:
    """VRAM and RAM needed, verdict and speed ceilings for every --n-cpu-moe; works without a GPU. A dense model
    (no routed experts) is planned along -ngl instead: layers on the GPU, fewer layers, less VRAM.

    RAM is what the launch needs resident (pinned, repacked or anonymous buffers, and the mapped experts it
    reads every token); the page cache the load leaves behind is shown apart, as reclaimable. Where a llama.cpp
    engine is found, its own projection (llama-fit-params) decides the fit; the replay of the pinned commit is
    the first guess, and plans alone for a card no engine here can project.

    \b
    Examples:
      moe-tune plan unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M --gpu "RTX 3060 12GB" \\
        -c 32768 --engine-check
      moe-tune plan gpt-oss-120b:MXFP4_MOE --gpu "RTX 3090" --ram 64 -c 32768 \\
        --host-bandwidth 51.2
    """
    cache_type_k, cache_type_v = cache_type_k or CacheType.F16, cache_type_v or CacheType.F16
    flash_attn = flash_attn or FlashAttn.AUTO
    if ram is not None and ram <= 0:
        raise UsageError(f"--ram {ram:g} GiB leaves nothing to plan for: give the host RAM in GiB, e.g. --ram 64")
    if parallel is not None and parallel < 1:
        raise UsageError(f"-np must be >= 1, got {parallel}")
    if load_mode not in LOAD_MODES:
        raise UsageError(f"--load-mode {load_mode!r} is not planned: use mmap or none")
    if cache_type_v.is_quantized and flash_attn is FlashAttn.OFF:
        raise UsageError(f"V cache type {cache_type_v.value} needs flash attention: use -fa on or -ctv f16")
    from tuner.hub.resolve import resolve_model
    from tuner.report import plan_doc

    resolved = resolve_model(model, header_only=True)
    answer = plan_doc.build(plan_doc.PlanRequest(
        resolved.path, resolved.source, gpu=gpu, ram_gib=ram, host_bandwidth_gb_s=host_bandwidth,
        vram_budget_mib=vram_budget, ctxs=tuple(_ctxs(ctx)), cache_type_k=cache_type_k, cache_type_v=cache_type_v,
        flash_attn=flash_attn, parallel=parallel, ubatch=ubatch, mmap=load_mode == "mmap", no_host=no_host,
        repack=not no_repack, engine_check=engine_check, llama_cpp_dir=llama_cpp_dir))
    if as_json:
        out.print_json(json.dumps(answer.document()))
        return
    p, base, mem, check = answer.plan, answer.base, answer.mem, answer.check
    hw = p.hardware
    _print_plan(model, answer.info, p, base, list(answer.notes), answer.model_source)
    for note in answer.memory_notes:
        _say(note)
    if check is not None and mem is not None:
        _print_check(check, base, mem.engine)
    else:
        out.print("add --engine-check to compare them with llama.cpp's own projection (llama-fit-params)",
                  highlight=False, markup=False, soft_wrap=True)
    if not hw.has_gpu:
        err.print("no GPU: planned for the CPU backend (one row: --n-cpu-moe changes nothing without a card); pass "
                  "--gpu NAME to plan for a card", highlight=False, markup=False)


# Verdicts as the 80-column table spells them (the JSON keeps the full words).
_SHORT = {"needs spill": "spill", "exceeds RAM": "over RAM"}


def _say(text: str) -> None:
    """A line of plain text (model names and paths are printed as given, never as markup), wrapped by the terminal."""
    out.print(text, highlight=False, markup=False, soft_wrap=True)


def _print_plan(model: str, info: ModelInfo, p: Plan, base: LaunchConfig, notes: list[str],
                source: str) -> None:
    from rich import box
    from rich.table import Table

    from tuner.engine import flags
    from tuner.plan.ram import TIGHT_MARGIN_BYTES
    from tuner.report import plan_doc

    hw = p.hardware
    c = base.ctx or info.ctx_train
    axis = p.rows[0].offload  # one step where no GPU is there: --n-cpu-moe would change nothing
    kind = "dense" if axis.dense else f"{info.n_expert} experts"
    _say(f"{Path(model).name}: {info.arch}, {info.n_layer} layers, {kind}; {hw.describe()}")
    _say(f"-c {c} -ctk {base.cache_type_k.value} -ctv {base.cache_type_v.value} -fa {base.flash_attn.value} "
         f"--load-mode {'mmap' if base.mmap else 'none'}; RAM available {hw.ram_available_bytes / 2**30:.1f} GiB; "
         f"host bandwidth {hw.host_bandwidth_bytes_s / 1e9:.1f} GB/s ({hw.host_bandwidth_source})")
    # Fits 80 columns: no vertical rules, units in the headers.
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for col in (flags.spelled(axis.setting) if axis.gpu else "weights\non", "VRAM\nMiB", "RAM need\nMiB",
                "RAM left\nMiB", "page\ncache", "verdict", "tg max\ntok/s", "pp max\ntok/s"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in p.rows:
        e, ram = r.estimate, plan_doc.row_ram(r, p, base)
        verdict = "tight" if ram.tight and e.verdict.value == "fits" else _SHORT.get(e.verdict.value, e.verdict.value)
        table.add_row(str(axis.value(r.step)) if axis.gpu else "CPU", _mib(e.gpu.total_bytes), _mib(e.host_need_bytes),
                      _mib(ram.headroom_bytes), _mib(e.reclaimable_bytes), verdict, _rate(r.roofline.gen_tok_s),
                      _rate(r.roofline.prompt_tok_s))
    out.print(table)
    _say("RAM need: pinned, repacked or anonymous buffers and the mapped weights read every token; RAM left: "
         "what stays beside it with llama-server's prompt cache at the size it can reach; tight: under "
         f"{TIGHT_MARGIN_BYTES / 2**30:.0f} GiB left; spill: more VRAM than the budget; page cache (MiB): file "
         "pages read at load, reclaimable")
    for s in p.smallest_fits:
        _say(f"-c {s.ctx} -ctk {s.cache_type_k.value} -ctv {s.cache_type_v.value} {s.interval.describe()}")
    for lc in p.largest_ctx:
        where = f"{lc.ctx} ({axis.span(lc.n_cpu_moe, lc.n_cpu_moe)})" if lc.n_cpu_moe is not None else "none fits"
        _say(f"largest ctx at -ctk {lc.cache_type_k.value} -ctv {lc.cache_type_v.value}: {where}")
    for note in notes:
        _say(note)
    _say(f"model header: {source}; figures: {plan_doc.FIGURES_FROM}")


def _print_check(check: Projection, base: LaunchConfig, engine: EngineIdentity) -> None:
    """The replay and the engine's projection side by side, and the figure that decides each component."""
    from rich import box
    from rich.table import Table

    from tuner.engine.identity import REPLAY_COMMIT
    from tuner.plan.pricing import decided_mib

    if check.cpu_fallback:
        err.print("--engine-check: this llama.cpp build has no GPU backend, so it projects the CPU backend; "
                  "both columns below are for CPU only", highlight=False)
    table = Table(title=f"replay of {REPLAY_COMMIT} vs {engine.name} (llama-fit-params, -np {base.parallel or 1})",
                  box=box.SIMPLE_HEAD)
    for col in ("component", "where", "replay MiB", "llama.cpp MiB", "diff MiB", "replay agrees",
                *(() if check.cpu_fallback else ("decides MiB",))):
        table.add_column(col, justify="right")
    for r in check.rows:
        decides = () if check.cpu_fallback else (f"{decided_mib(r.model_mib, r.engine_mib):,}",)
        table.add_row(r.component, r.where, f"{r.model_mib:,}", f"{r.engine_mib:,}", f"{r.error_mib:+,}",
                      "yes" if r.agrees else "NO", *decides)
    out.print(table)
    if not check.cpu_fallback:
        _say(f"decides: the figure the verdicts use ({engine.name}'s own where it differs from the replay by more "
             "than its rounding)")
