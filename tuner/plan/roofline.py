"""Speed ceilings from bytes moved: generation is memory-bound, prompt processing with offloaded experts
is bound by the link they are copied over. Pure, like tuner.plan.memory.

tg: every generated token reads the dense weights, the active experts (n_expert_used of n_expert) and the
KV cache filled so far; what lives on the GPU is read at GPU bandwidth, the rest at host RAM bandwidth.

pp: with op offload (``ggml_backend_cuda_device_offload_op``: an op whose batch reaches GGML_OP_OFFLOAD_MIN_BATCH
tokens), every ubatch copies the host weights it uses to the GPU, then the GPU reads what it holds. The scheduler
copies only the experts a ubatch routes to (``ggml_backend_sched_compute_splits``: "copying only the experts that
are used", llama.cpp PR 15346), and this pin does not overlap the copy with the matmul that reads it, so one
ubatch takes at least (GPU-resident bytes it reads) / VRAM bandwidth + (host bytes it copies) / link bandwidth.

Which experts a ubatch uses is the router's choice, which no header tells. The bound counts what an even
router would use (n tokens picking k of E experts each leave an expert unused with probability (1 - k/E)^n:
every expert at a 512-token ubatch); a router that concentrates tokens on fewer experts copies less and can run
faster (PR 15346 measured gpt-oss leaving experts unused), and a zero-filled model's tied router picks the same k
experts for every token, so its prompt figures say nothing about a trained model's.

The link moves pinned memory (CUDA_Host: ``--load-mode none`` on a CUDA build) by DMA at its own speed; pageable
pages (CPU_Mapped under mmap, plain CPU) go through the driver's staging buffer, slower by an amount the hardware
decides (measured at 0.30-0.77x of pinned: kekzl/imp PR 1409, one expert's copy 9.6 vs 32.4 GB/s; llama.cpp PR
28223, a 26K-token prefill 166 vs 330 tok/s on 2x RTX 3090; ollama issue 16221, 475 vs 616 tok/s on an RTX 3090).
No source gives that factor for a given machine, so the bound is the link's for both: pageable copies reach a
smaller share of it, which is why the load mode is measured, not priced (tuner.search.levers.load_mode_axis).
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo, TensorClass
from tuner.plan.memory import HostBuffer, host_buffer, kv_bytes_per_cell, resolve, tensor_on_gpu
from tuner.plan.op_offload import offloads_ubatch


@dataclass(frozen=True, slots=True)
class Roofline:
    gpu_bytes_per_token: int
    host_bytes_per_token: int
    gen_tok_s: float  # ceiling; 0.0 when a bandwidth is unknown
    prompt_tok_s: float | None  # link bound for host weights; None: every weight on the GPU, or no op offload
    prompt_copy_bytes: int = 0  # host bytes one ubatch copies to the GPU (0: none)
    # The copied weights sit in pinned memory (CUDA_Host) and reach the link's speed; False: pageable (mapped or
    # plain), a smaller share of it; None: nothing is copied.
    prompt_pinned: bool | None = None
    # A zero-filled model's router ties: a ubatch copies k of E experts, a trained model's nearly all of them.
    tied_router: bool = False

    def percent_of_ceiling(self, measured_gen_tok_s: float) -> float | None:
        return 100.0 * measured_gen_tok_s / self.gen_tok_s if self.gen_tok_s else None

    def prompt_percent(self, measured_prompt_tok_s: float) -> float | None:
        """The measured prompt speed as a share of the link bound; None where no bound applies or where the model
        is zero-filled (its tied router copies a few experts a ubatch: the share would say nothing)."""
        if not self.prompt_tok_s or self.tied_router:
            return None
        return 100.0 * measured_prompt_tok_s / self.prompt_tok_s


def expert_spread(model: ModelInfo, n_tokens: int, tied_router: bool = False) -> float:
    """The expected share of a layer's experts that ``n_tokens`` tokens route to: each picks ``n_expert_used`` of
    ``n_expert``, so an even router leaves an expert unused with probability (1 - k/E)^n; a tied router (zero
    weights) sends every token to the same k."""
    if not model.n_expert:
        return 1.0
    share = model.n_expert_used / model.n_expert
    return share if tied_router else 1.0 - (1.0 - share) ** max(1, n_tokens)


def roofline(model: ModelInfo, cfg: LaunchConfig, hw: Hardware, depth_tokens: int = 0, *,
             tied_router: bool = False) -> Roofline:
    """``cfg`` as placed: a line that leaves the placement to llama.cpp's ``--fit`` is priced at the placement fit
    would choose by the caller (tuner.plan.placement.placed_by_fit), not at every weight on the GPU."""
    backend = "cuda" if hw.has_gpu else "cpu"
    r = resolve(model, cfg, backend)
    active = model.n_expert_used / model.n_expert if model.n_expert else 1.0
    spread = expert_spread(model, r.n_ubatch, tied_router)
    gpu = host = 0.0
    gpu_ubatch = copied = 0.0  # bytes one prompt ubatch reads on the GPU / copies to it (op offload)
    pinned: set[bool] = set()
    for t in model.tensors:
        if t.klass is TensorClass.TOKEN_EMBD:
            continue  # one row per token: negligible, and its GET_ROWS stays on the host
        experts = t.klass is TensorClass.ROUTED_EXPERTS
        read = t.n_bytes * (active if experts else 1.0)
        used = t.n_bytes * (spread if experts else 1.0)
        if backend == "cuda" and tensor_on_gpu(model, r, t):
            gpu += read
            gpu_ubatch += used
        else:
            host += read
            copied += used
            pinned.add(host_buffer(t, cfg, backend) is HostBuffer.PINNED)
    kv_read = sum(kv_bytes_per_cell(model, il, cfg.cache_type_k, cfg.cache_type_v)
                  for il in range(model.n_layer)) * depth_tokens
    if backend == "cuda":
        gpu += kv_read
    else:
        host += kv_read
    gen = _rate(1.0, ((gpu, hw.gpu_bandwidth_bytes_s), (host, hw.host_bandwidth_bytes_s)))
    prompt = None
    # A threshold above the ubatch keeps the host experts on the CPU: no copy, so no link bound.
    copies = backend == "cuda" and copied > 0 and offloads_ubatch(cfg, r.n_ubatch)
    if copies and hw.pcie_bandwidth_bytes_s > 0:
        # The copies are read from VRAM once they land, like the weights the card holds; an unknown VRAM bandwidth
        # leaves that leg out (a looser bound, still a bound).
        vram = ((gpu_ubatch + copied, hw.gpu_bandwidth_bytes_s),) if hw.gpu_bandwidth_bytes_s > 0 else ()
        prompt = _rate(r.n_ubatch, (*vram, (copied, hw.pcie_bandwidth_bytes_s))) or None
    return Roofline(int(gpu), int(host), gen, prompt, int(copied) if copies else 0,
                    (pinned == {True}) if copies else None, tied_router)


def _rate(tokens: float, legs: tuple[tuple[float, float], ...]) -> float:
    """``tokens`` over the time the legs take one after another (bytes / bandwidth); 0.0 when a leg that moves bytes
    has no known bandwidth."""
    seconds = 0.0
    for n_bytes, bw in legs:
        if n_bytes:
            if bw <= 0:
                return 0.0
            seconds += n_bytes / bw
    return tokens / seconds if seconds > 0 else 0.0
