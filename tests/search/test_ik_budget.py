"""ik_llama.cpp under a VRAM budget on a GPU (issue 62). ik has no ``-fitt`` (its --fit is a switch, off unless given,
common.cpp) and its bare launch puts nothing on the card (``llama_model_default_params``: ``n_gpu_layers`` 0): under
--vram-budget or a --vram-margin above --fit's own 1024 MiB its default arm is its bare launch, kept and measured,
never given the -fitt its dialect refuses; a line the dialect refuses inside a round is that round's failure with its
reason, never an error that ends the tune; and a line that leaves the placement open is priced where ik puts it (on
the host), not where llama.cpp's --fit would. The card is a fake NVML (FakeNVML, the hardware boundary)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.fakes import FakeNVML
from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.engine.kinds import IK_LLAMA, LLAMA_CPP
from tuner.machine import hardware
from tuner.measure import workload
from tuner.measure.failures import FailureKind
from tuner.measure.workload import Workload, WorkloadKind
from tuner.models import demo_model, gguf_reader
from tuner.plan.placement import placed_by_fit
from tuner.search import finish, known_good, session_stage, space
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.trials import config_from_dict
from tuner.search.watched_round import shown_line, watched_round

GIB, MIB = 2**30, 2**20
CARD = "NVIDIA GeForce RTX 4090"
BUDGET_MIB = 6000
IK_REFUSES_FITT = ("ik_llama.cpp does not read -fitt: it is llama.cpp's; leave it at its default for an "
                   "ik_llama.cpp line")


def _card(budget_mib: float | None) -> hardware.Hardware:
    """A 24 GiB card with 4 GiB held by others (20,480 MiB free), with or without --vram-budget."""
    hw = hardware.probe_hardware(FakeNVML([(CARD, 24 * GIB, 4 * GIB)]), host_bandwidth_s=0)
    return hardware.with_vram_budget(replace(hw, ram_total_bytes=64 * GIB, ram_available_bytes=64 * GIB), budget_mib)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, gguf_reader.ModelInfo]:
    path = demo_model.write_demo_model(tmp_path_factory.mktemp("ik-budget") / "qwen3moe.gguf", arch="qwen3moe")
    return path, gguf_reader.inspect_model(path)


# --vram-budget 6000 holds back 14,480 MiB of the free VRAM; --vram-margin 2048 asks twice --fit's own margin: either
# way llama.cpp's bare launch would fill what the user kept out (its default arm is dropped, -fitt bounds the agent's).
BUDGETS = [pytest.param(BUDGET_MIB, None, id="vram-budget"), pytest.param(None, 2048, id="vram-margin-2048")]


@pytest.mark.fast
@pytest.mark.parametrize(("budget_mib", "margin_mib"), BUDGETS)
def test_under_a_budget_ik_s_default_arm_is_its_bare_launch_kept_and_runnable(moe, budget_mib, margin_mib):
    path, info = moe
    hw = _card(budget_mib)
    assert finish.fit_target_mib(hw, margin_mib) > finish.FIT_MARGIN_MIB  # a budget --fit would not keep
    sp = space.build_space(path, info, hw, ctx=4096, parallel=1, prompt_tokens=512, kind=IK_LLAMA,
                           vram_margin_mib=margin_mib)
    default, fit = known_good.own_choice(sp, info, hw, None, margin_mib)  # ik has no llama-fit-params: no fit arm
    assert fit is None and default.engine == IK_LLAMA.name and default.fit_target_mib is None
    assert known_good.bounded_default(sp, hw, margin_mib).fit_target_mib is None
    # The bare launch, as ik reads it: its dialect refuses nothing in it.
    line = flags.launch_line(default)
    assert "-fitt" not in line and line.startswith(f"llama-server -m {path} -c 4096 -np 1"), line
    assert finish.baseline_configs(sp, hw, None, margin_mib, default) == [("default", default)]
    # The agent's session stage runs the same default: the tuned line (ik's own explicit placement) beside it.
    tuned = space.make_config(sp, {"n_cpu_moe": sp.n_cpu_moe[0] if sp.n_cpu_moe else 0})
    arms, notes = session_stage.stage_arms(default, tuned, info, hw, None, margin_mib)
    lines = {label: flags.launch_line(cfg) for label, cfg in arms}
    assert lines["default"] == line and all("-fitt" not in x for x in lines.values()), lines
    # A reuse setting ik does not read is no arm of its (capabilities unknown here: its --help would not list it).
    assert "tuned + cache-reuse 256" not in lines
    assert notes["cache-reuse 256"] == ("not launched: ik_llama.cpp's checkpoint spacing, --cache-reuse and "
                                        "speculation are not measured by moe-tune: leave them at their defaults "
                                        "for an ik_llama.cpp line")
    assert "-ngl 999" in lines["tuned"] and "--n-cpu-moe" in lines["tuned"], lines
    # llama.cpp on the same card keeps the budget by -fitt, and its bare launch is no arm: unchanged.
    llama = space.build_space(path, info, hw, ctx=4096, parallel=1, prompt_tokens=512, vram_margin_mib=margin_mib)
    llama_default, _ = known_good.own_choice(llama, info, hw, None, margin_mib)
    assert llama_default.fit_target_mib == finish.fit_target_mib(hw, margin_mib)
    assert finish.baseline_configs(llama, hw, None, margin_mib, llama_default) == []


@pytest.mark.fast
def test_ik_s_open_placement_is_priced_on_the_host_where_ik_puts_it(moe):
    """llama.cpp's --fit keeps on the card what fits; ik's bare launch keeps every layer on the host, so its default
    line is priced there (with --n-cpu-moe too: without -ngl ik offloads nothing), and an explicit -ngl is kept."""
    path, info = moe
    hw = _card(None)
    bare = LaunchConfig(model=path, ctx=4096, parallel=1)
    assert placed_by_fit(info, bare, hw, engine=LLAMA_CPP) == bare  # the demo model fits the card whole: all on it
    ik_bare = replace(bare, engine=IK_LLAMA.name)
    assert placed_by_fit(info, ik_bare, hw, engine=IK_LLAMA) == replace(ik_bare, n_gpu_layers=0)
    assert placed_by_fit(info, replace(ik_bare, n_cpu_moe=3), hw, engine=IK_LLAMA).n_gpu_layers == 0
    explicit = replace(ik_bare, n_gpu_layers=999, n_cpu_moe=3)
    assert placed_by_fit(info, explicit, hw, engine=IK_LLAMA) == explicit
    # No GPU: nothing to place, whatever the engine.
    assert placed_by_fit(info, ik_bare, hw.cpu_only(), engine=IK_LLAMA) == ik_bare


@pytest.mark.fast
def test_a_line_its_dialect_refuses_is_a_failed_round_with_the_reason():
    """ik's dialect refuses -fitt before anything is launched: inside a round that is the arm's failure, and the arm's
    record and messages carry no line of it (it has none), never an error that ends the tune."""
    refused = LaunchConfig(model=Path("m.gguf"), ctx=4096, parallel=1, fit_target_mib=15504, engine=IK_LLAMA.name)
    got = watched_round(refused, "default", "round 1", lambda: flags.server_argv(Path("llama-server"), refused))
    assert got.value is None and got.failure is not None
    assert (got.failure.kind, got.failure.reason) == (FailureKind.REJECTED_CONFIG, IK_REFUSES_FITT)
    assert shown_line(refused) == ""
    m = finish.summarize("default", refused, [got.failure], Workload(WorkloadKind.CUSTOM, 64, 8))
    assert m.gen_tok_s is None and m.launch_line == "" and m.failure is not None
    assert m.failure["reason"] == IK_REFUSES_FITT
    arm = session_stage.ArmSessions("default", refused, (None,), failure=got.failure.summary())
    assert arm.to_dict()["launch_line"] == "" and session_stage._lost(arm) == "failed"


def _arm(label: str, scores: list[float], growth: int, engine: str = IK_LLAMA.name) -> ServerMeasurement:
    return ServerMeasurement(label, {"model": "m.gguf", "engine": engine}, "llama-server -m m.gguf", [], max(scores),
                             [], None, None, None, None, scores=scores, vram_growth_bytes=growth)


@pytest.mark.fast
def test_ik_s_default_is_the_reference_within_the_budget_and_said_to_break_it_over():
    cand = _arm("candidate-1", [1.2, 1.21, 1.19, 1.2], 5000 * MIB)
    within = _arm("default", [1.0, 1.01, 0.99, 1.0], 400 * MIB)  # a CUDA context and compute buffers: no layers
    fin = Finish((cand,), (within,), vram_budget_bytes=BUDGET_MIB * MIB)
    assert fin.reference is within and fin.winner is cand
    assert fin.decision.reason == "candidate-1 was decided faster than default"
    over = replace(within, vram_growth_bytes=7000 * MIB)
    lost = Finish((cand,), (over,), vram_budget_bytes=BUDGET_MIB * MIB)
    assert lost.reference is None and lost.winner is cand
    assert lost.decision.reason == "ik_llama.cpp's own choice broke the VRAM budget (default): candidate-1 is printed"


# -------------------------------------------------------------------------------------------- on the ik engine

SERVER_MIB = 400  # what each llama-server holds on the fake card: a CUDA context and compute buffers, no layers


class FakeCardServing(FakeNVML):
    """A FAKE driver (the NVML boundary) whose card's used VRAM counts ``SERVER_MIB`` for each llama-server this test
    runs, as a CUDA build's server would hold with no layer on the card (the CPU build here holds none)."""

    def nvmlDeviceGetMemoryInfo(self, handle: int):  # noqa: N802 - mirrors pynvml
        mem = super().nvmlDeviceGetMemoryInfo(handle)
        held = sum(used for _, used in self._contexts())
        return type(mem)(total=mem.total, free=mem.free - held, used=mem.used + held)


@pytest.fixture
def served_card(ik_loc, monkeypatch) -> FakeCardServing:
    """The fake driver as the ``pynvml`` every sampler of this process opens (restored after the test)."""
    fake = FakeCardServing([(CARD, 24 * GIB, 4 * GIB)],
                           contexts=(str(ik_loc.tool("llama-server").resolve()), SERVER_MIB * MIB))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


@pytest.mark.parametrize("kind", [WorkloadKind.CHAT, WorkloadKind.AGENT])
@pytest.mark.parametrize(("budget_mib", "margin_mib"), BUDGETS)
def test_ik_tuned_under_a_budget_prints_a_line_with_its_default_measured(ik_loc, demo_models, served_card, tmp_path,
                                                                        budget_mib, margin_mib, kind):
    """What auto-tune --engines ik runs after its search, on a GPU with --vram-budget 6000 or --vram-margin 2048:
    llama.cpp's choice under such a budget was fit's (which ik lacks) and -fitt on the agent's default (which ik's
    dialect refuses), so the finish had no reference and the session stage ended in an error. Now ik's default arm,
    its bare launch, is measured within the budget (its VRAM read), a line is printed, and the agent's sessions run
    the same default and print a line. (The command itself stops a CPU build on a GPU machine before its search:
    tuner.measure.gpu_use.preflight; these are its stages after that check.)"""
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = gguf_reader.inspect_model(model)
    caps = build.capabilities(ik_loc)
    hw = _card(budget_mib)
    load = workload.preset(kind, 128, 8, rounds=1, depth_tokens=512 if kind is WorkloadKind.AGENT else None)
    sp = space.build_space(model, info, hw, ctx=2048, parallel=1, prompt_tokens=load.prompt_tokens, kind=caps.kind,
                           vram_margin_mib=margin_mib)
    fit = finish.fit_config(ik_loc, finish.default_config(sp), info.n_layer,
                            fit_target=finish.fit_target_mib(hw, margin_mib))
    default, fit = finish.own_choice(sp, info, hw, fit, margin_mib)
    baselines = finish.baseline_configs(sp, hw, fit, margin_mib, default)
    assert fit is None and [label for label, _ in baselines] == ["default"]
    # ik's own placement (explicit -ngl and its host experts): this CPU build's --help lists no -ngl, so its dialect
    # refuses that line, a failed round with the reason; beside it the same line without -ngl, which it runs.
    placed = space.make_config(sp, {"n_cpu_moe": sp.n_cpu_moe[0] if sp.n_cpu_moe else 0, "threads": 2})
    assert placed.n_gpu_layers is not None and placed.fit_target_mib is None
    runnable = replace(placed, n_gpu_layers=None, n_cpu_moe=None)
    budget = hw.vram_budget_bytes or None
    done = finish.finish(ik_loc, [(0, runnable), (1, placed)], baselines, load, log_dir=tmp_path / "finish",
                         caps=caps, rounds=finish.Rounds(min=2, max=2, select=1), vram_budget_bytes=budget)
    refused = next(m for m in done.candidates if m.config.get("n_gpu_layers") is not None)
    assert refused.gen_tok_s is None and refused.failure is not None and refused.failure["reason"] == (
        f"llama-server of this engine (ik_llama.cpp) does not accept -ngl {placed.n_gpu_layers}: update it "
        "(`moe-tune engine install --engine ik`) or leave that setting at its default")
    ref = done.judged("default")
    assert ref is not None and ref.failure is None and ref.gen_tok_s is not None, ref
    assert ref.vram_growth_bytes == SERVER_MIB * MIB and not done.over_budget(ref) and done.eligible(ref)
    assert done.reference is ref and "-fitt" not in ref.launch_line and ref.launch_line.startswith(
        f"llama-server -m {model} -c 2048 -np 1")
    printed = done.winner
    assert printed is not None and printed.label in ("default", "candidate-1"), done.decision.reason
    if kind is WorkloadKind.AGENT:
        req = session_stage.SessionRequest(depth_tokens=512, gen_tokens=4, rounds=2)
        stage = session_stage.run_stage(ik_loc, default, config_from_dict(printed.config), info, hw, req,
                                        result_dir=tmp_path / "result", caps=caps, vram_margin_mib=margin_mib)
        arm = stage.arm("default")
        assert stage.winner is not None, stage.reason
        assert arm is not None and arm.failure is None and arm.median_session_s is not None
        assert arm.vram_verdict == "within" and "-fitt" not in flags.launch_line(arm.config)
