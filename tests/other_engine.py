"""Another llama.cpp build, made cheaply: the pinned engine's own binaries behind shims whose ``--version`` reports
another commit (or none, as a build from a source without git data does). Everything else is the real binary: its
flags, its devices, its projections. What a user's own build looks like to moe-tune, without compiling one."""

from __future__ import annotations

import os
from pathlib import Path

from tuner.engine import build

SHIM = """#!/bin/sh
# {tool} of the pinned engine, reporting build {number}, commit {commit}
if [ "$1" = "--version" ]; then
    "{real}" --version 2>&1 | sed -e 's/build [0-9]*, commit [0-9a-fA-F]*/build {number}, commit {commit}/' >&2
    exit 0
fi
exec "{real}" "$@"
"""


def other_engine(real: build.EngineLocation, folder: Path, commit: str, number: str = "0") -> build.EngineLocation:
    """A folder of shims over ``real``'s tools that report ``commit`` (``unknown``: no commit at all)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in build.TOOLS:
        if real.has(tool):
            shim = folder / tool
            shim.write_text(SHIM.format(tool=tool, real=real.tool(tool), number=number, commit=commit))
            os.chmod(shim, 0o755)
    return build.EngineLocation(folder.resolve(), "option")
