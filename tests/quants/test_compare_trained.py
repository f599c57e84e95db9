"""compare-quants' quality claims on trained weights: quants made here (the made-quant path, incl. a MoE mix) from
the trained MoE (SmolLM2-135M-Instruct split exactly into 8 experts, tests/trained.py), their KL-divergence against
it in llama.cpp's published order for trained weights (tools/perplexity/README.md: Q8_0 far below the 3-4 bit
types), and the pick by a loss budget over those engine figures. Random weights cannot answer these: every quant of
noise costs about the same. Speed is left out (the same for both rows): the pick under a loss budget alone is the
fastest row within it, so a budget that only Q8_0 meets must answer Q8_0 whatever the speeds.

SmolLM2's rows are 576 (and the experts' down rows 192) wide, not a multiple of 256: llama-quantize gives every
K-quant tensor its fallback type (src/llama-quant.cpp ``tensor_type_fallback``: Q3_K → Q4_0, Q4_K → Q5_0,
Q5_K → Q5_1, Q6_K → Q8_0), so the mix's experts are Q4_0 here, and a Q6_K file is a Q8_0 file."""

from __future__ import annotations

from tuner.models import quantize
from tuner.quality import perplexity
from tuner.quants import pick as quant_pick

RECIPES = "Q8_0,Q3_K_M/Q8_0"


def test_made_quants_of_a_trained_moe_keep_the_published_order_and_the_loss_budget_picks(engine_loc, trained_moe,
                                                                                        monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "mt"))
    made = {r.name: quantize.make(engine_loc, trained_moe, tmp_path, r)
            for r in quantize.parse_recipes(RECIPES, quantize.available_types(engine_loc))}
    q8, mix = (perplexity.measure(engine_loc, made[n].path, reference=trained_moe, ctx=256, chunks=3)
               for n in ("Q8_0", "Q3_K_M/Q8_0"))
    assert q8.kld_mean is not None and mix.kld_mean is not None
    # The mix keeps attention, embeddings and output at Q8_0 and puts the experts (most of the weights) at Q3_K_M.
    assert made["Q3_K_M/Q8_0"].size_bytes < 0.75 * made["Q8_0"].size_bytes
    # Published for trained weights: Q8_0's KLD is about 1e-3, 3-bit types' tens of times larger.
    assert 0 < q8.kld_mean < 0.01 and mix.kld_mean > 5 * q8.kld_mean, (q8.kld_mean, mix.kld_mean)
    assert q8.same_top_pct is not None and mix.same_top_pct is not None and q8.same_top_pct > mix.same_top_pct
    cands = [quant_pick.Candidate(n, made[n].size_bytes, 1.0, 0.1, r.kld_mean or 0.0,
                                  quant_pick.kld_error(r.kld_mean_error))
             for n, r in (("Q8_0", q8), ("Q3_K_M/Q8_0", mix))]
    high = cands[0].kld_mean + (cands[0].kld_error or 0)
    low = cands[1].kld_mean - (cands[1].kld_error or 0)
    assert high < low, cands  # the intervals do not overlap
    answer = quant_pick.pick(cands, max_kld=(high + low) / 2)
    assert answer.quant == "Q8_0" and answer.verdicts["Q3_K_M/Q8_0"] == quant_pick.OVER_LOSS, answer
