"""`moe-tune compare-quants`: the quants of one model side by side, measured for real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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
)
from tuner.core.errors import TunerError, UsageError
from tuner.quality import perplexity
from tuner.search import budget

if TYPE_CHECKING:
    from tuner.quants import compare



@app.command("compare-quants", short_help="Which quant to run: speed and loss per quant.")
@friendly
def compare_quants_cmd(
    sources: Annotated[list[str] | None, typer.Argument(
        help="One Hugging Face repo (owner/name) or several .gguf files (none: only the --make quants).")] = None,
    quants: Annotated[str | None, typer.Option("--quants", help="Comma-separated quants, e.g. Q4_K_M,Q8_0 "
                                               "(default: every quant in the repo); after one local F16/BF16 "
                                               "file: the quants to make from it, as --make ... --from.")] = None,
    trials: Annotated[int, typer.Option("--trials", help="Auto-tune trials per quant.")] = budget.QUANT_TRIALS,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Judge the fit for this card, e.g. \"RTX 3060 12GB\".")]
    = None,
    min_ctx: Annotated[int | None, typer.Option("--min-ctx", help="Context the fit verdict and tuning are for.")]
    = None,
    ctx: Annotated[int, typer.Option("-c", "--ctx-size", help="Tokens per chunk of the PPL/KLD measure.")]
    = perplexity.DEFAULT_CTX,
    chunks: Annotated[int, typer.Option("--chunks", help="Chunks of the PPL/KLD measure.")]
    = perplexity.DEFAULT_CHUNKS,
    reference: Annotated[Path | None, typer.Option("--reference", help="Reference GGUF for KLD (default: the "
                                                   "repo's F16/BF16/Q8_0 quant, else its largest).")] = None,
    n_prompt: Annotated[int | None, typer.Option("-p", "--n-prompt", help="Prompt tokens per request.")] = None,
    n_gen: Annotated[int | None, typer.Option("-n", "--n-gen", help="Generated tokens per request.")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Output folder (default results/compare-<name>).")]
    = None,
    make: Annotated[str | None, typer.Option("--make", help="Quants to make here with llama-quantize, e.g. "
                                             "Q4_K_M,IQ4_XS,Q3_K_M/Q8_0 (EXPERTS/REST: a MoE mix with the routed "
                                             "experts at EXPERTS, attention/shared/embeddings/output at REST).")]
    = None,
    make_from: Annotated[str | None, typer.Option("--from", help="F16/BF16/Q8_0 source for --make: a .gguf or a "
                                                  "repo (default: the repo's or the files' full-precision copy).")]
    = None,
    use_imatrix: Annotated[bool, typer.Option("--imatrix", help="Make with an importance matrix (llama-imatrix on "
                                              "the bundled corpus, cached per source).")] = False,
    disk_budget: Annotated[float | None, typer.Option("--disk-budget", help="GiB the comparison may add to the "
                                                      "disk (every shard of the quants and the reference it fetches, "
                                                      "made quants, logits, importance matrix, its folder); checked "
                                                      "before each fetch; keeps the winner, drops the rest as "
                                                      "needed.")] = None,
    min_tok_s: Annotated[float | None, typer.Option("--min-tok-s", help="Speed floor: generation tok/s at the "
                                                    "workload's depth the answer must reach.")] = None,
    max_kld: Annotated[float | None, typer.Option("--max-kld", help="Loss budget: the largest mean KLD the "
                                                  "answer may have.")] = None,
    depth: Annotated[int | None, typer.Option("--depth", help="Context depth (tokens) generation is measured "
                                              "at (default: the prompt).")] = None,
    device: DeviceOpt = None,
    allow_busy: AllowBusy = False,
    busy_wait: BusyWait = "10m",
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV instead of the table.")] = False,
) -> None:
    """Compare the quants of one model: size, fit, best config, prompt/gen tok/s, PPL, KLD, Pareto front.

    Writes report.md, compare.csv, compare.json and gen_tok_s_vs_kld.png to the output folder. With --make it
    quantizes here first (rows labelled "made here" with the command); with --min-tok-s/--max-kld it answers
    which quant to run and which limit binds. Interrupted, it resumes at the next quant.

    \b
    Examples:
      moe-tune compare-quants unsloth/Qwen3-30B-A3B-GGUF \\
        --quants Q4_K_M,Q6_K,Q8_0 --trials 4
      moe-tune compare-quants --from model-F16.gguf \\
        --make Q4_K_M,Q3_K_M,IQ4_XS,Q3_K_M/Q8_0 \\
        --disk-budget 40 --min-tok-s 20 --max-kld 0.05
    """
    from tuner.catalog import cards
    from tuner.engine import build
    from tuner.hub import repos
    from tuner.machine import hardware
    from tuner.measure import workload
    from tuner.models.gguf_reader import ModelInfo
    from tuner.plan import placement
    from tuner.quants import compare
    from tuner.report import compare_report

    if as_json and as_csv:
        raise UsageError("--json and --csv both choose the output: pick one")
    loc = build.locate_engine(llama_cpp_dir)
    fit_hw = cards.machine(gpu)
    fit_ctx = min_ctx or compare.autotune.DEFAULT_CTX

    def fit_of(quant: repos.Quant, model: ModelInfo) -> str:
        return placement.fit_verdict(model, fit_ctx, fit_hw)

    def say(msg: str) -> None:
        if not (as_json or as_csv):
            err.print(msg, highlight=False, soft_wrap=True)

    req = compare.CompareRequest(
        sources=tuple(sources or ()), quants=tuple(q.strip() for q in (quants or "").split(",") if q.strip()),
        trials=trials, min_ctx=min_ctx,
        workload=workload.preset(workload.WorkloadKind.CHAT, n_prompt, n_gen, depth_tokens=depth),
        kld_ctx=ctx, kld_chunks=chunks, reference=reference, out_dir=out_dir,
        make=tuple(m.strip() for m in (make or "").split(",") if m.strip()), make_from=make_from,
        imatrix=use_imatrix, disk_budget_bytes=round(disk_budget * 2**30) if disk_budget is not None else None,
        min_tok_s=min_tok_s, max_kld=max_kld, device=device_choice(device))
    with measuring("compare-quants", allow_busy=allow_busy, busy_wait=busy_wait, quiet_output=as_json or as_csv,
                   device=req.device):
        tune_hw = hardware.probe_hardware(host_bandwidth_s=0.3)
        result = compare.compare(req, loc, tune_hw, fit_of, on_step=say)
    compare_report.write(result)
    if as_json:
        out.print_json(json.dumps(compare_report.to_json(result)))
    elif as_csv:
        out.print(compare_report.to_csv(result.rows), end="", highlight=False, markup=False, soft_wrap=True)
    if result.measured == 0:
        errors = [r for r in result.rows if r.error]
        first = f": {errors[0].quant}: {errors[0].error}" if errors else ""
        more = f" (and {len(errors) - 1} more, see {result.out_dir}/report.md)" if len(errors) > 1 else ""
        raise TunerError(f"compare-quants measured none of its {len(result.rows)} quant(s){first}{more}")
    if as_json or as_csv:
        return
    out.print(table_of(result, f"at -c {fit_ctx} on {fit_hw.describe()}"))
    for line in compare_report.after_table(result):
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    if result.catalog_model:
        out.print(f"published (catalog) figures: {result.catalog_model}, not measured here (see report.md)",
                  highlight=False)
    out.print(f"reference: {result.reference or 'none (PPL only)'}", highlight=False, soft_wrap=True)
    answer = f"answer: {result.pick}; {result.binding}" if result.pick else result.binding
    out.print(answer, highlight=False, markup=False, soft_wrap=True)
    for line in result.undecided:
        if line not in answer:
            out.print(line, highlight=False, markup=False, soft_wrap=True)
    if result.disk_used_bytes is not None and req.disk_budget_bytes is not None:
        out.print(f"disk: the comparison keeps {result.disk_used_bytes / 2**30:.3f} GiB of its "
                  f"{req.disk_budget_bytes / 2**30:.3f} GiB budget", highlight=False)
    out.print(f"written: {result.out_dir}/report.md, compare.csv, compare.json, gen_tok_s_vs_kld.png",
              highlight=False, soft_wrap=True)


def table_of(result: compare.Comparison, fit_where: str) -> Table:
    """One line per quant at 80 columns: no edges, one space between columns, no cell folded; the caption says
    what the short headers mean."""
    from rich import box

    from tuner.report import compare_report

    table = Table(title=result.title, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False,
                  caption=compare_report.caption(result, fit_where))
    for col in compare_report.TERMINAL_COLUMNS:
        table.add_column(col, justify="left" if col in ("quant", "fit", "config", "verdict") else "right",
                         no_wrap=True)
    for r in result.rows:
        table.add_row(*compare_report.terminal_cells(r))
    return table
