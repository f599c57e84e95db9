"""The agent workload's session stage: which reuse arms apply to which model and engine, the memory gate on
them, and the judgement by session time against the defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.core.config import LaunchConfig
from tuner.engine import build
from tuner.machine import sampler
from tuner.machine.hardware import Hardware
from tuner.machine.pressure import HostPressure
from tuner.measure.session_run import SessionResult, TurnResult
from tuner.models import demo_model, gguf_reader
from tuner.search import session_stage, space
from tuner.search.session_stage import ArmSessions

CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")


@pytest.fixture(scope="module")
def infos(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    return {arch: gguf_reader.inspect_model(demo_model.write_demo_model(out / f"{arch}.gguf", arch=arch))
            for arch in ("qwen3moe", "qwen35moe", "gpt-oss")}


def _labels(info, accepts=lambda _s: True, slots=1):
    return [a.label for a in space.reuse_arms(info, accepts, slots)]


def test_reuse_arms_follow_the_model_and_the_engine(infos):
    assert _labels(infos["qwen35moe"]) == ["checkpoints 8", "checkpoints 64, every 1024"]  # no KV shift: recurrent
    assert _labels(infos["gpt-oss"]) == ["checkpoints 8", "checkpoints 64, every 1024", "swa-full", "cache-reuse 256"]
    assert _labels(infos["qwen3moe"]) == ["cache-reuse 256"]  # plain attention rolls back: no checkpoints
    assert _labels(infos["qwen3moe"], slots=2) == ["cache-reuse 256", "prompt cache 2048 MiB"]
    assert _labels(infos["gpt-oss"], accepts=lambda s: s == "swa_full") == ["swa-full"]  # an older engine
    caps = build.Capabilities("t", "1", "abc", "cpu", (), {"llama-server": ("-m", "--swa-full")})
    cfg = LaunchConfig(model=Path("m.gguf"))
    arms, notes = session_stage.stage_arms(cfg, cfg, infos["gpt-oss"], CPU, caps)
    assert [label for label, _ in arms] == ["default", "default + swa-full"] and not notes  # the finish kept default
    assert arms[1][1].swa_full


def test_an_arm_that_does_not_fit_is_not_launched(infos):
    info = infos["gpt-oss"]
    cfg = LaunchConfig(model=info.paths[0], ctx=32768, parallel=1)
    from tuner.plan import memory

    need = memory.estimate(info, cfg, CPU).host.total_bytes
    tight = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, need + 2**20, 0, 20e9, 8, "none")  # room for the window only
    arms, notes = session_stage.stage_arms(cfg, cfg, info, tight, None)
    assert "swa-full" in notes and all("swa-full" not in label for label, _ in arms)


def _res(seconds: float) -> SessionResult:
    return SessionResult((TurnResult(0, 100, 0, 100, 0, 0.1, 0.1, 8, 10.0, seconds),), seconds)


def test_a_reuse_setting_is_printed_only_when_decided_faster_than_the_line_without_it():
    cfg = LaunchConfig(model=Path("m.gguf"))
    default = ArmSessions("default", cfg, (_res(10.0), _res(10.4), _res(9.8)))
    tuned = ArmSessions("tuned", cfg, (_res(8.0), _res(8.3), _res(7.9)))
    fast = ArmSessions("tuned + swa-full", cfg, (_res(5.0), _res(5.1), _res(4.9)))
    broken = ArmSessions("tuned + checkpoints 8", cfg, (None, None, None), failure="crashed")
    stage = session_stage.judge([default, tuned, fast, broken], "bundled", {})
    assert stage.winner == "tuned + swa-full" and stage.verdict is not None
    assert (stage.verdict.a, stage.verdict.b) == ("tuned + swa-full", "tuned")  # against the line without it
    assert stage.verdict.outcome == "better" and stage.verdict.ratio == pytest.approx(1.6, rel=0.05)
    assert stage.to_dict()["arms"][3]["failure"] == "crashed"
    close = ArmSessions("tuned + swa-full", cfg, (_res(7.6), _res(8.6), _res(7.7)))
    same = session_stage.judge([default, tuned, close], "b", {})
    assert same.winner == "tuned" and same.verdict is not None and same.verdict.outcome == "undecided"
    assert same.best == "tuned + swa-full" and same.reason.startswith("tuned + swa-full was the best reuse arm but")
    # No reuse setting applies: the base is printed, judged against the defaults for the report.
    only = session_stage.judge([default, tuned], "b", {})
    assert only.winner == "tuned" and only.verdict is not None and (only.verdict.a, only.verdict.b) == ("tuned",
                                                                                                    "default")
    assert session_stage.judge([default], "b", {}).verdict is None  # the defaults alone: nothing to compare


def test_when_the_base_line_fails_a_reuse_setting_needs_a_verdict_against_the_defaults():
    """The line without the setting failed (issue 42: the reuse arm used to be printed with no verdict at all)."""
    cfg = LaunchConfig(model=Path("m.gguf"))
    default = ArmSessions("default", cfg, (_res(10.0), _res(10.4), _res(9.8)))
    failed = ArmSessions("tuned", cfg, (None, None, None), failure="crashed")
    close = ArmSessions("tuned + swa-full", cfg, (_res(9.6), _res(10.6), _res(9.9)))
    stage = session_stage.judge([default, failed, close], "bundled", {})
    assert stage.winner == "default" and stage.verdict is not None and stage.verdict.outcome == "undecided"
    assert (stage.verdict.a, stage.verdict.b) == ("tuned + swa-full", "default")
    assert stage.reason == ("the base line failed and tuned + swa-full was not shown faster than the defaults: the "
                            "defaults are printed")
    fast = ArmSessions("tuned + swa-full", cfg, (_res(5.0), _res(5.1), _res(4.9)))
    won = session_stage.judge([default, failed, fast], "bundled", {})
    assert won.winner == "tuned + swa-full" and won.verdict is not None and won.verdict.outcome == "better"
    alone = session_stage.judge([ArmSessions("default", cfg, (None, None, None), failure="x"), failed, fast], "b", {})
    assert alone.winner is None  # nothing to decide it against: no setting is printed


def test_session_rounds_too_few_for_a_verdict_are_refused_by_both_commands():
    from tests.conftest import run_cli

    for argv in (["auto-tune", "m.gguf", "--workload", "agent"], ["compare-models", "a.gguf", "b.gguf",
                                                                    "--workload", "agent"]):
        res = run_cli(*argv, "--session-rounds", "1")
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.strip().splitlines()[-1] == (
            "error: --session-rounds 1: give 0 (no session stage) or 2 or more: a verdict needs 3 rounds (one more is "
            "measured while undecided)"), res.stderr


def test_the_reuse_arm_is_judged_on_fresh_rounds_not_the_ones_that_selected_it():
    cfg = LaunchConfig(model=Path("m.gguf"))
    # Selection: swa-full looked 2x faster, checkpoints a little; the confirmation rounds show no gain.
    selection = [ArmSessions("default", cfg, (_res(10.0), _res(10.1))),
                 ArmSessions("default + swa-full", cfg, (_res(5.0), _res(5.2))),
                 ArmSessions("default + cache-reuse 256", cfg, (_res(9.0), _res(9.2)))]
    confirmation = [ArmSessions("default", cfg, (_res(10.0), _res(10.2), _res(9.9), _res(10.1))),
                    ArmSessions("default + swa-full", cfg, (_res(10.1), _res(9.9), _res(10.0), _res(10.3)))]
    stage = session_stage.judge(selection, "bundled", {}, confirmation=confirmation)
    assert stage.best == "default + swa-full" and stage.winner == "default"
    assert stage.verdict is not None and stage.verdict.rounds == 4 and stage.verdict.outcome == "undecided"
    assert stage.arm("default + swa-full").median_session_s == pytest.approx(10.05)  # the confirmation's figure


def test_the_session_winner_is_the_launch_line_of_the_result(tmp_path):
    """With a session stage, result.json, ``launch-line`` (every rank and format) and report.md give the arm with
    the shortest session, not the finish's single-request winner."""
    from tuner.report import study_report
    from tuner.search import result as study_result
    from tuner.search.finish import Finish

    base = LaunchConfig(model=Path("/m/gpt-oss.gguf"), ctx=8192)
    tuned = LaunchConfig(model=Path("/m/gpt-oss.gguf"), ctx=8192, n_cpu_moe=2)
    swa = LaunchConfig(model=Path("/m/gpt-oss.gguf"), ctx=8192, n_cpu_moe=2, swa_full=True)
    stage = session_stage.judge([ArmSessions("default", base, (_res(10.0), _res(10.4), _res(9.8))),
                                 ArmSessions("tuned", tuned, (_res(8.0), _res(8.2), _res(7.9))),
                                 ArmSessions("tuned + swa-full", swa, (_res(5.0), _res(5.1), _res(4.9)))],
                                "bundled", {})
    assert stage.winner == "tuned + swa-full"
    plain = study_result.StudyResult(study="s", model="/m/gpt-oss.gguf", finish=Finish((), ()),
                                     workload={"kind": "agent", "prompt_tokens": 512, "gen_tokens": 64,
                                               "depth_tokens": 4096, "concurrency": 1})
    with pytest.raises(Exception, match="out of range"):  # no finish winner and no stage: nothing to launch
        study_report.launch_line(plain)
    stored = json.loads(json.dumps(stage.to_dict()))  # as the study's user attr holds it
    res = study_result.StudyResult(**{f: getattr(plain, f) for f in plain.__slots__} | {"session": stored})
    back = study_result.load_result(study_result.write_result(res, tmp_path))
    assert back == res
    lines = [study_report.launch_line(back, rank=r) for r in (1, 2, 3)]
    assert "--swa-full" in lines[0] and "--swa-full" not in lines[1] and "--n-cpu-moe 2" in lines[1]
    assert "--n-cpu-moe" not in lines[2]
    doc = json.loads(study_report.launch_line(back, fmt="json"))
    assert doc["chosen_by"] == "agent session time" and doc["median_session_s"] == pytest.approx(5.0)
    text = study_report.markdown(back)
    assert f"`{lines[0]}`" in text.split("## Agent sessions: the launch line", 1)[1].split("\n\n")[1]
    assert "| tuned + swa-full | 5.00 | 3 |" in text


def test_a_session_round_on_a_busy_machine_decides_nothing():
    """A 2x gap, but one round of three was disturbed: two quiet rounds are too few to decide, so the setting does
    not enter the line (the base is printed) and the verdict counts the busy round."""
    cfg = LaunchConfig(model=Path("m.gguf"))
    default = ArmSessions("default", cfg, (_res(10.0), _res(10.4), _res(9.8)), interference=(None, None, None))
    fast = ArmSessions("default + swa-full", cfg, (_res(5.0), _res(5.1), _res(4.9)),
                       interference=(None, "trainer pid 7 uses the GPU (95 % SM)", None))
    stage = session_stage.judge([default, fast], "bundled", {})
    assert stage.winner == "default" and stage.best == "default + swa-full" and stage.verdict is not None
    assert stage.verdict.outcome == "undecided" and stage.verdict.rounds == 2 and stage.verdict.busy_rounds == 1
    assert stage.to_dict()["arms"][1]["interference"][1].startswith("trainer pid 7")


def _paged() -> sampler.PagingVerdict:
    # A session beside a RAM balloon: 214 major faults over 2 generated tokens, memory pressure some 9.7 %.
    return sampler.paging_verdict(HostPressure(2.0, 214, 219, 0, 0, 0, 0, 9.7, 2.0), 2)


def test_an_arm_that_paged_host_ram_is_never_the_session_line():
    cfg = LaunchConfig(model=Path("m.gguf"))
    quiet = sampler.paging_verdict(HostPressure(2.0, 0, 3, 0, 0, 0, 0, 0.0, 0.0), 64)
    default = ArmSessions("default", cfg, (_res(10.0), _res(10.4), _res(9.8)), host_paging=(quiet,) * 3)
    tuned = ArmSessions("tuned", cfg, (_res(8.0), _res(8.3), _res(7.9)), host_paging=(quiet,) * 3)
    # The fastest reuse arm paged in one round (its prompt cache pushed the model out of RAM): never chosen.
    paging = ArmSessions("tuned + prompt cache 2048 MiB", cfg, (_res(5.0), _res(5.1), _res(4.9)),
                         host_paging=(quiet, _paged(), quiet))
    stage = session_stage.judge([default, tuned, paging], "bundled", {})
    assert paging.paging is not None and stage.winner == "tuned" and stage.best is None
    assert "paged host RAM" in stage.reason, stage.reason
    record = stage.to_dict()["arms"][2]
    assert record["paging"].startswith("host_paging (") and record["host_paging"][1]["verdict"] == "host_paging"
    # The base line paged: the defaults are printed; both paged: no session line at all.
    base_paged = ArmSessions("tuned", cfg, tuned.results, host_paging=(_paged(),) * 3)
    only_default = session_stage.judge([default, base_paged], "b", {})
    assert only_default.winner == "default" and only_default.reason == "the base line paged host RAM: the defaults " \
                                                                         "are printed"
    both = session_stage.judge([ArmSessions("default", cfg, default.results, host_paging=(_paged(),) * 3),
                                base_paged], "b", {})
    assert both.winner is None and "never printed" in both.reason, both.reason
