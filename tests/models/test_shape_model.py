from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tuner.catalog import families
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import breakdown
from tuner.machine.hardware import Hardware
from tuner.models import gguf_reader, recipes, shape_model
from tuner.models.recipes import Q, TensorShape
from tuner.plan import memory
from tuner.plan.placement import engine_agrees

MIB = 2**20
CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")
SIX = ("Qwen3-30B-A3B:Q4_K_M", "Qwen3.5-35B-A3B:Q4_K_M", "Qwen3.6-35B-A3B:Q8_0", "gpt-oss-20b:MXFP4_MOE",
       "gpt-oss-120b:MXFP4_MOE", "GLM-4.5-Air:Q4_K_M")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, shape_model.ShapeFile]:
    out = tmp_path_factory.mktemp("shapes")
    return {t: shape_model.write_catalog_model(t, out / f"{t.replace(':', '-')}.gguf") for t in SIX}


def test_q4_k_m_recipe_follows_llama_quantize():
    plan = [TensorShape("token_embd.weight", (2048, 151936)), TensorShape("blk.0.attn_norm.weight", (2048,)),
            TensorShape("blk.0.ffn_gate_inp.weight", (2048, 128))]
    plan += [TensorShape(f"blk.{i}.ffn_down_exps.weight", (768, 2048, 128)) for i in range(48)]
    plan += [TensorShape(f"blk.{i}.attn_v.weight", (2048, 512)) for i in range(48)]
    plan.append(TensorShape("output.weight", (2048, 151936)))
    types = dict(zip([t.name for t in plan], recipes.assign_types(plan, "q4_k_m", 128, 48), strict=True))
    assert types["output.weight"] is Q.Q6_K and types["token_embd.weight"] is Q.Q4_K
    assert types["blk.0.attn_norm.weight"] is Q.F32 and types["blk.0.ffn_gate_inp.weight"] is Q.F32
    # More bits for the first and last eighth of the layers and every third layer between.
    more = [i for i in range(48) if types[f"blk.{i}.ffn_down_exps.weight"] is Q.Q6_K]
    assert more == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    assert [i for i in range(48) if types[f"blk.{i}.attn_v.weight"] is Q.Q6_K] == more


def test_rows_that_do_not_divide_fall_back_and_mxfp4_keeps_experts():
    rows = [TensorShape("blk.0.attn_q.weight", (2880, 4096)), TensorShape("blk.0.ffn_up_exps.weight", (2880, 2880, 32)),
            TensorShape("output.weight", (2880, 201088))]
    assert recipes.assign_types(rows, "Q4_K_M", 32, 24) == [Q.Q5_0, Q.Q5_0, Q.Q8_0]  # 2880 % 256 != 0
    assert recipes.assign_types(rows, "MXFP4_MOE", 32, 24) == [Q.Q8_0, Q.MXFP4, Q.Q8_0]
    with pytest.raises(UsageError, match="Q4_K_M"):
        recipes.check_recipe("Q3_K_XL")


def test_shape_file_is_sparse_and_reads_like_the_real_model(shapes):
    made = shapes["Qwen3-30B-A3B:Q4_K_M"]
    assert 17.0 * 2**30 < made.logical_bytes < 17.6 * 2**30  # published Q4_K_M: 18.6 GB
    assert made.disk_bytes < 16e6
    info = gguf_reader.inspect_model(made.path)
    assert (info.arch, info.n_layer, info.n_embd, info.n_expert, info.n_expert_used) == ("qwen3moe", 48, 2048, 128, 8)
    assert info.n_vocab == 151936 and info.head_dim_k == 128 and set(info.n_head_kv) == {4}
    assert made.logical_bytes - info.tensor_bytes < 8 * MIB  # header, vocabulary and alignment only
    oss = gguf_reader.inspect_model(shapes["gpt-oss-120b:MXFP4_MOE"].path)
    assert oss.swa_layers[:4] == (True, False, True, False) and oss.n_swa == 128
    assert {t.ggml_type for t in oss.tensors if t.klass.value == "routed_experts" and t.name.endswith("weight")} == {
        "MXFP4"}
    hybrid = gguf_reader.inspect_model(shapes["Qwen3.5-35B-A3B:Q4_K_M"].path)
    assert sum(hybrid.recurrent_layers) == 30 and hybrid.n_vocab == 248320


def test_every_shape_is_written_fast(tmp_path):
    t0 = time.perf_counter()
    made = shape_model.write_catalog_model("glm-4.5-air:Q4_K_M", tmp_path / "glm.gguf")
    took_s = time.perf_counter() - t0
    assert made.logical_bytes > 60 * 2**30 and made.disk_bytes < 16e6
    assert took_s < 60  # a generous bound on a shared machine; typical is under a second
    assert made.spec.assumed == ("rope_dim",)  # facts the catalog lacks are named
    assert made.spec.n_ff_dense == 10944  # the dense first layer's width now comes from the catalog


@pytest.mark.parametrize("target", SIX)
def test_llama_cpp_projects_each_shape_and_the_model_agrees(target, shapes, engine_loc):
    path = shapes[target].path
    info = gguf_reader.inspect_model(path)
    base = LaunchConfig(model=path, parallel=1, ctx=32768)
    for cfg in (base, replace(base, ctx=131072, cache_type_k=CacheType.Q8_0, cache_type_v=CacheType.Q8_0,
                              flash_attn=FlashAttn.ON, ubatch=1024)):
        truth = breakdown.fit_params_breakdown(engine_loc, cfg)
        est = memory.estimate(info, cfg, CPU, fit_params=True)
        pairs = [(est.engine_host_weights_bytes - est.repack_bytes, truth.host_total("model")),
                 (est.host.context_bytes, truth.host_total("context")),
                 (est.host.compute_bytes, truth.host_total("compute"))]
        for pred, real in pairs:
            assert engine_agrees(pred // MIB, real, info.tensor_bytes), (target, cfg, pairs, truth)


def test_publisher_tensor_types_replace_the_recipe_as_llama_quantize_does():
    """llama-quantize --tensor-type (src/llama-quant.cpp llama_tensor_get_type): for a quantized recipe the first
    matching pattern replaces the recipe's pick; norms stay F32; an unquantized recipe ignores the overrides."""
    plan = [TensorShape("blk.0.attn_norm.weight", (2048,)), TensorShape("blk.0.attn_qkv.weight", (2048, 8192)),
            TensorShape("blk.0.ssm_out.weight", (4096, 2048)),
            TensorShape("blk.0.ffn_down_exps.weight", (512, 2048, 256)),
            TensorShape("blk.1.attn_gate.weight", (2048, 4096)), TensorShape("output.weight", (2048, 248320))]
    overrides = (("attn_(qkv|gate)\\.weight", "q8_0"), ("ssm_out", "q6_k"), ("attn_qkv", "q4_k"))
    got = recipes.assign_types(plan, "Q4_K_M", 256, 40, overrides)
    assert got == [Q.F32, Q.Q8_0, Q.Q6_K, Q.Q6_K, Q.Q8_0, Q.Q6_K]  # first match wins: attn_qkv is Q8_0, not Q4_K
    assert recipes.assign_types(plan, "Q4_K_M", 256, 40)[1:3] == [Q.Q6_K, Q.Q4_K]  # the recipe's own picks
    assert recipes.assign_types(plan, "F16", 256, 40, overrides) == recipes.assign_types(plan, "F16", 256, 40)


def _published_bytes(target: str) -> int:
    model = families.find_model(target)
    size = model.published_bytes(target.split(":")[1]) if model else None
    assert size is not None, target
    return size


@pytest.mark.parametrize("target", ["qwen3.5-35b-a3b:Q4_K_M", "qwen3.5-9b:Q4_K_M", "qwen3.5-27b:Q4_K_M"])
def test_shape_files_are_within_two_percent_of_the_published_unsloth_files(target, tmp_path):
    """Issue 35: the file the planner reads for a catalog shape is the size of the file a user would download
    (the catalog's published bytes, each with its source)."""
    made = shape_model.write_catalog_model(target, tmp_path / "m.gguf")
    published = _published_bytes(target)
    assert abs(made.logical_bytes / published - 1) <= 0.02, (target, made.logical_bytes, published)
    assert made.spec.n_vocab == 248320 and "n_vocab" not in made.spec.assumed
    if made.spec.arch == "qwen35moe":
        # llama-quantize's own recipe is the first (21.2 GB) upload; unsloth's re-upload keeps the hybrid
        # layers' attention and ssm_out at higher precision, which the catalog records as --tensor-type overrides.
        vanilla = shape_model.logical_bytes(replace(made.spec, tensor_types=()), "Q4_K_M")
        assert vanilla / published - 1 < -0.03


@pytest.mark.parametrize("target", ["qwen3.5-9b:Q4_K_M", "qwen3.5-27b:Q4_K_M"])
def test_dense_comparator_shapes_load_in_the_engine(target, tmp_path, engine_loc):
    """The dense Qwen3.5 shape (arch qwen35: llama_model_qwen35::load_arch_tensors) loads in the pinned
    llama-fit-params, which then sees every 4th layer as attention with KV and the rest as delta-net state."""
    res = run_cli("shape-model", target, "--out", str(tmp_path / "d.gguf"), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    made = shape_model.resolve_target(target)[0]
    assert doc["model"] == made.name and doc["logical_bytes"] == (tmp_path / "d.gguf").stat().st_size
    ctx = 32768
    truth = breakdown.fit_params_breakdown(engine_loc, LaunchConfig(model=tmp_path / "d.gguf", parallel=1, ctx=ctx))
    n_attn = made.n_layer // made.full_attention_interval
    kv_bytes = n_attn * ctx * made.n_head_kv * made.head_dim * 2 * 2  # K and V, f16
    state_bytes = (made.n_layer - n_attn) * 4 * (  # f32, one sequence (src/llama-memory-recurrent.cpp)
        (made.ssm_d_conv - 1) * (made.ssm_d_inner + 2 * made.ssm_n_group * made.ssm_d_state)
        + made.ssm_d_state * made.ssm_d_inner)
    assert truth.host_total("context") == pytest.approx((kv_bytes + state_bytes) / MIB, abs=1), truth
    assert n_attn == {"Qwen3.5-9B": 8, "Qwen3.5-27B": 16}[made.name]


def test_copy_header_keeps_the_header_and_the_size(demo_models, tmp_path):
    src = demo_models[("qwen35moe", "Q4_K_M")]
    made = shape_model.copy_header(src, tmp_path / "copy.gguf")
    assert made.logical_bytes == src.stat().st_size
    a, b = gguf_reader.inspect_model(src), gguf_reader.inspect_model(made.path)
    def rows(info: gguf_reader.ModelInfo) -> list[tuple[str, str, int]]:
        return [(t.name, t.ggml_type, t.n_bytes) for t in info.tensors]

    assert rows(a) == rows(b)
    with pytest.raises(UsageError, match="GGUF header"):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"nope" * 10)
        shape_model.copy_header(bad, tmp_path / "x.gguf")


def test_cli_shape_model(tmp_path):
    out = tmp_path / "q.gguf"
    res = run_cli("shape-model", "unsloth/Qwen3-30B-A3B-GGUF:Q8_0", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["model"] == "Qwen3-30B-A3B" and doc["recipe"] == "Q8_0" and doc["logical_bytes"] == out.stat().st_size
    res = run_cli("shape-model", "llama-7b:Q4_K_M", "--out", str(out))
    assert res.returncode == 1 and "gpt-oss-20b" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = run_cli("shape-model", "qwen3-30b-a3b:Q2_K", "--out", str(out))
    assert res.returncode == 1 and "Q4_K_M" in res.stderr
    res = run_cli("shape-model", "--list")
    assert res.returncode == 0 and "GLM-4.5-Air" in res.stdout and "MXFP4_MOE" in res.stdout


def test_plannable_model_from_catalog_name(tmp_path):
    from tuner.hub.resolve import resolve_model

    got = resolve_model("gpt-oss-20b:MXFP4_MOE", header_only=True, cache_dir=tmp_path)
    assert got.path.parent == tmp_path and "quant catalog" in got.source
    assert gguf_reader.inspect_model(got.path).arch == "gpt-oss"
    assert resolve_model(str(got.path), header_only=True).source == "file"
    with pytest.raises(UsageError, match="not found"):
        resolve_model(str(Path(tmp_path) / "missing.gguf"), header_only=True)
    with pytest.raises(UsageError, match="not found"):
        resolve_model("gpt-oss-20b:MXFP4_MOE")  # shapes are for planning only: nothing to run
