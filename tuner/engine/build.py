"""The engines: where their binaries are, and the managed builds (the pinned llama.cpp; ik_llama.cpp beside it).

Discovery order for every command: ``--llama-cpp-dir`` > ``LLAMA_CPP_DIR`` > PATH > the managed builds in the
per-user cache; asked for one kind of engine, the first of those that is that kind (:mod:`tuner.engine.kinds`:
known by the flags its tools list). A managed build compiles the engine tree vendored in its pinned sdist
(downloaded with pip, never built as a wheel: :mod:`tuner.engine.sdist`) and keeps only the tools this project
runs. What a build is and accepts: :mod:`tuner.engine.probe`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tuner.core.errors import (
    BuildFailedError,
    BuildToolMissingError,
    DiskSpaceError,
    EngineNotFoundError,
    ProcessFailedError,
    UsageError,
)
from tuner.engine import cpu_isa, cuda_toolkit, cuda_wheels, runner, sdist
from tuner.engine.caps import (  # noqa: F401 - the engine's public names: build.EngineLocation, build.parse_devices, ...
    FA_QUANTS_DEFAULT,
    FA_VEC_FLAG,
    Backend,
    Capabilities,
    CudaSource,
    EngineLocation,
    FaKernels,
    backend_of,
    fa_kernels_from_system_info,
    parse_devices,
    parse_help_flags,
    parse_version,
)
from tuner.engine.kinds import (  # noqa: F401 - build.PIN: the pin's one statement is in kinds
    IK_LLAMA,
    KINDS,
    LLAMA_CPP,
    PIN,
    EngineKind,
    EnginePin,
    kinds_named,
)
from tuner.engine.probe import (  # noqa: F401 - build.capabilities and friends, as before
    capabilities,
    note_engine_log,
    system_info,
)
from tuner.machine import hardware, paths
from tuner.machine.fileio import file_lock

# The llama.cpp tools moe-tune runs (tuner.engine.kinds). A build made before a tool joined the list is built again,
# once, to add it.
TOOLS = LLAMA_CPP.tools
# The flash-attention vector kernels the CUDA build compiles: llama.cpp's default list and every mixed pair the
# search's KV axis tries (tuner.search.space.KV_PAIRS; a test holds the two together). Without them a mixed
# pair converts the cache to f16 at every token (``ggml_cuda_flash_attn_ext_vec``). Each pair is one template
# instance file of 12 kernels (3 head sizes x 2 column counts x softcap on/off): 7 files instead of the default
# 4, where GGML_CUDA_FA_QUANTS=all would compile 49.
FA_QUANTS_BUILT = (*FA_QUANTS_DEFAULT, "f16-q8_0", "f16-q4_0", "q8_0-q4_0")
# A folder is an engine when it holds at least these.
CORE_TOOLS = ("llama-server", "llama-bench")
BUILD_DISK_BYTES = 1536 * 2**20
STAMP_NAME = "moe-tune-engine.json"


@dataclass(frozen=True, slots=True)
class InstallResult:
    bin_dir: Path
    backend: Backend
    built: bool
    elapsed_s: float


# ---------------------------------------------------------------------------------------------- discovery


def _engine_dir_in(folder: Path) -> Path | None:
    """Accept the binaries folder itself or a llama.cpp checkout whose build/bin holds them."""
    for candidate in (folder, folder / "bin", folder / "build" / "bin"):
        if all((candidate / t).is_file() for t in CORE_TOOLS[:1]):
            return candidate
    return None


def _stamp_engine(build_dir: Path) -> str | None:
    """Which kind a managed build is (its stamp; builds made before a second engine are llama.cpp's)."""
    try:
        return str(json.loads((build_dir / STAMP_NAME).read_text()).get("engine") or LLAMA_CPP.name)
    except (OSError, ValueError, AttributeError):
        return None


def managed_builds(kind: EngineKind | None = None) -> list[Path]:
    """Bin folders of finished managed builds (of ``kind``, or of every kind with llama.cpp's first), newest first."""
    root = paths.engine_root()
    if not root.is_dir():
        return []
    found = [p / "bin" for p in root.iterdir() if (p / STAMP_NAME).is_file() and (p / "bin").is_dir()
             and (kind is None or _stamp_engine(p) == kind.name)]
    newest = sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
    return newest if kind is not None else sorted(newest, key=lambda p: _stamp_engine(p.parent) != LLAMA_CPP.name)


def _named(explicit: Path | None) -> list[EngineLocation]:
    """The engines the user named, in precedence order: ``--llama-cpp-dir``, ``LLAMA_CPP_DIR``, PATH."""
    named: list[EngineLocation] = []
    if explicit is not None:
        found = _engine_dir_in(explicit.expanduser())
        if found is None:
            raise UsageError(
                f"--llama-cpp-dir {explicit} holds no llama-server: point it at the folder with the llama.cpp binaries"
            )
        named.append(EngineLocation(found.resolve(), "option"))
    env_dir = os.environ.get("LLAMA_CPP_DIR")
    if env_dir:
        found = _engine_dir_in(Path(env_dir).expanduser())
        if found is None:
            raise UsageError(
                f"LLAMA_CPP_DIR={env_dir} holds no llama-server: point it at the folder with the llama.cpp binaries"
            )
        named.append(EngineLocation(found.resolve(), "env"))
    on_path = shutil.which("llama-server")
    if on_path:
        named.append(EngineLocation(Path(on_path).resolve().parent, "path"))
    return named


def locate_engine(explicit: Path | None = None, kind: EngineKind | None = None) -> EngineLocation:
    """The engine every command runs: the first of ``--llama-cpp-dir``, ``LLAMA_CPP_DIR``, PATH and the managed
    builds. With ``kind``, the first of those that is that kind of engine (known by its flags, never its folder)."""
    named = _named(explicit)
    if kind is None and named:
        return named[0]
    for loc in named:
        if capabilities(loc).kind is kind:
            return loc
    if kind is None or kind is LLAMA_CPP:
        try:
            wanted: Path | None = _managed_dir(resolve_backend(Backend.AUTO)) / "bin"
        except BuildToolMissingError:  # a card whose architecture the driver does not report: any finished build
            wanted = None
        builds = managed_builds(kind)
        if wanted in builds:
            return EngineLocation(wanted, "managed")
    builds = managed_builds(kind)
    if builds:
        return EngineLocation(builds[0], "managed")
    if kind is not None and kind is not LLAMA_CPP:
        raise EngineNotFoundError(f"{kind.name}'s llama-server", [
            "--llama-cpp-dir", "LLAMA_CPP_DIR", "PATH", f"{paths.engine_root()} (`moe-tune engine install --engine "
            f"{kind.key}` builds it)"])
    raise EngineNotFoundError("llama-server", ["--llama-cpp-dir", "LLAMA_CPP_DIR", "PATH", str(paths.engine_root())])


ENGINES_ENV = "MOE_TUNE_ENGINES"  # the engines auto-tune tunes when --engines is not given (e.g. "llama.cpp")


def engines_for(names: str | None, explicit: Path | None = None) -> list[EngineLocation]:
    """The engines ``auto-tune --engines`` names (``llama.cpp,ik``), each located; None: ``MOE_TUNE_ENGINES``, else
    every engine installed here (llama.cpp alone until ik_llama.cpp is built). A named engine that is not here is
    an error naming how to build it."""
    wanted = names or os.environ.get(ENGINES_ENV)
    if not wanted:
        found = engines_found(explicit)
        if not found:
            locate_engine(explicit)  # raises, naming where it looked
        return found
    return [locate_engine(explicit, kind) for kind in kinds_named(wanted)]


def engines_found(explicit: Path | None = None) -> list[EngineLocation]:
    """One engine of each kind found here (the one :func:`locate_engine` would run for it), llama.cpp first."""
    found: list[EngineLocation] = []
    for kind in KINDS:
        with contextlib.suppress(EngineNotFoundError):
            loc = locate_engine(explicit, kind)
            if loc not in found:
                found.append(loc)
    return found


# -------------------------------------------------------------------------------------------- managed build


def backend_choice(requested: Backend) -> tuple[Backend, str]:
    """The backend to build and why, in words. ``auto`` means CUDA when an NVIDIA GPU is there to run it AND a
    toolkit can build it (an installed one, or NVIDIA's CUDA 13 wheels when the driver and card take them), else
    CPU: a toolkit without a GPU (common on CI images) would spend an hour compiling kernels nothing can run. nvcc
    is looked for where toolkits are installed, not only on PATH."""
    if requested is Backend.CPU:
        return Backend.CPU, "asked for with --backend cpu"
    gpus = hardware.probe_gpus().gpus
    if not gpus and requested is not Backend.CUDA:
        return Backend.CPU, "no NVIDIA GPU found (NVML lists none)"
    src, toolkit = cuda_toolkit.chosen_toolkit()
    blocked = cuda_wheels.blocker() if src is CudaSource.WHEELS else None
    how = toolkit.describe() if toolkit is not None else "no nvcc found yet" if src is CudaSource.INSTALLED \
        else f"CUDA {cuda_wheels.release_text()} from NVIDIA's wheels (fetched at install, once)"
    if requested is Backend.CUDA:
        return Backend.CUDA, f"asked for with --backend cuda; {how}"
    if toolkit is None and (blocked or src is CudaSource.INSTALLED):
        why = blocked or f"no CUDA toolkit (looked for nvcc in {hardware.nvcc_looked_in()})"
        return Backend.CPU, f"an {gpus[0].name} is here but {why}; then run `moe-tune engine install --backend cuda`"
    return Backend.CUDA, f"an {gpus[0].name} is here; {how}"


def resolve_backend(requested: Backend) -> Backend:
    return backend_choice(requested)[0]


def cmake_flags(backend: Backend, kind: EngineKind = LLAMA_CPP, isa: str | None = None) -> tuple[str, ...]:
    """The flags that make a build what it is (its cache key; ``isa``: :mod:`tuner.engine.cpu_isa`'s mode). The CUDA
    build adds, at configure time, this machine's toolkit and cuBLAS (:func:`tuner.engine.cuda_toolkit.cmake_flags`)."""
    if kind is IK_LLAMA:
        return _ik_cmake_flags(backend, isa)
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        f"-DLLAMA_BUILD_COMMIT={PIN.commit}",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        *cpu_isa.llama_cpp_flags(isa),  # this CPU's granted instruction sets, AMX never (tuner.engine.cpu_isa)
    ]
    if backend is Backend.CUDA:
        # Only the card that is here: the full default list of CUDA architectures takes hours on a small CPU.
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_toolkit.architectures()}",
                  f"-D{FA_VEC_FLAG}={','.join(FA_QUANTS_BUILT)}"]
    return tuple(flags)


# ik_llama.cpp's CPU flash attention (ggml/src/iqk/iqk_flash_attn.cpp, ``supported_kv_types``) takes f16, q8_0,
# q8_KV and q6_0 caches; q4_0, q4_1 and iq4_nl only when built with GGML_IQK_FA_ALL_QUANTS (its default, ON), and
# any other pair aborts the process ("… is not a supported combination on the CPU backend"). The search's KV axis
# tries q4_0 (tuner.search.space.KV_PAIRS), so the managed build keeps them all.
IK_FA_ALL_QUANTS = True


def _ik_cmake_flags(backend: Backend, isa: str | None = None) -> tuple[str, ...]:
    """ik_llama.cpp's tree: its examples folder holds llama-bench and the server (both off unless asked for); built
    for this CPU's granted instruction sets (:func:`tuner.engine.cpu_isa.ik_flags`: the fork's speed is the host's
    own SIMD). Shared libraries go beside the binaries (``$ORIGIN``): the install step gathers them from the tree."""
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        *cpu_isa.ik_flags(isa),
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_CURL=OFF",
        f"-DGGML_IQK_FA_ALL_QUANTS={'ON' if IK_FA_ALL_QUANTS else 'OFF'}",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    ]
    if backend is Backend.CUDA:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_toolkit.architectures()}"]
    return tuple(flags)


def build_identity(backend: Backend, kind: EngineKind = LLAMA_CPP, isa: str | None = None) -> tuple[str, ...]:
    """What makes two builds the same: the flags, the CPU a build for this CPU alone was made for (ik's; llama.cpp's
    flags name it), for CUDA the toolkit (an installed 13.0 and the wheels' 13.5 are two builds)."""
    flags = cmake_flags(backend, kind, isa)
    if kind is not LLAMA_CPP and cpu_isa.made_for_this_cpu(isa):
        flags = (*flags, cpu_isa.identity())
    return (*flags, f"toolkit={cuda_toolkit.toolkit_id()}") if backend is Backend.CUDA else flags


def _build_key(backend: Backend, kind: EngineKind = LLAMA_CPP) -> str:
    digest = hashlib.sha256("\n".join(build_identity(backend, kind)).encode()).hexdigest()[:8]
    if kind is LLAMA_CPP:  # the key builds made before a second engine existed carry
        return f"llama.cpp-{PIN.version}-{PIN.commit}-{backend.value}-{digest}"
    return f"{kind.name}-{kind.pin.version}-{backend.value}-{digest}"


def _managed_dir(backend: Backend, kind: EngineKind = LLAMA_CPP) -> Path:
    return paths.engine_root() / _build_key(backend, kind)


def _stamp_matches(target: Path, backend: Backend, kind: EngineKind = LLAMA_CPP) -> bool:
    stamp = target / STAMP_NAME
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return (
        data.get("pin") == asdict(kind.pin)
        and data.get("cmake_flags") == list(cmake_flags(backend, kind))
        and data.get("identity", data.get("cmake_flags")) == list(build_identity(backend, kind))
        # Every tool this version runs: a build made before a tool was added is built again, once.
        and all((target / "bin" / t).is_file() for t in kind.tools)
    )


def _check_build_tools(backend: Backend) -> tuple[str, str]:
    """Return (cmake, generator) or raise naming what to install."""
    cmake = shutil.which("cmake")
    if not cmake:
        raise BuildToolMissingError("cmake not found: install it (apt install cmake, or pip install cmake) and retry")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise BuildToolMissingError("no C++ compiler found: install g++ (apt install build-essential) and retry")
    if backend is Backend.CUDA:
        src, toolkit = cuda_toolkit.chosen_toolkit()
        if src is CudaSource.INSTALLED and toolkit is None:
            raise BuildToolMissingError(f"--backend cuda needs nvcc and none was found (looked in "
                                        f"{hardware.nvcc_looked_in()}): install the CUDA toolkit, or set CUDA_HOME "
                                        "to where it is, or use --cuda-from wheels, or --backend cpu")
        blocked = cuda_wheels.blocker() if src is CudaSource.WHEELS else None
        if blocked:
            raise BuildToolMissingError(blocked)
    if shutil.which("ninja"):
        return cmake, "Ninja"
    if shutil.which("make"):
        return cmake, "Unix Makefiles"
    raise BuildToolMissingError("neither ninja nor make found: install one (apt install ninja-build) and retry")


# ik_llama.cpp's ggml asks for the CUDA20 dialect: CMake 3.25.1 knows no nvcc flag for it ("Target ggml requires
# the language dialect CUDA20 … CMake does not know the flags"), 3.26.4 configures it (both seen here with CUDA 13.0).
IK_CUDA_CMAKE = (3, 26)
_CMAKE_VERSION = re.compile(r"cmake version (\d+)\.(\d+)")


def _cmake_version(cmake: str) -> tuple[int, int]:
    out = runner.run_process([cmake, "--version"], timeout_s=30, what="cmake --version", check=False,
                             fix="install cmake (apt install cmake, or pip install cmake)")
    found = _CMAKE_VERSION.search(out.stdout)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _newer_cmake(root: Path, phase: Callable[[str], None]) -> str:
    """A CMake new enough for ik's CUDA build, from the package index (its wheel carries the binary), kept in the
    engine cache; the system's stays as it is."""
    where = root / "cmake-py"
    binary = where / "cmake" / "data" / "bin" / "cmake"
    if not binary.is_file():
        phase(f"fetch CMake >= {'.'.join(map(str, IK_CUDA_CMAKE))} (this one knows no CUDA20 for nvcc)")
        runner.run_process([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(where),
                            f"cmake>={'.'.join(map(str, IK_CUDA_CMAKE))},<5"], timeout_s=600,
                           what="pip install of cmake", fix="check that PyPI is reachable (pip config, proxy)")
    return str(binary)


def _build_lock(root: Path, key: str) -> contextlib.AbstractContextManager[None]:
    return file_lock(root / f"{key}.lock")


_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def _built_files(kind: EngineKind, build_dir: Path) -> list[Path]:
    """The binaries and shared libraries a build made. llama.cpp's tree puts them all in build/bin; ik_llama.cpp's
    leaves libllama, libggml and libmtmd in their own folders, where binaries with an ``$ORIGIN`` rpath do not look."""
    found = [p for p in (build_dir / "bin").iterdir() if p.name in kind.tools or ".so" in p.name] \
        if (build_dir / "bin").is_dir() else []
    if kind is not LLAMA_CPP:
        names = {p.name for p in found}
        for lib in sorted(build_dir.rglob("lib*.so*")):
            if "CMakeFiles" not in lib.parts and lib.name not in names:
                found.append(lib)
                names.add(lib.name)
    return found


def install(
    backend: Backend = Backend.AUTO,
    *,
    kind: EngineKind = LLAMA_CPP,
    force: bool = False,
    jobs: int | None = None,
    on_phase: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> InstallResult:
    """Build an engine's tools (the pinned llama.cpp, or ik_llama.cpp) into the cache; return at once when a matching
    build is there."""
    start = time.monotonic()
    backend = resolve_backend(backend)
    key = _build_key(backend, kind)
    root = paths.engine_root()
    target = root / key
    if not force and _stamp_matches(target, backend, kind):
        return InstallResult(target / "bin", backend, False, time.monotonic() - start)

    def phase(name: str) -> None:
        if on_phase:
            on_phase(name)

    with _build_lock(root, key):
        if not force and _stamp_matches(target, backend, kind):  # another process finished it while we waited
            return InstallResult(target / "bin", backend, False, time.monotonic() - start)
        cmake, generator = _check_build_tools(backend)
        if kind is IK_LLAMA and backend is Backend.CUDA and _cmake_version(cmake) < IK_CUDA_CMAKE:
            cmake = _newer_cmake(root, phase)
        free = hardware.free_disk_bytes(root)
        if free < BUILD_DISK_BYTES:
            raise DiskSpaceError(root, BUILD_DISK_BYTES, free)
        log_path = paths.logs_dir() / f"build-{key}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w", buffering=1) as log:

            def log_line(line: str) -> None:
                log.write(line + "\n")

            def build_line(line: str) -> None:
                log.write(line + "\n")
                match = _NINJA_PROGRESS.match(line)
                if match and on_progress:
                    on_progress(int(match.group(1)), int(match.group(2)))
                elif (pct := _MAKE_PROGRESS.match(line)) and on_progress:
                    on_progress(int(pct.group(1)), 100)

            phase("download source")
            tarball = sdist.fetch(kind, root / "src", log_line)
            work = root / f"{key}.work"
            build_dir = work / "build"
            # An interrupted build keeps its folder; the source is extracted again with the sdist's own
            # mtimes (older than the objects), so ninja goes on from the step where it was stopped.
            resumed = (build_dir / ".ninja_log").is_file()
            phase("extract (the interrupted build resumes)" if resumed else "extract")
            source = sdist.extract(kind, tarball, work / kind.name)
            fix = f"see {log_path}; install the missing development package or pass --backend cpu"
            extra, runtime = _cuda_parts(backend, phase)
            phase("configure")
            _run_step("configure", [cmake, "-S", str(source), "-B", str(build_dir), "-G", generator,
                                    *cmake_flags(backend, kind), *extra], log_line, log_path, fix)
            phase("compile")
            n_jobs = jobs or os.cpu_count() or 2
            _run_step("compile", [cmake, "--build", str(build_dir), "-j", str(n_jobs), "--target", *kind.tools],
                      build_line, log_path, fix)
            phase("install")
            staged = root / f"{key}.staged"
            if staged.exists():
                shutil.rmtree(staged)
            (staged / "bin").mkdir(parents=True)
            for item in _built_files(kind, build_dir):
                shutil.copy2(item, staged / "bin" / item.name, follow_symlinks=False)
            for lib in runtime:  # CUDA runtime and cuBLAS beside the binaries (RPATH $ORIGIN)
                shutil.copy2(lib, staged / "bin" / lib.name)
            elapsed = time.monotonic() - start
            stamp = {
                "engine": kind.name,
                "pin": asdict(kind.pin),
                "backend": backend.value,
                "cmake_flags": list(cmake_flags(backend, kind)),
                "identity": list(build_identity(backend, kind)),
                "cmake_flags_here": extra,  # this machine's toolkit and cuBLAS (not part of the build's identity)
                "tools": list(kind.tools),
                "build_s": round(elapsed, 1),  # this run's time: a resumed build's earlier part is not in it
                "resumed": resumed,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (staged / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
            with contextlib.suppress(OSError):  # each step's compile time, kept beside the log (what made it slow)
                shutil.copy2(build_dir / ".ninja_log", log_path.with_suffix(".ninja_log"))
            shutil.rmtree(work, ignore_errors=True)
    return InstallResult(target / "bin", backend, True, time.monotonic() - start)


def _cuda_parts(backend: Backend, phase: Callable[[str], None]) -> tuple[list[str], list[Path]]:
    """Configure flags and runtime libraries of this machine's CUDA toolkit (nothing for the CPU build)."""
    if backend is not Backend.CUDA:
        return [], []
    return cuda_toolkit.configure_parts(cuda_toolkit.architectures(), phase)


def _run_step(step: str, argv: list[str], on_line: Callable[[str], None], log_path: Path, fix: str) -> None:
    try:
        runner.run_process(argv, timeout_s=4 * 3600, what=f"llama.cpp {step}", fix=fix, on_line=on_line)
    except ProcessFailedError as exc:
        raise BuildFailedError(step, argv, exc.returncode or 1, exc.stderr_tail, log_path) from exc


def build_info(bin_dir: Path) -> dict[str, object]:
    """The stamp of a managed build (empty for engines the user brought)."""
    try:
        data: dict[str, object] = json.loads((bin_dir.parent / STAMP_NAME).read_text())
        return data
    except (OSError, ValueError):
        return {}
