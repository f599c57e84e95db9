"""`moe-tune demo-model`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.app import LlamaDir, app, err, friendly, mib, out
from tuner.engine import build
from tuner.models import demo


@app.command("demo-model", short_help="Write synthetic MoE models the real llama.cpp loads.")
@friendly
def demo_model_cmd(
    arch: Annotated[str, typer.Option(help="qwen3moe, or qwen35moe (hybrid delta-net + attention).")]
    = demo.DEFAULT_ARCH,
    quant: Annotated[str, typer.Option(help="Comma list of quantized variants to make, e.g. Q8_0,Q4_K_M.")] = "",
    size: Annotated[str, typer.Option(help="tiny (~16 M params, tests) or large (>= 500 MB, CPU benchmarks).")]
    = demo.DEFAULT_SIZE,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed writes the same file.")] = 0,
    out_path: Annotated[Path | None, typer.Option("--out", help="Folder, or the F16 file's path (*.gguf).")]
    = None,
    force: Annotated[bool, typer.Option(help="Write files again even if they exist.")] = False,
    llama_cpp_dir: LlamaDir = None,
) -> None:
    """Write a synthetic random-weight MoE model that the real llama.cpp loads, plus quantized variants.

    Prints the path of every file.

    \b
    Example:
      moe-tune demo-model --arch qwen35moe --quant Q8_0,Q4_K_M
    """
    quants = demo.parse_quants(quant)
    loc = build.locate_engine(llama_cpp_dir) if [q for q in quants if q != "F16"] else None
    files = demo.make_demo_models(
        arch=arch, size=size, quants=quants, seed=seed, out=out_path, engine=loc, force=force,
        on_step=lambda msg: err.print(msg, highlight=False),
    )
    for f in files:
        err.print(f"{f.quant:8} {mib(f.size_bytes):>12}  {'written' if f.created else 'exists'}", highlight=False)
        out.print(str(f.path), highlight=False, soft_wrap=True)
