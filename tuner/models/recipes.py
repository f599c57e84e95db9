"""Per-tensor quantization recipes: which ggml type llama-quantize gives each tensor of a model.

A file called ``Q4_K_M`` is not all Q4_K: llama.cpp's ``src/llama-quant.cpp`` keeps norms, biases and the
expert router in F32, gives the output head Q6_K, and spends more bits on some ``attn_v``/``ffn_down``
layers. The rules below follow that file at the pinned commit for the recipes people run MoE models at;
shape-true models (tuner.models.shape_model) use them to get per-tensor bytes right without real weights.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import gguf

from tuner.core.errors import UsageError

Q = gguf.GGMLQuantizationType

# Recipe name → (base type, GGUF general.file_type).
RECIPES: dict[str, tuple[Q, int]] = {
    "Q4_K_M": (Q.Q4_K, int(gguf.LlamaFileType.MOSTLY_Q4_K_M)),
    "Q6_K": (Q.Q6_K, int(gguf.LlamaFileType.MOSTLY_Q6_K)),
    "Q8_0": (Q.Q8_0, int(gguf.LlamaFileType.MOSTLY_Q8_0)),
    "MXFP4_MOE": (Q.MXFP4, int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)),
    "F16": (Q.F16, int(gguf.LlamaFileType.MOSTLY_F16)),
}
# A block-256 type that does not divide a row falls back to a block-32 type of similar size.
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


@dataclass(frozen=True, slots=True)
class TensorShape:
    """One tensor before typing: name and ggml shape (ne0, the row width, first)."""

    name: str
    ne: tuple[int, ...]


def recipe_names() -> tuple[str, ...]:
    return tuple(RECIPES)


def check_recipe(recipe: str) -> str:
    key = recipe.upper()
    if key not in RECIPES:
        raise UsageError(f"unknown quantization recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    return key


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    return int(name.split(".", 2)[1]) if name.startswith("blk.") else 0


def quantized_name(name: str, ne: Sequence[int]) -> bool:
    """Whether llama-quantize quantizes a tensor of this name and shape (:func:`_quantized`)."""
    return _quantized(TensorShape(name, tuple(ne)))


def _quantized(t: TensorShape) -> bool:
    """llama-quantize touches only 2-D/3-D weights; norms, the router and the short conv stay as written."""
    n = t.name
    return (len([d for d in t.ne if d > 1]) >= 2 and n.endswith("weight") and "_norm.weight" not in n
            and "ffn_gate_inp.weight" not in n and "ssm_conv1d" not in n)


def assign_types(tensors: Sequence[TensorShape], recipe: str, n_expert: int, n_layer_all: int,
                 tensor_types: Sequence[tuple[str, str]] = ()) -> list[Q]:
    """The ggml type of each tensor of ``tensors`` (in file order) under ``recipe``.

    ``tensor_types`` are llama-quantize's ``--tensor-type PATTERN=TYPE`` overrides as a publisher passed them:
    as in the pinned ``llama_tensor_get_type`` (src/llama-quant.cpp), for a quantized recipe the first pattern
    that ``regex_search`` finds in a tensor's name replaces the recipe's pick (and that tensor no longer counts
    in the attn_v sequence); a row width the type cannot split falls back as any pick does.
    """
    base, _ = RECIPES[check_recipe(recipe)]
    manual = [(re.compile(pattern), gguf.GGMLQuantizationType[typ.upper()]) for pattern, typ in tensor_types]
    names = [t.name for t in tensors]
    tied = "output.weight" not in names
    n_attn_v = sum(1 for n in names if "attn_v.weight" in n or "attn_qkv.weight" in n)
    i_attn_v = 0
    out: list[Q] = []
    for t in tensors:
        if not _quantized(t):
            out.append(Q.F32)
            continue
        typ = base
        name = t.name
        if base is Q.F16:  # not a quantized recipe: llama-quantize applies no --tensor-type to it
            out.append(Q.F16)
            continue
        override = next((q for pattern, q in manual if pattern.search(name)), None)
        if override is not None:
            out.append(_fit_row(override, t.ne[0]))
            continue
        is_output = name == "output.weight" or (tied and name == "token_embd.weight")
        if is_output:
            if base is Q.MXFP4 or t.ne[0] % 256:
                typ = Q.Q8_0
            elif base is not Q.Q8_0:
                typ = Q.Q6_K
        elif base is Q.MXFP4:
            typ = Q.MXFP4 if len(t.ne) >= 3 and t.ne[2] > 1 else Q.Q8_0
        elif name == "token_embd.weight":
            pass
        elif "attn_v.weight" in name or "attn_qkv.weight" in name:
            if base is Q.Q4_K and _use_more_bits(i_attn_v, n_attn_v):
                typ = Q.Q6_K
            if n_expert == 8:
                typ = Q.Q8_0
            i_attn_v += 1
        elif "attn_k.weight" in name:
            if n_expert == 8:
                typ = Q.Q8_0
        elif "ffn_down" in name:
            if base is Q.Q4_K and _use_more_bits(_layer(name), n_layer_all):
                typ = Q.Q6_K
        elif "attn_output.weight" in name and n_expert == 8 and base is Q.Q4_K:
            typ = Q.Q5_K
        out.append(_fit_row(typ, t.ne[0]))
    return out


def _fit_row(typ: Q, ncols: int) -> Q:
    block = gguf.GGML_QUANT_SIZES[typ][0]
    if ncols % block == 0:
        return typ
    typ = _FALLBACK.get(typ, typ)
    return typ if ncols % gguf.GGML_QUANT_SIZES[typ][0] == 0 else Q.F16


def n_bytes(ne: Sequence[int], typ: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[typ]
    n = 1
    for d in ne:
        n *= d
    return n // block * size
