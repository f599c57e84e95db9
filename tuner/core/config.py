"""Plain typed values shared by every layer: the launch configuration and the categorical flags."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class CacheType(str, Enum):
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q5_1 = "q5_1"
    Q5_0 = "q5_0"
    Q4_1 = "q4_1"
    Q4_0 = "q4_0"
    IQ4_NL = "iq4_nl"

    @property
    def is_quantized(self) -> bool:
        return self not in (CacheType.F32, CacheType.F16, CacheType.BF16)


class FlashAttn(str, Enum):
    ON = "on"
    OFF = "off"
    AUTO = "auto"


class SpecType(str, Enum):
    """llama-server's ``--spec-type`` values (speculative decoding; llama-bench has none of them)."""

    DRAFT_SIMPLE = "draft-simple"  # a second, smaller model (-md) drafts
    DRAFT_EAGLE3 = "draft-eagle3"
    DRAFT_MTP = "draft-mtp"  # the model's own multi-token-prediction (NextN) head drafts
    DRAFT_DFLASH = "draft-dflash"
    DRAFT_DSPARK = "draft-dspark"
    NGRAM_SIMPLE = "ngram-simple"  # n-gram modes draft from text already seen: no second model
    NGRAM_MAP_K = "ngram-map-k"
    NGRAM_MAP_K4V = "ngram-map-k4v"
    NGRAM_MOD = "ngram-mod"
    NGRAM_CACHE = "ngram-cache"

    @property
    def is_ngram(self) -> bool:
        return self.value.startswith("ngram-")

    @property
    def needs_draft_model(self) -> bool:
        """Types that draft with a separate GGUF given by -md (MTP uses the target's own head)."""
        return not self.is_ngram and self is not SpecType.DRAFT_MTP


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """One way to run a model. ``None`` means "the engine's default" and renders no flag."""

    model: Path
    n_cpu_moe: int | None = None
    n_gpu_layers: int | None = None
    cache_type_k: CacheType = CacheType.F16
    cache_type_v: CacheType = CacheType.F16
    flash_attn: FlashAttn = FlashAttn.AUTO
    ctx: int | None = None
    parallel: int | None = None
    threads: int | None = None
    threads_batch: int | None = None
    batch: int | None = None
    ubatch: int | None = None
    # None: the engine's default (unified KV when -np is left at its default of auto).
    kv_unified: bool | None = None
    # SWA layers keep a full-size cache instead of the window (``--swa-full``).
    swa_full: bool = False
    # Prompt reuse between requests (llama-server only; None: the engine's default). ``cache_reuse``: the
    # smallest chunk reused by shifting KV (``--cache-reuse``); ``ctx_checkpoints``: copies of the state that
    # cannot be rolled back (recurrent, SWA) kept per slot; ``checkpoint_min_step``: tokens between them;
    # ``cache_ram_mib``: the host prompt cache's limit (0: off, -1: no limit).
    cache_reuse: int | None = None
    ctx_checkpoints: int | None = None
    checkpoint_min_step: int | None = None
    cache_ram_mib: int | None = None
    mmap: bool = True
    # CPU backend repacks some weights into faster layouts (a separate buffer); ``--no-repack`` turns it off.
    repack: bool = True
    # With a GPU, host-resident weights go to the GPU's pinned host buffer unless ``--no-host`` (then as on CPU).
    no_host: bool = False
    # With a GPU, an op on a host weight whose batch reaches 32 tokens runs on the GPU, the weight copied over PCIe
    # once per ubatch (ggml-cuda's ``ggml_backend_cuda_device_offload_op``); ``--no-op-offload`` keeps it on the CPU.
    op_offload: bool = True
    # The smallest batch (tokens of the ubatch an op processes) that op offload takes to the GPU: the engine reads
    # ``GGML_OP_OFFLOAD_MIN_BATCH`` from its environment, not argv (None: its default, 32). Above a turn's length
    # and below a long prompt's ubatch, short turns stay on the CPU while long prompts copy the experts up.
    op_offload_min_batch: int | None = None
    # ``-dev``: the devices to offload to; "none" runs on the CPU on purpose (None: every GPU, the default).
    device: str | None = None
    # ``-fitt``: the MiB llama.cpp's ``--fit`` leaves free on each device (None: its default, 1024). A bare launch
    # fits itself to all the free VRAM; under a smaller budget it carries the margin that leaves the rest.
    fit_target_mib: int | None = None
    # Speculative decoding (llama-server only). Empty: none, the engine default.
    spec_types: tuple[SpecType, ...] = ()
    draft_model: Path | None = None  # -md, for the draft-* types that need a second model
    spec_draft_n_max: int | None = None
    spec_draft_n_min: int | None = None
    spec_draft_p_min: float | None = None
    # Benchmarking only: drafted tokens are accepted at random (mean length, or per-position rates); the
    # generated text is not valid, the speed is that of a drafter with that acceptance.
    spec_synth_len: float | None = None
    spec_synth_rates: tuple[float, ...] | None = None
    # Which engine reads this line (tuner.engine.kinds: "llama.cpp" or "ik_llama.cpp"); the flag layer spells it
    # in that engine's dialect, and runs it with that engine's binaries.
    engine: str = "llama.cpp"
    # ik_llama.cpp's own levers (its common/common.cpp; llama.cpp reads none of them). At their defaults they render
    # nothing. ``run_time_repack`` (-rtr): weights repacked into the CPU's interleaved layouts at load (no mmap);
    # ``fused_moe`` (-no-fmoe turns it off): the MoE FFN's up, gate and activation in one op; ``merge_up_gate``
    # (-muge): experts' up and gate merged into one tensor at load; ``attn_max_batch`` (-amb): the most tokens an
    # attention step takes at once (bounds its compute buffer); ``graph_reuse`` (-no-gr turns it off): the compute
    # graph reused between tokens; ``smart_experts`` (-ser MIN,THRESH): experts below a weight skipped, down to MIN
    # (changes outputs: priced like a quantized KV cache); ``only_active_experts`` (-no-ooae turns it off): with
    # experts in RAM, only those a batch routes to are copied to the GPU.
    run_time_repack: bool = False
    fused_moe: bool = True
    merge_up_gate: bool = False
    attn_max_batch: int | None = None
    graph_reuse: bool = True
    smart_experts: tuple[int, float] | None = None
    only_active_experts: bool = True

    def __post_init__(self) -> None:
        # Values read back from JSON arrive as lists and strings; keep the config hashable and typed.
        object.__setattr__(self, "spec_types", tuple(SpecType(t) for t in self.spec_types))
        if self.draft_model is not None and not isinstance(self.draft_model, Path):
            object.__setattr__(self, "draft_model", Path(self.draft_model))
        if self.spec_synth_rates is not None:
            object.__setattr__(self, "spec_synth_rates", tuple(float(r) for r in self.spec_synth_rates))
        if self.smart_experts is not None:
            n_min, thresh = self.smart_experts
            object.__setattr__(self, "smart_experts", (int(n_min), float(thresh)))

    @property
    def speculative(self) -> bool:
        return bool(self.spec_types)
