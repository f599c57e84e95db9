"""Quality of a quant and of a KV cache type: perplexity and KL-divergence against a reference, cached.

One call, :func:`measure`, answers "how much does this file at these KV types differ from the best copy of
the same model?": the reference (the highest-precision sibling file, or one named) writes its logits once
to a cached file bounded by a chunk count and a disk budget; each (model, KV types) pair is then compared
against it in one llama-perplexity run. Results are cached by model identity, reference identity, text
hash, ctx, chunks, KV types and engine, so a study asks as often as it likes and pays once. Given a floor
(``max_kld``), the KL-divergence run stops once its verdict against it is clear (:mod:`tuner.quality.stopping`).

The reference's logits are :mod:`tuner.quality.reference`'s; where figures are kept, :mod:`tuner.quality.store`'s.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import TextTooShortError, UsageError
from tuner.engine import flags
from tuner.machine.fileio import atomic_write, file_lock
from tuner.quality import corpus, kld, ppl_run, stopping, store
from tuner.quality.reference import DEFAULT_DISK_BUDGET_BYTES, DEFAULT_TIMEOUT_S, reference_logits

# Read here by other packages (tuner.quants.compare, scripts): where the reference logits are kept.
from tuner.quality.reference import cached_logits_path as cached_logits_path
from tuner.quality.store import logits_dir as logits_dir

if TYPE_CHECKING:  # these load when a model is read or measured, not when a command names a default
    from tuner.engine import build
    from tuner.models import gguf_reader

DEFAULT_CTX = 512
DEFAULT_CHUNKS = 32
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
    chunks_used: int | None = None  # chunks the KL-divergence run read (None: all ``chunks``)
    stopped: str | None = None  # why that run stopped before its last chunk (its verdict was clear); None: it did not

    @property
    def is_reference(self) -> bool:
        """The reference itself at f16 KV: its KLD is zero by definition, not by measurement."""
        return self.reference == self.model and not self.argv

    def to_json(self) -> dict[str, object]:
        return asdict(self)


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


# ------------------------------------------------------------------------------------------ measuring


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
    max_kld: float | None = None,
) -> QualityResult:
    """Perplexity of ``model`` at these KV types and, with a reference, KL-divergence against it.

    ``reference`` names the reference file; without it the highest-precision sibling is found when
    ``auto_reference``. The bundled corpus is the text unless ``text_file`` is given. ``base_loc``: the engine that
    writes the reference's logits, where it is not ``loc`` (an engine priced against llama.cpp's numerics);
    ``levers``: that engine's own settings the line runs with (ik_llama.cpp's -rtr, -muge: other kernels).
    ``line``: a launch line priced as it runs (:func:`as_run`: its KV types, flash attention, placement, ubatch and
    engine levers replace the arguments). The reference's logits are always the reference engine's bare launch at
    f16 KV, never the priced line's settings (another engine's levers are not the reference engine's to read).
    ``max_kld``: the floor the KL-divergence is held to; its run stops once the verdict is clear
    (:func:`tuner.quality.stopping.kld_clear`), the result then says after how many chunks and why. None: every chunk.
    """
    from tuner.models import gguf_reader

    start = time.monotonic()
    if ctx < 16 or chunks < 1:
        raise UsageError(f"-c must be >= 16 and --chunks >= 1 (got -c {ctx}, --chunks {chunks})")
    for path, what in ((model, "model"), (reference, "reference"), (text_file, "text file")):
        if path is not None and not path.is_file():
            raise UsageError(f"{what} {path} not found: check the path")
    cfg = LaunchConfig(model=model, cache_type_k=cache_type_k, cache_type_v=cache_type_v, flash_attn=flash_attn,
                       threads=threads, engine=store.kind_name(loc))
    cfg = replace(cfg, **(levers or {}))
    if line is not None:
        cfg = as_run(line, model, store.kind_name(loc), ctx)
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
    commit = store.engine_identity(loc)
    kv = (cache_type_k.value, cache_type_v.value)
    model_id = store.model_identity(model)
    ref_id = store.model_identity(reference) if reference is not None else None
    base = store.engine_identity(base_loc) if base_loc != loc else None
    key = store.key(model=model_id, ref=ref_id, text=text_sha, ctx=ctx, chunks=chunks, kv=kv, engine=commit,
               fa=flash_attn.value, **({"base": base} if base else {}),
               **({"levers": sorted((levers or {}).items())} if levers else {}),
               **({"line": _run_words(cfg)} if line is not None else {}))
    cached_path = store.results_dir() / f"{key}.json"
    # A run stopped early answers only for its floor; one that read every chunk answers for any.
    stopped_path = store.results_dir() / f"{store.key(full=key, stop_at=max_kld)}.json"
    for path in (cached_path, stopped_path) if max_kld is not None else (cached_path,):
        if use_cache and (hit := _load_result(path)) is not None:
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
        argv = flags.perplexity_argv(binary, cfg, text_file=text_file, ctx=ctx, chunks=chunks) + store.file_log(loc)
        ppl = ppl_run.run(argv, lambda out: kld.parse_perplexity(out, want_chunks=chunks), timeout_s)
        result = replace(result, ppl=ppl.ppl, ppl_error=ppl.ppl_error, argv=tuple(argv))
    else:
        bare = LaunchConfig(model=reference, threads=threads, device=cfg.device, engine=store.kind_name(base_loc))
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
            # Held to a floor, one chunk per pass (the default batch of 2048 evaluates 4 chunks of 512 at once and
            # prints their rows together), so the run can stop after any chunk; the figures are the same bytes.
            run_cfg = replace(cfg, batch=ctx) if max_kld is not None else cfg
            argv = flags.perplexity_argv(binary, run_cfg, text_file=text_file, ctx=ctx, chunks=chunks,
                                         kld_base=ref.path, kld=True) + store.file_log(loc)
            watch = stopping.KldWatch(max_kld, chunks).see if max_kld is not None else None
            fig, stopped = ppl_run.run_until(argv, lambda out: kld.parse_kld(out, want_chunks=chunks, ctx=ctx),
                                             timeout_s, on_step, chunks, stop_when=watch,
                                             parse_cut=lambda out: kld.parse_kld_rows(out, ctx))
            result = replace(result, ppl=fig.ppl, ppl_error=fig.ppl_error, kld_mean=fig.kld_mean,
                             kld_mean_error=fig.kld_mean_error, kld_p99=fig.kld_p99, same_top_pct=fig.same_top_pct,
                             same_top_pct_error=fig.same_top_pct_error, argv=tuple(argv),
                             kld_token_error=fig.kld_token_error, chunks_used=fig.n_chunks, stopped=stopped)
    result = replace(result, elapsed_s=time.monotonic() - start)
    path = stopped_path if result.stopped else cached_path
    try:
        with file_lock(path.with_suffix(".lock")):
            _store_result(path, result)
    except OSError as exc:  # the figure stands; only the next ask pays again
        if on_step:
            on_step(f"  not cached: {store.unwritable(exc, 'the quality figure')}")
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
