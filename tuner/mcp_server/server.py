"""The MCP server: four read-only tools over :mod:`tuner.mcp_server.answers`, spoken over stdio with the official
MCP Python SDK. The tool's own errors (each names its fix) reach the agent as the tool's error text."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from tuner import __version__
from tuner.core.errors import TunerError
from tuner.mcp_server import answers

INSTRUCTIONS = (
    "moe-tune answers what fits and what was measured for llama.cpp Mixture-of-Experts models, without measuring: "
    "`plan` sizes a model for a card, `quants` lists a Hugging Face repo's quants with fit, `results` lists the "
    "tuned results on this machine (their launch lines, verdicts, and whether each still holds), `launch_line` "
    "renders a result's measured line for a shell, llama-swap, systemd, docker compose or JSON. Measuring (an "
    "auto-tune) is the user's to start: `moe-tune auto-tune MODEL`."
)
READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True)
F = TypeVar("F", bound=Callable[..., Any])


def _tool_errors(fn: F) -> F:
    """The tool's own errors as the agent's error text (the SDK hides the text of any other exception)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TunerError as exc:
            raise ToolError(str(exc)) from exc

    return wrapper  # type: ignore[return-value]


def build_server(results_dir: Path = Path("results"), llama_cpp_dir: Path | None = None) -> MCPServer:
    """The server with its tools; ``results_dir`` is where ``results`` looks (auto-tune's --results-dir)."""
    server: MCPServer = MCPServer("moe-tune", instructions=INSTRUCTIONS, version=__version__, log_level="WARNING")

    @server.tool(annotations=READ_ONLY)
    @_tool_errors
    def plan(
        model: Annotated[str, Field(description="GGUF path, owner/name:QUANT (header only, no download), or a catalog "
                                    "shape like qwen3-30b-a3b:Q4_K_M")],
        card: Annotated[str | None, Field(description="Plan for this card, e.g. 'RTX 4060 Ti 16GB'; default: this "
                                          "machine")] = None,
        context: Annotated[int | None, Field(description="Context in tokens, all slots together")] = None,
        ram_gib: Annotated[float | None, Field(description="Host RAM to plan for, in GiB; default: this "
                                               "machine's")] = None,
        host_bandwidth_gb_s: Annotated[float | None, Field(description="Host RAM bandwidth in GB/s for the speed "
                                                           "ceilings")] = None,
    ) -> dict[str, Any]:
        """VRAM and RAM needed, fit verdict and speed ceilings for every --n-cpu-moe (the figures of
        `moe-tune plan --json`); nothing is launched or downloaded."""
        return answers.plan(model, card, context, ram_gib, host_bandwidth_gb_s, llama_cpp_dir)

    @server.tool(annotations=READ_ONLY)
    @_tool_errors
    def quants(
        repo: Annotated[str, Field(description="Hugging Face repo, owner/name (optionally :QUANT for its header)")],
        card: Annotated[str | None, Field(description="Judge the fit for this card; default: this machine")] = None,
        context: Annotated[int, Field(description="Context in tokens the fit verdict is for")] = 8192,
    ) -> dict[str, Any]:
        """Every quant in a Hugging Face repo with its size, parts and fit verdict; the architecture from one
        quant's GGUF header (range requests, no tensor data downloaded)."""
        return answers.quants(repo, card, context)

    @server.tool(annotations=READ_ONLY)
    @_tool_errors
    def results() -> dict[str, Any]:
        """The auto-tune results on this machine, newest first: each one's measured launch line, why it was chosen,
        its verdicts, and whether it still holds here (same engine, card, free VRAM, model file)."""
        return answers.results(results_dir, llama_cpp_dir)

    @server.tool(annotations=READ_ONLY)
    @_tool_errors
    def launch_line(
        result: Annotated[str, Field(description="A result.json (or its folder), as `results` lists them")],
        format: Annotated[str, Field(description="shell, llama-swap, systemd, compose, preset or json")] = "shell",
        rank: Annotated[int, Field(description="1 = the line the run printed (after a race across engines, the "
                                   "race's, from either engine's result), 2 = the next one handed out, ...")] = 1,
        host: Annotated[str | None, Field(description="Address the server listens on")] = None,
        port: Annotated[int | None, Field(description="Port the server listens on")] = None,
    ) -> str:
        """A result's measured llama-server line in a deployment format, as `moe-tune launch-line` prints it; what a
        format cannot carry is written into it. A line its quality price refused is never given: the error says
        why."""
        return answers.launch_line(result, format, rank, host, port, llama_cpp_dir)

    return server


def run_stdio(results_dir: Path = Path("results"), llama_cpp_dir: Path | None = None) -> None:
    """Serve the tools over stdin/stdout until the client closes the stream."""
    build_server(results_dir, llama_cpp_dir).run("stdio")
