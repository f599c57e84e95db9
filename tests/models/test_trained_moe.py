"""The trained MoE (tuner.models.trained): SmolLM2-135M-Instruct split exactly into 8 experts of 192, all used.

Every expected figure comes from the engine (llama-perplexity of the dense model, its load log, llama-fit-params
through `plan --engine-check`) or from the dense model's published shape (30 layers, 576 wide, FFN 1536)."""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest

from tests.conftest import run_cli
from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import flags, runner
from tuner.models import trained
from tuner.models.gguf_reader import inspect_model
from tuner.quality import corpus, perplexity

N_LAYER, N_EMBD, N_FF, N_EXPERT = 30, 576, 1536, 8
EXPERT_LAYER_BYTES = 3 * N_EMBD * N_FF * 2  # gate, up and down of one layer in F16, all 8 experts together


@pytest.mark.slow  # dequantizes a 135M model: not the fast tier
def test_the_moe_header_and_tensors_are_those_of_an_8x192_moe(trained_moe, trained_model):
    info = inspect_model(trained_moe)
    assert (info.arch, info.n_layer, info.n_expert, info.n_expert_used, info.n_ff_exp) == ("llama", N_LAYER, 8, 8, 192)
    reader = gguf.GGUFReader(trained_moe)
    dense = gguf.GGUFReader(trained_model)
    for key in ("tokenizer.chat_template", "tokenizer.ggml.merges", "tokenizer.ggml.tokens", "llama.rope.freq_base"):
        assert reader.fields[key].contents() == dense.fields[key].contents(), key
    t = {x.name: x for x in reader.tensors}
    assert t["blk.7.ffn_gate_exps.weight"].shape.tolist() == [N_EMBD, 192, 8]
    assert t["blk.7.ffn_down_exps.weight"].shape.tolist() == [192, N_EMBD, 8]
    assert t["blk.7.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert not np.any(t["blk.7.ffn_gate_inp.weight"].data)  # the zero router: softmax gives every expert 1/8
    # Expert 3's down block is columns 576..767 of the dense down, times 8, exactly (a power of two in F16).
    d = {x.name: x for x in dense.tensors}["blk.7.ffn_down.weight"]
    dense_down = gguf.quants.dequantize(d.data, d.tensor_type).astype(np.float16)
    assert np.array_equal(np.asarray(t["blk.7.ffn_down_exps.weight"].data)[3], dense_down[:, 576:768] * 8)


def test_the_moe_computes_the_dense_models_function(engine_loc, trained_moe, trained_dense_f16, monkeypatch,
                                                    tmp_path):
    """llama-perplexity of the MoE equals its dense twin's (the same F16 weights, one FFN) within 0.1 %."""
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    moe = perplexity.measure(engine_loc, trained_moe, auto_reference=False, ctx=256, chunks=2)
    dense = perplexity.measure(engine_loc, trained_dense_f16, auto_reference=False, ctx=256, chunks=2)
    assert 5.0 < dense.ppl < 60.0, dense.ppl  # a trained model; random weights give thousands
    assert moe.ppl == pytest.approx(dense.ppl, rel=1e-3), (moe.ppl, dense.ppl)


def test_n_cpu_moe_moves_exactly_the_first_layers_experts(engine_loc, trained_moe):
    """The engine's own load log (-v) names every tensor that --n-cpu-moe 2 sent to the host."""
    cfg = LaunchConfig(model=trained_moe, n_cpu_moe=2, threads=2)
    argv = flags.perplexity_argv(engine_loc.tool("llama-perplexity"), cfg, text_file=corpus.text_file(), ctx=128,
                                 chunks=1)
    log: list[str] = []
    runner.run_process([*argv, "-v"], timeout_s=120, what="llama-perplexity", fix="check the engine",
                       on_line=log.append)
    moved = set(re.findall(r"tensor (\S+) \(.*\) buffer type overridden to CPU", "\n".join(log)))
    assert moved == {f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1) for p in ("gate", "up", "down")}


def test_plan_moves_one_layers_experts_per_step_and_agrees_with_llama_cpp(engine_loc, trained_moe, tmp_path):
    env = {"MOE_TUNE_CACHE": str(tmp_path / "mt"), "LLAMA_CPP_DIR": str(engine_loc.bin_dir)}
    res = run_cli("plan", str(trained_moe), "--gpu", "RTX 3060 12GB", "-c", "4096", "--engine-check", "--json",
                  env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = {r["n_cpu_moe"]: r for r in data["rows"]}
    assert sorted(rows) == list(range(N_LAYER + 1))
    for n in (1, 2, 30):
        assert rows[0]["gpu"]["weights"] - rows[n]["gpu"]["weights"] == n * EXPERT_LAYER_BYTES
        assert rows[n]["host"]["weights"] - rows[0]["host"]["weights"] == n * EXPERT_LAYER_BYTES
    assert data["engine_check"] and all(c["agrees"] for c in data["engine_check"]), data["engine_check"]


@pytest.mark.slow  # writes a 135M model
def test_demo_model_trained_writes_it_and_refuses_bad_input(trained_model, tmp_path):
    res = run_cli("demo-model", "--trained", "--from", str(trained_model), "--experts", "4", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    path = tmp_path / "SmolLM2-135M-Instruct-moe4-F16.gguf"
    assert res.stdout.strip() == str(path) and "written" in res.stderr
    assert inspect_model(path).n_expert == 4 and inspect_model(path).n_ff_exp == 384
    again = run_cli("demo-model", "--trained", "--from", str(trained_model), "--experts", "4", "--out", str(tmp_path))
    assert again.returncode == 0 and "exists" in again.stderr
    for args, says in ((["--trained", "--experts", "3"], "power of two"),
                       (["--trained", "--from", str(path)], "cannot be split"),
                       (["--trained", "--arch", "qwen35moe"], "--arch"),
                       (["--experts", "4"], "add --trained")):
        bad = run_cli("demo-model", *args, "--out", str(tmp_path))
        last = bad.stderr.strip().splitlines()[-1]
        assert bad.returncode == 1 and last.startswith("error:") and says in last, (args, bad.stderr)
        assert "Traceback" not in bad.stderr


def test_a_model_that_is_not_a_dense_llama_is_refused(demo_models, tmp_path):
    with pytest.raises(UsageError, match="qwen3moe model"):
        trained.write_moe(demo_models[("qwen3moe", "F16")], tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def _tiny_dense_llama(path, n_embd: int = 64, n_ff: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-layer dense llama GGUF whose FFN weights are multiples of 1/64 (exact in F16)."""
    rng = np.random.default_rng(seed)
    w = {"gate": rng.integers(-64, 64, (n_ff, n_embd)) / 64, "up": rng.integers(-64, 64, (n_ff, n_embd)) / 64,
         "down": rng.integers(-64, 64, (n_embd, n_ff)) / 64}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny dense")
    writer.add_block_count(1)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for part, values in w.items():
        writer.add_tensor(f"blk.0.ffn_{part}.weight", values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w


def test_the_split_is_the_dense_ffn_term_by_term(tmp_path):
    """SwiGLU: down · (silu(gate · x) ⊙ (up · x)) is a sum over hidden units; the experts, each weighted 1/E as
    llama.cpp's softmax over a zero router gives them, add up to it (float64 here, the written F16 values)."""
    w = _tiny_dense_llama(tmp_path / "dense.gguf")
    moe = trained.write_moe(tmp_path / "dense.gguf", tmp_path / "moe.gguf", n_expert=4)
    t = {x.name: np.asarray(x.data, dtype=np.float64) for x in gguf.GGUFReader(moe).tensors}
    x = np.random.default_rng(1).standard_normal(64)

    def silu(v):
        return v / (1 + np.exp(-v))

    dense = w["down"] @ (silu(w["gate"] @ x) * (w["up"] @ x))
    gate, up, down = (t[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    weight = np.exp(t["blk.0.ffn_gate_inp.weight"] @ x)
    weight /= weight.sum()  # softmax over the 4 experts, then normalized over the 4 chosen: all of them
    mixed = sum(weight[e] * down[e] @ (silu(gate[e] @ x) * (up[e] @ x)) for e in range(4))
    np.testing.assert_allclose(mixed, dense, rtol=1e-12, atol=1e-12)
