"""`moe-tune shape-model`: write a shape-true GGUF (real header, sparse data) to plan or test at real scale."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.app import JsonFlag, app, facts_table, friendly, out
from tuner.core.errors import UsageError
from tuner.models import recipes, shape_model


@app.command("shape-model")
@friendly
def shape_model_cmd(
    target: Annotated[str | None, typer.Argument(
        help="Catalog model and recipe (qwen3-30b-a3b:Q4_K_M), or a .gguf file / Hub header stand-in to copy.")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", "-o", help="Where to write the shape file.")] = None,
    list_known: Annotated[bool, typer.Option("--list", help="List the models and recipes it can write.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Write a GGUF with a real model's tensor names, shapes and types whose data is a sparse hole.

    Gigabytes logical, megabytes on disk: `moe-tune plan` and llama-fit-params read it like the real file.

    Example: moe-tune shape-model qwen3-30b-a3b:Q4_K_M --out qwen3-30b-q4km.gguf
    """
    if list_known or target is None:
        out.print(f"models: {', '.join(shape_model.known_models())}", highlight=False, soft_wrap=True)
        out.print(f"recipes: {', '.join(recipes.recipe_names())}", highlight=False)
        if target is None and not list_known:
            raise UsageError("give a model, e.g. `moe-tune shape-model qwen3-30b-a3b:Q4_K_M --out x.gguf`")
        return
    if out_path is None:
        raise UsageError("pass --out PATH.gguf for the shape file")
    t0 = time.perf_counter()
    src = Path(target).expanduser()
    if src.suffix == ".gguf" or src.is_file():
        if not src.is_file():
            raise UsageError(f"{src} not found: pass an existing .gguf or a catalog name like qwen3-30b-a3b:Q4_K_M")
        made = shape_model.copy_header(src, out_path)
    else:
        made = shape_model.write_catalog_model(target, out_path)
    took_s = time.perf_counter() - t0
    assumed = list(made.spec.assumed) if made.spec else []
    if as_json:
        out.print_json(json.dumps({
            "path": str(made.path), "model": made.spec.name if made.spec else str(src), "recipe": made.recipe,
            "logical_bytes": made.logical_bytes, "disk_bytes": made.disk_bytes, "n_tensors": made.n_tensors,
            "seconds": round(took_s, 3), "assumed": assumed,
        }))
        return
    table = facts_table()
    table.add_row("file", str(made.path))
    table.add_row("model", f"{made.spec.name} ({made.spec.arch}) {made.recipe}" if made.spec else f"header of {src}")
    table.add_row("logical size", f"{made.logical_bytes / 2**30:,.2f} GiB")
    table.add_row("on disk", f"{made.disk_bytes / 1e6:,.1f} MB")
    table.add_row("written in", f"{took_s:.2f} s")
    if assumed:
        table.add_row("assumed", ", ".join(assumed) + " (not in the catalog; see tuner/models/shape_model.py)")
    out.print(table)
