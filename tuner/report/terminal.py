"""Text for a terminal of a given width: prose wrapped to it, and each launch line and each path whole on a line of
its own, where a reader copies it from (a launch line folded at the edge no longer pastes as one command).

The commands' steps and notes are sentences that may carry a launch line (``round 2 (confirmation): default
(llama-server -m ... -np 1)``) or paths (``written: a/report.md, a/scores.png``); :func:`fitted` lays out one such
message. A message that fits the width is left as it is.
"""

from __future__ import annotations

import re
import textwrap

# A launch line as tuner.engine.flags.launch_line writes it: environment assignments, then llama-server (or the path
# to another engine's) and its first flag (so that "llama-server default", an arm's name, stays prose).
_LAUNCH = re.compile(r"(?:[A-Z][A-Z0-9_]*=\S+ )*(?:[^\s(]*/)?llama-server -")
# A path: absolute, home- or dot-relative, a sqlite URL, or a relative one naming a file of ours.
_PATH = re.compile(r"^(?:sqlite:///|/|~/|\./)\S*$|^\S+/\S+\.(?:gguf|md|json|jsonl|png|html|db|txt|log|csv|parquet)$")
_TRAILING = ",;:"  # list punctuation after a path, not part of it
INDENT = "  "  # a wrapped sentence's later lines, told apart from the next message


def _launch_spans(text: str) -> list[tuple[int, int, int, int]]:
    """(cut_start, cut_end, line_start, line_end) of each launch line: in parentheses, the parentheses are cut with it
    and it ends at the closing one; else it runs to the end of the text."""
    spans = []
    pos = 0
    while (m := _LAUNCH.search(text, pos)) is not None:
        start = m.start()
        if start > 0 and text[start - 1] == "(":
            close = text.find(")", start)
            end = close if close >= 0 else len(text)
            spans.append((start - 1, min(len(text), end + 1), start, end))
        else:
            end = len(text)
            spans.append((start, end, start, end))
        pos = spans[-1][1]
    return spans


def _pieces(text: str) -> list[tuple[str, bool]]:
    """The text as (piece, whole) pairs: prose, and the launch lines and paths that stand whole."""
    out: list[tuple[str, bool]] = []
    pos = 0
    for cut_start, cut_end, start, end in _launch_spans(text):
        out += _paths(text[pos:cut_start])
        out.append((text[start:end].strip(), True))
        pos = cut_end
    return out + _paths(text[pos:])


def _paths(prose: str) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    words: list[str] = []
    for word in prose.split():
        bare = word.rstrip(_TRAILING)
        if _PATH.match(bare):
            out.append((" ".join(words), False))
            out.append((bare, True))
            words = []
        else:
            words.append(word)
    return [*out, (" ".join(words), False)]


def fitted(text: str, width: int, seen: set[str] | None = None) -> list[str]:
    """``text`` as lines for a terminal ``width`` columns wide: each launch line and path whole on its own line,
    the prose around them wrapped to the width (later lines of a sentence indented). Only a launch line, a path or a
    word longer than the width is longer than it. ``seen``: the launch lines already shown (a round's steps name
    the same arms' lines again and again); one of them is left out, and each shown is added."""
    if len(text) <= width or width < 20:
        return [text]
    lead = text[:len(text) - len(text.lstrip(" "))]  # a message's own indent stays on its first line
    lines: list[str] = []
    for piece, whole in _pieces(text):
        if whole and seen is not None and _LAUNCH.match(piece):
            if piece in seen:
                continue
            seen.add(piece)
        if whole:
            lines.append(piece)
        elif piece.strip(" ,;:()"):
            wrapped = textwrap.wrap(piece, width, subsequent_indent=INDENT, break_long_words=False,
                                    break_on_hyphens=False)
            lines += [lead + wrapped[0], *wrapped[1:]] if not lines else [INDENT + wrapped[0], *wrapped[1:]]
    return [line for line in lines if line.strip()]
