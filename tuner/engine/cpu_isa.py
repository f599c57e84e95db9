"""Which instruction sets a managed CPU build compiles for: the ones this CPU has and the kernel grants, so the two
engines race like for like, and a build is never run on a CPU it was not made for.

llama.cpp's own build (``ggml/src/ggml-cpu/CMakeLists.txt``) turns ``GGML_NATIVE=ON`` into ``-march=native``, which
asks CPUID: on a Xeon VM of this project CPUID listed AMX, the compiler emitted it, and llama-server died with SIGILL
in ``ggml_backend_amx_mul_mat`` (``tilezero``) on a Q4_K_M model. ``GGML_NATIVE=OFF`` alone compiles AVX2 at most, so
on an AVX-512 machine llama.cpp ran prompts ~20 % slower than the same source built for the CPU (DESIGN §3). So
llama.cpp's build states each x86 option the CPU grants (``/proc/cpuinfo``, :func:`tuner.machine.hardware.cpu_flags`),
and AMX never: its kernels (``ggml-cpu/amx/mmq.cpp``) serve only a few quant types and are the part that faulted.
ik_llama.cpp's explicit options stop at ``-mavx512f -mavx512bw`` (``ggml/src/CMakeLists.txt``), short of the VL/DQ its
``HAVE_FANCY_SIMD`` kernels need (``iqk/iqk_config.h``), so its build takes ``GGML_NATIVE=OFF`` and the compiler
options of every granted feature through ``GGML_ARCH_FLAGS`` instead of ``-march=native``: the same code a native
build makes where CPUID and the kernel agree, none the kernel withholds where they do not.

Both keys carry what the build was made for: llama.cpp's its stated options, ik's the granted features
(:func:`identity`); on a CPU whose features cannot be read, the key names the host, so a cache shared between
machines never hands one's build to another. A build made elsewhere (the user's own) is caught when it dies of an
illegal instruction (:mod:`tuner.core.errors`, ``ProcessFailedError``).

``MOE_TUNE_CPU_ISA=avx2`` builds the portable baseline instead (the flags of builds before this module): for a build
that travels to another machine, such as the CUDA engines a GPU lease carries (``scripts/gpucheck/engine.py``
passes it explicitly: ``isa=PORTABLE``).
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
# ik_llama.cpp's explicit x86 options (ggml/CMakeLists.txt): stated OFF, so GGML_ARCH_FLAGS alone says what is used.
IK_X86_OPTIONS = ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512", "GGML_AVX512_VBMI",
                  "GGML_AVX512_VNNI", "GGML_AVX512_BF16")
# /proc/cpuinfo's name of each feature and gcc's option for it (gcc >= 11; clang takes the same spellings). What
# -march=native turns on that ggml's code (and the compiler's vectoriser) can use; AMX never (see above).
GCC_OPTIONS: tuple[tuple[str, str], ...] = (
    ("pni", "-msse3"), ("ssse3", "-mssse3"), ("sse4_1", "-msse4.1"), ("sse4_2", "-msse4.2"), ("sse4a", "-msse4a"),
    ("popcnt", "-mpopcnt"), ("avx", "-mavx"), ("avx2", "-mavx2"), ("fma", "-mfma"), ("f16c", "-mf16c"),
    ("bmi1", "-mbmi"), ("bmi2", "-mbmi2"), ("abm", "-mlzcnt"), ("movbe", "-mmovbe"), ("aes", "-maes"),
    ("pclmulqdq", "-mpclmul"), ("sha_ni", "-msha"), ("adx", "-madx"), ("gfni", "-mgfni"), ("vaes", "-mvaes"),
    ("vpclmulqdq", "-mvpclmulqdq"), ("avx_vnni", "-mavxvnni"), ("avx512f", "-mavx512f"), ("avx512cd", "-mavx512cd"),
    ("avx512vl", "-mavx512vl"), ("avx512dq", "-mavx512dq"), ("avx512bw", "-mavx512bw"),
    ("avx512ifma", "-mavx512ifma"), ("avx512vbmi", "-mavx512vbmi"), ("avx512_vbmi2", "-mavx512vbmi2"),
    ("avx512_vnni", "-mavx512vnni"), ("avx512_bitalg", "-mavx512bitalg"),
    ("avx512_vpopcntdq", "-mavx512vpopcntdq"), ("avx512_bf16", "-mavx512bf16"),
)
# The x86 feature flags that name what a build may use (the key of ik's build); others (bugs, power) do not.
_ISA_PREFIXES = ("pni", "popcnt", "abm", "aes", "pclmul", "sse", "ssse", "avx", "fma", "f16c", "bmi", "amx", "vaes",
                 "gfni", "vpclmul", "sha", "adx", "movbe")


def mode(isa: str | None = None) -> str:
    """``native`` (default) or ``avx2``: ``isa`` when given, else ``MOE_TUNE_CPU_ISA``; anything else is refused
    naming both."""
    chosen = (isa or os.environ.get(ISA_ENV) or NATIVE).strip().lower()
    if chosen not in (NATIVE, PORTABLE):
        raise UsageError(f"{ISA_ENV}={chosen!r} is not known: use {NATIVE} (this CPU's own instruction sets) or "
                         f"{PORTABLE} (a portable build for another machine)")
    return chosen


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def granted() -> frozenset[str]:
    """This CPU's instruction-set features as the kernel grants them: on x86 the ISA flags of ``/proc/cpuinfo``;
    elsewhere every feature it lists (ARM's ``Features`` line is the kernel's HWCAP list: asimd, sve, i8mm, …).
    Empty where nothing can be read (no /proc/cpuinfo)."""
    have = hardware.cpu_flags()
    return frozenset(f for f in have if f.startswith(_ISA_PREFIXES)) if _x86() else have


def llama_cpp_flags(isa: str | None = None) -> tuple[str, ...]:
    """llama.cpp's ISA options for this CPU: every x86 option stated ON or OFF, AMX OFF. Empty in ``avx2`` mode and
    off x86 or where nothing is known (the build's own defaults with GGML_NATIVE=OFF: AVX2 at most on x86, the
    architecture's baseline elsewhere: nothing of this host in either)."""
    if mode(isa) == PORTABLE or not _x86():
        return ()
    have = granted()
    if not have:
        return ()
    out = [f"-D{opt}={'ON' if all(f in have for f in needs) else 'OFF'}" for opt, needs in GGML_X86_OPTIONS]
    return (*out, *(f"-D{opt}=OFF" for opt in GGML_NEVER))


def ik_flags(isa: str | None = None) -> tuple[str, ...]:
    """ik_llama.cpp's ISA options: portable, ``GGML_NATIVE=OFF`` (its AVX2 defaults); on x86 with the features known,
    ``GGML_NATIVE=OFF``, its own options OFF and every granted feature's compiler option in ``GGML_ARCH_FLAGS`` (never
    CPUID's ``-march=native``); off x86 ``GGML_NATIVE=ON`` (its tree sets no ``-mcpu=native`` for ARM: the baseline
    and the build's own checks)."""
    if mode(isa) == PORTABLE:
        return ("-DGGML_NATIVE=OFF",)
    have = granted()
    if not _x86() or not have:
        return ("-DGGML_NATIVE=ON",)
    options = [opt for feature, opt in GCC_OPTIONS if feature in have]
    return ("-DGGML_NATIVE=OFF", *(f"-D{opt}=OFF" for opt in IK_X86_OPTIONS), f"-DGGML_ARCH_FLAGS={';'.join(options)}")


def made_for_this_cpu(isa: str | None = None) -> bool:
    """Whether a build in this mode carries code for this CPU alone (its key must then name the CPU)."""
    return mode(isa) == NATIVE


def identity() -> str:
    """The CPU a build is made for, as part of its cache key: the granted features; where none can be read, the
    host, so that builds are not shared between machines whose CPUs nobody knows."""
    have = granted()
    if have:
        return "cpu_isa=" + ",".join(sorted(have))
    return f"cpu_isa=unknown@{platform.node() or 'this-host'}/{platform.machine() or 'unknown'}"
