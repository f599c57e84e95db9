"""Flash-attention vector kernels of a CUDA build: which K/V pairs have one, learnt from the build's system info
(a short probe per engine, cached with the capabilities) or from the warning its log prints for a pair without
one, and the search leaving such a pair out with the build flag that adds it."""

from __future__ import annotations

import pytest

from tuner.core.config import CacheType
from tuner.engine import build, caps
from tuner.engine.caps import FaKernels, fa_kernels_from_system_info
from tuner.machine.hardware import Hardware
from tuner.models.gguf_reader import inspect_model
from tuner.search import space

GIB = 2**30
CPU_ONLY = Hardware("", 0, 0, 0.0, 0.0, 16 * GIB, 12 * GIB, 0, 20e9, 8, source="none")
F16, Q8, Q4 = CacheType.F16, CacheType.Q8_0, CacheType.Q4_0

# What llama_print_system_info prints for a CUDA build of the pin at its default GGML_CUDA_FA_QUANTS
# (ggml_backend_cuda_get_features: the CMake list with ';' written as ','), beside the CPU backend's features.
DEFAULT_CUDA_INFO = ("system_info: n_threads = 16 (n_threads_batch = 16) / 32 | CUDA : ARCHS = 890 | "
                     "FA_QUANTS = q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
                     "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | REPACK = 1 | ")
# ggml_cuda_flash_attn_ext_vec's warning (ggml-cuda/fattn.cu), as a server log line carries it.
NO_KERNEL_LINE = ("0.02.113.540 W ggml_cuda_flash_attn_ext_vec: no FlashAttention vector kernel compiled for K/V "
                  "types f16-q8_0, converting K and V to f16 instead (slow). Add \"f16-q8_0\" to GGML_CUDA_FA_QUANTS "
                  "to compile it.")


@pytest.fixture(scope="module")
def model(demo_models):
    return demo_models[("qwen3moe", "Q4_K_M")]


def _space(model, fa: FaKernels | None) -> space.SearchSpace:
    return space.build_space(model, inspect_model(model), CPU_ONLY, ctx=4096, parallel=1, prompt_tokens=512,
                             fa_kernels=fa)


def test_a_default_cuda_build_leaves_the_mixed_pairs_out_naming_the_flag(model):
    fa = fa_kernels_from_system_info(DEFAULT_CUDA_INFO, "cuda")
    assert fa.pairs == ("f16-f16", "q4_0-q4_0", "q8_0-q8_0", "bf16-bf16")
    assert fa.has("q8_0", "q8_0") and not fa.has("f16", "q8_0")
    sp = _space(model, fa)
    assert sp.kv_pairs == ((F16, F16), (Q8, Q8), (Q4, Q4))
    assert len(sp.left_out) == 3
    note = sp.left_out[0]
    assert note.startswith("K/V f16/q8_0 left out") and "-DGGML_CUDA_FA_QUANTS=<its list>,f16-q8_0" in note
    assert "GGML_CUDA_FA_QUANTS=q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16 in the build's system info" in note
    assert "K/V q8_0/q4_0 left out" in sp.left_out[2]


def test_the_engine_log_line_leaves_its_pair_out(model):
    learnt = FaKernels().learn_from_log("llama_context: n_ctx = 4096\n" + NO_KERNEL_LINE + "\nsrv update_slots\n")
    assert learnt.missing == ("f16-q8_0",) and not learnt.has("f16", "q8_0") and learnt.has("f16", "q4_0")
    assert learnt.learn_from_log(NO_KERNEL_LINE) is learnt  # nothing new: the same value
    sp = _space(model, learnt)
    assert (F16, Q8) not in sp.kv_pairs and len(sp.kv_pairs) == len(space.KV_PAIRS) - 1
    (note,) = sp.left_out
    assert "K/V f16/q8_0 left out" in note and "its log said so" in note and "GGML_CUDA_FA_QUANTS" in note


def test_builds_that_list_all_pairs_or_none_and_the_cpu():
    assert fa_kernels_from_system_info(DEFAULT_CUDA_INFO.replace("q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16", "all"),
                                       "cuda").pairs is None
    assert fa_kernels_from_system_info("CUDA : ARCHS = 860 | FA_ALL_QUANTS = 1 | USE_GRAPHS = 1 |", "cuda").pairs \
        is None
    older = fa_kernels_from_system_info("CUDA : ARCHS = 860 | USE_GRAPHS = 1 | CPU : AVX2 = 1 |", "cuda")
    assert older.pairs == caps.FA_PAIRS_BEFORE_FA_QUANTS and not older.has("f16", "q4_0")
    # A user's list gets f16-f16 beside it, as ggml_cuda_fattn_vec_instances compiles it always.
    mine = fa_kernels_from_system_info("CUDA : FA_QUANTS = q8_0-q4_0 |", "cuda")
    assert mine.has("f16", "f16") and mine.has("q8_0", "q4_0") and not mine.has("q8_0", "q8_0")
    cpu = fa_kernels_from_system_info("system_info: n_threads = 2 / 2 | CPU : SSE3 = 1 | AVX2 = 1 |", "cpu")
    assert cpu == FaKernels() and cpu.has("f16", "q4_0")


def test_the_cuda_build_compiles_every_pair_the_search_tries(monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "89")
    flag = next(f for f in build.cmake_flags(build.Backend.CUDA) if f.startswith("-DGGML_CUDA_FA_QUANTS="))
    listed = flag.split("=", 1)[1]
    for entry in listed.split(","):  # the engine's own rule (ggml/cmake/common.cmake): <type_K>-<type_V>
        k, v = entry.split("-")
        assert k in caps.FA_VEC_TYPES and v in caps.FA_VEC_TYPES, entry
    # What that build's system info will say, read back: every pair of the search's KV axis has its kernel.
    built = fa_kernels_from_system_info(f"CUDA : ARCHS = 890 | FA_QUANTS = {listed} | USE_GRAPHS = 1 |", "cuda")
    missing = [space.kv_label(k, v) for k, v in space.KV_PAIRS if not built.has(k.value, v.value)]
    assert missing == []
    assert "-DGGML_CUDA_FA_QUANTS" not in " ".join(build.cmake_flags(build.Backend.CPU))


def test_the_probe_reads_the_real_engine_system_info(engine_loc, tmp_path, monkeypatch):
    line = build.system_info(engine_loc)
    assert "system_info:" in line and "CPU :" in line and "CUDA :" not in line
    assert fa_kernels_from_system_info(line, "cpu") == FaKernels()
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))  # the learnt pair stays in this test's cache
    first = build.capabilities(engine_loc, use_cache=False)
    assert first.fa_kernels == FaKernels()
    learnt = build.note_engine_log(engine_loc, NO_KERNEL_LINE)
    assert learnt.fa_kernels.missing == ("f16-q8_0",)
    assert build.capabilities(engine_loc).fa_kernels.missing == ("f16-q8_0",)  # kept with the cached capabilities


def test_a_pair_the_engine_said_it_lacks_is_refused_for_the_rest_of_the_run(engine_loc, model, tmp_path, monkeypatch):
    """Issue 43: bench and the search's trials feed the engine's own output to what it knows of its kernels. Once
    a log said a pair has no vector kernel (the CUDA warning, as ggml-cuda/fattn.cu prints it), every later trial
    of that pair is refused before it runs, with the flag that adds it; the other pairs are measured."""
    from tuner.core.config import FlashAttn, LaunchConfig
    from tuner.core.errors import TrialFailedError
    from tuner.measure import bench, failures

    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))  # the learnt pair stays in this test's cache
    mixed = LaunchConfig(model=model, ctx=512, threads=2, flash_attn=FlashAttn.ON, cache_type_v=Q8)
    plain = LaunchConfig(model=model, ctx=512, threads=2, flash_attn=FlashAttn.ON)
    bench.check_fa_kernels(engine_loc, [mixed, plain])  # nothing known yet: both may run
    with pytest.raises(TrialFailedError, match="K/V f16/q8_0 left out.*its log said so.*GGML_CUDA_FA_QUANTS"):
        bench.check_fa_kernels(engine_loc, [plain, mixed], "srv load_model\n" + NO_KERNEL_LINE + "\n")
    got = bench.run_bench_many(engine_loc, [mixed, plain], n_prompt=8, n_gen=4, repetitions=1)
    assert isinstance(got[0], failures.Failure) and got[0].kind is failures.FailureKind.REJECTED_CONFIG
    assert "f16/q8_0" in got[0].reason and not isinstance(got[1], failures.Failure) and got[1].rows
    off = LaunchConfig(model=model, ctx=512, threads=2, flash_attn=FlashAttn.OFF, cache_type_k=Q8)
    bench.check_fa_kernels(engine_loc, [off])  # no flash attention, no vector kernel asked for
