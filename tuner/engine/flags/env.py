"""LaunchConfig settings llama.cpp reads from its environment, not its argv: rendered as ``VAR=value`` for the
process the runner starts and for every emitted line, and read back from a pasted line's leading assignments."""

from __future__ import annotations

from collections.abc import Mapping

from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError

# ggml/src/ggml-cuda/ggml-cuda.cu, ``ggml_backend_cuda_reg``: ``getenv("GGML_OP_OFFLOAD_MIN_BATCH") ? atoi(...) :
# 32`` is read once, when the CUDA backend registers its devices, into each device's op_offload_min_batch_size;
# ``ggml_backend_cuda_device_offload_op`` offloads an op on a host weight when ``get_op_batch_size(op)`` (a
# MUL_MAT's ne[1], a MUL_MAT_ID's ne[2]: the tokens of the ubatch) is at least that. The Vulkan, SYCL and Metal
# backends read the same variable; the CPU backend ignores it.
OP_OFFLOAD_MIN_BATCH_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"
OP_OFFLOAD_MIN_BATCH_DEFAULT = 32
# Every variable a rendered line may set before the program (what :func:`server_env` can return).
CONFIG_ENV = frozenset({OP_OFFLOAD_MIN_BATCH_ENV})


def server_env(cfg: LaunchConfig) -> dict[str, str]:
    """The environment ``cfg`` needs beside its argv (llama-server, llama-bench, llama-batched-bench alike); empty
    where every such setting is the engine's default."""
    validate_env(cfg)
    if cfg.op_offload and cfg.op_offload_min_batch is not None:
        return {OP_OFFLOAD_MIN_BATCH_ENV: str(cfg.op_offload_min_batch)}
    return {}


def validate_env(cfg: LaunchConfig) -> None:
    """Refuse a threshold that means nothing (op offload off) or that the engine would misread."""
    n = cfg.op_offload_min_batch
    if n is None:
        return
    if n < 1:
        raise UsageError(f"the op-offload threshold counts tokens, so it is >= 1, got {n}")
    if not cfg.op_offload:
        raise UsageError(f"{OP_OFFLOAD_MIN_BATCH_ENV}={n} only matters with op offload on: drop it or "
                         "drop --no-op-offload")


def env_prefix(cfg: LaunchConfig) -> list[str]:
    """``VAR=value`` words that go before the program in a shell line."""
    return [f"{k}={v}" for k, v in server_env(cfg).items()]


def config_env_fields(assignments: Mapping[str, str]) -> dict[str, object]:
    """LaunchConfig fields from a pasted line's leading ``VAR=value`` words (other variables are not settings)."""
    raw = assignments.get(OP_OFFLOAD_MIN_BATCH_ENV)
    if raw is None:
        return {}
    try:
        return {"op_offload_min_batch": int(raw)}
    except ValueError:
        raise UsageError(f"{OP_OFFLOAD_MIN_BATCH_ENV}={raw!r} is not a whole number of tokens: fix it in the "
                         "pasted command") from None
