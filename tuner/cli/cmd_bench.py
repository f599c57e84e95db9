"""`moe-tune bench`: one config measured end to end — llama-bench at depth, then a llama-server workload."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from tuner.cli.app import (
    AllowBusy,
    BusyWait,
    CacheTypeK,
    CacheTypeV,
    DeviceOpt,
    FlashAttnOpt,
    JsonFlag,
    LlamaDir,
    UbatchOpt,
    app,
    device_choice,
    err,
    friendly,
    measuring,
    mib,
    model_path,
    out,
)
from tuner.core.config import LaunchConfig
from tuner.core.errors import TunerError, UsageError
from tuner.measure import workload

if TYPE_CHECKING:
    from tuner.engine import build
    from tuner.engine.kinds import EngineKind
    from tuner.machine import hardware
    from tuner.measure import one_config, session_run
    from tuner.measure.bench import ServerTrial



def _kind_of_program(line: str) -> EngineKind | None:
    """The engine a pasted line's program is, where it is a path to a build here (ik's server has llama.cpp's name,
    so only what the build is tells them apart); None: the line's own flags decide."""
    import shlex

    from tuner.engine import build

    try:
        words = [w for w in shlex.split(line.replace("\\\n", " ")) if "=" not in w or w.startswith("-")]
    except ValueError:
        return None  # the parse that follows says what is wrong with the quotes
    program = Path(words[0]).expanduser() if words else None
    if program is None or not program.is_absolute() or not program.is_file():
        return None
    return build.capabilities(build.EngineLocation(program.parent, "option")).kind


@app.command("bench", short_help="Measure one config end to end: speed, memory, spill.")
@friendly
def bench_cmd(
    model: Annotated[str | None, typer.Argument(
        help="GGUF file or Hugging Face REPO:QUANT (downloaded); default: the embedded demo model.")] = None,
    from_cmd: Annotated[str | None, typer.Option("--from-cmd", help="A pasted llama-server command to measure.")]
    = None,
    n_cpu_moe: Annotated[int | None, typer.Option("--n-cpu-moe", "-ncmoe", help="Layers whose experts stay in RAM.")]
    = None,
    n_gpu_layers: Annotated[int | None, typer.Option("-ngl", "--n-gpu-layers", help="Layers on the GPU.")] = None,
    cache_type_k: CacheTypeK = None,
    cache_type_v: CacheTypeV = None,
    flash_attn: FlashAttnOpt = None,
    ctx: Annotated[int | None, typer.Option("-c", "--ctx-size", help="Server context (all slots).")] = None,
    parallel: Annotated[int | None, typer.Option(
        "-np", "--parallel", help="Server slots; measured 1..N; --workload agent: N agents at once.")] = None,
    threads: Annotated[int | None, typer.Option("-t", "--threads")] = None,
    threads_batch: Annotated[int | None, typer.Option("-tb", "--threads-batch")] = None,
    batch: Annotated[int | None, typer.Option("-b", "--batch-size")] = None,
    ubatch: UbatchOpt = None,
    kv_unified: Annotated[bool | None, typer.Option("--kv-unified/--no-kv-unified")] = None,
    swa_full: Annotated[bool, typer.Option("--swa-full", help="Full-size cache for sliding-window layers.")] = False,
    cache_reuse: Annotated[int | None, typer.Option(
        "--cache-reuse", help="Server: smallest chunk reused from the cache by shifting KV (0: off).")] = None,
    ctx_checkpoints: Annotated[int | None, typer.Option(
        "--ctx-checkpoints", help="Server: context checkpoints per slot (hybrid and SWA models).")] = None,
    checkpoint_min_step: Annotated[int | None, typer.Option(
        "--checkpoint-min-step", help="Server: minimum tokens between context checkpoints.")] = None,
    cache_ram: Annotated[int | None, typer.Option(
        "--cache-ram", help="Server: host prompt cache limit in MiB (0: off, -1: no limit).")] = None,
    session_file: Annotated[str | None, typer.Option(
        "--session", help="Agent workload: replay this OpenAI-style messages JSON instead of the bundled session.")]
    = None,
    no_mmap: Annotated[bool, typer.Option("--no-mmap", help="Load weights into RAM (-lm none).")] = False,
    no_repack: Annotated[bool, typer.Option("--no-repack")] = False,
    spec_type: Annotated[str | None, typer.Option(
        "--spec-type", help="Speculative decoding (server only): draft-mtp, draft-simple (with -md), ngram-mod, …")]
    = None,
    draft_model: Annotated[str | None, typer.Option("-md", "--draft", help="Draft model for draft-simple.")] = None,
    spec_n_max: Annotated[int | None, typer.Option("--spec-draft-n-max", help="Tokens drafted per step.")] = None,
    spec_n_min: Annotated[int | None, typer.Option("--spec-draft-n-min")] = None,
    spec_p_min: Annotated[float | None, typer.Option("--spec-draft-p-min", help="Stop drafting below this p.")]
    = None,
    synth_len: Annotated[float | None, typer.Option(
        "--spec-synth-len", help="Benchmarking only: synthetic mean acceptance length.")] = None,
    synth_rates: Annotated[str | None, typer.Option(
        "--spec-synth-rates", help="Benchmarking only: per-position acceptance, e.g. 0.8,0.6,0.4.")] = None,
    n_prompt: Annotated[int | None, typer.Option("-p", "--n-prompt", help="Prompt tokens (P).")] = None,
    n_gen: Annotated[int | None, typer.Option("-n", "--n-gen", help="Generated tokens (G).")] = None,
    repetitions: Annotated[int | None, typer.Option(
        "-r", "--repetitions", help="Exact llama-bench repetitions; default: repeat until RSE <= 3 %.")] = None,
    depth: Annotated[int, typer.Option("-d", "--depth", help="Context already filled before measuring.")] = 0,
    workload_kind: Annotated[workload.WorkloadKind, typer.Option("--workload", help="Server workload.")]
    = workload.WorkloadKind.CHAT,
    no_server: Annotated[bool, typer.Option("--no-server", help="Only llama-bench; skip the server trial.")]
    = False,
    vram_budget: Annotated[float | None, typer.Option(
        "--vram-budget", help="MiB of VRAM the spill verdict counts as full (default: what is free).")] = None,
    device: DeviceOpt = None,
    allow_busy: AllowBusy = False,
    busy_wait: BusyWait = "10m",
    engine: Annotated[str | None, typer.Option(
        "--engine", help="Which engine measures: llama.cpp or ik (ik_llama.cpp, `moe-tune engine install --engine "
        "ik`). Default: the engine a --from-cmd line names (its path, or ik's own flags), else llama.cpp.")] = None,
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Measure one config: pp/tg at depth (llama-bench, with CV), then TTFT and per-request vs aggregate
    tok/s per concurrency (llama-server), memory peak and the spill verdicts: VRAM (spill) and host RAM (host
    paging: the model read back from disk while it generates, counted in major faults per generated token).

    \b
    Examples:
      moe-tune bench model.gguf --n-cpu-moe 20 -ctk q8_0 -ctv q8_0 -fa on \\
        -c 32768 -np 2 -d 8192
      moe-tune bench --from-cmd "llama-server -m x.gguf -ncmoe 20 -c 32768"
      moe-tune bench model.gguf --workload agent -d 16384 \\
        --session my-agent-log.json
    """
    from tuner.engine import build, flags
    from tuner.engine.kinds import kind_named
    from tuner.machine import hardware
    from tuner.measure import one_config, session
    from tuner.models import demo

    given: dict[str, Any] = {
        "n_cpu_moe": n_cpu_moe, "n_gpu_layers": n_gpu_layers, "cache_type_k": cache_type_k,
        "cache_type_v": cache_type_v, "flash_attn": flash_attn, "ctx": ctx, "parallel": parallel,
        "threads": threads, "threads_batch": threads_batch, "batch": batch, "ubatch": ubatch,
        "kv_unified": kv_unified, "swa_full": True if swa_full else None, "cache_reuse": cache_reuse,
        "ctx_checkpoints": ctx_checkpoints, "checkpoint_min_step": checkpoint_min_step, "cache_ram_mib": cache_ram,
        "mmap": False if no_mmap else None, "repack": False if no_repack else None,
        "spec_types": flags.parse_spec_types(spec_type) if spec_type else None,
        "draft_model": model_path(draft_model) if draft_model else None,
        "spec_draft_n_max": spec_n_max, "spec_draft_n_min": spec_n_min, "spec_draft_p_min": spec_p_min,
        "spec_synth_len": synth_len,
        "spec_synth_rates": tuple(_number(r) for r in synth_rates.split(",")) if synth_rates else None,
        "device": device_choice(device),
    }
    given = {k: v for k, v in given.items() if v is not None}
    if from_cmd is not None:
        if given:
            raise UsageError(f"--from-cmd already holds the flags; drop {', '.join(sorted(given))} or edit the command")
        kind = kind_named(engine) if engine else _kind_of_program(from_cmd)
        parsed = flags.parse_command(from_cmd, kind)
        cfg = parsed.config if model is None else flags.with_overrides(parsed.config, model=model_path(model))
        if parsed.ignored and not as_json:
            err.print(f"not measured (no effect on speed): {' '.join(parsed.ignored)}", highlight=False)
    else:
        # The demo model (when no model is named) is made once the machine is held: it runs the engine.
        cfg = LaunchConfig(model=model_path(model) if model is not None else DEMO_PLACEHOLDER,
                           engine=kind_named(engine or "llama.cpp").name, **given)
    if cfg.model != DEMO_PLACEHOLDER and not cfg.model.is_file():
        raise TunerError(f"model file {cfg.model} not found: check the path")
    flags.validate(cfg)
    if cfg.speculative and no_server:
        raise UsageError("speculative decoding is measured by llama-server only: drop --no-server")
    load = workload.preset(workload_kind, n_prompt, n_gen, depth_tokens=depth or None)  # agent's 8192 cut to -d
    loc = build.locate_engine(llama_cpp_dir, kind_named(cfg.engine))
    if cfg.speculative and not as_json:
        err.print("llama-bench has no speculative decoding at the pinned engine: its rows are measured without it; "
                  "the llama-server trial measures it", highlight=False)
    if session_file is not None and workload_kind is not workload.WorkloadKind.AGENT:
        raise UsageError("--session replays an agent conversation: add --workload agent")
    agent = workload_kind is workload.WorkloadKind.AGENT
    turn_gen = n_gen or session.DEFAULT_GEN_TOKENS
    # -np N: N agents' sessions at once, one per slot.
    makers = session.session_makers(Path(session_file).expanduser() if session_file else None, depth or None,
                                    turn_gen, parallel or 1) if agent else None
    with measuring("bench", allow_busy=allow_busy, busy_wait=busy_wait, quiet_output=as_json, device=cfg.device):
        if cfg.model == DEMO_PLACEHOLDER:
            cfg = replace(cfg, model=demo.default_model(loc, on_step=lambda msg: err.print(msg, highlight=False)))
        ram_warning = _ram_warning(loc, cfg, hardware.probe_hardware(host_bandwidth_s=0))
        if ram_warning:
            err.print(ram_warning, highlight=False, markup=False, soft_wrap=True)
        with err.status(f"measuring {cfg.model.name}") as status:
            report = one_config.bench_config(loc, cfg, load, depth=depth, repetitions=repetitions,
                                             server=not no_server, vram_budget_mib=vram_budget,
                                             on_step=status.update, session=makers, session_gen_tokens=turn_gen)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    _print(report)
    accepted = report.acceptance
    if accepted is not None:
        out.print(f"speculation: {accepted.accepted_n} of {accepted.drafted_n} drafted tokens accepted "
                  f"({100 * (accepted.rate or 0):.0f} %), {accepted.mean_len:.2f} tokens per step", highlight=False)
    elif cfg.speculative and report.server is not None:
        out.print("speculation: nothing was drafted in this workload", highlight=False)


DEMO_PLACEHOLDER = Path("<the demo model>")


def _ram_warning(loc: build.EngineLocation, cfg: LaunchConfig, hw: hardware.Hardware) -> str | None:
    """A warning for a config the memory model says exceeds RAM or leaves it tight, said before it is measured:
    its figures would be those of the kernel paging experts in from disk, not of the config. The engine that will
    run it decides by its own projection (tuner.measure.engine_memory)."""
    from tuner.machine import hardware
    from tuner.measure.engine_memory import EngineMemory
    from tuner.models.gguf_reader import inspect_model
    from tuner.plan import ram

    side = ram.ram_side(EngineMemory.of(loc)(inspect_model(cfg.model), cfg, hw), cfg, hw)
    if not (side.exceeds or side.tight):
        return None
    fix = "fewer host experts (a lower --n-cpu-moe), a smaller quant, or close what holds RAM"
    if side.cache_ram_fit_mib is not None:
        fix = f"--cache-ram {side.cache_ram_fit_mib}, " + fix
    holders = ram.holders_line(hardware.ram_holders(), hw) or ""
    return (f"warning: the memory model says this config {side.describe()} ({side.need_bytes / ram.GIB:.1f} GiB "
            f"needed of {side.available_bytes / ram.GIB:.1f} GiB available): it may measure the disk, not the config; "
            f"{fix}" + (f". {holders}" if holders else ""))


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--spec-synth-rates takes numbers like 0.8,0.6, got {text!r}") from None


def _print(report: one_config.BenchReport) -> None:
    from tuner.engine import flags

    cfg, result, trial = report.config, report.bench, report.server
    engine = report.engine.describe() if report.engine is not None else "llama.cpp of unknown build"
    out.print(f"{cfg.model.name}  ({engine})", highlight=False, soft_wrap=True)
    table = Table(title="llama-bench")
    for col in ("test", "depth", "median tok/s", "CV %", "samples", "% of ceiling"):
        table.add_column(col, justify="right")
    for row in result.rows:
        s = row.spread
        test = f"pp{row.n_prompt}" if row.kind == "pp" else f"tg{row.n_gen}"
        pct = report.percent_of_roofline(s.median) if row.kind == "tg" else None
        table.add_row(test, str(row.n_depth), f"{s.median:,.1f}", f"{s.cv_pct:.1f}", str(s.n),
                      "" if pct is None else f"{pct:.0f} %")
    out.print(table)
    out.print(f"llama-bench host paging (timed generation runs): {result.host_paging.describe()}", highlight=False,
              soft_wrap=True)
    if trial is not None:
        t = Table(title=f"llama-server, {trial.workload.kind.value} workload "
                        f"(P={trial.workload.prompt_tokens}, G={trial.workload.gen_tokens})")
        for col in ("concurrent", "TTFT ms", "prompt tok/s per request", "gen tok/s per request",
                    "aggregate gen tok/s", "end-to-end gen tok/s"):
            t.add_column(col, justify="right")
        for lvl in trial.levels:
            t.add_row(str(lvl.concurrency), f"{1000 * lvl.ttft_s:,.0f}", f"{lvl.per_request_prompt_tok_s:,.1f}",
                      f"{lvl.per_request_gen_tok_s:,.1f}", f"{lvl.aggregate_gen_tok_s:,.1f}",
                      f"{lvl.end_to_end_gen_tok_s:,.1f}")
        out.print(t)
        _print_memory(trial)
    if report.session is not None:
        print_session(report.session.result, f"llama-server, agent session ({report.session.result.source})")
        out.print(f"host paging (session): {report.session.host_paging.describe()}", highlight=False, soft_wrap=True)
        if report.finding is not None:
            out.print(report.finding.describe(), highlight=False, soft_wrap=True)
    out.print(f"launch line: {flags.launch_line(cfg)}", highlight=False, soft_wrap=True)


def print_session(result: session_run.SessionResult, title: str) -> None:
    """The per-turn table: context, cached vs processed prompt tokens, TTFT, generation speed, turn time."""
    agents = result.agents
    t = Table(title=title + (f", {agents} agents at once (turn 2.3: agent 2's third)" if agents > 1 else ""))
    for col in ("turn", "context", "cached", "processed", "cached %", "TTFT ms", "gen tok/s", "turn s"):
        t.add_column(col, justify="right")
    for r in result.turns:
        mark = " !" if r.full_reprocess else ""
        t.add_row(f"{r.name(agents)}{mark}", f"{r.context_tokens:,}", f"{r.cached_tokens:,}", f"{r.processed_tokens:,}",
                  f"{100 * r.cached_share:.0f}", f"{1000 * r.ttft_s:,.0f}", f"{r.gen_tok_s:,.1f}", f"{r.elapsed_s:.2f}")
    out.print(t)
    wall = f" (wall time, {agents} agents at once)" if agents > 1 else ""
    out.print(f"session: {result.session_s:.2f} s{wall} over {len(result.turns)} turns; median TTFT "
              f"{1000 * result.median_ttft_s:,.0f} ms; {100 * result.reprocessed_share:.0f} % of the reusable context "
              "re-processed" + ("  (! = a turn that re-processed its whole context)" if result.full_reprocess_turns
                                else ""), highlight=False, soft_wrap=True)


def _print_memory(trial: ServerTrial) -> None:
    mem = trial.memory
    vram = "n/a (no NVIDIA GPU)" if mem.vram_peak_bytes is None else mib(mem.vram_peak_bytes)
    rss = "n/a" if mem.rss_peak_bytes is None else mib(mem.rss_peak_bytes)
    tpj = "n/a (no power reading)" if trial.tokens_per_joule is None else f"{trial.tokens_per_joule:,.2f} tok/J"
    roof_text = "n/a" if not trial.roofline_tok_s else \
        f"{100 * trial.levels[0].per_request_gen_tok_s / trial.roofline_tok_s:.0f} % of roofline"
    out.print(f"memory peak: VRAM {vram}, server RSS {rss}, swap +{mib(mem.swap_growth_bytes)}", highlight=False)
    out.print(f"spill: {trial.spill.kind.value} ({trial.spill.evidence})", highlight=False, soft_wrap=True)
    out.print(f"host paging: {trial.host_paging.describe()}", highlight=False, soft_wrap=True)
    out.print(f"energy: {tpj}; roofline: {roof_text}", highlight=False)
    if trial.memory_breakdown is not None:
        parts = [f"{r.name} model {r.model_mib} + context {r.context_mib} + compute {r.compute_mib} MiB"
                 for r in trial.memory_breakdown.rows if r.self_mib]
        out.print(f"llama.cpp memory: {'; '.join(parts)}", highlight=False, soft_wrap=True)
