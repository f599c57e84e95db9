"""The prompt-side levers of a CUDA rig with experts in host RAM: op offload on/off, the batch from which it
offloads (``GGML_OP_OFFLOAD_MIN_BATCH``), and the host buffer (llama.cpp's default or ``--no-host``).

With experts in RAM each ubatch of a prompt either copies them to the GPU (op offload: ~1 s for 14 GiB over a
PCIe 4.0 x8 link) or runs them on the CPU. Which wins depends on the link and on the batch, so both are measured,
never assumed: on an H100 (PCIe 5) op offload off ran an agent turn's prompt at 0.05x.
"""

from __future__ import annotations

from collections.abc import Sequence

from tuner.machine.hardware import Hardware
from tuner.plan.memory import DEFAULT_UBATCH

# Op-offload thresholds above the engine's 32 tokens. The engine compares a threshold with the tokens of the ubatch
# an op processes, so a prompt of P tokens at ubatch U offloads chunks of min(P, U) tokens: a threshold at or below
# that keeps the measured prompt on the GPU while batches shorter than the threshold (an agent turn's new tokens
# on a cached prefix, a prompt's last chunk) stay on the CPU, where one copy of the experts costs more than the
# CPU takes for them. 512: the default ubatch, a turn of a few hundred tokens stays on the CPU; 4096: a slow link
# (or a fast CPU) where only long prompts repay the copy. A threshold above every chunk the measured prompt makes
# would only repeat op offload off, which is searched on its own.
OP_OFFLOAD_MIN_BATCH_CHOICES = (512, 4096)


def host_levers(hw: Hardware, device: str | None, moe: tuple[int, int] | None) -> bool:
    """Are the prompt-side levers of host experts worth searching: a GPU is used and every config of the space
    keeps experts in RAM (where the card holds them all, the likeliest winner has none on the host and the
    levers would only spend trials). A CPU-only run has neither op offload (no device to offload to) nor a host
    buffer choice (every weight is the CPU's)."""
    return hw.has_gpu and device != "none" and moe is not None and moe[0] > 0


def min_batch_choices(prompt_tokens: int, ubatch: Sequence[int | None]) -> tuple[int | None, ...]:
    """The engine's default threshold (None: 32), and each larger one that the measured prompt's chunks still reach
    at the largest ubatch of the space (:data:`OP_OFFLOAD_MIN_BATCH_CHOICES`)."""
    chunk = min(prompt_tokens, max(u or DEFAULT_UBATCH for u in ubatch))
    return (None, *(t for t in OP_OFFLOAD_MIN_BATCH_CHOICES if t <= chunk))


def levers_note(min_batch: Sequence[int | None]) -> tuple[str, ...]:
    """What the space says about the levers it searches."""
    larger = [t for t in min_batch if t is not None]
    threshold = (f"the op-offload threshold (GGML_OP_OFFLOAD_MIN_BATCH: 32, {', '.join(map(str, larger))} tokens of "
                 "the ubatch; batches below it stay on the CPU) searched with op offload on" if larger else
                 "GGML_OP_OFFLOAD_MIN_BATCH stays at 32 (the measured prompt's chunks reach no larger threshold)")
    return ("op offload (on/off) and the host buffer (llama.cpp's default or --no-host) searched: with experts in "
            "RAM, each ubatch of a prompt copies them to the GPU (op offload) or runs them on the CPU, where "
            "--no-host lets the CPU backend repack them (make_cpu_buft_list); --no-repack is not searched (with the "
            f"default mmap load, --no-host --no-repack maps the experts as the default does); {threshold}",)
