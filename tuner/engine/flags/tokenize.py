"""argv for llama-tokenize, and its answer read back."""

from __future__ import annotations

import re
from pathlib import Path

TOKENIZE = "llama-tokenize"

_IDS = re.compile(r"\[([0-9,\s]*)\]\s*$")


def tokenize_argv(binary: Path, model: Path, text_file: Path) -> list[str]:
    """The token ids of ``text_file`` in ``model``'s vocabulary, counted as llama-server's ``/tokenize`` counts
    them for the session sizer: no BOS (``add_special`` false) and special tokens parsed (the handler's defaults in
    tools/server/server-context.cpp; llama-tokenize parses them by default, common_params_parse_ex in
    common/arg.cpp). The tool loads the vocabulary alone (``vocab_only`` in tools/tokenize/tokenize.cpp), so no
    weight is read."""
    return [str(binary), "-m", str(model), "-f", str(text_file), "--ids", "--no-bos", "--log-disable"]


def parse_token_ids(stdout: str) -> list[int]:
    """``[1, 2, 3]``, the last line llama-tokenize prints with ``--ids``; ValueError when there is none."""
    m = _IDS.search(stdout.strip())
    if m is None:
        raise ValueError(f"llama-tokenize printed no ids: {stdout.strip()[-200:]!r}")
    return [int(x) for x in m.group(1).replace(",", " ").split()]
