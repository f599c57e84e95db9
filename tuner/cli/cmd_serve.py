"""`moe-tune serve`: llama-server with a tuned result's measured line, in the foreground, checked to still hold."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tuner.cli.app import LlamaDir, app, err, friendly, out
from tuner.core.errors import UsageError
from tuner.engine import flags
from tuner.engine import serve as served

if TYPE_CHECKING:
    from tuner.report import line_check
    from tuner.search.result import StudyResult


# Where llama-server listens is serve's own choice (--host, --port): the same flags passed through would split it.
ADDRESS_FLAGS = ("--host", "--port")
ALIAS_FLAGS = ("-a", "--alias")  # llama-server's own spelling, passed through after --
KEY_FLAG = "--api-key"  # a key spelled on a command line: every local user reads /proc/PID/cmdline


def _found(target: str | None, results_dir: Path) -> line_check.Found:
    """A result folder or result.json as given; a model's newest result; or the newest result of all."""
    from tuner.report import line_check
    from tuner.search.result import RESULT_FILE

    if target is None:
        return line_check.latest(results_dir)
    path = Path(target).expanduser()
    if path.is_dir() or path.suffix == ".json":
        if path.is_dir() and not (path / RESULT_FILE).is_file():
            raise UsageError(f"{path} holds no {RESULT_FILE}: pass results/<study>/ from auto-tune, or a model")
        return line_check.found_at(path)
    if path.is_file():
        return line_check.latest(results_dir, path.absolute())
    from tuner.hub.repos import HubOptions
    from tuner.hub.resolve import resolve_model

    # serve runs what is on this machine: a Hub name is looked up in the local cache, never downloaded.
    return line_check.latest(results_dir, resolve_model(target, options=HubOptions(offline=True)).path)


def retune_command(result: StudyResult) -> str:
    """The auto-tune command that measures this result's line again, here and now (same workload and context)."""
    w = result.workload or {}
    sp = result.space or {}
    goal = result.objective or {}
    argv = ["moe-tune", "auto-tune", result.model or "MODEL"]
    if w.get("kind") and w["kind"] != "custom":
        argv += ["--workload", w["kind"]]
    if w.get("prompt_tokens"):
        argv += ["--n-prompt", str(w["prompt_tokens"])]
    if w.get("gen_tokens"):
        argv += ["--n-gen", str(w["gen_tokens"])]
    if w.get("depth_tokens") and w.get("depth_tokens") != w.get("prompt_tokens"):
        argv += ["--depth", str(w["depth_tokens"])]
    if goal.get("goal") == "context":
        argv += ["--goal", "context"]
    elif sp.get("ctx"):
        argv += ["--min-ctx", str(sp["ctx"])]
    if "max_kld" in goal and goal.get("max_kld") != goal.get("max_kld_default"):
        argv += ["--max-kld", "off" if goal["max_kld"] is None else f"{goal['max_kld']:g}"]
    if goal.get("pareto"):
        argv.append("--pareto")
    if goal.get("min_tok_s"):
        argv += ["--min-tok-s", f"{goal['min_tok_s']:g}"]
    if sp.get("device") == "none":
        argv += ["--device", "none"]
    return shlex.join(argv)


def _say(text: str) -> None:
    err.print(text, highlight=False, markup=False, soft_wrap=True)


def _key_in_argv() -> UsageError:
    return UsageError(f"a key on the command line is readable by every local user (/proc/PID/cmdline): "
                      f"{served.KEY_FIX}")


def _passed_through(extra: list[str], measured: list[str]) -> None:
    for flag in ADDRESS_FLAGS:
        if flag in extra:
            raise UsageError(f"{flag} after -- would move the server off the address serve waits on: use serve's "
                             f"own {flag}")
    if any(t == KEY_FLAG or t.startswith(f"{KEY_FLAG}=") for t in extra):
        raise _key_in_argv()
    overridden = sorted({t for t in extra if t.startswith("-") and t in measured})
    also = f" (overriding the measured {', '.join(overridden)})" if overridden else ""
    _say(f"not measured, passed through: {shlex.join(extra)}{also}")


@app.command("serve", short_help="Run llama-server with a tuned result's line, in the foreground.")
@friendly
def serve_cmd(
    target: Annotated[str | None, typer.Argument(
        metavar="[MODEL|RESULT]",
        help="A model (its newest result), a results/<study> folder or result.json; default: the newest result.",
        show_default=False)] = None,
    extra: Annotated[list[str] | None, typer.Argument(
        metavar="[-- FLAGS]", help="More llama-server flags after --, passed through (named as not measured).",
        show_default=False)] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port to listen on (default: a free one).")] = None,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on; any but loopback lets the network in (add --api-key-file, "
                 f"or export {served.API_KEY_ENV}).")]
    = "127.0.0.1",
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", metavar="FILE",
        help=f"File holding the key clients must send (Authorization: Bearer KEY); made with a new random key "
             f"(mode 600) when it does not exist. Or export {served.API_KEY_ENV}.", show_default=False)] = None,
    api_key_in_argv: Annotated[str | None, typer.Option("--api-key", hidden=True)] = None,
    alias: Annotated[str | None, typer.Option(
        "--alias", metavar="NAME", help="The model's name to clients (/v1/models, replies); default: the model "
        "file's name without .gguf.", show_default=False)] = None,
    rank: Annotated[int, typer.Option(
        "--rank", help="1 = the line the run printed (a race's, from either engine's folder), 2 = the next one "
        "handed out (as launch-line --rank counts), ...")] = 1,
    results_dir: Annotated[Path, typer.Option("--results-dir", help="Where auto-tune wrote its results.")]
    = Path("results"),
    force: Annotated[bool, typer.Option(
        "--force", help="Start even when the line no longer holds (engine, card, VRAM or model changed).")] = False,
    load_timeout: Annotated[float, typer.Option("--load-timeout", help="Seconds the model may take to load.")]
    = 600.0,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the line and print the llama-server command serve would start (before its address, "
        "key and log flags); start nothing.")] = False,
    llama_cpp_dir: LlamaDir = None,
) -> None:
    """Start llama-server with the measured line of a tuned result and keep it in the foreground: the line is
    checked first (same engine, same card with enough VRAM free, model file unchanged since the tune), the
    OpenAI-compatible base URL is printed once the model is loaded, and Ctrl-C or SIGTERM stops it (no process
    is left).

    \b
    Examples:
      moe-tune serve unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M
      moe-tune serve results/<study> --port 8080 --alias qwen3 -- --jinja
    On the network (clients send the key):
      moe-tune serve MODEL --host 0.0.0.0 --api-key-file ~/.moe-tune-key
    The key never goes on a command line (every local user reads those, so
    --api-key is refused): it comes from the file (yours alone: mode 600) or
    from LLAMA_API_KEY, and llama-server gets it by environment.
    After a race across engines, either engine's folder serves the line the
    race printed, on its engine's server.
    """
    from tuner.engine import build
    from tuner.machine import interrupt
    from tuner.report import handover, line_check

    if api_key_in_argv is not None:
        raise _key_in_argv()
    if target is not None and target.startswith("-"):  # `serve -- FLAGS` with no target
        extra, target = [target, *(extra or [])], None
    found = _found(target, results_dir)
    chosen = handover.of(found.result).at(rank)
    measured = line_check.measured_by(chosen, found)
    kind = chosen.kind
    loc = build.locate_engine(llama_cpp_dir, kind)
    argv = handover.argv(chosen, binary=str(loc.tool("llama-server")))
    checked = line_check.check(measured, chosen.config, chosen.label, line_check.probe_now(loc))
    _say(f"{chosen.label} of {measured.file}, on {build.capabilities(loc).identity.describe()} at {loc.bin_dir}")
    if checked.changes:
        changed = "; ".join(checked.changes)
        if not force:
            raise UsageError(f"the line may no longer hold: {changed}. Re-tune with `{retune_command(found.result)}`,"
                             " or add --force to start it as it is")
        _say(f"warning (--force): the line may no longer hold: {changed}")
    for note in checked.notes:
        _say(f"note: {note}")
    for what in checked.unchecked:
        _say(f"not checked: {what}")
    if extra:
        _passed_through(extra, argv)
    if dry_run:
        out.print(shlex.join([*(f"{k}={v}" for k, v in handover.env(chosen).items()), *argv]), highlight=False,
                  soft_wrap=True, markup=False)
        return
    served.check_host(host)
    key = served.api_key(os.environ, api_key_file)
    if key is None and not served.is_loopback(host):
        _say(f"warning: listening on {host} without a key (--api-key-file or {served.API_KEY_ENV}): anyone who "
             "can reach this machine can use the server")
    elif key is not None:
        _say(f"{'a new key was written to' if key.made else 'the key is in'} {key.where}: clients send "
             "`Authorization: Bearer KEY` (OpenAI clients: api_key=KEY)")
    named = None
    if not any(t in ALIAS_FLAGS or t.startswith("--alias=") for t in extra or []):  # one passed through wins
        named = served.alias_for(Path(chosen.config["model"]), alias)
        _say(f"served as model {named!r} (what /v1/models lists and clients send as model)")

    def ready(s: served.Served) -> None:
        _say(f"llama-server (pid {s.pid}) is ready on {s.host}:{s.port}; log: {s.log}; Ctrl-C stops it")
        out.print(f"OpenAI-compatible base URL: {s.base_url}", highlight=False, soft_wrap=True)

    with interrupt.sigterm_as_ctrl_c(), served.handed_to(kind, key, named) as (key_argv, handed):
        env = {**handover.env(chosen), **handed}
        try:
            served.run_foreground([*argv, *key_argv, *flags.file_log_argv(kind, measured.file.parent / "logs"),
                                   *(extra or [])], host=host, port=port,
                                  log_dir=measured.file.parent / "logs", env=env, load_timeout_s=load_timeout,
                                  on_ready=ready)
        except KeyboardInterrupt:
            interrupt.handled()  # stopping is what Ctrl-C asks of serve: the run ends well
            _say("llama-server stopped")
