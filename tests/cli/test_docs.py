"""docs/commands.md is what every command's --help prints now, and the README links the docs pages it moved
there. Runs the typer app in-process (no engine)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from tuner.cli.docs import REGENERATE, command_reference

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def test_command_reference_is_current():
    page = (DOCS / "commands.md").read_text()
    want = command_reference()
    diff = "".join(list(difflib.unified_diff(page.splitlines(True), want.splitlines(True), "docs/commands.md",
                                             "--help now", n=1))[:40])
    assert page == want, f"docs/commands.md is stale: regenerate with `{REGENERATE}`\n{diff}"


def test_command_reference_holds_every_command_and_option():
    page = (DOCS / "commands.md").read_text()
    for heading in ("## moe-tune auto-tune", "## moe-tune engine install", "## moe-tune compare-quants"):
        assert heading in page
    auto_tune = page.split("## moe-tune auto-tune", 1)[1].split("\n## ", 1)[0]
    for option in ("--frontier", "--max-kld", "--workload <chat|agent|batch|custom>", "--allow-busy"):
        assert option in auto_tune, option


def test_docs_links_resolve():
    """Every relative link in README.md and docs/*.md names a file that exists (and an anchor the page has)."""
    for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name} links {target}: no such file"
            if anchor and file.suffix == ".md":
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
                assert anchor in headings, f"{page.name} links {target}: no such heading"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
