"""Another llama.cpp build, made cheaply: the pinned engine's own binaries behind shims whose ``--version`` reports
another commit (or none, as a build from a source without git data does). Everything else is the real binary: its
flags, its devices, its projections. What a user's own build looks like to moe-tune, without compiling one.

``host_compute_mib`` makes it a build whose own projection reserves that much more host compute than the pin's (as
b11434's ``build_inp_embd`` reserves more, only more): its llama-fit-params is the real one, its memory record and
table with the host row's compute (and total) raised by that many MiB. Every other figure is the real projection."""

from __future__ import annotations

import os
import sys
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

# llama-fit-params of a build whose projection puts ``more`` MiB more compute on the host: the pinned tool's own
# output, its `fit_memory_breakdown` records and its `Host model context compute` line moved by that much.
MOVED_FIT_PARAMS = """#!{python}
# llama-fit-params of the pinned engine, reporting build {number}, commit {commit}, host compute +{more} MiB
import json, re, subprocess, sys

real, more = {real!r}, {more}
if sys.argv[1:2] == ["--version"]:
    got = subprocess.run([real, "--version"], capture_output=True, text=True)
    sys.stderr.write(re.sub(r"build [0-9]*, commit [0-9a-fA-F]*", "build {number}, commit {commit}",
                            got.stdout + got.stderr))
    sys.exit(0)
got = subprocess.run([real, *sys.argv[1:]], capture_output=True, text=True)
lines = []
for line in got.stdout.splitlines():
    if '"fit_memory_breakdown"' in line:
        record = json.loads(line)
        for row in record["data"]["rows"]:
            if row.get("kind") == "host":
                row["compute"] += more
                row["self"] += more
        line = json.dumps(record, separators=(",", ":"))
    elif line.split()[:1] == ["Host"] and len(line.split()) == 4:
        name, model, context, compute = line.split()
        line = f"{{name}} {{model}} {{context}} {{int(compute) + more}} "
    lines.append(line)
sys.stdout.write("\\n".join(lines) + "\\n")
sys.stderr.write(got.stderr)
sys.exit(got.returncode)
"""


def other_engine(real: build.EngineLocation, folder: Path, commit: str, number: str = "0",
                 host_compute_mib: int = 0) -> build.EngineLocation:
    """A folder of shims over ``real``'s tools that report ``commit`` (``unknown``: no commit at all), whose
    projection reserves ``host_compute_mib`` more host compute than ``real``'s."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in build.TOOLS:
        if real.has(tool):
            shim = folder / tool
            if tool == "llama-fit-params" and host_compute_mib:
                shim.write_text(MOVED_FIT_PARAMS.format(python=sys.executable, real=str(real.tool(tool)),
                                                        number=number, commit=commit, more=host_compute_mib))
            else:
                shim.write_text(SHIM.format(tool=tool, real=real.tool(tool), number=number, commit=commit))
            os.chmod(shim, 0o755)
    return build.EngineLocation(folder.resolve(), "option")
