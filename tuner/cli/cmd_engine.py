"""`moe-tune engine install | path | info`."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Annotated

import typer

from tuner.cli.app import JsonFlag, LlamaDir, engine_app, err, facts_table, friendly, out
from tuner.engine.caps import Backend, CudaSource


@engine_app.command("install", short_help="Build the pinned llama.cpp engine, or ik_llama.cpp (once).")
@friendly
def engine_install(
    engine: Annotated[str, typer.Option(
        "--engine", help="Which engine: llama.cpp (the pinned one every command needs) or ik (ik_llama.cpp, the "
        "fork with its own MoE levers, built from the ik-llama-cpp-python sdist; auto-tune then searches both and "
        "decides between them on your workload).")] = "llama.cpp",
    backend: Annotated[Backend, typer.Option(
        help="auto: CUDA when an NVIDIA GPU is here and a toolkit can build for it (nvcc on PATH, in "
        "CUDA_HOME/CUDA_PATH, /usr/local/cuda or /opt/cuda; else NVIDIA's wheels, see --cuda-from).")]
    = Backend.AUTO,
    cuda_from: Annotated[CudaSource | None, typer.Option(
        "--cuda-from", help="Where a CUDA build's toolkit comes from: auto (an installed one, else NVIDIA's CUDA 13 "
        "wheels from the package index, ~900 MiB, for a machine with only the driver), installed, or wheels (even "
        "where a toolkit is installed). Default: MOE_TUNE_CUDA_FROM, else auto.")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a matching build exists.")] = False,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Parallel compile jobs (default: all cores).")]
    = None,
) -> None:
    """Build the pinned llama.cpp tools into the per-user cache (a no-op once built); with --engine ik,
    ik_llama.cpp beside it. Without a GPU here to read the card's CUDA architecture from, name it:
    MOE_TUNE_CUDA_ARCHS=86 (8.6, an RTX 3090).

    \b
    Example:
      moe-tune engine install --backend cpu
      moe-tune engine install --engine ik
      MOE_TUNE_CUDA_ARCHS=86 moe-tune engine install --backend cuda
      moe-tune engine install --backend cuda --cuda-from wheels  # driver only
    """
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from tuner.engine import build, cuda_wheels
    from tuner.engine.kinds import kind_named

    kind = kind_named(engine)
    if cuda_from is not None:
        os.environ[cuda_wheels.ENV] = cuda_from.value  # the one knob the library reads (as MOE_TUNE_CUDA_ARCHS)
    start = time.monotonic()
    chosen, why = build.backend_choice(backend)
    err.print(f"backend: {chosen.value} ({why})", highlight=False, soft_wrap=True)
    with Progress(
        SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
        TimeElapsedColumn(), console=err, transient=True,
    ) as progress:
        task = progress.add_task(kind.name, total=None, step="")

        def on_phase(name: str) -> None:
            elapsed = time.monotonic() - start
            err.print(f"[{elapsed:6.1f}s] {name}", highlight=False)
            progress.update(task, description=name, step="")

        def on_progress(done: int, total: int) -> None:
            progress.update(task, total=total, completed=done, step=f"{done}/{total}")

        result = build.install(backend, kind=kind, force=force, jobs=jobs, on_phase=on_phase,
                               on_progress=on_progress)
    if result.built:
        err.print(f"built {result.backend.value} {kind.name} in {result.elapsed_s:.0f} s", highlight=False)
    else:
        err.print(f"{result.backend.value} {kind.name} already built ({kind.pin.package} {kind.pin.version})",
                  highlight=False)
    out.print(str(result.bin_dir), highlight=False, soft_wrap=True)


@engine_app.command("path", short_help="Print the folder of the binaries every command uses.")
@friendly
def engine_path(llama_cpp_dir: LlamaDir = None) -> None:
    """Print the folder holding the llama.cpp binaries that every command will use.

    \b
    Example:
      ls "$(moe-tune engine path)"
    """
    from tuner.engine import build

    out.print(str(build.locate_engine(llama_cpp_dir).bin_dir), highlight=False, soft_wrap=True)


@engine_app.command("info", short_help="Version, commit, backend, devices and flags.")
@friendly
def engine_info(llama_cpp_dir: LlamaDir = None, as_json: JsonFlag = False) -> None:
    """Version, commit, backend, devices and supported flags of the engine.

    \b
    Example:
      moe-tune engine info --json
    """
    from tuner.engine import build

    loc = build.locate_engine(llama_cpp_dir)
    caps = build.capabilities(loc)
    others = [x for x in build.engines_found(llama_cpp_dir) if x != loc]
    info = {
        "path": str(loc.bin_dir), "source": loc.source, "engine": caps.kind.name,
        "pinned_commit": caps.kind.pin.commit, **asdict(caps), "build": build.build_info(loc.bin_dir),
        "other_engines": [{"path": str(x.bin_dir), "source": x.source, "engine": build.capabilities(x).kind.name,
                           **asdict(build.capabilities(x)), "build": build.build_info(x.bin_dir)} for x in others],
    }
    if as_json:
        out.print_json(json.dumps(info))
        return
    for where, c in [(loc, caps), *((x, build.capabilities(x)) for x in others)]:
        table = facts_table()
        table.add_row("engine", c.kind.name)
        table.add_row("path", f"{where.bin_dir} ({where.source})")
        table.add_row("version", f"build {c.build_number}, commit {c.commit} (pinned {c.kind.pin.commit})")
        table.add_row("backend", c.backend)
        table.add_row("devices", "\n".join(c.devices) or "CPU only")
        for tool, tool_flags in c.flags.items():
            table.add_row(tool, f"{len(tool_flags)} flags")
        out.print(table)
