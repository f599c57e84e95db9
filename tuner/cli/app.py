"""Shared pieces of the command line: the typer app, consoles, option types and the error wrapper."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tuner import __version__
from tuner.core.config import CacheType, FlashAttn
from tuner.core.errors import TunerError, UsageError
from tuner.engine.identity import PIN

# Help is typer's plain renderer (rich_markup_mode=None), not its rich panels: in typer 0.29 the panel renderer
# (rich_utils._print_options_panel) prints every option's type, `<bool>` beside each flag included, where the plain
# one (TyperOption.get_help_record) skips flags; and the panels squeeze six columns into the terminal, cutting
# option names with "…" and folding help into a narrow last column at 80 columns, where the plain renderer wraps
# each option's help beside it. Commands give a short_help so the command list is never cut with "..." either.
app = typer.Typer(
    name="moe-tune",
    help="Find the fastest llama.cpp settings for a Mixture-of-Experts model on your GPU, measured for real.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
engine_app = typer.Typer(help="Install, locate and inspect the llama.cpp engine.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(engine_app, name="engine")

# No markup and no :emoji: codes by default: model names, repo ids and error messages are user text and print
# literally (`a:b:c` stays `a:b:c`). Styled words are built as rich Text.
out = Console(markup=False, emoji=False)
err = Console(stderr=True, markup=False, emoji=False)

F = TypeVar("F", bound=Callable[..., Any])

LlamaDir = Annotated[
    Path | None,
    typer.Option("--llama-cpp-dir", help="Folder with llama.cpp binaries (overrides LLAMA_CPP_DIR and PATH)."),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]

# llama-server's own settings, declared once for every command that takes them (llama.cpp's spelling).
CacheTypeK = Annotated[CacheType | None, typer.Option("-ctk", "--cache-type-k", help="KV cache type of K.")]
CacheTypeV = Annotated[CacheType | None, typer.Option("-ctv", "--cache-type-v", help="KV cache type of V.")]
FlashAttnOpt = Annotated[FlashAttn | None, typer.Option("-fa", "--flash-attn", help="Flash attention: on, off, auto.")]
UbatchOpt = Annotated[int | None, typer.Option("-ub", "--ubatch-size", help="Physical batch size.")]
# Every measuring command (auto-tune, bench, compare-quants) waits for a quiet machine: see measuring().
AllowBusy = Annotated[bool, typer.Option(
    "--allow-busy", help="Measure even while other programs (a llama.cpp process, CPU or GPU load) are busy "
    "here: what was seen is reported and disturbed rounds decide no verdict. Another moe-tune run is still waited "
    "for (--busy-wait): it holds the machine's lock.")]
BusyWait = Annotated[str, typer.Option(
    "--busy-wait", help="How long to wait for a busy machine before giving up, e.g. 10m, 30s, 0.")]
DeviceOpt = Annotated[str | None, typer.Option(
    "-dev", "--device", metavar="none", help="llama.cpp's -dev: `none` measures the CPU on purpose (the GPU "
    "is left out and its load is no reason to wait). Default: the GPU NVML lists, checked to be really used.")]


def device_choice(device: str | None) -> str | None:
    """``--device`` as the configs carry it: ``none`` (the CPU on purpose) or a llama.cpp device name."""
    if device is None:
        return None
    value = device.strip()
    if not value or value.lower() == "auto":
        return None
    if value.lower() == "none":
        return "none"
    if not all(part.strip() for part in value.split(",")):
        raise UsageError(f"--device {device!r} is not a device list: use none, or names such as CUDA0")
    return value


def say_fitted(console: Console, text: str, seen: set[str] | None = None) -> None:
    """``text`` to fit the console's width (COLUMNS): prose wrapped, each launch line and path whole on a line of its
    own (:func:`tuner.report.terminal.fitted`); with ``seen``, a launch line already shown through it is not again."""
    from tuner.report import terminal

    for line in terminal.fitted(text, console.width, seen):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


@contextlib.contextmanager
def measuring(command: str, *, allow_busy: bool, busy_wait: str, quiet_output: bool = False,
              device: str | None = None) -> Iterator[str | None]:
    """Hold the machine for a measuring command (see :mod:`tuner.machine.quiet`); yields what was busy when
    ``--allow-busy`` went ahead anyway (None: quiet). Waiting shows one live line in a terminal, and one line
    when it starts and one when it ends otherwise (a log file keeps the trace); Ctrl-C ends it (exit 130).
    Nothing of the engine runs before the machine is held: the caller does its engine work inside."""
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from tuner.engine import runner
    from tuner.machine import processes, quiet
    from tuner.search.study import parse_duration  # optuna loads only for the commands that measure

    wait_s = parse_duration(busy_wait)
    for left in processes.left_by_earlier_runs():
        say_fitted(err, f"warning: {left.describe()} is still running: stop it with `kill {left.pid}`")
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=err, transient=True,
                  disable=quiet_output) as bar:
        task = bar.add_task("checking that the machine is quiet", total=None)

        waited: list[str] = []  # what the wait was for, once it started (plain lines when not a terminal)

        def on_wait(what: str, waited_s: float) -> None:
            bar.update(task, description=f"{escape(what)} ({waited_s:.0f} s of {wait_s:.0f} s; Ctrl-C to stop)")
            if not waited and not err.is_terminal and not quiet_output:
                say_fitted(err, f"{what} (up to {wait_s:.0f} s)")
            waited[:] = [what]

        started = time.monotonic()
        with quiet.claim_machine(command, allow_busy=allow_busy, wait_s=wait_s, own=runner.own_pids,
                                 on_wait=on_wait, gpu=device != "none") as claim:
            bar.stop()
            if claim.note:  # the machine's lock could not be used: said even under --json (stderr)
                say_fitted(err, f"warning: {claim.note}")
            if waited and not err.is_terminal and not quiet_output:
                err.print(f"the machine is ours after {time.monotonic() - started:.0f} s", highlight=False)
            if claim.noise and not quiet_output:
                say_fitted(err, f"warning: measuring on a busy machine: {claim.noise}")
            if (residents := claim.residents_line()) and not quiet_output:
                say_fitted(err, residents)
            yield claim.noise


def friendly(func: F) -> F:
    """Turn the tool's own errors into one line on stderr and exit 1; Ctrl-C into exit 130."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except TunerError as exc:
            if os.environ.get("MOE_TUNE_DEBUG"):
                raise
            err.print(Text.assemble(("error:", "bold red"), f" {exc}"), highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted", highlight=False)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def usage_error(exc: Exception) -> int | None:
    """Print the command-line parser's complaint about ``exc`` on one line, with the command whose --help lists
    the valid options, and return the exit code (0 after the help a bare command shows, else 1); None when
    ``exc`` is not such a complaint. (Duck-typed: typer's parser errors carry
    ``format_message`` and exit code 2; nothing here imports the parser's internals.)"""
    if getattr(exc, "exit_code", None) != 2 or not hasattr(exc, "format_message"):
        return None
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", "") or "moe-tune"
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
        out.print(ctx.get_help(), highlight=False)
        return 0
    message = " ".join(str(exc.format_message()).split()).replace("Value error, ", "").rstrip(".")
    err.print(Text.assemble(("error:", "bold red"), f" {message}; see `{command} --help`"), highlight=False,
              soft_wrap=True)
    return 1


def model_path(name: str) -> Path:
    """A model argument as the user typed it: a .gguf path, or ``REPO[:QUANT]`` fetched from the Hub.

    The Hub client is imported only when a name is not a local file: it costs a noticeable share of start-up.
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path.absolute()  # the launch line must run from any directory
    from tuner.hub.resolve import resolve_model

    return resolve_model(name).path


def facts_table() -> Table:
    """Two columns, label and value; values fold instead of being cut, so paths stay copyable."""
    table = Table(show_header=False, box=None)
    table.add_column("what", no_wrap=True)
    table.add_column("value", overflow="fold")
    return table


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.1f} MiB"


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"moe-tune {__version__} (llama.cpp {PIN.commit})", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """moe-tune: measured llama.cpp settings for MoE models on one consumer GPU."""
