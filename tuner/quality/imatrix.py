"""An importance matrix for quantizing: the engine's llama-imatrix over the bundled corpus, once per source.

Cached by the source's content identity, the corpus hash, ctx, chunks and the engine, so every quant made from
one source with ``--imatrix`` shares one file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tuner.core.errors import UsageError
from tuner.engine import build, flags, runner
from tuner.machine.fileio import atomic_path, file_lock
from tuner.quality import corpus, perplexity

DEFAULT_CTX = 512
DEFAULT_CHUNKS = 16
TIMEOUT_S = 6 * 3600.0


def imatrix_dir() -> Path:
    return perplexity.quality_dir() / "imatrix"


def importance_matrix(loc: build.EngineLocation, source: Path, *, ctx: int = DEFAULT_CTX,
                      chunks: int = DEFAULT_CHUNKS, on_step: Callable[[str], None] | None = None) -> Path:
    """The cached importance matrix of ``source`` (a GGUF file), computed on first use."""
    if not loc.has(flags.IMATRIX):
        raise UsageError(f"this engine ({loc.bin_dir}) has no llama-imatrix: rebuild it with "
                         "`moe-tune engine install --force`, or leave out --imatrix")
    text_file, text_sha = corpus.text_file(), corpus.sha256()
    if text_file.stat().st_size < 2 * ctx:
        raise UsageError(f"the bundled corpus is too short for -c {ctx}: lower it")
    key = perplexity._key(model=perplexity.model_identity(source), text=text_sha, ctx=ctx, chunks=chunks,
                          engine=perplexity.engine_identity(loc), tool=flags.IMATRIX)
    path = imatrix_dir() / f"{key}.imatrix.gguf"
    imatrix_dir().mkdir(parents=True, exist_ok=True)
    with file_lock(imatrix_dir() / f"{key}.lock"):
        if path.is_file() and path.stat().st_size > 0:
            return path
        if on_step:
            on_step(f"importance matrix of {source.name} ({chunks} chunks of {ctx} tokens of the bundled corpus)")
        with atomic_path(path) as tmp:
            argv = flags.imatrix_argv(loc.tool(flags.IMATRIX), source, text_file=text_file, out=tmp, ctx=ctx,
                                      chunks=chunks)
            runner.run_process(argv, timeout_s=TIMEOUT_S, what="llama-imatrix",
                               fix="check the source model (MOE_TUNE_DEBUG=1 shows the full error)")
            if not tmp.is_file() or tmp.stat().st_size == 0:
                raise UsageError(f"llama-imatrix wrote no matrix for {source.name}: lower -c or check the model")
    return path
