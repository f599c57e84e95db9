"""A reference's logits over the corpus, written once and reused while they fit a disk budget, and what its
perplexity says of the model, kept per model so that the next price reads it at once.

The logits are llama-perplexity's ``--kl-divergence-base`` file. A run stopped early (its model predicts no text:
:mod:`tuner.quality.stopping`) leaves no file to reuse: the engine writes the header with the chunk count it was asked
for before the first chunk, then each chunk's log-probabilities as that chunk ends, through a buffered stream
(perplexity.cpp ``perplexity``: ``logits_stream.write`` of n_chunk and the tokens, then ``process_logits`` per
chunk), and ``kl_divergence`` reads that header's n_chunk and fails at the first chunk the file lacks ("failed
reading log-probs for chunk"). A cut file is discarded; what the run read is kept (:class:`ReferenceRead`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.core.config import CacheType, LaunchConfig
from tuner.core.errors import DiskSpaceError, QualityError, UsageError
from tuner.engine import flags
from tuner.machine.fileio import atomic_path, atomic_write, file_lock
from tuner.quality import corpus, kld, ppl_run, store

if TYPE_CHECKING:  # these load when a model is read or measured, not when a command names a default
    from tuner.engine import build
    from tuner.models import gguf_reader

DEFAULT_DISK_BUDGET_BYTES = 8 * 2**30
DEFAULT_TIMEOUT_S = 6 * 3600.0
DISK_MARGIN_BYTES = 512 * 2**20


@dataclass(frozen=True, slots=True)
class ReferenceLogits:
    path: Path  # where the logits are (or, for a run stopped early, would have been)
    size_bytes: int
    ppl: float  # over the chunks read
    ppl_error: float
    created: bool
    chunks_read: int = 0  # 0: all the chunks asked for
    stopped: str | None = None  # why the run stopped before its last chunk (no file then); None: complete

    @property
    def complete(self) -> bool:
        return self.stopped is None


@dataclass(frozen=True, slots=True)
class ReferenceRead:
    """What a reference's run read of its model: its perplexity over the chunks it read, and why it stopped there
    (None: it read every chunk asked for). Kept per (model, corpus, ctx, engine), whatever the chunk count."""

    ppl: float
    chunks_read: int
    chunks: int
    stopped: str | None = None


class _Cut(Exception):  # noqa: N818 - a private signal: the run stopped early, its file is not to be kept
    def __init__(self, figures: kld.PerplexityFigures, why: str) -> None:
        super().__init__(why)
        self.figures = figures
        self.why = why


def _make_room(need_bytes: int, budget_bytes: int, keep: Path) -> None:
    """Keep the reference logits cache within the budget: refuse what cannot fit, evict the least recently used."""
    from tuner.machine import hardware

    if need_bytes > budget_bytes:
        raise UsageError(
            f"the reference logits would take {need_bytes / 2**30:.2f} GiB, over the {budget_bytes / 2**30:.2f} GiB "
            "disk budget: lower --chunks (or -c) or raise --disk-budget-gib"
        )
    folder = store.logits_dir()
    folder.mkdir(parents=True, exist_ok=True)
    others = sorted((p for p in folder.glob("*.logits") if p != keep), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in others)
    while others and total + need_bytes > budget_bytes:
        victim = others.pop(0)
        total -= victim.stat().st_size
        victim.unlink(missing_ok=True)
    free = hardware.free_disk_bytes(folder)
    if free < need_bytes + DISK_MARGIN_BYTES:
        raise DiskSpaceError(folder, need_bytes + DISK_MARGIN_BYTES, free)


def _logits_path(loc: build.EngineLocation, reference: Path, text_sha256: str, ctx: int, chunks: int) -> Path:
    key = store.key(ref=store.model_identity(reference), text=text_sha256, ctx=ctx, chunks=chunks,
                    engine=store.engine_identity(loc))
    return store.logits_dir() / f"{key}.logits"


def cached_logits_path(loc: build.EngineLocation, reference: Path, *, ctx: int, chunks: int) -> Path | None:
    """The reference logits over the bundled corpus, when they are cached (a disk budget counts them)."""
    path = _logits_path(loc, reference, corpus.sha256(), ctx, chunks)
    return path if path.is_file() else None


def reference_logits(
    loc: build.EngineLocation,
    reference: Path,
    *,
    text_file: Path,
    text_sha256: str,
    ctx: int,
    chunks: int,
    disk_budget_bytes: int = DEFAULT_DISK_BUDGET_BYTES,
    cfg: LaunchConfig | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_step: Callable[[str], None] | None = None,
    reference_info: gguf_reader.ModelInfo | None = None,
    stop_when: Callable[[str], str | None] | None = None,
) -> ReferenceLogits:
    """The reference's logits over ``chunks`` chunks, written once (f16 KV) and reused while they fit the budget.

    ``reference_info``: the reference's header when the caller has read it already (it is not read again).
    ``stop_when``: reads each chunk's row (--ppl-output-type 1) and gives a reason to stop there; a run so stopped
    keeps no file (module docstring) and says what it read (:attr:`ReferenceLogits.stopped`)."""
    from tuner.models import gguf_reader

    n_vocab = (reference_info or gguf_reader.inspect_model(reference)).n_vocab
    path = _logits_path(loc, reference, text_sha256, ctx, chunks)
    key = path.stem
    meta = path.with_suffix(".json")
    with file_lock(store.logits_dir() / f"{key}.lock"):
        if path.is_file() and meta.is_file():
            with contextlib.suppress(QualityError, OSError, ValueError, KeyError):
                size = kld.check_logits_file(path, ctx=ctx, n_chunks=chunks, n_vocab=n_vocab)
                saved = json.loads(meta.read_text())
                os.utime(path)  # most recently used: evicted last
                return ReferenceLogits(path, size, float(saved["ppl"]), float(saved["ppl_error"]), False, chunks)
        need = kld.logits_bytes(n_vocab, ctx, chunks)
        _make_room(need, disk_budget_bytes, keep=path)
        if on_step:
            on_step(f"writing reference logits of {reference.name} ({need / 2**20:,.1f} MiB, {chunks} chunks)")
        base_cfg = replace(cfg, model=reference) if cfg else LaunchConfig(model=reference)
        base_cfg = replace(base_cfg, cache_type_k=CacheType.F16, cache_type_v=CacheType.F16)
        if stop_when is not None:
            # One chunk per pass: with the default batch of 2048 the engine evaluates 4 chunks of 512 at once and
            # prints their rows together. The logits are the same bytes (results/benchmarks/early-stop-price.md).
            base_cfg = replace(base_cfg, batch=ctx)
        try:
            with atomic_path(path) as tmp:
                argv = flags.perplexity_argv(loc.tool("llama-perplexity"), base_cfg, text_file=text_file, ctx=ctx,
                                             chunks=chunks, kld_base=tmp) + store.file_log(loc)
                if stop_when is not None:
                    argv += flags.chunk_rows_argv()
                figures, stopped = ppl_run.run_until(argv, lambda out: kld.parse_perplexity(out, want_chunks=chunks),
                                                     timeout_s, on_step, chunks, stop_when=stop_when,
                                                     parse_cut=kld.parse_ppl_rows)
                if stopped is not None:
                    raise _Cut(figures, stopped)
                size = kld.check_logits_file(tmp, ctx=ctx, n_chunks=chunks, n_vocab=n_vocab)
        except _Cut as cut:
            return ReferenceLogits(path, 0, cut.figures.ppl, cut.figures.ppl_error, True, cut.figures.n_chunks,
                                   cut.why)
        meta.write_text(json.dumps({"reference": str(reference), "ppl": figures.ppl, "ppl_error": figures.ppl_error,
                                    "ctx": ctx, "chunks": chunks, "text_sha256": text_sha256}))
        return ReferenceLogits(path, size, figures.ppl, figures.ppl_error, True, chunks)


# -------------------------------------------------------------------------------- what the reference read


def _read_path(loc: build.EngineLocation, reference: Path, text_sha256: str, ctx: int) -> Path:
    key = store.key(ref=store.model_identity(reference), text=text_sha256, ctx=ctx, engine=store.engine_identity(loc),
                    read=1)
    return store.logits_dir() / f"{key}.read.json"


def kept_read(loc: build.EngineLocation, reference: Path, *, ctx: int) -> ReferenceRead | None:
    """What an earlier run of ``loc`` read of ``reference`` over the bundled corpus at ``ctx``, or None."""
    path = _read_path(loc, reference, corpus.sha256(), ctx)
    try:
        return ReferenceRead(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def keep_read(loc: build.EngineLocation, reference: Path, *, ctx: int, read: ReferenceRead) -> None:
    path = _read_path(loc, reference, corpus.sha256(), ctx)
    atomic_write(path, json.dumps(asdict(read)))
