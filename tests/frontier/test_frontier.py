"""The trade-off frontier: the context ladder, memory-gated multi-objective trials, Optuna's Pareto front, and
`launch-line --ctx/--slots` — on a fake runner (the measurement boundary), plus the hypervolume by hand."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import pytest
from optuna.trial import TrialState

from tests.fakes import FakeFrontierRunner, small_card
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import UsageError
from tuner.frontier import hypervolume, pareto
from tuner.machine.hardware import Hardware
from tuner.measure.workload import WorkloadKind, preset
from tuner.models.gguf_reader import inspect_model
from tuner.quality.kv_price import KvPrice
from tuner.search import result as study_result
from tuner.search import study

GIB = 2**30
CPU = Hardware("", 0, 0, 0.0, 0.0, 16 * GIB, 12 * GIB, 0, 20e9, 2, source="none")


def fake_kld(cfg):
    """KLD prices as the tiny model measures them, roughly (pricing itself is tested in tests/quality)."""
    cost = {"f16": 0.0, "q8_0": 0.0002, "q4_0": 0.004}
    kld = cost[cfg.cache_type_k.value] + cost[cfg.cache_type_v.value]
    return KvPrice(cfg.cache_type_k, cfg.cache_type_v, kld, 0.0, 99.0, 0.1, 512, 1)


def test_ctx_ladder_is_log_spaced_and_keeps_both_ends():
    assert pareto.ctx_ladder(4096, 32768) == (4096, 8192, 16384, 32768)
    assert pareto.ctx_ladder(1024, 131072, 5) == (1024, 3328, 11520, 38912, 131072)
    assert pareto.ctx_ladder(4096, 4096) == (4096,)
    load = preset(WorkloadKind.CHAT, 512, 128)
    assert pareto.depths(load, 8192, 1) == (8192 - 128 - 512, 8192 - 128)
    assert pareto.depths(load, 8192, 4) == (2048 - 640, 2048 - 128)
    assert pareto.depths(preset(WorkloadKind.CHAT, 512, 128, depth_tokens=6000), 4096, 1) == (5488, 6000)


def test_hypervolume_by_hand_and_against_a_grid_count():
    assert hypervolume.hypervolume([(1.0, 1.0)], (2.0, 2.0)) == pytest.approx(1.0)
    assert hypervolume.hypervolume([(0.0, 1.0), (1.0, 0.0)], (2.0, 2.0)) == pytest.approx(3.0)
    assert hypervolume.hypervolume([(3.0, 0.0)], (2.0, 2.0)) == 0.0
    rng = random.Random(3)
    pts = [tuple(rng.randint(0, 4) for _ in range(3)) for _ in range(12)]
    ref = (5, 5, 5)
    # Count the unit cells dominated by some point: the exact volume on an integer grid.
    cells = sum(any(all(p[i] <= c[i] for i in range(3)) for p in pts) for c in itertools.product(range(5), repeat=3))
    assert hypervolume.hypervolume([tuple(map(float, p)) for p in pts], tuple(map(float, ref))) == pytest.approx(cells)


@pytest.fixture(scope="module")
def model(demo_models):
    return demo_models[("qwen3moe", "Q4_K_M")]


def _run(model, hw, load, contexts, slots, tmp_path, trials, runner, margin=None):
    info = inspect_model(model)
    fs = pareto.build_frontier_space(model, info, hw, load, contexts, slots=slots, vram_margin_mib=margin)
    axes = pareto.Axes(fs.concurrent, kld=True)
    st, created = pareto.create_or_load("f", study.default_storage(tmp_path), axes, seed=0)
    assert created
    pareto.enqueue_seeds(st, fs, pareto.seed_configs(fs, info, hw, margin))
    out = pareto.run_frontier(st, fs, info, hw, load, runner, budget=study.Budget(trials=trials), axes=axes,
                                kld_of=fake_kld, vram_margin_mib=margin)
    return st, fs, out, pareto.frontier_of(st, fs, hw.has_gpu)


def test_cpu_frontier_has_a_point_per_context_and_launch_line_picks_one(model, tmp_path):
    runner = FakeFrontierRunner(fail_kv="q4_0/q4_0")
    load = preset(WorkloadKind.CHAT, 128, 32)
    st, fs, out, front = _run(model, CPU, load, (512, 1024, 2048, 4096), (1,), tmp_path, 14, runner)
    assert out.trials_this_run == 14 and not out.interrupted
    # Every trial measured at the depth its context allows (the reply ends at the slot's end).
    assert all(p.gen_depth == p.config.ctx - 32 and p.prompt_depth == p.gen_depth - 128 for p in runner.plans)
    # The seeds measured the best guess at each context first: each context is a point of the front.
    assert {p.ctx for p in front.points} == {512, 1024, 2048, 4096}
    assert front.axes == ("request_s", "ctx", "kld") and front.notes and "CPU" in front.notes[0]
    numbers = {t.number for t in st.best_trials}
    assert {p.trial for p in front.points} == numbers
    # A failed trial is pruned with its class, never scored.
    failed = [t for t in st.trials if t.user_attrs.get("status") == "failed"]
    assert all(t.values is None and t.user_attrs["failure"]["kind"] == "crashed" for t in failed)
    # Deeper is slower here, so along the front a larger context never has a shorter request at the same KLD.
    for a, b in itertools.combinations(front.points, 2):
        if a.kld == b.kld and a.ctx < b.ctx:
            assert a.request_s < b.request_s
    pick = front.at(ctx=2048)
    assert pick.ctx == 2048 and "-c 2048" in pick.launch_line
    assert pick.request_s == min(p.request_s for p in front.points if p.ctx == 2048)
    with pytest.raises(UsageError, match="no frontier point at --ctx 3000: the frontier has -c 512, -c 1024"):
        front.at(ctx=3000)
    # Ctrl-C: the trials in flight are told FAIL, nothing stays RUNNING, and the study resumes its count.
    def interrupt(p):
        raise KeyboardInterrupt

    info = inspect_model(model)
    before = len(st.trials)
    out2 = pareto.run_frontier(st, fs, info, CPU, load, runner, budget=study.Budget(trials=8),
                                 axes=pareto.Axes(), kld_of=fake_kld, on_progress=interrupt)
    from optuna.trial import TrialState

    assert out2.interrupted and out2.trials_this_run == 1
    assert TrialState.RUNNING not in {t.state for t in st.trials}
    later = [t.user_attrs["status"] for t in st.trials[before:] if t.user_attrs["status"] != "duplicate"]
    assert later[0] in ("measured", "failed") and later[1:] == ["interrupted"] * (len(later) - 1) and len(later) > 1
    # result.json carries the front with its Optuna trial numbers, and reads back.
    st.set_user_attr("frontier", front.to_dict())
    st.set_user_attr("model", str(model))
    res = study_result.result_from_study(st)
    again = study_result.StudyResult.from_dict(res.to_dict())
    assert pareto.Frontier.from_dict(again.frontier or {}) == front


def test_gpu_frontier_never_launches_what_cannot_fit_and_batch_searches_slots(model, tmp_path):
    info = inspect_model(model)
    hw = small_card(info, LaunchConfig(model=model, ctx=1024, parallel=1, flash_attn=FlashAttn.ON), info.n_layer // 4)
    runner = FakeFrontierRunner()
    load = preset(WorkloadKind.BATCH, 64, 32)
    st, fs, out, front = _run(model, hw, load, (1024, 2048, 4096), (1, 2, 4), tmp_path, 20, runner, margin=0)
    assert fs.concurrent and fs.slots == (1, 2, 4) and fs.base.n_cpu_moe is not None
    assert front.axes == ("request_s", "aggregate_tok_s", "ctx", "kld")
    from tuner.search import space

    # Nothing the memory model rejects, and no slot shorter than one request, was handed to the runner.
    for p in runner.plans:
        assert space.check(info, p.config, hw, 0).feasible
        assert p.config.ctx // p.config.parallel >= load.context_tokens
    infeasible = [t for t in st.trials if t.user_attrs.get("status") == "infeasible"]
    assert infeasible and all(any(v > 0 for v in t.user_attrs["constraints"].values()) for t in infeasible)
    # Context costs experts on this small card: the fewest host layers that fit grows with the context.
    lowest = {c: min(p.config.n_cpu_moe for p in runner.plans if p.config.ctx == c) for c in (1024, 4096)}
    assert lowest[1024] < lowest[4096]
    assert len({p.slots for p in front.points}) >= 2 and len({p.ctx for p in front.points}) >= 2
    assert front.at(slots=4).slots == 4 and front.at(ctx=4096, slots=1).ctx == 4096


def test_auto_tune_frontier_on_the_demo_model_end_to_end(demo_models, tmp_path):
    """The real engine, a short ladder: every context a measured trial; --workload batch adds slot counts."""
    from tests.conftest import run_cli

    model = str(demo_models[("qwen3moe", "Q4_K_M")])
    args = ["auto-tune", model, "--frontier", "-p", "16", "-n", "8", "--min-ctx", "256", "--max-ctx", "1024",
            "--max-kld", "off", "--results-dir", str(tmp_path)]
    done = run_cli(*args, "--trials", "4", timeout=300)
    assert done.returncode == 0, done.stderr
    # Not a terminal: one flushed line per trial, with the time left, instead of a bar.
    lines = [x for x in done.stderr.splitlines() if x.startswith("trial ")]
    assert [x.split(":")[0] for x in lines] == [f"trial {i}/4" for i in range(1, 5)], done.stderr
    assert all(" elapsed, about " in x and x.endswith(" left") for x in lines)
    assert "measuring " in done.stderr and "timed at the reply's depth" in done.stdout
    [result_file] = tmp_path.glob("*frontier*/result.json")
    res = study_result.load_result(result_file)
    front = pareto.Frontier.from_dict(res.frontier or {})
    assert front.contexts == (256, 512, 768, 1024) and len(front.points) >= 1
    # Every context measured (the seeds); which of them stand on the front is the measurement's to say: on a
    # loaded machine a deeper context can measure faster than a shallower one and dominate it.
    measured = {t.number for t in res.trials if t.status == "measured"}
    assert {t.config["ctx"] for t in res.trials if t.status == "measured"} == {256, 512, 768, 1024}
    # Host paging read over each trial's timed generation runs (llama-bench --progress), the load left out.
    assert all((t.host_paging or {}).get("verdict") == "none" for t in res.trials if t.status == "measured")
    assert all(p.paging_cell == "none" for p in front.points)
    assert {p.trial for p in front.points} <= measured and set(res.pareto) == {p.trial for p in front.points}
    assert "CPU only" in done.stdout and "frontier" in done.stdout
    report = (result_file.parent / "report.md").read_text()
    assert "## Frontier" in report and (result_file.parent / "frontier_context.png").stat().st_size > 100
    line = run_cli("launch-line", str(result_file), "--ctx", str(front.points[0].ctx))
    assert line.returncode == 0 and line.stdout.strip() == front.at(front.points[0].ctx).launch_line
    bad = run_cli("launch-line", str(result_file), "--ctx", "300")
    assert bad.returncode == 1 and "the frontier has -c " in bad.stderr and "Traceback" not in bad.stderr
    for extra in (["--pareto"], ["--goal", "context"]):
        refused = run_cli("auto-tune", model, "--frontier", *extra, "--results-dir", str(tmp_path))
        assert refused.returncode == 1 and "drop --pareto" in refused.stderr and len(refused.stderr.splitlines()) == 1
    lone = run_cli("auto-tune", model, "--max-ctx", "1024", "--results-dir", str(tmp_path))
    assert lone.returncode == 1 and "add --frontier" in lone.stderr

    # --json: stdout is the JSON alone; the progress still reaches stderr (a batch frontier once ran 487 s silent).
    batch = run_cli("auto-tune", model, "--frontier", "--workload", "batch", "-p", "16", "-n", "8", "--min-ctx",
                    "256", "--max-ctx", "512", "--max-kld", "off", "--results-dir", str(tmp_path / "b"), "--trials",
                    "6", "--json", timeout=300)
    assert batch.returncode == 0, batch.stderr
    [bfile] = (tmp_path / "b").glob("*frontier*/result.json")
    assert json.loads(batch.stdout)["result_dir"] == str(bfile.parent)
    blines = [x for x in batch.stderr.splitlines() if x.startswith("trial ")]
    assert [x.split(":")[0] for x in blines] == [f"trial {i}/6" for i in range(1, 7)], batch.stderr
    assert "measuring " in batch.stderr and "CPU only" in batch.stderr
    bfront = pareto.Frontier.from_dict(study_result.load_result(bfile).frontier or {})
    assert bfront.concurrent and len({p.slots for p in bfront.points}) >= 2
    assert all(p.aggregate_tok_s and p.aggregate_tok_s > 0 for p in bfront.points)
    assert all(p.paging_cell == "none" for p in bfront.points)  # batched-bench: every batch but the first
    assert (bfile.parent / "frontier_slots.png").exists()
    n = bfront.points[0].slots
    assert run_cli("launch-line", str(bfile), "--slots", str(n)).stdout.count(f"-np {n}") == 1


def _point(trial, ctx, request_s, kv="f16", fa="on"):
    cfg = {"model": "m.gguf", "cache_type_k": kv, "cache_type_v": kv, "flash_attn": fa, "threads": 2, "ubatch": None,
           "n_cpu_moe": None, "ctx": ctx, "parallel": 1}
    return pareto.FrontierPoint(trial, ctx, 1, cfg, request_s, ctx - 8, 100.0, 1000.0, None, 0.0, None, 2 * GIB,
                                  f"llama-server -m m.gguf -c {ctx}")


def test_report_table_and_where_a_single_winner_sits(tmp_path):
    from tests.search.test_finish import _m
    from tuner.report import frontier_report
    from tuner.search.finish import Finish

    front = pareto.Frontier(("request_s", "ctx", "kld"), (_point(0, 1024, 0.5), _point(3, 4096, 1.0)),
                              (1024, 4096), (1,), False, False, 5, ("CPU only: ...",))
    fres = study_result.StudyResult(study="m__cpu__frontier-1", model="m.gguf", finish=Finish((), ()),
                                    frontier=front.to_dict(), workload={"kind": "chat", "prompt_tokens": 8},
                                    hardware={"physical_cores": 2})
    frontier_report.write(fres, tmp_path / fres.study)
    md = (tmp_path / fres.study / "report.md").read_text()
    assert "## Frontier" in md and "| 4,096 | 1 | f16/f16 fa on t 2 | 1.000 | 100.0 | 0.00000 | 2.00 | ? | 3 |" in md
    assert "paging ?: host paging not measured for that point" in md  # a front stored before the verdict
    assert "from 1,024 to 4,096 tokens of context a request at full depth takes 2.00x as long" in md
    assert (tmp_path / fres.study / "frontier_context.png").exists() is False  # no measured trials: no plot
    assert frontier_report.launch_line(fres, 4096, None) == "llama-server -m m.gguf -c 4096 -np 1 -t 2 -fa on"

    win = _m("candidate-1", [1.3, 1.31, 1.29])
    # llama.cpp's defaults spelled out (-fa auto, all cores) run as the frontier's explicit settings.
    on = replace(win, config=dict(_point(0, 1024, 0.5).config, flash_attn="auto", threads=None))
    single = study_result.StudyResult(study="s", model="m.gguf", finish=Finish((on,), ()))
    assert frontier_report.winner_on_frontier(single, tmp_path) == (
        f"on the frontier ({tmp_path / fres.study / 'result.json'}): the winner runs as its point at -c 1024 "
        "(trial 0, 0.500 s/request at full depth); the same settings at -c 4096")
    off = replace(win, config=dict(_point(0, 4096, 0.5, kv="q8_0").config))
    single = study_result.StudyResult(study="s", model="m.gguf", finish=Finish((off,), ()))
    assert "not on it; at -c 4096 its fastest point is trial 3" in (
        frontier_report.winner_on_frontier(single, tmp_path) or "")
    other_model = study_result.StudyResult(study="s", model="other.gguf", finish=Finish((off,), ()))
    assert frontier_report.winner_on_frontier(other_model, tmp_path) is None


def test_a_small_space_is_covered_in_as_many_trials_as_it_has_configs(model, tmp_path):
    """The sampler's repeats cost nothing: told FAIL as duplicates, with their original's constraints (search.dedup,
    the single-winner study's mechanism too); an untried config is enqueued instead."""
    runner = FakeFrontierRunner()
    load = preset(WorkloadKind.CHAT, 128, 32)
    info = inspect_model(model)
    fs = pareto.build_frontier_space(model, info, CPU, load, (512, 1024, 2048), threads=(2,),
                                       kv_pairs=[(CacheType.F16, CacheType.F16), (CacheType.Q8_0, CacheType.Q8_0)])
    grid = set(pareto.iter_configs(fs))
    assert len(grid) == 9
    st, _ = pareto.create_or_load("small", study.default_storage(tmp_path), pareto.Axes(), seed=1)
    out = pareto.run_frontier(st, fs, info, CPU, load, runner, budget=study.Budget(trials=12),
                                axes=pareto.Axes(), kld_of=fake_kld)
    assert {p.config for p in runner.plans} == grid and len(runner.plans) == 9  # each once, then it stops
    assert out.trials_this_run == 9 and not out.interrupted
    statuses = [t.user_attrs["status"] for t in st.trials]
    assert statuses.count("measured") == 9 and set(statuses) <= {"measured", "duplicate"}
    repeats = [t for t in st.trials if t.user_attrs["status"] == "duplicate"]
    for t in repeats:
        first = st.trials[t.user_attrs["duplicate_of"]]
        assert t.state == TrialState.FAIL and t.params == first.params
        assert t.user_attrs[study.CONSTRAINTS_ATTR] == first.user_attrs[study.CONSTRAINTS_ATTR]


def test_a_dense_frontier_spans_ngl_over_every_context(trained_model):
    """SmolLM2-135M (dense, 30 layers) on a card whose budget holds about half of it: the frontier's offload axis is
    -ngl, spanning the union of every context's fitting range (fewer layers fit at 8K than at 1K), and its points
    name the -ngl they ran with."""
    from tuner.report import frontier_report
    from tuner.search import space

    info = inspect_model(trained_model)
    card = Hardware("RTX test", 12 * GIB, 12 * GIB, 360e9, 25e9, 16 * GIB, 12 * GIB, 0, 50e9, 8, source="catalog",
                    vram_budget_override_bytes=1524 * 2**20)
    load = preset(WorkloadKind.CHAT, 128, 32)
    per_ctx = [space.build_space(trained_model, info, card, ctx=c, parallel=1, prompt_tokens=128)
               for c in (1024, 8192)]
    short, long = (s.n_gpu_layers for s in per_ctx)
    assert short is not None and long is not None and long[0] < short[0]  # a longer cache leaves room for fewer
    fs = pareto.build_frontier_space(trained_model, info, card, load, (1024, 8192))
    assert fs.base.n_cpu_moe is None and fs.base.n_gpu_layers == (long[0], max(short[1], long[1]))
    assert {c.n_gpu_layers for c in pareto.iter_configs(fs)} == set(range(long[0], short[1] + 1))
    point = {"cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "on", "n_gpu_layers": long[0]}
    assert frontier_report.config_label(point) == f"f16/f16 fa on ngl {long[0]}"


class PagingRunner(FakeFrontierRunner):
    """The fake runner on a machine whose RAM holds the model up to a context: deeper configs read their model
    back from disk while they generate (the verdict from counters as a 9B-shaped model measured beside a RAM
    balloon: 107 major faults per generated token), the others measured quiet."""

    def __init__(self, pages_from_ctx: int) -> None:
        super().__init__()
        self.pages_from_ctx = pages_from_ctx

    def __call__(self, plans):
        from tuner.machine import sampler
        from tuner.machine.pressure import HostPressure
        from tuner.measure import phases

        out = []
        for p, res in zip(plans, super().__call__(plans), strict=True):
            paging = p.config.ctx >= self.pages_from_ctx
            host = HostPressure(64.0, 107 * 64 if paging else 0, 107 * 64 + 5, 0, 0, 0, 6848 if paging else 0,
                                9.7 if paging else 0.0, 2.4 if paging else 0.0)
            verdict = sampler.paging_verdict(host, 64)
            if verdict.paging:  # spelled for the config, as the engine's measurement spells it
                verdict = replace(verdict, fix=phases.paging_fix(p.config))
            out.append(replace(res, request_s=res.request_s * (6 if paging else 1), host_paging=verdict))
        return out


def test_a_trial_that_pages_host_ram_is_kept_off_the_front_and_never_a_line(model, tmp_path):
    from tuner.report import frontier_report

    load = preset(WorkloadKind.CHAT, 128, 32)
    st, fs, out, front = _run(model, CPU, load, (512, 1024, 4096), (1,), tmp_path, 8, PagingRunner(4096))
    statuses = {t.number: t.user_attrs.get("status") for t in st.trials}
    paged = [n for n, s in statuses.items() if s == pareto.PAGING]
    assert paged and all(st.trials[n].state == TrialState.PRUNED for n in paged)
    # Its figures and verdict are kept; it is not on the front, and the front says why.
    t = st.trials[paged[0]]
    assert t.user_attrs["host_paging"]["verdict"] == "host_paging" and t.user_attrs["request_s"] > 0
    assert {p.ctx for p in front.points} == {512, 1024} and all(p.paging_cell == "none" for p in front.points)
    assert {p["trial"] for p in front.paged} == set(paged) and front.paged[0]["ctx"] == 4096
    assert any("paged host RAM and are kept off the front" in n and "107.0 per generated token" in n
               for n in front.notes), front.notes
    assert not any("no point measured at 4,096" in n for n in front.notes)  # it was measured: it paged
    with pytest.raises(UsageError, match="no line at --ctx 4096: every config measured there paged host RAM"):
        front.at(ctx=4096)
    # result.json and report.md carry it.
    stored = json.dumps(front.to_dict(), sort_keys=True)
    again = pareto.Frontier.from_dict(json.loads(stored))
    assert json.dumps(again.to_dict(), sort_keys=True) == stored and again.paged[0]["fix"]
    st.set_user_attr("frontier", front.to_dict())
    st.set_user_attr("model", str(model))
    res = study_result.result_from_study(st)
    assert {r.number for r in res.trials if r.status == pareto.PAGING} == set(paged)
    md = frontier_report.markdown(res)
    assert "## Kept off the front: host paging" in md and "| 4,096 | 1 |" in md.split("Kept off the front")[1]
    # A resumed run does not measure a paging config again (held like one the memory gate refused).
    again_out = pareto.run_frontier(st, fs, inspect_model(model), CPU, load, PagingRunner(4096),
                                    budget=study.Budget(trials=4), axes=pareto.Axes(), kld_of=fake_kld)
    assert again_out.trials_this_run >= 1
    configs = [t.user_attrs.get("config") for t in st.trials if t.user_attrs.get("status") == pareto.PAGING]
    assert len(configs) == len({json.dumps(c, sort_keys=True) for c in configs})
