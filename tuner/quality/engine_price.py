"""What a line costs in quality, priced as it runs: the mean KL-divergence of its logits against llama.cpp's own, the
same model at f16 KV, over the bundled corpus. Another engine runs other kernels (ik_llama.cpp's IQK matrix products
and flash attention, its fused MoE op, its repacked weights), and a quantized KV cache stores less: the figure says by
how much, on the model being tuned, with the line's own KV types, flash attention, placement, ubatch and levers
(:func:`tuner.quality.perplexity.as_run`), and it is held to the same floor as a quantized KV cache (``--max-kld``:
:mod:`tuner.quality.kv_price`).

One reference per model: llama.cpp's logits at f16 KV, written once by :func:`tuner.quality.reference.reference_logits`
and shared with every KV price, whichever engine's line is priced against it. Its perplexity first says whether any
KL-divergence on the model says anything (:func:`reference_says`, a call a caller can make before a race): a model
that predicts no text is known after the reference's first chunk, and every price of it then answers at once, no line
run. A price held to a floor (``max_kld``) stops its line's run once the verdict is clear
(:mod:`tuner.quality.stopping`). Each price is cached like every perplexity figure. A line that loads its weights
into RAM (ik's ``-rtr`` repacks them; ``--load-mode none``) is not priced where the model does not fit the RAM free:
that run would read it back from disk for minutes and say nothing the race did not.

Every failure of a price, the file system's too (a file where the cache's folder goes, a full disk), comes out as
one :class:`~tuner.core.errors.QualityError` line naming the fix: a caller that prices after a long race leaves the
line unpriced with that reason, and keeps its run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import QualityError, TunerError
from tuner.engine import build, flags
from tuner.engine.kinds import kind_by_name
from tuner.models import gguf_reader
from tuner.quality import corpus, kv_price, perplexity, stopping, store
from tuner.quality.reference import ReferenceRead, cached_logits_path, keep_read, kept_read, reference_logits

MIB = 2**20


@dataclass(frozen=True, slots=True)
class LinePrice:
    engine: str  # the priced engine, as it names itself (EngineIdentity.name)
    reference: str  # the engine whose logits are the reference (llama.cpp)
    kld_mean: float | None  # None: no line run (its reference says nothing of quality: ``says_nothing``)
    kld_mean_error: float
    same_top_pct: float | None
    ppl: float | None  # the line's perplexity over the chunks its run read (None: no line run)
    reference_ppl: float | None
    ctx: int
    chunks: int  # the chunks the price was asked for
    priced_as: str = ""  # the line's settings as priced (its launch line's words after the model)
    from_cache: bool = False
    argv: tuple[str, ...] = ()  # the llama-perplexity command that priced it (the reference's logits are llama.cpp's)
    # Why the figure says nothing of quality (None: it does): the reference predicts no text (:func:`says_nothing`).
    says_nothing: str | None = None
    chunks_used: int | None = None  # the chunks the line's run read (0: none, the reference said nothing)
    stopped: str | None = None  # why the line's run stopped before its last chunk: its verdict was clear

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        how = f" ({self.priced_as})" if self.priced_as else ""
        if self.kld_mean is None:
            return f"{self.engine}{how} not priced against {self.reference}'s f16 logits: {self.says_nothing}"
        top = f", same top token {self.same_top_pct:.1f} %" if self.same_top_pct is not None else ""
        said = f"; it says nothing of quality: {self.says_nothing}" if self.says_nothing else ""
        read = (f"{self.chunks} chunks of {self.ctx} tokens" if not self.stopped else
                f"stopped after {self.chunks_used} of {self.chunks} chunks of {self.ctx} tokens, {self.stopped}")
        return (f"{self.engine}{how} against {self.reference}'s f16 logits: mean KLD {self.kld_mean:.4g} ± "
                f"{self.kld_mean_error:.2g} nats/token{top} ({read}){said}")

    def refused_by(self, max_kld: float | None) -> bool:
        """Whether this price refuses its line under the floor (a price that says nothing refuses nothing)."""
        return (max_kld is not None and self.says_nothing is None and self.kld_mean is not None
                and self.kld_mean > max_kld)


@dataclass(frozen=True, slots=True)
class ReferenceVerdict:
    """What the reference's perplexity says of a model before any line is priced on it (:func:`reference_says`)."""

    says_nothing: str | None  # why no KL-divergence on this model says anything of quality (None: a price does)
    reference_ppl: float  # over the chunks the reference's run read
    chunks_read: int
    chunks: int
    complete: bool  # the reference's logits over ``chunks`` are written: a price reads them at once
    stopped: str | None = None  # why the reference's run stopped before its last chunk
    from_cache: bool = False  # read from an earlier run's record, no process run

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def says_nothing(reference_ppl: float | None, n_vocab: int, over: str = "the corpus") -> str | None:
    """Why a KL-divergence against this reference measures no quality, or None. A reference whose perplexity on the
    corpus is at least its vocabulary's size predicts the text no better than a uniform guess: its weights model no
    language (valid but untrained, as the shape models this project measures speed on), and a deep stack of them
    amplifies any rounding: on the Qwen3-30B-A3B Q4_K_M shape with direct weights (reference PPL 230,547 over 151,936
    tokens), llama.cpp against itself with only ``--no-repack`` (another Q4_K kernel, the same arithmetic) read a mean
    KLD of 0.53 and the same top token 0.3 % of the time (results/benchmarks/which-engine-cpu.md). A trained model's
    perplexity is a small fraction of its vocabulary (SmolLM2-135M: 18.8 over 49,152). ``over``: the text it was
    read on (the first chunks of the corpus, for a run stopped there)."""
    if reference_ppl is None or reference_ppl < n_vocab:
        return None
    return (f"the model predicts no text (its perplexity on {over}, {reference_ppl:,.0f}, is no better than a "
            f"uniform guess over its {n_vocab:,}-token vocabulary): a KL-divergence on it measures rounding, not "
            "quality")


def needs_price(line: LaunchConfig) -> bool:
    """Whether a line computes other numbers than llama.cpp's bare launch: another engine, or a quantized KV cache."""
    kind = kind_by_name(line.engine)
    return not kind.numerics_reference or line.cache_type_k.is_quantized or line.cache_type_v.is_quantized


def check_room(line: LaunchConfig, model: Path, available_bytes: int) -> None:
    """Refuse, before any run, to price a line that loads its weights into RAM (no file mapping) on a machine whose
    free RAM does not hold the model."""
    kind = kind_by_name(line.engine)
    size = model.stat().st_size
    if not kind.maps_model(line) and size > available_bytes:
        raise QualityError(f"not priced: this line loads all {size / 2**30:.1f} GiB of {model.name} into RAM "
                           f"({' '.join(flags.launch_line(line).split()[3:]) or 'its flags'}) and "
                           f"{available_bytes / 2**30:.1f} GiB is free: free RAM, or price it with --max-kld off")


def reference_says(model: Path, reference_loc: build.EngineLocation, *, ctx: int = kv_price.PRICE_CTX,
                   chunks: int = kv_price.PRICE_CHUNKS,
                   on_step: Callable[[str], None] | None = None) -> ReferenceVerdict:
    """Whether a KL-divergence on ``model`` says anything, from ``reference_loc``'s perplexity of it at f16 KV. The
    reference's run over ``chunks`` chunks writes the logits every price of the model reads, and stops after the
    chunk where the model clearly predicts no text (:func:`tuner.quality.stopping.predicts_no_text`; its cut logits
    are not kept). On return the model says nothing, or its logits over ``chunks`` are written (``complete``), so a
    price after a race reads them at once. What the run read is kept per model: the next call, and every
    :func:`price_line` of a model that says nothing, answers at once."""
    with _one_line("the reference's perplexity"):
        n_vocab = gguf_reader.inspect_model(model).n_vocab
        read = kept_read(reference_loc, model, ctx=ctx)
        from_cache = read is not None
        cfg = LaunchConfig(model=model, engine=store.kind_name(reference_loc))
        if read is None:
            if on_step:
                on_step(f"the reference's perplexity of {model.name}: does the model predict text?")
            ref = reference_logits(reference_loc, model, text_file=corpus.text_file(), text_sha256=corpus.sha256(),
                                   ctx=ctx, chunks=chunks, cfg=cfg, on_step=on_step,
                                   stop_when=stopping.ReferenceWatch(n_vocab, chunks).see)
            read = ReferenceRead(ref.ppl, ref.chunks_read, chunks, ref.stopped)
            keep_read(reference_loc, model, ctx=ctx, read=read)
        over = ("the corpus" if read.stopped is None else
                f"the first {read.chunks_read} of {read.chunks} chunks of the corpus")
        why = says_nothing(read.ppl, n_vocab, over)
        complete = cached_logits_path(reference_loc, model, ctx=ctx, chunks=chunks) is not None
        if why is None and not complete:  # read before at another chunk count, or evicted since: written now
            reference_logits(reference_loc, model, text_file=corpus.text_file(), text_sha256=corpus.sha256(), ctx=ctx,
                             chunks=chunks, cfg=cfg, on_step=on_step)
            complete, from_cache = True, False
        return ReferenceVerdict(why, read.ppl, read.chunks_read, read.chunks, complete, read.stopped, from_cache)


def price_line(line: LaunchConfig, loc: build.EngineLocation, reference: build.EngineLocation, *,
               ctx: int = kv_price.PRICE_CTX, chunks: int = kv_price.PRICE_CHUNKS, available_bytes: int | None = None,
               on_step: Callable[[str], None] | None = None, use_cache: bool = True,
               max_kld: float | None = None) -> LinePrice:
    """The KL-divergence of ``line`` as ``loc`` runs it against ``reference``'s bare launch at f16 KV (both on the
    line's model). ``available_bytes``: the RAM free, checked first (:func:`check_room`). Where the reference says
    nothing of quality (:func:`reference_says`), no line runs: the price says why. ``max_kld``: the floor; the line's
    run stops once its verdict against it is clear (None: every chunk). Any failure: one :class:`QualityError` line."""
    with _one_line("the price"):
        if available_bytes is not None:
            check_room(line, line.model, available_bytes)
        verdict = reference_says(line.model, reference, ctx=ctx, chunks=chunks, on_step=on_step)
        words = " ".join(flags.launch_line(perplexity.as_run(line, line.model, line.engine, ctx)).split()[3:])
        names = build.capabilities(loc).identity.name, build.capabilities(reference).identity.name
        if verdict.says_nothing:
            return LinePrice(*names, None, 0.0, None, None, verdict.reference_ppl, ctx, chunks, words,
                             verdict.from_cache, (), verdict.says_nothing, chunks_used=0)
        q = perplexity.measure(loc, line.model, reference=line.model, ctx=ctx, chunks=chunks, on_step=on_step,
                               base_loc=reference, line=line, use_cache=use_cache, max_kld=max_kld)
        if q.kld_mean is None:
            raise QualityError(f"no KL-divergence came out of pricing {line.model.name}: see the perplexity log")
        n_vocab = gguf_reader.inspect_model(line.model).n_vocab
        return LinePrice(*names, q.kld_mean, q.kld_mean_error or 0.0, q.same_top_pct, q.ppl, q.reference_ppl, ctx,
                         chunks, words, q.from_cache, tuple(q.argv), says_nothing(q.reference_ppl, n_vocab),
                         q.chunks_used or chunks, q.stopped)


def price(loc: build.EngineLocation, reference: build.EngineLocation, model: Path, *,
          ctx: int = kv_price.PRICE_CTX, chunks: int = kv_price.PRICE_CHUNKS, levers: dict[str, Any] | None = None,
          on_step: Callable[[str], None] | None = None, use_cache: bool = True,
          max_kld: float | None = None) -> LinePrice:
    """``loc``'s bare launch of ``model`` (f16 KV), with its own ``levers`` where given, priced against
    ``reference``'s: the engine's numerics alone (:func:`price_line` prices a whole line)."""
    line = LaunchConfig(model=model, engine=build.capabilities(loc).kind.name, **(levers or {}))
    return price_line(line, loc, reference, ctx=ctx, chunks=chunks, on_step=on_step, use_cache=use_cache,
                      max_kld=max_kld)


@contextlib.contextmanager
def _one_line(what: str) -> Iterator[None]:
    """Any failure inside as one :class:`QualityError` line naming the fix: the tool's own errors keep their words;
    the file system's (a file where the cache's folder goes, a full disk, no permission) are said with their path
    (:func:`tuner.quality.store.unwritable`). Anything else is a bug of ours and travels on."""
    try:
        yield
    except QualityError:
        raise
    except TunerError as exc:
        raise QualityError(f"{what} failed: {exc}") from exc
    except OSError as exc:
        raise store.unwritable(exc) from exc
