"""Which instruction sets a managed CPU build compiles for: the ones this CPU has and the kernel grants, so the two
engines race like for like.

llama.cpp's own build (``ggml/src/ggml-cpu/CMakeLists.txt``) turns ``GGML_NATIVE=ON`` into ``-march=native``, which
asks CPUID: on a Xeon VM of this project CPUID listed AMX, the compiler emitted it, and llama-server died with SIGILL
in ``ggml_backend_amx_mul_mat`` (``tilezero``) on a Q4_K_M model. ``GGML_NATIVE=OFF`` alone compiles AVX2 at most, so
on an AVX-512 machine llama.cpp ran prompts ~20 % slower than the same source built for the CPU, while ik_llama.cpp
(built native) did not (DESIGN §3). So llama.cpp's build states each x86 option the CPU grants (``/proc/cpuinfo``,
:func:`tuner.machine.hardware.cpu_flags`), and AMX never: its kernels (``ggml-cpu/amx/mmq.cpp``) serve only a few quant
types and are the part that faulted. ik_llama.cpp's tree uses no AMX and its explicit options stop at AVX512F/BW
(``ggml/src/CMakeLists.txt``), so it stays native; both keys carry the CPU's features, so a cached build is never
run on a CPU it was not made for.

``MOE_TUNE_CPU_ISA=avx2`` builds the portable baseline instead (the flags of builds before this module): for a build
that travels to another machine, such as a CUDA engine packed for a lent GPU.
"""

from __future__ import annotations

import os
import platform

from tuner.core.errors import UsageError
from tuner.machine import hardware

ISA_ENV = "MOE_TUNE_CPU_ISA"
NATIVE = "native"
PORTABLE = "avx2"

# llama.cpp's x86 options (ggml/CMakeLists.txt) and the /proc/cpuinfo flags each needs. GGML_AVX512 compiles
# -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw (ggml-cpu/CMakeLists.txt), so it needs all five.
GGML_X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
GGML_NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# The feature flags that name what a native build may use (the key of ik's build); others (bugs, power) do not.
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "bmi", "amx", "vaes", "gfni", "vpclmul", "sha", "adx", "movbe")


def mode() -> str:
    """``native`` (default) or ``avx2``, from ``MOE_TUNE_CPU_ISA``; anything else is refused naming both."""
    chosen = (os.environ.get(ISA_ENV) or NATIVE).strip().lower()
    if chosen not in (NATIVE, PORTABLE):
        raise UsageError(f"{ISA_ENV}={chosen!r} is not known: use {NATIVE} (this CPU's own instruction sets) or "
                         f"{PORTABLE} (a portable build for another machine)")
    return chosen


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def granted() -> frozenset[str]:
    """This CPU's instruction-set features as the kernel grants them (empty off x86 or without /proc/cpuinfo)."""
    if not _x86():
        return frozenset()
    return frozenset(f for f in hardware.cpu_flags() if f.startswith(_ISA_PREFIXES))


def llama_cpp_flags(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """llama.cpp's ISA options for this CPU: every x86 option stated ON or OFF, AMX OFF. Empty in ``avx2`` mode
    and where nothing is known (the build's own defaults: AVX2 at most on x86, the compiler's on ARM)."""
    have = granted() if flags is None else flags
    if mode() == PORTABLE or not have:
        return ()
    out = [f"-D{opt}={'ON' if all(f in have for f in needs) else 'OFF'}" for opt, needs in GGML_X86_OPTIONS]
    return (*out, *(f"-D{opt}=OFF" for opt in GGML_NEVER))


def native_allowed() -> bool:
    """Whether a tree built with ``-march=native`` (ik_llama.cpp's) may be: not in ``avx2`` mode."""
    return mode() == NATIVE


def identity(flags: frozenset[str] | None = None) -> str:
    """The CPU a native build is made for, as part of its cache key."""
    have = granted() if flags is None else flags
    return "cpu_isa=" + (",".join(sorted(have)) or "unknown")
