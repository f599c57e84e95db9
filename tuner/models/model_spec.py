"""One description of a model's shape, the tensors llama.cpp's loader asks for, and the GGUF keys.

Demo models (tuner.models.demo_model) and shape-true models (tuner.models.shape_model) are both a
:class:`ModelSpec`; :func:`tensor_plan` lists every tensor of a spec in ggml order, :func:`fill_of` says
what a valid value of each looks like, and :func:`add_metadata` writes the architecture and tokenizer keys.
tuner.models.gguf_writer turns the three into a file. A spec with ``n_expert == 0`` is a dense model (every
layer's FFN is ``n_ff_dense`` wide): Qwen3.5-9B/27B, arch ``qwen35``, the MoE models' usual comparators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import gguf

from tuner.models.recipes import TensorShape
from tuner.models.vocab import Vocab

ARCHS = ("qwen3moe", "qwen35moe", "qwen35", "qwen3next", "gpt-oss", "glm4moe", "olmoe")
# Hybrid delta-net archs: a query/output gate on attention, delta-net layers between (src/models/qwen3next.cpp,
# qwen35moe.cpp, qwen35.cpp at the pinned commit).
GATED_HYBRID_ARCHS = ("qwen35moe", "qwen35", "qwen3next")
_TOKENIZER_PRE = {"qwen3moe": "qwen2", "qwen35moe": "qwen35", "qwen35": "qwen35", "qwen3next": "qwen2",
                  "gpt-oss": "gpt-4o", "glm4moe": "glm4", "olmoe": "olmo"}
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

Fill = Literal["normal", "ones", "zeros", "decay"]  # "decay" is ssm_a's negative rates


@dataclass(frozen=True, slots=True)
class ModelSpec:
    arch: str
    name: str
    n_layer: int  # trunk layers (without NextN/MTP layers)
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int  # 0: a dense model
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    ctx_train: int
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    n_ff_dense: int = 0  # the FFN width of a dense layer (every layer of a dense model; the lead layers of a MoE)
    n_layer_dense_lead: int = 0
    n_layer_nextn: int = 0
    tied: bool = False  # no output.weight; llama.cpp reuses token_embd for the LM head
    rope_theta: float = 1_000_000.0
    rope_dim: int = 0  # 0: the whole head
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    rms_eps: float = 1e-6
    n_swa: int = 0
    full_attention_interval: int = 0  # every Nth layer is full attention, the rest are delta-net
    ssm_d_conv: int = 0
    ssm_d_state: int = 0  # per-head key (and value) width
    ssm_n_group: int = 0  # number of key heads
    ssm_dt_rank: int = 0  # number of value heads
    tokenizer_pre: str = ""  # "": the architecture's usual pre-tokenizer
    # (regex, ggml type) the GGUF's publisher passed to llama-quantize as --tensor-type: they replace the recipe's pick
    tensor_types: tuple[tuple[str, str], ...] = ()
    assumed: tuple[str, ...] = field(default=())  # fields not taken from the source (catalog or config)

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + self.n_layer_nextn

    @property
    def is_dense(self) -> bool:
        return self.n_expert == 0

    @property
    def ssm_d_inner(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank

    def is_recurrent(self, il: int) -> bool:
        return bool(self.full_attention_interval) and il < self.n_layer and (il + 1) % self.full_attention_interval != 0

    @property
    def n_params(self) -> int:
        total = 0
        for t in tensor_plan(self):
            n = 1
            for d in t.ne:
                n *= d
            total += n
        return total


def fill_of(name: str) -> Fill:
    """What a trained checkpoint's tensor of this name looks like, as far as finite, sane output needs."""
    if name.endswith("norm.weight"):
        return "ones"
    if name.endswith(".bias") or name.endswith("attn_sinks.weight"):
        return "zeros"
    if name.endswith(".ssm_a"):
        return "decay"
    return "normal"


# --- tensor plans: what each architecture's llama.cpp loader asks for, in ggml (ne) order ---------------


def tensor_plan(s: ModelSpec) -> list[TensorShape]:
    """Every tensor the llama.cpp loader asks for, and nothing more (extra tensors fail the load)."""
    e, v = s.n_embd, s.n_vocab
    plan = [TensorShape("token_embd.weight", (e, v))]
    for il in range(s.n_layer_all):
        plan += _layer_plan(s, il)
    plan.append(TensorShape("output_norm.weight", (e,)))
    if not s.tied:
        plan.append(TensorShape("output.weight", (e, v)))
    return plan


def _attention(s: ModelSpec, b: str) -> list[TensorShape]:
    e, hd = s.n_embd, s.head_dim
    q_width, kv_width = hd * s.n_head, hd * s.n_head_kv
    gated = s.arch in GATED_HYBRID_ARCHS  # a query and an output gate per head
    t = [TensorShape(f"{b}.attn_q.weight", (e, q_width * (2 if gated else 1))),
         TensorShape(f"{b}.attn_k.weight", (e, kv_width)), TensorShape(f"{b}.attn_v.weight", (e, kv_width))]
    if s.arch in ("gpt-oss", "glm4moe"):
        t += [TensorShape(f"{b}.attn_q.bias", (q_width,)), TensorShape(f"{b}.attn_k.bias", (kv_width,)),
              TensorShape(f"{b}.attn_v.bias", (kv_width,))]
    t.append(TensorShape(f"{b}.attn_output.weight", (q_width, e)))
    if s.arch == "gpt-oss":
        t += [TensorShape(f"{b}.attn_output.bias", (e,)), TensorShape(f"{b}.attn_sinks.weight", (s.n_head,))]
    if s.arch == "olmoe":  # OLMoE normalizes the whole q and k projections, not each head
        t += [TensorShape(f"{b}.attn_q_norm.weight", (q_width,)), TensorShape(f"{b}.attn_k_norm.weight", (kv_width,))]
    elif s.arch not in ("gpt-oss", "glm4moe"):
        t += [TensorShape(f"{b}.attn_q_norm.weight", (hd,)), TensorShape(f"{b}.attn_k_norm.weight", (hd,))]
    return t


def _delta_net(s: ModelSpec, b: str) -> list[TensorShape]:
    e = s.n_embd
    key_dim, value_dim = s.ssm_d_state * s.ssm_n_group, s.ssm_d_inner
    conv_dim = 2 * key_dim + value_dim
    if s.arch == "qwen3next":  # one fused q/k/v/z input projection and one fused beta/alpha
        t = [TensorShape(f"{b}.ssm_in.weight", (e, 2 * key_dim + 2 * value_dim))]
    else:
        t = [TensorShape(f"{b}.attn_qkv.weight", (e, conv_dim)), TensorShape(f"{b}.attn_gate.weight", (e, value_dim))]
    t += [TensorShape(f"{b}.ssm_conv1d.weight", (s.ssm_d_conv, conv_dim)),
          TensorShape(f"{b}.ssm_dt.bias", (s.ssm_dt_rank,)), TensorShape(f"{b}.ssm_a", (s.ssm_dt_rank,))]
    if s.arch == "qwen3next":
        t.append(TensorShape(f"{b}.ssm_ba.weight", (e, 2 * s.ssm_dt_rank)))
    else:
        t += [TensorShape(f"{b}.ssm_beta.weight", (e, s.ssm_dt_rank)),
              TensorShape(f"{b}.ssm_alpha.weight", (e, s.ssm_dt_rank))]
    return t + [TensorShape(f"{b}.ssm_norm.weight", (s.ssm_d_state,)),
                TensorShape(f"{b}.ssm_out.weight", (value_dim, e))]


def _ffn(s: ModelSpec, b: str, il: int) -> list[TensorShape]:
    e = s.n_embd
    if s.is_dense or il < s.n_layer_dense_lead:
        dense = s.n_ff_dense
        return [TensorShape(f"{b}.ffn_gate.weight", (e, dense)), TensorShape(f"{b}.ffn_down.weight", (dense, e)),
                TensorShape(f"{b}.ffn_up.weight", (e, dense))]
    ff, ne = s.n_ff_exp, s.n_expert
    # The router stays F32, as convert_hf_to_gguf.py writes it and llama-quantize leaves it.
    t = [TensorShape(f"{b}.ffn_gate_inp.weight", (e, ne))]
    if s.arch == "gpt-oss":
        t.append(TensorShape(f"{b}.ffn_gate_inp.bias", (ne,)))
    if s.arch == "glm4moe":
        t.append(TensorShape(f"{b}.exp_probs_b.bias", (ne,)))
    t += [TensorShape(f"{b}.ffn_gate_exps.weight", (e, ff, ne)), TensorShape(f"{b}.ffn_up_exps.weight", (e, ff, ne)),
          TensorShape(f"{b}.ffn_down_exps.weight", (ff, e, ne))]
    if s.arch == "gpt-oss":
        t += [TensorShape(f"{b}.ffn_gate_exps.bias", (ff, ne)), TensorShape(f"{b}.ffn_up_exps.bias", (ff, ne)),
              TensorShape(f"{b}.ffn_down_exps.bias", (e, ne))]
    if s.n_ff_shexp and s.n_expert_shared:
        if s.arch in GATED_HYBRID_ARCHS:
            t.append(TensorShape(f"{b}.ffn_gate_inp_shexp.weight", (e,)))
        sh = s.n_ff_shexp
        t += [TensorShape(f"{b}.ffn_gate_shexp.weight", (e, sh)), TensorShape(f"{b}.ffn_up_shexp.weight", (e, sh)),
              TensorShape(f"{b}.ffn_down_shexp.weight", (sh, e))]
    return t


def _layer_plan(s: ModelSpec, il: int) -> list[TensorShape]:
    b, e = f"blk.{il}", s.n_embd
    t = [TensorShape(f"{b}.attn_norm.weight", (e,))]
    t += _delta_net(s, b) if s.is_recurrent(il) else _attention(s, b)
    # qwen35moe and friends call the pre-FFN norm post_attention_norm; the role is the same.
    post = "ffn_norm" if s.arch in ("qwen3moe", "olmoe") else "post_attention_norm"
    t.append(TensorShape(f"{b}.{post}.weight", (e,)))
    t += _ffn(s, b, il)
    if il >= s.n_layer:  # NextN / MTP block (GLM-4.5, Qwen3.5): predicts one more token; skipped unless drafting
        t += [TensorShape(f"{b}.nextn.eh_proj.weight", (2 * e, e)), TensorShape(f"{b}.nextn.enorm.weight", (e,)),
              TensorShape(f"{b}.nextn.hnorm.weight", (e,)), TensorShape(f"{b}.nextn.shared_head_norm.weight", (e,))]
    return t


# --- GGUF keys --------------------------------------------------------------------------------------------


def add_metadata(w: gguf.GGUFWriter, s: ModelSpec, title: str, file_type: int, vocab: Vocab) -> None:
    w.add_name(title)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    keys: list[tuple[Callable[[Any], None], object]] = [
        (w.add_context_length, s.ctx_train), (w.add_embedding_length, s.n_embd), (w.add_block_count, s.n_layer_all),
        (w.add_feed_forward_length, s.n_ff_dense or s.n_ff_exp), (w.add_head_count, s.n_head),
        (w.add_head_count_kv, s.n_head_kv), (w.add_key_length, s.head_dim), (w.add_value_length, s.head_dim),
        (w.add_layer_norm_rms_eps, s.rms_eps), (w.add_rope_freq_base, s.rope_theta),
        (w.add_rope_dimension_count, s.rope_dim or s.head_dim),
    ]
    if not s.is_dense:  # a dense GGUF carries no expert keys (convert_hf_to_gguf.py writes none)
        keys += [(w.add_expert_count, s.n_expert), (w.add_expert_used_count, s.n_expert_used),
                 (w.add_expert_feed_forward_length, s.n_ff_exp)]
    if s.n_expert_shared:
        keys += [(w.add_expert_shared_count, s.n_expert_shared),
                 (w.add_expert_shared_feed_forward_length, s.n_ff_shexp)]
    if s.n_swa:
        keys.append((w.add_sliding_window, s.n_swa))
    if s.arch == "glm4moe":
        keys += [(w.add_leading_dense_block_count, s.n_layer_dense_lead), (w.add_nextn_predict_layers, s.n_layer_nextn),
                 (w.add_expert_weights_scale, 1.0), (w.add_expert_weights_norm, True),
                 (w.add_expert_gating_func, gguf.ExpertGatingFuncType.SIGMOID)]
    if s.n_layer_nextn and s.arch != "glm4moe":  # an MTP head on another arch (qwen35/qwen35moe): the engine reads it
        keys.append((w.add_nextn_predict_layers, s.n_layer_nextn))
    if s.full_attention_interval:
        keys += [(w.add_ssm_conv_kernel, s.ssm_d_conv), (w.add_ssm_inner_size, s.ssm_d_inner),
                 (w.add_ssm_state_size, s.ssm_d_state), (w.add_ssm_time_step_rank, s.ssm_dt_rank),
                 (w.add_ssm_group_count, s.ssm_n_group), (w.add_full_attention_interval, s.full_attention_interval)]
    if any(s.rope_sections):
        keys.append((w.add_rope_dimension_sections, list(s.rope_sections)))
    keys += [
        (w.add_tokenizer_model, "gpt2"),
        (w.add_tokenizer_pre, s.tokenizer_pre or _TOKENIZER_PRE.get(s.arch, "default")),
        (w.add_token_list, list(vocab.tokens)), (w.add_token_types, list(vocab.token_types)),
        (w.add_token_merges, list(vocab.merges)), (w.add_bos_token_id, vocab.bos_id),
        (w.add_eos_token_id, vocab.eos_id), (w.add_pad_token_id, vocab.pad_id),
        (w.add_add_bos_token, vocab.add_bos), (w.add_chat_template, CHATML_TEMPLATE),
    ]
    for add, value in keys:
        add(value)
