"""The `moe-tune` command: a thin typer layer over the library. Only this package imports typer.

Each command lives in its own ``cmd_*`` module and registers itself on the shared app when imported.
"""

from __future__ import annotations

import sys

from tuner.cli import cmd_bench, cmd_demo, cmd_doctor, cmd_engine, cmd_hub, cmd_plan, cmd_quality, cmd_shape, cmd_tune  # noqa: F401 - registers the commands
from tuner.cli.app import app


def main() -> None:
    app()
    sys.exit(0)
