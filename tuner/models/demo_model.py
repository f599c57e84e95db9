"""Random-weight Mixture-of-Experts GGUF files that the real llama.cpp loads and runs.

Tests and demos need MoE models with the same tensor names, shapes and metadata as real Qwen3 MoE
and Qwen3.5 MoE checkpoints, without downloading gigabytes. The weights are noise, so the text is
nonsense, but every code path that matters for tuning (expert offload, quantization, KV cache,
recurrent state) runs for real.

"tiny" (~16 M parameters, ~33 MB in F16) is for fast tests; "large" (~260-280 M parameters,
500-600 MB in F16) is big enough that CPU benchmarks read weights from RAM, not from cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from tuner.core.errors import UsageError
from tuner.models.vocab import Vocab, train_vocab

DEMO_ARCHS = ("qwen3moe", "qwen35moe")
DEMO_SIZES = ("tiny", "large")

GGUF_FILE_TYPE_F16 = 1
WEIGHT_STD = 0.02
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """Shape of a demo model. Widths that feed K-quant rows are multiples of 256."""

    arch: str
    size: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int  # 0: no shared expert (qwen3moe)
    n_vocab: int
    ctx_train: int
    tied_embeddings: bool  # no output.weight; llama.cpp reuses token_embd for the LM head
    rope_freq_base: float
    rms_eps: float = 1e-6
    # Gated delta-net (linear attention) layers of qwen35moe; unused for qwen3moe.
    ssm_d_conv: int = 0
    ssm_d_state: int = 0  # per-head key (and value) width
    ssm_n_group: int = 0  # number of key heads
    ssm_dt_rank: int = 0  # number of value heads
    full_attention_interval: int = 0  # every Nth layer is full attention, the rest are delta-net
    rope_dim: int = 0  # rotary dims per head; 0 means the whole head
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def name(self) -> str:
        return f"moe-tune demo {self.arch} {self.size}"

    @property
    def is_hybrid(self) -> bool:
        return self.arch == "qwen35moe"

    @property
    def ssm_d_inner(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank

    def is_recurrent(self, layer: int) -> bool:
        return self.is_hybrid and (layer + 1) % self.full_attention_interval != 0

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in _tensor_plan(self))

    @property
    def f16_data_bytes(self) -> int:
        """Tensor bytes of the F16 file (header and alignment padding not included)."""
        return sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in _tensor_plan(self))


_SPECS: dict[tuple[str, str], DemoSpec] = {
    ("qwen3moe", "tiny"): DemoSpec(
        arch="qwen3moe", size="tiny", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
        n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=0, n_vocab=4096, ctx_train=32768,
        tied_embeddings=False, rope_freq_base=1_000_000.0,
    ),
    ("qwen3moe", "large"): DemoSpec(
        arch="qwen3moe", size="large", n_layer=12, n_embd=768, n_head=8, n_head_kv=2, head_dim=128,
        n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff_shexp=0, n_vocab=4096, ctx_train=32768,
        tied_embeddings=False, rope_freq_base=1_000_000.0,
    ),
    # Tied embeddings keep the tiny hybrid under 35 MB; the large one ties too so the arch is consistent.
    ("qwen35moe", "tiny"): DemoSpec(
        arch="qwen35moe", size="tiny", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
        n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, n_vocab=4096, ctx_train=32768,
        tied_embeddings=True, rope_freq_base=10_000_000.0,
        ssm_d_conv=4, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4, full_attention_interval=4,
        rope_dim=16, rope_sections=(3, 3, 2, 0),
    ),
    ("qwen35moe", "large"): DemoSpec(
        arch="qwen35moe", size="large", n_layer=12, n_embd=768, n_head=8, n_head_kv=2, head_dim=128,
        n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff_shexp=512, n_vocab=4096, ctx_train=32768,
        tied_embeddings=True, rope_freq_base=10_000_000.0,
        ssm_d_conv=4, ssm_d_state=128, ssm_n_group=4, ssm_dt_rank=8, full_attention_interval=4,
        rope_dim=32, rope_sections=(6, 5, 5, 0),
    ),
}


def demo_spec(arch: str, size: str = "tiny") -> DemoSpec:
    if arch not in DEMO_ARCHS:
        raise UsageError(f"unknown demo arch {arch!r}: use one of {', '.join(DEMO_ARCHS)}")
    if size not in DEMO_SIZES:
        raise UsageError(f"unknown demo size {size!r}: use one of {', '.join(DEMO_SIZES)}")
    return _SPECS[(arch, size)]


@dataclass(frozen=True, slots=True)
class _PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: the reverse of ggml's ne
    dtype: type[np.floating]
    fill: Literal["normal", "ones", "zeros", "decay"]  # "decay" is ssm_a's negative rates


def _tensor_plan(spec: DemoSpec) -> list[_PlannedTensor]:
    """Every tensor the llama.cpp loader asks for, and nothing more (extra tensors fail the load)."""
    f16, f32 = np.float16, np.float32

    def weight(name: str, *ne: int) -> _PlannedTensor:
        return _PlannedTensor(name, tuple(reversed(ne)), f16, "normal")

    def norm(name: str, n: int) -> _PlannedTensor:
        return _PlannedTensor(name, (n,), f32, "ones")

    e, v = spec.n_embd, spec.n_vocab
    plan = [weight("token_embd.weight", e, v)]
    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        plan.append(norm(f"{blk}.attn_norm.weight", e))
        if spec.is_recurrent(il):
            plan += _delta_net_tensors(spec, blk)
        else:
            # Qwen3.5 full attention projects a query and an output gate per head, hence 2x.
            q_width = spec.head_dim * spec.n_head * (2 if spec.is_hybrid else 1)
            kv_width = spec.head_dim * spec.n_head_kv
            plan += [
                weight(f"{blk}.attn_q.weight", e, q_width),
                weight(f"{blk}.attn_k.weight", e, kv_width),
                weight(f"{blk}.attn_v.weight", e, kv_width),
                weight(f"{blk}.attn_output.weight", spec.head_dim * spec.n_head, e),
                norm(f"{blk}.attn_q_norm.weight", spec.head_dim),
                norm(f"{blk}.attn_k_norm.weight", spec.head_dim),
            ]
        # qwen35moe calls its pre-FFN norm post_attention_norm; the role is the same.
        plan.append(norm(f"{blk}.{'post_attention_norm' if spec.is_hybrid else 'ffn_norm'}.weight", e))
        # The router stays F32, as convert_hf_to_gguf.py writes it and llama-quantize leaves it.
        plan.append(_PlannedTensor(f"{blk}.ffn_gate_inp.weight", (spec.n_expert, e), f32, "normal"))
        plan += [
            weight(f"{blk}.ffn_gate_exps.weight", e, spec.n_ff_exp, spec.n_expert),
            weight(f"{blk}.ffn_up_exps.weight", e, spec.n_ff_exp, spec.n_expert),
            weight(f"{blk}.ffn_down_exps.weight", spec.n_ff_exp, e, spec.n_expert),
        ]
        if spec.n_ff_shexp:
            plan += [
                _PlannedTensor(f"{blk}.ffn_gate_inp_shexp.weight", (e,), f32, "normal"),
                weight(f"{blk}.ffn_gate_shexp.weight", e, spec.n_ff_shexp),
                weight(f"{blk}.ffn_up_shexp.weight", e, spec.n_ff_shexp),
                weight(f"{blk}.ffn_down_shexp.weight", spec.n_ff_shexp, e),
            ]
    plan.append(norm("output_norm.weight", e))
    if not spec.tied_embeddings:
        plan.append(weight("output.weight", e, v))
    return plan


def _delta_net_tensors(spec: DemoSpec, blk: str) -> list[_PlannedTensor]:
    e = spec.n_embd
    key_dim = spec.ssm_d_state * spec.ssm_n_group
    value_dim = spec.ssm_d_inner
    conv_dim = 2 * key_dim + value_dim
    f16, f32 = np.float16, np.float32
    return [
        _PlannedTensor(f"{blk}.attn_qkv.weight", (conv_dim, e), f16, "normal"),
        _PlannedTensor(f"{blk}.attn_gate.weight", (value_dim, e), f16, "normal"),
        # The short convolution stays F32, as the converter writes it.
        _PlannedTensor(f"{blk}.ssm_conv1d.weight", (conv_dim, spec.ssm_d_conv), f32, "normal"),
        _PlannedTensor(f"{blk}.ssm_dt.bias", (spec.ssm_dt_rank,), f32, "zeros"),
        _PlannedTensor(f"{blk}.ssm_a", (spec.ssm_dt_rank,), f32, "decay"),
        _PlannedTensor(f"{blk}.ssm_beta.weight", (spec.ssm_dt_rank, e), f16, "normal"),
        _PlannedTensor(f"{blk}.ssm_alpha.weight", (spec.ssm_dt_rank, e), f16, "normal"),
        _PlannedTensor(f"{blk}.ssm_norm.weight", (spec.ssm_d_state,), f32, "ones"),
        _PlannedTensor(f"{blk}.ssm_out.weight", (e, value_dim), f16, "normal"),
    ]


def _fill(tensor: _PlannedTensor, rng: np.random.Generator) -> np.ndarray:
    if tensor.fill == "ones":
        return np.ones(tensor.shape, dtype=tensor.dtype)
    if tensor.fill == "zeros":
        return np.zeros(tensor.shape, dtype=tensor.dtype)
    if tensor.fill == "decay":
        # ssm_a holds -exp(A_log); real checkpoints start A in [1, 16], a negative decay rate.
        return -rng.uniform(1.0, 16.0, size=tensor.shape).astype(tensor.dtype)
    values = rng.standard_normal(tensor.shape, dtype=np.float32)
    values *= WEIGHT_STD
    return values.astype(tensor.dtype, copy=False)


def _tensor_data(plan: list[_PlannedTensor], seed: int) -> Iterator[np.ndarray]:
    # One generator drawn in plan order: the same seed gives the same bytes on every run.
    rng = np.random.default_rng(seed)
    for tensor in plan:
        yield _fill(tensor, rng)


def write_demo_model(path: Path, arch: str = "qwen3moe", size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight F16 MoE GGUF to ``path`` atomically and return ``path``."""
    spec = demo_spec(arch, size)
    vocab = train_vocab(spec.n_vocab)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory, so the final rename is atomic; readers never see a half-written model.
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    plan = _tensor_plan(spec)
    writer = gguf.GGUFWriter(tmp_path, spec.arch)
    try:
        _add_metadata(writer, spec, vocab)
        for tensor in plan:
            nbytes = int(np.prod(tensor.shape)) * np.dtype(tensor.dtype).itemsize
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(tensor.dtype), nbytes)
        # Header first, then one tensor at a time, so memory stays at one tensor, not the whole model.
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in _tensor_data(plan, seed):
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp_path, path)
    except BaseException:
        writer.close()
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def _add_metadata(w: gguf.GGUFWriter, spec: DemoSpec, vocab: Vocab) -> None:
    w.add_name(spec.name)
    w.add_file_type(GGUF_FILE_TYPE_F16)
    w.add_context_length(spec.ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_rope_dimension_count(spec.rope_dim or spec.head_dim)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.is_hybrid:
        w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
        w.add_ssm_conv_kernel(spec.ssm_d_conv)
        w.add_ssm_inner_size(spec.ssm_d_inner)
        w.add_ssm_state_size(spec.ssm_d_state)
        w.add_ssm_time_step_rank(spec.ssm_dt_rank)
        w.add_ssm_group_count(spec.ssm_n_group)
        w.add_full_attention_interval(spec.full_attention_interval)
        w.add_rope_dimension_sections(list(spec.rope_sections))

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_types))
    w.add_token_merges(list(vocab.merges))
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(vocab.add_bos)
    w.add_chat_template(CHATML_TEMPLATE)
