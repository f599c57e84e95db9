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
    mmap: bool = True
    # CPU backend repacks some weights into faster layouts (a separate buffer); ``--no-repack`` turns it off.
    repack: bool = True
