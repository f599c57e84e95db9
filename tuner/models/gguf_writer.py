"""The one GGUF writer for every synthetic model: demo models and shape-true models alike.

It writes the header (architecture keys, tokenizer, every tensor's name, shape and ggml type) and then the
data region in one of two ways:

- ``zero``: nothing. The file is truncated to its full size, so the data region is a sparse hole of zeros:
  gigabytes logical, megabytes on disk, written in seconds. llama.cpp loads and runs it, but a zero router
  ties every expert, so every token takes the same experts and prompt processing is far too cheap.
- ``random``: valid data of each tensor's type, streamed in chunks of at most :data:`CHUNK_BYTES` (constant
  memory). Float tensors are Gaussian (std 0.02, as a trained checkpoint's weights), norms are ones, biases
  zeros, recurrent decay rates negative; quantized tensors are blocks sampled at random from a pool that the
  real llama-quantize made (tuner.models.block_pool). A random router (std 0.02, as every weight) gives each
  token its own top-k, so the first layer's batch spreads over the experts (top-k does not depend on the
  router's scale); deeper layers collapse onto a few experts (see ``direct``).
- ``direct``: the same, but the pools are drawn here in numpy (tuner.models.direct_blocks): valid blocks
  assembled field by field, no engine needed, as fast to write as ``random``. One more difference keeps the
  router spread through depth: every layer's pre-mixer norm (``attn_norm``, which attention and linear attention
  read through in every architecture here) has gain :data:`MIXER_NORM_GAIN` instead of one. With all weights at
  std 0.02, a branch turns its normed (RMS 1) input into an output of RMS about 0.02·√width ≈ 1, fifty times the
  embedding's RMS, and random queries and keys attend almost uniformly, so the attention branch adds nearly the
  same vector to every token: the hidden states collapse onto it and the router sends every token to the same
  experts (llama-imatrix on OLMoE's shape, 8 layers, one 512-token chunk of the bundled corpus: the top expert
  took 99 % of the tokens in every layer and 26-30 of 64 experts were used past layer 2). At gain 0.02 the
  branch adds about what the embedding holds, tokens stay distinct, and all 64 experts take tokens in each of
  16 layers (results/benchmarks/valid-weights-writer.md).

One random generator is drawn in file order: the same seed writes the same bytes.
"""

from __future__ import annotations

import io
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tuner.core.errors import UsageError
from tuner.models import direct_blocks, recipes
from tuner.models.model_spec import ModelSpec, add_metadata, fill_of, tensor_plan
from tuner.models.recipes import Q, TensorShape
from tuner.models.vocab import Vocab

WEIGHTS = ("zero", "random", "direct")
ALIGNMENT = 32  # GGUF's default data alignment (general.alignment is not written)
WEIGHT_STD = 0.02
MIXER_NORM_GAIN = WEIGHT_STD  # ``direct``: the pre-mixer norm's gain (see above)
CHUNK_BYTES = 32 * 2**20
_QUEUE_CHUNKS = 3


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    name: str
    ne: tuple[int, ...]  # ggml order: the row width first
    typ: Q

    @property
    def n_bytes(self) -> int:
        return recipes.n_bytes(self.ne, self.typ)


@dataclass(frozen=True, slots=True)
class WriteTimes:
    """Where the time went: generating data (random draws, pool gathers), the write calls, the final fsync."""

    header_s: float = 0.0
    generate_s: float = 0.0
    write_s: float = 0.0
    sync_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WrittenModel:
    path: Path
    logical_bytes: int
    disk_bytes: int
    n_tensors: int
    weights: str
    times: WriteTimes


def planned_tensors(spec: ModelSpec, recipe: str) -> list[PlannedTensor]:
    plan: list[TensorShape] = tensor_plan(spec)
    types = recipes.assign_types(plan, recipe, spec.n_expert, spec.n_layer_all, spec.tensor_types)
    return [PlannedTensor(t.name, t.ne, typ) for t, typ in zip(plan, types, strict=True)]


def check_weights(weights: str) -> str:
    key = weights.lower()
    if key not in WEIGHTS:
        raise UsageError(f"unknown --weights {weights!r}: use one of {', '.join(WEIGHTS)}")
    return key


def write_model(
    path: Path, spec: ModelSpec, recipe: str, vocab: Vocab, *, title: str, weights: str = "zero", seed: int = 0,
    pools: Mapping[Q, np.ndarray] | None = None,
) -> WrittenModel:
    """Write ``spec`` quantized by ``recipe`` to ``path`` atomically (readers never see half a model).

    ``pools`` (tuner.models.block_pool.block_pools) must hold every quantized type when ``weights`` is random;
    ``direct`` draws its own (tuner.models.direct_blocks.direct_pools, from ``seed``).
    """
    t0 = time.perf_counter()
    weights = check_weights(weights)
    recipe = recipes.check_recipe(recipe)
    plan = planned_tensors(spec, recipe)
    pools = dict(pools or {})
    if weights == "direct":
        pools = direct_blocks.direct_pools({t.typ for t in plan}, seed)
    missing = {t.typ.name for t in plan if weights == "random" and t.typ not in _FLOAT and t.typ not in pools}
    if missing:
        raise UsageError(f"no block pool for {', '.join(sorted(missing))}: make them with block_pool.block_pools")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, spec.arch)
    try:
        add_metadata(writer, spec, title, recipes.RECIPES[recipe][1], vocab)
        for t in plan:
            _add_tensor_info(writer, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        data_start = _pad(tmp.stat().st_size)
        header_s = time.perf_counter() - t0
        times = WriteTimes(header_s=header_s)
        if weights == "zero":
            with open(tmp, "r+b") as f:  # the hole: tensor data is never written
                f.truncate(data_start + sum(_pad(t.n_bytes) for t in plan))
        else:
            times = _stream(tmp, data_start, plan, seed, pools, header_s, weights)
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    total = time.perf_counter() - t0
    times = WriteTimes(times.header_s, times.generate_s, times.write_s, times.sync_s, total)
    return WrittenModel(path, path.stat().st_size, path.stat().st_blocks * 512, len(plan), weights, times)


_FLOAT = {Q.F32: np.float32, Q.F16: np.float16}


def _pad(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _add_tensor_info(writer: gguf.GGUFWriter, t: PlannedTensor) -> None:
    if t.typ in _FLOAT:
        writer.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(_FLOAT[t.typ]), t.n_bytes)
    else:
        block, size = gguf.GGML_QUANT_SIZES[t.typ]
        byte_shape = (*reversed(t.ne[1:]), t.ne[0] // block * size)
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.n_bytes, raw_dtype=t.typ)


def _chunks(t: PlannedTensor, rng: np.random.Generator, pools: Mapping[Q, np.ndarray], weights: str = "random"
            ) -> Iterator[np.ndarray]:
    """The tensor's bytes in order, at most about CHUNK_BYTES at a time."""
    fill = fill_of(t.name)
    n = 1
    for d in t.ne:
        n *= d
    if t.typ not in _FLOAT:
        if fill != "normal":
            raise UsageError(f"{t.name} is {t.typ.name} but should be {fill}: keep norms and biases in F32")
        pool = pools[t.typ]
        items = pool.view(f"V{pool.shape[1]}").ravel()  # one item per block, so a gather copies whole blocks
        n_blocks = n // gguf.GGML_QUANT_SIZES[t.typ][0]
        step = max(1, CHUNK_BYTES // pool.shape[1])
        for first in range(0, n_blocks, step):
            yield items[rng.integers(0, len(items), min(step, n_blocks - first))]
        return
    dtype = _FLOAT[t.typ]
    if fill == "ones":
        gain = MIXER_NORM_GAIN if weights == "direct" and t.name.endswith(".attn_norm.weight") else 1.0
        yield np.full(n, gain, dtype=dtype)
    elif fill == "zeros":
        yield np.zeros(n, dtype=dtype)
    elif fill == "decay":
        # ssm_a holds -exp(A_log); real checkpoints start A in [1, 16], a negative decay rate.
        yield -rng.uniform(1.0, 16.0, size=n).astype(dtype)
    else:
        step = max(t.ne[0], CHUNK_BYTES // 4 // t.ne[0] * t.ne[0])  # whole rows; F32 draws, then cast
        for first in range(0, n, step):
            values = rng.standard_normal(min(step, n - first), dtype=np.float32)
            values *= WEIGHT_STD
            yield values.astype(dtype, copy=False)


def _write_all(f: io.RawIOBase, item: np.ndarray | bytes) -> None:
    view = memoryview(item) if isinstance(item, bytes) else memoryview(item.view(np.uint8).data)
    while view:
        view = view[f.write(view) or 0:]


def _stream(path: Path, data_start: int, plan: Sequence[PlannedTensor], seed: int,
            pools: Mapping[Q, np.ndarray], header_s: float, weights: str) -> WriteTimes:
    """Generate on this thread, write on another: the draws and gathers overlap the write calls."""
    rng = np.random.default_rng(seed)
    todo: queue.Queue[np.ndarray | bytes | None] = queue.Queue(maxsize=_QUEUE_CHUNKS)
    write_s = [0.0]
    failed: list[BaseException] = []

    with open(path, "r+b", buffering=0) as f:
        f.seek(data_start)

        def drain() -> None:
            while (item := todo.get()) is not None:
                if failed:
                    continue
                t = time.perf_counter()
                try:
                    _write_all(f, item)
                except BaseException as e:  # noqa: BLE001 - handed to the generating thread
                    failed.append(e)
                write_s[0] += time.perf_counter() - t

        worker = threading.Thread(target=drain, name="gguf-writer", daemon=True)
        worker.start()
        generate_s = 0.0
        try:
            for t in plan:
                start = time.perf_counter()
                for chunk in _chunks(t, rng, pools, weights):
                    generate_s += time.perf_counter() - start
                    todo.put(chunk)
                    if failed:
                        raise failed[0]
                    start = time.perf_counter()
                generate_s += time.perf_counter() - start
                todo.put(bytes(_pad(t.n_bytes) - t.n_bytes))
        finally:
            todo.put(None)
            worker.join()
        if failed:
            raise failed[0]
        start = time.perf_counter()
        os.fsync(f.fileno())
        sync_s = time.perf_counter() - start
    return WriteTimes(header_s, generate_s, write_s[0], sync_s)
