"""Valid-weight shape models: a real shape with fewer layers, written with valid data, runs in llama.cpp.

The real-scale files (gigabytes) live in the user's cache and never in tests: here OLMoE-1B-7B's real layer,
vocabulary and head shapes are written with one layer (~0.4 GB), so every tensor type the Q4_K_M recipe
gives it (Q4_K, Q6_K, F32) is written, loaded and computed on for real.
"""

from __future__ import annotations

import math
from dataclasses import replace

import gguf
import numpy as np
import pytest

from tests.conftest import run_cli
from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.measure import bench
from tuner.models import block_pool, gguf_reader, gguf_writer, shape_model
from tuner.models.recipes import Q
from tuner.quality import perplexity

OLMOE = shape_model.EXTRA_SHAPES["olmoe-1b-7b"]
ONE_LAYER = replace(OLMOE, n_layer=1)
BATCH = 512  # tokens in one prompt-processing batch (llama.cpp's default -ub)


@pytest.fixture(scope="module")
def valid(engine_loc, tmp_path_factory) -> shape_model.ShapeFile:
    out = tmp_path_factory.mktemp("valid")
    return shape_model.write_shape_model(ONE_LAYER, "Q4_K_M", out / "olmoe-1l-valid.gguf", weights="random",
                                         engine=engine_loc)


def _tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_block_pools_decode_to_trained_looking_values(valid):
    for typ in (Q.Q4_K, Q.Q6_K):
        pool = np.load(block_pool.pool_path(typ))
        assert pool.shape[1] == gguf.GGML_QUANT_SIZES[typ][1] and len(pool) >= 8192
        assert 0.015 < block_pool.decoded_std(pool, typ) < 0.025  # the source weights' std is 0.02
        assert len(np.unique(pool, axis=0)) == len(pool)  # every block differs


def test_valid_file_has_the_zero_files_table_and_sane_values(valid, tmp_path):
    zero = shape_model.write_shape_model(ONE_LAYER, "Q4_K_M", tmp_path / "zero.gguf")
    assert valid.logical_bytes == zero.logical_bytes and valid.disk_bytes >= 0.99 * valid.logical_bytes
    assert zero.disk_bytes < 16e6 < 300e6 < valid.disk_bytes
    rows = [(t.name, t.ggml_type, t.n_bytes) for t in gguf_reader.inspect_model(valid.path).tensors]
    assert rows == [(t.name, t.ggml_type, t.n_bytes) for t in gguf_reader.inspect_model(zero.path).tensors]
    t = _tensors(valid.path)
    assert {t[n].tensor_type for n in ("token_embd.weight", "output.weight", "blk.0.ffn_up_exps.weight")} == {
        Q.Q4_K, Q.Q6_K}
    for name in ("blk.0.attn_norm.weight", "blk.0.attn_q_norm.weight", "output_norm.weight"):
        assert np.all(np.asarray(t[name].data) == 1.0)
    router = np.asarray(t["blk.0.ffn_gate_inp.weight"].data)
    assert router.shape == (OLMOE.n_expert, OLMOE.n_embd) and 0.018 < router.std() < 0.022
    for name in ("token_embd.weight", "blk.0.ffn_down_exps.weight"):
        rows_q = np.asarray(t[name].data).reshape(-1, t[name].data.shape[-1])[:256]
        values = gguf.quants.dequantize(rows_q, t[name].tensor_type)
        assert np.isfinite(values).all() and 0.015 < values.std() < 0.025
        assert len(np.unique(rows_q, axis=0)) == len(rows_q)  # rows differ: tokens and experts are distinct


def test_tokens_of_a_batch_spread_over_the_experts(valid):
    """llama.cpp prints no expert usage, so this is the router math on the written weights: llama-bench's
    random tokens, their embeddings RMS-normed (the norm weights are ones), times the router, top-k. A zero
    router ties every expert and every token takes the same n_expert_used experts."""
    t = _tensors(valid.path)
    ids = np.random.default_rng(0).integers(0, OLMOE.n_vocab, BATCH)
    embd_q = np.asarray(t["token_embd.weight"].data)
    x = gguf.quants.dequantize(embd_q[ids], Q.Q4_K)
    x /= np.sqrt((x**2).mean(axis=1, keepdims=True) + OLMOE.rms_eps)
    logits = x @ np.asarray(t["blk.0.ffn_gate_inp.weight"].data).T
    top = np.argsort(-logits, axis=1)[:, :OLMOE.n_expert_used]
    used = len(np.unique(top))
    assert used >= 0.75 * OLMOE.n_expert, used
    # Balanced, as a trained router's: no expert takes more than 3x its fair share of the batch.
    counts = np.bincount(top.ravel(), minlength=OLMOE.n_expert)
    assert counts.max() < 3 * BATCH * OLMOE.n_expert_used / OLMOE.n_expert
    zero_top = np.argsort(-np.zeros_like(logits), axis=1, kind="stable")[:, :OLMOE.n_expert_used]
    assert len(np.unique(zero_top)) == OLMOE.n_expert_used


def test_llama_bench_and_perplexity_give_finite_figures(engine_loc, valid):
    result = bench.run_bench(engine_loc, LaunchConfig(model=valid.path, threads=2), n_prompt=64, n_gen=8,
                             repetitions=1)
    assert result.prompt_tok_s > 0 and result.gen_tok_s > 0
    assert math.isfinite(result.prompt_tok_s) and math.isfinite(result.gen_tok_s)
    ppl = perplexity.measure(engine_loc, valid.path, auto_reference=False, ctx=128, chunks=2, threads=2,
                             use_cache=False)
    # Random weights know nothing: perplexity is finite and near the vocabulary size, not NaN or inf.
    assert math.isfinite(ppl.ppl) and 1.0 < ppl.ppl < 10 * OLMOE.n_vocab


def test_same_seed_same_bytes_and_writing_streams(engine_loc, tmp_path):
    small = replace(OLMOE, n_layer=1, n_expert=8, n_vocab=4096)
    a = shape_model.write_shape_model(small, "Q4_K_M", tmp_path / "a.gguf", weights="random", seed=3, engine=engine_loc)
    b = shape_model.write_shape_model(small, "Q4_K_M", tmp_path / "b.gguf", weights="random", seed=3, engine=engine_loc)
    c = shape_model.write_shape_model(small, "Q4_K_M", tmp_path / "c.gguf", weights="random", seed=4, engine=engine_loc)
    assert a.path.read_bytes() == b.path.read_bytes() != c.path.read_bytes()
    assert a.times is not None and a.times.total_s >= a.times.generate_s > 0
    # The largest chunk the writer holds is CHUNK_BYTES, whatever the tensor's size.
    pools = block_pool.block_pools({Q.Q4_K}, engine_loc)
    big = gguf_writer.PlannedTensor("blk.0.ffn_up_exps.weight", (2048, 1024, 64), Q.Q4_K)
    sizes = [c.nbytes for c in gguf_writer._chunks(big, np.random.default_rng(0), pools)]
    assert sum(sizes) == big.n_bytes and max(sizes) <= gguf_writer.CHUNK_BYTES


def test_cli_weights_option(tmp_path):
    res = run_cli("shape-model", "olmoe-1b-7b:Q4_K_M", "--weights", "ones", "--out", str(tmp_path / "x.gguf"))
    assert res.returncode == 1 and "zero, random" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("shape-model", "OLMoE-1B-7B-0924", "--out", str(tmp_path / "o.gguf"), "--json")
    assert res.returncode == 0, res.stderr
    assert '"weights": "zero"' in res.stdout and "OLMoE-1B-7B-0924" in res.stdout
    assert "olmoe-1b-7b" in run_cli("shape-model", "--list").stdout
    with pytest.raises(UsageError, match="zero, random"):
        gguf_writer.check_weights("full")


SMOKE = ("Qwen3-30B-A3B:Q8_0", "Qwen3.5-35B-A3B:Q4_K_M", "Qwen3-Next-80B-A3B-Instruct:Q6_K", "gpt-oss-20b:MXFP4_MOE",
         "GLM-4.5-Air:Q4_K_M")


@pytest.mark.parametrize("target", SMOKE)
def test_every_catalog_arch_runs_with_valid_weights(engine_loc, target, tmp_path):
    """Each catalog architecture and recipe at its real widths, cut to a few layers, 8 experts and a small
    vocabulary (files of 60-300 MB, about a second each): llama.cpp loads it and measures finite speeds."""
    spec, recipe = shape_model.resolve_target(target)
    small = replace(spec, n_layer=max(2, spec.full_attention_interval), n_vocab=4096, n_expert=8,
                    n_expert_used=min(spec.n_expert_used, 4), n_layer_dense_lead=min(1, spec.n_layer_dense_lead))
    made = shape_model.write_shape_model(small, recipe, tmp_path / "small.gguf", weights="random", engine=engine_loc)
    result = bench.run_bench(engine_loc, LaunchConfig(model=made.path, threads=2), n_prompt=32, n_gen=4,
                             repetitions=1)
    assert math.isfinite(result.prompt_tok_s) and result.prompt_tok_s > 0
    assert math.isfinite(result.gen_tok_s) and result.gen_tok_s > 0
