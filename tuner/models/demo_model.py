"""Random-weight Mixture-of-Experts GGUF files that the real llama.cpp loads and runs.

Tests and demos need MoE models with the same tensor names, shapes and metadata as real Qwen3 MoE
and Qwen3.5 MoE checkpoints, without downloading gigabytes. The weights are noise, so the text is
nonsense, but every code path that matters for tuning (expert offload, quantization, KV cache,
recurrent state) runs for real.

"tiny" (~16 M parameters, ~33 MB in F16) is for fast tests; "large" (~260-280 M parameters,
500-600 MB in F16) is big enough that CPU benchmarks read weights from RAM, not from cache.
A demo model is a small :class:`~tuner.models.model_spec.ModelSpec` written by the shared writer
(tuner.models.gguf_writer) in F16 with random weights and a BPE vocabulary trained here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner.core.errors import UsageError
from tuner.models import gguf_writer
from tuner.models.model_spec import ModelSpec
from tuner.models.vocab import train_vocab

DEMO_ARCHS = ("qwen3moe", "qwen35moe", "gpt-oss")
DEMO_SIZES = ("tiny", "large")


def _spec(arch: str, size: str, **shape: Any) -> ModelSpec:
    hybrid: dict[str, Any] = {}
    if arch == "gpt-oss":
        # Every other layer attends over a sliding window (llama.cpp's gpt-oss loader sets the pattern); the window
        # is small so that a short session already outgrows it, as gpt-oss's 128 tokens do at real scale.
        hybrid = dict(n_swa=128, rms_eps=1e-5)
    if arch == "qwen35moe":
        # Tied embeddings keep the tiny hybrid under 35 MB; the large one ties too so the arch is consistent.
        hybrid = dict(n_expert_shared=1, tied=True, rope_theta=10_000_000.0, ssm_d_conv=4, full_attention_interval=4)
    # Widths that feed K-quant rows are multiples of 256; the BPE vocabulary is trained for qwen2's split rule.
    return ModelSpec(arch=arch, name=f"moe-tune demo {arch} {size}", n_vocab=4096, ctx_train=32768,
                     tokenizer_pre="qwen2", **hybrid, **shape)


_SPECS: dict[tuple[str, str], ModelSpec] = {
    ("qwen3moe", "tiny"): _spec("qwen3moe", "tiny", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                                n_expert=8, n_expert_used=2, n_ff_exp=256),
    ("qwen3moe", "large"): _spec("qwen3moe", "large", n_layer=12, n_embd=768, n_head=8, n_head_kv=2, head_dim=128,
                                 n_expert=32, n_expert_used=4, n_ff_exp=256),
    ("qwen35moe", "tiny"): _spec("qwen35moe", "tiny", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                                 n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64,
                                 ssm_n_group=2, ssm_dt_rank=4, rope_dim=16, rope_sections=(3, 3, 2, 0)),
    ("qwen35moe", "large"): _spec("qwen35moe", "large", n_layer=12, n_embd=768, n_head=8, n_head_kv=2, head_dim=128,
                                  n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff_shexp=512, ssm_d_state=128,
                                  ssm_n_group=4, ssm_dt_rank=8, rope_dim=32, rope_sections=(6, 5, 5, 0)),
    ("gpt-oss", "tiny"): _spec("gpt-oss", "tiny", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                               n_expert=8, n_expert_used=2, n_ff_exp=256),
}


def demo_spec(arch: str, size: str = "tiny") -> ModelSpec:
    if arch not in DEMO_ARCHS:
        raise UsageError(f"unknown demo arch {arch!r}: use one of {', '.join(DEMO_ARCHS)}")
    if size not in DEMO_SIZES or (arch, size) not in _SPECS:
        raise UsageError(f"unknown demo size {size!r}: use one of {', '.join(DEMO_SIZES)}")
    return _SPECS[(arch, size)]


def write_demo_model(path: Path, arch: str = "qwen3moe", size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight F16 MoE GGUF to ``path`` atomically and return ``path``."""
    spec = demo_spec(arch, size)
    made = gguf_writer.write_model(Path(path), spec, "F16", train_vocab(spec.n_vocab), title=spec.name,
                                   weights="random", seed=seed)
    return made.path
