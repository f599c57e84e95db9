"""The README's command list is the CLI's: every command and option it shows exists in `--help`, and every
command `--help` lists is in the README. Runs the typer app in-process (no subprocess, no engine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli import app
from tuner.cli.docs import subcommands

README = Path(__file__).resolve().parents[2] / "README.md"
RUNNER = CliRunner()


def readme_commands() -> dict[tuple[str, ...], set[str]]:
    """``("engine", "install") → {"--backend", "--force", "-j"}`` from the README's `## Commands` block."""
    text = README.read_text()
    block = text.split("## Commands", 1)[1].split("```", 2)[1]
    commands: dict[tuple[str, ...], set[str]] = {}
    current: tuple[str, ...] | None = None
    for line in block.splitlines():
        code = line.split("#", 1)[0]
        m = re.match(r"moe-tune ((?:[a-z][a-z-]*)(?: (?:install|path|info))?)", code.strip())
        if m:
            current = tuple(m.group(1).split())
            commands.setdefault(current, set())
        if current is not None:
            commands[current] |= set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", code.replace(m.group(0), "")
                                                 if m else code))
    return commands


def help_text(*command: str) -> str:
    res = RUNNER.invoke(app, [*command, "--help"], env={"COLUMNS": "250", "TERM": "dumb", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    return res.output


def test_readme_lists_every_command():
    listed = {c[0] for c in readme_commands()}
    top = help_text()
    shown = set(subcommands(top))
    assert shown, top
    assert shown <= listed, f"commands missing from README.md: {sorted(shown - listed)}"
    assert listed <= shown, f"README.md lists commands the CLI lacks: {sorted(listed - shown)}"


@pytest.mark.parametrize("command", sorted(readme_commands()), ids=" ".join)
def test_readme_options_exist(command):
    text = help_text(*command)
    shown = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))
    missing = sorted(readme_commands()[command] - shown)
    assert not missing, f"README.md shows {missing} for `moe-tune {' '.join(command)}`, its --help does not"
