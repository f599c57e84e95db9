"""Speed ceilings from bytes moved: generation is memory-bound, prompt processing with offloaded experts
is PCIe-bound. Pure, like tuner.plan.memory.

tg: every generated token reads the dense weights, the active experts (n_expert_used of n_expert) and the
KV cache filled so far; what lives on the GPU is read at GPU bandwidth, the rest at host RAM bandwidth.
pp: weights kept on the host (experts, or a dense model's layers below -ngl) are copied to the GPU once per
ubatch for large batches (the scheduler's op offload, from GGML_OP_OFFLOAD_MIN_BATCH tokens of the ubatch), so
pp <= n_ubatch / (bytes / PCIe).
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo, TensorClass
from tuner.plan.memory import kv_bytes_per_cell, resolve, tensor_on_gpu
from tuner.plan.op_offload import offloads_ubatch


@dataclass(frozen=True, slots=True)
class Roofline:
    gpu_bytes_per_token: int
    host_bytes_per_token: int
    gen_tok_s: float  # ceiling; 0.0 when a bandwidth is unknown
    prompt_tok_s: float | None  # PCIe bound for host weights; None: every weight on the GPU, or no op offload

    def percent_of_ceiling(self, measured_gen_tok_s: float) -> float | None:
        return 100.0 * measured_gen_tok_s / self.gen_tok_s if self.gen_tok_s else None


def roofline(model: ModelInfo, cfg: LaunchConfig, hw: Hardware, depth_tokens: int = 0) -> Roofline:
    backend = "cuda" if hw.has_gpu else "cpu"
    r = resolve(model, cfg, backend)
    active = model.n_expert_used / model.n_expert if model.n_expert else 1.0
    gpu = host = 0.0
    offloaded = 0  # host weights a large batch copies to the GPU
    for t in model.tensors:
        if t.klass is TensorClass.TOKEN_EMBD:
            continue  # one row per token: negligible
        read = t.n_bytes * (active if t.klass is TensorClass.ROUTED_EXPERTS else 1.0)
        if backend == "cuda" and tensor_on_gpu(model, r, t):
            gpu += read
        else:
            host += read
            offloaded += t.n_bytes
    kv_read = sum(kv_bytes_per_cell(model, il, cfg.cache_type_k, cfg.cache_type_v)
                  for il in range(model.n_layer)) * depth_tokens
    if backend == "cuda":
        gpu += kv_read
    else:
        host += kv_read
    seconds = 0.0
    known = True
    for n_bytes, bw in ((gpu, hw.gpu_bandwidth_bytes_s), (host, hw.host_bandwidth_bytes_s)):
        if n_bytes:
            if bw <= 0:
                known = False
            else:
                seconds += n_bytes / bw
    gen = 1.0 / seconds if known and seconds > 0 else 0.0
    prompt = None
    # A threshold above the ubatch keeps the host experts on the CPU: no copy, so no PCIe bound.
    if backend == "cuda" and offloaded and offloads_ubatch(cfg, r.n_ubatch) and hw.pcie_bandwidth_bytes_s > 0:
        prompt = r.n_ubatch / (offloaded / hw.pcie_bandwidth_bytes_s)
    return Roofline(int(gpu), int(host), gen, prompt)
