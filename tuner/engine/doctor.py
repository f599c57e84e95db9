"""`moe-tune doctor`: what the tool will run on, and each problem with its fix."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuner.core.errors import TunerError
from tuner.engine import build
from tuner.engine.identity import PIN, EngineIdentity
from tuner.engine.kinds import KINDS
from tuner.machine import hardware, paths

GiB = 2**30
MIN_FREE_DISK_BYTES = 2 * GiB


@dataclass(frozen=True, slots=True)
class Problem:
    what: str
    fix: str
    # A fatal problem means the tool cannot run at all (doctor exits non-zero).
    fatal: bool = False


@dataclass(slots=True)
class DoctorReport:
    engine: dict[str, Any] = field(default_factory=dict)
    # Every engine found, one per kind (llama.cpp, ik_llama.cpp), as auto-tune --engines would run them.
    engines: list[dict[str, Any]] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    gpu_note: str = ""
    host: dict[str, Any] = field(default_factory=dict)
    disk: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.fatal for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "engine": self.engine,
            "engines": self.engines,
            "gpus": self.gpus,
            "gpu_note": self.gpu_note,
            "host": self.host,
            "disk": self.disk,
            "problems": [asdict(p) for p in self.problems],
        }


def _hf_cache_dir() -> Path:
    hub = os.environ.get("HF_HUB_CACHE")
    if hub:
        return Path(hub)
    home = os.environ.get("HF_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "huggingface") / "hub"


# Where each way of naming an engine stands in the search order (tuner.engine.build.locate_engine).
PRECEDENCE = {
    "option": "--llama-cpp-dir comes first",
    "env": "LLAMA_CPP_DIR comes before PATH and the managed build",
    "path": "a llama-server on PATH comes before the managed build (LLAMA_CPP_DIR would come before it)",
    "managed": "the managed build comes last, after --llama-cpp-dir, LLAMA_CPP_DIR and PATH",
}


def _to_pinned(loc: build.EngineLocation) -> str:
    """How to run the pinned build instead of the one found, in the search order's words."""
    if loc.source == "managed":
        return "`moe-tune engine install` builds the pinned one"
    unset = {"option": "drop --llama-cpp-dir", "env": "unset LLAMA_CPP_DIR",
             "path": "take llama-server off PATH"}[loc.source]
    return f"to measure the pinned one, run `moe-tune engine install` and {unset} ({PRECEDENCE[loc.source]})"


def _identity_problems(ident: EngineIdentity, loc: build.EngineLocation) -> list[Problem]:
    """An engine with no commit cannot be tied to its results; another commit than the pin's is measured as
    itself, its own projection deciding memory (the replay follows the pin)."""
    if not ident.known:
        return [Problem(
            f"the engine at {loc.bin_dir} reports no commit ({ident.name}): results measured on it cannot be tied "
            "to an engine, and `serve` cannot tell it from another build",
            "build it with -DLLAMA_BUILD_COMMIT=<its commit> (a source without git data prints \"unknown\"), or "
            + _to_pinned(loc))]
    if not ident.pinned:
        return [Problem(
            f"engine commit {ident.commit} differs from the pinned {PIN.commit}: results name {ident.commit}; its own "
            f"projection (llama-fit-params) decides memory, where the replay follows {PIN.commit}",
            _to_pinned(loc))]
    return []


def _every_engine(llama_cpp_dir: Path | None) -> list[dict[str, Any]]:
    """One entry per kind of engine found (the one auto-tune runs for it), and one per kind not built yet."""
    found = []
    for loc in build.engines_found(llama_cpp_dir):
        caps = build.capabilities(loc)
        found.append({"engine": caps.kind.name, "path": str(loc.bin_dir), "source": loc.source,
                      "identity": caps.identity.describe(), "tools": {t: loc.has(t) for t in caps.kind.tools}})
    have = {e["engine"] for e in found}
    for kind in KINDS:
        if kind.name not in have:
            found.append({"engine": kind.name, "path": None,
                          "install": f"moe-tune engine install --engine {kind.key}"})
    return found


def diagnose(llama_cpp_dir: Path | None = None, nvml: Any = None) -> DoctorReport:
    report = DoctorReport()
    try:
        loc = build.locate_engine(llama_cpp_dir)
        caps = build.capabilities(loc)
        ident = caps.identity
        report.engine = {
            "path": str(loc.bin_dir),
            "source": loc.source,
            "build_number": caps.build_number,
            "commit": caps.commit,
            "backend": caps.backend,
            "devices": list(caps.devices),
            "tools": {t: loc.has(t) for t in build.TOOLS},
            "flags": {tool: list(f) for tool, f in caps.flags.items()},
            "pinned_commit": PIN.commit,
            "identity": ident.describe(),
            "pinned": ident.pinned,
        }
        missing = [t for t in caps.kind.tools if not loc.has(t) and t != "llama-batched-bench"]
        if missing:
            report.problems.append(Problem(
                f"engine at {loc.bin_dir} lacks {', '.join(missing)}",
                "build those targets too, or run `moe-tune engine install` for the managed build",
            ))
        report.problems += _identity_problems(ident, loc)
        report.engines = _every_engine(llama_cpp_dir)
    except TunerError as exc:
        report.engine = {"path": None, "pinned_commit": PIN.commit}
        report.problems.append(Problem(str(exc), "run `moe-tune engine install` or set LLAMA_CPP_DIR", fatal=True))

    probe = hardware.probe_gpus(nvml)
    report.gpus = [asdict(g) for g in probe.gpus]
    report.gpu_note = probe.reason
    chosen, why = build.backend_choice(build.Backend.AUTO)
    report.engine["install_would_build"] = {"backend": chosen.value, "why": why}
    if probe.gpus and report.engine.get("backend") == "cpu":
        report.problems.append(Problem(
            f"an NVIDIA GPU is present but the engine is a CPU build (engine install: {why})",
            "run `moe-tune engine install --backend cuda` or point --llama-cpp-dir at a CUDA build",
        ))
    elif probe.gpus and report.engine.get("backend") == "cuda" and not any(
            d.upper().startswith("CUDA") for d in report.engine.get("devices", [])):
        report.problems.append(Problem(
            "the engine is a CUDA build but lists no CUDA device (a driver older than its runtime, no driver "
            "library, or CUDA_VISIBLE_DEVICES hiding the card)",
            "run `llama-server --list-devices` from the engine folder to see llama.cpp's reason",
        ))

    host = hardware.probe_host()
    report.host = asdict(host)
    if host.swap_used_bytes > GiB:
        report.problems.append(Problem(
            f"{host.swap_used_bytes / GiB:.1f} GiB of swap in use: measurements will be slowed",
            "close other programs before tuning",
        ))

    for name, where in (("engine", paths.engine_root()), ("models", paths.models_dir()),
                        ("hf_cache", _hf_cache_dir())):
        free = hardware.free_disk_bytes(where)
        report.disk[name] = {"path": str(where), "free_bytes": free}
        if free < MIN_FREE_DISK_BYTES:
            report.problems.append(Problem(
                f"only {free / GiB:.1f} GiB free at {where}",
                "free disk space or set MOE_TUNE_CACHE / HF_HOME to a larger disk",
            ))
    return report
