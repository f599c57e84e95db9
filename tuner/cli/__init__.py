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
    cmd_mcp,
    cmd_plan,
    cmd_quality,
    cmd_serve,
    cmd_shape,
    cmd_share,
    cmd_tune,
    cmd_versus,
)
from tuner.cli.app import app, usage_error


def main() -> None:
    """Run the app; a mistyped command line (unknown option, a value outside its choices) is one line naming
    the valid values and exit 1, like every other mistake, instead of a boxed usage screen and exit 2."""
    try:
        code = app(standalone_mode=False)
    except Exception as exc:
        handled = usage_error(exc)
        if handled is None:
            raise
        sys.exit(handled)
    sys.exit(code if isinstance(code, int) else 0)
