"""A line priced as it runs (tuner.quality.engine_price.price_line): the perplexity run carries the printed line's KV
types, flash attention, placement, ubatch and engine levers; the reference logits are llama.cpp's bare launch at f16,
whichever engine's line is priced (issue 61: ik's -rtr once reached llama.cpp's reference run, which refused it); a line
that loads its weights into RAM is refused before any run where the model does not fit the RAM free."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import QualityError
from tuner.engine.kinds import IK_LLAMA
from tuner.quality import engine_price, perplexity

M = Path("/m.gguf")
IK_LINE = LaunchConfig(model=M, ctx=8192, parallel=2, engine=IK_LLAMA.name, cache_type_k=CacheType.Q8_0,
                       cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON, run_time_repack=True, merge_up_gate=True,
                       ubatch=16, threads=1, n_gpu_layers=99, n_cpu_moe=12, cache_ram_mib=1024)


@pytest.mark.fast
def test_the_priced_run_keeps_the_line_s_numerics_and_drops_what_changes_no_figure():
    run = perplexity.as_run(IK_LINE, M, IK_LLAMA.name, ctx=512)
    kept = {k: getattr(run, k) for k in ("cache_type_k", "cache_type_v", "flash_attn", "run_time_repack",
                                         "merge_up_gate", "ubatch", "threads", "n_gpu_layers", "n_cpu_moe", "engine")}
    assert kept == {"cache_type_k": CacheType.Q8_0, "cache_type_v": CacheType.Q8_0, "flash_attn": FlashAttn.ON,
                    "run_time_repack": True, "merge_up_gate": True, "ubatch": 16, "threads": 1, "n_gpu_layers": 99,
                    "n_cpu_moe": 12, "engine": IK_LLAMA.name}
    assert run.ctx is None and run.parallel is None and run.cache_ram_mib is None  # no figure depends on them
    assert perplexity.as_run(LaunchConfig(model=M, ubatch=2048), M, "llama.cpp", ctx=512).ubatch == 512  # one chunk


@pytest.mark.fast
def test_which_lines_need_a_price():
    assert engine_price.needs_price(IK_LINE)
    assert engine_price.needs_price(LaunchConfig(model=M, cache_type_v=CacheType.Q4_0, flash_attn=FlashAttn.ON))
    assert not engine_price.needs_price(LaunchConfig(model=M, threads=2, flash_attn=FlashAttn.OFF))


@pytest.mark.fast
def test_a_resident_line_is_refused_before_pricing_where_the_model_does_not_fit(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 4096)
    with pytest.raises(QualityError, match=r"loads all 0.0 GiB of m.gguf into RAM \(.*--run-time-repack.*\) and 0.0 GiB"
                                           r" is free: free RAM, or price it with --max-kld off"):
        engine_price.check_room(IK_LINE, model, available_bytes=1024)
    engine_price.check_room(IK_LINE, model, available_bytes=8192)  # it fits: no refusal
    engine_price.check_room(LaunchConfig(model=model), model, available_bytes=1024)  # mapped: the page cache's


def test_an_ik_line_is_priced_as_it_runs_against_llama_cpp_s_bare_reference(engine_loc, ik_loc, tmp_path):
    from tuner.models import demo

    # A model no earlier run priced: the reference logits are written here, by llama.cpp, from its bare launch.
    (made,) = [f for f in demo.make_demo_models(quants=["Q4_K_M"], out=tmp_path, engine=engine_loc,
                                                 seed=int(time.time()) % 100_000) if f.quant == "Q4_K_M"]
    line = LaunchConfig(model=made.path, engine=IK_LLAMA.name, cache_type_k=CacheType.Q8_0,
                        cache_type_v=CacheType.Q8_0, flash_attn=FlashAttn.ON, run_time_repack=True, ubatch=16,
                        threads=1)
    said: list[str] = []
    got = engine_price.price_line(line, ik_loc, engine_loc, ctx=128, chunks=2, on_step=said.append,
                                  available_bytes=2**40)
    argv = list(got.argv)
    assert argv[0] == str(ik_loc.tool("llama-perplexity"))
    for flag, value in (("-ctk", "q8_0"), ("-ctv", "q8_0"), ("-ub", "16"), ("-t", "1")):
        assert argv[argv.index(flag) + 1] == value, argv
    assert argv[argv.index("-fa") + 1] in ("on", "1") and ("--run-time-repack" in argv or "-rtr" in argv), argv
    assert "--kl-divergence" in argv
    assert any(s.startswith("writing reference logits") for s in said), said  # written now, by llama.cpp
    assert got.reference.startswith("llama.cpp") and got.engine.startswith("ik_llama.cpp")
    assert 0.0 <= got.kld_mean < 1.0 and got.chunks == 2 and "-ctk q8_0" in got.priced_as


@pytest.mark.fast
def test_a_price_against_a_model_that_predicts_no_text_says_nothing_and_refuses_nothing():
    # The Qwen3-30B-A3B shape with direct (untrained) weights: its own perplexity on the corpus was 230,547 over a
    # 151,936-token vocabulary; llama.cpp against itself with only --no-repack read a KLD of 0.53 there, ik's lines
    # 0.59-0.62 (results/benchmarks/which-engine-cpu.md). Trained SmolLM2-135M: 18.8 over 49,152.
    why = engine_price.says_nothing(230_547.1, 151_936)
    assert why is not None and why.startswith("the model predicts no text (its perplexity on the corpus, 230,547, ")
    assert engine_price.says_nothing(18.8, 49_152) is None and engine_price.says_nothing(None, 10) is None
    untrained = engine_price.LinePrice("ik_llama.cpp", "llama.cpp", 0.59, 0.002, 0.1, 2e5, 230_547.1, 512, 8,
                                       says_nothing=why)
    trained = replace(untrained, reference_ppl=18.8, says_nothing=None)
    assert not untrained.refused_by(0.01) and trained.refused_by(0.01) and not trained.refused_by(None)
