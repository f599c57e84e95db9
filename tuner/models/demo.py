"""The embedded default model: synthetic MoE GGUFs written on demand and quantized with llama-quantize."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf

from tuner.core.errors import UsageError
from tuner.engine import flags, runner
from tuner.engine.build import EngineLocation
from tuner.machine import paths
from tuner.models import demo_model

DEFAULT_ARCH = "qwen3moe"
DEFAULT_SIZE = "tiny"
DEFAULT_QUANT = "Q4_K_M"

# Quant names llama-quantize knows, from the file types gguf-py lists (MOSTLY_Q4_K_M → Q4_K_M).
KNOWN_QUANTS = frozenset(
    name.removeprefix("MOSTLY_") for name in gguf.LlamaFileType.__members__ if name.startswith("MOSTLY_")
) | {"F16", "BF16", "F32"}


@dataclass(frozen=True, slots=True)
class DemoFile:
    quant: str
    path: Path
    size_bytes: int
    created: bool


def parse_quants(text: str) -> list[str]:
    quants = [q.strip().upper() for q in text.split(",") if q.strip()]
    unknown = [q for q in quants if q not in KNOWN_QUANTS]
    if unknown:
        raise UsageError(
            f"unknown quant type {', '.join(unknown)}: use names like Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M"
        )
    return quants


def _base_name(arch: str, size: str, seed: int) -> str:
    seed_part = f"-seed{seed}" if seed else ""
    return f"moe-tune-demo-{arch}-{size}{seed_part}"


def demo_paths(arch: str, size: str, seed: int, quants: Sequence[str], out: Path | None) -> dict[str, Path]:
    """Where each variant goes: ``out`` may be a folder or the F16 file's path (``*.gguf``)."""
    if out is not None and out.suffix.lower() == ".gguf":
        stem = re.sub(r"-F16$", "", out.stem, flags=re.IGNORECASE)
        folder, base = out.parent, stem
        result = {"F16": out}
    else:
        folder = out if out is not None else paths.models_dir() / "demo"
        base = _base_name(arch, size, seed)
        result = {"F16": folder / f"{base}-F16.gguf"}
    for quant in quants:
        if quant != "F16":
            result[quant] = folder / f"{base}-{quant}.gguf"
    return result


def make_demo_models(
    *,
    arch: str = DEFAULT_ARCH,
    size: str = DEFAULT_SIZE,
    quants: Sequence[str] = (),
    seed: int = 0,
    out: Path | None = None,
    engine: EngineLocation | None = None,
    force: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> list[DemoFile]:
    """Write the F16 demo model (if missing) and each requested quant of it (if missing)."""
    demo_model.demo_spec(arch, size)  # validates arch and size before any work
    targets = demo_paths(arch, size, seed, quants, out)
    f16 = targets["F16"]
    written: list[DemoFile] = []
    created = force or not f16.is_file()
    if created:
        if on_step:
            on_step(f"writing {f16.name}")
        f16.parent.mkdir(parents=True, exist_ok=True)
        demo_model.write_demo_model(f16, arch=arch, size=size, seed=seed)
    written.append(DemoFile("F16", f16, f16.stat().st_size, created))
    return written + quantize_variants(f16, targets, engine=engine, force=force, on_step=on_step)


def quantize_variants(f16: Path, targets: dict[str, Path], *, engine: EngineLocation | None, force: bool = False,
                      on_step: Callable[[str], None] | None = None) -> list[DemoFile]:
    """Each quant of ``f16`` that ``targets`` names (F16 itself left out), made when missing or older than it."""
    written: list[DemoFile] = []
    for quant, path in targets.items():
        if quant == "F16":
            continue
        created = force or created_newer(f16, path)
        if created:
            if engine is None:
                raise UsageError("quantizing needs the engine: run `moe-tune engine install` first")
            if on_step:
                on_step(f"quantizing to {quant}")
            quantize(engine, f16, path, quant)
        written.append(DemoFile(quant, path, path.stat().st_size, created))
    return written


def created_newer(source: Path, derived: Path) -> bool:
    """True when ``derived`` is missing or older than ``source`` (so it must be made again)."""
    return not derived.is_file() or derived.stat().st_mtime < source.stat().st_mtime


def quantize(engine: EngineLocation, source: Path, dest: Path, quant: str) -> Path:
    tmp = dest.with_name(dest.name + ".part")
    runner.run_process(
        flags.quantize_argv(engine.tool(flags.QUANTIZE), source, tmp, quant),
        timeout_s=3600, what=f"llama-quantize {quant}",
        fix="check the quant name; IQ1/IQ2 types need an importance matrix",
    )
    tmp.replace(dest)
    return dest


def default_model(engine: EngineLocation | None, on_step: Callable[[str], None] | None = None) -> Path:
    """The model the main job runs on when the user names none: the tiny qwen3moe demo at Q4_K_M."""
    files = make_demo_models(quants=[DEFAULT_QUANT], engine=engine, on_step=on_step)
    return files[-1].path
