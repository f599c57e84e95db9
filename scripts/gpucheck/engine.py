"""The pinned engines on the GPU machine of `scripts/gpu_check`: CUDA builds (llama.cpp's, and ik_llama.cpp's for
the race) for the card's own architecture, timed into the state, and packed small enough to come back from the
lease and travel with the next one.

The build uses the product's own flags (:func:`tuner.engine.build.cmake_flags`: the flash-attention vector
kernels of every K/V pair the search tries, ``CMAKE_CUDA_ARCHITECTURES`` from the card's compute capability) plus
the machine's toolkit (:func:`tuner.engine.cuda_toolkit.cmake_flags`: nvcc, and cuBLAS from the toolkit or from
NVIDIA's wheel installed beside PyTorch, since nothing can be fetched there), built portable for the CPU
(``MOE_TUNE_CPU_ISA=avx2``, :mod:`tuner.engine.cpu_isa`): a build made here or on one lease's machine runs on the
next one's CPU, whatever it is, so its identity names no CPU. Only the tools the check runs are built. A build cut
by a command's time limit resumes in the next command (ninja keeps its steps); the compile time of every command is
added up, so the state holds the machine's whole build time.

Built, the tools and libraries (not the toolkit's runtime, which the next machine has) are packed as
``engine.tar.xz`` in parts of at most 15 MiB, when the whole is at most 45 MiB: they come back from ``$OUT``
(8 files of 16 MiB at most) and travel in the next lease's carry (64 MiB with the working tree), where
:func:`restore` puts them back instead of building again.
"""

from __future__ import annotations

import io
import json
import lzma
import os
import re
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.engine import build, cpu_isa, cuda_toolkit, runner
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP, EngineKind

CHECK_TOOLS = ("llama-server", "llama-bench", "llama-fit-params")  # what (a)-(c) run
IK_CHECK_TOOLS = ("llama-server", "llama-bench")  # what the race runs of ik_llama.cpp (no llama-fit-params there)
# Where each engine's pack sits in its carry folder (llama.cpp's in .gpu-pack, ik's in its own, carried by the
# lease's second command: each device call carries at most 64 MiB).
PACK_DIRS = {LLAMA_CPP.name: "engine", IK_LLAMA.name: "engine-ik"}
LEASE_ISA = cpu_isa.PORTABLE  # a lease's engines travel between machines: no host ISA in their code or key
ARCHIVE = "engine.tar.xz"
META = "engine.json"
PART_BYTES = 15 * 2**20  # a file back from $OUT is at most 16 MiB
BACK_LIMIT_BYTES = 45 * 2**20  # three parts: with the table and its JSON, well inside what comes back and travels
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")


def tools_of(kind: EngineKind) -> tuple[str, ...]:
    return IK_CHECK_TOOLS if kind is IK_LLAMA else CHECK_TOOLS


def identity(arch: str, kind: EngineKind = LLAMA_CPP) -> dict[str, Any]:
    """What makes a build reusable on another machine: the engine and its pin, the product's flags built portable
    for the CPU (the same on any x86-64 CPU), the card's architecture."""
    os.environ["MOE_TUNE_CUDA_ARCHS"] = arch  # read by build.cmake_flags
    out = {"pin": kind.pin.commit, "arch": arch,
           "cmake_flags": list(build.build_identity(build.Backend.CUDA, kind, isa=LEASE_ISA))}
    return out if kind is LLAMA_CPP else {"engine": kind.name, **out}


def configure_argv(src: Path, bdir: Path, arch: str, kind: EngineKind = LLAMA_CPP) -> tuple[list[str], list[Path]]:
    """The configure command and the runtime libraries the binaries need beside them."""
    flags, runtime = cuda_toolkit.configure_parts(arch)
    return (["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja",
             *build.cmake_flags(build.Backend.CUDA, kind, isa=LEASE_ISA), *flags], runtime)


def compile_engine(src: Path, bdir: Path, arch: str, *, timeout_s: float, log: Callable[[str], None],
                   times: dict[str, Any], kind: EngineKind = LLAMA_CPP) -> Path:
    """Configure (once) and compile the check's tools; ``times`` (the state's record) gets each command's
    seconds added, so a build cut by a time limit and resumed keeps its whole time. Returns the bin folder."""
    argv, runtime = configure_argv(src, bdir, arch, kind)
    start = time.monotonic()
    if not (bdir / "build.ninja").is_file():
        runner.run_process(argv, timeout_s=min(600, timeout_s), what="cmake configure", fix="see the build log",
                           on_line=log)
        times["configure_s"] = round(time.monotonic() - start, 1)
    jobs = os.cpu_count() or 4
    times.update(jobs=jobs, arch=arch, commands=times.get("commands", 0) + 1)

    def line(text: str) -> None:
        log(text)
        m = _NINJA.match(text)
        if m:
            times["steps_done"], times["steps"] = int(m.group(1)), int(m.group(2))

    t0 = time.monotonic()
    try:
        runner.run_process(["cmake", "--build", str(bdir), "-j", str(jobs), "--target", *tools_of(kind)],
                           timeout_s=max(30.0, timeout_s - (t0 - start)), what="cmake build", on_line=line,
                           fix="run the same command again: the build continues")
    finally:  # cut by the time limit or done: the seconds count either way
        times["compile_s"] = round(times.get("compile_s", 0.0) + time.monotonic() - t0, 1)
    times["finished"] = True
    times["build_s"] = round(times.get("configure_s", 0.0) + times["compile_s"], 1)
    bin_dir = bdir / "bin"
    link_runtime(bin_dir, runtime)
    return bin_dir


def link_runtime(bin_dir: Path, libs: list[Path]) -> None:
    """The toolkit's runtime and cuBLAS beside the binaries (they load from their own folder): links, not copies
    (cuBLAS is over 500 MiB), and never packed (the next machine has its own)."""
    for lib in libs:
        link = bin_dir / lib.name
        if not link.exists():
            link.symlink_to(lib)


# The toolkit's runtime and cuBLAS (copied beside a managed build's binaries): never packed; the GPU machine has
# its own.
RUNTIME_PREFIXES = ("libcudart", "libcublas")


def _packed(bin_dir: Path) -> list[Path]:
    return sorted(p for p in bin_dir.iterdir()
                  if p.is_file() and not p.is_symlink() and (p.name in CHECK_TOOLS or ".so" in p.name)
                  and not p.name.startswith(RUNTIME_PREFIXES))  # ik's tools are a subset of CHECK_TOOLS


def pack(bin_dir: Path, dest: Path, meta: dict[str, Any], *, limit_bytes: int = BACK_LIMIT_BYTES,
         part_bytes: int = PART_BYTES) -> dict[str, Any]:
    """``engine.tar.xz.00``, ``.01``, … and ``engine.json`` in ``dest`` when the archive is at most ``limit_bytes``;
    returns what was done (the parts, or why not), for the state."""
    t0 = time.monotonic()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for path in _packed(bin_dir):
            tar.add(path, arcname=path.name)
        # The library links the loader follows (libllama.so.0 -> libllama.so.0.5.0): kept as links.
        for path in sorted(bin_dir.iterdir()):
            if path.is_symlink() and not Path(os.readlink(path)).is_absolute() \
                    and not path.name.startswith(RUNTIME_PREFIXES):
                tar.add(path, arcname=path.name)
    data = lzma.compress(raw.getvalue(), preset=6)
    took = round(time.monotonic() - t0, 1)
    if len(data) > limit_bytes:
        return {"packed": False, "archive_mib": round(len(data) / 2**20, 1), "took_s": took,
                "note": f"the engine packs to {len(data) / 2**20:.1f} MiB, over {limit_bytes / 2**20:.0f} MiB: "
                        "the next lease builds it again"}
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    for n, off in enumerate(range(0, len(data), part_bytes)):
        part = dest / f"{ARCHIVE}.{n:02d}"
        part.write_bytes(data[off:off + part_bytes])
        parts.append(part.name)
    (dest / META).write_text(json.dumps({**meta, "parts": parts, "bytes": len(data)}, indent=2) + "\n")
    return {"packed": True, "parts": parts, "archive_mib": round(len(data) / 2**20, 1), "took_s": took}


def restore(src: Path, bin_dir: Path, want: dict[str, Any]) -> dict[str, Any] | None:
    """Unpack a carried engine into ``bin_dir`` when it is the build ``want`` describes (pin, flags, architecture);
    None when there is none or it is another build (then it is built)."""
    meta_path = src / META
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if any(meta.get(k) != v for k, v in want.items()):
        return None
    data = b"".join((src / name).read_bytes() for name in meta["parts"])
    if len(data) != meta["bytes"]:
        return None
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(bin_dir, filter="data")
        else:  # Python < 3.10.12
            tar.extractall(bin_dir)  # noqa: S202 - our own archive, checked against its recorded size
    return meta
