"""`moe-tune compare-models`: which model for this card and workload — the MoE with its experts offloaded, or a
dense model that fits — planned from headers, tuned, and judged head to head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tuner.cli.app import (
    AllowBusy,
    BusyWait,
    DeviceOpt,
    JsonFlag,
    LlamaDir,
    app,
    device_choice,
    err,
    friendly,
    measuring,
    out,
    say_fitted,
)
from tuner.core.errors import TunerError, UsageError
from tuner.measure import workload
from tuner.quality import kv_price


def _file(name: str) -> Path:
    """A model's weights, fetched if it is a Hub quant; a catalog shape has none to measure."""
    from tuner.hub.resolve import resolve_model

    try:
        return resolve_model(name).path
    except UsageError:
        if Path(name).suffix != ".gguf" and ":" in name and "/" not in name:
            raise UsageError(f"{name} is a catalog shape, with no weights to measure: write one with `moe-tune "
                             f"shape-model {name} --weights random` and pass the file, or use --plan-only") from None
        raise


@app.command("compare-models", short_help="Which model for this card: plan, tune and judge models head to head.")
@friendly
def compare_models_cmd(
    models: Annotated[list[str], typer.Argument(
        help="Two or more models: .gguf files, owner/name:QUANT on Hugging Face, or catalog shapes "
             "(qwen3.6-35b-a3b:Q4_K_M; --plan-only for those).")],
    workload_kind: Annotated[workload.WorkloadKind, typer.Option("--workload", help="chat, agent or batch.")]
    = workload.WorkloadKind.CHAT,
    n_prompt: Annotated[int | None, typer.Option("-p", "--n-prompt", help="Prompt tokens per request.")] = None,
    n_gen: Annotated[int | None, typer.Option("-n", "--n-gen", help="Generated tokens per request.")] = None,
    depth: Annotated[int | None, typer.Option("--depth", help="Context depth (tokens) of the workload.")] = None,
    ctx: Annotated[int | None, typer.Option("--ctx", "-c", help="Context (total over the slots) every model is "
                                            "planned and tuned for (default: the workload's).")] = None,
    parallel: Annotated[int | None, typer.Option("-np", "--parallel", help="Slots (with --workload agent: agents "
                                                 "at once).")] = None,
    trials: Annotated[int, typer.Option("--trials", help="Auto-tune trials per model.")] = 6,
    max_kld: Annotated[str | None, typer.Option(
        "--max-kld", help=f"Quality floor for every model's KV cache, as auto-tune's (default "
        f"{kv_price.DEFAULT_MAX_KLD}; off: none, and no KV pair is priced).")] = None,
    session_rounds: Annotated[int, typer.Option(
        "--session-rounds", help="Agent workload: auto-tune's confirmation sessions per arm when it tunes prompt "
        "reuse for each model; 0: no session stage (the head to head still replays sessions).")] = 3,
    gpu: Annotated[str | None, typer.Option("--gpu", help="With --plan-only: plan for this card, e.g. "
                                            "\"RTX 5080 16GB\" (default: the card here).")] = None,
    ram: Annotated[float | None, typer.Option("--ram", help="With --plan-only: plan for this much host RAM, in "
                                              "GiB.")] = None,
    host_bandwidth: Annotated[float | None, typer.Option("--host-bandwidth", help="With --plan-only: host RAM "
                                                         "bandwidth in GB/s for the ceilings (default with --gpu: "
                                                         "dual-channel DDR5-5600, 89.6).")] = None,
    plan_only: Annotated[bool, typer.Option("--plan-only", help="Answer from the headers alone: fit, offload, "
                                            "ceilings, KV capacity. No download, no GPU, nothing launched.")]
    = False,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Output folder (default results/compare-models-"
                                                 "<names>).")] = None,
    device: DeviceOpt = None,
    allow_busy: AllowBusy = False,
    busy_wait: BusyWait = "10m",
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Which model for this card and workload: plan every model (fit, offload, speed ceilings, KV capacity), tune
    each that fits (auto-tune, same card, context and slots), then judge the tuned lines head to head in
    interleaved rounds on the workload's own metric (request time; session time for agents): selection rounds
    choose the best median, fresh rounds judge it. A model is called faster only when decided in rounds that did
    not select it; undecided stays undecided. An agent session's --depth is checked in each model's own tokens
    before anything is tuned.

    Writes report.md, compare-models.json and scores.png to the output folder.

    \b
    Examples:
      moe-tune compare-models qwen3.6-35b-a3b:Q4_K_M qwen3.5-9b:Q4_K_M \\
        --gpu "RTX 5080 16GB" --ctx 65536 --plan-only
      moe-tune compare-models unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M \\
        unsloth/Qwen3.5-9B-GGUF:Q4_K_M --workload agent --trials 8
    """
    from rich import box

    from tuner.catalog import cards
    from tuner.engine import build
    from tuner.machine import hardware
    from tuner.report import versus_report
    from tuner.search import session_stage
    from tuner.versus import compare

    if trials < 1:
        raise UsageError(f"--trials {trials} tunes nothing: give 1 or more")
    if (gpu is not None or ram is not None or host_bandwidth is not None) and not plan_only:
        raise UsageError("--gpu, --ram and --host-bandwidth plan a machine that is not here: add --plan-only "
                         "(measuring uses this machine)")
    if ram is not None and ram <= 0:
        raise UsageError(f"--ram {ram:g} GiB leaves nothing to plan for: give the host RAM in GiB, e.g. --ram 64")
    session_stage.check_rounds(session_rounds)
    load = workload.preset(workload_kind, n_prompt, n_gen, depth_tokens=depth, concurrency=parallel)
    req = compare.CompareModelsRequest(models=tuple(models), workload=load, ctx=ctx, parallel=parallel, trials=trials,
                                       out_dir=out_dir, device=device_choice(device), plan_only=plan_only,
                                       max_kld=kv_price.parse_max_kld(max_kld), session_rounds=session_rounds)

    shown: set[str] = set()  # launch lines the steps already showed whole

    def say(msg: str) -> None:
        say_fitted(err, msg, shown)

    if plan_only:
        hw = cards.machine(gpu, 0.3, int(ram * 2**30) if ram is not None else None, host_bandwidth)
        result = compare.compare_models(req, None, hw, resolve_header=compare.header_resolver(),
                                        resolve_file=_file, on_step=say)
    else:
        loc = build.locate_engine(llama_cpp_dir)
        headers = compare.header_resolver()
        # Plan first (headers only): a model that fits nowhere, or a bad name, stops before anything is measured.
        compare.plan(req, cards.machine(None, 0.3), headers, loc)
        with measuring("compare-models", allow_busy=allow_busy, busy_wait=busy_wait, quiet_output=as_json,
                       device=req.device):
            hw = hardware.probe_hardware(host_bandwidth_s=0.3)
            result = compare.compare_models(req, loc, hw, resolve_header=headers,
                                            resolve_file=_file, on_step=say)
    written = versus_report.write(result)
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
    else:
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True,
                      caption=versus_report.CAPTION)
        for col in versus_report.columns(result):
            # The model column is cut to fit 80 columns; the lines below name each model in full.
            table.add_column(col, justify="left" if col in ("model", "placement", "KV") else "right", no_wrap=True,
                             overflow="ellipsis", max_width=26 if col == "model" else None)
        for r in result.rows:
            table.add_row(*versus_report.cells(result, r))
        out.print(table)
        for line in versus_report.after_table(result):
            say_fitted(out, line)
        say_fitted(out, f"written: {', '.join(str(p) for p in written)}, {result.out_dir / 'compare-models.json'}")
    if not plan_only and result.versus is not None and result.versus.best is None:
        raise TunerError(f"compare-models: {result.versus.summary()}")
    if not plan_only and result.versus is None:
        errors = [f"{r.plan.label}: {r.error}" for r in result.rows if r.error]
        raise TunerError("compare-models measured no model" + (f" ({'; '.join(errors)})" if errors else ""))
