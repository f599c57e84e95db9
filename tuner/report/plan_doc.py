"""A plan (:func:`tuner.plan.placement.make_plan`) as JSON, and the notes a reader needs beside it: what
``moe-tune plan --json`` prints and the MCP ``plan`` tool answers, one builder for both (:func:`build`: the machine,
the model's header, the engine that decides, the plan, its notes and document; a dense model's rows carry
``n_gpu_layers``, a MoE's ``n_cpu_moe``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.catalog import cards
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.engine import build as engine_build
from tuner.engine import flags
from tuner.engine.identity import REPLAY_COMMIT, EngineIdentity, replay_note
from tuner.machine import hardware
from tuner.measure.engine_memory import EngineMemory, Projection, engine_check
from tuner.models import gguf_reader
from tuner.plan.default_ctx import default_ctx
from tuner.plan.memory import Breakdown, HostBuffer
from tuner.plan.placement import KV_CHOICES, Plan, PlanRow, load_mode_note, make_plan
from tuner.plan.pricing import Price, decided_mib
from tuner.plan.ram import TIGHT_MARGIN_BYTES, RamSide, holders_line, ram_side

FIGURES_FROM = "moe-tune's memory model (tuner.plan.memory), the engine's own projection deciding where one is found"
HOST_BANDWIDTH_PROBE_S = 0.3  # how long a plan for this machine measures its RAM bandwidth (without a card named)


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What a plan is asked for: ``moe-tune plan``'s options, the MCP tool's arguments (the defaults of both)."""

    model: Path  # the GGUF header (a front end resolves the user's name: hub.resolve.resolve_model, header only)
    model_source: str  # where that header came from, in words
    gpu: str | None = None  # a card by name; None: this machine
    ram_gib: float | None = None  # plan for this much host RAM; None: this machine's available RAM
    host_bandwidth_gb_s: float | None = None
    vram_budget_mib: float | None = None
    ctxs: tuple[int, ...] = ()
    cache_type_k: CacheType = CacheType.F16
    cache_type_v: CacheType = CacheType.F16
    flash_attn: FlashAttn = FlashAttn.AUTO
    parallel: int | None = None
    ubatch: int | None = None
    mmap: bool = True
    no_host: bool = False
    repack: bool = True
    engine_check: bool = False  # set the replay beside the engine's projection (an engine is then required)
    llama_cpp_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class PlanAnswer:
    """A plan with everything said beside it; :meth:`document` is ``plan --json`` and the MCP tool's answer."""

    info: gguf_reader.ModelInfo
    plan: Plan
    base: LaunchConfig
    notes: tuple[str, ...]
    model_source: str
    mem: EngineMemory | None  # the engine whose projection decided; None: the replay alone
    check: Projection | None = None  # ``engine_check``: the replay beside the engine, component by component

    @property
    def memory_notes(self) -> tuple[str, ...]:
        """Whose figures decided, each drift beyond the tolerance, and whose the replay's are."""
        whose = replay_note(self.mem.engine if self.mem is not None else None)
        return ((self.mem.describe(), *self.mem.notes) if self.mem is not None else ()) + ((whose,) if whose else ())

    def document(self) -> dict[str, Any]:
        doc = plan_json(self.plan, list(self.notes), self.base) | {
            "model_source": self.model_source, "figures_from": FIGURES_FROM, "memory_figures": memory_figures(self.mem)}
        if self.check is not None and self.mem is not None:
            doc["engine_check"] = check_json(self.check, self.mem.engine)
        return doc


def build(req: PlanRequest) -> PlanAnswer:
    """The plan of ``req``: the machine (this one, or the named card in it), the engine whose own projection decides
    where one is found (required with ``engine_check``), the plan of the model's header and its notes."""
    info = gguf_reader.inspect_model(req.model)
    hw = hardware.with_vram_budget(
        cards.machine(req.gpu, HOST_BANDWIDTH_PROBE_S, int(req.ram_gib * 2**30) if req.ram_gib is not None else None,
                      req.host_bandwidth_gb_s), req.vram_budget_mib)
    ctxs = list(req.ctxs)
    base = LaunchConfig(model=req.model, cache_type_k=req.cache_type_k, cache_type_v=req.cache_type_v,
                        flash_attn=req.flash_attn, parallel=req.parallel, ubatch=req.ubatch,
                        ctx=ctxs[0] if ctxs else None, mmap=req.mmap, no_host=req.no_host, repack=req.repack)
    mem = (EngineMemory.of(engine_build.locate_engine(req.llama_cpp_dir)) if req.engine_check
           else EngineMemory.find(req.llama_cpp_dir))
    said: list[str] = []
    if not ctxs:  # the trained context is a ceiling, not a default (262,144 for Qwen3.5: nobody plans that first)
        ctx, why = default_ctx(info, base, hw, mem)
        ctxs, base, said = [ctx], replace(base, ctx=ctx), [why]
    if mem is not None and hw.has_gpu:  # a card's plan asks a projection per row: prefetched, as the card allows
        p = mem.prefetched(lambda price: make_plan(info, base, hw, ctxs, KV_CHOICES, price=price))
    else:  # without a GPU the offload axis places nothing: one row, a handful of projections asked as they come
        p = make_plan(info, base, hw, ctxs, KV_CHOICES, price=mem)
    notes = said + plan_notes(info, p, base, holders=ram_holders_for(req.ram_gib is not None), price=mem)
    check = engine_check(mem, info, base, hw) if req.engine_check and mem is not None else None
    return PlanAnswer(info, p, base, tuple(notes), req.model_source, mem, check)


def check_json(check: Projection, engine: EngineIdentity) -> list[dict[str, Any]]:
    """``plan --engine-check``'s rows in the document: both figures, and the one that decides each component."""
    return [{"component": r.component, "where": r.where, "model_mib": r.model_mib, "engine_mib": r.engine_mib,
             "error_mib": r.error_mib, "agrees": r.agrees, "engine_commit": engine.commit,
             "decides_mib": None if check.cpu_fallback else decided_mib(r.model_mib, r.engine_mib)}
            for r in check.rows]

# What each host buffer is, in the words the table's notes use.
_BUFFER_WORDS = {
    HostBuffer.PINNED.value: "pinned (CUDA_Host), one copy",
    HostBuffer.REPACK.value: "repacked (CPU_REPACK)",
    HostBuffer.MAPPED.value: "mapped from the file, read every token",
    HostBuffer.PLAIN.value: "plain RAM (CPU)",
}


def _parts(b: Breakdown) -> dict[str, int]:
    return {"weights": b.weights_bytes, "kv": b.kv_bytes, "recurrent": b.recurrent_bytes,
            "compute": b.compute_bytes, "overhead": b.overhead_bytes}


def row_ram(row: PlanRow, p: Plan, base: LaunchConfig) -> RamSide:
    """The RAM side of one row (tuner.plan.ram): what is left beside it, tight or not, the --cache-ram that fits."""
    return ram_side(row.estimate, base, p.hardware)


def _row_json(row: PlanRow, ram: RamSide) -> dict[str, Any]:
    e, gen, prompt = row.estimate, row.roofline.gen_tok_s, row.roofline.prompt_tok_s
    where = {"n_gpu_layers": row.n_gpu_layers} if row.offload.dense else {"n_cpu_moe": row.n_cpu_moe}
    return {
        **where, "verdict": e.verdict.value,
        "vram_bytes": e.gpu.total_bytes, "ram_bytes": e.host.total_bytes,
        "ram_need_bytes": e.host_need_bytes, "ram_reclaimable_bytes": e.reclaimable_bytes,
        # RAM left beside the config, its prompt cache counted at the size it can reach (the fitted one if set).
        "ram_headroom_bytes": ram.headroom_bytes, "ram_tight": ram.tight,
        "prompt_cache_reach_bytes": ram.cache_reach_bytes, "cache_ram_fit_mib": ram.cache_ram_fit_mib,
        "load_mode": e.load_mode,
        # Every host buffer is needed resident; a mapped one is file-backed (the kernel could evict it, at the
        # price of reading the file again every token).
        "host_buffers": [{"buffer": name, "bytes": n, "file_backed": name == HostBuffer.MAPPED.value}
                         for name, n in e.host_buffers],
        "mapped_span_bytes": e.mapped_span_bytes, "gpu_offload_copy_bytes": e.gpu_offload_copy_bytes,
        "gpu": _parts(e.gpu), "host": _parts(e.host),
        "gen_tok_s_ceiling": gen, "prompt_tok_s_ceiling": prompt,
        # Op offload: every ubatch of a prompt copies the host weights to the GPU over PCIe (None: nothing to copy).
        "op_offload_copy_s_per_ubatch": e.n_ubatch / prompt if prompt else None,
    }


def plan_json(p: Plan, notes: list[str], base: LaunchConfig) -> dict[str, Any]:
    hw = p.hardware
    axis = p.rows[0].offload

    def at(step: int | None) -> dict[str, int | None]:
        value = None if step is None else axis.value(step)
        return {"n_gpu_layers": value} if axis.dense else {"n_cpu_moe": value}

    return {
        "model": str(p.model.paths[0]), "hardware": hw.describe(), "n_configs": p.n_configs,
        "dense": axis.dense, "offload_flag": flags.spelled(axis.setting),
        "vram_budget_bytes": hw.vram_budget_bytes, "vram_budget_source": hw.vram_budget_source,
        "ram_available_bytes": hw.ram_available_bytes,
        "host_bandwidth_bytes_s": hw.host_bandwidth_bytes_s, "host_bandwidth_source": hw.host_bandwidth_source,
        "ram_tight_margin_bytes": TIGHT_MARGIN_BYTES,
        "rows": [_row_json(r, row_ram(r, p, base)) for r in p.rows],
        "fit_intervals": [{"ctx": s.ctx, "cache_type_k": s.cache_type_k.value, "cache_type_v": s.cache_type_v.value,
                           **at(s.n_cpu_moe), **s.interval.to_dict(), "summary": s.interval.describe()}
                          for s in p.smallest_fits],
        "largest_ctx": [{"cache_type_k": c.cache_type_k.value, "cache_type_v": c.cache_type_v.value,
                         **at(c.n_cpu_moe), "ctx": c.ctx} for c in p.largest_ctx],
        "notes": notes,
    }


def memory_figures(mem: EngineMemory | None) -> dict[str, Any]:
    """Whose figures decided the plan (``memory_figures`` of ``plan --json``): the engine's summary, or the replay
    alone; with the note that says whose figures the replay's are where the engine is not the pin. The same plan
    gives the same document whether its projections ran now or came from the cache."""
    summary = mem.summary(cost=False) if mem is not None else {"decided_by": "replay", "engine": None,
                                                     "replay_commit": REPLAY_COMMIT}
    return {**summary, "replay_note": replay_note(mem.engine if mem is not None else None)}


def ram_holders_for(ram_given: bool) -> Callable[[], tuple[tuple[str, int], ...]] | None:
    """Who to name as holding this machine's RAM in the notes: its processes (read only when a row is short of RAM),
    unless the plan is for a RAM size the user gave (``--ram``, the MCP tool's ``ram_gib``): another machine's."""
    return None if ram_given else hardware.ram_holders


def plan_notes(info: gguf_reader.ModelInfo, p: Plan, base: LaunchConfig,
               holders: Callable[[], tuple[tuple[str, int], ...]] | None = None, price: Price | None = None
               ) -> list[str]:
    """What a reader needs beside the table: how the host side is held, and when the load mode matters (``price``:
    the figures that decided the plan, :mod:`tuner.plan.pricing`)."""
    notes = []
    axis = p.rows[0].offload  # the plan's own axis: one step where no GPU is there
    first = p.smallest_fits[0] if p.smallest_fits else None
    n = first.n_cpu_moe if first and first.n_cpu_moe is not None else axis.steps - 1
    est = next(r.estimate for r in p.rows if r.step == n)
    held = ", ".join(f"{_BUFFER_WORDS[name]} {b / 2**30:.1f} GiB" for name, b in est.host_buffers)
    if held:
        notes.append(f"host weights at {axis.span(n, n)}: {held}" if axis.gpu else
                     f"host weights (no GPU: every weight on the CPU): {held}")
    if axis.dense:
        notes.append("a dense model has no routed experts, so --n-cpu-moe moves nothing: -ngl (layers on the GPU, "
                     "the last ones, the output head counted as one) is its offload")
    if p.hardware.has_gpu and base.mmap and not base.no_host and n > 0 and not axis.dense:
        # llama_model_loader warns the same: overrides to CPU with mmap → consider --load-mode none.
        notes.append("--load-mode none holds them as one pinned copy instead (same RAM): prompts copy experts to "
                     "the GPU faster from pinned memory; llama.cpp suggests it when experts stay on the host")
    if first is not None:
        note = load_mode_note(info, base, p.hardware, first, price)
        if note:
            notes.append(note)
    row = next(r for r in p.rows if r.step == n)
    copy = _copy_note(row, p.hardware)
    if copy:
        notes.append(copy)
    ram = row_ram(row, p, base)
    if ram.cache_ram_fit_mib is not None and not ram.exceeds:
        notes.append(f"llama-server's prompt cache may grow to --cache-ram {base.cache_ram_mib or 8192} MiB, which "
                     f"does not fit beside {axis.span(n, n)} in {ram.available_bytes / 2**30:.1f} GiB of RAM: "
                     f"launch it with --cache-ram {ram.cache_ram_fit_mib}; each row's own is in the JSON "
                     "(cache_ram_fit_mib: more host weights, a smaller cap), and auto-tune's line carries its own "
                     "config's")
    if ram.tight:
        notes.append(f"{axis.span(n, n)}: {ram.describe()}; another program's growth would make the kernel read "
                     "experts back from disk every token (fewer host experts, a smaller quant, or close something)")
    # Planned for this machine: what holds the rest of its RAM (tuner.machine.hardware.ram_holders), read only
    # when the row is short of it.
    if holders is not None and (ram.tight or ram.exceeds or row.estimate.verdict.value != "fits"):
        line = holders_line(holders(), p.hardware)
        if line:
            notes.append(line)
    return notes


def _copy_note(row: PlanRow, hw: Hardware) -> str | None:
    """What op offload costs per ubatch of a prompt for a config with host weights on a GPU rig."""
    prompt, e = row.roofline.prompt_tok_s, row.estimate
    if not prompt or not hw.has_gpu or hw.pcie_bandwidth_bytes_s <= 0:
        return None
    copied = row.roofline.prompt_copy_bytes
    copy_s = copied / hw.pcie_bandwidth_bytes_s
    return (f"op offload: each ubatch of a prompt (-ub {e.n_ubatch}) copies "
            f"{copied / 2**30:.1f} GiB of host weights to the GPU, "
            f"{1000 * copy_s:,.0f} ms at {hw.pcie_bandwidth_bytes_s / 1e9:.1f} GB/s PCIe: at most {prompt:,.0f} "
            "prompt tok/s; a larger -ub copies as often for more tokens, --no-op-offload computes them on the CPU")
