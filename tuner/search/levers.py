"""The prompt-side levers of a CUDA rig with experts in host RAM: op offload on/off, the batch from which it
offloads (``GGML_OP_OFFLOAD_MIN_BATCH``), the host buffer (llama.cpp's default or ``--no-host``) and the load mode
(mmap or ``--load-mode none``: the experts mapped pageable, or one pinned copy).

With experts in RAM each ubatch of a prompt either copies them to the GPU (op offload: ~1 s for 14 GiB over a
PCIe 4.0 x8 link) or runs them on the CPU. Which wins depends on the link and on the batch, so both are measured,
never assumed: on an H100 (PCIe 5) op offload off ran an agent turn's prompt at 0.05x.
"""

from __future__ import annotations

from dataclasses import replace

from tuner.core.config import LaunchConfig
from tuner.core.model import ModelInfo
from tuner.machine.hardware import Hardware
from tuner.measure.engine_memory import price
from tuner.plan.memory import DEFAULT_UBATCH
from tuner.plan.op_offload import OP_OFFLOAD_MIN_BATCH
from tuner.plan.ram import TIGHT_MARGIN_BYTES, lock_fits

LOAD_MODES = ("mmap", "none")  # llama-server's --load-mode values the search measures (mmap: its default)


def host_levers(hw: Hardware, device: str | None, moe: tuple[int, int] | None) -> bool:
    """Are the prompt-side levers of host experts worth searching: a GPU is used and every config of the space
    keeps experts in RAM (where the card holds them all, the likeliest winner has none on the host and the
    levers would only spend trials). A CPU-only run has neither op offload (no device to offload to) nor a host
    buffer choice (every weight is the CPU's)."""
    return hw.has_gpu and device != "none" and moe is not None and moe[0] > 0


def session_threshold(cfg: LaunchConfig, hw: Hardware) -> int | None:
    """The op-offload threshold the agent session stage tries on ``cfg`` (None: none applies): its ubatch. The engine
    compares the threshold with the tokens of the ubatch an op processes, so at the line's own ubatch every full
    ubatch of a long prompt still copies the experts to the GPU while a turn shorter than one (a tool result on a
    cached history) runs them on the CPU, where one copy of every host expert can cost more than the CPU takes
    for a few hundred tokens (~1 s for 14 GiB over PCIe 4.0 x8). llama-bench, the search's measure, times full
    ubatches only, so a threshold at or below them measures as op offload on: only whole sessions tell it apart."""
    if not (hw.has_gpu and cfg.device != "none" and cfg.op_offload and cfg.op_offload_min_batch is None):
        return None
    if not (cfg.n_cpu_moe or (cfg.n_gpu_layers is not None and cfg.n_gpu_layers <= 0)):
        return None  # no host experts: nothing to copy
    ubatch = cfg.ubatch or DEFAULT_UBATCH
    return ubatch if ubatch > OP_OFFLOAD_MIN_BATCH else None


def levers_note() -> tuple[str, ...]:
    """What the space says about the levers it searches."""
    return ("op offload (on/off) and the host buffer (llama.cpp's default or --no-host) searched: with experts in "
            "RAM, each ubatch of a prompt copies them to the GPU (op offload) or runs them on the CPU, where "
            "--no-host lets the CPU backend repack them (make_cpu_buft_list); --no-repack is not searched (with the "
            "default mmap load, --no-host --no-repack maps the experts as the default does); the op-offload "
            "threshold (GGML_OP_OFFLOAD_MIN_BATCH, 32 tokens) is tried by the agent session stage, whose turns are "
            "shorter than a ubatch (llama-bench times full ubatches only)",)


def load_mode_axis(info: ModelInfo, hw: Hardware, device: str | None, moe: tuple[int, int] | None,
                   most_host: LaunchConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The load modes the space searches, and what it says about them.

    With a GPU and experts on the host, mmap (the default) leaves them the file's pageable pages (CPU_Mapped) and
    ``--load-mode none`` makes them one pinned copy (CUDA_Host): ``create_tensor`` (src/llama-model-loader.cpp)
    swaps the GPU's host buffer for plain CPU when mmap is on, and warns "tensor overrides to CPU are used with
    mmap enabled - consider using --load-mode none for better performance". Each prompt ubatch copies the experts
    to the GPU (op offload), from pinned memory by DMA at the link's speed, from pageable pages through the
    driver's staging buffer at 0.30-0.77x of it in published measurements (tuner.plan.roofline): a gain no header
    prices, so it is measured. Both hold the experts once in RAM (tuner.plan.memory), but the pinned copy can
    never be paged out: the axis is offered only where it leaves the RAM margin at the most host experts the space
    tries (``most_host``, its largest ubatch), never where it would page, by the figures in force (the engine's own
    projection during a tune: :func:`tuner.measure.engine_memory.price`). Without a GPU, or with every expert on the
    card, nothing is copied and mmap stays.

    On the CPU alone the axis is about residence: a mapped model is the page cache's, so whatever else takes RAM for a
    while (another program, or another engine's line that loads its weights into its own buffers, as ik_llama.cpp's
    ``-rtr`` does) evicts it, and the next tokens read it back from disk; ``--load-mode none`` reads it into the
    engine's own buffers once (and, on a CPU build, holds the repacked tensors once rather than beside the mapping,
    DESIGN §5). It is offered where that copy leaves the RAM margin but the mapped file and a resident copy together
    do not (RAM is tight: on 24 GiB the 17.3 GiB Qwen3-30B-A3B default read its model back from disk in 1 of 3 race
    rounds beside resident lines, results/benchmarks/which-engine-cpu.md), and said; where both fit, no resident
    line evicts the mapping and the axis would only double the space: mmap stays, as without a tight RAM."""
    if not (hw.has_gpu and device != "none"):
        return _cpu_load_modes(info, hw, most_host)
    if not host_levers(hw, device, moe):
        return (LOAD_MODES[0],), ()
    pinned = replace(most_host, mmap=False, no_host=False)
    est = price(info, pinned, hw)
    if not lock_fits(est, pinned, hw):
        return (LOAD_MODES[0],), (
            f"--load-mode none not searched: its pinned copy of {est.pinned_bytes / 2**30:.1f} GiB of experts (at "
            f"--n-cpu-moe {pinned.n_cpu_moe}) would leave under {TIGHT_MARGIN_BYTES / 2**30:.0f} GiB of "
            f"{hw.ram_available_bytes / 2**30:.1f} GiB RAM, and pinned memory cannot be paged out",)
    return LOAD_MODES, ("--load-mode none vs mmap searched: pinned host experts copy to the GPU at the link's speed, "
                        "mapped ones through the driver's staging buffer (slower by an amount only a measurement "
                        f"tells); the pinned copy leaves the {TIGHT_MARGIN_BYTES / 2**30:.0f} GiB RAM margin at "
                        f"--n-cpu-moe {pinned.n_cpu_moe}",)


def _cpu_load_modes(info: ModelInfo, hw: Hardware, cfg: LaunchConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    resident = replace(cfg, mmap=False, no_host=False)
    est = price(info, resident, hw)
    if not lock_fits(est, resident, hw):
        return (LOAD_MODES[0],), (
            f"--load-mode none not searched: a resident copy of the model ({est.host_need_bytes / 2**30:.1f} GiB) "
            f"would leave under {TIGHT_MARGIN_BYTES / 2**30:.0f} GiB of {hw.ram_available_bytes / 2**30:.1f} GiB RAM",)
    both = info.file_bytes + est.host_need_bytes + TIGHT_MARGIN_BYTES
    if both <= hw.ram_available_bytes:  # the mapped file and a resident copy fit together: nothing to say
        return (LOAD_MODES[0],), ()
    return LOAD_MODES, ("--load-mode none vs mmap searched: a resident copy is never read back from disk when other "
                        "work takes the page cache (a resident line, ik's -rtr or this one, and the mapped file do not "
                        "fit RAM together), a mapped one costs no load time and shares the file's pages",)
