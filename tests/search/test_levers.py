"""The prompt-side levers of host experts (tuner/search/levers.py): the op-offload threshold as an axis, asked only
with op offload on, and priced by the plan."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from tuner.catalog.cards import find_card
from tuner.core.config import FlashAttn, LaunchConfig
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search import levers, space

GIB = 2**30
CPU_ONLY = Hardware("", 0, 0, 0.0, 0.0, 16 * GIB, 12 * GIB, 0, 20e9, 8, source="none")


@pytest.fixture(scope="module")
def shape():
    from tuner.hub.resolve import resolve_model

    return resolve_model("qwen3.6-35b-a3b:Q4_K_M", header_only=True).path


@pytest.fixture(scope="module")
def info(shape):
    return inspect_model(shape)


@pytest.fixture(scope="module")
def slow_link():
    return find_card("RTX 4060 Ti 16GB").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)


def test_thresholds_are_those_the_measured_prompts_chunks_reach():
    """A prompt of P tokens at ubatch U offloads chunks of min(P, U): a threshold above every chunk of the space
    would only repeat op offload off."""
    assert levers.min_batch_choices(8192, (None, 1024, 2048, 4096, 8192)) == (None, 512, 4096)
    assert levers.min_batch_choices(2048, (None, 1024, 2048)) == (None, 512)
    assert levers.min_batch_choices(512, (None,)) == (None, 512)
    assert levers.min_batch_choices(256, (None,)) == (None,)  # a short prompt's one chunk stays under 512


def test_the_op_offload_threshold_is_an_axis_only_where_op_offload_is_searched(shape, info, slow_link):
    sp = space.build_space(shape, info, slow_link, ctx=32768, parallel=1, prompt_tokens=8192)
    assert sp.op_offload == (True, False) and sp.op_offload_min_batch == (None, 512, 4096)
    assert sp.describe()["op_offload_min_batch"] == [None, 512, 4096]
    assert any("GGML_OP_OFFLOAD_MIN_BATCH: 32, 512, 4096" in n for n in sp.left_out)
    configs = list(space.iter_configs(sp))
    assert {(c.op_offload, c.op_offload_min_batch) for c in configs} == {(True, None), (True, 512), (True, 4096),
                                                                         (False, None)}
    on_512 = next(c for c in configs if c.op_offload_min_batch == 512 and c.no_host)
    assert space.make_config(sp, space.params_of(sp, on_512)) == on_512  # seeds map back onto the space
    off = replace(on_512, op_offload=False, op_offload_min_batch=None)
    assert "op_offload_min_batch" not in space.params_of(sp, off)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    asked = []
    for _ in range(60):
        trial = study.ask()
        cfg = space.suggest(trial, sp)
        asked.append((dict(trial.params), cfg))
    # Never asked with op offload off (no trial spent on off at each threshold); every threshold asked with on.
    assert all("op_offload_min_batch" in p for p, c in asked if c.op_offload)
    assert all("op_offload_min_batch" not in p and c.op_offload_min_batch is None for p, c in asked
               if not c.op_offload)
    assert {c.op_offload_min_batch for _, c in asked if c.op_offload} == {None, 512, 4096}
    short = space.build_space(shape, info, slow_link, ctx=32768, parallel=1, prompt_tokens=256)
    assert short.op_offload == (True, False) and short.op_offload_min_batch == (None,)
    assert "op_offload_min_batch" not in short.describe()
    big = find_card("RTX 5090").hardware(64 * GIB, 64 * GIB, 89.6e9, 8, 0)
    for none in (space.build_space(shape, info, CPU_ONLY, ctx=32768, parallel=1, prompt_tokens=8192),
                 space.build_space(shape, info, slow_link, ctx=32768, parallel=1, prompt_tokens=8192, device="none"),
                 space.build_space(shape, info, big, ctx=8192, parallel=1, prompt_tokens=8192)):
        assert none.op_offload_min_batch == (None,) and "op_offload_min_batch" not in none.describe()
        assert {c.op_offload_min_batch for c in space.iter_configs(none)} == {None}


def test_a_threshold_above_the_ubatch_prices_the_host_experts_on_the_cpu(shape, info, slow_link):
    """Above the ubatch no batch reaches the threshold: no copy of the largest host weight in the GPU's compute
    buffer and no PCIe ceiling, as with op offload off; at or below it, the default's pricing. (A 128-token ubatch,
    where the copied weight outweighs the graph's own buffer.)"""
    from tuner.plan import memory, roofline

    on = LaunchConfig(model=shape, ctx=8192, parallel=1, n_cpu_moe=30, flash_attn=FlashAttn.ON, ubatch=128)
    above, at = replace(on, op_offload_min_batch=129), replace(on, op_offload_min_batch=128)
    off = replace(on, op_offload=False)
    e_on, e_above, e_at = (memory.estimate(info, c, slow_link) for c in (on, above, at))
    assert e_on.gpu_offload_copy_bytes > 0 and e_at.gpu_offload_copy_bytes == e_on.gpu_offload_copy_bytes
    assert e_above.gpu_offload_copy_bytes == 0
    assert e_above.gpu.compute_bytes == memory.estimate(info, off, slow_link).gpu.compute_bytes
    assert roofline.roofline(info, above, slow_link).prompt_tok_s is None
    assert roofline.roofline(info, at, slow_link).prompt_tok_s == roofline.roofline(info, on, slow_link).prompt_tok_s
