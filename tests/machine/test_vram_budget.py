"""The VRAM budget: free VRAM at start (NVML, faked here) or --vram-budget, never the card's total; the memory
gate, the --fit margin (-fitt), the spill verdict and `moe-tune plan` all use it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from tests.fakes import FakeNVML
from tuner.cli.app import app
from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.machine import hardware
from tuner.machine.sampler import Sample, SpillKind, spill_verdict, summarize
from tuner.models import gguf_reader, shape_model
from tuner.search import finish, space

GIB = 2**30
MIB = 2**20
CARD = "NVIDIA GeForce RTX 4090"


def _probed(used_gib: float) -> hardware.Hardware:
    """A 24 GiB card with ``used_gib`` held by others, in a 64 GiB host (the host is not what is tested)."""
    hw = hardware.probe_hardware(FakeNVML([(CARD, 24 * GIB, int(used_gib * GIB))]), host_bandwidth_s=0)
    return replace(hw, ram_total_bytes=64 * GIB, ram_available_bytes=64 * GIB)


def test_budget_is_free_vram_at_start_or_the_option():
    hw = _probed(used_gib=6)
    assert hw.vram_total_bytes == 24 * GIB and hw.vram_budget_bytes == 18 * GIB
    assert hw.vram_budget_source == "free at start (NVML)" and "budget 18,432 MiB" in hw.describe()
    small = hardware.with_vram_budget(hw, 8192)
    assert small.vram_budget_bytes == 8 * GIB and small.vram_budget_source == "--vram-budget"
    assert hardware.vram_held_back_bytes(small) == 10 * GIB
    assert hardware.with_vram_budget(hw, None) is hw
    assert hardware.vram_held_back_bytes(hw) == 0


def test_budget_errors_name_the_fix():
    with pytest.raises(UsageError, match="lower it"):
        hardware.with_vram_budget(_probed(0), 30000)
    with pytest.raises(UsageError, match="positive"):
        hardware.with_vram_budget(_probed(0), 0)
    cpu = hardware.probe_hardware(FakeNVML(init_error="Driver Not Loaded"), host_bandwidth_s=0)
    assert cpu.vram_budget_bytes == 0
    with pytest.raises(UsageError, match="drop --vram-budget"):
        hardware.with_vram_budget(cpu, 8192)


@pytest.fixture(scope="module")
def qwen30b(tmp_path_factory):
    """A shape-true Qwen3-30B-A3B Q4_K_M (17 GiB logical, a few MB on disk)."""
    path = tmp_path_factory.mktemp("shape") / "qwen3-30b-a3b-Q4_K_M.gguf"
    shape_model.write_catalog_model("qwen3-30b-a3b:Q4_K_M", path)
    return gguf_reader.inspect_model(path)


def test_memory_gate_uses_free_vram_not_the_total(qwen30b):
    cfg = LaunchConfig(model=qwen30b.paths[0], n_cpu_moe=0, ctx=8192, parallel=1)
    empty = _probed(used_gib=0)
    need_mib = space.check(qwen30b, cfg, empty).estimate.gpu.total_bytes / MIB
    assert 17 * 1024 < need_mib < 22 * 1024  # all experts on a 24 GiB card: fits an empty one
    assert space.check(qwen30b, cfg, empty).feasible
    busy = _probed(used_gib=6)  # a desktop and a browser hold 6 GiB: 18 GiB free is not enough
    over = space.check(qwen30b, cfg, busy)
    assert not over.feasible
    assert over.vram_over_mib == pytest.approx(need_mib + 1024 - 18 * 1024, abs=1)
    emulated = hardware.with_vram_budget(empty, 16 * 1024)  # the empty 4090 standing in for a 16 GiB card
    assert not space.check(qwen30b, cfg, emulated).feasible
    assert space.check(qwen30b, replace(cfg, n_cpu_moe=qwen30b.n_layer), emulated).feasible
    # The plan's verdict (memory.judge) agrees with the gate.
    assert space.check(qwen30b, cfg, busy).estimate.verdict.value != "fits"
    assert space.check(qwen30b, cfg, empty).estimate.verdict.value == "fits"


def test_fit_margin_holds_back_what_the_budget_does_not_allow():
    empty = _probed(used_gib=0)
    assert finish.fit_target_mib(empty) == 1024
    assert finish.fit_target_mib(empty, vram_margin_mib=512) == 512
    emulated = hardware.with_vram_budget(empty, 12 * 1024)
    # llama.cpp's --fit sees 24 GiB free: leave its 1 GiB margin plus the 12 GiB outside the budget.
    assert finish.fit_target_mib(emulated) == 1024 + 12 * 1024


def _run(baseline_gib: float, peak_gib: float, total_gib: float = 80) -> list[Sample]:
    return [Sample(0.0, int(baseline_gib * GIB), int(total_gib * GIB)),
            Sample(1.0, int(peak_gib * GIB), int(total_gib * GIB))]


def test_spill_verdict_judges_full_by_the_budget():
    # An 80 GB card emulating 16 GiB: 2 GiB held by others, the server reached 17.9 GiB in all.
    report = summarize(_run(2, 17.9))
    assert spill_verdict(report).kind is SpillKind.NONE
    at_budget = spill_verdict(report, vram_budget_bytes=16 * GIB)
    assert at_budget.kind is SpillKind.VRAM_AT_CAPACITY and "budget 16,384 MiB" in at_budget.evidence
    cliff = spill_verdict(report, vram_budget_bytes=16 * GIB, gen_tok_s=5.0, roofline_tok_s=100.0)
    assert cliff.kind is SpillKind.THROUGHPUT_CLIFF
    assert spill_verdict(summarize(_run(2, 10)), vram_budget_bytes=16 * GIB).kind is SpillKind.NONE


@pytest.fixture
def fake_gpu(monkeypatch):
    def use(used_gib: float) -> None:
        monkeypatch.setattr(hardware, "_load_nvml", lambda: FakeNVML([(CARD, 24 * GIB, int(used_gib * GIB))]))
    return use


def _plan(*args: str) -> dict:
    res = CliRunner().invoke(app, ["plan", "qwen3-30b-a3b:Q4_K_M", "-c", "8192", "-np", "1", "--ram", "64", "--json",
                                   *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_plan_cli_defaults_to_free_vram_and_takes_the_option(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path))
    fake_gpu(used_gib=6)
    free = _plan()
    assert free["vram_budget_bytes"] == 18 * GIB and free["vram_budget_source"] == "free at start (NVML)"
    assert free["rows"][0]["verdict"] != "fits"  # all experts on the GPU: needs more than the 18 GiB free
    fake_gpu(used_gib=0)
    assert _plan()["rows"][0]["verdict"] == "fits"
    small = _plan("--vram-budget", "12288")
    assert small["vram_budget_bytes"] == 12 * GIB and small["vram_budget_source"] == "--vram-budget"
    fits = [r["n_cpu_moe"] for r in small["rows"] if r["verdict"] == "fits"]
    assert fits and min(fits) > 0  # 12 GiB: some experts must stay in RAM
    card = _plan("--gpu", "RTX 4090", "--vram-budget", "20000")
    assert card["vram_budget_bytes"] == 20000 * MIB and "budget 20,000 MiB" in card["hardware"]


def test_cli_options_exist():
    runner = CliRunner()
    for cmd in ("plan", "auto-tune", "bench"):
        res = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
        assert "--vram-budget" in res.stdout, cmd


def test_llama_fit_params_takes_the_budget_margin(engine_loc, demo_models):
    from tuner.engine import flags

    argv = flags.with_fit_target(["llama-fit-params", "-m", "x.gguf"], 13 * 1024)
    assert argv[-2:] == ["-fitt", "13312"]
    from tuner.models.gguf_reader import inspect_model

    base = LaunchConfig(model=demo_models[("qwen3moe", "Q4_K_M")], ctx=4096, parallel=1)
    fit = finish.fit_config(engine_loc, base, inspect_model(base.model).n_layer, fit_target=13 * 1024)
    assert fit is not None and fit.ctx == 4096  # the engine accepted -fitt and answered with a launch
