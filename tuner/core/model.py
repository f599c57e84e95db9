"""What a model is, as plain values: hyperparameters and bytes per tensor class.

Pure: the GGUF reader (:mod:`tuner.models.gguf_reader`) fills these from a header; the memory model and the
roofline compute from them without touching a file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

_EXPERT_RE = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")


class TensorClass(str, Enum):
    TOKEN_EMBD = "token_embd"
    OUTPUT = "output"
    ATTENTION = "attention"
    DENSE_FFN = "dense_ffn"
    ROUTER = "router"
    SHARED_EXPERTS = "shared_experts"
    ROUTED_EXPERTS = "routed_experts"
    RECURRENT = "recurrent"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: str  # gguf.GGMLQuantizationType name, e.g. "Q4_K"
    shape: tuple[int, ...]  # ggml order: ne0 (row width) first
    n_bytes: int
    layer: int | None  # None for token_embd, output and output_norm
    klass: TensorClass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    paths: tuple[Path, ...]
    arch: str
    name: str
    file_type: int | None
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer; 0 on layers without KV (recurrent)
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    ctx_train: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int
    n_ff_shexp: int
    n_swa: int  # sliding window size; 0: none
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    full_attention_interval: int  # hybrid recurrent: every Nth layer has KV; 0: not hybrid
    recurrent_layers: tuple[bool, ...]
    ssm_d_conv: int
    ssm_d_inner: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    mla_kv_lora_rank: int  # 0: no MLA
    mla_rope_dim: int
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    # Multi-token-prediction (NextN) blocks at the end of the stack ({arch}.nextn_predict_layers); 0: none.
    n_nextn_layers: int = 0
    # What a draft model must share to draft for this one: tokenizer model, BOS id, EOS id (-1: none).
    tokenizer_ids: tuple[str, int, int] = ("", -1, -1)

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def is_hybrid(self) -> bool:
        return any(self.recurrent_layers)

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank > 0

    @property
    def tied_embeddings(self) -> bool:
        return not any(t.name == "output.weight" for t in self.tensors)

    def bytes_by_class(self) -> dict[TensorClass, int]:
        out = dict.fromkeys(TensorClass, 0)
        for t in self.tensors:
            out[t.klass] += t.n_bytes
        return out

    def layer_bytes(self, layer: int) -> dict[TensorClass, int]:
        out = dict.fromkeys(TensorClass, 0)
        for t in self.tensors:
            if t.layer == layer:
                out[t.klass] += t.n_bytes
        return out


def is_routed_expert(name: str) -> bool:
    """The tensors `--n-cpu-moe` / `--cpu-moe` keep on the host (llama.cpp's own pattern)."""
    return bool(_EXPERT_RE.search(name + "."))

def iter_layer_tensors(info: ModelInfo, layer: int) -> Iterator[TensorInfo]:
    return (t for t in info.tensors if t.layer == layer)
