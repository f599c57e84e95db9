"""What an engine costs in quality: the mean KL-divergence of its logits against llama.cpp's, the same model at the
same f16 cache, over the bundled corpus. Another engine runs other kernels (ik_llama.cpp's IQK matrix products and
flash attention, its fused MoE op), so its numbers differ; the figure says by how much, on the model being tuned,
and is held to the same floor as a quantized KV cache (``--max-kld``: :mod:`tuner.quality.kv_price`).

Measured once per (engine build, model, corpus, context, chunks) and cached like every perplexity figure; the
reference logits are llama.cpp's, written by :func:`tuner.quality.perplexity.reference_logits` and shared with the
KV prices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuner.engine import build
from tuner.quality import kv_price, perplexity


@dataclass(frozen=True, slots=True)
class EnginePrice:
    engine: str  # the priced engine, as it names itself (EngineIdentity.name)
    reference: str  # the engine whose logits are the reference (llama.cpp)
    kld_mean: float
    kld_mean_error: float
    same_top_pct: float | None
    ppl: float
    reference_ppl: float | None
    ctx: int
    chunks: int
    from_cache: bool = False
    levers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        top = f", same top token {self.same_top_pct:.1f} %" if self.same_top_pct is not None else ""
        with_levers = f" with {', '.join(f'{k}={v}' for k, v in self.levers.items())}" if self.levers else ""
        return (f"{self.engine}{with_levers} against {self.reference}: mean KLD {self.kld_mean:.4g} ± "
                f"{self.kld_mean_error:.2g} nats/token{top} ({self.chunks} chunks of {self.ctx} tokens, f16 KV)")


def price(loc: build.EngineLocation, reference: build.EngineLocation, model: Path, *,
          ctx: int = kv_price.PRICE_CTX, chunks: int = kv_price.PRICE_CHUNKS, levers: dict[str, Any] | None = None,
          on_step: Callable[[str], None] | None = None, use_cache: bool = True) -> EnginePrice:
    """The KL-divergence of ``loc``'s logits on ``model`` against ``reference``'s (both at f16 KV), with the
    engine's own ``levers`` as the line sets them (``-rtr`` runs other kernels: it is priced as run)."""
    q = perplexity.measure(loc, model, reference=model, ctx=ctx, chunks=chunks, on_step=on_step,
                           base_loc=reference, levers=levers, use_cache=use_cache)
    return EnginePrice(build.capabilities(loc).identity.name, build.capabilities(reference).identity.name,
                       q.kld_mean or 0.0, q.kld_mean_error or 0.0, q.same_top_pct, q.ppl, q.reference_ppl, ctx,
                       chunks, q.from_cache, dict(levers or {}))
