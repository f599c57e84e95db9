"""`moe-tune mcp`: the MCP server (stdio) for agents, a thin door to :mod:`tuner.mcp_server`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.app import LlamaDir, app, friendly


@app.command("mcp", short_help="MCP server (stdio): plan, quants, results, launch lines.")
@friendly
def mcp_cmd(
    results_dir: Annotated[Path, typer.Option(
        "--results-dir", help="Where the results tool looks (auto-tune's --results-dir).")] = Path("results"),
    llama_cpp_dir: LlamaDir = None,
) -> None:
    """Serve moe-tune's answers to an agent over MCP (stdio): plan, quants, results (with each line's verdicts
    and whether it still holds) and launch_line. Nothing is measured; the client starts and stops it.

    \b
    Example (a client's MCP configuration):
      {"mcpServers": {"moe-tune": {"command": "moe-tune", "args": ["mcp"]}}}
    """
    from tuner.mcp_server.server import run_stdio  # the SDK loads only for this command

    run_stdio(results_dir.absolute(), llama_cpp_dir)
