"""The VRAM ballast: a helper process that holds all but N MiB of a GPU's memory until stopped (the host RAM's
balloon is :mod:`tuner.machine.ram_ballast`).

So a big card can stand in for a small one with its own bandwidth: hold all but 16 GiB of an 80 GB card and
llama.cpp, NVML and the memory gate all see a 16 GiB card's free memory. The helper is a few lines of CUDA C
built once with ``nvcc`` (plain ``cudaMalloc``, never managed memory, which can hang a GPU when
oversubscribed); without nvcc, CuPy or PyTorch do the same ``cudaMalloc`` from Python. The helper prints one
JSON line once it holds the memory and then sleeps until killed; :func:`hold_vram` is a context manager, so
the memory is given back however the block ends. Spawned through :mod:`tuner.engine.runner`, the only
spawner, which the caller hands in (``machine`` may not import ``engine``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tuner.core.errors import HardwareError, NoGpuError, UsageError
from tuner.machine import hardware, paths

# Plain cudaMalloc in halving chunks until what is free is down to the amount to leave; then sleep.
CUDA_SOURCE = r"""
#include <cuda_runtime.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: moe-tune-ballast LEAVE_MIB [DEVICE]\n"); return 2; }
    const size_t mib = (size_t)1 << 20;
    size_t leave = (size_t)strtoull(argv[1], NULL, 10) * mib, free_b = 0, total_b = 0, held = 0;
    cudaError_t e = cudaSetDevice(argc > 2 ? atoi(argv[2]) : 0);
    if (e == cudaSuccess) e = cudaMemGetInfo(&free_b, &total_b);
    if (e != cudaSuccess) { fprintf(stderr, "error: no CUDA device: %s\n", cudaGetErrorString(e)); return 3; }
    for (size_t chunk = 256 * mib; chunk >= 2 * mib;) {
        cudaMemGetInfo(&free_b, &total_b);
        if (free_b <= leave + 2 * mib) break;
        size_t want = free_b - leave < chunk ? (free_b - leave - 2 * mib) / (2 * mib) * (2 * mib) : chunk;
        void *p = NULL;
        if (want == 0 || cudaMalloc(&p, want) != cudaSuccess) { cudaGetLastError(); chunk /= 2; continue; }
        cudaMemset(p, 0, want);  /* touch it: the driver must really back it */
        held += want;
    }
    cudaDeviceSynchronize();
    cudaMemGetInfo(&free_b, &total_b);
    printf("{\"held_mib\": %zu, \"free_mib\": %zu, \"total_mib\": %zu, \"method\": \"nvcc\"}\n",
           held / mib, free_b / mib, total_b / mib);
    fflush(stdout);
    for (;;) pause();
}
"""

# The same with CuPy (raw cudaMalloc through cupy.cuda.Memory) or PyTorch, when there is no nvcc.
PYTHON_SOURCE = r"""
import json, sys, time
leave, dev, mib = int(sys.argv[1]) << 20, int(sys.argv[2]), 1 << 20
try:
    import cupy
    cupy.cuda.Device(dev).use()
    info, alloc, method = cupy.cuda.runtime.memGetInfo, cupy.cuda.Memory, "cupy"
except ImportError:
    import torch
    info = lambda: torch.cuda.mem_get_info(dev)
    alloc = lambda n: torch.empty(n, dtype=torch.uint8, device=f"cuda:{dev}")
    method = "torch"
held, keep, chunk = 0, [], 256 * mib
while chunk >= 2 * mib:
    free, total = info()
    if free <= leave + 2 * mib:
        break
    want = chunk if free - leave >= chunk else (free - leave - 2 * mib) // (2 * mib) * (2 * mib)
    if want <= 0:
        break
    try:
        keep.append(alloc(want))
        held += want
    except Exception:
        chunk //= 2
free, total = info()
print(json.dumps({"held_mib": held // mib, "free_mib": free // mib, "total_mib": total // mib, "method": method}),
      flush=True)
while True:
    time.sleep(3600)
"""

READY_TIMEOUT_S = 120.0


class Spawner(Protocol):
    """What :mod:`tuner.engine.runner` offers (the only spawner; passed in, since ``machine`` sits below
    ``engine`` and may not import it)."""

    def run_process(self, argv: Sequence[str], *, timeout_s: float, what: str, fix: str) -> Any: ...

    def hold(self, argv: Sequence[str], *, ready_timeout_s: float, what: str, fix: str
             ) -> AbstractContextManager[Any]: ...


@dataclass(frozen=True, slots=True)
class BallastMethod:
    name: str  # "nvcc", "cupy", "torch"
    argv_prefix: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ballast:
    """A ballast that is holding memory right now."""

    pid: int
    method: str
    held_mib: int
    free_mib: int  # what the GPU has free with the ballast in place
    total_mib: int


def _build_dir() -> Path:
    digest = hashlib.sha256(CUDA_SOURCE.encode()).hexdigest()[:10]
    return paths.cache_root() / "ballast" / digest


def build_cuda_helper(nvcc: str, spawner: Spawner) -> Path:
    """Compile the CUDA C helper once (a few seconds); later calls find the binary."""
    out = _build_dir() / "moe-tune-ballast"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent / "ballast.cu"
    src.write_text(CUDA_SOURCE)
    tmp = out.with_suffix(".tmp")
    spawner.run_process([nvcc, "-O2", "-o", str(tmp), str(src)], timeout_s=300, what="nvcc (VRAM ballast)",
                        fix="check the CUDA toolkit (nvcc --version)")
    tmp.rename(out)
    return out


def find_method(spawner: Spawner) -> BallastMethod | None:
    """How this machine can hold VRAM: nvcc, else CuPy, else PyTorch; None when none of them is there."""
    nvcc = hardware.find_nvcc()  # on PATH, in CUDA_HOME/CUDA_PATH or where installers put it
    if nvcc:
        return BallastMethod("nvcc", (str(build_cuda_helper(str(nvcc), spawner)),))
    for module in ("cupy", "torch"):
        if importlib.util.find_spec(module) is not None:
            return BallastMethod(module, (sys.executable, "-c", PYTHON_SOURCE))
    return None


def gpu_missing_reason(nvml: Any = None) -> str | None:
    """Why no ballast can run here (in the user's words), or None when one can."""
    probe = hardware.probe_gpus(nvml)
    if not probe.gpus:
        return probe.reason or "no NVIDIA GPU found"
    return None


def parse_ready_line(line: str, method: str) -> Ballast:
    """The helper's JSON line (pid filled in by the caller)."""
    try:
        info = json.loads(line)
        return Ballast(0, str(info.get("method", method)), int(info["held_mib"]), int(info["free_mib"]),
                       int(info["total_mib"]))
    except (ValueError, KeyError, TypeError):
        raise HardwareError(f"the VRAM ballast said {line[:200]!r}, not its JSON line: delete "
                            "~/.cache/moe-tune/ballast to rebuild it") from None


@contextlib.contextmanager
def hold_vram(leave_mib: int, spawner: Spawner, *, device: int = 0, nvml: Any = None) -> Iterator[Ballast]:
    """Hold all but ``leave_mib`` MiB of free VRAM on ``device`` for the duration of the block.

    ``spawner`` is :mod:`tuner.engine.runner`: ``hold_vram(16384, runner)``.
    """
    if leave_mib < 0:
        raise UsageError(f"the ballast must leave >= 0 MiB free, got {leave_mib}")
    reason = gpu_missing_reason(nvml)
    if reason is not None:
        raise NoGpuError(f"{reason}: the VRAM ballast needs an NVIDIA GPU; run it on a machine with one")
    method = find_method(spawner)
    if method is None:
        raise NoGpuError("no way to allocate VRAM here (no nvcc, CuPy or PyTorch): install the CUDA toolkit")
    argv = [*method.argv_prefix, str(int(leave_mib)), str(device)]
    with spawner.hold(argv, ready_timeout_s=READY_TIMEOUT_S, what=f"VRAM ballast ({method.name})",
                      fix="check that the GPU is visible (nvidia-smi)") as held:
        b = parse_ready_line(held.ready_line, method.name)
        yield Ballast(held.pid, b.method, b.held_mib, b.free_mib, b.total_mib)
