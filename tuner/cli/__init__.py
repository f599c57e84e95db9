"""The `moe-tune` command: a thin typer layer over the library. Only this package imports typer.

Each command lives in its own ``cmd_*`` module and registers itself on the shared app when imported.
"""

from __future__ import annotations

import sys

from tuner.cli import (  # noqa: F401 - registers the commands
    cmd_bench,
    cmd_compare,
    cmd_demo,
    cmd_doctor,
    cmd_engine,
    cmd_hub,
    cmd_plan,
    cmd_quality,
    cmd_shape,
    cmd_tune,
)
from tuner.cli.app import app


def main() -> None:
    app()
    sys.exit(0)
