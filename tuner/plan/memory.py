"""What a launch costs in VRAM and RAM, before anything is launched. Pure: no I/O, no clock, no environment.

ModelInfo × LaunchConfig × Hardware → MemoryEstimate, following the pinned llama.cpp's placement rules:
``--n-cpu-moe N`` keeps the routed experts of the FIRST N layers on the host, ``-ngl N`` puts the LAST N
layers (the output head counts as one more) on the GPU, the token embedding always stays on the host, and
the KV of a layer lives where the layer lives.

Two backends are modelled separately. CPU: validated against the engine's own breakdown (see
``scripts/bench_memory_model.py``; the compute buffer, built as the engine builds it by tuner.plan.graph_arch,
in ``scripts/bench_compute_buffer.py``). CUDA: the same placement and KV arithmetic; the compute buffers are the
same graph split as ``ggml_backend_sched_split_graph`` splits it (host inputs, device copies, op offload), checked
against an H100's own breakdown (results/benchmarks/gpu-lease-2); plus a fixed CUDA context overhead.

Host RAM is the engine's buffer placement for the backend planned for (:func:`host_buffer`): each host
tensor lives in exactly one buffer, pinned (CUDA_Host), repacked (CPU_REPACK), mapped from the file
(CPU_Mapped) or plain (CPU). What a launch *needs* is those buffers once, plus KV, compute and output
buffers; the page cache the load leaves behind (file pages of tensors that went to the GPU, were repacked
or were read into anonymous memory) is *reclaimable*: the kernel drops it under pressure.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import Enum

from tuner.core.config import CacheType, FlashAttn, LaunchConfig, SpecType
from tuner.core.machine_spec import Hardware
from tuner.core.model import ModelInfo, TensorClass, TensorInfo
from tuner.core.units import MIB
from tuner.plan.graph_arch import GRAPH_ARCHS, ReserveShape, compute_buffer_bytes
from tuner.plan.op_offload import cuda_alloc_bytes, min_batch, offloads_ubatch
from tuner.plan.outputs import reserved_outputs

CTX_PAD = 256
DEFAULT_BATCH = 2048
DEFAULT_UBATCH = 512
DEFAULT_PARALLEL = 4  # llama-server's -np auto: 4 slots sharing one unified KV cache
FIT_MARGIN_BYTES = 1024 * MIB  # llama.cpp's --fit leaves this much free; we plan with the same margin
CUDA_CONTEXT_BYTES = 300 * MIB  # driver context + cuBLAS workspace: outside llama.cpp's breakdown
# Weight types the CPU backend repacks into interleaved layouts on x86 with AVX2 (rows must be a multiple
# of 8); they move from the mapped file into an anonymous CPU_REPACK buffer of the same size.
REPACK_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"})

# Bytes per element of each KV cache type (block size / block bytes from ggml).
KV_TYPE_BYTES: dict[CacheType, float] = {
    CacheType.F32: 4.0, CacheType.F16: 2.0, CacheType.BF16: 2.0, CacheType.Q8_0: 34 / 32,
    CacheType.Q5_1: 24 / 32, CacheType.Q5_0: 22 / 32, CacheType.Q4_1: 20 / 32, CacheType.Q4_0: 18 / 32,
    CacheType.IQ4_NL: 18 / 32,
}


class HostBuffer(str, Enum):
    """The host buffer type a weight lands in, named as llama.cpp's load log names them."""

    PINNED = "CUDA_Host"  # the GPU's pinned host buffer: anonymous, page-locked, a resident need
    REPACK = "CPU_REPACK"  # interleaved copy for the CPU kernels: anonymous, a resident need
    MAPPED = "CPU_Mapped"  # the file's pages, mapped: needed resident to run at speed (the working set)
    PLAIN = "CPU"  # plain anonymous host buffer (no mmap): a resident need


class Verdict(str, Enum):
    FITS = "fits"
    NEEDS_SPILL = "needs spill"  # more VRAM than the card has: OOM on Linux, a slow spill on Windows
    EXCEEDS_RAM = "exceeds RAM"  # host side larger than available RAM: swap


@dataclass(frozen=True, slots=True)
class Breakdown:
    weights_bytes: int = 0
    kv_bytes: int = 0
    recurrent_bytes: int = 0
    compute_bytes: int = 0
    overhead_bytes: int = 0
    # Host copies kept for prompt reuse: context checkpoints of every slot and the prompt cache's limit.
    reuse_bytes: int = 0

    @property
    def context_bytes(self) -> int:
        """What llama.cpp calls "context": KV cache plus recurrent state."""
        return self.kv_bytes + self.recurrent_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.context_bytes + self.compute_bytes + self.overhead_bytes + self.reuse_bytes


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """``host.weights_bytes`` is what the host weights need (each tensor once, in its buffer); the page cache
    the load leaves is ``reclaimable_bytes``, not a need."""

    backend: str  # "cuda" or "cpu"
    gpu: Breakdown
    host: Breakdown
    repack_bytes: int  # part of host.weights_bytes held in CPU_REPACK (anonymous memory)
    mapped_bytes: int  # part of host.weights_bytes mapped from the file and read while running; 0 without mmap
    n_ctx: int  # cells after padding, all slots together
    n_seq: int
    n_ubatch: int
    flash_attn: bool
    verdict: Verdict
    # Host weight bytes per buffer type (HostBuffer values), the parts of host.weights_bytes.
    host_buffers: tuple[tuple[str, int], ...] = ()
    # The span llama.cpp maps for the CPU_Mapped buffer: first to last mapped tensor in file order, so tensors
    # placed elsewhere in between (repacked, on the GPU) count again in the engine's breakdown, not in RAM need.
    mapped_span_bytes: int = 0
    reclaimable_bytes: int = 0  # page cache of file pages read at load and not read again while running
    gpu_offload_copy_bytes: int = 0  # part of gpu.compute_bytes: a host weight copied up for a large batch

    @property
    def host_need_bytes(self) -> int:
        return self.host.total_bytes

    @property
    def pinned_bytes(self) -> int:
        """Host weights in the GPU's pinned buffer (CUDA_Host: ``--load-mode none`` on a CUDA build): page-locked, so
        the kernel can neither drop nor swap them; mapped experts (mmap) it can drop and read back from the file."""
        return dict(self.host_buffers).get(HostBuffer.PINNED.value, 0)

    @property
    def engine_host_weights_bytes(self) -> int:
        """Host weights as llama.cpp's own breakdown counts them (the mapped span instead of the mapped tensors)."""
        return self.host.weights_bytes - self.mapped_bytes + self.mapped_span_bytes

    @property
    def load_mode(self) -> str:
        return "mmap" if self.mapped_bytes or self.mapped_span_bytes else "none"


@dataclass(frozen=True, slots=True)
class Resolved:
    """A LaunchConfig with every engine default filled in, as llama-server would run it."""

    n_ctx: int
    n_seq: int
    unified: bool
    n_ubatch: int
    flash_attn: bool
    n_gpu_layers: int
    n_cpu_moe: int
    n_outputs: int  # rows of logits the reserve graph computes


def resolve(model: ModelInfo, cfg: LaunchConfig, backend: str, fit_params: bool = False) -> Resolved:
    """``fit_params``: as llama-fit-params projects it, every token of the ubatch an output (``n_outputs_max``
    defaults to ``n_batch``); llama-server caps the outputs at one per slot plus its drafts
    (``server_output_limits`` → ``common_speculative_get_output_limits``)."""
    ctx = cfg.ctx if cfg.ctx else model.ctx_train
    n_seq = cfg.parallel if cfg.parallel else DEFAULT_PARALLEL
    unified = cfg.kv_unified if cfg.kv_unified is not None else cfg.parallel is None
    n_ctx = _pad(ctx, CTX_PAD)
    if not unified and n_seq > 1:
        n_ctx = _pad(n_ctx // n_seq, CTX_PAD) * n_seq
    n_batch = min(cfg.batch or DEFAULT_BATCH, n_ctx)
    n_ubatch = min(cfg.ubatch or DEFAULT_UBATCH, n_batch)
    # -fa auto turns flash attention on wherever the backend supports it (CPU and CUDA do).
    fa = cfg.flash_attn is not FlashAttn.OFF
    ngl = model.n_layer + 1 if cfg.n_gpu_layers is None else min(cfg.n_gpu_layers, model.n_layer + 1)
    if backend == "cpu":
        ngl = 0
    n_cpu_moe = min(cfg.n_cpu_moe or 0, model.n_layer)
    n_outputs = reserved_outputs(cfg, n_ubatch, n_seq, fit_params)
    return Resolved(n_ctx, n_seq, unified, n_ubatch, fa, ngl, n_cpu_moe, n_outputs)


def effective_config(cfg: LaunchConfig, physical_cores: int) -> LaunchConfig:
    """``cfg`` with the engine's defaults spelled out, so two launch lines that run the same way compare equal
    (``-fa auto`` is on where the backend has flash attention, as CPU and CUDA do; threads default to the
    physical cores; the threads of prompt processing to the threads)."""
    threads = cfg.threads or (physical_cores or None)
    return replace(cfg, flash_attn=FlashAttn.OFF if cfg.flash_attn is FlashAttn.OFF else FlashAttn.ON,
                   threads=threads, threads_batch=cfg.threads_batch or threads, batch=cfg.batch or DEFAULT_BATCH,
                   ubatch=cfg.ubatch or DEFAULT_UBATCH, n_cpu_moe=cfg.n_cpu_moe or None)


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def layer_on_gpu(model: ModelInfo, r: Resolved, layer: int) -> bool:
    """``llama_model_base::load_tensors``: ``i_gpu_start = n_layer + 1 - n_gpu_layers``; the output head is layer
    ``n_layer`` of that count, so -ngl N puts the head and the last N-1 repeating layers on the GPU."""
    return layer >= model.n_layer + 1 - r.n_gpu_layers


def tensor_on_gpu(model: ModelInfo, r: Resolved, t: TensorInfo) -> bool:
    if t.klass is TensorClass.TOKEN_EMBD:
        return False
    if t.layer is None:
        return layer_on_gpu(model, r, model.n_layer)  # output head and final norm
    if t.klass is TensorClass.ROUTED_EXPERTS and t.layer < r.n_cpu_moe:
        return False
    return layer_on_gpu(model, r, t.layer)


def is_repacked(t: TensorInfo) -> bool:
    return (t.ggml_type in REPACK_TYPES and t.klass is not TensorClass.TOKEN_EMBD
            and len(t.shape) >= 2 and t.shape[1] % 8 == 0)


def host_buffer(t: TensorInfo, cfg: LaunchConfig, backend: str) -> HostBuffer:
    """Where a host-resident weight lands, as the pinned engine decides it.

    ``make_cpu_buft_list`` (src/llama-model.cpp) orders the host buffer types ACCEL, then the GPU's host
    buffer (CUDA_Host; not with ``--no-host``), then the CPU's extra types (CPU_REPACK; not with
    ``--no-repack``), then plain CPU. ``llama_model_loader::create_tensor`` sends layers kept on the host and
    tensors overridden to CPU (``--n-cpu-moe``, ``-ot …=CPU``) through ``select_weight_buft`` over that list:
    the first type whose device supports the weight's op wins. The CUDA device supports the matmuls and
    GET_ROWS of every weight type these models use, so with a GPU that is CUDA_Host, never the repack
    buffer. The same function then swaps a device host buffer for plain CPU when mmap is on ("avoid using a
    host buffer when using mmap"), and ``create_backend_buffers`` maps only a device's default buffer type
    from the file. So: GPU + mmap → mapped; GPU + ``--load-mode none`` → one pinned copy; CPU build (or
    ``--no-host``) → repacked where the CPU repacks the type, else mapped (mmap) or plain (none).
    """
    if backend == "cuda" and not cfg.no_host:
        return HostBuffer.MAPPED if cfg.mmap else HostBuffer.PINNED
    if cfg.repack and is_repacked(t):
        return HostBuffer.REPACK
    return HostBuffer.MAPPED if cfg.mmap else HostBuffer.PLAIN


def kv_bytes_per_cell(model: ModelInfo, layer: int, type_k: CacheType, type_v: CacheType) -> float:
    n_kv = model.n_head_kv[layer]
    if not n_kv:
        return 0.0
    if model.is_mla:  # one compressed latent plus the rope part, stored as K; V is a view of it
        return (model.mla_kv_lora_rank + model.mla_rope_dim) * KV_TYPE_BYTES[type_k]
    return n_kv * (model.head_dim_k * KV_TYPE_BYTES[type_k] + model.head_dim_v * KV_TYPE_BYTES[type_v])


def kv_cells(model: ModelInfo, r: Resolved, layer: int, swa_full: bool) -> int:
    if model.swa_layers[layer] and model.n_swa and not swa_full:
        per_stream = r.n_ctx if r.unified else r.n_ctx // r.n_seq
        window = model.n_swa * (r.n_seq if r.unified else 1) + r.n_ubatch
        cells = _pad(min(per_stream, window), CTX_PAD)
        return cells if r.unified else cells * r.n_seq
    return r.n_ctx


def recurrent_bytes_per_seq(model: ModelInfo) -> int:
    """f32 conv state plus SSM / delta-net state of ONE recurrent layer for one sequence."""
    conv_dim = model.ssm_d_inner + 2 * model.ssm_n_group * model.ssm_d_state
    conv = (model.ssm_d_conv - 1) * conv_dim
    ssm = model.ssm_d_state * model.ssm_d_inner
    return 4 * (conv + ssm)


def compute_bytes(model: ModelInfo, r: Resolved, cfg: LaunchConfig | None = None) -> int:
    """The compute buffer llama.cpp reserves for one ubatch: its worst-case graph placed by ggml's allocator.

    For every architecture the shape writer knows, this builds the graph ``llama_context::sched_reserve`` reserves
    (``min(n_ctx, n_ubatch)`` tokens, all outputs, the KQ mask over a whole stream) from the model's tensor
    shapes and runs ``ggml_gallocr``'s placement over it (tuner.plan.graph_arch, tuner.plan.graph_alloc): the
    peak follows the engine's order of nodes, in-place reuse and free-block fit, which no closed formula did
    across architectures and ubatches. Other architectures keep the fitted formula (:func:`fitted_compute_bytes`).
    """
    if model.arch not in GRAPH_ARCHS:
        return fitted_compute_bytes(model, r)
    return _reserve_bytes(model, reserve_shape(model, r, cfg))[0]


def reserve_shape(model: ModelInfo, r: Resolved, cfg: LaunchConfig | None = None) -> ReserveShape:
    """What the reserve graph is built for: ``graph_reserve`` rounds the tokens up to a multiple of the slots; a
    split cache gives each slot its own stream of cells; quantized K/V caches add a Hadamard rotation."""
    n_stream = 1 if r.unified or r.n_seq <= 1 else r.n_seq
    n_tokens = _pad(r.n_ubatch, max(1, r.n_seq))
    swa = next((il for il in range(model.n_layer) if model.swa_layers[il]), None)
    swa_full = cfg.swa_full if cfg is not None else False
    n_kv_swa = kv_cells(model, r, swa, swa_full) // n_stream if swa is not None else 0
    type_k = cfg.cache_type_k if cfg is not None else CacheType.F16
    type_v = cfg.cache_type_v if cfg is not None else CacheType.F16
    plain = (CacheType.F16, CacheType.F32, CacheType.BF16)
    return ReserveShape(n_tokens, _mask_cells(r), n_kv_swa, n_stream, r.flash_attn, type_k not in plain,
                        type_v not in plain, min(r.n_outputs, n_tokens))


_RESERVED: dict[tuple[int, ReserveShape], tuple[ModelInfo, tuple[int, int]]] = {}


def _reserve_bytes(model: ModelInfo, shape: ReserveShape) -> tuple[int, int]:
    """Memoized by the model's identity: plans and searches price the same model at one shape many times."""
    key = (id(model), shape)
    hit = _RESERVED.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_RESERVED) > 1024:
        _RESERVED.clear()
    size = compute_buffer_bytes(model, shape)
    _RESERVED[key] = (model, size)
    return size


def fitted_compute_bytes(model: ModelInfo, r: Resolved) -> int:
    """The former closed formula (architectures without a graph): the larger of an attention peak (mask, KQ scores
    without flash attention, activations) and an output peak (every token's logits), fitted on six CPU shapes."""
    n_tok = r.n_ubatch
    n_q = model.n_head * model.head_dim_k
    moe = _moe_activation_bytes(model, n_tok)
    cells = _mask_cells(r)
    if r.flash_attn:
        attn = cells * n_tok * 2 + moe
    else:
        heads = model.n_head
        attn = cells * n_tok * 4 * (1 + heads) + n_tok * 4 * (5 * model.n_embd + n_q)
        if model.is_hybrid:  # gated attention (qwen3.5): the output gate half of the q projection stays live
            attn += n_tok * 4 * n_q
        if any(t.name.endswith(".attn_q.bias") for t in model.tensors):
            # Biased q/k/v projections (GLM-4.5, gpt-oss) keep more alive; fitted on both at real scale.
            kv_width = (model.n_head_kv[0] or max(model.n_head_kv)) * model.head_dim_k
            attn += n_tok * 4 * max(0, n_q - 2 * kv_width)
    output = n_tok * 4 * (model.n_vocab + 3 * model.n_embd)
    return int(max(attn, output))


def _moe_activation_bytes(model: ModelInfo, n_tok: int) -> int:
    """Routed experts of one layer: gate, up, activation and output per used expert, a few residual tensors."""
    return n_tok * 4 * (model.n_expert_used * (3 * model.n_ff_exp + model.n_embd) + 5 * model.n_embd)


def _mask_cells(r: Resolved) -> int:
    """Unified: one stream of n_ctx cells. Split: n_seq streams of n_ctx / n_seq cells each."""
    return r.n_ctx if r.unified or r.n_seq <= 1 else r.n_ctx // r.n_seq


def mtp_layers(model: ModelInfo) -> frozenset[int]:
    """NextN / multi-token-prediction blocks (GLM-4.5's last block): llama.cpp skips their tensors and
    gives them no KV unless speculative decoding with MTP is asked for."""
    return frozenset(t.layer for t in model.tensors if t.layer is not None and ".nextn." in t.name)


def estimate(model: ModelInfo, cfg: LaunchConfig, hw: Hardware, draft: ModelInfo | None = None, *,
             fit_params: bool = False) -> MemoryEstimate:
    """``draft``: the header of ``cfg.draft_model`` when speculation drafts with a second model. ``fit_params``:
    the compute buffer as llama-fit-params projects it (every token an output), not as llama-server reserves it."""
    backend = "cuda" if hw.has_gpu else "cpu"
    r = resolve(model, cfg, backend, fit_params)
    skipped = mtp_layers(model)
    gpu_w = 0
    loaded: list[TensorInfo] = []
    where: list[HostBuffer | None] = []  # per loaded tensor in file order: its host buffer, None on the GPU
    for t in model.tensors:
        if t.layer in skipped and SpecType.DRAFT_MTP not in cfg.spec_types:  # draft-mtp loads the head
            continue
        loaded.append(t)
        if tensor_on_gpu(model, r, t):
            gpu_w += t.n_bytes
            where.append(None)
        else:
            where.append(host_buffer(t, cfg, backend))
    by_buffer = {b: sum(t.n_bytes for t, w in zip(loaded, where, strict=True) if w is b) for b in HostBuffer}
    host_w = sum(by_buffer.values())
    repack, mapped = by_buffer[HostBuffer.REPACK], by_buffer[HostBuffer.MAPPED]
    span = _mapped_span(loaded, where)
    reclaimable = sum(t.n_bytes for t in loaded) - mapped
    if backend == "cuda" and model.tied_embeddings and layer_on_gpu(model, r, model.n_layer):
        gpu_w += next(t.n_bytes for t in model.tensors if t.klass is TensorClass.TOKEN_EMBD)
    gpu_kv = host_kv = 0.0
    gpu_rec = host_rec = 0
    rec_per_layer = recurrent_bytes_per_seq(model) * max(1, r.n_seq) if model.is_hybrid else 0
    for il in range(model.n_layer):
        if il in skipped:
            continue
        on_gpu = layer_on_gpu(model, r, il) if backend == "cuda" else False
        kv = kv_cells(model, r, il, cfg.swa_full) * kv_bytes_per_cell(model, il, cfg.cache_type_k, cfg.cache_type_v)
        rec = rec_per_layer if model.recurrent_layers[il] else 0
        if on_gpu:
            gpu_kv, gpu_rec = gpu_kv + kv, gpu_rec + rec
        else:
            host_kv, host_rec = host_kv + kv, host_rec + rec
    # Logits of every slot are copied back to a host output buffer.
    host_overhead = r.n_seq * model.n_vocab * 4
    copy = 0
    if backend == "cuda":  # --no-op-offload: host weights' ops stay on the CPU (ggml_backend_sched_new's op_offload)
        host_weights = [t for t, w in zip(loaded, where, strict=True)
                        if w is not None and t.klass is not TensorClass.TOKEN_EMBD and len(t.shape) >= 2]
        if offloads_ubatch(cfg, r.n_ubatch) and host_weights:
            copy = max(cuda_alloc_bytes(t) for t in host_weights)
        gpu_compute, host_compute = split_compute_bytes(model, r, cfg, host_weights)
        gpu = Breakdown(gpu_w, int(gpu_kv), gpu_rec, gpu_compute, CUDA_CONTEXT_BYTES)
        host = Breakdown(host_w, int(host_kv), host_rec, host_compute, host_overhead)
    else:
        gpu = Breakdown()
        host = Breakdown(host_w, int(host_kv), host_rec, compute_bytes(model, r, cfg), host_overhead)
    if cfg.spec_types:
        gpu, host = speculation_bytes(model, cfg, hw, r, gpu, host, draft)
    host = replace(host, reuse_bytes=checkpoints_bytes(model, cfg, r) + prompt_cache_bytes(cfg))
    verdict = judge(gpu, host, hw)
    buffers = tuple((b.value, n) for b, n in by_buffer.items() if n)
    return MemoryEstimate(backend, gpu, host, repack, mapped, r.n_ctx, r.n_seq, r.n_ubatch, r.flash_attn, verdict,
                          buffers, span, reclaimable, copy)


def _mapped_span(loaded: list[TensorInfo], where: list[HostBuffer | None]) -> int:
    """llama.cpp's CPU_Mapped buffer: ``get_mapping_range`` spans the first to the last mapped tensor of the
    file (tensors are listed in file order), so whatever lies between counts in the engine's figure."""
    idx = [i for i, w in enumerate(where) if w is HostBuffer.MAPPED]
    return sum(t.n_bytes for t in loaded[idx[0]:idx[-1] + 1]) if idx else 0


def split_compute_bytes(model: ModelInfo, r: Resolved, cfg: LaunchConfig, host_weights: list[TensorInfo]
                        ) -> tuple[int, int]:
    """(GPU, host) compute buffers beside a GPU: the reserve graph as ``ggml_backend_sched_split_graph`` splits it.
    Graph inputs and the token embedding's GET_ROWS run on the host (``ggml_backend_sched_backend_id_from_cur``),
    the device reads copies of them; a host weight's matmul of at least 32 tokens runs on the GPU
    (``ggml_backend_cuda_device_offload_op``) on a copy of the weight made at the start of its own split and
    dropped after it (GGML_OP_OFFLOAD_MIN_BATCH: :mod:`tuner.plan.op_offload`). Architectures without a graph: the
    fitted formulas."""
    offload = min_batch(cfg) if cfg.op_offload else 0
    if model.arch in GRAPH_ARCHS:
        shape = replace(reserve_shape(model, r, cfg), split=True, offload_min_batch=offload,
                        host_weights=tuple((t.name, cuda_alloc_bytes(t)) for t in host_weights))
        return _reserve_bytes(model, shape)
    act = _mask_cells(r) * r.n_ubatch * (2 if r.flash_attn else 4) + _moe_activation_bytes(model, r.n_ubatch)
    copy = max(t.n_bytes for t in host_weights) + act if offload and r.n_ubatch >= offload and host_weights else 0
    on_host = r.n_cpu_moe > 0 or r.n_gpu_layers <= model.n_layer
    return max(fitted_compute_bytes(model, r), copy), r.n_ubatch * 4 * (model.n_embd * 2 + 3 * model.n_expert_used
                                                                         * model.n_ff_exp * on_host)


def _plus(a: Breakdown, b: Breakdown) -> Breakdown:
    return Breakdown(*(getattr(a, f.name) + getattr(b, f.name) for f in fields(Breakdown)))


DEFAULT_CTX_CHECKPOINTS = 32  # common_params::n_ctx_checkpoints at the pin
DEFAULT_CHECKPOINT_MIN_STEP = 8192  # common_params::checkpoint_min_step
DEFAULT_CACHE_RAM_MIB = 8192  # common_params::cache_ram_mib


STATE_CELL_META_BYTES = 12  # llama_kv_cache::state_write_meta: a cell's position, seq-id count and seq id


def checkpoint_bytes(model: ModelInfo, cfg: LaunchConfig, r: Resolved) -> int:
    """One context checkpoint of one slot: the part of its memory that cannot be rolled back, copied to host
    RAM (``server_context::create_checkpoint`` → ``llama_state_seq_get_data_ext`` with
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``). For a hybrid model that is the recurrent state of every recurrent
    layer (``llama_memory_hybrid::state_write`` skips the attention cache); for a sliding-window model the SWA
    cache only (``llama_kv_cache_iswa::state_write`` skips the full one), whose ``state_write`` keeps the cells
    of the sequence not masked by ``llama_hparams::is_masked_swa`` against its largest position: the last
    ``n_swa`` tokens. With ``--swa-full`` or plain attention the engine makes none (``do_checkpoint`` in
    ``update_slots``)."""
    if model.is_hybrid:
        return recurrent_bytes_per_seq(model) * sum(model.recurrent_layers)
    if model.n_swa and any(model.swa_layers) and not cfg.swa_full:
        per_seq = r.n_ctx if r.unified else r.n_ctx // max(1, r.n_seq)
        cells = min(per_seq, model.n_swa)
        per_cell = sum(kv_bytes_per_cell(model, il, cfg.cache_type_k, cfg.cache_type_v)
                       for il in range(model.n_layer) if model.swa_layers[il])
        return int(cells * (per_cell + STATE_CELL_META_BYTES))
    return 0


def checkpoints_bytes(model: ModelInfo, cfg: LaunchConfig, r: Resolved) -> int:
    """Every slot's checkpoints at their cap (``-ctxcp``, 32 per slot by default): a long session fills it."""
    count = DEFAULT_CTX_CHECKPOINTS if cfg.ctx_checkpoints is None else cfg.ctx_checkpoints
    return checkpoint_bytes(model, cfg, r) * count * max(1, r.n_seq)


def prompt_cache_bytes(cfg: LaunchConfig) -> int:
    """The host prompt cache at its limit when one is set (``server_prompt_cache``: states of idle prompts,
    evicted oldest first above ``--cache-ram`` MiB). The engine's default limit (8192 MiB) fills only with many
    distinct conversations, so it is not counted unless asked for; ``-1`` (no limit) cannot be counted."""
    return max(0, cfg.cache_ram_mib or 0) * MIB


NGRAM_MOD_TABLE_BYTES = 4 * 2**20 * 4  # ngram-mod's hash table: 4 Mi token entries, allocated once


def speculation_bytes(model: ModelInfo, cfg: LaunchConfig, hw: Hardware, r: Resolved, gpu: Breakdown,
                      host: Breakdown, draft: ModelInfo | None) -> tuple[Breakdown, Breakdown]:
    """``gpu`` and ``host`` plus what speculative decoding adds: a second context with f16 KV over the same
    cells and slots and its own compute buffer, on the MTP head (weights counted with the target's) or on a
    draft model (its weights too: all layers on the GPU, -ngld's default); n-gram modes add host tables only."""
    if SpecType.DRAFT_MTP in cfg.spec_types and mtp_layers(model):
        head = mtp_layers(model)
        kv = sum(r.n_ctx * kv_bytes_per_cell(model, il, CacheType.F16, CacheType.F16) for il in head)
        extra = Breakdown(kv_bytes=int(kv), compute_bytes=compute_bytes(model, r, cfg))
        on_gpu = hw.has_gpu and all(layer_on_gpu(model, r, il) for il in head)
        gpu, host = (_plus(gpu, extra), host) if on_gpu else (gpu, _plus(host, extra))
    if draft is not None and any(t.needs_draft_model for t in cfg.spec_types):
        plain = replace(cfg, model=draft.paths[0], n_cpu_moe=None, n_gpu_layers=None, cache_type_k=CacheType.F16,
                        cache_type_v=CacheType.F16, spec_types=(), draft_model=None)
        sub = estimate(draft, plain, hw)
        gpu, host = _plus(gpu, replace(sub.gpu, overhead_bytes=0)), _plus(host, sub.host)
    if SpecType.NGRAM_MOD in cfg.spec_types:
        host = _plus(host, Breakdown(overhead_bytes=NGRAM_MOD_TABLE_BYTES))
    return gpu, host


def judge(gpu: Breakdown, host: Breakdown, hw: Hardware) -> Verdict:
    if hw.has_gpu and gpu.total_bytes + FIT_MARGIN_BYTES > hw.vram_budget_bytes:
        return Verdict.NEEDS_SPILL
    if host.total_bytes > hw.ram_available_bytes:
        return Verdict.EXCEEDS_RAM
    return Verdict.FITS
