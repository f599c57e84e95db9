"""Quant recipes, llama-quantize's argv and what is read back from its output (fast); making one quant of the
demo model with the real engine, and reusing it (engine)."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import pytest

from tuner.core.errors import UsageError
from tuner.engine import flags
from tuner.models import quantize

HELP = """usage: llama-quantize [--help] ...
-----------------------------------------------------------------------------
 allowed quantization types
-----------------------------------------------------------------------------

   2  or  Q4_0    :  4.34G, +0.4685 ppl @ Llama-3-8B
  19  or  IQ2_XXS :  2.06 bpw quantization
  12  or  Q3_K    : alias for Q3_K_M
  12  or  Q3_K_M  :  3.74G, +0.6569 ppl @ Llama-3-8B
  15  or  Q4_K_M  :  4.58G, +0.1754 ppl @ Llama-3-8B
  30  or  IQ4_XS  :  4.25 bpw non-linear quantization
   7  or  Q8_0    :  7.96G, +0.0026 ppl @ Llama-3-8B
          COPY    : only copy tensors, no quantizing
"""


def test_quant_types_are_read_from_the_help_list():
    assert flags.parse_quant_types(HELP) == ("Q4_0", "IQ2_XXS", "Q3_K", "Q3_K_M", "Q4_K_M", "IQ4_XS", "Q8_0")


def test_dry_run_size_is_read_in_bytes():
    out = "llama_model_quantize_impl: model size  =    31.20 MiB (16.00 BPW)\n" \
          "llama_model_quantize_impl: quant size  =     8.25 MiB (4.23 BPW)\n"
    assert flags.parse_quant_size_bytes(out) == round(8.25 * 2**20)
    assert flags.parse_quant_size_bytes("nothing here") is None


def test_recipes_parse_types_and_moe_mixes_against_the_engine_list():
    types = flags.parse_quant_types(HELP)
    got = quantize.parse_recipes("q4_k_m, IQ4_XS,Q3_K_M/q8_0,Q4_K_M", types)
    assert got == (quantize.Recipe("Q4_K_M"), quantize.Recipe("IQ4_XS"), quantize.Recipe("Q3_K_M", "Q8_0"))
    assert got[2].name == "Q3_K_M/Q8_0" and got[2].file_label == "Q3_K_M-moe-Q8_0"
    with pytest.raises(UsageError, match="no quant type 'Q9_K'.*Q4_K_M"):
        quantize.parse_recipes("Q9_K", types)
    with pytest.raises(UsageError, match="not a ggml tensor type"):
        quantize.parse_recipes("Q4_K_M/Q4_K_M", types)  # a file type, not a tensor type
    with pytest.raises(UsageError, match="--make names no quant types"):
        quantize.parse_recipes(" , ", types)


def test_a_moe_mix_keeps_every_weight_but_the_routed_experts_high():
    argv = flags.quantize_argv(Path("/e/llama-quantize"), Path("m-F16.gguf"), Path("o.gguf"), "Q3_K_M",
                               tensor_types=[(p, "Q8_0") for p in quantize.MIX_HIGH_PATTERNS],
                               output_tensor_type="Q8_0", token_embedding_type="Q8_0", imatrix=Path("i.gguf"))
    assert argv == ["/e/llama-quantize", "--imatrix", "i.gguf", "--tensor-type", r"^(?!.*_(ch)?exps\.)=q8_0",
                    "--output-tensor-type", "q8_0", "--token-embedding-type", "q8_0", "m-F16.gguf", "o.gguf",
                    "Q3_K_M"]
    high = [re.compile(p) for p in quantize.MIX_HIGH_PATTERNS]

    def is_high(name: str) -> bool:
        return any(p.search(name) for p in high)
    for name in ("blk.3.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.ffn_down_shexp.weight",
                 "blk.2.attn_qkv.weight", "blk.2.attn_gate.weight", "blk.0.ssm_alpha.weight", "blk.0.ssm_beta.weight",
                 "blk.0.ssm_out.weight", "blk.0.ssm_in.weight", "blk.5.attn_kv_a_mqa.weight"):
        assert is_high(name), name
    for name in ("blk.1.ffn_down_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.0.ffn_gate_up_exps.weight",
                 "blk.4.ffn_up_chexps.weight"):
        assert not is_high(name), name
    dry = flags.quantize_argv(Path("q"), Path("m.gguf"), Path("m.gguf"), "Q4_K_M", dry_run=True)
    assert dry == ["q", "--dry-run", "m.gguf", "Q4_K_M"]


# llama-quantize's per-tensor log line (llama_model_quantize_impl in src/llama-quant.cpp): the tensor, its shape,
# its type in the source, then either "converting to TYPE .." or, when copied as it is, "size = ...".
_TENSOR_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s+(\S+), (?:converting to (\S+) \.\.)?")


def _quantizer_log(lines: list[str]) -> dict[str, tuple[str, str | None]]:
    """tensor → (source type, type it was converted to; None: copied unchanged), from the quantizer's own log."""
    found = {}
    for line in lines:
        m = _TENSOR_LINE.match(line.strip())
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    return found


def test_a_moe_mix_on_qwen35moe_gives_every_non_expert_weight_the_high_type(engine_loc, demo_models, tmp_path):
    """Checked from llama-quantize's own per-tensor log: the hybrid family's ssm_* weights, attn_qkv/attn_gate,
    the shared experts and the embeddings all get Q8_0; the routed experts get Q2_K's own types; what the
    quantizer copies unchanged is only what it never quantizes (F32 norms, biases, the router, ssm_conv1d)."""
    src = demo_models[("qwen35moe", "F16")]
    log: list[str] = []
    made = quantize.make(engine_loc, src, tmp_path, quantize.Recipe("Q2_K", "Q8_0"), on_log=log.append)
    tensors = _quantizer_log(log)
    assert len(tensors) == len(gguf.GGUFReader(src).tensors)  # every tensor is in the log
    converted = {n: to for n, (_, to) in tensors.items() if to is not None}
    copied = {n: frm for n, (frm, to) in tensors.items() if to is None}
    non_expert = {n: to for n, to in converted.items() if "_exps." not in n}
    for part in ("ssm_alpha", "ssm_beta", "ssm_out", "attn_qkv", "attn_gate", "attn_q.", "attn_k.", "attn_v.",
                 "attn_output", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "token_embd"):
        assert any(part in n for n in non_expert), part
    assert {n for n, to in non_expert.items() if to != "q8_0"} == set()
    experts = {to for n, to in converted.items() if "_exps." in n}
    assert experts and "q8_0" not in experts and experts <= {"q2_K", "q3_K", "q4_K", "q5_K", "q6_K"}
    assert set(copied.values()) == {"f32"}, copied  # no f16 weight left out of the mix
    assert {n for n in copied if not (n.endswith(("norm.weight", ".bias", ".ssm_a")) or "ffn_gate_inp" in n
                                      or "ssm_conv1d" in n)} == set()
    # The written file agrees with the log.
    written = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(made.path).tensors}
    assert all(written[n] == to.lower() for n, to in converted.items())


def test_made_file_names_drop_the_source_quant():
    src = Path("/m/Model-30B-F16.gguf")
    assert quantize.made_path(src, Path("/o"), quantize.Recipe("Q3_K_M", "Q8_0"), None) == \
        Path("/o/Model-30B-Q3_K_M-moe-Q8_0.gguf")
    assert quantize.made_path(src, Path("/o"), quantize.Recipe("IQ4_XS"), Path("i")) == \
        Path("/o/Model-30B-IQ4_XS-imat.gguf")


def test_the_engine_lists_its_types_and_makes_a_mix_once(engine_loc, demo_models, tmp_path):
    types = quantize.available_types(engine_loc)
    assert {"Q4_K_M", "Q3_K_M", "IQ4_XS", "Q8_0", "Q2_K"} <= set(types)
    src = demo_models[("qwen3moe", "F16")]
    recipe = quantize.Recipe("Q2_K", "Q8_0")
    estimate = quantize.estimate_bytes(engine_loc, src, recipe)
    made = quantize.make(engine_loc, src, tmp_path, recipe)
    assert not made.reused and made.path.is_file() and made.size_bytes == made.path.stat().st_size
    assert made.size_bytes <= estimate < made.size_bytes * 1.1 + 2**20  # an upper bound, and a close one
    assert made.command.startswith("llama-quantize --tensor-type '^(?!.*_(ch)?exps\\.)=q8_0'")
    assert made.command.endswith(" Q2_K")
    assert quantize.made_command(made.path) == made.command
    plain = quantize.make(engine_loc, src, tmp_path, quantize.Recipe("Q2_K"))
    assert plain.size_bytes < made.size_bytes  # the mix keeps attention and the rest at Q8_0
    again = quantize.make(engine_loc, src, tmp_path, recipe)
    assert again.reused and again.path == made.path
    assert quantize.drop(made.path) >= made.size_bytes and not made.path.exists()
