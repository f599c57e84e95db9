"""The embedded demo models: written by our generator, quantized and run by the real llama.cpp."""

from __future__ import annotations

import hashlib

import gguf
import pytest

from tests.conftest import run_cli
from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import flags, runner
from tuner.measure import bench
from tuner.models import demo, demo_model

ARCHS = ("qwen3moe", "qwen35moe")
K_QUANTS = {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K}


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _params(path) -> int:
    return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_size_and_architecture(demo_models, arch):
    f16 = demo_models[(arch, "F16")]
    assert f16.stat().st_size <= 35 * 2**20
    assert 8_000_000 <= _params(f16) <= 24_000_000
    reader = gguf.GGUFReader(f16)
    assert reader.get_field("general.architecture").contents() == arch
    assert reader.get_field(f"{arch}.expert_count").contents() >= 4
    names = {t.name for t in reader.tensors}
    assert "blk.0.ffn_up_exps.weight" in names and "blk.0.ffn_down_exps.weight" in names
    if arch == "qwen35moe":
        # Hybrid: delta-net layers plus full attention every 4th layer, and a shared expert.
        assert "blk.0.ssm_conv1d.weight" in names and "blk.3.attn_q.weight" in names
        assert "blk.3.ssm_conv1d.weight" not in names
        assert "blk.0.ffn_up_shexp.weight" in names
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert "<|im_start|>" in tokens and "<|im_end|>" in tokens
    assert "im_start" in reader.get_field("tokenizer.chat_template").contents()


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_variants_are_smaller_and_use_k_quants(demo_models, arch):
    f16, q8, q4 = (demo_models[(arch, q)] for q in ("F16", "Q8_0", "Q4_K_M"))
    assert q4.stat().st_size < q8.stat().st_size < f16.stat().st_size
    assert q4.stat().st_size < 0.5 * f16.stat().st_size
    for tensor in gguf.GGUFReader(q4).tensors:
        if "_exps" in tensor.name:
            assert tensor.tensor_type in K_QUANTS, (tensor.name, tensor.tensor_type.name)


def test_same_seed_same_bytes(tmp_path):
    a = demo_model.write_demo_model(tmp_path / "a.gguf", arch="qwen3moe", seed=7)
    b = demo_model.write_demo_model(tmp_path / "b.gguf", arch="qwen3moe", seed=7)
    c = demo_model.write_demo_model(tmp_path / "c.gguf", arch="qwen3moe", seed=8)
    assert _sha256(a) == _sha256(b) != _sha256(c)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quant", ["F16", "Q4_K_M"])
def test_llama_bench_measures_every_arch(engine_loc, demo_models, arch, quant):
    cfg = LaunchConfig(model=demo_models[(arch, quant)], threads=2)
    result = bench.run_bench(engine_loc, cfg, n_prompt=64, n_gen=16, repetitions=1)
    assert result.prompt_tok_s > 0 and result.gen_tok_s > 0
    assert {r.kind for r in result.rows} == {"pp", "tg"}
    assert all(r.build_commit.startswith("0c1e570") for r in result.rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_server_generates_tokens(engine_loc, demo_models, arch, tmp_path):
    cfg = LaunchConfig(model=demo_models[(arch, "Q8_0")], ctx=2048, parallel=1, threads=2)
    with runner.serve(flags.server_argv(engine_loc.tool("llama-server"), cfg), log_dir=tmp_path) as server:
        body = server.complete("def main():\n    print(", n_predict=16)
    assert body["timings"]["predicted_n"] == 16
    assert body["timings"]["prompt_n"] > 3  # the BPE vocabulary split the prompt into several tokens
    assert isinstance(body["content"], str)


def test_demo_model_command_prints_every_path(tmp_path):
    proc = run_cli("demo-model", "--arch", "qwen35moe", "--quant", "Q8_0", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split()
    assert [p.rsplit("-", 1)[-1] for p in printed] == ["F16.gguf", "Q8_0.gguf"]
    assert all((tmp_path / p.rsplit("/", 1)[-1]).is_file() for p in printed)
    again = run_cli("demo-model", "--arch", "qwen35moe", "--quant", "Q8_0", "--out", str(tmp_path))
    assert again.returncode == 0 and again.stdout == proc.stdout and "exists" in again.stderr


@pytest.mark.parametrize("args,needle", [
    (["--quant", "Q9_9"], "unknown quant type Q9_9"),
    (["--arch", "llama"], "llama"),
    (["--size", "huge"], "huge"),
])
def test_demo_model_bad_input_is_one_line(args, needle, tmp_path):
    proc = run_cli("demo-model", "--out", str(tmp_path), *args)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written for bad input


def test_unknown_arch_in_library_is_usage_error():
    with pytest.raises(UsageError):
        demo_model.demo_spec("llama", "tiny")
    with pytest.raises(UsageError):
        demo.parse_quants("Q4_K_M,bogus")
