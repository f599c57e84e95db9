"""The CUDA compute buffers (tuner.plan.memory.split_compute_bytes) against a real H100's own figures.

Expected figures: llama-server's ``fit_memory_breakdown`` records (MiB, CUDA0 compute and Host compute) on an NVIDIA
H100 80GB, CUDA build of the pinned engine 0c1e57098, Qwen3-30B-A3B Q4_K_M written by the shape writer at real
scale, -np 1 (results/benchmarks/gpu-lease-2, logs.tgz: tune-*/…/logs and opoff-logs). They come from the engine,
not from this code; the model writes the same shape file here (sparse, about a second)."""

from __future__ import annotations

import pytest

from tuner.core.config import FlashAttn, LaunchConfig
from tuner.machine.hardware import Hardware
from tuner.models import gguf_reader, shape_model
from tuner.plan import memory

MIB = 2**20
H100 = Hardware("NVIDIA H100 80GB HBM3", 80 * 2**30, 80 * 2**30, 3.35e12, 50e9, 126 * 2**30, 125 * 2**30, 0, 40e9,
                16, "catalog")

# (ctx, --n-cpu-moe, -fa, -ub/-b, op offload) → (CUDA0 compute, Host compute), MiB, from the H100 run.
H100_ROWS = [
    ((8192, 10, FlashAttn.ON, None, True), (225, 16)),
    ((8192, 22, FlashAttn.ON, None, True), (225, 16)),
    ((8192, 34, FlashAttn.ON, None, True), (225, 16)),
    ((8192, 49, FlashAttn.ON, None, True), (225, 16)),  # every expert on the host
    ((8192, None, FlashAttn.AUTO, None, True), (92, 16)),  # everything on the GPU
    ((32768, 49, FlashAttn.AUTO, None, True), (249, 40)),
    # --no-op-offload: the host experts' up/gate/down and the activation between them run on the host, which reads
    # copies of the normed input and the expert ids; the device reads a copy of their output.
    ((32768, 49, FlashAttn.AUTO, None, False), (112, 80)),
    # -ub 4096: the fused MoE weighted sum's allocation dependencies keep the unweighted experts (256 MiB) alive
    # beside the weighted ones; without them the replay says 928. Without the split inputs allocated where their
    # split starts, the first six rows are 8 MiB over.
    ((32768, 35, FlashAttn.ON, 4096, True), (1149, 320)),
]
# Documented gaps: the host figure matches, the device one does not yet (strict xfail: a fix must update this).
H100_GAPS = [
    # Without flash attention (512 MiB of KQ scores a layer) the replay places 20 MiB less than the engine: 554 vs
    # 574. Not yet traced; the device figure was 1064 before split inputs were allocated where their split starts.
    ((8192, 2, FlashAttn.OFF, None, True), (574, 26)),
]


@pytest.fixture(scope="module")
def qwen30b(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "qwen3-30b-a3b-Q4_K_M.gguf"
    shape_model.write_catalog_model("qwen3-30b-a3b:Q4_K_M", path)
    return gguf_reader.inspect_model(path)


def _check(info, row, engine) -> None:
    ctx, n_cpu_moe, fa, ub, op_offload = row
    cfg = LaunchConfig(model=info.paths[0], ctx=ctx, parallel=1, n_cpu_moe=n_cpu_moe, flash_attn=fa, ubatch=ub,
                       batch=ub, op_offload=op_offload)
    est = memory.estimate(info, cfg, H100)
    ours = (est.gpu.compute_bytes // MIB, est.host.compute_bytes // MIB)
    assert ours == engine, (ours, engine)  # device and host, to the MiB the engine prints


@pytest.mark.parametrize(("row", "engine"), H100_ROWS)
def test_cuda_compute_buffers_match_the_h100(row, engine, qwen30b):
    """llama-server reserves logits for one output per slot (``server_output_limits``), not a whole ubatch as
    llama-fit-params does; inputs and the token rows live on the host, their device copies allocated where the
    split that first reads them starts; an offloaded host expert is copied up at the start of its own split; the
    CUDA backend's fusions keep what they read alive until the fused group ends."""
    _check(qwen30b, row, engine)


@pytest.mark.parametrize(("row", "engine"), H100_GAPS)
@pytest.mark.xfail(strict=True, reason="documented gap in the CUDA compute buffer (see H100_GAPS)")
def test_cuda_compute_buffer_gaps(row, engine, qwen30b):
    _check(qwen30b, row, engine)


def test_fit_params_projection_keeps_every_output(qwen30b):
    """llama-fit-params reserves logits for the whole ubatch: 512 tokens x 151,936 vocabulary x 4 bytes."""
    cfg = LaunchConfig(model=qwen30b.paths[0], ctx=8192, parallel=1)
    server = memory.estimate(qwen30b, cfg, H100).gpu.compute_bytes
    projected = memory.estimate(qwen30b, cfg, H100, fit_params=True).gpu.compute_bytes
    logits = 512 * qwen30b.n_vocab * 4
    assert projected >= logits > 2 * server
