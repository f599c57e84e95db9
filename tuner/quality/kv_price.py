"""What a KV cache type costs in quality: mean KL-divergence (and same-top %) of the model at that K/V pair
against the SAME model at the f16 cache, on the bundled corpus.

The reference is the model itself at f16 KV, so the figure isolates the cache's loss from the weights' own
quantization, and no higher-precision sibling file is needed. Each (model, K, V) is priced once: the result
and the reference logits are cached by :func:`tuner.quality.perplexity.measure` (model identity, corpus,
ctx, chunks, KV types, engine).

The default floor, :data:`DEFAULT_MAX_KLD` = 0.002, sits between q8_0's and q4_0's cost as measured: on the
OLMoE-shaped valid-weight Q4_K_M (results/benchmarks/bench_search.txt) f16/q8_0 0.000117 and q8_0/q8_0 0.000119
(same top 99.4 / 99.0 %), but f16/q4_0 0.00356, q8_0/q4_0 0.00356, q4_0/q4_0 0.00367 (98.6 %); DESIGN puts
Llama-3-8B's q8_0 cache near 0.0008. So q8_0 passes and a 4-bit V cache must earn it: ``--max-kld`` moves the
floor, ``--max-kld off`` removes it. (The random-weight demo model's figures are all small — q4_0 0.0007 with
same top 65 % — so there a 4-bit cache passes.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tuner.core.config import CacheType, FlashAttn
from tuner.engine import build
from tuner.quality import perplexity

# Mean KLD (nats per token) above which a KV pair is refused by default. Between q8_0's and q4_0's cost.
DEFAULT_MAX_KLD = 0.002
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


def price(loc: build.EngineLocation, model: Path, cache_type_k: CacheType, cache_type_v: CacheType, *,
          ctx: int = PRICE_CTX, chunks: int = PRICE_CHUNKS,
          on_step: Callable[[str], None] | None = None) -> KvPrice:
    """The quality cost of running ``model`` with this K/V pair instead of f16/f16 (cached)."""
    if cache_type_k is CacheType.F16 and cache_type_v is CacheType.F16:
        return KvPrice("f16", "f16", 0.0, 0.0, 100.0, ctx, chunks, True)
    fa = FlashAttn.ON if cache_type_v.is_quantized else FlashAttn.AUTO
    q = perplexity.measure(loc, model, reference=model, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                           flash_attn=fa, ctx=ctx, chunks=chunks, on_step=on_step)
    assert q.kld_mean is not None and q.same_top_pct is not None  # a reference was given
    return KvPrice(cache_type_k.value, cache_type_v.value, q.kld_mean, q.kld_mean_error or 0.0, q.same_top_pct,
                   ctx, chunks, q.from_cache)
