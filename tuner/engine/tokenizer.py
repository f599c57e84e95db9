"""A model's own tokenizer before any server starts: the engine's llama-tokenize reads the vocabulary from the
GGUF's header alone (``vocab_only``), so a 20 GiB model, or the header stand-in of a Hub quant, is counted in a
fraction of a second without a weight read. What an input check needs to size a session in the model's tokens
before the first costly step."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

from tuner.core.errors import TunerError, UsageError
from tuner.engine import flags, runner
from tuner.engine.caps import EngineLocation

TIMEOUT_S = 60.0


def available(loc: EngineLocation | None) -> bool:
    """The engine has llama-tokenize (a user's own build may not)."""
    return loc is not None and loc.has(flags.TOKENIZE)


def model_tokenizer(loc: EngineLocation, model: Path) -> Callable[[str], list[int]]:
    """``text -> token ids`` in ``model``'s vocabulary, as llama-server's /tokenize gives them; each text is
    counted once. A model whose vocabulary cannot be read is a one-line UsageError naming it."""
    binary = loc.tool(flags.TOKENIZE)

    @functools.lru_cache(maxsize=256)
    def ids(text: str) -> tuple[int, ...]:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt") as f:
            f.write(text)
            f.flush()
            try:
                res = runner.run_process(flags.tokenize_argv(binary, model, Path(f.name)), timeout_s=TIMEOUT_S,
                                         what="llama-tokenize", fix=f"check that {model} is a GGUF with a vocabulary")
                return tuple(flags.parse_token_ids(res.stdout))
            except (TunerError, ValueError) as exc:
                raise UsageError(f"{model.name}: its vocabulary could not be read by llama-tokenize "
                                 f"({str(exc).splitlines()[0]}): check the file") from None

    return lambda text: list(ids(text))
