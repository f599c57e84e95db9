"""The prompt-side levers of host experts (tuner/search/levers.py): the op-offload threshold, tried by the agent
session stage rather than the bench search, and priced by the plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner.catalog.cards import find_card
from tuner.core.config import FlashAttn, LaunchConfig
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search import space

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


def test_the_bench_search_has_no_threshold_axis_it_could_not_tell_apart(shape, info, slow_link):
    """llama-bench times a prompt in full ubatches: a threshold at or below the ubatch measures as op offload on,
    one above it as off (searched on its own). Trials on it would be spent on copies of the same measurement."""
    sp = space.build_space(shape, info, slow_link, ctx=32768, parallel=1, prompt_tokens=8192)
    assert sp.op_offload == (True, False) and not hasattr(sp, "op_offload_min_batch")
    assert "op_offload_min_batch" not in sp.describe()
    assert {c.op_offload_min_batch for c in space.iter_configs(sp)} == {None}
    assert any("GGML_OP_OFFLOAD_MIN_BATCH, 32 tokens) is tried by the agent session stage" in n for n in sp.left_out)


def test_the_session_stage_tries_the_threshold_at_the_lines_ubatch_where_experts_live_in_ram(shape, info,
                                                                                              slow_link):
    """Whole sessions tell the threshold apart: a turn shorter than a ubatch runs the host experts on the CPU, full
    ubatches still copy them up. One arm, at the tuned line's ubatch; none without a GPU, with op offload off, or
    with every expert on the card. The arm's line carries the variable (a llama-server reads it from its
    environment)."""
    from tuner.engine import flags
    from tuner.search import session_stage

    default = LaunchConfig(model=shape, ctx=32768, parallel=1)
    tuned = replace(default, n_cpu_moe=30, flash_attn=FlashAttn.ON)
    arms, _ = session_stage.stage_arms(default, tuned, info, slow_link, None)
    by_label = dict(arms)
    arm = by_label.get("tuned + op offload from 512 tokens")
    assert arm is not None and arm == replace(tuned, op_offload_min_batch=512)
    assert flags.launch_line(arm).startswith("GGML_OP_OFFLOAD_MIN_BATCH=512 llama-server ")
    big_ub = dict(session_stage.stage_arms(default, replace(tuned, ubatch=2048, batch=2048), info, slow_link,
                                           None)[0])
    assert any(c.op_offload_min_batch == 2048 for c in big_ub.values())
    for hw, line in ((CPU_ONLY, tuned), (slow_link, replace(tuned, op_offload=False)),
                     (slow_link, replace(tuned, n_cpu_moe=None))):
        labels = [label for label, _ in session_stage.stage_arms(default, line, info, hw, None)[0]]
        assert not any("op offload from" in label for label in labels), (hw.gpu_name, line.op_offload)


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
