"""Valid weights drawn directly (``--weights direct``): blocks assembled in numpy, no llama-quantize.

Validity is judged by decoders that are not ours: gguf-py's reference dequantizer (every type, fast) and the
engine's own loader with ``--check-tensors`` (``ggml_validate_row_data`` on every row). The spread of a batch
over the experts is read from the engine too: llama-imatrix's per-expert token counts for one 512-token chunk.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest

from tests.conftest import run_cli
from tuner.core.errors import ProcessFailedError, UsageError
from tuner.models import block_pool, direct_blocks, shape_model
from tuner.models.recipes import Q
from tuner.quality import imatrix

# The std of a trained checkpoint's weights, which the llama-quantize pools are made from (block_pool).
TRAINED_STD = block_pool.SOURCE_STD
F16_MIN_NORMAL = float(np.finfo(np.float16).tiny)  # 6.1e-5: smaller halves are subnormal
OLMOE = shape_model.EXTRA_SHAPES["olmoe-1b-7b"]


def _halves(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset:offset + 2].copy().view("<f2").ravel().astype(np.float32)


# Where each type keeps its f16 scales (ggml-common.h): d first, or at the end for Q6_K.
HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
          Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@pytest.mark.parametrize("typ", list(direct_blocks.DRAW), ids=lambda t: t.name)
def test_drawn_blocks_decode_to_finite_trained_looking_values(typ):
    blocks = direct_blocks.draw_blocks(typ, 8192, np.random.default_rng(1))
    assert blocks.dtype == np.uint8 and blocks.shape == (8192, gguf.GGML_QUANT_SIZES[typ][1])
    values = gguf.quants.dequantize(blocks, typ)
    assert np.isfinite(values).all()
    # MXFP4's scale is a power of two (two of them, half the blocks each), so its std lands off the target.
    lo, hi = (0.015, 0.025) if typ is Q.MXFP4 else (0.019, 0.021)
    assert lo < values.std() < hi, values.std()
    assert abs(values.mean()) < 0.02 * values.std()  # centred, as quantized Gaussian weights are
    assert len(np.unique(blocks, axis=0)) == len(blocks)  # every block differs
    for offset in HALVES.get(typ, ()):
        scale = np.abs(_halves(blocks, offset))
        assert np.isfinite(scale).all() and scale.min() >= F16_MIN_NORMAL  # finite, normal halves
    if typ is Q.Q8_0:
        assert blocks[:, 2:].view(np.int8).min() == -127  # quantize_row_q8_0_ref's range, never -128
    if typ is Q.MXFP4:
        assert set(np.unique(blocks[:, 0])) <= {119, 120}  # e8m0 exponents of 2**-9 and 2**-8


def test_k_quant_scales_pack_as_ggml_unpacks_them():
    """Every 6-bit scale and min goes through gguf-py's unpacking (get_scale_min_k4's layout) unchanged."""
    rng = np.random.default_rng(0)
    sc, m = rng.integers(0, 64, (1000, 8)), rng.integers(0, 64, (1000, 8))
    got_sc, got_m = gguf.quants.Q4_K.get_scale_min(direct_blocks._k_scales(sc, m))
    assert np.array_equal(got_sc, sc) and np.array_equal(got_m, m)


def test_pools_come_from_the_seed_alone_and_unknown_types_name_the_fix():
    a = direct_blocks.direct_pools([Q.Q4_K, Q.Q6_K, Q.F32], seed=3)
    assert sorted(a) == [Q.Q4_K, Q.Q6_K] and len(a[Q.Q4_K]) == direct_blocks.POOL_BLOCKS
    b = direct_blocks.direct_pools([Q.Q4_K], seed=3)
    assert np.array_equal(a[Q.Q4_K], b[Q.Q4_K])
    assert not np.array_equal(a[Q.Q4_K], direct_blocks.direct_pools([Q.Q4_K], seed=4)[Q.Q4_K])
    with pytest.raises(UsageError, match="cannot draw IQ4_XS blocks .* use --weights random"):
        direct_blocks.draw_blocks(Q.IQ4_XS, 4, np.random.default_rng(0))


SMALL = replace(OLMOE, n_layer=2, n_expert=8, n_vocab=4096)  # real widths, 73 MB


def test_direct_model_has_valid_distinct_rows_and_the_mixer_norm_gain(tmp_path):
    made = shape_model.write_shape_model(SMALL, "Q4_K_M", tmp_path / "d.gguf", weights="direct", seed=5)
    again = shape_model.write_shape_model(SMALL, "Q4_K_M", tmp_path / "e.gguf", weights="direct", seed=5)
    zero = shape_model.write_shape_model(SMALL, "Q4_K_M", tmp_path / "z.gguf")
    assert made.weights == "direct" and made.logical_bytes == zero.logical_bytes
    assert made.disk_bytes >= 0.99 * made.logical_bytes and made.path.read_bytes() == again.path.read_bytes()
    t = {x.name: x for x in gguf.GGUFReader(made.path).tensors}
    assert {t[n].tensor_type for n in t if n.endswith("_exps.weight")} == {Q.Q4_K, Q.Q6_K}  # Q4_K_M's mix
    for name, x in t.items():
        if x.tensor_type in direct_blocks.DRAW:
            values = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
            assert np.isfinite(values).all() and 0.019 < values.std() < 0.021, name
    up = np.asarray(t["blk.0.ffn_up_exps.weight"].data)  # (experts, rows, bytes)
    assert up.shape[0] == SMALL.n_expert
    assert len(np.unique(up.reshape(SMALL.n_expert, -1), axis=0)) == SMALL.n_expert  # no two experts alike
    rows = up.reshape(-1, up.shape[-1])
    assert len(np.unique(rows, axis=0)) == len(rows)  # no two rows alike
    router = np.asarray(t["blk.0.ffn_gate_inp.weight"].data)
    assert router.shape == (SMALL.n_expert, SMALL.n_embd) and 0.019 < router.std() < 0.021
    assert np.all(np.asarray(t["blk.1.attn_norm.weight"].data) == np.float32(0.02))  # the weights' std, not 1
    for name in ("blk.1.ffn_norm.weight", "blk.1.attn_q_norm.weight", "output_norm.weight"):
        assert np.all(np.asarray(t[name].data) == 1.0), name


def test_cli_weights_direct(tmp_path):
    assert "direct: valid weights whose blocks are drawn here (no engine)" in " ".join(
        run_cli("shape-model", "--help").stdout.split())
    res = run_cli("shape-model", "olmoe-1b-7b:Q4_K_M", "--weights", "full", "--out", str(tmp_path / "y.gguf"))
    assert res.returncode == 1 and "zero, random, direct" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    header = shape_model.write_shape_model(SMALL, "Q4_K_M", tmp_path / "h.gguf").path
    res = run_cli("shape-model", str(header), "--weights", "direct", "--out", str(tmp_path / "c.gguf"))
    assert res.returncode == 1 and "--weights direct needs a catalog name" in res.stderr


FOUR_LAYERS = replace(OLMOE, n_layer=4, n_vocab=4096)  # 64 experts, top-8, real widths: ~0.9 GB


@pytest.fixture(scope="module")
def routed(engine_loc, tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """llama-imatrix's per-expert token counts over one 512-token chunk, for zero and direct weights."""
    out = tmp_path_factory.mktemp("routed")
    counts = {}
    for weights in ("zero", "direct"):
        made = shape_model.write_shape_model(FOUR_LAYERS, "Q4_K_M", out / f"{weights}.gguf", weights=weights)
        counts[weights] = imatrix.expert_counts(engine_loc, made.path, threads=2)
        made.path.unlink()
    return counts


def _per_layer(counts: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [counts[f"blk.{i}.ffn_up_exps.weight"] for i in range(FOUR_LAYERS.n_layer)]


def test_a_ubatch_of_direct_weights_spreads_over_every_layers_experts(routed):
    for layer in _per_layer(routed["direct"]):
        assert layer.shape == (FOUR_LAYERS.n_expert,)
        assert layer.sum() == 512 * FOUR_LAYERS.n_expert_used  # each token took n_expert_used experts
        assert (layer > 0).sum() >= 0.9 * FOUR_LAYERS.n_expert  # (a trained router reaches nearly all of them)
        assert layer.max() < 0.6 * 512  # no expert takes most of the batch
    for layer in _per_layer(routed["zero"]):  # a tied router: every token takes the same experts
        assert (layer > 0).sum() == FOUR_LAYERS.n_expert_used and set(layer[layer > 0]) == {512}


def test_the_engine_refuses_a_block_with_a_non_finite_scale(engine_loc, tmp_path):
    """The spread test's loads ran with --check-tensors: one NaN scale is enough for the engine to refuse."""
    made = shape_model.write_shape_model(replace(SMALL, n_layer=1), "Q4_K_M", tmp_path / "bad.gguf", weights="direct")
    x = next(t for t in gguf.GGUFReader(made.path).tensors if t.name == "blk.0.ffn_up_exps.weight")
    with open(made.path, "r+b") as f:
        f.seek(x.data_offset + 7 * gguf.GGML_QUANT_SIZES[Q.Q4_K][1])  # the 8th block's d
        f.write(np.array([np.nan], dtype="<f2").tobytes())
    with pytest.raises(ProcessFailedError) as failed:
        imatrix.expert_counts(engine_loc, made.path, threads=2)
    assert "found nan value at block 7" in failed.value.stderr_tail
    assert "tensor 'blk.0.ffn_up_exps.weight' has invalid data" in failed.value.stderr_tail
