"""Every command's --help in an 80-column terminal: no `<bool>` beside a flag, no line past the edge, and every
option's name and help text printed whole (nothing cut with "…" or "..."). Runs the typer app in-process."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from tuner.cli import app
from tuner.cli.docs import all_commands

COMMANDS = all_commands()


def words(text: str) -> str:
    return "".join(text.split())  # wrapping may break a line at a space or after a hyphen


def declared(command: tuple[str, ...]):
    """The command's parameters as declared (typer's own command object), to compare the printed help with."""
    cmd = typer.main.get_command(app)
    for name in command:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


def test_every_command_is_covered():
    names = {c[-1] for c in COMMANDS if c}
    assert {"auto-tune", "bench", "plan", "compare-quants", "engine", "install", "info"} <= names, names
    assert len(COMMANDS) == 1 + len(declared(()).commands) + len(declared(("engine",)).commands)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "moe-tune")
def test_help_at_80_columns(command):
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    text = res.output
    cmd = declared(command)
    assert "<bool>" not in text
    written = [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]
    assert text.count("…") == sum(h.count("…") for h in written), "an ellipsis the help text does not hold: cut"
    long = [line for line in text.splitlines() if len(line) > 80]
    assert not long, long
    flat = words(text)
    for param in cmd.params:
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} cut or missing"
        if getattr(param, "is_flag", False):
            row = next(line for line in text.splitlines() if line.lstrip().startswith(param.opts[0]))
            assert "<" not in row, row  # a flag takes no value: no type beside it
        if getattr(param, "help", None):
            assert words(param.help) in flat, f"help of {param.opts} cut: {param.help!r}"
    listed = text.split("\nCommands:\n", 1)[1] if "\nCommands:\n" in text else ""
    for name, sub in getattr(cmd, "commands", {}).items():
        one_line = sub.short_help or (sub.help or "").split("\n\n")[0]
        assert words(f"{name} {one_line}") in words(listed), f"{name}'s one-line help cut: {listed}"
