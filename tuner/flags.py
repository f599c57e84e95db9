"""The only place llama.cpp flags are spelled: LaunchConfig → argv for llama-bench and llama-server.

Because the measured argv and the emitted launch line come from the same function, they cannot differ.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from tuner.config import CacheType, FlashAttn, LaunchConfig
from tuner.errors import UsageError


def validate(cfg: LaunchConfig) -> None:
    """Refuse what the engine would reject at context creation, before anything is launched."""
    if cfg.cache_type_v.is_quantized and cfg.flash_attn is FlashAttn.OFF:
        raise UsageError(
            f"V cache type {cfg.cache_type_v.value} needs flash attention: use -fa on (or auto) or -ctv f16"
        )
    for name in ("n_cpu_moe", "n_gpu_layers", "threads"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise UsageError(f"{name} must be >= 0, got {value}")
    for name in ("ctx", "parallel", "batch", "ubatch"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")


def _common(cfg: LaunchConfig, tool: str) -> list[str]:
    argv: list[str] = []
    if cfg.n_gpu_layers is not None:
        argv += ["-ngl", str(cfg.n_gpu_layers)]
    if cfg.n_cpu_moe is not None:
        argv += ["--n-cpu-moe" if tool == "server" else "-ncmoe", str(cfg.n_cpu_moe)]
    if cfg.cache_type_k is not CacheType.F16:
        argv += ["-ctk", cfg.cache_type_k.value]
    if cfg.cache_type_v is not CacheType.F16:
        argv += ["-ctv", cfg.cache_type_v.value]
    if cfg.threads is not None:
        argv += ["-t", str(cfg.threads)]
    if cfg.threads_batch is not None and tool != "bench":
        argv += ["-tb", str(cfg.threads_batch)]
    if cfg.batch is not None:
        argv += ["-b", str(cfg.batch)]
    if cfg.ubatch is not None:
        argv += ["-ub", str(cfg.ubatch)]
    return argv


def bench_argv(
    binary: Path,
    cfg: LaunchConfig,
    *,
    n_prompt: int,
    n_gen: int,
    repetitions: int,
    depth: int = 0,
) -> list[str]:
    """llama-bench for one config; it has no -c (context = prompt + generated + depth)."""
    validate(cfg)
    argv = [str(binary), "-m", str(cfg.model), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(repetitions)]
    if depth:
        argv += ["-d", str(depth)]
    argv += _common(cfg, "bench")
    if cfg.flash_attn is not FlashAttn.AUTO:
        argv += ["-fa", cfg.flash_attn.value]
    if not cfg.mmap:
        argv += ["-lm", "none"]
    if not cfg.repack:
        argv += ["--repack", "0"]
    return argv + ["-o", "jsonl"]


def server_argv(binary: Path, cfg: LaunchConfig) -> list[str]:
    validate(cfg)
    argv = [str(binary), "-m", str(cfg.model)]
    if cfg.ctx is not None:
        argv += ["-c", str(cfg.ctx)]
    if cfg.parallel is not None:
        argv += ["-np", str(cfg.parallel)]
    argv += _common(cfg, "server")
    if cfg.flash_attn is not FlashAttn.AUTO:
        argv += ["-fa", cfg.flash_attn.value]
    argv += _context_flags(cfg)
    return argv


def _context_flags(cfg: LaunchConfig) -> list[str]:
    """Flags llama-server and llama-perplexity share (llama-bench has none of these)."""
    argv: list[str] = []
    if cfg.kv_unified is True:
        argv += ["--kv-unified"]
    elif cfg.kv_unified is False:
        argv += ["--no-kv-unified"]
    if cfg.swa_full:
        argv += ["--swa-full"]
    if not cfg.mmap:
        argv += ["-lm", "none"]  # read weights into anonymous memory instead of mapping the file
    if not cfg.repack:
        argv += ["--no-repack"]
    return argv


def perplexity_argv(
    binary: Path,
    cfg: LaunchConfig,
    *,
    text_file: Path,
    ctx: int,
    chunks: int | None = None,
    kld_base: Path | None = None,
    kld: bool = False,
) -> list[str]:
    """llama-perplexity over ``text_file`` in chunks of ``ctx`` tokens.

    With ``kld_base`` and not ``kld``: write the reference logits to that file. With both: compare against it.
    """
    validate(cfg)
    argv = [str(binary), "-m", str(cfg.model), "-f", str(text_file), "-c", str(ctx)]
    if chunks is not None:
        argv += ["--chunks", str(chunks)]
    if cfg.parallel is not None:
        argv += ["-np", str(cfg.parallel)]
    argv += _common(cfg, "server")
    if cfg.flash_attn is not FlashAttn.AUTO:
        argv += ["-fa", cfg.flash_attn.value]
    argv += _context_flags(cfg)
    if kld_base is not None:
        argv += ["--kl-divergence-base", str(kld_base)]
        if kld:
            argv += ["--kl-divergence"]
    elif kld:
        raise UsageError("KL-divergence needs a reference logits file: pass kld_base")
    return argv


def launch_line(cfg: LaunchConfig, binary: str = "llama-server") -> str:
    """The command a user pastes into a shell."""
    return shlex.join(server_argv(Path(binary), cfg))
