"""`moe-tune bench`: one config measured with llama-bench."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tuner import bench, demo, engine, flags
from tuner.cli.app import JsonFlag, LlamaDir, app, err, friendly, out
from tuner.config import CacheType, FlashAttn, LaunchConfig
from tuner.errors import TunerError


@app.command("bench")
@friendly
def bench_cmd(
    model: Annotated[Path | None, typer.Argument(help="GGUF file; default: the embedded demo model.")] = None,
    n_prompt: Annotated[int, typer.Option("-p", "--n-prompt", help="Prompt tokens per test.")] = 512,
    n_gen: Annotated[int, typer.Option("-n", "--n-gen", help="Generated tokens per test.")] = 128,
    repetitions: Annotated[int, typer.Option("-r", "--repetitions", help="Repetitions per test.")] = 3,
    depth: Annotated[int, typer.Option("-d", "--depth", help="Context already filled before measuring.")] = 0,
    n_cpu_moe: Annotated[int | None, typer.Option("--n-cpu-moe", help="Layers whose experts stay in RAM.")] = None,
    cache_type_k: Annotated[CacheType, typer.Option("-ctk", "--cache-type-k")] = CacheType.F16,
    cache_type_v: Annotated[CacheType, typer.Option("-ctv", "--cache-type-v")] = CacheType.F16,
    flash_attn: Annotated[FlashAttn, typer.Option("-fa", "--flash-attn")] = FlashAttn.AUTO,
    threads: Annotated[int | None, typer.Option("-t", "--threads")] = None,
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Measure prompt and generation tok/s of one config with llama-bench.

    Example: moe-tune bench model.gguf -p 512 -n 128 -ctk q8_0 -ctv q8_0 -fa on
    """
    loc = engine.locate_engine(llama_cpp_dir)
    if model is None:
        model = demo.default_model(loc, on_step=lambda msg: err.print(msg, highlight=False))
    elif not model.is_file():
        raise TunerError(f"model file {model} not found: check the path")
    cfg = LaunchConfig(
        model=model, n_cpu_moe=n_cpu_moe, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
        flash_attn=flash_attn, threads=threads,
    )
    with err.status(f"llama-bench on {model.name} ({repetitions} repetitions)"):
        result = bench.run_bench(loc, cfg, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions, depth=depth)
    if as_json:
        out.print_json(json.dumps({
            "model": str(model), "argv": list(result.argv), "elapsed_s": result.elapsed_s,
            "launch_line": flags.launch_line(cfg), "rows": [asdict(r) for r in result.rows],
        }))
        return
    out.print(f"{model.name}  (llama-bench, llama.cpp {engine.PIN.commit})", highlight=False, soft_wrap=True)
    table = Table()
    for col in ("test", "depth", "tok/s", "± stddev"):
        table.add_column(col, justify="right")
    for row in result.rows:
        test = f"pp{row.n_prompt}" if row.kind == "pp" else f"tg{row.n_gen}"
        table.add_row(test, str(row.n_depth), f"{row.avg_tok_s:,.1f}", f"{row.stddev_tok_s:,.1f}")
    out.print(table)
    out.print(f"prompt {result.prompt_tok_s:,.1f} tok/s, generation {result.gen_tok_s:,.1f} tok/s", highlight=False)
    out.print(f"launch line: {flags.launch_line(cfg)}", highlight=False, soft_wrap=True)
