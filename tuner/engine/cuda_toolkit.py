"""The CUDA toolkit, wherever the distribution put it, and what the pinned CUDA build needs from it.

nvcc is looked for on PATH, then in ``$CUDA_HOME/bin`` and ``$CUDA_PATH/bin``, then in ``/usr/local/cuda/bin``
and ``/opt/cuda/bin`` (where NVIDIA's installers and the distributions put it, off PATH). The toolkit's root is
asked of nvcc itself (``nvcc --dryrun`` prints ``TOP=``), so a wrapper script on PATH still leads to it.

The pinned ``ggml/src/ggml-cuda/CMakeLists.txt`` links ``CUDA::cublas`` (and ``CUDA::cuda_driver`` unless
``GGML_CUDA_NO_VMM``). A minimal toolkit (nvcc and cudart alone) has neither: cuBLAS then comes from NVIDIA's
wheel on PyPI (``nvidia-cublas`` for CUDA 13, ``nvidia-cublas-cu12`` for 12): the one installed in this Python
(GPU images ship it with PyTorch), else fetched with pip into the engine cache; copied beside the binaries
(they load libraries from their own folder, ``RPATH=$ORIGIN``); without the driver library (``libcuda.so``, or
the toolkit's stub of it) the build turns off VMM, which is the only part that links the driver directly.
``CMAKE_CUDA_ARCHITECTURES=native`` needs a GPU at configure time, so the architecture is the card's compute
capability read through NVML (``MOE_TUNE_CUDA_ARCHS`` overrides it).

Where no toolkit is installed (or ``MOE_TUNE_CUDA_FROM=wheels`` asks for it), the toolkit is NVIDIA's CUDA 13
wheels unpacked into the engine cache (:mod:`tuner.engine.cuda_wheels`). A toolkit without the driver library
(both of these: the wheels carry no ``libcuda.so`` stub, nor does this project's machine's toolkit) links against
a stub made here from the toolkit's own ``cuda.h`` (:func:`driver_stub`), so VMM stays on, as in a build on a
machine with the driver: the carried engine is the one users build.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tuner.core.errors import BuildToolMissingError
from tuner.engine import cuda_wheels, runner
from tuner.engine.caps import CudaSource
from tuner.machine import hardware, paths

_TOP = re.compile(r"TOP=(\S+)")
_RELEASE = re.compile(r"release (\d+)\.(\d+)")


@dataclass(frozen=True, slots=True)
class Toolkit:
    nvcc: Path
    found_in: str  # "PATH", "CUDA_HOME", "/usr/local/cuda/bin", ...
    root: Path
    version: tuple[int, int]
    lib_dirs: tuple[Path, ...]

    @property
    def version_text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    def library(self, stem: str) -> Path | None:
        """``lib<stem>.so`` (or its versioned name) in the toolkit's library folders."""
        for d in self.lib_dirs:
            found = sorted(d.glob(f"lib{stem}.so*"))
            if found:
                return found[0]
        return None

    def describe(self) -> str:
        return f"nvcc {self.version_text} at {self.nvcc} (found in {self.found_in})"


@cache
def find_toolkit() -> Toolkit | None:
    """The first working nvcc and its toolkit, or None."""
    for nvcc, where in hardware.nvcc_candidates():
        if not (nvcc.is_file() and os.access(nvcc, os.X_OK)):
            continue
        toolkit = _ask(nvcc, where)
        if toolkit is not None:
            return toolkit
    return None


def chosen_toolkit(*, fetch: bool = False,
                   phase: Callable[[str], None] | None = None) -> tuple[CudaSource, Toolkit | None]:
    """The toolkit a CUDA build uses, by ``MOE_TUNE_CUDA_FROM``: an installed one (``auto``'s first choice), or
    NVIDIA's wheels (None until fetched; ``fetch`` fetches them)."""
    src = cuda_wheels.source()
    if src is not CudaSource.WHEELS:
        installed = find_toolkit()
        if installed is not None or src is CudaSource.INSTALLED:
            return CudaSource.INSTALLED, installed
    nvcc = cuda_wheels.fetch(phase) if fetch else cuda_wheels.cached_nvcc()
    return CudaSource.WHEELS, (_wheels_toolkit(nvcc) if nvcc is not None else None)


def toolkit_id() -> str:
    """The toolkit part of a CUDA build's identity: ``installed-13.0``, ``wheels-13.5``."""
    src, toolkit = chosen_toolkit()
    if src is CudaSource.WHEELS:
        return f"wheels-{cuda_wheels.release_text()}"
    return f"installed-{toolkit.version_text}" if toolkit is not None else "installed-none"


@cache
def _wheels_toolkit(nvcc: Path) -> Toolkit | None:
    return _ask(nvcc, "NVIDIA's wheels")


def _ask(nvcc: Path, where: str) -> Toolkit | None:
    version = runner.run_process([str(nvcc), "--version"], timeout_s=60, what="nvcc --version",
                                 fix="reinstall the CUDA toolkit", check=False)
    release = _RELEASE.search(version.stdout)
    if version.returncode != 0 or release is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cu"
        probe.write_text("int main() { return 0; }\n")
        dry = runner.run_process([str(nvcc), "--dryrun", "-c", str(probe)], timeout_s=60, what="nvcc --dryrun",
                                 fix="reinstall the CUDA toolkit", check=False)
    top = _TOP.search(dry.stdout + "\n" + dry.stderr_tail)
    root = Path(top.group(1)).resolve() if top else nvcc.resolve().parent.parent
    libs = [root / "lib64", root / "lib", *sorted((root / "targets").glob("*/lib"))]
    return Toolkit(nvcc, where, root, (int(release.group(1)), int(release.group(2))),
                   tuple(d for d in libs if d.is_dir()))


def driver_library(toolkit: Toolkit) -> Path | None:
    """``libcuda.so`` to link VMM against: the installed driver's, or the toolkit's stub."""
    for d in (*toolkit.lib_dirs, *(d / "stubs" for d in toolkit.lib_dirs)):
        found = sorted(d.glob("libcuda.so*"))
        if found:
            return found[0]
    for d in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")):
        found = sorted(d.glob("libcuda.so*"))
        if found:
            return found[0]
    return None


# Every driver API entry point ``cuda.h`` declares, after the preprocessor has mapped the versioned names
# (``cuMemGetInfo`` → ``cuMemGetInfo_v2``) as it does for the code that links against them.
_DRIVER_API = re.compile(r"\bCUresult\s+(cu[A-Za-z0-9_]+)\s*\(")
CUDA_ERROR_STUB_LIBRARY = 34  # what NVIDIA's own stubs answer: "the driver loaded is a stub library"


def cuda_header(toolkit: Toolkit) -> Path | None:
    for inc in (toolkit.root / "include", *sorted((toolkit.root / "targets").glob("*/include"))):
        if (inc / "cuda.h").is_file():
            return inc / "cuda.h"
    return None


def driver_stub(toolkit: Toolkit) -> Path:
    """``libcuda.so`` (soname ``libcuda.so.1``) that defines every driver API function of the toolkit's ``cuda.h``
    and does nothing: what the build links ``CUDA::cuda_driver`` (VMM, ggml-cuda's CMakeLists) against when no
    driver library is here. At run time the loader finds the real driver's ``libcuda.so.1``; the stub is never
    copied beside the binaries (it would shadow the driver through ``RPATH=$ORIGIN``)."""
    dest = paths.engine_root() / "cuda-deps" / f"driver-stub-{toolkit.version_text}"
    lib = dest / "libcuda.so"
    if lib.is_file() and (dest / "libcuda.so.1").is_symlink():
        return lib
    header = cuda_header(toolkit)
    if header is None:
        raise BuildToolMissingError(f"the CUDA toolkit at {toolkit.root} has no cuda.h: reinstall it (the "
                                    "runtime's headers) and retry")
    # Any C or C++ compiler does (told the source is C): the build machine has one, the CUDA build needs it.
    cc = os.environ.get("CC") or next((found for name in ("cc", "gcc", "clang", "c++", "g++")
                                       if (found := shutil.which(name))), "cc")
    pre = runner.run_process([cc, "-E", "-P", "-x", "c", "-I", str(header.parent), str(header)], timeout_s=120,
                             what="preprocess cuda.h", fix="install gcc (apt install build-essential) and retry")
    names = sorted(set(_DRIVER_API.findall(pre.stdout)))
    if "cuMemCreate" not in names:
        raise BuildToolMissingError(f"{header} declares no cuMemCreate: the toolkit is too old for llama.cpp's VMM "
                                    "pool; install CUDA 11.2 or newer")
    staging = dest.with_name(dest.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    source = staging / "libcuda_stub.c"
    source.write_text("/* Link-time stand-in for the NVIDIA driver library, made by moe-tune from "
                      f"{header}. */\n"
                      + "".join(f"int {n}(void) {{ return {CUDA_ERROR_STUB_LIBRARY}; }}\n" for n in names))
    runner.run_process([cc, "-shared", "-fPIC", "-O0", "-o", str(staging / "libcuda.so"),
                        "-Wl,-soname,libcuda.so.1", "-x", "c", str(source)], timeout_s=300,
                       what="compile the driver stub", fix="install gcc (apt install build-essential) and retry")
    (staging / "libcuda.so.1").symlink_to("libcuda.so")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return lib


def link_driver(toolkit: Toolkit) -> tuple[Path, bool]:
    """The driver library the build links (VMM on): the installed driver's or the toolkit's stub when there is
    one, else :func:`driver_stub`; and whether it is the stub made here."""
    found = driver_library(toolkit)
    return (found, False) if found is not None else (driver_stub(toolkit), True)


def architectures(nvml: object = None) -> str:
    """``CMAKE_CUDA_ARCHITECTURES`` for the card that is here: its compute capability ("86" for 8.6)."""
    override = os.environ.get("MOE_TUNE_CUDA_ARCHS")
    if override:
        return override
    cc = hardware.compute_capability(nvml)
    if cc is None:
        raise BuildToolMissingError(
            "no NVIDIA GPU here to take the CUDA architecture from: set MOE_TUNE_CUDA_ARCHS to your card's compute "
            "capability without the dot (86 for an RTX 3090, 89 for a 4090, 120 for a 5090) and retry")
    return f"{cc[0]}{cc[1]}"


def cublas_wheel(toolkit: Toolkit) -> str:
    """The pip requirement for cuBLAS of this toolkit's major.minor release."""
    major, minor = toolkit.version
    name = "nvidia-cublas" if major >= 13 else f"nvidia-cublas-cu{major}"
    return f"{name}>={major}.{minor},<{major}.{minor + 1}"


def cublas_dir(toolkit: Toolkit) -> Path:
    return paths.engine_root() / "cuda-deps" / f"cublas-{toolkit.version_text}"


def cached_cublas(toolkit: Toolkit) -> Path | None:
    """The folder of cuBLAS fetched earlier for this toolkit release (``include/`` and ``lib/``), or None."""
    have = sorted(cublas_dir(toolkit).glob("**/lib/libcublas.so*"))
    return have[0].parent.parent if have else None


def installed_cublas(toolkit: Toolkit, search: Sequence[Path] | None = None) -> Path | None:
    """cuBLAS of the toolkit's major release from NVIDIA's wheel installed in this Python (``nvidia/cu13`` for CUDA
    13, ``nvidia/cublas`` for 12; GPU images ship it with PyTorch): the folder with ``include/`` and ``lib/``, so a
    machine with no network builds without fetching it. ``search``: folders to look in (default: ``sys.path``)."""
    major = toolkit.version[0]
    for base in search if search is not None else [Path(p) for p in sys.path if p]:
        for sub in (f"nvidia/cu{major}", "nvidia/cublas"):
            root = base / sub
            if sorted(root.glob(f"lib/libcublas.so.{major}*")) and (root / "include" / "cublas_v2.h").is_file():
                return root
    return None


def fetch_cublas(toolkit: Toolkit) -> Path:
    """cuBLAS headers and libraries from NVIDIA's wheel, unpacked into the engine cache; returns the folder
    that holds ``include/`` and ``lib/``. Fetched once per toolkit release."""
    dest = cublas_dir(toolkit)
    cached = cached_cublas(toolkit)
    if cached is not None:
        return cached
    wheels = dest.with_name(dest.name + ".wheels")
    wheels.mkdir(parents=True, exist_ok=True)
    requirement = cublas_wheel(toolkit)
    runner.run_process([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                        str(wheels), requirement], timeout_s=1800, what=f"pip download {requirement}",
                       fix="check that PyPI is reachable, or install cuBLAS with your CUDA toolkit")
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest)
    shutil.rmtree(wheels, ignore_errors=True)
    have = sorted(dest.glob("**/lib/libcublas.so*"))
    if not have:
        raise BuildToolMissingError(f"{requirement} holds no libcublas: install cuBLAS with your CUDA toolkit")
    return have[0].parent.parent


def cmake_flags(toolkit: Toolkit, archs: str, cublas_root: Path | None, driver: Path | None) -> list[str]:
    """What the pinned CUDA build is configured with here (see the module docstring for each part). ``driver``:
    the ``libcuda.so`` VMM links against (:func:`link_driver`); None turns VMM off."""
    flags = ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}", f"-DCMAKE_CUDA_COMPILER={toolkit.nvcc}",
             f"-DCUDAToolkit_ROOT={toolkit.root}"]
    link_dirs = []
    if driver is None:
        flags.append("-DGGML_CUDA_NO_VMM=ON")
    else:
        # FindCUDAToolkit's cache variable for CUDA::cuda_driver; its folder also holds libcuda.so.1, the name
        # libggml-cuda records, which the tools' link looks for (-rpath-link, as for cuBLAS below).
        flags.append(f"-DCUDA_cuda_driver_LIBRARY={driver}")
        link_dirs.append(driver.parent)
    # The toolkit's own library folders too: the wheels' lib/ (cuBLAS inside the toolkit) is in no linker's search
    # path, and the tools' link failed on libggml-cuda's libcublas.so.13 after the whole CUDA compile.
    link_dirs += list(toolkit.lib_dirs)
    if cublas_root is not None:
        libs = cublas_root / "lib"
        lt = sorted(libs.glob("libcublasLt.so*"))
        flags += [f"-DCUDA_cublas_LIBRARY={sorted(libs.glob('libcublas.so*'))[0]}",
                  *([f"-DCUDA_cublasLt_LIBRARY={lt[0]}"] if lt else []),
                  f"-DCMAKE_CUDA_FLAGS=-I{cublas_root / 'include'}", f"-DCMAKE_CXX_FLAGS=-I{cublas_root / 'include'}"]
        # The tools link libggml-cuda, which needs libcublas.so.13 from a folder no linker searches:
        # without this every executable's link failed ("libcublas.so.13, needed by
        # bin/libggml-cuda.so…, not found"), after the whole CUDA compile had succeeded.
        link_dirs.append(libs)
    if link_dirs:
        rpath_link = ",".join(f"-rpath-link,{d}" for d in link_dirs)
        flags += [f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,{rpath_link}", f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,{rpath_link}"]
    return flags


def runtime_libraries(toolkit: Toolkit, cublas_root: Path | None) -> list[Path]:
    """Libraries the CUDA binaries load that a user's machine may lack: copied beside them at install."""
    wanted = []
    for stem in ("cudart", "cublas", "cublasLt"):
        where = [cublas_root / "lib"] if cublas_root is not None and stem.startswith("cublas") else []
        for d in (*where, *toolkit.lib_dirs):
            found = [p for p in sorted(d.glob(f"lib{stem}.so.*")) if p.is_file()]
            if found:
                wanted.append(found[0])
                break
    return wanted



def configure_parts(archs: str, phase: Callable[[str], None] = lambda _: None) -> tuple[list[str], list[Path]]:
    """The CUDA build's configure flags on this machine (toolkit, cuBLAS, driver library) and the runtime
    libraries its binaries need beside them. Fetches what is missing: the wheels' toolkit when it is the one
    chosen, cuBLAS when the toolkit has none (from the wheel installed in this Python, else the package index)."""
    _, toolkit = chosen_toolkit(fetch=True, phase=phase)
    if toolkit is None:
        raise BuildToolMissingError(f"--backend cuda needs nvcc and none was found (looked in "
                                    f"{hardware.nvcc_looked_in()}): install the CUDA toolkit, or set CUDA_HOME, "
                                    "or use --cuda-from wheels")
    cublas_root = None
    if toolkit.library("cublas") is None:
        installed = installed_cublas(toolkit)
        cublas_root = installed or cached_cublas(toolkit)
        if cublas_root is None:
            phase(f"fetch cuBLAS ({cublas_wheel(toolkit)}; the toolkit has none)")
            cublas_root = fetch_cublas(toolkit)
        else:
            phase(f"cuBLAS {'installed here' if installed else 'fetched earlier'} ({cublas_root}; the toolkit "
                  "has none)")
    driver, stub = link_driver(toolkit)
    if stub:
        phase(f"link VMM against a driver stub made from {toolkit.root}'s cuda.h (no libcuda.so here)")
    return cmake_flags(toolkit, archs, cublas_root, driver), runtime_libraries(toolkit, cublas_root)
