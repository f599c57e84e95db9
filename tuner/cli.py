"""The `moe-tune` command: a thin typer layer over the library. The only module that imports typer."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tuner import __version__, bench, demo, doctor, engine, flags
from tuner.config import CacheType, FlashAttn, LaunchConfig
from tuner.errors import TunerError

app = typer.Typer(
    name="moe-tune",
    help="Find the fastest llama.cpp settings for a Mixture-of-Experts model on your GPU, measured for real.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
engine_app = typer.Typer(help="Install, locate and inspect the llama.cpp engine.", no_args_is_help=True)
app.add_typer(engine_app, name="engine")

out = Console()
err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

LlamaDir = Annotated[
    Path | None,
    typer.Option("--llama-cpp-dir", help="Folder with llama.cpp binaries (overrides LLAMA_CPP_DIR and PATH)."),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


def friendly(func: F) -> F:
    """Turn the tool's own errors into one line on stderr and exit 1; Ctrl-C into exit 130."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except TunerError as exc:
            if os.environ.get("MOE_TUNE_DEBUG"):
                raise
            err.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted", highlight=False)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _facts_table() -> Table:
    """Two columns, label and value; values fold instead of being cut, so paths stay copyable."""
    table = Table(show_header=False, box=None)
    table.add_column("what", no_wrap=True)
    table.add_column("value", overflow="fold")
    return table


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.1f} MiB"


# ------------------------------------------------------------------------------------------------- engine


@engine_app.command("install")
@friendly
def engine_install(
    backend: Annotated[engine.Backend, typer.Option(help="auto: CUDA when nvcc and an NVIDIA GPU are present.")]
    = engine.Backend.AUTO,
    force: Annotated[bool, typer.Option(help="Rebuild even if a matching build exists.")] = False,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Parallel compile jobs (default: all cores).")]
    = None,
) -> None:
    """Build the pinned llama.cpp tools into the per-user cache (a no-op once built).

    Example: moe-tune engine install --backend cpu
    """
    start = time.monotonic()
    with Progress(
        SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
        TimeElapsedColumn(), console=err, transient=True,
    ) as progress:
        task = progress.add_task("llama.cpp", total=None, step="")

        def on_phase(name: str) -> None:
            elapsed = time.monotonic() - start
            err.print(f"[{elapsed:6.1f}s] {name}", highlight=False)
            progress.update(task, description=name, step="")

        def on_progress(done: int, total: int) -> None:
            progress.update(task, total=total, completed=done, step=f"{done}/{total}")

        result = engine.install(backend, force=force, jobs=jobs, on_phase=on_phase, on_progress=on_progress)
    if result.built:
        err.print(f"built {result.backend.value} engine in {result.elapsed_s:.0f} s", highlight=False)
    else:
        err.print(f"{result.backend.value} engine already built (llama.cpp {engine.PIN.commit})", highlight=False)
    out.print(str(result.bin_dir), highlight=False, soft_wrap=True)


@engine_app.command("path")
@friendly
def engine_path(llama_cpp_dir: LlamaDir = None) -> None:
    """Print the folder holding the llama.cpp binaries that every command will use.

    Example: ls "$(moe-tune engine path)"
    """
    out.print(str(engine.locate_engine(llama_cpp_dir).bin_dir), highlight=False, soft_wrap=True)


@engine_app.command("info")
@friendly
def engine_info(llama_cpp_dir: LlamaDir = None, as_json: JsonFlag = False) -> None:
    """Version, commit, backend, devices and supported flags of the engine.

    Example: moe-tune engine info --json
    """
    loc = engine.locate_engine(llama_cpp_dir)
    caps = engine.capabilities(loc)
    info = {
        "path": str(loc.bin_dir), "source": loc.source, "pinned_commit": engine.PIN.commit,
        **asdict(caps), "build": engine.build_info(loc.bin_dir),
    }
    if as_json:
        out.print_json(json.dumps(info))
        return
    table = _facts_table()
    table.add_row("path", f"{loc.bin_dir} ({loc.source})")
    table.add_row("version", f"build {caps.build_number}, commit {caps.commit} (pinned {engine.PIN.commit})")
    table.add_row("backend", caps.backend)
    table.add_row("devices", "\n".join(caps.devices) or "CPU only")
    for tool, tool_flags in caps.flags.items():
        table.add_row(tool, f"{len(tool_flags)} flags")
    out.print(table)


# ------------------------------------------------------------------------------------------------- doctor


@app.command("doctor")
@friendly
def doctor_cmd(llama_cpp_dir: LlamaDir = None, as_json: JsonFlag = False) -> None:
    """Check the engine, GPU, memory and disk; print each problem with its fix. Exit 0 when tuning can run.

    Example: moe-tune doctor --json
    """
    report = doctor.diagnose(llama_cpp_dir)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        table = _facts_table()
        eng = report.engine
        if eng.get("path"):
            table.add_row("engine", f"{eng['path']} ({eng['source']})")
            table.add_row("version", f"build {eng['build_number']}, commit {eng['commit']}, backend {eng['backend']}")
            table.add_row("flags", ", ".join(f"{t}: {len(f)}" for t, f in eng["flags"].items()))
        else:
            table.add_row("engine", "[red]not found[/]")
        if report.gpus:
            for gpu in report.gpus:
                table.add_row(
                    f"GPU {gpu['index']}",
                    f"{gpu['name']}: {_mib(gpu['total_bytes'])} total, {_mib(gpu['free_bytes'])} free, "
                    f"driver {gpu['driver_version']}",
                )
        else:
            table.add_row("GPU", report.gpu_note)
        host = report.host
        table.add_row("RAM", f"{_mib(host['ram_total_bytes'])} total, {_mib(host['ram_available_bytes'])} available")
        table.add_row("swap", f"{_mib(host['swap_total_bytes'])} total, {_mib(host['swap_used_bytes'])} used")
        table.add_row("cores", f"{host['physical_cores']} physical, {host['logical_cores']} logical")
        for name, disk in report.disk.items():
            table.add_row(f"disk ({name})", f"{_mib(disk['free_bytes'])} free at {disk['path']}")
        out.print(table)
        for problem in report.problems:
            style = "red" if problem.fatal else "yellow"
            out.print(f"[{style}]problem:[/] {problem.what}\n  fix: {problem.fix}", highlight=False)
        if not report.problems:
            out.print("[green]no problems found[/]")
    if not report.ok:
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------- demo model


@app.command("demo-model")
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

    Prints the path of every file. Example: moe-tune demo-model --arch qwen35moe --quant Q8_0,Q4_K_M
    """
    quants = demo.parse_quants(quant)
    loc = engine.locate_engine(llama_cpp_dir) if [q for q in quants if q != "F16"] else None
    files = demo.make_demo_models(
        arch=arch, size=size, quants=quants, seed=seed, out=out_path, engine=loc, force=force,
        on_step=lambda msg: err.print(msg, highlight=False),
    )
    for f in files:
        err.print(f"{f.quant:8} {_mib(f.size_bytes):>12}  {'written' if f.created else 'exists'}", highlight=False)
        out.print(str(f.path), highlight=False, soft_wrap=True)


# -------------------------------------------------------------------------------------------------- bench


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


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"moe-tune {__version__} (llama.cpp {engine.PIN.commit})", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """moe-tune: measured llama.cpp settings for MoE models on one consumer GPU."""


def main() -> None:
    app()
    sys.exit(0)


if __name__ == "__main__":
    main()
