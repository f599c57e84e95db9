"""`moe-tune doctor` on this machine (real engine, real psutil) and with a fake NVML for the GPU path."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.fakes import FakeNVML
from tuner.engine import build, doctor
from tuner.machine import hardware


def test_doctor_json_names_the_pinned_commit_and_exits_zero():
    proc = run_cli("doctor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["engine"]["commit"] == build.PIN.commit
    assert report["engine"]["tools"]["llama-server"] is True
    assert "--n-cpu-moe" in report["engine"]["flags"]["llama-server"]
    assert report["host"]["ram_total_bytes"] > 2**30
    assert report["host"]["logical_cores"] >= 1
    assert report["disk"]["engine"]["free_bytes"] > 0
    if not hardware.probe_gpus().gpus:
        assert report["gpus"] == []
        assert report["gpu_note"].startswith("no NVIDIA GPU found")


def test_doctor_table_says_no_gpu():
    if hardware.probe_gpus().gpus:
        pytest.skip("this machine has an NVIDIA GPU")
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no NVIDIA GPU found" in proc.stdout
    assert build.PIN.commit in proc.stdout


def test_doctor_without_engine_fails_with_the_fix(tmp_path):
    proc = run_cli("doctor", "--json", env={"MOE_TUNE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert any(p["fatal"] and "engine install" in p["fix"] for p in report["problems"])


def test_gpu_path_with_fake_nvml():
    fake = FakeNVML([("NVIDIA GeForce RTX 4060 Ti", 16 << 30, 1 << 30)], driver="570.86.10")
    report = doctor.diagnose(nvml=fake)
    assert report.gpus == [{
        "index": 0, "name": "NVIDIA GeForce RTX 4060 Ti", "total_bytes": 16 << 30, "free_bytes": 15 << 30,
        "used_bytes": 1 << 30, "driver_version": "570.86.10", "uuid": "GPU-fake-0",
    }]
    assert report.gpu_note == ""
    assert not fake.initialized  # NVML shut down again
    if report.engine.get("backend") == "cpu":
        assert any("CPU build" in p.what for p in report.problems)


def test_nvml_failure_is_a_reason_not_a_crash():
    probe = hardware.probe_gpus(FakeNVML(init_error="NVML Shared Library Not Found"))
    assert probe.gpus == ()
    assert probe.reason == "no NVIDIA GPU found (NVML: NVML Shared Library Not Found)"
    probe = hardware.probe_gpus(FakeNVML([]))
    assert probe.reason == "no NVIDIA GPU found (the driver lists none)"
