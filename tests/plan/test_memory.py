from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.engine import breakdown
from tuner.machine.hardware import Hardware
from tuner.models import gguf_reader
from tuner.plan import memory
from tuner.plan.placement import engine_agrees

MIB = 2**20
CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")
GPU_12G = Hardware("RTX 3060", 12 * 2**30, 12 * 2**30, 360e9, 31.5e9, 64 * 2**30, 60 * 2**30, 0, 40e9, 8, "catalog")


def _check(info, cfg, truth, projected: bool) -> None:
    if projected and cfg.parallel is None:
        cfg = replace(cfg, parallel=1)  # llama-fit-params defaults to one slot; llama-server to 4
    est = memory.estimate(info, cfg, CPU, fit_params=projected)
    weights = est.engine_host_weights_bytes
    if projected:  # the projection maps without the repacked tensors; the plain table drops CPU_REPACK
        weights -= est.repack_bytes
        if truth.row("CPU_REPACK") is None:
            weights -= est.repack_bytes
    for ours, part in ((weights, "model"), (est.host.context_bytes, "context"), (est.host.compute_bytes, "compute")):
        assert engine_agrees(ours // MIB, truth.host_total(part), info.tensor_bytes), (part, ours // MIB, truth)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_matches_llama_server_actual(arch, demo_models, engine_loc, tmp_path):
    path = demo_models[(arch, "Q4_K_M")]
    info = gguf_reader.inspect_model(path)
    cfg = LaunchConfig(model=path, ctx=8192, parallel=2, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0)
    _, actual = breakdown.server_breakdown(engine_loc, cfg, tmp_path)
    _check(info, cfg, actual, projected=False)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_matches_fit_params_grid(arch, demo_models, engine_loc):
    path = demo_models[(arch, "F16")]
    info = gguf_reader.inspect_model(path)
    base = LaunchConfig(model=path)
    for cfg in (replace(base, ctx=16384, flash_attn=FlashAttn.OFF, ubatch=1024),
                replace(base, ctx=32768, flash_attn=FlashAttn.ON, cache_type_k=CacheType.Q4_0),
                replace(base, ctx=4096, parallel=4)):
        _check(info, cfg, breakdown.fit_params_breakdown(engine_loc, cfg), projected=True)


def test_kv_formula_and_padding(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q8_0")])
    cfg = LaunchConfig(model=info.paths[0], ctx=1000, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.F16)
    est = memory.estimate(info, cfg, CPU)
    assert est.n_ctx == 1024
    per_cell = 2 * 64 * (34 / 32 + 2)  # 2 KV heads of width 64, q8_0 K and f16 V
    assert est.host.kv_bytes == int(8 * 1024 * per_cell)
    split = memory.estimate(info, replace(cfg, ctx=1000, parallel=3), CPU)
    assert split.n_ctx == 3 * 512  # each of 3 slots gets ceil256(1024 / 3)


def test_hybrid_recurrent_state_per_slot(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen35moe", "Q8_0")])
    one = memory.estimate(info, LaunchConfig(model=info.paths[0], ctx=4096, parallel=1), CPU)
    four = memory.estimate(info, LaunchConfig(model=info.paths[0], ctx=4096, parallel=4), CPU)
    assert four.host.recurrent_bytes == 4 * one.host.recurrent_bytes > 0
    assert four.host.kv_bytes == one.host.kv_bytes  # KV only on the 2 full-attention layers, same cells


def test_cuda_placement_n_cpu_moe(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    experts = info.bytes_by_class()[gguf_reader.TensorClass.ROUTED_EXPERTS]
    embd = info.bytes_by_class()[gguf_reader.TensorClass.TOKEN_EMBD]
    cfg = LaunchConfig(model=info.paths[0], ctx=4096)
    gpu_all = memory.estimate(info, replace(cfg, n_cpu_moe=0), GPU_12G)
    cpu_all = memory.estimate(info, replace(cfg, n_cpu_moe=info.n_layer), GPU_12G)
    assert gpu_all.backend == "cuda" and gpu_all.host.weights_bytes == embd
    assert gpu_all.gpu.weights_bytes - cpu_all.gpu.weights_bytes == experts
    assert cpu_all.gpu.kv_bytes == gpu_all.gpu.kv_bytes > 0  # KV stays with the layer, on the GPU
    first = memory.estimate(info, replace(cfg, n_cpu_moe=1), GPU_12G)
    layer0_experts = info.layer_bytes(0)[gguf_reader.TensorClass.ROUTED_EXPERTS]
    assert gpu_all.gpu.weights_bytes - first.gpu.weights_bytes == layer0_experts


def test_verdicts(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q8_0")])
    cfg = LaunchConfig(model=info.paths[0], ctx=32768)
    assert memory.estimate(info, cfg, GPU_12G).verdict is memory.Verdict.FITS
    tiny_card = replace(GPU_12G, vram_total_bytes=1024 * MIB + 100 * MIB)
    assert memory.estimate(info, cfg, tiny_card).verdict is memory.Verdict.NEEDS_SPILL
    no_ram = replace(CPU, ram_available_bytes=10 * MIB)
    assert memory.estimate(info, cfg, no_ram).verdict is memory.Verdict.EXCEEDS_RAM


# Figures llama-fit-params -fitp on printed for shape-true real models (CPU build at the pinned commit,
# -np 1); scripts/bench_memory_model.py re-measures them. (target, ctx, fa, ubatch, component, MiB)
REAL_SCALE = [
    ("Qwen3-30B-A3B:Q4_K_M", 262144, FlashAttn.ON, None, "compute", 344),
    ("Qwen3-30B-A3B:Q4_K_M", 131072, FlashAttn.OFF, None, "compute", 8478),
    ("Qwen3-30B-A3B:Q4_K_M", 32768, FlashAttn.ON, 2048, "compute", 1219),
    ("Qwen3-30B-A3B:Q4_K_M", 32768, FlashAttn.ON, None, "context", 3072),
    ("GLM-4.5-Air:Q4_K_M", 262144, FlashAttn.ON, None, "compute", 426),
    ("GLM-4.5-Air:Q4_K_M", 32768, FlashAttn.OFF, None, "compute", 6292),
    ("GLM-4.5-Air:Q4_K_M", 32768, FlashAttn.ON, None, "context", 5888),  # 46 layers: the NextN block has no KV
    ("gpt-oss-20b:MXFP4_MOE", 32768, FlashAttn.ON, 2048, "compute", 1638),
    ("gpt-oss-20b:MXFP4_MOE", 32768, FlashAttn.OFF, None, "compute", 4198),
]


@pytest.fixture(scope="module")
def real_shapes(tmp_path_factory):
    from tuner.models import shape_model

    out = tmp_path_factory.mktemp("real")
    targets = {t[0] for t in REAL_SCALE}
    return {t: gguf_reader.inspect_model(shape_model.write_catalog_model(t, out / f"{t.replace(':', '-')}.gguf").path)
            for t in targets}


@pytest.mark.parametrize(("target", "ctx", "fa", "ub", "component", "engine_mib"), REAL_SCALE)
def test_real_scale_figures(target, ctx, fa, ub, component, engine_mib, real_shapes):
    info = real_shapes[target]
    cfg = LaunchConfig(model=info.paths[0], ctx=ctx, flash_attn=fa, ubatch=ub, batch=2048, parallel=1)
    est = memory.estimate(info, cfg, CPU, fit_params=True)
    got = est.host.compute_bytes if component == "compute" else est.host.context_bytes
    assert engine_agrees(got // MIB, engine_mib, info.tensor_bytes), (got // MIB, engine_mib)


def test_nextn_block_weights_are_not_loaded(real_shapes):
    info = real_shapes["GLM-4.5-Air:Q4_K_M"]
    assert memory.mtp_layers(info) == {46}
    est = memory.estimate(info, LaunchConfig(model=info.paths[0], ctx=4096, repack=False), CPU)
    nextn = sum(t.n_bytes for t in info.tensors if t.layer == 46)
    assert est.host.weights_bytes == info.tensor_bytes - nextn
    assert abs(est.host.weights_bytes // MIB - 67175) <= 16  # llama-fit-params --no-repack


def test_effective_config_spells_out_engine_defaults():
    base = LaunchConfig(model=Path("m.gguf"), ctx=4096, parallel=1)
    spelled = LaunchConfig(model=Path("m.gguf"), ctx=4096, parallel=1, threads=2, threads_batch=2,
                           flash_attn=FlashAttn.ON, batch=2048, ubatch=512, n_cpu_moe=0)
    assert memory.effective_config(base, 2) == memory.effective_config(spelled, 2)
    assert memory.effective_config(base, 4) != memory.effective_config(spelled, 4)  # 2 threads of 4 cores
    assert memory.effective_config(base, 2) != memory.effective_config(replace(base, flash_attn=FlashAttn.OFF), 2)


# --- prompt reuse: context checkpoints, a full SWA cache, the host prompt cache --------------------------------


@pytest.fixture(scope="module")
def swa_demo(engine_loc, tmp_path_factory):
    from tuner.models import demo

    path = demo.make_demo_models(arch="gpt-oss", out=tmp_path_factory.mktemp("swa"), engine=engine_loc)[0].path
    return gguf_reader.inspect_model(path)


def _session_log(engine_loc, cfg, tmp_path) -> str:
    from tuner.measure import session, session_run

    maker = session.session_maker(None, 1024, 8)
    trial = session_run.run_session_trial(engine_loc, replace(cfg, threads=1), maker, 8, log_dir=tmp_path, trace=True)
    return trial.log_path.read_text(errors="replace")


def test_checkpoint_size_matches_the_engine_log_hybrid(demo_models, engine_loc, tmp_path):
    from tuner.measure import session_run

    info = gguf_reader.inspect_model(demo_models[("qwen35moe", "Q8_0")])
    cfg = LaunchConfig(model=info.paths[0], ctx=2048, parallel=1, ctx_checkpoints=6)
    made = session_run.checkpoints_from_log(_session_log(engine_loc, cfg, tmp_path))
    ours = memory.checkpoint_bytes(info, cfg, memory.resolve(info, cfg, "cpu")) / MIB
    assert made and {c.of for c in made} == {6} and max(c.number for c in made) <= 6
    for c in made:  # the recurrent state of one sequence, whatever the position
        assert abs(c.size_mib - ours) <= 0.01 * ours + 0.01, (c, ours)
    est = memory.estimate(info, cfg, CPU)
    assert est.host.reuse_bytes == 6 * memory.checkpoint_bytes(info, cfg, memory.resolve(info, cfg, "cpu"))


def test_checkpoint_size_matches_the_engine_log_sliding_window(swa_demo, engine_loc, tmp_path):
    from tuner.measure import session_run

    info = swa_demo
    cfg = LaunchConfig(model=info.paths[0], ctx=2048, parallel=1)
    made = session_run.checkpoints_from_log(_session_log(engine_loc, cfg, tmp_path))
    bound = memory.checkpoint_bytes(info, cfg, memory.resolve(info, cfg, "cpu")) / MIB
    # A checkpoint holds the window: the last n_swa (128) positions once the prompt is that long, fewer before.
    long = [c.size_mib for c in made if c.n_tokens > info.n_swa]
    assert long and all(abs(size - bound) <= 0.01 * bound + 0.001 for size in long), (long, bound)
    assert all(c.size_mib < bound for c in made if c.n_tokens < info.n_swa)
    assert memory.checkpoint_bytes(info, replace(cfg, swa_full=True), memory.resolve(info, cfg, "cpu")) == 0


def test_swa_full_context_matches_the_engine(swa_demo, engine_loc, tmp_path):
    info = swa_demo
    cfg = LaunchConfig(model=info.paths[0], ctx=8192, parallel=1)
    engine, ours = [], []
    for c in (cfg, replace(cfg, swa_full=True)):  # the context term (KV): the compute term is fitted elsewhere
        _, actual = breakdown.server_breakdown(engine_loc, c, tmp_path)
        engine.append(actual.host_total("context"))
        ours.append(memory.estimate(info, c, CPU).host.context_bytes / MIB)
    # What --swa-full costs: half the layers go from a 128 + 512-token window (padded) to all 8192 cells.
    assert engine[1] - engine[0] >= 14, engine
    assert all(abs(o - e) <= 1 for o, e in zip(ours, engine, strict=True)), (ours, engine)


def test_prompt_cache_limit_is_the_engine_s(demo_models, engine_loc, tmp_path):
    from tuner.measure import session_run

    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q8_0")])
    cfg = LaunchConfig(model=info.paths[0], ctx=2048, parallel=1, cache_ram_mib=300)
    assert session_run.prompt_cache_limit_mib(_session_log(engine_loc, cfg, tmp_path)) == 300
    est, plain = memory.estimate(info, cfg, CPU), memory.estimate(info, replace(cfg, cache_ram_mib=None), CPU)
    assert est.host.total_bytes - plain.host.total_bytes == 300 * MIB
    assert est.host.reuse_bytes == 300 * MIB  # plain attention: no checkpoints (server-context.cpp do_checkpoint)


def test_reuse_costs_scale_with_checkpoints_and_slots(demo_models):
    info = gguf_reader.inspect_model(demo_models[("qwen35moe", "Q8_0")])
    one = memory.estimate(info, LaunchConfig(model=info.paths[0], ctx=4096, parallel=1), CPU)
    four = memory.estimate(info, LaunchConfig(model=info.paths[0], ctx=4096, parallel=4, ctx_checkpoints=8), CPU)
    per = one.host.reuse_bytes // 32  # the engine's default: 32 checkpoints per slot
    assert per == one.host.recurrent_bytes > 0  # one checkpoint is the recurrent state of one sequence
    assert four.host.reuse_bytes == 4 * 8 * per
    off = memory.estimate(info, LaunchConfig(model=info.paths[0], ctx=4096, parallel=1, ctx_checkpoints=0), CPU)
    assert off.host.reuse_bytes == 0 and off.host.total_bytes == one.host.total_bytes - one.host.reuse_bytes


# --- big ubatches (prompt-heavy workloads: -ub 4096 with -b 4096) -------------------------------------------------

UB_SHAPES = ("Qwen3-30B-A3B:Q4_K_M", "Qwen3.5-35B-A3B:Q4_K_M", "gpt-oss-20b:MXFP4_MOE", "GLM-4.5-Air:Q4_K_M")


@pytest.fixture(scope="module")
def ub_shapes(tmp_path_factory):
    from tuner.models import shape_model

    out = tmp_path_factory.mktemp("ub")
    return {t: gguf_reader.inspect_model(shape_model.write_catalog_model(t, out / f"{t.replace(':', '-')}.gguf").path)
            for t in UB_SHAPES}


def test_a_ubatch_above_the_batch_is_clamped_as_the_engine_does(demo_models):
    """``llama_context``: ``n_batch = min(n_ctx, n_batch)``, ``n_ubatch = min(n_batch, n_ubatch)``: -ub 4096 with the
    default -b 2048 runs (and is priced) at 2048; with -b 4096 at 4096, and the compute buffer doubles."""
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    cfg = LaunchConfig(model=info.paths[0], ctx=16384, parallel=1, flash_attn=FlashAttn.OFF)
    assert memory.resolve(info, replace(cfg, ubatch=4096), "cpu").n_ubatch == 2048
    assert memory.resolve(info, replace(cfg, ubatch=4096, batch=4096), "cpu").n_ubatch == 4096
    assert memory.resolve(info, replace(cfg, ctx=3000, ubatch=4096, batch=4096), "cpu").n_ubatch == 3072
    two, four = (memory.estimate(info, replace(cfg, ubatch=u, batch=u), CPU, fit_params=True).host.compute_bytes
                 for u in (2048, 4096))
    assert four == 2 * two  # as llama-fit-params projects it: every token an output, everything per token
    served = memory.estimate(info, replace(cfg, ubatch=4096, batch=4096), CPU).host.compute_bytes
    assert two < served < four  # llama-server reserves one row of logits per slot (server_output_limits)


@pytest.mark.parametrize(("target", "ctx"), [(t, 32768) for t in UB_SHAPES] + [("Qwen3-30B-A3B:Q4_K_M", 262144)])
def test_compute_buffer_at_ubatch_4096_matches_llama_fit_params(target, ctx, ub_shapes, engine_loc):
    """The compute buffer at -ub 4096 -b 4096 (flash attention on, as quantized V needs) against llama.cpp's own
    projection of real-scale shapes, within the tolerance every other component holds. At 32K the logits peak
    (Qwen3.5's 248K vocabulary: 3,976 MiB); at 256K the KQ mask and the experts' activations do (2,752 MiB)."""
    info = ub_shapes[target]
    cfg = LaunchConfig(model=info.paths[0], ctx=ctx, ubatch=4096, batch=4096, flash_attn=FlashAttn.ON, parallel=1)
    truth = breakdown.fit_params_breakdown(engine_loc, cfg)
    est = memory.estimate(info, cfg, CPU, fit_params=True)
    for ours, part in ((est.host.compute_bytes, "compute"), (est.host.context_bytes, "context")):
        assert engine_agrees(ours // MIB, truth.host_total(part), info.tensor_bytes), (part, ours // MIB, truth)
    assert truth.host_total("compute") > 3 * memory.estimate(info, replace(cfg, ubatch=None, batch=None),
                                                             CPU).host.compute_bytes // MIB  # it grew with -ub


def test_compute_buffer_at_ubatch_4096_on_a_loaded_demo_model(demo_models, engine_loc, tmp_path):
    """llama-server's at-exit breakdown of a model it loaded at -ub 4096 -b 4096, flash attention off (the KQ scores
    peak) and on with q8_0 K/V (the KQ mask and the experts' activations peak; a quantized cache adds the Hadamard
    rotation of Q, K and V): the allocated buffer is what the reserve graph placed by ggml's allocator says, within
    the one tolerance (the model was 16 MiB over here before it followed the allocator)."""
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    base = LaunchConfig(model=info.paths[0], ctx=8192, parallel=1, ubatch=4096, batch=4096)
    for cfg in (replace(base, flash_attn=FlashAttn.OFF),
                replace(base, flash_attn=FlashAttn.ON, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0)):
        _, actual = breakdown.server_breakdown(engine_loc, cfg, tmp_path)
        ours = memory.estimate(info, cfg, CPU).host.compute_bytes // MIB
        assert engine_agrees(ours, actual.host_total("compute"), info.tensor_bytes), (cfg.flash_attn, ours, actual)
