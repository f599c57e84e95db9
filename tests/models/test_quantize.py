"""Quant recipes, llama-quantize's argv and what is read back from its output (fast); making one quant of the
demo model with the real engine, and reusing it (engine)."""

from __future__ import annotations

from pathlib import Path

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


def test_a_moe_mix_keeps_attention_shared_dense_embeddings_and_output_high():
    argv = flags.quantize_argv(Path("/e/llama-quantize"), Path("m-F16.gguf"), Path("o.gguf"), "Q3_K_M",
                               tensor_types=[(p, "Q8_0") for p in quantize.MIX_HIGH_PATTERNS],
                               output_tensor_type="Q8_0", token_embedding_type="Q8_0", imatrix=Path("i.gguf"))
    assert argv == ["/e/llama-quantize", "--imatrix", "i.gguf", "--tensor-type", "attn_=q8_0",
                    "--tensor-type", r"ffn_(gate|up|down)(_shexp)?\.weight=q8_0", "--output-tensor-type", "q8_0",
                    "--token-embedding-type", "q8_0", "m-F16.gguf", "o.gguf", "Q3_K_M"]
    import re
    high = [re.compile(p) for p in quantize.MIX_HIGH_PATTERNS]

    def is_high(name: str) -> bool:
        return any(p.search(name) for p in high)
    assert is_high("blk.3.attn_q.weight") and is_high("blk.0.ffn_up.weight")
    assert is_high("blk.1.ffn_down_shexp.weight")
    assert not is_high("blk.1.ffn_down_exps.weight") and not is_high("blk.1.ffn_gate_exps.weight")
    dry = flags.quantize_argv(Path("q"), Path("m.gguf"), Path("m.gguf"), "Q4_K_M", dry_run=True)
    assert dry == ["q", "--dry-run", "m.gguf", "Q4_K_M"]


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
    assert made.command.startswith("llama-quantize --tensor-type attn_=q8_0") and made.command.endswith(" Q2_K")
    assert quantize.made_command(made.path) == made.command
    plain = quantize.make(engine_loc, src, tmp_path, quantize.Recipe("Q2_K"))
    assert plain.size_bytes < made.size_bytes  # the mix keeps attention and the rest at Q8_0
    again = quantize.make(engine_loc, src, tmp_path, recipe)
    assert again.reused and again.path == made.path
    assert quantize.drop(made.path) >= made.size_bytes and not made.path.exists()
