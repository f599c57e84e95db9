"""An importance matrix for quantizing: the engine's llama-imatrix over the bundled corpus, once per source.

Cached by the source's content identity, the corpus hash, ctx, chunks and the engine, so every quant made from
one source with ``--imatrix`` shares one file. The same tool also says which experts a batch chose
(:func:`expert_counts`): its counts are the engine's own routing, not a computation of ours.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from tuner.core.errors import UsageError
from tuner.engine import build, flags, runner
from tuner.machine.fileio import atomic_path, file_lock
from tuner.quality import corpus, store

DEFAULT_CTX = 512
DEFAULT_CHUNKS = 16
TIMEOUT_S = 6 * 3600.0


def imatrix_dir() -> Path:
    return store.quality_dir() / "imatrix"


def _require_imatrix(loc: build.EngineLocation, alternative: str = "") -> None:
    if not loc.has(flags.IMATRIX):
        raise UsageError(f"this engine ({loc.bin_dir}) has no llama-imatrix: rebuild it with "
                         f"`moe-tune engine install --force`{alternative}")


def importance_matrix(loc: build.EngineLocation, source: Path, *, ctx: int = DEFAULT_CTX,
                      chunks: int = DEFAULT_CHUNKS, on_step: Callable[[str], None] | None = None) -> Path:
    """The cached importance matrix of ``source`` (a GGUF file), computed on first use."""
    _require_imatrix(loc, ", or leave out --imatrix")
    text_file, text_sha = corpus.text_file(), corpus.sha256()
    if text_file.stat().st_size < 2 * ctx:
        raise UsageError(f"the bundled corpus is too short for -c {ctx}: lower it")
    key = store.key(model=store.model_identity(source), text=text_sha, ctx=ctx, chunks=chunks,
                    engine=store.engine_identity(loc), tool=flags.IMATRIX)
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


def expert_counts(loc: build.EngineLocation, model: Path, *, ctx: int = DEFAULT_CTX, threads: int | None = None,
                  check_tensors: bool = True) -> dict[str, np.ndarray]:
    """Per routed-expert tensor (``blk.N.ffn_up_exps.weight``...), how many of one ``ctx``-token chunk's tokens the
    engine sent to each expert. llama-imatrix runs the chunk as one batch (one ubatch while ``ctx`` is at most
    the default -ub 512) and, for each MUL_MAT_ID, adds one to ``counts[expert]`` per token and chosen expert
    (``IMatrixCollector::collect_imatrix``, tools/imatrix/imatrix.cpp); the GGUF it writes keeps them as the
    ``<weight>.counts`` tensor (``save_imatrix``). A tied router sends every token to the same n_expert_used
    experts; a trained one spreads them. ``check_tensors``: the loader validates every row first and refuses a
    model with a non-finite scale or value (a ProcessFailedError)."""
    _require_imatrix(loc)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.imatrix.gguf"
        argv = flags.imatrix_argv(loc.tool(flags.IMATRIX), model, text_file=corpus.text_file(), out=out, ctx=ctx,
                                  chunks=1, threads=threads, check_tensors=check_tensors)
        runner.run_process(argv, timeout_s=TIMEOUT_S, what="llama-imatrix (expert counts)",
                           fix="check the model (MOE_TUNE_DEBUG=1 shows the full error)")
        if not out.is_file():
            raise UsageError(f"llama-imatrix wrote no counts for {model.name}: check the model")
        suffix = ".counts"
        return {t.name.removesuffix(suffix): np.asarray(t.data, dtype=np.float64).ravel().round().astype(np.int64)
                for t in gguf.GGUFReader(out).tensors if t.name.endswith(suffix) and "_exps." in t.name}
