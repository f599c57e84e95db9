"""When a price's verdict is clear before its last chunk (tuner.quality.stopping): the reference of a model that
predicts no text, and a line's KL-divergence far above or below the floor. Pure: figures in the engine's row format."""

from __future__ import annotations

import math

import pytest

from tuner.quality import kld, stopping

FLOOR = 0.01

# Chunk rows of llama-perplexity --kl-divergence (perplexity.cpp ``kl_divergence``): running figures after each chunk.
# ik_llama.cpp's line on the trained SmolLM2 MoE (llama architecture: its MoE adds back the normalised input).
IK_ROWS = [
    "   1    2.1e+08 ±  3.0e+07    16.10000 ±    0.20000    17.80000 ±    0.30000    80.000 ±  0.300 %     0.392 ±  "
    "0.390 %",
    "   2    2.0e+08 ±  2.0e+07    16.00000 ±    0.15000    18.10000 ±    0.20000    80.100 ±  0.200 %     0.300 ±  "
    "0.250 %",
]
ROW = ("{n:4d}    17.8000 ±    1.2000     0.00100 ±    0.00050    {kld:10.5f} ±    0.00010     3.000 ±   0.100 %    "
       "96.000 ±   0.500 %")


def rows_for(chunk_kld: list[float]) -> list[str]:
    """The engine's rows for chunks with these own means (it prints running means with 5 decimals)."""
    return [ROW.format(n=i, kld=sum(chunk_kld[:i]) / i) for i in range(1, len(chunk_kld) + 1)]


def watch(lines: list[str], max_kld: float, chunks: int) -> tuple[int, str | None]:
    """(rows read, reason) for a KldWatch fed ``lines``: where it would stop the run."""
    w = stopping.KldWatch(max_kld, chunks)
    seen = 0
    for line in lines:
        seen += kld.kld_row(line) is not None
        if why := w.see(line):
            return seen, why
    return seen, None


@pytest.mark.fast
def test_a_kld_far_above_the_floor_is_refused_after_its_first_chunk_for_certain():
    # 17.8 nats in one chunk of 8 already put the mean of all 8 at 2.23 or more: no chunk to come can bring it under.
    assert watch(IK_ROWS, FLOOR, 8) == (1, "refused: the mean over all 8 chunks would read 2.23 or more (the 1 chunk "
                                           "read alone: a KL-divergence is never negative), above --max-kld 0.01")
    # The bound is exact: a first chunk at 8 x the floor is not yet a verdict, just above it is.
    assert stopping.kld_clear([0.08], FLOOR, 8) is None
    assert stopping.kld_clear([0.0801], FLOOR, 8) is not None
    assert stopping.kld_clear([0.0], 0.0, 8) is None  # a floor of 0 and identical numerics: nothing is above it


# A q8_0 KV cache on the trained SmolLM2 MoE (Q8_0), each chunk's own mean KLD as llama.cpp 0c1e57098 read them
# (running means 0.00352, 0.00373, 0.00443, 0.00448, 0.00439, 0.00448, 0.00449, 0.00454; 8 chunks of 512).
Q8_0_CHUNKS = [0.00352, 0.00394, 0.00583, 0.00463, 0.00403, 0.00493, 0.00455, 0.00496]


@pytest.mark.fast
def test_a_kld_below_the_floor_passes_once_the_whole_mean_s_99_pct_bound_is_below():
    n, why = watch(rows_for(Q8_0_CHUNKS), FLOOR, 8)
    assert why is not None and why.startswith("passes: the mean over all 8 chunks would read 0.006")
    assert why.endswith("(99 % bound from the 4 chunks read, their mean 0.00448), below --max-kld 0.01")
    # Four chunks in all (the race's price): the last one weighs a quarter, and three chunks bound it well enough.
    assert watch(rows_for(Q8_0_CHUNKS[:4]), FLOOR, 4)[0] == 3
    assert n == 4, n  # at three of eight, five chunks to come: t(0.995, 2) = 9.9 still reaches the floor
    assert stopping.kld_clear(Q8_0_CHUNKS[:1], FLOOR, 8) is None  # one chunk has no spread: never "passes"


@pytest.mark.fast
def test_a_kld_near_the_floor_reads_every_chunk():
    near = [0.008, 0.012, 0.009, 0.011, 0.010, 0.009, 0.012, 0.008]
    assert watch(rows_for(near), FLOOR, 8) == (8, None)
    # A wide spread keeps it reading too, far from the floor or not: 2 chunks at t = 63.7.
    assert stopping.kld_clear([0.001, 0.006], FLOOR, 8) is None
    assert stopping.kld_clear([0.05, 0.03], FLOOR, 8) is None  # 0.08 in all: not yet over 8 x 0.01
    assert stopping.kld_clear([0.05, 0.031], FLOOR, 8) is not None  # over it: refused for certain
    assert stopping.kld_clear([0.001] * 3 + [0.0011], FLOOR, 4) is None  # the last chunk: the run ends by itself


@pytest.mark.fast
def test_the_bound_is_two_sided_99_pct_student_t():
    assert stopping.t_995(1) == 63.657 and stopping.t_995(3) == 5.841 and stopping.t_995(200) == 2.750
    # Refused from the bound (not from the sum: 0.12 is under 64 x 0.01) once enough chunks agree.
    why = stopping.kld_clear([0.020, 0.021, 0.019, 0.020, 0.021, 0.019], FLOOR, 64)
    assert why is not None and why.startswith("refused: the mean over all 64 chunks would read 0.018")
    assert "(99 % bound from the 6 chunks read, their mean 0.02)" in why


@pytest.mark.fast
def test_a_reference_that_predicts_no_text_stops_after_its_first_chunk():
    # --ppl-output-type 1 rows (offset, running PPL, mean NLL, its per-token error), first chunk of each model, 512
    # tokens: an untrained Qwen3-30B-A3B-like shape (widths 2048, vocabulary 8,192), the trained SmolLM2 MoE (49,152),
    # and the random-weight demo (4,096), which predicts about as well as a uniform guess: not clear after one chunk.
    untrained = kld.ppl_row("       0  13884.5110  9.538529  0.047155")
    trained = kld.ppl_row("       0  16.6971  2.815235  0.178400")
    demo = kld.ppl_row("       0  4172.9469  8.336378  0.020037")
    assert untrained is not None and trained is not None and demo is not None
    why = stopping.predicts_no_text(untrained, 8192)
    assert why is not None and why.startswith("its perplexity so far, 13,885, is clearly no better than a uniform "
                                              "guess over its 8,192-token vocabulary (99 % bound 1")
    assert stopping.predicts_no_text(trained, 49_152) is None
    assert stopping.predicts_no_text(demo, 4096) is None
    assert kld.ppl_row(IK_ROWS[0]) is None and kld.ppl_row("perplexity: 4.65 seconds per pass") is None
    w = stopping.ReferenceWatch(8192, chunks=4)
    assert w.see("perplexity: calculating perplexity over 4 chunks") is None
    assert w.see("       0  13884.5110  9.538529  0.047155") == why
    last = stopping.ReferenceWatch(8192, chunks=1)  # the only chunk: the run ends by itself, the logits whole
    assert last.see("       0  13884.5110  9.538529  0.047155") is None


@pytest.mark.fast
def test_a_stopped_kld_run_is_read_from_its_rows():
    fig = kld.parse_kld_rows("\n".join(["kl_divergence: computing over 8 chunks, n_ctx=512", *IK_ROWS]), ctx=512)
    assert fig.n_chunks == 2 and fig.kld_mean == 18.1 and fig.kld_p99 is None and fig.kld_max is None
    assert fig.kld_chunks == pytest.approx((17.8, 18.4))
    assert fig.kld_mean_error == pytest.approx(0.3) and fig.same_top_pct == 0.3
    assert fig.ppl_base == pytest.approx(2.0e8 / math.exp(16.0))
    ppl = kld.parse_ppl_rows("\n".join(["       0  13884.5110  9.538529  0.047155",
                                        "     512  12727.4876  9.451519  0.034444"]))
    assert (ppl.ppl, ppl.n_chunks) == (12727.4876, 2) and ppl.ppl_error == pytest.approx(12727.4876 * 0.034444)
