"""nvcc where the toolkit put it, the backend `engine install` chooses and why, the CUDA architecture from the
card. Uses this machine's real CUDA toolkit (/usr/local/cuda, nvcc 13 off PATH's own folders) where it is
there; the card is the FAKE desktop of :mod:`tests.desktop` (NVML boundary)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.desktop import desktop
from tests.fakes import FakeNVML
from tuner.core.errors import BuildToolMissingError
from tuner.engine import build, cuda_toolkit
from tuner.machine import hardware

pytestmark = pytest.mark.fast
REAL_NVCC = Path("/usr/local/cuda/bin/nvcc")
needs_toolkit = pytest.mark.skipif(not REAL_NVCC.is_file(), reason="no CUDA toolkit in /usr/local/cuda here")


def _no_nvcc_on_path(monkeypatch, tmp_path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir(exist_ok=True)
    for tool in ("cmake", "c++", "make", "sh"):  # the rest of a build machine stays; only nvcc is off PATH
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
        assert why.startswith("an NVIDIA GeForce RTX 3090 is here and nvcc ") and "/usr/local/cuda/bin" in why
        # The architecture is the card's compute capability (8.6), not "native" (which needs a GPU at configure).
        assert "-DCMAKE_CUDA_ARCHITECTURES=86" in build.cmake_flags(build.Backend.CUDA)
    cuda_toolkit.find_toolkit.cache_clear()


def test_auto_stays_on_the_cpu_without_a_toolkit_and_names_the_fix(monkeypatch, tmp_path):
    _no_nvcc_on_path(monkeypatch, tmp_path)
    monkeypatch.setattr(hardware, "NVCC_DIRS", ())
    _fake_driver(monkeypatch, FakeNVML([("NVIDIA GeForce RTX 4060 Ti", 16 * 2**30, 2**30)]))
    backend, why = build.backend_choice(build.Backend.AUTO)
    assert backend is build.Backend.CPU
    assert "an NVIDIA GeForce RTX 4060 Ti is here but no CUDA toolkit" in why and "CUDA_HOME" in why
    _fake_driver(monkeypatch, FakeNVML(init_error="NVML Shared Library Not Found"))
    assert build.backend_choice(build.Backend.AUTO) == (build.Backend.CPU, "no NVIDIA GPU found (NVML lists none)")
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
def test_a_minimal_toolkit_gets_cublas_from_the_wheel_and_builds_without_vmm(monkeypatch, tmp_path):
    """What this machine's toolkit lacks is what the configure flags add (read from the toolkit, not assumed)."""
    _no_nvcc_on_path(monkeypatch, tmp_path)
    tk = cuda_toolkit.find_toolkit()
    assert tk is not None
    has_cublas = tk.library("cublas") is not None
    has_driver = cuda_toolkit.driver_library(tk) is not None
    fake_cublas = tmp_path / "cublas"
    (fake_cublas / "lib").mkdir(parents=True)
    for name in ("libcublas.so.13", "libcublasLt.so.13"):
        (fake_cublas / "lib" / name).write_bytes(b"")
    flags = cuda_toolkit.cmake_flags(tk, "86", None if has_cublas else fake_cublas, has_driver)
    assert ("-DGGML_CUDA_NO_VMM=ON" in flags) == (not has_driver)
    assert any(f.startswith("-DCUDA_cublas_LIBRARY=") for f in flags) == (not has_cublas)
    # The tools link through libggml-cuda: the linker must be told where its libcublas.so.13 is.
    assert (f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,{fake_cublas / 'lib'}" in flags) == (not has_cublas)
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
    assert f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,{lib}" in flags
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
