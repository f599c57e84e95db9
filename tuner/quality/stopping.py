"""When a price's verdict is clear before its last chunk, so its llama-perplexity run can stop there.

Two runs make a price (:mod:`tuner.quality.engine_price`), and each can stop early:

- **The reference** (llama.cpp's logits at f16 KV) first says whether a KL-divergence on this model says anything: a
  model whose perplexity on the corpus is at least its vocabulary's size predicts no text. Its run stops once the
  running mean negative log-likelihood is clearly above ln(vocabulary) (:func:`predicts_no_text`). An untrained shape
  reads far above it from the first chunk (Qwen3-30B-A3B's shape with direct weights: PPL 230,547 over 151,936
  tokens), a trained model far below (SmolLM2-135M: 18.8 over 49,152), so only the untrained side stops: a trained
  model's reference is written whole, for the line's run to read.
- **The line's KL-divergence run** stops once its mean KLD is clearly above or below ``--max-kld``
  (:func:`kld_clear`): ik_llama.cpp's bug on a llama-architecture MoE reads 0.6-18 nats against a 0.01 floor, a q8_0
  KV cache 0.004 on trained weights.

Pure: lines of the engine's output in, a reason (or None) out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from tuner.quality import kld

# Two-sided 99 % Student-t quantiles, t(0.995, df) for df = 1..30; beyond, df 30's (above the true value: a wider
# bound, never a narrower one).
_T_995 = (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169, 3.106, 3.055, 3.012, 2.977, 2.947,
          2.921, 2.898, 2.878, 2.861, 2.845, 2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763, 2.756, 2.750)
# The reference's bound: a 99 % normal bound (2.576 errors) on the chunk's mean log-likelihood, whose error is the
# engine's per-token figure times 2.5. Tokens of one chunk share their context, so the per-token error understates how
# far one chunk's mean lies from the corpus's: on untrained models the spread of the chunk means was 0.87-2.21x the
# first chunk's per-token error (results/benchmarks/early-stop-price.md). Near the line (a model that predicts about as
# well as a uniform guess) the run is not cut, and its whole perplexity decides as before.
_Z_99 = 2.576
_CHUNK_SPREAD = 2.5


def t_995(df: int) -> float:
    """The two-sided 99 % Student-t quantile for ``df`` degrees of freedom (df >= 1)."""
    return _T_995[min(df, len(_T_995)) - 1]


def predicts_no_text(row: kld.PplRow, n_vocab: int) -> str | None:
    """Why a reference run can stop after this row: its mean log-likelihood per token is clearly worse than a
    uniform guess over ``n_vocab`` tokens (see the module docstring), so no KL-divergence on the model says anything
    of quality (:func:`tuner.quality.engine_price.says_nothing`); or None."""
    if row.nll_error <= 0 or not math.isfinite(row.nll_mean):
        return None  # no error printed yet (llama-perplexity prints a negative variance as is): not clear
    lower = row.nll_mean - _Z_99 * _CHUNK_SPREAD * row.nll_error
    if lower < math.log(n_vocab):
        return None
    return (f"its perplexity so far, {row.ppl:,.0f}, is clearly no better than a uniform guess over its "
            f"{n_vocab:,}-token vocabulary (99 % bound {math.exp(lower):,.0f})")


def kld_clear(chunk_kld: Sequence[float], max_kld: float, chunks: int) -> str | None:
    """Why a KL-divergence run of ``chunks`` chunks can stop after the chunks whose own mean KLDs are ``chunk_kld``:
    the verdict the whole run would give against ``max_kld`` is clear (its price refuses the line, or passes it);
    or None, to read on.

    The whole run's figure is the mean of all ``chunks`` chunk means: the ones read are known, the rest predicted from
    them. From two chunks on, a two-sided 99 % Student-t prediction interval bounds the mean of the chunks to come
    (their spread is the per-chunk means' spread, as :mod:`tuner.quality.kld` computes the ±: tokens of one chunk err
    together), and the run stops when the whole mean's bound lies wholly above or below ``max_kld``. Student's t at few
    degrees of freedom (63.7 at two chunks, 9.9 at three) and two-sided, so that the up to seven looks of an 8-chunk
    price keep a changed verdict rare; a line near its floor reads on, and its whole mean decides as before. With one
    chunk there is no spread, and the chunks to come are bounded only below, by zero (a KL-divergence is never
    negative): a first chunk above ``chunks`` x ``max_kld`` refuses the line for certain (ik_llama.cpp's 18 nats stop
    there), and nothing passes on one chunk.
    """
    n = len(chunk_kld)
    if n == 0 or n >= chunks:
        return None
    seen, rest = sum(chunk_kld), chunks - n
    mean = seen / n
    half = (t_995(n - 1) * statistics.stdev(chunk_kld) * math.sqrt(1 / n + 1 / rest)) if n >= 2 else math.inf
    lowest = (seen + rest * max(mean - half, 0.0)) / chunks
    highest = (seen + rest * (mean + half)) / chunks
    how = (f"(99 % bound from the {n} chunks read, their mean {mean:.3g})" if n >= 2 and mean - half > 0 else
           f"(the {n} chunk{'s' if n > 1 else ''} read alone: a KL-divergence is never negative)")
    if lowest > max_kld:
        return f"refused: the mean over all {chunks} chunks would read {lowest:.3g} or more {how}, above --max-kld " \
               f"{max_kld:g}"
    if highest < max_kld:
        return (f"passes: the mean over all {chunks} chunks would read {highest:.3g} at most (99 % bound from the {n} "
                f"chunks read, their mean {mean:.3g}), below --max-kld {max_kld:g}")
    return None


class KldWatch:
    """Reads a KL-divergence run's stdout line by line; :meth:`see` says why to stop once :func:`kld_clear` does."""

    def __init__(self, max_kld: float, chunks: int) -> None:
        self.max_kld = max_kld
        self.chunks = chunks
        self._running: list[float] = []

    def see(self, line: str) -> str | None:
        row = kld.kld_row(line)
        if row is None or row[0] != len(self._running) + 1:
            return None
        self._running.append(row[1])
        return kld_clear(kld.per_chunk_means(self._running), self.max_kld, self.chunks)


class ReferenceWatch:
    """Reads a reference run's stdout (--ppl-output-type 1) line by line; :meth:`see` says why to stop once
    :func:`predicts_no_text` does, before the last chunk."""

    def __init__(self, n_vocab: int, chunks: int) -> None:
        self.n_vocab = n_vocab
        self.chunks = chunks
        self.rows: list[kld.PplRow] = []

    def see(self, line: str) -> str | None:
        row = kld.ppl_row(line)
        if row is None:
            return None
        self.rows.append(row)
        if len(self.rows) >= self.chunks:
            return None
        return predicts_no_text(row, self.n_vocab)
