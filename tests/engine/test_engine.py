"""Engine pin, discovery order, managed build stamp, capabilities — against the real binaries."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tuner.core.errors import BuildToolMissingError, DiskSpaceError, EngineNotFoundError, UsageError
from tuner.engine import build


def _mirror(loc: build.EngineLocation, folder: Path) -> Path:
    """A second engine folder made of links to the real binaries (as a user's own build would look)."""
    folder.mkdir(parents=True)
    for item in loc.bin_dir.iterdir():
        (folder / item.name).symlink_to(item)
    return folder


def test_pin_lives_in_one_place():
    hits = []
    for path in [*REPO.joinpath("tuner").rglob("*.py"), REPO / "Makefile", REPO / "pyproject.toml"]:
        text = path.read_text()
        if build.PIN.commit in text or f"=={build.PIN.version}" in text:
            hits.append(path.relative_to(REPO).as_posix())
    assert hits == ["tuner/engine/kinds.py"]


def test_discovery_order(engine_loc, tmp_path, monkeypatch):
    opt = _mirror(engine_loc, tmp_path / "opt")
    env = _mirror(engine_loc, tmp_path / "env")
    on_path = _mirror(engine_loc, tmp_path / "path")
    monkeypatch.setenv("PATH", f"{on_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(env))

    assert build.locate_engine(opt) == build.EngineLocation(opt.resolve(), "option")
    assert build.locate_engine() == build.EngineLocation(env.resolve(), "env")
    monkeypatch.delenv("LLAMA_CPP_DIR")
    # PATH entries are resolved through the link to the real binary's folder.
    assert build.locate_engine().source == "path"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    managed = build.locate_engine()
    assert managed.source == "managed"
    assert managed.bin_dir == engine_loc.bin_dir or engine_loc.source != "managed"


def test_llama_cpp_checkout_with_build_bin_is_accepted(engine_loc, tmp_path):
    _mirror(engine_loc, tmp_path / "llama.cpp" / "build" / "bin")
    loc = build.locate_engine(tmp_path / "llama.cpp")
    assert loc.bin_dir == (tmp_path / "llama.cpp" / "build" / "bin").resolve()
    assert loc.has("llama-bench")


def test_bad_engine_dirs_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="--llama-cpp-dir"):
        build.locate_engine(tmp_path)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    with pytest.raises(UsageError, match="LLAMA_CPP_DIR"):
        build.locate_engine()
    monkeypatch.delenv("LLAMA_CPP_DIR")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(EngineNotFoundError, match="moe-tune engine install"):
        build.locate_engine()


def test_install_is_a_noop_once_built(engine_loc):
    if engine_loc.source != "managed":
        pytest.skip("tests run against a user-provided engine")
    start = time.monotonic()
    result = build.install(build.Backend.CPU)
    assert not result.built
    assert result.bin_dir == engine_loc.bin_dir
    assert time.monotonic() - start < 2.0
    # The command a user types, process start-up included.
    start = time.monotonic()
    proc = run_cli("engine", "install", "--backend", "cpu")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(engine_loc.bin_dir)
    assert "already built" in proc.stderr
    assert elapsed < 5.0  # interpreter + imports; the install itself was timed above


def test_managed_build_stamp_and_rpath(engine_loc):
    if engine_loc.source != "managed":
        pytest.skip("tests run against a user-provided engine")
    stamp = build.build_info(engine_loc.bin_dir)
    assert stamp["pin"]["commit"] == build.PIN.commit
    assert stamp["backend"] in ("cpu", "cuda")
    assert all((engine_loc.bin_dir / t).is_file() for t in build.TOOLS)
    # Relocatable: the binaries find their libraries next to them, not in the (deleted) build tree.
    readelf = subprocess.run(["readelf", "-d", str(engine_loc.bin_dir / "llama-server")], capture_output=True,
                             text=True)
    if readelf.returncode == 0:
        assert "$ORIGIN" in readelf.stdout


def test_missing_build_tools_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cmake, no compiler
    with pytest.raises(BuildToolMissingError, match="cmake not found: install"):
        build.install(build.Backend.CPU, force=True)


def test_low_disk_is_an_error_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    # Fake at the hardware boundary: the disk reports almost no free space.
    monkeypatch.setattr(build.hardware, "free_disk_bytes", lambda path: 10 * 2**20)
    with pytest.raises(DiskSpaceError, match="MOE_TUNE_CACHE"):
        build.install(build.Backend.CPU, force=True)


def test_auto_backend_without_gpu_is_cpu(monkeypatch):
    from tests.fakes import FakeNVML

    monkeypatch.setattr(build.hardware, "_load_nvml", lambda: FakeNVML(init_error="Driver Not Loaded"))
    assert build.resolve_backend(build.Backend.AUTO) is build.Backend.CPU
    monkeypatch.setattr(build.hardware, "_load_nvml", lambda: FakeNVML([("NVIDIA GeForce RTX 3090", 24 << 30, 0)]))
    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/local/bin/nvcc" if name == "nvcc" else None)
    assert build.resolve_backend(build.Backend.AUTO) is build.Backend.CUDA
    assert "-DGGML_CUDA=ON" in build.cmake_flags(build.Backend.CUDA)
    assert build._build_key(build.Backend.CUDA) != build._build_key(build.Backend.CPU)


def test_capabilities_of_the_pinned_engine(engine_loc):
    caps = build.capabilities(engine_loc, use_cache=False)
    assert caps.commit == build.PIN.commit
    assert caps.build_number.isdigit()
    assert caps.backend == "cpu" or caps.devices
    assert caps.supports("llama-bench", "-ncmoe")
    assert caps.supports("llama-bench", "-ctk")
    assert caps.supports("llama-server", "--n-cpu-moe")
    assert caps.supports("llama-server", "-fa")
    assert caps.supports("llama-perplexity", "--kl-divergence")
    assert not caps.supports("llama-bench", "-c")  # llama-bench has no context flag
    # The second read comes from the cache and says the same.
    assert build.capabilities(engine_loc) == caps


def test_parsers_on_recorded_output():
    assert build.parse_version("version: 0.5.0-dev (build 1, commit 0c1e57098)\nbuilt with GNU") == (
        "0.5.0-dev", "1", "0c1e57098")
    assert build.parse_version("version: 6500 (a1b2c3d4)") == ("6500", "6500", "a1b2c3d4")
    assert build.parse_version("garbage") == ("unknown", "unknown", "unknown")
    devices = build.parse_devices(
        "Available devices:\n  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23500 MiB free)\n")
    assert devices == ("CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23500 MiB free)",)
    assert build.backend_of(devices, Path("/nonexistent")) == "cuda"
    assert build.parse_devices("Available devices:\n  (none)\n") == ()
    flags = build.parse_help_flags(
        "  -ctk, --cache-type-k TYPE   KV cache data type for K (default: f16)\n"
        "  -fa,  --flash-attn [on|off|auto]  set Flash Attention use\n"
        "description text mentioning --not-a-flag\n")
    assert flags == ("--cache-type-k", "--flash-attn", "-ctk", "-fa")


def test_engine_path_and_info_commands(engine_loc):
    proc = run_cli("engine", "path")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == engine_loc.bin_dir
    assert (Path(proc.stdout.strip()) / "llama-server").is_file()
    proc = run_cli("engine", "info", "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    info = json.loads(proc.stdout)
    assert info["commit"] == build.PIN.commit
    assert "--n-cpu-moe" in info["flags"]["llama-server"]


def test_engine_path_with_bad_env_is_one_line(tmp_path):
    proc = run_cli("engine", "path", env={"LLAMA_CPP_DIR": str(tmp_path / "nope")})
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "LLAMA_CPP_DIR" in lines[0]
    assert "Traceback" not in proc.stderr


def test_python_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert build.PIN.commit in proc.stdout
