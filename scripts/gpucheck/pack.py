"""`scripts/gpu_check --pack DIR`: the carry folder a bare, offline GPU machine needs for the check.

What goes in (≤ 60 MiB, so it travels beside the working tree under a 64 MiB carry limit):

- ``llama.cpp.tar.gz``: the pinned llama.cpp tree (vendored in the llama-cpp-python sdist) trimmed to what a
  CUDA build of the engine's tools needs: vocab and model files, docs, media, examples, tests, benches,
  conversion scripts, the web UI's sources and every ggml backend but CPU and CUDA are left out;
- ``wheels/``: the packages the GPU image lacks (optuna and its needs, gguf), for CPython 3.12 there, fetched
  here with ``pip download`` at the versions this venv runs;
- ``manifest.json``: what is in the pack, its sizes, the engine pin, and what was left out.

The tuner package itself is not packed: the working tree travels with every device call.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tuner.core.errors import UsageError
from tuner.engine import build, runner
from tuner.engine.kinds import LLAMA_CPP, EngineKind
from tuner.machine import paths
from tuner.machine.fileio import sha256_file

PACK_LIMIT_BYTES = 60 * 2**20
TREE_NAME = "llama.cpp.tar.gz"
MANIFEST = "manifest.json"
GPU_PYTHON = "3.12"  # the GPU image's python3
# Distributions the GPU image lacks (see the device notes): the check's optuna and gguf, and what they need
# beyond numpy, PyYAML, tqdm, packaging, requests, MarkupSafe and typing-extensions, which it has; and
# huggingface_hub 2.x with httpx2 (tuner.hub imports httpx2; the image's huggingface_hub 1.x has none), with
# the small pure-Python packages httpx2 needs at versions it accepts.
WHEELS = ("optuna", "alembic", "sqlalchemy", "mako", "colorlog", "gguf", "huggingface-hub", "httpx2", "httpcore2",
          "truststore", "anyio", "idna", "h11")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# Top-level entries of the llama.cpp tree a build needs; everything else is dropped.
KEEP_TOP = {"CMakeLists.txt", "CMakePresets.json", "LICENSE", "licenses", "cmake", "common", "ggml", "include",
            "src", "tools", "vendor", "app", "scripts", "grammars"}
# ggml backends kept (the others are only added when enabled).
KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda"}
# Inside tools/ui only the CMake glue: the UI is neither built nor downloaded (LLAMA_BUILD_UI=OFF,
# LLAMA_USE_PREBUILT_UI=OFF), so its sources, tests and lock files are not needed.
KEEP_UI = {"CMakeLists.txt", "sources.cmake", "ui.cpp.in", "ui.h.in"}


@dataclass(frozen=True, slots=True)
class PackResult:
    folder: Path
    total_bytes: int
    parts: dict[str, int]  # name -> bytes
    dropped_bytes: int  # uncompressed bytes of the tree left out
    kept_bytes: int  # uncompressed bytes of the tree kept
    missing_wheels: tuple[str, ...]


def keep_member(rel: str) -> bool:
    """Does the CUDA build of the engine's tools need this path of the llama.cpp tree?"""
    parts = rel.split("/")
    top = parts[0]
    if top not in KEEP_TOP:
        return False
    if top == "scripts":  # only CMake scripts (ui-assets.cmake, build info) are used by the build
        return len(parts) == 1 or rel.endswith(".cmake") or rel.endswith(".sh")
    if top == "ggml" and len(parts) >= 3 and parts[1] == "src" and parts[2].startswith("ggml-") \
            and (len(parts) > 3 or "." not in parts[2]):
        return parts[2] in KEEP_BACKENDS
    if top == "tools" and len(parts) >= 2 and parts[1] == "ui":
        return len(parts) == 2 or (len(parts) == 3 and parts[2] in KEEP_UI)
    # The tools' own test suites (Python, pytest) are not part of the build.
    return not (top == "tools" and len(parts) >= 3 and parts[2] == "tests")


def trim_sdist(sdist: Path, dest: Path) -> tuple[int, int]:
    """Write the trimmed llama.cpp tree of ``sdist`` to ``dest`` (tar.gz, paths relative to the tree root).

    Returns (kept, dropped) uncompressed bytes.
    """
    kept = dropped = 0
    prefix = None
    with tarfile.open(sdist) as src, tarfile.open(dest, "w:gz", compresslevel=9) as out:
        for member in src:
            if prefix is None:  # the sdist's top folder (llama_cpp_python-0.3.36/), not its .git/modules copy
                prefix = member.name.split("/")[0] + "/vendor/llama.cpp/"
            if not member.name.startswith(prefix) or len(member.name) <= len(prefix):
                continue
            rel = member.name[len(prefix):]
            if not (member.isfile() or member.isdir()) or not keep_member(rel):
                dropped += member.size
                continue
            member.name = rel
            # A long name travels in the member's PAX header ("path"), which tarfile writes back over .name:
            # without this, every path over 100 characters kept the sdist's prefix and landed outside the tree.
            member.pax_headers = {k: v for k, v in member.pax_headers.items() if k != "path"}
            kept += member.size
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
    if not kept:
        raise UsageError(f"{sdist} holds no vendor/llama.cpp tree: pass the llama-cpp-python sdist")
    return kept, dropped


def extract_tree(archive: Path, dest: Path) -> Path:
    """Unpack a trimmed tree written by :func:`trim_sdist` (the GPU side of the pack)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.10.12
            tar.extractall(dest)  # noqa: S202 - our own archive
    return dest


def local_sdist() -> Path:
    """The pinned sdist the engine build downloaded (checked against the pin), or a one-line fix."""
    path = paths.engine_root() / "src" / build.PIN.sdist_name
    if not path.is_file():
        raise UsageError(f"{path} not found: run `moe-tune engine install` once (it downloads the pinned "
                         "source), or pass --sdist PATH")
    if sha256_file(path) != build.PIN.sdist_sha256:
        raise UsageError(f"{path} does not match the engine pin: delete it and run `moe-tune engine install`")
    return path


def wheel_specs(names: Iterable[str] = WHEELS) -> list[str]:
    """``name==version`` for each, at the version this venv runs (so the GPU side runs what was tested)."""
    specs = []
    for name in names:
        try:
            specs.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            specs.append(name)
    return specs


def download_wheels(dest: Path, specs: list[str]) -> tuple[str, ...]:
    """``pip download`` each wheel for the GPU side's CPython; returns the specs no wheel was found for."""
    dest.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", GPU_PYTHON, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        base += ["--platform", p]
    missing = []
    for spec in specs:
        res = runner.run_process([*base, spec], timeout_s=300, what=f"pip download {spec}",
                                 fix="check that PyPI is reachable", check=False)
        if res.returncode != 0:
            missing.append(spec)
    return tuple(missing)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def make_pack(folder: Path, *, sdist: Path | None = None, wheels: bool = True,
              wheel_dir: Path | None = None) -> PackResult:
    """Fill ``folder`` with the trimmed tree, the wheels and a manifest; refuse a pack over 60 MiB.

    ``wheel_dir`` copies wheels already at hand instead of downloading (offline); ``wheels=False`` packs none.
    """
    folder.mkdir(parents=True, exist_ok=True)
    source = sdist or local_sdist()
    t0 = time.monotonic()
    kept, dropped = trim_sdist(source, folder / TREE_NAME)
    missing: tuple[str, ...] = ()
    wheel_folder = folder / "wheels"
    for old in wheel_folder.glob("*.whl"):  # two versions of one package stop the whole install there
        old.unlink()
    if wheel_dir is not None:
        wheel_folder.mkdir(exist_ok=True)
        for whl in sorted(wheel_dir.glob("*.whl")):
            (wheel_folder / whl.name).write_bytes(whl.read_bytes())
    elif wheels:
        missing = download_wheels(wheel_folder, wheel_specs())
    parts = {TREE_NAME: (folder / TREE_NAME).stat().st_size}
    if wheel_folder.is_dir():
        parts.update({f"wheels/{w.name}": w.stat().st_size for w in sorted(wheel_folder.glob("*.whl"))})
    manifest = {
        "pin": {"package": build.PIN.package, "version": build.PIN.version, "commit": build.PIN.commit},
        "sdist": {"name": source.name, "sha256": sha256_file(source)},
        "tree": {"kept_bytes": kept, "dropped_bytes": dropped, "keep_top": sorted(KEEP_TOP),
                 "backends": sorted(KEEP_BACKENDS)},
        "wheels_for": f"CPython {GPU_PYTHON}, {PLATFORMS[0]}", "missing_wheels": list(missing),
        "parts": parts, "tuner": "not packed: the working tree travels with the device call",
        "packed_in_s": round(time.monotonic() - t0, 1),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    total = _folder_bytes(folder)
    if total > PACK_LIMIT_BYTES:
        raise UsageError(f"the pack in {folder} is {total / 2**20:.1f} MiB, over the 60 MiB limit: "
                         "drop wheels (--no-wheels) or trim more")
    return PackResult(folder, total, parts, dropped, kept, missing)


def describe(res: PackResult) -> str:
    out = io.StringIO()
    out.write(f"pack {res.folder}: {res.total_bytes / 2**20:.2f} MiB of {PACK_LIMIT_BYTES / 2**20:.0f} MiB\n")
    out.write(f"  llama.cpp tree: kept {res.kept_bytes / 2**20:.1f} MiB, dropped {res.dropped_bytes / 2**20:.1f} "
              "MiB (uncompressed)\n")
    for name, size in res.parts.items():
        out.write(f"  {name}: {size / 2**20:.2f} MiB\n")
    if res.missing_wheels:
        out.write(f"  NO WHEEL FOUND for: {', '.join(res.missing_wheels)} (the GPU side cannot import them)\n")
    return out.getvalue()


def pack_engine(folder: Path, arch: str, bin_dir: Path | None = None,
                kind: EngineKind = LLAMA_CPP, stand_in: bool = False) -> dict[str, Any]:
    """The CUDA engine built here (``MOE_TUNE_CPU_ISA=avx2 MOE_TUNE_CUDA_ARCHS=arch moe-tune engine install --backend
    cuda``, with ``--engine ik`` for ik_llama.cpp's) into ``folder/engine`` (``folder/engine-ik``), as a lease brings
    one back: the lease restores it in seconds instead of building (lease 1: 263 s of its 900). Found among the
    managed builds by its identity (pin, flags built portable for the CPU, architecture, toolkit) unless ``bin_dir``
    names it; the toolkit's runtime and cuBLAS stay behind (the GPU machine has its own). ``stand_in``: the build at
    ``bin_dir`` (a CPU one) takes the CUDA engine's place for a rehearsal (``--rehearse``), and its pack says so."""
    from gpucheck import engine as gpu_engine

    want = gpu_engine.identity(arch, kind)
    if bin_dir is None:
        for candidate in build.managed_builds(kind):
            stamp = build.build_info(candidate)
            if stamp.get("identity") == want["cmake_flags"]:
                bin_dir = candidate
                break
    if bin_dir is None:
        engine = "" if kind is LLAMA_CPP else f" --engine {kind.key}"
        raise UsageError(f"no CUDA engine{engine and ' of ' + kind.name} for arch {arch} built here with this "
                         f"toolkit, portable for the CPU: run MOE_TUNE_CPU_ISA={gpu_engine.LEASE_ISA} "
                         f"MOE_TUNE_CUDA_ARCHS={arch} moe-tune engine install --backend cuda{engine} first (about 27 "
                         "min on 2 cores for llama.cpp's)")
    stamp = build.build_info(bin_dir)
    meta = {**want, "build": {"build_s": stamp.get("build_s"), "built_at": stamp.get("built_at"),
                              "where": "built before the lease (moe-tune engine install)"}}
    if stand_in:
        meta["stand_in"] = (f"the {stamp.get('backend', 'unknown')} build at {bin_dir} packed in the CUDA engine's "
                            "place for a rehearsal: no CUDA in it")
    return gpu_engine.pack(bin_dir, folder / gpu_engine.PACK_DIRS[kind.name], meta)
