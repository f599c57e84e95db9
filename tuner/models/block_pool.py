"""Pools of valid quantized blocks, made once per ggml type by the real llama-quantize and cached.

A valid-weight model at real scale needs every quantized tensor filled with blocks that llama.cpp decodes
to finite, trained-looking numbers (scales that are finite halves, codes in range). Nobody here writes a
quantizer: the tiny demo model's weights (Gaussian, std 0.02, like a trained checkpoint's) are quantized by
llama-quantize with the expert tensors forced to the wanted type, and those blocks become the pool. The
writer then samples pool blocks at random for each tensor, so rows (and experts) differ from each other.
Each pool is checked by decoding it with gguf-py's reference dequantizer.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np

from tuner.core.errors import EngineError, UsageError
from tuner.engine import flags, runner
from tuner.engine.build import EngineLocation
from tuner.machine import paths

Q = gguf.GGMLQuantizationType
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
MAX_BLOCKS = 65536  # Q4_K: 9 MiB; random draws from this many blocks make rows practically all distinct
POOL_SEED = 11
POOL_VERSION = 1  # bump when the way pools are made changes
# The demo model's weights have this std; decoded pools must come back near it.
SOURCE_STD = 0.02


def pool_dir() -> Path:
    return paths.cache_root() / "block-pools"


def pool_path(typ: Q) -> Path:
    return pool_dir() / f"{typ.name}-v{POOL_VERSION}.npy"


def block_pools(types: Iterable[Q], engine: EngineLocation | None) -> dict[Q, np.ndarray]:
    """One pool (n_blocks × type_size bytes) per quantized type in ``types``, made on first use."""
    pools: dict[Q, np.ndarray] = {}
    for typ in sorted(set(types) - FLOAT_TYPES):
        path = pool_path(typ)
        if not path.is_file():
            if engine is None:
                raise UsageError(f"valid {typ.name} weights need llama-quantize once: run `moe-tune engine install`")
            _make_pool(typ, engine, path)
        pools[typ] = np.load(path)
    return pools


def decoded_std(pool: np.ndarray, typ: Q) -> float:
    """Std of the pool's decoded values (gguf-py's reference dequantizer); raises if any is not finite."""
    values = gguf.quants.dequantize(pool, typ)
    if not np.isfinite(values).all():
        raise EngineError(f"the {typ.name} block pool decodes to non-finite values: delete {pool_dir()} and retry")
    return float(values.std())


def _make_pool(typ: Q, engine: EngineLocation, path: Path) -> None:
    from tuner.models import demo_model  # the pool's source is a demo model; the writer does not import this module

    path.parent.mkdir(parents=True, exist_ok=True)
    block_bytes = gguf.GGML_QUANT_SIZES[typ][1]
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = demo_model.write_demo_model(Path(tmp) / "source-F16.gguf", "qwen3moe", "tiny", seed=POOL_SEED)
        dst = Path(tmp) / f"source-{typ.name}.gguf"
        runner.run_process(
            flags.quantize_argv(engine.tool(flags.QUANTIZE), src, dst, "Q8_0", tensor_types=[("_exps", typ.name)]),
            timeout_s=600, what=f"llama-quantize (a {typ.name} block pool)",
            fix=f"this engine's llama-quantize cannot write {typ.name}; pick another recipe",
        )
        parts = [np.asarray(t.data).reshape(-1, block_bytes) for t in gguf.GGUFReader(dst).tensors
                 if t.tensor_type == typ]
        if not parts:
            raise EngineError(f"llama-quantize wrote no {typ.name} tensors for the block pool: pick another recipe")
        pool = np.ascontiguousarray(np.concatenate(parts)[:MAX_BLOCKS])
    std = decoded_std(pool, typ)
    if not 0.5 * SOURCE_STD < std < 2 * SOURCE_STD:
        raise EngineError(f"the {typ.name} block pool decodes to std {std:.4f}, not ~{SOURCE_STD}: report this")
    tmp_path = path.with_name(f".{path.stem}.{os.getpid()}.npy")
    np.save(tmp_path, pool)
    os.replace(tmp_path, path)
