"""README.md is a front page that stays true: at most 120 lines; the three questions, each with the command that
answers it; the set-up commands CI runs; every command the CLI has, and only those; every `moe-tune …` it shows
uses options that command's `--help` lists; every figure it quotes (seconds, GiB, ratios, percentages, counts,
both ends of a range) is in the benchmark file it links. Runs the typer app in-process (no subprocess, no
engine)."""

from __future__ import annotations

import re
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Figure:
    """A number as written (``digits``, thousands separators dropped), its value, its unit ("" for a count) and,
    for a count, the word that says what it counts (``noun``, stemmed: "10-turn" → "turn", "20 trials" →
    "trial", "trial 1" → "trial")."""

    digits: str
    value: float
    unit: str
    noun: str = ""


NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?:\s?(GiB|MiB|ms|s|x|%)(?!\w))?")
LINK = re.compile(r"\[[^\]]*\]\((results/benchmarks/[^)]+)\)")
WORD = r"[A-Za-z][\w'-]*"
SMALL = {"a", "an", "and", "at", "by", "for", "from", "in", "is", "of", "on", "or", "the", "to", "vs", "with"}


def _stem(word: str) -> str:
    word = word.lower()
    return word[:-1] if word.endswith("s") and not word.endswith("ss") and len(word) > 3 else word


def _noun(before: str, after: str) -> str:
    """What a count counts: the word right after it ("14-config", "4 of 4 contexts": the word after "of N"), else
    the last word before it in the same clause ("at trial 1;")."""
    m = re.match(rf"(?:\s+of\s+[\d,]+)?(?:-|\s+)({WORD})", after)
    if m and m.group(1).lower() not in SMALL:
        return _stem(m.group(1))
    words = [w for w in re.findall(WORD, re.split(r"[;:,.()\[\]]", before)[-1]) if w.lower() not in SMALL]
    return _stem(words[-1]) if words else ""


def figures(text: str) -> list[Figure]:
    """Every figure in ``text``: seconds, GiB, MiB, ms, ratios (0.97x), percentages, and counts; both ends of a
    range (83.2–88.6 %: both are percentages). Digits inside a name are not figures (Q4_K_M, f16, gpt-oss-20b,
    pp128, a commit hash)."""
    found: list[tuple[Figure, int, int]] = []
    for m in NUMBER.finditer(text):
        before, after = text[:m.start()], text[m.end():]
        if m.group(2) is None and re.match(r"[A-Za-z_]", after):
            continue  # 20b, 0c1e57098: part of a name
        if re.search(r"[A-Za-z_][-–]$", before):
            continue  # gpt-oss-20b
        digits = m.group(1).replace(",", "")
        unit = m.group(2) or ""
        found.append((Figure(digits, float(digits), unit, "" if unit else _noun(before, after)), m.start(), m.end()))
    out = []
    for i, (fig, _, end) in enumerate(found):
        nxt = found[i + 1] if i + 1 < len(found) else None
        if not fig.unit and nxt and nxt[0].unit and re.fullmatch(r"\s?[-–]\s?", text[end:nxt[1]]):
            fig = Figure(fig.digits, fig.value, nxt[0].unit)  # the low end of a range takes the high end's unit
        out.append(fig)
    return out


def backed(fig: Figure, text: str) -> bool:
    """``fig`` is in ``text``. A figure with a unit: with that unit (15.30 s is 15.3 s) or, when it has decimals,
    as the same digits without a unit (a table cell under a "default s" header). A count: as a count of the same
    value, on a line that names what it counts wherever the file names it at all (the README's words are not
    always the file's: "3 auto-tunes" stands on "3 runs")."""
    lines = [(line.lower(), figures(line)) for line in text.splitlines()]
    if fig.unit:
        return any((b.unit == fig.unit and b.value == fig.value)
                   or ("." in fig.digits and not b.unit and b.digits == fig.digits) for _, bs in lines for b in bs)
    named = [(line, bs) for line, bs in lines if fig.noun and fig.noun in line]
    return any(not b.unit and b.value == fig.value for _, bs in (named or lines) for b in bs)


def unbacked(claim: str) -> list[tuple[str, str]]:
    """(figure, file) for each figure of ``claim`` missing from the benchmark file it cites: the text before a
    link is backed by that link's file (text after the last link by the last)."""
    parts = LINK.split(claim)
    texts, links = parts[0::2], parts[1::2]
    assert links, f"a claim without its benchmark file: {claim!r}"
    missing = []
    for n, text in enumerate(texts):
        link = links[min(n, len(links) - 1)]
        backing = (REPO / link).read_text()
        missing += [(f"{f.digits}{' ' + f.unit if f.unit else ''}", link) for f in figures(text)
                    if not backed(f, backing)]
    return missing


def claims() -> list[str]:
    """The claims: each item of "What backs the claims", and each table row of the README that quotes a figure
    (the "Which model?" answer quotes a measured session time; a figure in a table is a claim all the same)."""
    rows = [line for line in README.read_text().splitlines()
            if line.startswith("|") and figures(re.sub(r"`[^`]*`", "", LINK.sub("", line)))]
    return re.split(r"\n- ", section("What backs the claims"))[1:] + rows


def test_figures_are_read_with_their_units_and_both_ends_of_a_range():
    text = ("A 10-turn session at 2048 tokens took 15.30 s (1,842 cached), 72.4 s off; 83.2–88.6 % and 3.8-9.8 s; "
            "0.97x; chat at 4 of 4 contexts; 4017 MiB, 3.92 GiB; best at trial 1; the OLMoE-shaped Q4_K_M, "
            "gpt-oss-20b, f16/f16, pp128, llama.cpp 0c1e57098, x2")
    assert [(f.digits, f.unit or f.noun) for f in figures(text)] == [
        ("10", "turn"), ("2048", "token"), ("15.30", "s"), ("1842", "cached"), ("72.4", "s"), ("83.2", "%"),
        ("88.6", "%"), ("3.8", "s"), ("9.8", "s"), ("0.97", "x"), ("4", "context"), ("4", "context"),
        ("4017", "MiB"), ("3.92", "GiB"), ("1", "trial")]
    table = "depth | turns | default s\n2048 | 10 | 15.30 | 72.39\nthe session took 72.4 s, 16 s in all, 12 turns"
    assert backed(Figure("15.30", 15.3, "s"), table) and backed(Figure("72.40", 72.4, "s"), table)
    assert not backed(Figure("1.30", 1.3, "s"), table)  # once passed: only "N x" and "N %" were checked
    assert not backed(Figure("16", 16.0, "GiB"), table) and not backed(Figure("16", 16.0, ""), table)
    assert not backed(Figure("72", 72.0, "s"), table)  # an integer with a unit is matched with that unit
    assert backed(Figure("12", 12.0, "", "turn"), table) and not backed(Figure("10", 10.0, "", "turn"), table)
    assert backed(Figure("10", 10.0, "", "request"), table)  # a word the file never uses: the number alone


def test_readme_figures_are_in_the_files_it_links():
    found = claims()
    assert any("122.5 s" in c for c in found), "the Which model? row's session time is not held to its file"
    assert len(found) >= 5, found
    assert sum(len(figures(LINK.sub("", c))) for c in found) >= 20, "the claims quote fewer figures than expected"
    missing = [m for claim in found for m in unbacked(claim)]
    assert not missing, f"README.md quotes figures its benchmark files do not hold: {missing}"
