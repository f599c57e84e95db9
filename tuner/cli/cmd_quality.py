"""`moe-tune quality`: perplexity and KL-divergence of a model file at given KV cache types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.app import (
    CacheTypeK,
    CacheTypeV,
    FlashAttnOpt,
    JsonFlag,
    LlamaDir,
    app,
    err,
    facts_table,
    friendly,
    mib,
    model_path,
    out,
)
from tuner.core.config import CacheType, FlashAttn
from tuner.core.errors import UsageError
from tuner.quality import perplexity


def _pm(value: float | None, error: float | None, fmt: str, unit: str = "") -> str:
    if value is None:
        return "—"
    return f"{value:{fmt}} ± {error or 0.0:{fmt}}{unit}"


@app.command("quality", short_help="Perplexity and KL-divergence against a reference.")
@friendly
def quality_cmd(
    model_name: Annotated[str, typer.Argument(metavar="MODEL", help="GGUF file or Hugging Face REPO:QUANT.")],
    reference_name: Annotated[
        str | None,
        typer.Option("--reference", help="Reference GGUF (default: the highest-precision file of the same model "
                                         "next to MODEL: F32/BF16/F16/Q8_0)."),
    ] = None,
    cache_type_k: CacheTypeK = CacheType.F16,
    cache_type_v: CacheTypeV = CacheType.F16,
    flash_attn: FlashAttnOpt = FlashAttn.AUTO,
    ctx: Annotated[int, typer.Option("-c", "--ctx-size", help="Tokens per chunk.")] = perplexity.DEFAULT_CTX,
    chunks: Annotated[int, typer.Option("--chunks", help="Chunks to evaluate.")] = perplexity.DEFAULT_CHUNKS,
    text_file: Annotated[
        Path | None, typer.Option("-f", "--file", help="Evaluate on this text instead of the bundled corpus.")
    ] = None,
    dataset: Annotated[
        str | None, typer.Option("--dataset", help="Evaluate on a standard text from the Hub: wikitext-2.")
    ] = None,
    disk_budget_gib: Annotated[
        float, typer.Option("--disk-budget-gib", help="Most disk the cached reference logits may take.")
    ] = perplexity.DEFAULT_DISK_BUDGET_BYTES / 2**30,
    threads: Annotated[int | None, typer.Option("-t", "--threads")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Measure again even if a result is cached.")] = False,
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Measure perplexity and KL-divergence against a reference (llama-perplexity), cached.

    \b
    Examples:
      moe-tune quality model-Q4_K_M.gguf -ctk q8_0 -ctv q8_0 --chunks 32
      moe-tune quality unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M --dataset wikitext-2 \\
        -c 512 --chunks 64
    """
    from tuner.engine import build
    from tuner.quality import corpus

    cache_type_k, cache_type_v = cache_type_k or CacheType.F16, cache_type_v or CacheType.F16
    flash_attn = flash_attn or FlashAttn.AUTO
    if dataset is not None:
        if text_file is not None:
            raise UsageError("-f and --dataset both name the text: keep one")
        from tuner.hub import datasets

        with err.status(f"fetching {dataset}"):
            text_file = datasets.fetch(dataset)
    loc = build.locate_engine(llama_cpp_dir)
    model = model_path(model_name)
    reference = model_path(reference_name) if reference_name else None
    with err.status(f"measuring {model.name}") as status:
        result = perplexity.measure(
            loc, model, reference=reference, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
            flash_attn=flash_attn, threads=threads, ctx=ctx, chunks=chunks, text_file=text_file,
            disk_budget_bytes=int(disk_budget_gib * 2**30), use_cache=not no_cache,
            on_step=lambda msg: status.update(msg),
        )
    if as_json:
        out.print_json(json.dumps(result.to_json()))
        return
    table = facts_table()
    table.add_row("model", result.model)
    table.add_row("reference", result.reference or "none found (perplexity only; name one with --reference)")
    if result.reference_logits:
        table.add_row("reference logits", f"{result.reference_logits} ({mib(result.reference_logits_bytes or 0)})")
        table.add_row("reference PPL", f"{result.reference_ppl:.4f}")
    text = "bundled corpus" if text_file is None else (f"{dataset} ({text_file})" if dataset else str(text_file))
    if text_file is None:
        text += f" ({len(corpus.documents())} documents)"
    table.add_row("text", f"{text}, sha256 {result.corpus_sha256[:16]}")
    table.add_row("chunks", f"{result.chunks} × {result.ctx} tokens")
    table.add_row("KV cache", f"{result.cache_type_k}/{result.cache_type_v}")
    table.add_row("PPL", _pm(result.ppl, result.ppl_error, ".4f"))
    table.add_row("mean KLD", _pm(result.kld_mean, result.kld_mean_error, ".6f"))
    table.add_row("99th pct KLD", "—" if result.kld_p99 is None else f"{result.kld_p99:.6f}")
    table.add_row("same top token", _pm(result.same_top_pct, result.same_top_pct_error, ".3f", " %"))
    source = "cache" if result.from_cache else f"llama.cpp {result.engine_commit}"
    table.add_row("measured", f"{result.elapsed_s:.2f} s ({source})")
    out.print(table)
