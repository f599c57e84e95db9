"""A CUDA toolkit from NVIDIA's wheels on the package index, for a machine with the driver and nothing else.

NVIDIA publishes the CUDA 13 compiler as wheels that all unpack under ``nvidia/cu13/`` (``bin/nvcc`` with its
``nvcc.profile``, ``include/``, ``lib/``, ``nvvm/``): ``nvidia-cuda-nvcc``, ``nvidia-cuda-crt`` (host headers
nvcc includes), ``nvidia-nvvm`` (cicc, libdevice), ``nvidia-cuda-cccl``, ``nvidia-cuda-runtime`` (cudart and
``cuda.h``) and ``nvidia-cublas``. Unpacked into one folder they are a toolkit CMake's FindCUDAToolkit accepts
once the unversioned library links exist (``libcudart.so`` → ``libcudart.so.13``), as an installer makes them.

Only CUDA 13: the CUDA 12 wheels (``nvidia-cuda-nvcc-cu12`` 12.4 and 12.9 were looked at) carry ``ptxas`` and
``libnvvm`` but no ``nvcc``. CUDA 13 needs a driver that runs it (580 or newer, NVML's CUDA driver version
13.0) and builds nothing for cards older than Turing (compute capability 7.5); older set-ups need an installed
CUDA 12 toolkit, and are told so.

``MOE_TUNE_CUDA_FROM`` (or ``engine install --cuda-from``) chooses: ``auto`` (an installed toolkit, else the
wheels), ``installed``, or ``wheels`` (even where a toolkit is installed).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from tuner.core.errors import BuildToolMissingError, UsageError
from tuner.engine import runner
from tuner.engine.caps import CudaSource
from tuner.machine import hardware, paths

ENV = "MOE_TUNE_CUDA_FROM"
# The release these wheels were built and checked with (nvcc 13.5.37 compiled the pinned engine for sm_90 here).
RELEASE = (13, 5)
MIN_DRIVER_CUDA = (13, 0)
MIN_ARCH = 75  # CUDA 13 dropped Maxwell, Pascal and Volta
_SAME_RELEASE = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime")
# cccl and cuBLAS number their releases on their own: the newest of CUDA 13 goes with any 13.x compiler.
_OWN_NUMBERING = ("nvidia-cuda-cccl", "nvidia-cublas")


def source() -> CudaSource:
    """Where the CUDA build takes its toolkit from (``MOE_TUNE_CUDA_FROM``; ``auto`` when unset)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    try:
        return CudaSource(value)
    except ValueError:
        raise UsageError(f"{ENV}={value!r} is not a CUDA source: use auto, installed or wheels") from None


def requirements() -> list[str]:
    major, minor = RELEASE
    return ([f"{name}=={major}.{minor}.*" for name in _SAME_RELEASE]
            + [f"{name}>={major},<{major + 1}" for name in _OWN_NUMBERING])


def release_text() -> str:
    return f"{RELEASE[0]}.{RELEASE[1]}"


def root() -> Path:
    """Where the wheels are unpacked into one toolkit folder (in the engine cache, once per release)."""
    return paths.engine_root() / "cuda-deps" / f"wheels-cu{RELEASE[0]}-{release_text()}"


def cached_nvcc() -> Path | None:
    nvcc = root() / "bin" / "nvcc"
    return nvcc if nvcc.is_file() and (root() / ".complete").is_file() else None


def blocker(nvml: object = None) -> str | None:
    """Why the CUDA 13 wheels cannot serve this machine's card, with the fix; None when they can.

    With no GPU here (building for another machine) the architectures asked for are checked instead."""
    driver = hardware.driver_cuda_version(nvml)
    if driver is not None and driver < MIN_DRIVER_CUDA:
        return (f"the NVIDIA driver here runs CUDA up to {driver[0]}.{driver[1]} and NVIDIA's compiler wheels are "
                f"CUDA {RELEASE[0]} (its CUDA 12 wheels carry no nvcc): update the driver to 580 or newer, or "
                "install a CUDA 12 toolkit and use --cuda-from installed")
    cc = hardware.compute_capability(nvml)
    archs = [f"{cc[0]}{cc[1]}"] if cc else os.environ.get("MOE_TUNE_CUDA_ARCHS", "").replace(",", ";").split(";")
    numbers = [int(m.group()) for a in archs if (m := re.match(r"\d+", a.strip()))]  # "90a", "86-real"
    old = [n for n in numbers if n < MIN_ARCH]
    if old:
        return (f"compute capability {old[0] // 10}.{old[0] % 10} is older than Turing and CUDA {RELEASE[0]} builds "
                "nothing for it: install a CUDA 12 toolkit and use --cuda-from installed")
    return None


def fetch(phase: Callable[[str], None] | None = None) -> Path:
    """The wheels' nvcc, unpacked into :func:`root` on first use (about 900 MiB; pip, from the package index)."""
    have = cached_nvcc()
    if have is not None:
        return have
    dest = root()
    if phase:
        phase(f"fetch CUDA {release_text()} from NVIDIA's wheels (nvcc, runtime, cuBLAS: about 900 MiB, once)")
    staging = dest.with_name(dest.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    wheels = staging / "wheels"
    wheels.mkdir(parents=True)
    runner.run_process([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-d", str(wheels), *requirements()], timeout_s=3600,
                       what="pip download of NVIDIA's CUDA wheels",
                       fix="check that the package index is reachable, or install the CUDA toolkit and use "
                           "--cuda-from installed")
    unpacked = staging / "unpacked"
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(unpacked)
    tree = unpacked / "nvidia" / f"cu{RELEASE[0]}"
    if not (tree / "bin" / "nvcc").is_file():
        raise BuildToolMissingError(f"NVIDIA's CUDA {release_text()} wheels held no bin/nvcc: install the CUDA "
                                    "toolkit and use --cuda-from installed")
    for tool in (tree / "bin").rglob("*"):  # zip files keep no mode bits
        if tool.is_file():
            tool.chmod(0o755)
    for tool in (tree / "nvvm" / "bin").glob("*"):
        tool.chmod(0o755)
    _link_unversioned(tree / "lib")
    shutil.rmtree(dest, ignore_errors=True)
    tree.rename(dest)
    shutil.rmtree(staging, ignore_errors=True)
    (dest / ".complete").write_text(" ".join(requirements()) + "\n")
    return dest / "bin" / "nvcc"


def _link_unversioned(lib: Path) -> None:
    """``libcudart.so`` → ``libcudart.so.13`` and the like: the names a linker (and FindCUDAToolkit) looks for,
    which an installer makes and a wheel does not."""
    for versioned in sorted(lib.glob("lib*.so.*")):
        plain = lib / (versioned.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(versioned.name)
