"""Where quality figures are kept and what names them: a model's content identity, an engine's, the cache folders
under ``MOE_TUNE_CACHE`` (:func:`tuner.machine.paths.cache_root`), the key of each cached figure, and the one-line
reason, naming the fix, when that folder cannot be written."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.core.errors import QualityError
from tuner.engine import flags
from tuner.machine import paths

if TYPE_CHECKING:  # these load when a model is read or measured, not when a command names a default
    from tuner.engine import build


def model_identity(model: Path) -> str:
    """Content identity of a model file (all split parts): size plus hashes of its head and tail.

    Hashing a 20 GB file whole would cost minutes; the head holds the GGUF header (every tensor's name, type
    and offset) and the start of the data, so a re-quantized or re-converted file differs there. Hashed once per
    process: a file seen again (same parts, sizes and modification times) is served from memory, so a pricing
    pass over many KV types, or a model that is its own reference, reads it once.
    """
    from tuner.models import gguf_reader

    parts = gguf_reader.split_parts(model)
    return _hash_parts(tuple((str(p.resolve()), st.st_size, st.st_mtime_ns) for p in parts for st in (p.stat(),)))


@functools.lru_cache(maxsize=64)
def _hash_parts(stamp: tuple[tuple[str, int, int], ...]) -> str:
    """The hash itself, keyed by each part's (resolved path, size, mtime): a rewritten file is hashed again."""
    digest = hashlib.sha256()
    for part, size, _ in stamp:
        digest.update(f"{size}|".encode())
        with Path(part).open("rb") as fh:
            digest.update(fh.read(4 * 2**20))
            if size > 5 * 2**20:
                fh.seek(size - 2**20)
                digest.update(fh.read())
    return digest.hexdigest()[:32]


def file_log(loc: build.EngineLocation) -> list[str]:
    """Where an engine that writes a log file of its own (ik_llama.cpp) puts it: beside moe-tune's logs."""
    from tuner.engine import build

    return flags.file_log_argv(build.capabilities(loc).kind, paths.logs_dir())


def kind_name(loc: build.EngineLocation) -> str:
    """Which kind of engine ``loc`` is (its lines are spelled in that engine's dialect)."""
    from tuner.engine import build

    return build.capabilities(loc).kind.name


def engine_identity(loc: build.EngineLocation) -> str:
    """The engine commit; a build that does not know its commit is named by its binary instead."""
    from tuner.engine import build

    engine = build.capabilities(loc).identity
    if engine.known:
        return engine.commit
    st = loc.tool("llama-perplexity").stat()
    return "binary-" + hashlib.sha256(f"{loc.bin_dir}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def quality_dir() -> Path:
    return paths.cache_root() / "quality"


def logits_dir() -> Path:
    return quality_dir() / "logits"


def results_dir() -> Path:
    return quality_dir() / "results"


def key(**parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]




# errno → what it means for the cache, and the fix (beside pointing MOE_TUNE_CACHE elsewhere)
_WRITE_FAILURES = {
    errno.ENOSPC: ("the disk is full", "free space"),
    errno.EDQUOT: ("over the disk quota", "free space"),
    errno.EACCES: ("permission denied", "make it writable"),
    errno.EPERM: ("permission denied", "make it writable"),
    errno.EROFS: ("a read-only file system", "mount it writable"),
}


def unwritable(exc: OSError, what: str | None = None) -> QualityError:
    """``exc``, met while keeping ``what`` in the cache (None: named from the path: the reference logits, the quality
    figures), as one line naming the fix. An error of the file system is no bug of ours, and a caller that prices a
    line after a long race must be able to leave it unpriced with its reason rather than lose the run (issue 66)."""
    path = Path(exc.filename) if exc.filename else quality_dir()
    if not path.absolute().is_relative_to(paths.cache_root().absolute()):
        return QualityError(f"{what or 'pricing'} failed on {path} ({exc.strerror or exc}): check that file")
    if what is None:
        what = ("the reference logits" if path.absolute().is_relative_to(logits_dir().absolute()) else
                "the quality figures" if path.absolute().is_relative_to(results_dir().absolute()) else
                "the quality cache")
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        # mkdir of a folder that is a file (EEXIST), or of one under a file (ENOTDIR): name the file itself.
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        return QualityError(f"{what} cannot be written to {path} (a file is in the way: {blocker}): remove it, or "
                            "set MOE_TUNE_CACHE to another folder")
    why, fix = _WRITE_FAILURES.get(exc.errno or 0, (exc.strerror or type(exc).__name__, "check that folder"))
    return QualityError(f"{what} cannot be written to {path} ({why}): {fix}, or set MOE_TUNE_CACHE to another folder")
