"""Which CPU a managed build is made for (tuner/engine/cpu_isa.py): what the kernel grants, never CPUID, named in the
build's key on every architecture, and nothing of the host in a build that travels. The CPU is another machine's,
simulated where cpu_isa reads it: a FAKE /proc/cpuinfo (tests.fakes.FakeCpuInfo)."""

from __future__ import annotations

import platform

import pytest

from tests.fakes import (
    AVX2_CPU_FLAGS,
    NEOVERSE_N1_FEATURES,
    NEOVERSE_V1_FEATURES,
    ZEN4_CPU_FLAGS,
    FakeCpuInfo,
)
from tuner.engine import build, cpu_isa
from tuner.engine.kinds import IK_LLAMA

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)


def _arch_flags(flags: tuple[str, ...]) -> list[str]:
    return next(f for f in flags if f.startswith("-DGGML_ARCH_FLAGS=")).split("=", 1)[1].split(";")


def test_ik_is_built_for_what_the_kernel_grants_never_for_cpuid(tmp_path, monkeypatch):
    """Issue 67: ik_llama.cpp's native build read CPUID (-march=native), the source a VM may fill with features the
    kernel withholds (AMX here once: SIGILL). It now states the granted features' compiler options itself."""
    FakeCpuInfo(tmp_path / "zen4", ZEN4_CPU_FLAGS).install(monkeypatch)
    zen4 = build.cmake_flags(build.Backend.CPU, IK_LLAMA)
    zen4_key = build.build_identity(build.Backend.CPU, IK_LLAMA)
    assert "-DGGML_NATIVE=OFF" in zen4 and "native" not in " ".join(zen4).replace("GGML_NATIVE", "")
    opts = _arch_flags(zen4)
    # What ik's HAVE_FANCY_SIMD kernels need (iqk/iqk_config.h), which its own GGML_AVX512 option does not give.
    assert {"-mavx512f", "-mavx512vnni", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx512bf16"} <= set(opts)
    assert not any("amx" in o for o in opts)
    # A VM whose CPUID may say AVX-512 while the kernel grants AVX2 alone: AVX2 code only.
    FakeCpuInfo(tmp_path / "avx2", AVX2_CPU_FLAGS + " amx_tile_not_granted").install(monkeypatch)
    avx2 = _arch_flags(build.cmake_flags(build.Backend.CPU, IK_LLAMA))
    assert "-mavx2" in avx2 and "-mfma" in avx2 and not any(o.startswith("-mavx512") for o in avx2)
    assert build.build_identity(build.Backend.CPU, IK_LLAMA) != zen4_key


def test_arm_builds_are_keyed_by_the_features_the_kernel_grants(tmp_path, monkeypatch):
    """Off x86 the key read ``cpu_isa=unknown``: two ARM CPUs, one with SVE and one without, shared a build. Their
    ``Features`` line (the kernel's HWCAP names) now keys ik's build; llama.cpp's ARM build is the architecture's
    baseline (no x86 option, nothing of this host)."""
    FakeCpuInfo(tmp_path / "v1", NEOVERSE_V1_FEATURES, machine="aarch64").install(monkeypatch)
    v1 = build.build_identity(build.Backend.CPU, IK_LLAMA)
    v1_llama = build.build_identity(build.Backend.CPU)
    FakeCpuInfo(tmp_path / "n1", NEOVERSE_N1_FEATURES, machine="aarch64").install(monkeypatch)
    n1 = build.build_identity(build.Backend.CPU, IK_LLAMA)
    assert v1 != n1 and "sve" in v1[-1].split("=", 1)[1].split(",") and "sve" not in n1[-1]
    assert v1_llama == build.build_identity(build.Backend.CPU)  # portable there: one key for both
    assert not any(f.startswith(("-DGGML_AVX", "-DGGML_SSE", "-DGGML_ARCH_FLAGS")) for f in v1 + v1_llama)


def test_a_cpu_whose_features_cannot_be_read_keeps_its_builds_to_its_host(tmp_path, monkeypatch):
    FakeCpuInfo(tmp_path / "none", None).install(monkeypatch)
    assert cpu_isa.granted() == frozenset()
    assert cpu_isa.identity() == f"cpu_isa=unknown@{platform.node() or 'this-host'}/x86_64"
    assert build.cmake_flags(build.Backend.CPU)[-1] == "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"  # the build's defaults


def test_the_portable_build_carries_nothing_of_the_host(tmp_path, monkeypatch):
    FakeCpuInfo(tmp_path / "zen4", ZEN4_CPU_FLAGS).install(monkeypatch)
    monkeypatch.setenv(cpu_isa.ISA_ENV, cpu_isa.PORTABLE)
    zen4 = (build.build_identity(build.Backend.CPU), build.build_identity(build.Backend.CPU, IK_LLAMA))
    FakeCpuInfo(tmp_path / "avx2", AVX2_CPU_FLAGS).install(monkeypatch)
    assert zen4 == (build.build_identity(build.Backend.CPU), build.build_identity(build.Backend.CPU, IK_LLAMA))
    monkeypatch.delenv(cpu_isa.ISA_ENV)
    assert build.build_identity(build.Backend.CPU, isa=cpu_isa.PORTABLE) == zen4[0]  # the explicit choice, the same
    with pytest.raises(cpu_isa.UsageError, match="MOE_TUNE_CPU_ISA='avx512' is not known"):
        cpu_isa.mode("avx512")
