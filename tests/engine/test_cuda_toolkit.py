"""nvcc where the toolkit put it, the backend `engine install` chooses and why, the CUDA architecture from the
card. Uses this machine's real CUDA toolkit (/usr/local/cuda, nvcc 13 off PATH's own folders) where it is
there; the card is the FAKE desktop of :mod:`tests.desktop` (NVML boundary)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.desktop import desktop
from tests.fakes import FakeNVML
from tuner.core.errors import BuildToolMissingError, EngineError, UsageError
from tuner.engine import build, cuda_toolkit, cuda_wheels
from tuner.machine import hardware, paths

pytestmark = pytest.mark.fast
REAL_NVCC = Path("/usr/local/cuda/bin/nvcc")
needs_toolkit = pytest.mark.skipif(not REAL_NVCC.is_file(), reason="no CUDA toolkit in /usr/local/cuda here")


def _no_nvcc_on_path(monkeypatch, tmp_path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir(exist_ok=True)
    for tool in ("cmake", "c++", "cc", "as", "ld", "make", "sh"):  # the rest of a build machine stays; nvcc goes
        found = shutil.which(tool)
        if found and not (bare / tool).exists():
            (bare / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bare))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    cuda_toolkit.find_toolkit.cache_clear()


@needs_toolkit
def test_nvcc_off_path_is_found_where_the_toolkit_put_it(monkeypatch, tmp_path):
    _no_nvcc_on_path(monkeypatch, tmp_path)
    tk = cuda_toolkit.find_toolkit()
    assert tk is not None and tk.nvcc == REAL_NVCC and tk.found_in == "/usr/local/cuda/bin"
    assert tk.version >= (12, 0) and (tk.root / "bin" / "nvcc").is_file()
    assert tk.library("cudart") is not None  # the root came from nvcc itself, with its library folders
    monkeypatch.setenv("CUDA_HOME", str(tk.root))
    cuda_toolkit.find_toolkit.cache_clear()
    assert cuda_toolkit.find_toolkit().found_in == "CUDA_HOME"
    cuda_toolkit.find_toolkit.cache_clear()


def test_no_toolkit_anywhere_says_where_it_looked(monkeypatch, tmp_path):
    _no_nvcc_on_path(monkeypatch, tmp_path)
    monkeypatch.setattr(hardware, "NVCC_DIRS", (tmp_path / "nowhere",))
    assert cuda_toolkit.find_toolkit() is None
    monkeypatch.setenv("MOE_TUNE_CUDA_FROM", "installed")  # auto would take NVIDIA's wheels instead
    with pytest.raises(BuildToolMissingError, match=r"looked in PATH, \$CUDA_HOME/bin, \$CUDA_PATH/bin, .*nowhere\)"):
        build._check_build_tools(build.Backend.CUDA)
    cuda_toolkit.find_toolkit.cache_clear()


def _fake_driver(monkeypatch, nvml) -> None:
    monkeypatch.setattr(hardware, "_load_nvml", lambda: nvml)


@needs_toolkit
def test_auto_chooses_cuda_on_a_desktop_with_the_toolkit_off_path_and_says_why(monkeypatch, tmp_path):
    _no_nvcc_on_path(monkeypatch, tmp_path)
    monkeypatch.delenv("MOE_TUNE_CUDA_ARCHS", raising=False)
    with desktop(tmp_path) as d:
        _fake_driver(monkeypatch, d.nvml())
        backend, why = build.backend_choice(build.Backend.AUTO)
        assert backend is build.Backend.CUDA
        assert why.startswith("an NVIDIA GeForce RTX 3090 is here; nvcc ") and "/usr/local/cuda/bin" in why
        # The architecture is the card's compute capability (8.6), not "native" (which needs a GPU at configure).
        assert "-DCMAKE_CUDA_ARCHITECTURES=86" in build.cmake_flags(build.Backend.CUDA)
    cuda_toolkit.find_toolkit.cache_clear()


def test_without_a_toolkit_auto_takes_nvidias_wheels_where_the_driver_runs_cuda_13(monkeypatch, tmp_path):
    """No nvcc anywhere: a card whose driver runs CUDA 13 (580+, NVML's 13000) gets a CUDA build from NVIDIA's
    wheels; an older driver (570: 12.8) or a card older than Turing stays on the CPU, told why and what to do; so
    does `--cuda-from installed`. No GPU at all: the CPU, as before."""
    _no_nvcc_on_path(monkeypatch, tmp_path)
    monkeypatch.setattr(hardware, "NVCC_DIRS", ())
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    card = [("NVIDIA GeForce RTX 4060 Ti", 16 * 2**30, 2**30)]
    _fake_driver(monkeypatch, FakeNVML(card, driver="580.95.05", cuda_driver=13000, compute_capability=(8, 9)))
    backend, why = build.backend_choice(build.Backend.AUTO)
    assert backend is build.Backend.CUDA and "CUDA 13.5 from NVIDIA's wheels" in why
    monkeypatch.setenv("MOE_TUNE_CUDA_FROM", "installed")
    backend, why = build.backend_choice(build.Backend.AUTO)
    assert backend is build.Backend.CPU
    assert "an NVIDIA GeForce RTX 4060 Ti is here but no CUDA toolkit" in why and "CUDA_HOME" in why
    with pytest.raises(BuildToolMissingError, match="--cuda-from wheels"):
        build._check_build_tools(build.Backend.CUDA)
    monkeypatch.delenv("MOE_TUNE_CUDA_FROM")
    _fake_driver(monkeypatch, FakeNVML(card, cuda_driver=12080))
    backend, why = build.backend_choice(build.Backend.AUTO)
    assert backend is build.Backend.CPU and "runs CUDA up to 12.8" in why and "580 or newer" in why
    with pytest.raises(BuildToolMissingError, match="CUDA 12 wheels carry no nvcc"):
        build._check_build_tools(build.Backend.CUDA)
    _fake_driver(monkeypatch, FakeNVML([("NVIDIA GeForce GTX 1080 Ti", 11 * 2**30, 2**30)], cuda_driver=13000,
                                       compute_capability=(6, 1)))
    assert "compute capability 6.1 is older than Turing" in build.backend_choice(build.Backend.AUTO)[1]
    _fake_driver(monkeypatch, FakeNVML(init_error="NVML Shared Library Not Found"))
    assert build.backend_choice(build.Backend.AUTO) == (build.Backend.CPU, "no NVIDIA GPU found (NVML lists none)")
    cuda_toolkit.find_toolkit.cache_clear()


def test_building_for_another_machine_checks_the_architectures_asked_for(monkeypatch):
    monkeypatch.setattr(hardware, "_load_nvml", lambda: FakeNVML(init_error="no driver"))
    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "90")
    assert cuda_wheels.blocker() is None
    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "86;70-real")
    assert "compute capability 7.0 is older than Turing" in (cuda_wheels.blocker() or "")
    monkeypatch.setenv("MOE_TUNE_CUDA_FROM", "conda")
    with pytest.raises(UsageError, match="MOE_TUNE_CUDA_FROM='conda' is not a CUDA source: use auto, installed or "
                                         "wheels"):
        cuda_wheels.source()


@needs_toolkit
def test_the_installed_toolkit_and_the_wheels_make_two_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "90")
    monkeypatch.setenv("MOE_TUNE_CUDA_FROM", "installed")
    installed = build._build_key(build.Backend.CUDA)
    assert build.build_identity(build.Backend.CUDA)[-1].startswith("toolkit=installed-13")
    monkeypatch.setenv("MOE_TUNE_CUDA_FROM", "wheels")
    assert build.build_identity(build.Backend.CUDA)[-1] == "toolkit=wheels-13.5"
    assert build._build_key(build.Backend.CUDA) != installed
    assert build.cmake_flags(build.Backend.CUDA) == build.build_identity(build.Backend.CUDA)[:-1]
    cuda_toolkit.find_toolkit.cache_clear()


def _pinned_driver_calls() -> set[str]:
    """The driver API functions the pinned ggml-cuda calls (``cuMemCreate`` …), read from the engine's source."""
    sdist = paths.engine_root() / "src" / build.PIN.sdist_name
    if not sdist.is_file():
        pytest.skip("no pinned source here: run `moe-tune engine install` once")
    calls: set[str] = set()
    with tarfile.open(sdist) as tar:
        for member in tar:
            if "/ggml/src/ggml-cuda/" in member.name and member.name.endswith((".cu", ".cuh")) and member.isfile():
                text = tar.extractfile(member).read().decode(errors="replace")  # type: ignore[union-attr]
                calls |= set(re.findall(r"\b(cu[A-Z][a-z][A-Za-z0-9_]*)\s*\(", text))  # not cuBLAS
    return calls


@needs_toolkit
def test_the_driver_stub_defines_every_driver_call_of_the_pinned_engine(monkeypatch, tmp_path):
    """VMM links the driver library (ggml-cuda's CMakeLists: CUDA::cuda_driver). Neither this toolkit nor NVIDIA's
    wheels carry one, so the build links a stub made from the toolkit's cuda.h: it must define every driver call
    the pinned source makes, answer CUDA_ERROR_STUB_LIBRARY, and carry the driver's soname, which the loader then
    resolves to the real driver on a GPU machine."""
    cuda_toolkit.find_toolkit.cache_clear()
    calls = _pinned_driver_calls()
    assert {"cuMemCreate", "cuMemMap", "cuMemAddressReserve", "cuDeviceGetAttribute"} <= calls
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    tk = cuda_toolkit.find_toolkit()
    assert tk is not None
    stub = cuda_toolkit.driver_stub(tk)
    lib = ctypes.CDLL(str(stub))
    for name in sorted(calls):
        assert getattr(lib, name)() == cuda_toolkit.CUDA_ERROR_STUB_LIBRARY, name
    dynamic = subprocess.run(["readelf", "-d", str(stub)], capture_output=True, text=True, check=True).stdout
    assert "Library soname: [libcuda.so.1]" in dynamic
    assert os.readlink(stub.parent / "libcuda.so.1") == "libcuda.so"
    driver, made = cuda_toolkit.link_driver(tk)
    if cuda_toolkit.driver_library(tk) is None:
        assert made and driver == stub
    flags = cuda_toolkit.cmake_flags(tk, "90", None, driver)
    assert "-DGGML_CUDA_NO_VMM=ON" not in flags and f"-DCUDA_cuda_driver_LIBRARY={driver}" in flags
    (exe,) = [f for f in flags if f.startswith("-DCMAKE_EXE_LINKER_FLAGS=-Wl,")]
    assert exe.startswith(f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,{driver.parent},")
    cuda_toolkit.find_toolkit.cache_clear()


def test_the_architecture_needs_a_card_or_the_variable(monkeypatch):
    monkeypatch.delenv("MOE_TUNE_CUDA_ARCHS", raising=False)
    assert cuda_toolkit.architectures(FakeNVML([("NVIDIA GeForce RTX 4090", 24 * 2**30, 0)],
                                               compute_capability=(8, 9))) == "89"
    with pytest.raises(BuildToolMissingError, match="set MOE_TUNE_CUDA_ARCHS"):
        cuda_toolkit.architectures(FakeNVML(init_error="no driver"))
    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "120")
    assert cuda_toolkit.architectures(FakeNVML(init_error="no driver")) == "120"


@needs_toolkit
def test_a_minimal_toolkit_gets_cublas_from_the_wheel(monkeypatch, tmp_path):
    """What this machine's toolkit lacks is what the configure flags add (read from the toolkit, not assumed)."""
    _no_nvcc_on_path(monkeypatch, tmp_path)
    tk = cuda_toolkit.find_toolkit()
    assert tk is not None
    has_cublas = tk.library("cublas") is not None
    fake_cublas = tmp_path / "cublas"
    (fake_cublas / "lib").mkdir(parents=True)
    for name in ("libcublas.so.13", "libcublasLt.so.13"):
        (fake_cublas / "lib" / name).write_bytes(b"")
    flags = cuda_toolkit.cmake_flags(tk, "86", None if has_cublas else fake_cublas, None)
    assert "-DGGML_CUDA_NO_VMM=ON" in flags  # no driver library given: VMM off
    assert any(f.startswith("-DCUDA_cublas_LIBRARY=") for f in flags) == (not has_cublas)
    # The tools link through libggml-cuda: the linker must be told where its libcublas.so.13 is, in a wheel beside
    # the toolkit or in the toolkit's own folders (NVIDIA's wheels: lib/, in no linker's search path).
    (exe,) = [f for f in flags if f.startswith("-DCMAKE_EXE_LINKER_FLAGS=-Wl,")]
    assert (f"-rpath-link,{fake_cublas / 'lib'}" in exe) == (not has_cublas)
    assert all(f"-rpath-link,{d}" in exe for d in tk.lib_dirs)
    assert cuda_toolkit.cublas_wheel(tk).startswith(("nvidia-cublas>=13", "nvidia-cublas-cu12>=12"))
    assert os.fspath(tk.nvcc) in " ".join(flags)
    cuda_toolkit.find_toolkit.cache_clear()


@needs_toolkit
def test_a_card_whose_driver_hides_its_architecture_still_finds_the_engine(monkeypatch, tmp_path):
    """Every command locates the engine; a driver that does not report the compute capability must not stop
    that (only `engine install --backend cuda` needs the architecture)."""
    if not build.managed_builds():
        pytest.skip("no managed engine build here")
    monkeypatch.delenv("MOE_TUNE_CUDA_ARCHS", raising=False)
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    _no_nvcc_on_path(monkeypatch, tmp_path)  # llama-server is not on PATH either
    _fake_driver(monkeypatch, FakeNVML([("NVIDIA GeForce RTX 3090", 24 * 2**30, 2**30)], compute_capability=None))
    assert build.backend_choice(build.Backend.AUTO)[0] is build.Backend.CUDA
    assert build.locate_engine().bin_dir in build.managed_builds()
    cuda_toolkit.find_toolkit.cache_clear()


@needs_toolkit
def test_cublas_fetched_once_is_not_fetched_or_announced_again(monkeypatch, tmp_path):
    """A second CUDA build on a minimal toolkit uses the cuBLAS of the first (no pip run) and says so."""
    _no_nvcc_on_path(monkeypatch, tmp_path)
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOE_TUNE_CUDA_ARCHS", "86")
    tk = cuda_toolkit.find_toolkit()
    assert tk is not None
    if tk.library("cublas") is not None:
        pytest.skip("this toolkit has its own cuBLAS: nothing is fetched")
    assert cuda_toolkit.cached_cublas(tk) is None
    lib = cuda_toolkit.cublas_dir(tk) / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"")
    monkeypatch.setattr(cuda_toolkit, "fetch_cublas", lambda _tk: pytest.fail("fetched again"))
    phases: list[str] = []
    flags, _ = build._cuda_parts(build.Backend.CUDA, phases.append)
    assert cuda_toolkit.cached_cublas(tk) == lib.parent
    assert [p for p in phases if "cuBLAS" in p] == [f"cuBLAS fetched earlier ({lib.parent}; the toolkit has none)"]
    (exe,) = [f for f in flags if f.startswith("-DCMAKE_EXE_LINKER_FLAGS=")]
    assert f"-rpath-link,{lib}" in exe and "-DGGML_CUDA_NO_VMM=ON" not in flags  # the driver stub keeps VMM on
    cuda_toolkit.find_toolkit.cache_clear()


def test_cublas_installed_as_nvidias_wheel_is_used_without_fetching(tmp_path):
    """A GPU image ships PyTorch with nvidia-cublas (``nvidia/cu13/{include,lib}`` in site-packages): an offline
    machine builds against it instead of fetching the wheel. Only the toolkit's major release counts."""
    tk = cuda_toolkit.Toolkit(Path("/usr/local/cuda/bin/nvcc"), "PATH", Path("/usr/local/cuda"), (13, 0), ())
    site = tmp_path / "site-packages"
    root = site / "nvidia" / "cu13"
    (root / "lib").mkdir(parents=True)
    (root / "include").mkdir()
    assert cuda_toolkit.installed_cublas(tk, [site]) is None  # no library yet
    (root / "lib" / "libcublas.so.13").write_bytes(b"")
    assert cuda_toolkit.installed_cublas(tk, [site]) is None  # no headers: nothing to compile against
    (root / "include" / "cublas_v2.h").write_text("")
    assert cuda_toolkit.installed_cublas(tk, [tmp_path / "elsewhere", site]) == root
    cu12 = cuda_toolkit.Toolkit(tk.nvcc, "PATH", tk.root, (12, 8), ())
    assert cuda_toolkit.installed_cublas(cu12, [site]) is None  # libcublas.so.13 is not CUDA 12's


def test_a_cuda_build_on_a_machine_without_the_driver_says_so_in_one_line(tmp_path):
    """A CUDA build links the driver (libcuda.so.1, for VMM); on a machine without one the loader refuses to start
    it. The engine is then named as built for a GPU machine, not read as a build of unknown commit with no flags.
    The binaries here are real ones linked against a libcuda.so.1 that is then taken away."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "stub.c").write_text("int cuInit(unsigned f) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), "-Wl,-soname,libcuda.so.1",
                    str(lib / "stub.c")], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "main.c").write_text("int cuInit(unsigned f); int main(void) { return cuInit(0); }\n")
    for tool in ("llama-bench", "llama-server"):
        subprocess.run(["cc", "-o", str(bin_dir / tool), str(tmp_path / "main.c"), "-L", str(lib),
                        "-l:libcuda.so.1"], check=True)
    shutil.rmtree(lib)
    loc = build.EngineLocation(bin_dir, "option")
    said = (r"is a CUDA build and this machine has no NVIDIA driver \(libcuda\.so\.1\): it runs on a GPU machine; "
            r"here run `moe-tune engine install --backend cpu`")
    with pytest.raises(EngineError, match=said):
        build.capabilities(loc, use_cache=False)
