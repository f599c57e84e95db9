"""What an engine build is and what it accepts, read from its own tools: version and commit, devices, every flag
each tool lists in its --help (which also tells llama.cpp from ik_llama.cpp: :mod:`tuner.engine.kinds`), and which
K/V pairs its flash attention runs. Cached per binary identity; below :mod:`tuner.engine.build`, which re-exports
these names (``build.capabilities``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import asdict, replace
from pathlib import Path

from tuner.core.config import LaunchConfig
from tuner.core.errors import WRONG_CPU_FIX, EngineError, illegal_instruction
from tuner.engine import runner
from tuner.engine.caps import (
    Capabilities,
    EngineLocation,
    FaKernels,
    backend_of,
    fa_kernels_from_system_info,
    ik_fa_kernels,
    parse_cuda_init,
    parse_devices,
    parse_help_flags,
    parse_version,
)
from tuner.engine.flags import file_log_argv, server_argv, trace_argv
from tuner.engine.flags.quantize import help_argv
from tuner.engine.kinds import IK_LLAMA, KINDS, EngineKind, kind_of_flags
from tuner.machine import paths
from tuner.machine.fileio import atomic_write

# Every tool of every kind: a folder is read for what it holds.
ALL_TOOLS = tuple(dict.fromkeys(t for k in KINDS for t in k.tools))


def _capabilities_cache_file(loc: EngineLocation) -> Path:
    ident = []
    for tool in ALL_TOOLS:
        path = loc.bin_dir / tool
        if path.exists():
            st = path.stat()
            ident.append(f"{tool}:{st.st_size}:{st.st_mtime_ns}")
    digest = hashlib.sha256((str(loc.bin_dir) + "|" + "|".join(ident)).encode()).hexdigest()[:16]
    return paths.cache_root() / "capabilities" / f"{digest}.json"


def capabilities(loc: EngineLocation, use_cache: bool = True) -> Capabilities:
    """Version, commit, devices and accepted flags of the binaries at ``loc`` (cached per binary identity)."""
    cache_file = _capabilities_cache_file(loc)
    if use_cache and cache_file.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            raw = json.loads(cache_file.read_text())
            return Capabilities.from_json(raw)
    fix = "the binary may be broken: rebuild with `moe-tune engine install --force`"
    flags: dict[str, tuple[str, ...]] = {}
    for tool in ALL_TOOLS:
        if loc.has(tool):
            res = runner.run_process(
                help_argv(loc.bin_dir / tool), timeout_s=30, what=f"{tool} --help", fix=fix, check=False
            )
            _refuse_unloadable(res.returncode, res.stdout + "\n" + res.stderr_tail, loc)
            flags[tool] = parse_help_flags(res.stdout + "\n" + res.stderr_tail)
    kind = kind_of_flags(flags)
    version, build_number, commit = _version(loc, fix)
    server = loc.tool("llama-server")
    info = ""
    if "--list-devices" in flags.get("llama-server", ("--list-devices",)):
        dev = runner.run_process(
            [str(server), "--list-devices"], timeout_s=60, what="llama-server --list-devices", fix=fix, check=False
        )
        _refuse_unloadable(dev.returncode, dev.stdout + "\n" + dev.stderr_tail, loc)  # the CPU backend's first run
        devices = parse_devices(dev.stdout + "\n" + dev.stderr_tail)
    else:  # ik_llama.cpp's server lists none: its start-up names the CUDA devices it found (ggml_cuda_init)
        info = _startup_text(loc, kind)
        devices = parse_cuda_init(info)
    backend = backend_of(devices, loc.bin_dir)
    # Which K/V pairs run flash attention: a CUDA build of llama.cpp compiles a list (read from its system info);
    # ik_llama.cpp's CPU kernels take a fixed set, larger with GGML_IQK_FA_ALL_QUANTS (learnt from its log).
    if kind is IK_LLAMA:
        fa = ik_fa_kernels(info or _startup_text(loc, kind))
    elif backend == "cuda":
        fa = fa_kernels_from_system_info(system_info(loc), backend)
    else:
        fa = FaKernels()
    caps = Capabilities(version, build_number, commit, backend, devices, flags, fa)
    _save_caps(cache_file, caps)
    return caps


_MISSING_LIBRARY = re.compile(r"error while loading shared libraries: (\S+?):")


def _refuse_unloadable(returncode: int, text: str, loc: EngineLocation) -> None:
    """A binary the loader cannot start says nothing of itself: name the library it lacks, and for a CUDA build
    linked to the driver (``libcuda.so.1``, VMM) on a machine without one, that it was built for a GPU machine."""
    if illegal_instruction(returncode):  # the first run of a build (managed or the user's): it cannot run on this CPU
        raise EngineError(f"the engine at {loc.bin_dir} was built for another CPU (its tools die of an illegal "
                          f"instruction, SIGILL): {WRONG_CPU_FIX}")
    missing = _MISSING_LIBRARY.search(text)
    if returncode == 0 or missing is None:
        return
    lib = missing.group(1)
    if lib.startswith("libcuda.so"):
        raise EngineError(f"the engine at {loc.bin_dir} is a CUDA build and this machine has no NVIDIA driver ({lib}): "
                          "it runs on a GPU machine; here run `moe-tune engine install --backend cpu` or point "
                          "LLAMA_CPP_DIR at a CPU build")
    raise EngineError(f"the engine at {loc.bin_dir} cannot start: {lib} is missing; install it, or rebuild with "
                      "`moe-tune engine install --force`")


def _save_caps(cache_file: Path, caps: Capabilities) -> None:
    with contextlib.suppress(OSError):
        atomic_write(cache_file, json.dumps(asdict(caps)))


def _version(loc: EngineLocation, fix: str) -> tuple[str, str, str]:
    """(version, build number, commit) from the first tool that prints them: llama.cpp's llama-bench does, ik's
    llama-bench takes no --version (its llama-server does, as ``version: N (COMMIT)``)."""
    for tool in ("llama-bench", "llama-server"):
        if loc.has(tool):
            out = runner.run_process([str(loc.bin_dir / tool), "--version"], timeout_s=30, what=f"{tool} --version",
                                     fix=fix, check=False)
            _refuse_unloadable(out.returncode, out.stdout + "\n" + out.stderr_tail, loc)
            found = parse_version(out.stdout + "\n" + out.stderr_tail)
            if found != ("unknown", "unknown", "unknown"):
                return found
    return "unknown", "unknown", "unknown"


def _startup_text(loc: EngineLocation, kind: EngineKind) -> str:
    """What llama-server prints before it looks for its model: the backends it found and the system info line."""
    missing = LaunchConfig(model=loc.bin_dir / "moe-tune-probe-no-model.gguf", engine=kind.name)
    argv = server_argv(loc.tool("llama-server"), missing) + trace_argv(kind) + file_log_argv(kind, paths.logs_dir())
    res = runner.run_process(argv,
                             timeout_s=60, what="llama-server start-up", check=False,
                             fix="rebuild with `moe-tune engine install --force`")
    return res.stdout + "\n" + res.stderr_tail


def system_info(loc: EngineLocation) -> str:
    """The system info line of the engine's build (``llama_print_system_info``: each backend's compiled
    features, a CUDA build's ``FA_QUANTS`` among them). ``common_params_print_info`` prints it at verbosity 4
    before any model is loaded, so a llama-server pointed at no model prints it and exits at once."""
    missing = LaunchConfig(model=loc.bin_dir / "moe-tune-probe-no-model.gguf")
    found: list[str] = []

    def keep(line: str) -> None:  # every line passes here: the tail alone may have lost it
        if "system_info:" in line:
            found.append(line)

    res = runner.run_process(server_argv(loc.tool("llama-server"), missing) + trace_argv(),
                             timeout_s=60, what="llama-server system info", check=False, on_line=keep,
                             fix="rebuild with `moe-tune engine install --force`")
    return found[0] if found else res.stdout


def note_engine_log(loc: EngineLocation, log_text: str) -> Capabilities:
    """Keep what a server or bench log taught about the engine: K/V pairs it said it has no flash-attention
    vector kernel for ("no FlashAttention vector kernel compiled for K/V types …") are left out from then on."""
    caps = capabilities(loc)
    learnt = caps.fa_kernels.learn_from_log(log_text)
    if learnt is caps.fa_kernels:
        return caps
    caps = replace(caps, fa_kernels=learnt)
    _save_caps(_capabilities_cache_file(loc), caps)
    return caps
