"""Write docs/commands.md from every command's --help (tuner/cli/docs.py renders it).

Run after changing a command's options or docstring: .venv/bin/python scripts/gen_docs.py
tests/cli/test_docs.py fails while the checked-in page differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tuner.cli.docs import command_reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "commands.md"


def main() -> int:
    text = command_reference()
    old = PAGE.read_text() if PAGE.exists() else ""
    if text == old:
        print(f"{PAGE.relative_to(PAGE.parents[1])} is current")
        return 0
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(PAGE.parents[1])} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
