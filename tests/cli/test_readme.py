"""README.md is a front page that stays true: at most 120 lines; the three questions, each with the command that
answers it; the set-up commands CI runs; every command the CLI has, and only those; every `moe-tune …` it shows
uses options that command's `--help` lists; every figure it quotes is in the benchmark file it links.
Runs the typer app in-process (no subprocess, no engine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tuner.cli.docs import all_commands, help_text

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def section(title: str) -> str:
    text = README.read_text()
    assert f"\n## {title}\n" in text, f"README.md has no `## {title}` section"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def leaf_commands() -> set[tuple[str, ...]]:
    commands = all_commands()
    return {c for c in commands if c and not any(other[:len(c)] == c and other != c for other in commands)}


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines; move reference text into docs/"
    answers = section("What it answers")
    for question, command in [("Which config?", "`moe-tune auto-tune MODEL`"),
                              ("Which trade-off?", "`moe-tune auto-tune MODEL --frontier`"),
                              ("Which quant?", "`moe-tune compare-quants REPO`")]:
        row = next((r for r in answers.splitlines() if question in r), "")
        assert command in row, f"the {question!r} row does not name {command}"
    setup = section("Set up: two commands").split("```", 2)[1]
    assert re.search(r"^make demo\b", setup, re.M) and re.search(r"^make test\b", setup, re.M), setup
    assert "make test" in (REPO / ".ci" / "run").read_text(), "CI must run the README's test command"
    assert section("On a desktop").strip(), "the `On a desktop` section is empty"


def test_readme_lists_every_command():
    listed: set[tuple[str, ...]] = set()
    for row in section("Commands").splitlines():
        if not row.startswith("| `"):
            continue
        prefix: tuple[str, ...] = ()
        for name in re.findall(r"`([a-z][a-z -]*)`", row.split("|")[1]):
            words = tuple(name.split())
            if len(words) > 1:
                prefix = words[:-1]
            listed.add(words if len(words) > 1 else (*prefix, *words))
    assert listed, "README.md's Commands table is empty"
    shown = leaf_commands()
    assert shown <= listed, f"commands missing from README.md: {sorted(shown - listed)}"
    assert listed <= shown, f"README.md lists commands the CLI lacks: {sorted(listed - shown)}"


def invocations() -> list[tuple[tuple[str, ...], set[str]]]:
    """Each `moe-tune COMMAND …` the README shows (inline code or a code block): the command and its options."""
    known = leaf_commands()
    found = []
    for line in README.read_text().splitlines():
        for m in re.finditer(r"moe-tune ((?:[a-z][a-z-]*)(?: (?:install|path|info))?)([^`\n|#]*)", line):
            command = tuple(m.group(1).split())
            if command in known:
                found.append((command, set(OPTION.findall(re.sub(r'"[^"]*"', "", m.group(2))))))
    return found


def test_readme_shows_real_invocations():
    commands = {c for c, _ in invocations()}
    assert {("auto-tune",), ("compare-quants",), ("demo-model",), ("plan",)} <= commands, commands


@pytest.mark.parametrize("command,options", invocations(), ids=lambda v: " ".join(v) if isinstance(v, tuple)
                         else ",".join(sorted(v)))
def test_readme_options_exist(command, options):
    shown = set(OPTION.findall(help_text(*command)))
    missing = sorted(options - shown)
    assert not missing, f"README.md shows {missing} for `moe-tune {' '.join(command)}`, its --help does not"


def figures(text: str) -> set[tuple[str, float]]:
    """Ratios (0.97x) and percentages (97 %, 100.0 %) in ``text``."""
    return ({("x", float(v)) for v in re.findall(r"(\d+\.\d+)x\b", text)}
            | {("%", float(v)) for v in re.findall(r"(\d+(?:\.\d+)?) ?%", text)})


def test_readme_figures_are_in_the_files_it_links():
    claims = re.split(r"\n- ", section("What backs the claims"))[1:]
    assert len(claims) >= 5, claims
    for claim in claims:
        links = re.findall(r"\]\((results/benchmarks/[^)]+)\)", claim)
        assert links, f"a claim without its benchmark file: {claim!r}"
        backing = set().union(*(figures((REPO / link).read_text()) for link in links))
        quoted = figures(claim)
        assert quoted <= backing, f"{sorted(quoted - backing)} quoted but not in {links}"
