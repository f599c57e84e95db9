"""The search space: axes per machine, the quantized-V ⇒ flash-attention dependency, and memory gating."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from tuner.catalog.cards import find_card
from tuner.core.config import CacheType, FlashAttn
from tuner.core.errors import UsageError
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search import space

GIB = 2**30
CPU_ONLY = Hardware("", 0, 0, 0.0, 0.0, 16 * GIB, 12 * GIB, 0, 20e9, 8, source="none")


@pytest.fixture(scope="module")
def model(demo_models):
    return demo_models[("qwen3moe", "Q4_K_M")]


@pytest.fixture(scope="module")
def info(model):
    return inspect_model(model)


def test_cpu_space_skips_n_cpu_moe_and_ubatch_for_short_prompts(model, info):
    sp = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=1, prompt_tokens=512)
    assert sp.n_cpu_moe is None and sp.ubatch == (None,) and sp.threads == (4, 8)
    long = space.build_space(model, info, CPU_ONLY, ctx=8192, parallel=1, prompt_tokens=4096)
    assert long.ubatch == (None, 1024, 2048)
    with pytest.raises(UsageError):
        space.build_space(model, info, CPU_ONLY, ctx=0, parallel=1, prompt_tokens=8)


def test_gpu_space_searches_every_n_cpu_moe(model, info):
    hw = find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9)
    sp = space.build_space(model, info, hw, ctx=4096, parallel=2, prompt_tokens=512)
    assert sp.n_cpu_moe == (0, info.n_layer)


def test_quantized_v_forces_flash_attention_and_params_round_trip(model, info):
    sp = space.build_space(model, info, CPU_ONLY, ctx=4096, parallel=1, prompt_tokens=512)
    cfg = space.suggest(optuna.trial.FixedTrial({"cache_type_k": "q8_0", "cache_type_v": "q4_0", "threads": 4}), sp)
    assert cfg.flash_attn is FlashAttn.ON and cfg.cache_type_v is CacheType.Q4_0 and cfg.threads == 4
    configs = list(space.iter_configs(sp))
    # 8 K types x (7 quantized V with fa on + 1 f16 V x 2 fa + bf16 V x 2 fa) x 2 thread counts
    assert len(configs) == 8 * (6 + 2 * 2) * 2 == sp.size
    for c in configs:
        assert not (c.cache_type_v.is_quantized and c.flash_attn is not FlashAttn.ON)
        assert space.make_config(sp, space.params_of(sp, c)) == c


def test_memory_model_gates_configs_with_constraint_values(model, info):
    tiny = replace(find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 60 * GIB, 50e9), vram_total_bytes=1100 * 2**20)
    sp = space.build_space(model, info, tiny, ctx=4096, parallel=1, prompt_tokens=512)
    all_gpu = space.make_config(sp, {"n_cpu_moe": 0})
    f = space.check(info, all_gpu, tiny)  # 1 GiB margin + weights + KV + compute + CUDA context > 1100 MiB
    assert not f.feasible and f.vram_over_mib > 0 and f.constraints["vram_over_mib"] == round(f.vram_over_mib, 3)
    assert space.check(info, all_gpu, tiny, vram_margin_mib=0).vram_over_mib < f.vram_over_mib
    roomy = replace(tiny, vram_total_bytes=16 * GIB)
    guess = space.best_guess(sp, info, roomy)
    assert guess is not None and guess.n_cpu_moe == 0 and guess.cache_type_k is CacheType.F16
    assert space.check(info, guess, roomy).feasible
