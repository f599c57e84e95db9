"""What a KV cache type costs in quality: mean KL-divergence (and same-top %) of the model at that K/V pair
against the SAME model at the f16 cache, on the bundled corpus.

The reference is the model itself at f16 KV, so the figure isolates the cache's loss from the weights' own
quantization, and no higher-precision sibling file is needed. Each (model, K, V) is priced once: the result
and the reference logits are cached by :func:`tuner.quality.perplexity.measure` (model identity, corpus,
ctx, chunks, KV types, engine).

The default floor, :data:`DEFAULT_MAX_KLD` = 0.01 nats per token, is absolute: it bounds what the cache adds,
whatever the model's size or its weights' own loss (auto-tune has no higher-precision file to measure that loss
against, and on trained models a given KLD changes about the same share of top tokens). It is set from trained
weights (docs/how-it-decides.md gives the figures and their sources): on SmolLM2-135M-Instruct Q4_1
(results/benchmarks/kv-kld-trained.md) q8_0/q8_0 costs 0.0044 (same top 96.3 %), as much as the engine's own
flash-attention arithmetic moves it (0.0039), f16/q4_0 0.0116 and q4_0/q4_0 0.0577 (87.0 %); Llama-3-8B's
q8_0 cache costs 0.00098 and its Q5_K_M weights 0.0108 (llama.cpp). So q8_0 passes on small and large models
and a 4-bit cache only where it costs less than Q5_K_M weights cost Llama 3 8B. ``--max-kld`` moves the floor,
``--max-kld off`` removes it. (It was 0.002, set from random-weight models, and refused every quantized pair of
the trained model, q8_0 included.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuner.core.config import CacheType, FlashAttn
from tuner.quality import perplexity, store

if TYPE_CHECKING:
    from tuner.engine import build

# Mean KLD (nats per token) above which a KV pair is refused by default: absolute, set on trained weights
# (module docstring). Above q8_0's cost (0.0044 on a 135M model, 0.001 on 8B), below q4_0/q4_0's (0.058 on 135M).
DEFAULT_MAX_KLD = 0.01
# Pricing runs: 512-token windows (llama-perplexity's standard), few chunks: the KLD of a KV type is a
# per-token average, stable to a few % after a couple of thousand scored tokens.
PRICE_CTX = 512
PRICE_CHUNKS = 8


@dataclass(frozen=True, slots=True)
class KvPrice:
    cache_type_k: str
    cache_type_v: str
    kld_mean: float
    kld_mean_error: float
    same_top_pct: float
    ctx: int
    chunks: int
    from_cache: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_max_kld(text: str | None) -> float | None:
    """``--max-kld``: a number, ``off`` (no floor), or nothing (the default floor)."""
    from tuner.core.errors import UsageError

    if text is None:
        return DEFAULT_MAX_KLD
    if text.strip().lower() in ("off", "none", "no"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"cannot read --max-kld {text!r}: give a mean KLD like 0.01, or off") from None
    if value < 0:
        raise UsageError("--max-kld must be >= 0 (or off)")
    return value


def flash_attn_for(cache_type_v: CacheType) -> FlashAttn:
    """How a pair is priced: a quantized V cache needs flash attention on; otherwise the engine decides."""
    return FlashAttn.ON if cache_type_v.is_quantized else FlashAttn.AUTO


def price(loc: build.EngineLocation, model: Path, cache_type_k: CacheType, cache_type_v: CacheType, *,
          ctx: int = PRICE_CTX, chunks: int = PRICE_CHUNKS,
          on_step: Callable[[str], None] | None = None) -> KvPrice:
    """The quality cost of running ``model`` with this K/V pair instead of f16/f16 (cached)."""
    if cache_type_k is CacheType.F16 and cache_type_v is CacheType.F16:
        return KvPrice("f16", "f16", 0.0, 0.0, 100.0, ctx, chunks, True)
    try:
        q = perplexity.measure(loc, model, reference=model, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                               flash_attn=flash_attn_for(cache_type_v), ctx=ctx, chunks=chunks, on_step=on_step)
    except OSError as exc:  # an unwritable cache (a file in the way, a full disk): one line naming the path
        raise store.unwritable(exc) from exc
    assert q.kld_mean is not None and q.same_top_pct is not None  # a reference was given
    return KvPrice(cache_type_k.value, cache_type_v.value, q.kld_mean, q.kld_mean_error or 0.0, q.same_top_pct,
                   ctx, chunks, q.from_cache)
