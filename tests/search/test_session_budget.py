"""The agent session stage under the user's --vram-budget (issue 51): on a 24 GB card tuned with --vram-budget 12000
(room kept for a game or a second model), llama.cpp's bare launch would let --fit fill all 24. The stage's
``default`` carries ``-fitt`` from the budget (common/fit.cpp fits each device until its projected free memory is
at least the target), each session round samples the line's own VRAM as a server trial does, and an arm whose
VRAM broke the budget is never the printed line nor a ranked one. The card is a fake NVML (the hardware boundary);
the sessions run on the real engine."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from tests.fakes import FakeNVML
from tests.fakes_live import FakeLiveNVML, FakeStep
from tuner.core.config import LaunchConfig
from tuner.engine import flags
from tuner.machine import hardware
from tuner.measure import session, session_run
from tuner.measure.session_run import SessionResult, TurnResult
from tuner.models import demo_model, gguf_reader
from tuner.report import study_report
from tuner.search import known_good, session_stage, space
from tuner.search import result as study_result
from tuner.search.finish import Finish
from tuner.search.session_stage import ArmSessions

GIB, MIB = 2**30, 2**20
CARD = "NVIDIA GeForce RTX 4090"
BUDGET_MIB = 12000
FIT_MARGIN_MIB = 1024  # common_params::fit_params_target's default: what --fit leaves free per device


def _card(budget_mib: float | None) -> hardware.Hardware:
    """An empty 24 GiB card (24,576 MiB free), with or without --vram-budget."""
    hw = hardware.probe_hardware(FakeNVML([(CARD, 24 * GIB, 0)]), host_bandwidth_s=0)
    return hardware.with_vram_budget(replace(hw, ram_total_bytes=64 * GIB, ram_available_bytes=64 * GIB), budget_mib)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, gguf_reader.ModelInfo]:
    path = demo_model.write_demo_model(tmp_path_factory.mktemp("budget") / "qwen3moe.gguf", arch="qwen3moe")
    return path, gguf_reader.inspect_model(path)


@pytest.mark.fast
def test_the_agent_stages_default_leaves_what_the_budget_holds_back(moe):
    path, info = moe
    hw = _card(BUDGET_MIB)
    sp = space.build_space(path, info, hw, ctx=8192, parallel=1, prompt_tokens=512)
    default, _ = known_good.own_choice(sp, info, hw, None)
    # --fit may use the free VRAM minus its target: 24,576 - target must be the budget less fit's own margin.
    assert 24 * 1024 - default.fit_target_mib == BUDGET_MIB - FIT_MARGIN_MIB
    tuned = space.make_config(sp, {"n_cpu_moe": sp.n_cpu_moe[0] if sp.n_cpu_moe else 0})
    arms, _ = session_stage.stage_arms(default, tuned, info, hw, None)
    lines = {label: flags.launch_line(cfg) for label, cfg in arms}
    assert f"-fitt {default.fit_target_mib}" in lines["default"], lines
    # Every other arm is the tuned line (an explicit placement the finish measured within the budget) plus reuse.
    assert all("--n-cpu-moe" in line for label, line in lines.items() if label != "default"), lines
    # The whole free VRAM as the budget: the bare launch is llama.cpp's own choice, as it is.
    free, _ = known_good.own_choice(sp, info, _card(None), None)
    assert free.fit_target_mib is None and "-fitt" not in flags.launch_line(free)


def _res(seconds: float) -> SessionResult:
    return SessionResult((TurnResult(0, 100, 0, 100, 0, 0.1, 0.1, 8, 10.0, seconds),), seconds)


def _sampled(engine_loc, model: Path, line_mib: int, tmp_path: Path) -> int | None:
    """A real session on llama-server, its card a fake whose use grows by ``line_mib`` over a 1.5 GiB desktop."""
    desktop = 1536 * MIB
    fake = FakeLiveNVML([FakeStep(desktop), FakeStep(desktop + line_mib * MIB)], 24 * GIB, pid=os.getpid())
    cfg = LaunchConfig(model=model, ctx=2048, parallel=1, threads=1)
    trial = session_run.run_session_trial(engine_loc, cfg, session.session_maker(None, 1024, 4), 4,
                                          log_dir=tmp_path / str(line_mib), nvml=fake)
    return trial.vram_growth_bytes


def test_a_session_arm_over_the_budget_is_never_printed_nor_ranked(engine_loc, demo_models, tmp_path):
    model = demo_models[("qwen3moe", "Q4_K_M")]
    within, over = _sampled(engine_loc, model, 5000, tmp_path), _sampled(engine_loc, model, 13000, tmp_path)
    assert (within, over) == (5000 * MIB, 13000 * MIB)  # the line's own VRAM, the desktop's left out
    budget = _card(BUDGET_MIB).vram_budget_bytes
    base = LaunchConfig(model=model, ctx=2048, parallel=1, fit_target_mib=13600)
    tuned = replace(base, fit_target_mib=None, n_cpu_moe=2)
    arms = [ArmSessions("default", base, (_res(10.0), _res(10.2), _res(9.9)), vram_growth_bytes=(within,) * 3,
                        vram_budget_bytes=budget),
            ArmSessions("tuned", tuned, (_res(8.0), _res(8.2), _res(7.9)), vram_growth_bytes=(within,) * 3,
                        vram_budget_bytes=budget),
            # Twice as fast, but its cache took 13,000 MiB of a 12,000 MiB budget in a round.
            ArmSessions("tuned + swa-full", replace(tuned, swa_full=True), (_res(4.0), _res(4.1), _res(3.9)),
                        vram_growth_bytes=(within, over, within), vram_budget_bytes=budget)]
    stage = session_stage.judge(arms, "bundled", {})
    assert stage.winner == "tuned" and stage.best is None, (stage.winner, stage.reason)
    record = json.loads(json.dumps(stage.to_dict()))
    assert record["arms"][2]["over_budget"] == 13000 * MIB and record["arms"][0]["over_budget"] is None
    res = study_result.StudyResult(study="s", model=str(model), finish=Finish((), ()), session=record,
                                   workload={"kind": "agent", "prompt_tokens": 512, "gen_tokens": 64,
                                             "depth_tokens": 4096, "concurrency": 1})
    ranked = [p.label for p in study_report.picks(res)]
    assert ranked == ["tuned", "default"], ranked
    lines = [study_report.launch_line(res, rank=r) for r in (1, 2)]
    assert "--swa-full" not in " ".join(lines) and "-fitt 13600" in lines[1], lines
    with pytest.raises(Exception, match="out of range"):
        study_report.launch_line(res, rank=3)


@pytest.mark.fast
def test_an_arm_whose_vram_was_not_sampled_is_unknown_never_within_the_budget():
    """Issue 58: a round whose line's own VRAM NVML did not report (a driver that cannot attribute it, a PID it does
    not show) once read as within --vram-budget, and the arm could be printed. Unknown is its own verdict: such an
    arm is neither chosen nor printed nor ranked, and says why; without a budget (no GPU) there is no verdict."""
    cfg = LaunchConfig(model=Path("m.gguf"), ctx=2048, parallel=1)
    budget, within = BUDGET_MIB * MIB, 5000 * MIB
    default = ArmSessions("default", cfg, (_res(10.0), _res(10.2), _res(9.9)), vram_growth_bytes=(within,) * 3,
                          vram_budget_bytes=budget)
    tuned = ArmSessions("tuned", replace(cfg, n_cpu_moe=2), (_res(8.0), _res(8.2), _res(7.9)),
                        vram_growth_bytes=(within,) * 3, vram_budget_bytes=budget)
    # Twice as fast, and one of its rounds has no VRAM figure.
    unsampled = ArmSessions("tuned + swa-full", replace(cfg, n_cpu_moe=2, swa_full=True),
                            (_res(4.0), _res(4.1), _res(3.9)), vram_growth_bytes=(within, None, within),
                            vram_budget_bytes=budget)
    assert (default.vram_verdict, unsampled.vram_verdict, unsampled.over_budget) == ("within", "unknown", None)
    stage = session_stage.judge([default, tuned, unsampled], "bundled", {})
    assert stage.winner == "tuned" and stage.best is None, (stage.winner, stage.reason)
    assert stage.reason == ("no reuse arm could be printed (tuned + swa-full had its VRAM unsampled (not known to keep "
                            "the VRAM budget)): tuned is printed")
    record = json.loads(json.dumps(stage.to_dict()))
    assert [a["vram_verdict"] for a in record["arms"]] == ["within", "within", "unknown"]
    res = study_result.StudyResult(study="s", model="m.gguf", finish=Finish((), ()), session=record,
                                   workload={"kind": "agent", "prompt_tokens": 512, "gen_tokens": 64,
                                             "depth_tokens": 4096, "concurrency": 1})
    assert [p.label for p in study_report.picks(res)] == ["tuned", "default"]
    # The base line unknown: the defaults are printed, and the reason names what is missing.
    base_unknown = replace(tuned, vram_growth_bytes=(None,) * 3)
    back = session_stage.judge([default, base_unknown], "bundled", {})
    assert back.winner == "default" and back.reason == ("the base line had its VRAM unsampled (not known to keep the "
                                                        "VRAM budget): the defaults are printed")
    # A failed round has nothing to sample; without a budget there is nothing to keep.
    assert replace(tuned, results=(None, *tuned.results[1:]), vram_growth_bytes=(None, within, within)).vram_verdict \
        == "within"
    free = replace(unsampled, vram_budget_bytes=None)
    assert free.vram_verdict is None and session_stage.usable(free)
