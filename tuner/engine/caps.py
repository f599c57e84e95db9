"""Where an engine's binaries are and what they accept: the two values every engine module passes around
(and, for a CUDA build, which K/V pairs its flash-attention vector kernels cover).

They live below ``build`` (which finds and builds engines) and ``flags`` (which spells a config for a binary's
capabilities), so that neither has to import the other: runner → flags → caps ← build.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from tuner.core.errors import EngineNotFoundError
from tuner.engine.identity import EngineIdentity
from tuner.engine.kinds import EngineKind, kind_of_flags


class Backend(str, Enum):
    """Which backend a managed build compiles (``moe-tune engine install --backend``)."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class CudaSource(str, Enum):
    """Where a CUDA build takes its toolkit from (``MOE_TUNE_CUDA_FROM``, ``engine install --cuda-from``; see
    :mod:`tuner.engine.cuda_wheels`)."""

    AUTO = "auto"
    INSTALLED = "installed"
    WHEELS = "wheels"


@dataclass(frozen=True, slots=True)
class EngineLocation:
    bin_dir: Path
    source: str  # "option" | "env" | "path" | "managed"

    def tool(self, name: str) -> Path:
        path = self.bin_dir / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EngineNotFoundError(name, [str(self.bin_dir)])
        return path

    def has(self, name: str) -> bool:
        path = self.bin_dir / name
        return path.is_file() and os.access(path, os.X_OK)


# ------------------------------------------------------------------- what a build's tools print about it

# "version: 0.5.0-dev (build 1, commit <hash>)" now; "version: 6500 (<hash>)" in older builds.
_VERSION_RE = re.compile(r"version:\s*(\S+)\s*\(build\s+(\d+),\s*commit\s+([0-9a-fA-F]+|unknown)\)")
# ``version: 0 (ik-llama-cpp-python-0.1.5)``: ik_llama.cpp's server, its commit the source label of a build from an
# sdist (tuner.engine.sdist) or a git hash.
_OLD_VERSION_RE = re.compile(r"version:\s*(\d+)\s*\(([0-9A-Za-z][0-9A-Za-z._+-]*)\)")
_FLAG_RE = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")
_DEVICE_RE = re.compile(r"^\s*([A-Za-z]+)(\d+):\s*(.+)$")


def parse_version(text: str) -> tuple[str, str, str]:
    """(version, build number, commit) from ``llama-bench --version``."""
    match = _VERSION_RE.search(text)
    if match:
        return match.group(1), match.group(2), match.group(3)
    old = _OLD_VERSION_RE.search(text)
    if old:
        return old.group(1), old.group(1), old.group(2)
    return "unknown", "unknown", "unknown"


def parse_help_flags(text: str) -> tuple[str, ...]:
    """Flags a binary accepts, read from the option column of its --help."""
    flags: set[str] = set()
    for line in text.splitlines():
        stripped = line.lstrip()
        if not stripped.startswith("-"):
            continue
        # Aliases are separated by a comma and padding ("-fa,   --flash-attn"); the option column ends where
        # two spaces start the description.
        column = re.split(r"\s{2,}", re.sub(r",\s+", ", ", stripped), maxsplit=1)[0]
        flags.update(_FLAG_RE.findall(column))
    return tuple(sorted(flags))


def parse_devices(text: str) -> tuple[str, ...]:
    devices = []
    for line in text.splitlines():
        match = _DEVICE_RE.match(line)
        if match and match.group(1).upper() in {"CUDA", "VULKAN", "METAL", "ROCM", "HIP", "SYCL", "CPU", "BLAS", "RPC"}:
            devices.append(f"{match.group(1)}{match.group(2)}: {match.group(3).strip()}")
    return tuple(devices)


# ggml_cuda_init (ggml-cuda.cu), as ik_llama.cpp's server prints it at start-up:
# "  Device 0: NVIDIA H200, compute capability 9.0, VMM: yes, VRAM: 143167 MiB".
_CUDA_INIT_RE = re.compile(r"^\s*Device (\d+): ([^,\n]+), compute capability", re.MULTILINE)


def parse_cuda_init(text: str) -> tuple[str, ...]:
    """CUDA devices from a start-up log (for a server with no ``--list-devices``), in that list's spelling."""
    return tuple(f"CUDA{n}: {name.strip()}" for n, name in _CUDA_INIT_RE.findall(text))


def backend_of(devices: tuple[str, ...], bin_dir: Path) -> str:
    for name in ("CUDA", "Vulkan", "Metal", "ROCm", "HIP", "SYCL"):
        if any(d.upper().startswith(name.upper()) for d in devices):
            return name.lower()
    if any(bin_dir.glob("libggml-cuda*")):
        return "cuda"
    return "cpu"


# --------------------------------------------------------------------- flash-attention vector kernels (CUDA)

# The K/V types a CUDA build can compile a flash-attention vector kernel for (``FA_TYPES`` in the pinned
# ggml/cmake/common.cmake, ``ggml_cuda_fattn_vec_instances``).
FA_VEC_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "bf16", "f16")
# What a CUDA build compiles when GGML_CUDA_FA_QUANTS is left at its default (ggml/CMakeLists.txt at the pin).
FA_QUANTS_DEFAULT = ("q4_0-q4_0", "q8_0-q8_0", "f16-f16", "bf16-bf16")
# Builds from before GGML_CUDA_FA_QUANTS (GGML_CUDA_FA_ALL_QUANTS off) had these same-type kernels only.
FA_PAIRS_BEFORE_FA_QUANTS = ("f16-f16", "q4_0-q4_0", "q8_0-q8_0")
FA_VEC_FLAG = "GGML_CUDA_FA_QUANTS"

# llama.cpp's system info (``llama_print_system_info``: ``CUDA : ARCHS = 890 | FA_QUANTS = q4_0-q4_0,… | …``).
_FA_QUANTS_RE = re.compile(r"\bFA_QUANTS\s*=\s*([^|\n]*)")
_FA_ALL_RE = re.compile(r"\bFA_ALL_QUANTS\s*=\s*1\b")
_CUDA_SECTION_RE = re.compile(r"\bCUDA\s*:")
# ``ggml_cuda_flash_attn_ext_vec`` (ggml-cuda/fattn.cu) when a pair has no kernel:
# "no FlashAttention vector kernel compiled for K/V types f16-q8_0, converting K and V to f16 instead (slow)."
_NO_VEC_KERNEL_RE = re.compile(r"no FlashAttention vector kernel compiled for K/V types ([a-z0-9_]+)-([a-z0-9_]+)")


def fa_pair(type_k: str, type_v: str) -> str:
    """A K/V pair in GGML_CUDA_FA_QUANTS's spelling: ``<type_K>-<type_V>``."""
    return f"{type_k}-{type_v}"


@dataclass(frozen=True, slots=True)
class FaKernels:
    """Which K/V type pairs an engine has a flash-attention vector kernel for: the kernel that generates tokens.

    A CUDA build compiles one only for the pairs of ``GGML_CUDA_FA_QUANTS``; for any other pair
    ``ggml_cuda_flash_attn_ext_vec`` converts the whole K and V cache to f16 at every step, so a trial would
    measure that conversion, not the pair. ``pairs`` None: every pair runs its own kernel (CPU, or a build
    that compiled them all). ``source`` says how it was learnt; ``missing`` holds pairs the engine's own log
    said it lacks (learnt at run time, for builds whose system info does not list them).
    """

    pairs: tuple[str, ...] | None = None
    source: str = "not a CUDA build: every pair has its kernel"
    missing: tuple[str, ...] = ()

    def has(self, type_k: str, type_v: str) -> bool:
        pair = fa_pair(type_k, type_v)
        return pair not in self.missing and (self.pairs is None or pair in self.pairs)

    def why_missing(self, type_k: str, type_v: str) -> str:
        """Why the pair is left out, naming the build flag that adds it."""
        pair = fa_pair(type_k, type_v)
        seen = "its log said so" if pair in self.missing else self.source
        return (f"K/V {type_k}/{type_v} left out: this CUDA build has no flash-attention vector kernel for it "
                f"({seen}), so llama.cpp would convert the cache to f16 at every token; rebuild with "
                f"-D{FA_VEC_FLAG}=<its list>,{pair} (or {FA_VEC_FLAG}=all), e.g. `moe-tune engine install "
                "--backend cuda --force`, which builds every pair the search tries")

    def learn_from_log(self, text: str) -> FaKernels:
        """These kernels, less the pairs the engine's log says it has no vector kernel for."""
        found = tuple(fa_pair(k, v) for k, v in (*_NO_VEC_KERNEL_RE.findall(text), *_IK_NO_PAIR_RE.findall(text)))
        new = tuple(p for p in dict.fromkeys(found) if p not in self.missing)
        return FaKernels(self.pairs, self.source, self.missing + new) if new else self


# ik_llama.cpp's CPU flash attention (ggml/src/iqk/iqk_flash_attn.cpp, ``supported_kv_types``): f16 and q8_0 of the
# types this project searches; q4_0, q4_1 and iq4_nl with GGML_IQK_FA_ALL_QUANTS (its default); bf16 only as
# bf16/bf16 on a CPU with AVX512_BF16. Any other pair aborts the process.
IK_FA_TYPES = ("f16", "q8_0")
IK_FA_ALL_QUANTS_TYPES = ("q4_0", "q4_1", "iq4_nl")
_IK_NO_PAIR_RE = re.compile(r"K cache (\w+) coupled with V cache (\w+) is not a supported combination")


def ik_fa_kernels(startup: str, backend: str = "cpu", all_quants: bool = True) -> FaKernels:
    """The K/V pairs ik_llama.cpp's CPU flash attention runs. Its system info does not say whether the build has
    GGML_IQK_FA_ALL_QUANTS: ``all_quants`` is its default (on), and a pair its log refuses is learnt then."""
    if backend != "cpu":
        return FaKernels(None, "ik_llama.cpp on a GPU: pairs learnt from its log")
    types = IK_FA_TYPES + (IK_FA_ALL_QUANTS_TYPES if all_quants else ())
    pairs = [fa_pair(k, v) for k in types for v in types]
    if re.search(r"AVX512_BF16 = 1", startup):
        pairs.append("bf16-bf16")
    why = "GGML_IQK_FA_ALL_QUANTS on" if all_quants else "GGML_IQK_FA_ALL_QUANTS off"
    return FaKernels(tuple(pairs), f"ik_llama.cpp's CPU flash attention ({why}; iqk_flash_attn.cpp)")


def fa_kernels_from_system_info(text: str, backend: str) -> FaKernels:
    """The vector-kernel pairs of an engine, from the system info line its tools print (``-lv 4``).

    ``FA_QUANTS`` is the build's GGML_CUDA_FA_QUANTS with ``;`` written as ``,`` (``ggml_backend_cuda_get_features``),
    and ``f16-f16`` is always compiled beside it (``ggml_cuda_fattn_vec_instances``); ``all`` compiles every pair.
    A CUDA build that names neither predates the list: its default was the same-type f16, q4_0 and q8_0 kernels.
    """
    if backend != "cuda" and not _CUDA_SECTION_RE.search(text):
        return FaKernels()
    listed = _FA_QUANTS_RE.search(text)
    if listed:
        value = listed.group(1).strip().strip('"').lower()
        if value == "all":
            return FaKernels(None, f"{FA_VEC_FLAG}=all: every pair compiled")
        pairs = [p.strip() for p in re.split(r"[,;]", value) if p.strip()]
        return FaKernels(tuple(dict.fromkeys(["f16-f16", *pairs])),
                         f"{FA_VEC_FLAG}={','.join(pairs)} in the build's system info")
    if _FA_ALL_RE.search(text):
        return FaKernels(None, "GGML_CUDA_FA_ALL_QUANTS=ON: every pair compiled")
    return FaKernels(FA_PAIRS_BEFORE_FA_QUANTS,
                     f"the build's system info names no {FA_VEC_FLAG}: builds of that age compile "
                     f"{', '.join(FA_PAIRS_BEFORE_FA_QUANTS)} only")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one engine build is (version, commit, backend, devices) and which flags each of its tools accepts,
    read from ``--version``, ``--list-devices`` and ``--help``, and for a CUDA build its flash-attention vector
    kernels, read from its system info (see :func:`tuner.engine.build.capabilities`)."""

    version: str
    build_number: str
    commit: str
    backend: str
    devices: tuple[str, ...]
    flags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Which K/V pairs have a flash-attention vector kernel (CUDA builds compile a list: see FaKernels).
    fa_kernels: FaKernels = field(default_factory=FaKernels)

    def supports(self, tool: str, flag: str) -> bool:
        return flag in self.flags.get(tool, ())

    @property
    def kind(self) -> EngineKind:
        """llama.cpp or ik_llama.cpp, known by the flags its tools list (:func:`tuner.engine.kinds.kind_of_flags`)."""
        return kind_of_flags(self.flags)

    @property
    def identity(self) -> EngineIdentity:
        """Which build this is, in the one spelling every output uses (:mod:`tuner.engine.identity`)."""
        pairs = self.fa_kernels.pairs
        return EngineIdentity(self.commit, self.version, self.build_number, self.backend,
                              ";".join(pairs) if pairs else None, self.kind.name)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Capabilities:
        """Read back from ``asdict``'s JSON; a KeyError for one written before a field existed (read it again)."""
        fa = raw["fa_kernels"]
        return cls(raw["version"], raw["build_number"], raw["commit"], raw["backend"], tuple(raw["devices"]),
                   {k: tuple(v) for k, v in raw["flags"].items()},
                   FaKernels(None if fa["pairs"] is None else tuple(fa["pairs"]), fa["source"], tuple(fa["missing"])))
