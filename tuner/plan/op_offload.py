"""When the engine takes an op on a host-resident weight to the GPU (op offload), as the plan prices it.

ggml-cuda's ``ggml_backend_cuda_device_offload_op`` offloads an op whose batch (a MUL_MAT's ne[1], a MUL_MAT_ID's
ne[2]: the tokens of the ubatch) reaches ``op_offload_min_batch_size``, read from ``GGML_OP_OFFLOAD_MIN_BATCH``
(default 32) when the backend registers its devices; ``--no-op-offload`` turns it off.
"""

from __future__ import annotations

import math

from tuner.core.config import LaunchConfig
from tuner.core.model import TensorInfo

OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda's op_offload_min_batch_size when GGML_OP_OFFLOAD_MIN_BATCH is unset


def min_batch(cfg: LaunchConfig | None) -> int:
    """The tokens of a ubatch from which op offload takes host weights' ops to the GPU."""
    return OP_OFFLOAD_MIN_BATCH if cfg is None or cfg.op_offload_min_batch is None else cfg.op_offload_min_batch


def offloads_ubatch(cfg: LaunchConfig | None, n_ubatch: int) -> bool:
    """Does a ubatch of ``n_ubatch`` tokens copy host weights to the GPU? Below the threshold (or with op offload
    off) the CPU computes them and nothing is copied."""
    return (cfg is None or cfg.op_offload) and n_ubatch >= min_batch(cfg)


MATRIX_ROW_PADDING = 512  # ggml-cuda/common.cuh


def cuda_alloc_bytes(t: TensorInfo) -> int:
    """``ggml_backend_cuda_buffer_type_get_alloc_size``: a quantized tensor's rows are padded to a multiple of 512."""
    pad = (-t.shape[0]) % MATRIX_ROW_PADDING
    if not pad or t.ggml_type in ("F32", "F16", "BF16"):
        return t.n_bytes
    return t.n_bytes + t.n_bytes * pad // math.prod(t.shape)
