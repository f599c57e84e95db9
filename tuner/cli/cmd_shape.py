"""`moe-tune shape-model`: write a shape-true GGUF (real header, sparse data) to plan or test at real scale."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tuner.cli.app import JsonFlag, LlamaDir, app, facts_table, friendly, out
from tuner.core.errors import DiskSpaceError, UsageError

if TYPE_CHECKING:
    from tuner.models import shape_model



@app.command("shape-model", short_help="Write a GGUF shaped like a real model.")
@friendly
def shape_model_cmd(
    target: Annotated[str | None, typer.Argument(
        help="Catalog model and recipe (qwen3-30b-a3b:Q4_K_M), or a .gguf file / Hub header stand-in to copy.")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", "-o", help="Where to write the shape file.")] = None,
    weights: Annotated[str, typer.Option(
        help="zero: a sparse hole (megabytes on disk); random: valid weights of each tensor's type, written at "
             "full size, blocks from the engine's llama-quantize (needs it once per type); direct: valid weights "
             "whose blocks are drawn here (no engine), with a router that spreads a batch over the experts "
             "through every layer.")] = "zero",
    seed: Annotated[int, typer.Option(help="Random seed for --weights random or direct; the same seed writes the "
                                           "same file.")] = 0,
    list_known: Annotated[bool, typer.Option("--list", help="List the models and recipes it can write.")] = False,
    llama_cpp_dir: LlamaDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Write a GGUF with a real model's tensor names, shapes and types; its data a sparse hole or valid weights.

    Zero weights: gigabytes logical, megabytes on disk; `moe-tune plan` and llama-fit-params read it like the
    real file, but the router ties (every token takes the same experts): for memory figures only. Direct
    weights: the real size on disk; llama.cpp runs it at real speed, a batch's tokens spread over the experts
    in every layer. Random weights generate as fast, but their tokens collapse onto a few experts past the
    first layer.

    \b
    Example:
      moe-tune shape-model olmoe-1b-7b:Q4_K_M --weights direct \\
        --out olmoe-q4km.gguf
    """
    from tuner.engine import build
    from tuner.models import gguf_writer, recipes, shape_model

    if list_known or target is None:
        out.print(f"models: {', '.join(shape_model.known_models())}", highlight=False, soft_wrap=True)
        out.print(f"recipes: {', '.join(recipes.recipe_names())}", highlight=False)
        if target is None and not list_known:
            raise UsageError("give a model, e.g. `moe-tune shape-model qwen3-30b-a3b:Q4_K_M --out x.gguf`")
        return
    if out_path is None:
        raise UsageError("pass --out PATH.gguf for the shape file")
    weights = gguf_writer.check_weights(weights)
    t0 = time.perf_counter()
    src = Path(target).expanduser()
    if src.suffix == ".gguf" or src.is_file():
        if not src.is_file():
            raise UsageError(f"{src} not found: pass an existing .gguf or a catalog name like qwen3-30b-a3b:Q4_K_M")
        if weights != "zero":
            raise UsageError(f"--weights {weights} needs a catalog name like qwen3-30b-a3b:Q4_K_M, not a header copy")
        made = shape_model.copy_header(src, out_path)
    else:
        spec, recipe = shape_model.resolve_target(target)
        loc = build.locate_engine(llama_cpp_dir) if weights == "random" else None
        if weights != "zero":
            _check_disk(out_path, shape_model.logical_bytes(spec, recipe))
        made = shape_model.write_shape_model(spec, recipe, out_path, weights=weights, seed=seed, engine=loc)
    took_s = time.perf_counter() - t0
    assumed = list(made.spec.assumed) if made.spec else []
    if as_json:
        out.print_json(json.dumps({
            "path": str(made.path), "model": made.spec.name if made.spec else str(src), "recipe": made.recipe,
            "logical_bytes": made.logical_bytes, "disk_bytes": made.disk_bytes, "n_tensors": made.n_tensors,
            "seconds": round(took_s, 3), "assumed": assumed, "weights": made.weights,
            "times_s": _times(made),
        }))
        return
    table = facts_table()
    table.add_row("file", str(made.path))
    table.add_row("model", f"{made.spec.name} ({made.spec.arch}) {made.recipe}" if made.spec else f"header of {src}")
    table.add_row("logical size", f"{made.logical_bytes / 2**30:,.2f} GiB")
    table.add_row("on disk", f"{made.disk_bytes / 1e6:,.1f} MB")
    table.add_row("weights", made.weights)
    times = _times(made)
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in times.items() if k != "total")
    split = f" ({parts})" if made.weights != "zero" else ""
    table.add_row("written in", f"{took_s:.2f} s{split}")
    if assumed:
        table.add_row("assumed", ", ".join(assumed) + " (not in the catalog; see tuner/models/shape_model.py)")
    out.print(table)


def _times(made: shape_model.ShapeFile) -> dict[str, float]:
    t = made.times
    if t is None:
        return {}
    return {"header": round(t.header_s, 2), "generate": round(t.generate_s, 2), "write": round(t.write_s, 2),
            "fsync": round(t.sync_s, 2), "total": round(t.total_s, 2)}


def _check_disk(out_path: Path, need_bytes: int) -> None:
    folder = out_path.expanduser().resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need_bytes + 2**30:  # keep a GiB spare
        raise DiskSpaceError(folder, need_bytes + 2**30, free)
