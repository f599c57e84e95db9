from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tuner.core.errors import GGUFFormatError
from tuner.models import demo_model, gguf_writer
from tuner.models.gguf_reader import TensorClass, inspect_model, is_routed_expert


def test_qwen3moe_header(demo_models):
    info = inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    spec = demo_model.demo_spec("qwen3moe")
    assert (info.arch, info.n_layer, info.n_embd, info.n_head) == ("qwen3moe", spec.n_layer, spec.n_embd, spec.n_head)
    assert info.n_head_kv == (spec.n_head_kv,) * spec.n_layer
    assert (info.n_expert, info.n_expert_used, info.n_ff_exp) == (spec.n_expert, spec.n_expert_used, spec.n_ff_exp)
    assert info.n_vocab == spec.n_vocab and not info.is_hybrid and not info.tied_embeddings
    by_class = info.bytes_by_class()
    assert by_class[TensorClass.ROUTED_EXPERTS] > by_class[TensorClass.ATTENTION] > 0
    assert by_class[TensorClass.RECURRENT] == 0
    # Tensor bytes are the file minus header and alignment padding.
    assert 0.9 * info.file_bytes < info.tensor_bytes < info.file_bytes


def test_qwen35moe_hybrid_layers(demo_models):
    info = inspect_model(demo_models[("qwen35moe", "F16")])
    spec = demo_model.demo_spec("qwen35moe")
    assert info.recurrent_layers == tuple(spec.is_recurrent(il) for il in range(spec.n_layer))
    assert info.n_head_kv == tuple(0 if spec.is_recurrent(il) else spec.n_head_kv for il in range(spec.n_layer))
    assert (info.ssm_d_inner, info.ssm_d_state) == (spec.ssm_d_inner, spec.ssm_d_state)
    assert info.ssm_n_group == spec.ssm_n_group
    assert info.tied_embeddings and info.full_attention_interval == 4
    assert info.bytes_by_class()[TensorClass.SHARED_EXPERTS] > 0
    # F16 file: bytes per tensor follow from the shapes the generator planned.
    assert info.tensor_bytes == sum(t.n_bytes for t in gguf_writer.planned_tensors(spec, "F16"))


def test_expert_pattern_matches_llama_cpp():
    assert is_routed_expert("blk.3.ffn_up_exps.weight")
    assert is_routed_expert("blk.3.ffn_gate_up_exps.weight")
    assert is_routed_expert("blk.3.ffn_down_chexps.weight")
    assert not is_routed_expert("blk.3.ffn_up_shexp.weight")
    assert not is_routed_expert("blk.3.ffn_gate_inp.weight")


def test_truncated_file_is_one_line_error(demo_models, tmp_path):
    src = demo_models[("qwen3moe", "Q8_0")].read_bytes()
    for cut in (len(src) // 2, 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(src[:cut])
        with pytest.raises(GGUFFormatError, match="truncated") as err:
            inspect_model(bad)
        assert "\n" not in str(err.value)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("hello, this is not a model at all")
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        inspect_model(bad)
    with pytest.raises(GGUFFormatError, match="not found"):
        inspect_model(tmp_path / "missing.gguf")


def test_unsupported_arch(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(path, "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFFormatError, match="not supported"):
        inspect_model(path)


def _part(path: Path, tensors: dict[str, np.ndarray], split: tuple[int, int]) -> None:
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_uint16("split.no", split[0])
    w.add_uint16("split.count", split[1])
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_split_parts_are_one_model(tmp_path):
    first = tmp_path / "m-00001-of-00002.gguf"
    _part(first, {"token_embd.weight": np.zeros((16, 8), dtype=np.float32)}, (0, 2))
    experts = {"blk.0.ffn_up_exps.weight": np.zeros((4, 8, 8), dtype=np.float16)}
    _part(tmp_path / "m-00002-of-00002.gguf", experts, (1, 2))
    info = inspect_model(first)
    assert len(info.paths) == 2
    assert info.tensor_bytes == 16 * 8 * 4 + 4 * 8 * 8 * 2
    assert info.bytes_by_class()[TensorClass.ROUTED_EXPERTS] == 4 * 8 * 8 * 2
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(GGUFFormatError, match="missing"):
        inspect_model(first)
