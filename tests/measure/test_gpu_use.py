"""A GPU rig whose engine runs on the CPU is stopped, not crowned; ``--device none`` measures the CPU on purpose;
a desktop's display is no reason to wait and another program's GPU work is. The card is the FAKE desktop of
:mod:`tests.desktop` (NVML boundary); the engine, its output and every process are real."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.desktop import desktop
from tuner.core.config import LaunchConfig
from tuner.core.errors import CpuFallbackError
from tuner.engine import build
from tuner.measure import bench, gpu_use
from tuner.measure.workload import Workload, WorkloadKind

REPO = Path(__file__).resolve().parents[2]

CPU_BUILD = "is a CPU build and this machine has an NVIDIA GeForce RTX 3090"
QUICK = ("--no-server", "-r", "1", "-p", "8", "-n", "8")


def _one_line(res) -> str:
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    return res.stderr.strip().splitlines()[-1]


def test_a_cpu_build_on_a_gpu_desktop_stops_bench_and_auto_tune_at_once(engine_loc, demo_models, tmp_path):
    if build.capabilities(engine_loc).backend != "cpu":
        pytest.skip("the engine here is a GPU build")
    model = demo_models[("qwen3moe", "Q4_K_M")]
    # Named: with a CUDA build cached too, a machine that reports a GPU is given the CUDA build by default.
    cpu = ("--llama-cpp-dir", str(engine_loc.bin_dir))
    with desktop(tmp_path) as d:
        t0 = time.monotonic()
        res = run_cli("bench", str(model), *QUICK, *cpu, env=d.env)
        line = _one_line(res)
        assert line.startswith("error: the engine at ") and CPU_BUILD in line, line
        assert "moe-tune engine install --backend cuda" in line and line.endswith("--device none"), line
        assert "waiting" not in res.stderr  # the display, shell and browser on the card are no rivals...
        assert f"the GPU also holds Xorg pid {d.pids['Xorg']} (412 MiB)" in res.stderr  # ...and are named
        tune = run_cli("auto-tune", str(model), "--trials", "2", "--results-dir", str(tmp_path / "r"), *cpu,
                       env=d.env)
        assert CPU_BUILD in _one_line(tune)
        assert not list((tmp_path / "r").glob("*/result.json"))  # nothing searched, nothing crowned
        quants = run_cli("compare-quants", str(model), "--trials", "1", "--out", str(tmp_path / "c"), *cpu,
                         env=d.env)
        assert CPU_BUILD in _one_line(quants)
        assert not list((tmp_path / "c").glob("**/compare.json"))
        assert time.monotonic() - t0 < 120


def test_device_none_measures_the_cpu_on_purpose_beside_the_display(engine_loc, demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    with desktop(tmp_path) as d:
        res = run_cli("bench", str(model), *QUICK, "--device", "none", "--json", env=d.env)
        assert res.returncode == 0, res.stderr
        report = json.loads(res.stdout)
        assert "-dev none" in report["launch_line"] and report["argv"][report["argv"].index("-dev") + 1] == "none"
        shown = run_cli("bench", str(model), *QUICK, "-dev", "none", env=d.env)
        assert shown.returncode == 0, shown.stderr
        assert "launch line: llama-server -m" in shown.stdout and "-dev none" in shown.stdout


def test_another_programs_gpu_work_makes_bench_wait_then_refuse_saying_what(engine_loc, demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    with desktop(tmp_path, busy=True) as d:
        trainer = d.pids["trainer"]
        res = run_cli("bench", str(model), *QUICK, "--busy-wait", "2s", env=d.env)
        line = _one_line(res)
        assert f"trainer pid {trainer} uses the GPU (95 % SM)" in line, line
        assert "waited 2 s" in line or "waited 3 s" in line, line  # the first look past 2 s ends the wait
        # Output is not a terminal: the wait left one line when it started.
        first = res.stderr.strip().splitlines()[0]
        assert first.startswith("waiting for a quiet machine: ") and "up to 2 s" in first, res.stderr
        # The CPU on purpose: GPU work is not this run's concern.
        ok = run_cli("bench", str(model), *QUICK, "--device", "none", "--busy-wait", "2s", env=d.env)
        assert ok.returncode == 0, ok.stderr


def test_each_trial_is_checked_from_the_engines_own_output(engine_loc, demo_models, tmp_path):
    """The check reads llama-bench's JSON ``gpu_info`` and llama-server's load log, as they come from the engine
    (a CPU build here: what a CUDA build that found no device prints too)."""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    cfg = LaunchConfig(model=model, ctx=256, threads=2)
    gpu_use.expect(gpu_use.Expectation("NVIDIA GeForce RTX 3090"))
    try:
        with pytest.raises(CpuFallbackError, match="llama-bench ran on the CPU although an NVIDIA GeForce RTX 3090"):
            bench.run_bench(engine_loc, cfg, n_prompt=8, n_gen=4, repetitions=1)
        with pytest.raises(CpuFallbackError, match="llama-server put nothing on the GPU although an NVIDIA"):
            bench.run_server_trial(engine_loc, cfg, Workload(WorkloadKind.CUSTOM, 8, 4, rounds=1), log_dir=tmp_path)
        on_purpose = LaunchConfig(model=model, ctx=256, threads=2, device="none")
        assert bench.run_bench(engine_loc, on_purpose, n_prompt=8, n_gen=4, repetitions=1).rows
    finally:
        gpu_use.expect(gpu_use.Expectation(None))


def _cuda_builds() -> list:
    return [b for b in build.managed_builds() if build.build_info(b).get("backend") == "cuda"]


@pytest.mark.skipif(not _cuda_builds(), reason="no CUDA build cached here (`moe-tune engine install --backend cuda`)")
def test_a_cuda_build_with_no_usable_device_is_named_with_its_cause(demo_models, tmp_path):
    """The real CUDA runtime on a machine whose driver the NVML stand-in claims: the engine says why it found
    no device (no driver library here), and the run stops naming that cause."""
    cuda_bin = _cuda_builds()[0]
    model = demo_models[("qwen3moe", "Q4_K_M")]
    with desktop(tmp_path) as d:
        res = run_cli("bench", str(model), *QUICK, "--llama-cpp-dir", str(cuda_bin), env=d.env)
        line = _one_line(res)
        assert "the CUDA runtime found no" in line and "llama.cpp: " in line and "--device none" in line, line
        hidden = run_cli("bench", str(model), *QUICK, "--llama-cpp-dir", str(cuda_bin),
                         env=d.env | {"CUDA_VISIBLE_DEVICES": ""})
        assert "CUDA_VISIBLE_DEVICES='' hides every card" in _one_line(hidden)
        on_purpose = run_cli("bench", str(model), *QUICK, "--llama-cpp-dir", str(cuda_bin), "--device", "none",
                             env=d.env)
        assert on_purpose.returncode == 0, on_purpose.stderr


def test_a_cuda_servers_jsonl_log_counts_as_on_the_gpu():
    """llama-server on an H100 (the pinned engine, CUDA, --log-jsonl at its default verbosity: the first GPU
    lease) wrote no ``CUDA0 ... buffer size`` line, only ``fit_memory_breakdown`` records whose CUDA0 row holds
    14,261 MiB of weights; it generated at 108 tok/s on the card. Reading only the buffer lines refused it (and
    every GPU trial) as "nothing on the GPU"."""
    log = (REPO / "results/benchmarks/gpu-lease-1/tune-agent-default-arm-llama-server.log").read_text()
    assert "buffer size" not in log and '"name":"CUDA0"' in log
    cfg = LaunchConfig(model=REPO / "m.gguf", ctx=32768, parallel=1)
    gpu_use.expect(gpu_use.Expectation("NVIDIA H100 80GB HBM3"))
    try:
        gpu_use.check_server(log, cfg)  # no CpuFallbackError
        host_only = "\n".join(line for line in log.splitlines() if '"name":"CUDA0"' not in line)
        with pytest.raises(CpuFallbackError, match="llama-server put nothing on the GPU"):
            gpu_use.check_server(host_only, cfg)
    finally:
        gpu_use.expect(gpu_use.Expectation(None))
