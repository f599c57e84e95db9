"""The compute buffer (tuner.plan.graph_arch, tuner.plan.graph_alloc) against llama.cpp's own projection, swept over
every architecture the shape writer knows, flash attention on and off, and ubatches from 512 to 8192."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.engine import breakdown
from tuner.machine.hardware import Hardware
from tuner.models import demo, gguf_reader, shape_model
from tuner.models.model_spec import ARCHS
from tuner.plan import graph_alloc as g
from tuner.plan import memory
from tuner.plan.placement import engine_agrees

MIB = 2**20
CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")
SWEEP_UBATCHES = (512, 2048, 8192)


@pytest.fixture(scope="module")
def small_shapes(tmp_path_factory):
    """One few-MB zero-weight GGUF per architecture (shape_model.small_spec), and the gpt-oss demo (F16)."""
    out = tmp_path_factory.mktemp("small")
    found = {arch: shape_model.write_shape_model(shape_model.small_spec(arch), "Q8_0", out / f"{arch}.gguf").path
             for arch in ARCHS}
    found["demo gpt-oss"] = demo.make_demo_models(arch="gpt-oss", out=out / "demo")[0].path
    return found


def _sweep(engine_loc, path, contexts, ubatches) -> list[str]:
    """Every (ctx, fa, ub) where the model's compute buffer is outside the one tolerance of llama-fit-params'."""
    info = gguf_reader.inspect_model(path)
    off = []
    for ctx, fa, ub in itertools.product(contexts, (FlashAttn.ON, FlashAttn.OFF), ubatches):
        cfg = LaunchConfig(model=path, ctx=ctx, flash_attn=fa, ubatch=ub, batch=ub, parallel=1)
        engine = breakdown.fit_params_breakdown(engine_loc, cfg).host_total("compute")
        ours = memory.estimate(info, cfg, CPU, fit_params=True).host.compute_bytes // MIB
        if not engine_agrees(ours, engine, info.tensor_bytes):
            off.append(f"c{ctx} fa-{fa.value} ub{ub}: ours {ours} MiB, llama.cpp {engine} MiB")
    return off


@pytest.mark.parametrize("arch", [*ARCHS, "demo gpt-oss"])
def test_compute_buffer_sweep_matches_llama_fit_params(arch, small_shapes, engine_loc):
    """Each architecture's layout (attention pattern, expert and shared-expert layout, biases, gating, delta-net
    layers, sliding window, dense lead layer) at -ub 512, 2048 and 8192 with -b as large, flash attention on and
    off, at a context where the logits peak and one where the attention does: within the tolerance the weights and
    KV hold (2 % of the engine's figure, at least 4 MiB). The figures come from llama-fit-params at test time."""
    assert _sweep(engine_loc, small_shapes[arch], (8192, 32768), SWEEP_UBATCHES) == []


def test_compute_buffer_with_slots_and_quantized_caches(small_shapes, engine_loc):
    """Split KV streams (-np 3 and 4: the tokens rounded up to a multiple of the slots, a mask per stream), a
    quantized cache (the Hadamard rotation of Q, K and V adds tensors of their size) and quantized K without flash
    attention, at -c 32768 -ub 4096, on every architecture."""
    off = []
    for arch in ARCHS:
        path = small_shapes[arch]
        info = gguf_reader.inspect_model(path)
        base = LaunchConfig(model=path, ctx=32768, ubatch=4096, batch=4096, parallel=1, flash_attn=FlashAttn.ON)
        for cfg in (replace(base, parallel=3), replace(base, parallel=4),
                    replace(base, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0),
                    replace(base, cache_type_k=CacheType.Q4_0, flash_attn=FlashAttn.OFF)):
            engine = breakdown.fit_params_breakdown(engine_loc, cfg).host_total("compute")
            ours = memory.estimate(info, cfg, CPU, fit_params=True).host.compute_bytes // MIB
            if not engine_agrees(ours, engine, info.tensor_bytes):
                off.append(f"{arch} np{cfg.parallel} {cfg.cache_type_k.value}/{cfg.cache_type_v.value} "
                           f"fa-{cfg.flash_attn.value}: ours {ours} MiB, llama.cpp {engine} MiB")
    assert off == []


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_compute_buffer_sweep_on_the_demo_models(arch, demo_models, engine_loc):
    """The demo models at -c 8192 -ub 4096 (the row ``plan --engine-check`` was off on) and around it."""
    assert _sweep(engine_loc, demo_models[(arch, "Q4_K_M")], (8192,), (512, 4096, 8192)) == []


def test_glm_4_5_air_at_64k_matches_llama_fit_params(engine_loc, tmp_path):
    """GLM-4.5-Air's real shape (46 layers, 96 query heads, a dense lead layer, 151K vocabulary) at 64K: the
    attention peaks, the figure is in GiB, and the model holds 16 MiB."""
    path = shape_model.write_catalog_model("GLM-4.5-Air:Q4_K_M", tmp_path / "glm.gguf").path
    assert _sweep(engine_loc, path, (65536,), (512, 4096)) == []


# --- the allocator alone (no engine) ----------------------------------------------------------------------------


def test_allocator_reuses_a_dying_parent_and_frees_at_the_last_consumer():
    """x (8 KiB, input) → a = W·x and p = W'·x (16 KiB each) → b = a + p → c = W2·b (32 KiB, output). The add
    takes a's block (a dies there, same layout); x and p die at their last consumers, and c lands where p was,
    above b: 8 + 16 + 32 KiB, not the 8 + 16 + 16 + 16 + 32 of a tensor per node."""
    gf = g.Graph()
    x = g.inp(256, 8)
    b = g.same_shape("ADD", g.mul_mat(g.weight(256, 512), x), g.mul_mat(g.weight(256, 512), x))
    c = g.mul_mat(g.weight(512, 1024), b)
    g.mark_outputs([c])
    gf.expand(c)
    assert [n.op for n in gf.nodes] == ["MUL_MAT", "MUL_MAT", "ADD", "MUL_MAT"]
    assert g.reserve_bytes(gf) == (8 + 16 + 32) * 1024


def test_free_blocks_take_the_best_fitting_hole():
    """``ggml_dyn_tallocr_alloc``: the smallest hole that fits, so a later large tensor still finds the large hole."""
    mem = g._FreeBlocks(32)
    offsets = [mem.alloc(n * 1024) for n in (16, 4, 8, 4)]
    assert offsets == [0, 16 * 1024, 20 * 1024, 28 * 1024]
    mem.free(0, 16 * 1024)
    mem.free(20 * 1024, 8 * 1024)
    assert mem.alloc(8 * 1024) == 20 * 1024  # first fit would have taken offset 0
    assert mem.alloc(16 * 1024) == 0
    assert mem.max_size == 32 * 1024


def test_compute_buffer_grows_with_the_ubatch_and_the_context(tmp_path):
    spec = shape_model.small_spec("qwen3moe")
    info = gguf_reader.inspect_model(shape_model.write_shape_model(spec, "Q8_0", tmp_path / "m.gguf").path)
    base = LaunchConfig(model=info.paths[0], ctx=8192, parallel=1, flash_attn=FlashAttn.OFF)
    sizes = [memory.estimate(info, replace(base, ubatch=ub, batch=ub), CPU).host.compute_bytes
             for ub in (1024, 2048, 4096)]
    assert sizes[0] < sizes[1] < sizes[2]
    longer = memory.estimate(info, replace(base, ctx=16384, ubatch=4096, batch=4096), CPU).host.compute_bytes
    assert longer > sizes[2]  # the KQ scores span the context without flash attention
