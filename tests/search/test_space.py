"""The search space: axes per machine, the quantized-V ⇒ flash-attention dependency, and memory gating."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from tuner.catalog.cards import find_card
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search import space

GIB = 2**30
MIB = 2**20
CPU_ONLY = Hardware("", 0, 0, 0.0, 0.0, 16 * GIB, 12 * GIB, 0, 20e9, 8, source="none")


@pytest.fixture(scope="module")
def model(demo_models):
    return demo_models[("qwen3moe", "Q4_K_M")]


@pytest.fixture(scope="module")
def info(model):
    return inspect_model(model)


def test_cpu_space_skips_n_cpu_moe_and_ubatch_for_short_prompts(model, info):
    sp = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=1, prompt_tokens=512)
    assert sp.n_cpu_moe is None and sp.ubatch == (None,) and sp.threads == (4, 7, 8) and sp.slots == (1,)
    long = space.build_space(model, info, CPU_ONLY, ctx=8192, parallel=1, prompt_tokens=4096)
    assert long.ubatch == (None, 1024, 2048)
    batch = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=4, prompt_tokens=256, concurrency=4)
    assert batch.slots == (1, 2, 4) and space.slot_counts(6) == (1, 2, 4, 6)
    with pytest.raises(UsageError):
        space.build_space(model, info, CPU_ONLY, ctx=0, parallel=1, prompt_tokens=8)


def test_gpu_space_searches_n_cpu_moe_near_the_fitting_boundary(model, info):
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9)
    roomy = space.build_space(model, info, hw, ctx=4096, parallel=2, prompt_tokens=512)
    assert roomy.n_cpu_moe == (0, space.N_CPU_MOE_ABOVE)  # everything fits on 16 GB: 0 and a few above
    # A card where the boundary moves with the KV pair: the range runs from the smallest boundary of any pair
    # to the largest plus a few, never from 0 to n_layer.
    f16 = LaunchConfig(model=model, ctx=4096, parallel=2, flash_attn=FlashAttn.ON)
    q4 = replace(f16, cache_type_k=CacheType.Q4_0, cache_type_v=CacheType.Q4_0)
    for mib in range(300, 400):
        small = replace(hw, vram_total_bytes=mib * 2**20, vram_free_bytes=mib * 2**20)
        lo, hi = space.fitting_boundary(info, q4, small, 0), space.fitting_boundary(info, f16, small, 0)
        if lo is not None and hi is not None and lo < hi:
            break
    else:
        pytest.fail("no card size puts the f16 and q4_0 boundaries apart")
    sp = space.build_space(model, info, small, ctx=4096, parallel=2, prompt_tokens=512, vram_margin_mib=0)
    assert sp.n_cpu_moe == (lo, min(info.n_layer, hi + space.N_CPU_MOE_ABOVE))


def test_kv_pairs_are_same_type_or_k_more_precise_and_quantized_v_forces_flash_attention(model, info):
    sp = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=1, prompt_tokens=512)
    rank = {CacheType.F16: 0, CacheType.Q8_0: 1, CacheType.Q4_0: 2}
    assert len(sp.kv_pairs) == 6 and all(rank[k] <= rank[v] for k, v in sp.kv_pairs)
    cfg = space.suggest(optuna.trial.FixedTrial({"kv": "q8_0/q4_0", "threads": 4}), sp)
    assert cfg.flash_attn is FlashAttn.ON and cfg.cache_type_v is CacheType.Q4_0 and cfg.threads == 4
    configs = list(space.iter_configs(sp))
    # (f16/f16 x 2 fa + 5 pairs with quantized V, fa on) x 3 thread counts
    assert len(configs) == (2 + 5) * 3 == sp.size
    for c in configs:
        assert not (c.cache_type_v.is_quantized and c.flash_attn is not FlashAttn.ON)
        assert space.make_config(sp, space.params_of(sp, c)) == c


def test_memory_model_gates_configs_with_constraint_values(model, info):
    tiny = replace(find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9), vram_total_bytes=1100 * 2**20,
                   vram_free_bytes=1100 * 2**20)
    sp = space.build_space(model, info, tiny, ctx=4096, parallel=1, prompt_tokens=512)
    all_gpu = space.make_config(sp, {"n_cpu_moe": 0})
    f = space.check(info, all_gpu, tiny)  # 1 GiB margin + weights + KV + compute + CUDA context > 1100 MiB
    assert not f.feasible and f.vram_over_mib > 0 and f.constraints["vram_over_mib"] == round(f.vram_over_mib, 3)
    assert space.check(info, all_gpu, tiny, vram_margin_mib=0).vram_over_mib < f.vram_over_mib
    roomy = replace(tiny, vram_total_bytes=16 * GIB, vram_free_bytes=16 * GIB)
    assert sp.n_cpu_moe == (info.n_layer, info.n_layer)  # nothing fits the small card: only all-on-host is asked
    guess = space.best_guess(space.build_space(model, info, roomy, ctx=4096, parallel=1, prompt_tokens=512), info,
                             roomy)
    assert guess is not None and guess.n_cpu_moe == 0 and guess.cache_type_k is CacheType.F16
    assert space.check(info, guess, roomy).feasible


def test_a_dense_model_that_does_not_fit_searches_ngl_and_its_line_carries_it(trained_model):
    """SmolLM2-135M (dense llama, 30 layers) on a card whose budget holds about half of it at 8K: the offload axis
    is -ngl (whole layers), not --n-cpu-moe (which moves routed experts: a dense model has none)."""
    from tuner.engine import flags
    from tuner.plan import placement

    info = inspect_model(trained_model)
    assert info.n_expert == 0 and placement.offload_of(info).flag == "-ngl"
    card = Hardware("RTX test", 12 * GIB, 12 * GIB, 360e9, 25e9, 16 * GIB, 12 * GIB, 0, 50e9, 8, source="catalog")
    whole = placement.fit_interval(info, LaunchConfig(model=trained_model, ctx=8192, parallel=1), card)
    assert whole.lo == 0 and whole.describe() == "fits with -ngl 31..0"  # every layer and the head fit
    sp = space.build_space(trained_model, info, card, ctx=8192, parallel=1, prompt_tokens=128)
    assert sp.n_gpu_layers is None and sp.n_cpu_moe is None and "whole model fits" in sp.n_cpu_moe_why

    # A budget that holds all 31 at f16 needs ~671 MiB (plan's table); give it 1 GiB margin + 500 MiB.
    tight = replace(card, vram_budget_override_bytes=(1024 + 500) * MIB)
    sp = space.build_space(trained_model, info, tight, ctx=8192, parallel=1, prompt_tokens=128)
    assert sp.n_cpu_moe is None and sp.n_gpu_layers is not None
    lo, hi = sp.n_gpu_layers
    def most(k: CacheType, v: CacheType) -> int:
        cfg = LaunchConfig(model=trained_model, ctx=8192, parallel=1, cache_type_k=k, cache_type_v=v,
                           flash_attn=FlashAttn.ON)
        return max(n for n in range(32) if space.check(info, replace(cfg, n_gpu_layers=n), tight).feasible)

    per_pair = {kv: most(*kv) for kv in sp.kv_pairs}
    assert hi == max(per_pair.values()) < 31  # the most layers that fit at any KV pair: not all
    assert per_pair[(CacheType.F16, CacheType.F16)] < hi  # a smaller cache leaves room for more layers
    assert lo == max(0, min(per_pair.values()) - space.N_CPU_MOE_ABOVE)
    assert "-ngl searched" in sp.n_cpu_moe_why and sp.describe()["n_gpu_layers"] == [lo, hi]
    guess = space.best_guess(sp, info, tight)
    # The memory model's pick: the most precise KV pair, with the most layers that fit at it.
    assert guess is not None and guess.n_gpu_layers == per_pair[(CacheType.F16, CacheType.F16)]
    assert f"-ngl {guess.n_gpu_layers}" in flags.launch_line(guess)
    grid = list(space.iter_configs(sp))
    assert {c.n_gpu_layers for c in grid} == set(range(lo, hi + 1))
    assert space.make_config(sp, space.params_of(sp, guess)) == guess
