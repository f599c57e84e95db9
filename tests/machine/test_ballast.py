"""The VRAM ballast: on this CPU machine it says cleanly that no GPU is there; the process it runs under
(runner.hold) is checked with a stand-in helper that prints its line and waits, and is gone afterwards."""

from __future__ import annotations

import json
import sys

import psutil
import pytest

from tests.fakes import FakeNVML
from tuner.core.errors import HardwareError, NoGpuError, ProcessFailedError, ProcessTimeoutError
from tuner.engine import runner
from tuner.machine import ballast, hardware

# Stands in for the compiled helper: prints the JSON line a real ballast prints, then waits to be killed.
STAND_IN = ("import json, sys, time; print(json.dumps({'held_mib': 65000, 'free_mib': int(sys.argv[1]), "
            "'total_mib': 81559, 'method': 'stand-in'}), flush=True); time.sleep(300)")


def test_no_gpu_is_reported_cleanly(monkeypatch):
    monkeypatch.setattr(hardware, "_load_nvml", lambda: FakeNVML(init_error="Driver Not Loaded"))
    with pytest.raises(NoGpuError, match="needs an NVIDIA GPU") as exc, ballast.hold_vram(16384, runner):
        pass
    assert "Driver Not Loaded" in str(exc.value)


def test_a_gpu_without_nvcc_cupy_or_torch_names_the_fix(monkeypatch):
    monkeypatch.setattr(hardware, "_load_nvml", lambda: FakeNVML([("NVIDIA H100 80GB HBM3", 80 << 30, 1 << 30)]))
    monkeypatch.setattr(hardware, "find_nvcc", lambda: None)
    monkeypatch.setattr(ballast.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NoGpuError, match="install the CUDA toolkit"), ballast.hold_vram(8192, runner):
        pass


def test_hold_yields_the_ready_line_and_stops_the_helper():
    argv = [sys.executable, "-c", STAND_IN, "16384"]
    with runner.hold(argv, ready_timeout_s=30, what="stand-in ballast", fix="none") as held:
        proc = psutil.Process(held.pid)
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        b = ballast.parse_ready_line(held.ready_line, "nvcc")
        assert (b.method, b.held_mib, b.free_mib, b.total_mib) == ("stand-in", 65000, 16384, 81559)
    assert not psutil.pid_exists(held.pid) or psutil.Process(held.pid).status() == psutil.STATUS_ZOMBIE


def test_hold_reports_a_helper_that_dies_or_hangs():
    dies = [sys.executable, "-c", "import sys; print('error: no CUDA device: no driver', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(ProcessFailedError, match="no CUDA device") as exc, \
            runner.hold(dies, ready_timeout_s=30, what="VRAM ballast", fix="check nvidia-smi"):
        pass
    assert exc.value.returncode == 3
    hangs = [sys.executable, "-c", "import time; time.sleep(300)"]
    with pytest.raises(ProcessTimeoutError, match="not ready in 1 s"), \
            runner.hold(hangs, ready_timeout_s=1, what="VRAM ballast", fix="check nvidia-smi"):
        pass


def test_ready_line_must_be_the_helpers_json():
    with pytest.raises(HardwareError, match="delete"):
        ballast.parse_ready_line("Segmentation fault", "nvcc")
    line = json.dumps({"held_mib": 1, "free_mib": 2, "total_mib": 3})
    assert ballast.parse_ready_line(line, "cupy").method == "cupy"


def test_sources_use_plain_cudamalloc_never_managed_memory():
    # Managed memory asked beyond what is free can hang a GPU; the ballast must never use it.
    for src in (ballast.CUDA_SOURCE, ballast.PYTHON_SOURCE):
        assert "Managed" not in src and "managed" not in src
    assert "cudaMalloc(&p, want)" in ballast.CUDA_SOURCE and "pause()" in ballast.CUDA_SOURCE


# A fake CuPy at the hardware boundary: an 80 GB card whose driver hands out memory in 2 MiB pages.
FAKE_CUPY = '''
TOTAL, PAGE = 81559 << 20, 2 << 20
used = [600 << 20]
class _Runtime:
    @staticmethod
    def memGetInfo():
        return TOTAL - used[0], TOTAL
class _Device:
    def __init__(self, index): pass
    def use(self): pass
class Memory:
    def __init__(self, n):
        pages = -(-n // PAGE) * PAGE
        if pages > TOTAL - used[0]:
            raise MemoryError("out of memory")
        used[0] += pages
class cuda:
    runtime = _Runtime
    Device = _Device
    Memory = Memory
'''


@pytest.mark.parametrize("leave_mib", [8192, 16384, 0])
def test_python_helper_leaves_what_was_asked_with_a_fake_cupy(tmp_path, leave_mib):
    (tmp_path / "cupy.py").write_text(FAKE_CUPY)
    argv = [sys.executable, "-c", ballast.PYTHON_SOURCE, str(leave_mib), "0"]
    with runner.hold(argv, ready_timeout_s=30, what="ballast (fake CuPy)", fix="none",
                     env={"PYTHONPATH": str(tmp_path)}) as held:
        b = ballast.parse_ready_line(held.ready_line, "cupy")
    assert b.method == "cupy" and b.total_mib == 81559
    assert leave_mib <= b.free_mib <= leave_mib + 4  # within two driver pages of the budget
    assert b.held_mib == 81559 - 600 - b.free_mib
