"""Quality of a quant and of a KV cache type: perplexity and KL-divergence against a reference, cached.

One call, :func:`measure`, answers "how much does this file at these KV types differ from the best copy of
the same model?": the reference (the highest-precision sibling file, or one named) writes its logits once
to a cached file bounded by a chunk count and a disk budget; each (model, KV types) pair is then compared
against it in one llama-perplexity run. Results are cached by model identity, reference identity, text
hash, ctx, chunks, KV types and engine, so a study asks as often as it likes and pays once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import DiskSpaceError, QualityError, TextTooShortError, UsageError
from tuner.engine import flags
from tuner.machine import paths
from tuner.machine.fileio import atomic_path, atomic_write, file_lock
from tuner.quality import corpus, kld, ppl_run

if TYPE_CHECKING:  # these load when a model is read or measured, not when a command names a default
    from tuner.engine import build
    from tuner.models import gguf_reader

DEFAULT_CTX = 512
DEFAULT_CHUNKS = 32
DEFAULT_DISK_BUDGET_BYTES = 8 * 2**30
DEFAULT_TIMEOUT_S = 6 * 3600.0
DISK_MARGIN_BYTES = 512 * 2**20
RESULT_VERSION = 2  # 2: kld_mean_error from per-chunk means (tuner.quality.kld), kld_token_error added
# Reference precision, best first, by GGUF general.file_type (llama_ftype): F32, BF16, F16, Q8_0.
REFERENCE_FILE_TYPES = (0, 32, 1, 7)
_QUANT_SUFFIX = re.compile(r"[-._](?:UD-)?(?:I?Q\d[A-Z0-9_]*|BF16|F16|F32|MXFP4[A-Z0-9_]*)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class QualityResult:
    """One measured (model, KV types) pair. KLD fields are None when no reference was available."""

    model: str
    reference: str | None
    corpus_sha256: str
    ctx: int
    chunks: int
    cache_type_k: str
    cache_type_v: str
    engine_commit: str
    ppl: float
    ppl_error: float
    kld_mean: float | None
    kld_mean_error: float | None  # standard error from the per-chunk means: tokens of one chunk are correlated
    kld_p99: float | None
    same_top_pct: float | None
    same_top_pct_error: float | None
    reference_ppl: float | None
    reference_logits: str | None
    reference_logits_bytes: int | None
    elapsed_s: float
    argv: tuple[str, ...]
    kld_token_error: float | None = None  # the engine's per-token standard error (too small; kept to compare)
    from_cache: bool = False

    @property
    def is_reference(self) -> bool:
        """The reference itself at f16 KV: its KLD is zero by definition, not by measurement."""
        return self.reference == self.model and not self.argv

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ReferenceLogits:
    path: Path
    size_bytes: int
    ppl: float
    ppl_error: float
    created: bool


# ------------------------------------------------------------------------------------------ identities


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


def _file_log(loc: build.EngineLocation) -> list[str]:
    """Where an engine that writes a log file of its own (ik_llama.cpp) puts it: beside moe-tune's logs."""
    from tuner.engine import build

    return flags.file_log_argv(build.capabilities(loc).kind, paths.logs_dir())


def _kind_name(loc: build.EngineLocation) -> str:
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


def _base_name(path: Path) -> str:
    from tuner.models import gguf_reader

    split = gguf_reader.split_name(path.name)
    stem = split[0] if split else path.stem
    return _QUANT_SUFFIX.sub("", stem).lower()


def find_reference(model: Path) -> Path | None:
    """The highest-precision file of the same model next to ``model`` (same folder, or per-quant sibling
    folders as Hugging Face repos lay them out): same name without the quant, same shape, F32/BF16/F16/Q8_0."""
    from tuner.models import gguf_reader

    found = _reference_near(model, gguf_reader.inspect_model(model))
    return found[0] if found else None


def _reference_near(model: Path, info: gguf_reader.ModelInfo) -> tuple[Path, gguf_reader.ModelInfo] | None:
    """:func:`find_reference` for a model already read, with the reference's header (read once, kept)."""
    from tuner.models import gguf_reader

    base = _base_name(model)
    folders = {model.parent} | {p for p in model.parent.parent.iterdir() if p.is_dir()}
    best: tuple[int, Path, gguf_reader.ModelInfo] | None = None
    for folder in sorted(folders):
        for candidate in sorted(folder.glob("*.gguf")):
            split = gguf_reader.split_name(candidate.name)
            if _base_name(candidate) != base or (split is not None and split[1] != 1):
                continue
            try:
                other = info if candidate.resolve() == model.resolve() else gguf_reader.inspect_model(candidate)
            except (OSError, ValueError):
                continue
            same = (other.arch, other.n_layer, other.n_embd, other.n_vocab) == (
                info.arch, info.n_layer, info.n_embd, info.n_vocab)
            if not same or other.file_type not in REFERENCE_FILE_TYPES:
                continue
            rank = REFERENCE_FILE_TYPES.index(other.file_type)
            if best is None or rank < best[0]:
                best = (rank, candidate, other)
    return (best[1], best[2]) if best else None


# -------------------------------------------------------------------------------------------- storage


def quality_dir() -> Path:
    return paths.cache_root() / "quality"


def logits_dir() -> Path:
    return quality_dir() / "logits"


def results_dir() -> Path:
    return quality_dir() / "results"


def _key(**parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _load_result(path: Path) -> QualityResult | None:
    try:
        raw = json.loads(path.read_text())
        if raw.pop("version", None) != RESULT_VERSION:
            return None
        raw["argv"] = tuple(raw["argv"])
        raw["from_cache"] = True
        return QualityResult(**raw)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _store_result(path: Path, result: QualityResult) -> None:
    atomic_write(path, json.dumps({"version": RESULT_VERSION, **result.to_json()}, indent=1))


def _make_room(need_bytes: int, budget_bytes: int, keep: Path) -> None:
    """Keep the reference logits cache within the budget: refuse what cannot fit, evict the least recently used."""
    from tuner.machine import hardware

    if need_bytes > budget_bytes:
        raise UsageError(
            f"the reference logits would take {need_bytes / 2**30:.2f} GiB, over the {budget_bytes / 2**30:.2f} GiB "
            "disk budget: lower --chunks (or -c) or raise --disk-budget-gib"
        )
    folder = logits_dir()
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


# ------------------------------------------------------------------------------------------ measuring


def _logits_path(loc: build.EngineLocation, reference: Path, text_sha256: str, ctx: int, chunks: int) -> Path:
    key = _key(ref=model_identity(reference), text=text_sha256, ctx=ctx, chunks=chunks, engine=engine_identity(loc))
    return logits_dir() / f"{key}.logits"


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
) -> ReferenceLogits:
    """The reference's logits over ``chunks`` chunks, written once (f16 KV) and reused while they fit the budget.

    ``reference_info``: the reference's header when the caller has read it already (it is not read again)."""
    from tuner.models import gguf_reader

    n_vocab = (reference_info or gguf_reader.inspect_model(reference)).n_vocab
    path = _logits_path(loc, reference, text_sha256, ctx, chunks)
    key = path.stem
    meta = path.with_suffix(".json")
    with file_lock(logits_dir() / f"{key}.lock"):
        if path.is_file() and meta.is_file():
            with contextlib.suppress(QualityError, OSError, ValueError, KeyError):
                size = kld.check_logits_file(path, ctx=ctx, n_chunks=chunks, n_vocab=n_vocab)
                saved = json.loads(meta.read_text())
                os.utime(path)  # most recently used: evicted last
                return ReferenceLogits(path, size, float(saved["ppl"]), float(saved["ppl_error"]), False)
        need = kld.logits_bytes(n_vocab, ctx, chunks)
        _make_room(need, disk_budget_bytes, keep=path)
        if on_step:
            on_step(f"writing reference logits of {reference.name} ({need / 2**20:,.1f} MiB, {chunks} chunks)")
        base_cfg = replace(cfg, model=reference) if cfg else LaunchConfig(model=reference)
        base_cfg = replace(base_cfg, cache_type_k=CacheType.F16, cache_type_v=CacheType.F16)
        with atomic_path(path) as tmp:
            argv = flags.perplexity_argv(loc.tool("llama-perplexity"), base_cfg, text_file=text_file, ctx=ctx,
                                         chunks=chunks, kld_base=tmp) + _file_log(loc)
            figures = ppl_run.run(argv, lambda out: kld.parse_perplexity(out, want_chunks=chunks), timeout_s,
                                  on_step, chunks)
            size = kld.check_logits_file(tmp, ctx=ctx, n_chunks=chunks, n_vocab=n_vocab)
        meta.write_text(json.dumps({"reference": str(reference), "ppl": figures.ppl, "ppl_error": figures.ppl_error,
                                    "ctx": ctx, "chunks": chunks, "text_sha256": text_sha256}))
        return ReferenceLogits(path, size, figures.ppl, figures.ppl_error, True)


def measure(
    loc: build.EngineLocation,
    model: Path,
    *,
    reference: Path | None = None,
    auto_reference: bool = True,
    cache_type_k: CacheType = CacheType.F16,
    cache_type_v: CacheType = CacheType.F16,
    flash_attn: FlashAttn = FlashAttn.AUTO,
    threads: int | None = None,
    ctx: int = DEFAULT_CTX,
    chunks: int = DEFAULT_CHUNKS,
    text_file: Path | None = None,
    disk_budget_bytes: int = DEFAULT_DISK_BUDGET_BYTES,
    use_cache: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_step: Callable[[str], None] | None = None,
    base_loc: build.EngineLocation | None = None,
    levers: dict[str, Any] | None = None,
    line: LaunchConfig | None = None,
) -> QualityResult:
    """Perplexity of ``model`` at these KV types and, with a reference, KL-divergence against it.

    ``reference`` names the reference file; without it the highest-precision sibling is found when
    ``auto_reference``. The bundled corpus is the text unless ``text_file`` is given. ``base_loc``: the engine that
    writes the reference's logits, where it is not ``loc`` (an engine priced against llama.cpp's numerics);
    ``levers``: that engine's own settings the line runs with (ik_llama.cpp's -rtr, -muge: other kernels).
    ``line``: a launch line priced as it runs (:func:`as_run`: its KV types, flash attention, placement, ubatch and
    engine levers replace the arguments). The reference's logits are always the reference engine's bare launch at
    f16 KV, never the priced line's settings (another engine's levers are not the reference engine's to read).
    """
    from tuner.models import gguf_reader

    start = time.monotonic()
    if ctx < 16 or chunks < 1:
        raise UsageError(f"-c must be >= 16 and --chunks >= 1 (got -c {ctx}, --chunks {chunks})")
    for path, what in ((model, "model"), (reference, "reference"), (text_file, "text file")):
        if path is not None and not path.is_file():
            raise UsageError(f"{what} {path} not found: check the path")
    cfg = LaunchConfig(model=model, cache_type_k=cache_type_k, cache_type_v=cache_type_v, flash_attn=flash_attn,
                       threads=threads, engine=_kind_name(loc))
    cfg = replace(cfg, **(levers or {}))
    if line is not None:
        cfg = as_run(line, model, _kind_name(loc), ctx)
        cache_type_k, cache_type_v, flash_attn = cfg.cache_type_k, cfg.cache_type_v, cfg.flash_attn
    flags.validate(cfg)
    base_loc = base_loc or loc
    if text_file is None:
        text_file, text_sha = corpus.text_file(), corpus.sha256()
    else:
        text_sha = corpus.file_sha256(text_file)
    # Every token of a byte-level vocabulary covers at least one byte, so a text with fewer bytes than the
    # tokens llama-perplexity needs is too short. Checked here because the engine's own complaint is printed
    # just before it exits and is usually lost (its logger thread is not joined at exit).
    need_tokens = 2 * ctx
    if text_file.stat().st_size < need_tokens:
        raise TextTooShortError(None, need_tokens, ctx)
    # Each file's header is read once here and passed on (the reference is often the model itself).
    info = gguf_reader.inspect_model(model)
    ref_info: gguf_reader.ModelInfo | None = None
    if reference is None and auto_reference:
        found = _reference_near(model, info)
        reference, ref_info = found if found else (None, None)
    elif reference is not None:
        ref_info = info if reference.resolve() == model.resolve() else gguf_reader.inspect_model(reference)
    if reference is not None and ref_info is not None:
        m_vocab, r_vocab = info.n_vocab, ref_info.n_vocab
        if m_vocab != r_vocab:
            raise UsageError(f"reference {reference.name} has a {r_vocab}-token vocabulary and {model.name} "
                             f"{m_vocab}: name a reference of the same model with --reference")
    commit = engine_identity(loc)
    kv = (cache_type_k.value, cache_type_v.value)
    model_id = model_identity(model)
    ref_id = model_identity(reference) if reference is not None else None
    base = engine_identity(base_loc) if base_loc != loc else None
    key = _key(model=model_id, ref=ref_id, text=text_sha, ctx=ctx, chunks=chunks, kv=kv, engine=commit,
               fa=flash_attn.value, **({"base": base} if base else {}),
               **({"levers": sorted((levers or {}).items())} if levers else {}),
               **({"line": _run_words(cfg)} if line is not None else {}))
    cached_path = results_dir() / f"{key}.json"
    if use_cache and (hit := _load_result(cached_path)) is not None:
        return replace(hit, model=str(model), reference=str(reference) if reference else None,
                       elapsed_s=time.monotonic() - start)

    binary = loc.tool("llama-perplexity")
    result = QualityResult(
        model=str(model), reference=None, corpus_sha256=text_sha, ctx=ctx, chunks=chunks, cache_type_k=kv[0],
        cache_type_v=kv[1], engine_commit=commit, ppl=0.0, ppl_error=0.0, kld_mean=None, kld_mean_error=None,
        kld_p99=None, same_top_pct=None, same_top_pct_error=None, reference_ppl=None, reference_logits=None,
        reference_logits_bytes=None, elapsed_s=0.0, argv=(),
    )
    if reference is None:
        if on_step:
            on_step(f"perplexity of {model.name} (no reference found: PPL only)")
        argv = flags.perplexity_argv(binary, cfg, text_file=text_file, ctx=ctx, chunks=chunks) + _file_log(loc)
        ppl = ppl_run.run(argv, lambda out: kld.parse_perplexity(out, want_chunks=chunks), timeout_s)
        result = replace(result, ppl=ppl.ppl, ppl_error=ppl.ppl_error, argv=tuple(argv))
    else:
        bare = LaunchConfig(model=reference, threads=threads, device=cfg.device, engine=_kind_name(base_loc))
        ref = reference_logits(base_loc, reference, text_file=text_file, text_sha256=text_sha, ctx=ctx,
                               chunks=chunks, disk_budget_bytes=disk_budget_bytes, cfg=bare, timeout_s=timeout_s,
                               on_step=on_step, reference_info=ref_info)
        result = replace(result, reference=str(reference), reference_ppl=ref.ppl, reference_logits=str(ref.path),
                         reference_logits_bytes=ref.size_bytes)
        if ref_id == model_id and kv == ("f16", "f16") and base is None:
            # Compared with itself the distributions are identical: KLD 0, same top token 100 %.
            result = replace(result, ppl=ref.ppl, ppl_error=ref.ppl_error, kld_mean=0.0, kld_mean_error=0.0,
                             kld_p99=0.0, same_top_pct=100.0, same_top_pct_error=0.0, kld_token_error=0.0)
        else:
            if on_step:
                on_step(f"KL-divergence of {model.name} at KV {kv[0]}/{kv[1]} against {reference.name}")
            argv = flags.perplexity_argv(binary, cfg, text_file=text_file, ctx=ctx, chunks=chunks,
                                         kld_base=ref.path, kld=True) + _file_log(loc)
            fig = ppl_run.run(argv, lambda out: kld.parse_kld(out, want_chunks=chunks, ctx=ctx), timeout_s,
                              on_step, chunks)
            result = replace(result, ppl=fig.ppl, ppl_error=fig.ppl_error, kld_mean=fig.kld_mean,
                             kld_mean_error=fig.kld_mean_error, kld_p99=fig.kld_p99, same_top_pct=fig.same_top_pct,
                             same_top_pct_error=fig.same_top_pct_error, argv=tuple(argv),
                             kld_token_error=fig.kld_token_error)
    result = replace(result, elapsed_s=time.monotonic() - start)
    with file_lock(results_dir() / f"{key}.lock"):
        _store_result(cached_path, result)
    return result


# What of a launch line changes the numbers its engine computes: the cache types and flash attention, where each
# weight runs (the card's kernels or the CPU's), the ubatch (a kernel's choice can hang on the batch: ik_llama.cpp's
# repacked Q4_1 product differs from 32 tokens on, docs/engines.md), the load mode and the engine's own levers.
# Context, slots, prompt cache and thread counts change no figure.
_AS_RUN = ("cache_type_k", "cache_type_v", "flash_attn", "n_gpu_layers", "n_cpu_moe", "device", "mmap", "repack",
           "no_host", "op_offload", "threads")


def as_run(line: LaunchConfig, model: Path, engine: str, ctx: int) -> LaunchConfig:
    """The launch line's numerics for a perplexity run over ``ctx``-token chunks of ``model``: what :data:`_AS_RUN`
    names, its ubatch (at most a chunk: llama-perplexity decodes a chunk at a time) and its engine's levers."""
    from tuner.engine.kinds import kind_by_name

    kind = kind_by_name(engine)
    kept = {name: getattr(line, name) for name in (*_AS_RUN, *kind.levers)}
    ubatch = min(line.ubatch, ctx) if line.ubatch else None
    return replace(LaunchConfig(model=model, engine=engine), ubatch=ubatch, **kept)


def _run_words(cfg: LaunchConfig) -> str:
    """A priced line's settings as its launch line says them (the model's path aside): part of its cache key."""
    return " ".join(flags.launch_line(replace(cfg, model=Path("m.gguf"))).split()[3:])


def kv_quality(
    loc: build.EngineLocation,
    model: Path,
    kv_types: list[tuple[CacheType, CacheType]],
    **options: object,
) -> list[QualityResult]:
    """The same measurement for each (K type, V type): what each KV cache type costs in quality."""
    return [
        measure(loc, model, cache_type_k=k, cache_type_v=v, **options)  # type: ignore[arg-type]
        for k, v in kv_types
    ]
