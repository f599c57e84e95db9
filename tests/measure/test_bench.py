"""Measuring for real on the demo model: llama-bench at depth with spread, grouped runs, server trials,
classified failures and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli
from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.core.errors import TrialFailedError, UsageError
from tuner.engine import flags
from tuner.engine.build import EngineLocation
from tuner.machine.sampler import Sampler, SpillKind
from tuner.measure import bench, failures
from tuner.measure.bench import BenchRow
from tuner.measure.failures import FailureKind
from tuner.measure.workload import Workload, WorkloadKind

SMALL = Workload(WorkloadKind.CUSTOM, prompt_tokens=48, gen_tokens=8, rounds=1)


@pytest.fixture(scope="module")
def model(demo_models) -> Path:
    return demo_models[("qwen3moe", "Q4_K_M")]


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_spread_median_cv_and_rse():
    s = bench.spread([90.0, 100.0, 110.0, 100.0])
    assert s.median == 100.0 and s.mean == 100.0 and s.n == 4
    assert s.cv_pct == pytest.approx(8.165, abs=1e-3) and s.rse_pct == pytest.approx(8.165 / 2, abs=1e-3)
    assert bench.spread([5.0]).rse_pct == float("inf")  # one sample says nothing about noise


def test_configs_are_grouped_only_into_exact_cross_products():
    m = Path("/m.gguf")
    fa_on, fa_off = FlashAttn.ON, FlashAttn.OFF
    product = [LaunchConfig(model=m, flash_attn=fa, cache_type_k=k) for fa in (fa_on, fa_off)
               for k in (CacheType.F16, CacheType.Q8_0)]
    assert bench.group_configs(product) == [product]
    # Not a product: llama-bench would also run (off, q8_0 V) and abort the sweep, so vary one setting per run.
    partial = [LaunchConfig(model=m, flash_attn=fa_on, cache_type_v=CacheType.Q8_0),
               LaunchConfig(model=m, flash_attn=fa_off), LaunchConfig(model=m, flash_attn=fa_on)]
    groups = bench.group_configs(partial)
    assert sorted(map(len, groups)) == [1, 2] and sum(map(len, groups)) == 3
    for group in groups:
        flags.bench_group_argv(Path("llama-bench"), group, n_prompt=1, n_gen=1, repetitions=1)
    # A different expert placement is a different model load: its own run.
    assert len(bench.group_configs([LaunchConfig(model=m, n_cpu_moe=0), LaunchConfig(model=m, n_cpu_moe=4)])) == 2
    # The op-offload threshold is the process's environment (GGML_OP_OFFLOAD_MIN_BATCH): one run per threshold.
    by_env = [LaunchConfig(model=m, n_cpu_moe=4, op_offload_min_batch=t, flash_attn=fa)
              for t in (None, 512) for fa in (fa_on, fa_off)]
    assert [[c.op_offload_min_batch for c in g] for g in bench.group_configs(by_env)] == [[None, None], [512, 512]]


def test_each_of_an_engine_s_levers_is_a_llama_bench_run_of_its_own():
    """ik's llama-bench reads one value of each lever per process: configs that differ in any lever the kind lists
    (tuner.engine.kinds, the one list of them) are never one run."""
    from tuner.engine.kinds import IK_LLAMA

    base = LaunchConfig(model=Path("/m.gguf"), engine=IK_LLAMA.name, threads=2)
    values = {"run_time_repack": True, "fused_moe": False, "merge_up_gate": True, "attn_max_batch": 256,
              "graph_reuse": False, "smart_experts": (6, 0.5), "only_active_experts": False}
    assert set(values) == set(IK_LLAMA.levers)
    for lever, value in values.items():
        other = replace(base, **{lever: value}, threads=4)  # threads alone would share one run (-t 2,4)
        assert bench.group_configs([base, other]) == [[base], [other]], lever
    assert bench.group_configs([base, replace(base, threads=4)]) == [[base, replace(base, threads=4)]]


def test_rows_are_matched_back_to_their_config():
    def row(fa: str) -> BenchRow:
        return BenchRow(8, 0, 0, 1.0, 0.0, (1.0,), "x", (("flash_attn", fa), ("type_k", "f16"), ("type_v", "f16")))
    rows = (row("1"), row("0"))
    assert bench.rows_for(LaunchConfig(model=Path("m"), flash_attn=FlashAttn.OFF), rows) == (rows[1],)


def test_grouped_llama_bench_at_depth_reports_each_config(engine_loc, model):
    cfgs = [LaunchConfig(model=model, threads=2, flash_attn=fa) for fa in (FlashAttn.ON, FlashAttn.OFF)]
    on, off = bench.run_bench_group(engine_loc, cfgs, n_prompt=32, n_gen=8, depth=[0, 128], repetitions=2)
    assert on.argv == off.argv  # one llama-bench process for both
    assert on.argv[on.argv.index("-fa") + 1] == "on,off" and on.argv[on.argv.index("-d") + 1] == "0,128"
    for res, code in ((on, "1"), (off, "0")):
        assert sorted((r.kind, r.n_depth) for r in res.rows) == [("pp", 0), ("pp", 128), ("tg", 0), ("tg", 128)]
        assert all(dict(r.params)["flash_attn"] == code and len(r.samples_tok_s) == 2 for r in res.rows)
        assert res.row("tg", 128).spread.median > 0
        # Host paging per config, over its own timed generation runs (--progress), none of the prompt tests'.
        assert [(r.kind, r.host_runs) for r in res.rows if r.host is not None] == [("tg", 2), ("tg", 2)]
        assert res.host_paging.measured and not res.host_paging.paging, res.host_paging.describe()
    assert "--progress" in on.argv


def test_prompt_and_generation_at_the_workloads_own_depths(engine_loc, model):
    """A request's prompt starts on its history (depth 16 here) and its reply comes after the prompt (depth 48):
    two llama-bench processes of one config, each test at its own depth, none timed at the other's."""
    cfg = LaunchConfig(model=model, threads=2)
    res = bench.run_bench(engine_loc, cfg, n_prompt=32, n_gen=4, depth=16, gen_depth=48, repetitions=1)
    assert [(r.kind, r.n_depth) for r in res.rows] == [("pp", 16), ("tg", 48)]
    assert res.argv.count("&&") == 1 and res.prompt_tok_s > 0 and res.gen_tok_s > 0


def test_noise_control_repeats_until_the_error_is_small_or_the_cap(engine_loc, model):
    cfg = LaunchConfig(model=model, threads=2)
    cap = 6
    res = bench.run_bench(engine_loc, cfg, n_prompt=32, n_gen=8, repetitions=None, depth=64, max_repetitions=cap)
    for row in res.rows:
        n = len(row.samples_tok_s)
        assert n >= bench.MIN_REPETITIONS and n <= cap
    worst = max(r.spread.rse_pct for r in res.rows)
    assert worst <= bench.RSE_TARGET_PCT or all(len(r.samples_tok_s) == cap for r in res.rows)
    assert res.runs == 1 + (len(res.rows[0].samples_tok_s) - bench.MIN_REPETITIONS + 2) // 3


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(kv.partition("=")[::2] for kv in raw.split("\0") if kv)


class EnvironReadingSampler(Sampler):
    """The real sampler, which also reads the environment of the process it is attached to as it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.environs: list[tuple[int, dict[str, str]]] = []

    def attach(self, pid: int) -> None:
        self.environs.append((pid, _environ(pid)))
        super().attach(pid)


def test_the_op_offload_threshold_reaches_the_engines_environment(engine_loc, model, tmp_path):
    """The threshold travels as GGML_OP_OFFLOAD_MIN_BATCH in the environment of the real llama-bench and
    llama-server a trial starts (read from /proc while they run; the CPU build ignores it), not in argv; a config
    without one leaves the engine's default. Both processes are gone afterwards."""
    cfg = LaunchConfig(model=model, ctx=512, parallel=1, threads=2, op_offload_min_batch=4096)
    sampler = EnvironReadingSampler()
    with sampler:
        res = bench.run_bench(engine_loc, cfg, n_prompt=16, n_gen=4, repetitions=1, sampler=sampler)
    [(pid, env)] = sampler.environs
    assert env.get("GGML_OP_OFFLOAD_MIN_BATCH") == "4096" and res.prompt_tok_s > 0
    assert not any("OFFLOAD" in a for a in res.argv) and _gone(pid)
    seen: dict[str, dict[str, str]] = {}

    def ready(server) -> None:
        seen[str(server.proc.pid)] = _environ(server.proc.pid)

    bench.run_server_trial(engine_loc, cfg, SMALL, log_dir=tmp_path, on_ready=ready)
    default = replace(cfg, op_offload_min_batch=None)
    bench.run_server_trial(engine_loc, default, SMALL, log_dir=tmp_path, on_ready=ready)
    (pid_set, env_set), (pid_default, env_default) = seen.items()
    assert env_set.get("GGML_OP_OFFLOAD_MIN_BATCH") == "4096"
    assert env_default.get("GGML_OP_OFFLOAD_MIN_BATCH") == os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH")
    assert _gone(int(pid_set)) and _gone(int(pid_default))


def test_server_trial_at_parallel_two(engine_loc, model, tmp_path):
    cfg = LaunchConfig(model=model, ctx=512, parallel=2, threads=2)
    trial = bench.run_server_trial(engine_loc, cfg, SMALL, log_dir=tmp_path)
    assert [lvl.concurrency for lvl in trial.levels] == [1, 2]
    assert [len(lvl.requests) for lvl in trial.levels] == [1, 2]
    for lvl in trial.levels:
        assert all(r.prompt_n == 48 and r.gen_n == 8 for r in lvl.requests)  # exact P and G
        assert lvl.per_request_gen_tok_s > 0 and lvl.aggregate_gen_tok_s > 0 and lvl.ttft_s > 0
    assert trial.argv[trial.argv.index("-np") + 1] == "2" and "--log-jsonl" in trial.argv
    assert trial.memory.rss_peak_bytes and trial.memory.rss_peak_bytes > 2**20
    assert trial.spill.kind is SpillKind.NONE and trial.tokens_per_joule is None  # no GPU, no power
    assert {r["type"] for r in trial.log_records} >= {"fit_memory_breakdown"}
    host = trial.memory_breakdown.row("Host")  # llama.cpp's own figures, parsed by tuner.engine.breakdown
    assert host is not None and host.model_mib > 0 and host.context_mib > 0 and host.compute_mib > 0


def test_prompt_that_cannot_fit_the_slot_is_refused_before_launch(engine_loc, model, tmp_path):
    cfg = LaunchConfig(model=model, ctx=512, parallel=2)
    with pytest.raises(UsageError, match="do not fit the 256-token slot context"):
        bench.run_server_trial(engine_loc, cfg, Workload(WorkloadKind.CUSTOM, 250, 16), log_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_crash_is_classified_with_signal_and_argv(engine_loc, model, tmp_path):
    cfg = LaunchConfig(model=model, ctx=512, parallel=1, threads=2)
    with pytest.raises(TrialFailedError) as info:
        bench.run_server_trial(engine_loc, cfg, SMALL, log_dir=tmp_path,
                               on_ready=lambda server: os.kill(server.proc.pid, signal.SIGSEGV))
    f = info.value.failure
    assert f.kind is FailureKind.CRASHED and f.signal_name == "SIGSEGV" and f.returncode == -11
    assert f.argv[:3] == (str(engine_loc.tool("llama-server")), "-m", str(model))
    assert "listening" in f.stderr_tail  # the tail of the server's own log


def test_timeouts_are_classified(engine_loc, model, tmp_path):
    cfg = LaunchConfig(model=model, ctx=512, parallel=1, threads=2)
    with pytest.raises(TrialFailedError) as info:
        bench.run_server_trial(engine_loc, cfg, SMALL, log_dir=tmp_path, load_timeout_s=0.01)
    assert info.value.failure.kind is FailureKind.TIMED_OUT and info.value.failure.argv
    with pytest.raises(TrialFailedError) as info:
        bench.run_bench(engine_loc, cfg, n_prompt=4096, n_gen=512, repetitions=5, timeout_s=0.3)
    assert info.value.failure.kind is FailureKind.TIMED_OUT and "llama-bench" in info.value.failure.argv[0]


def test_rejected_and_missing_engine_are_classified(engine_loc, tmp_path):
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(TrialFailedError) as info:
        bench.run_bench(engine_loc, LaunchConfig(model=bogus), n_prompt=8, n_gen=8, repetitions=1)
    assert info.value.failure.kind is FailureKind.REJECTED_CONFIG, info.value.failure
    with pytest.raises(TrialFailedError) as info:
        bench.run_server_trial(EngineLocation(tmp_path, "option"), LaunchConfig(model=bogus), SMALL,
                               log_dir=tmp_path)
    assert info.value.failure.kind is FailureKind.ENGINE_MISSING and "engine install" in str(info.value)


def test_ctrl_c_during_a_server_trial_leaves_no_process(engine_loc, model, tmp_path):
    seen: list[int] = []

    def interrupt_soon(server) -> None:
        seen.append(server.proc.pid)
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()

    cfg = LaunchConfig(model=model, ctx=4096, parallel=1, threads=2)
    long_run = Workload(WorkloadKind.CUSTOM, 2048, 2000, rounds=3)
    with pytest.raises(KeyboardInterrupt):
        bench.run_server_trial(engine_loc, cfg, long_run, log_dir=tmp_path, on_ready=interrupt_soon)
    assert seen and _gone(seen[0])


def test_cli_sigint_exits_130_and_leaves_no_llama_process(model):
    exe = Path(sys.executable).parent / "moe-tune"
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.Popen([str(exe), "bench", str(model), "--no-server", "-p", "4096", "-n", "1024", "-r", "20",
                             "-t", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    children: list[psutil.Process] = []
    while time.monotonic() < deadline and not children:
        children = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.name().startswith("llama-")]
        time.sleep(0.1)
    assert children, "llama-bench never started"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in stderr
    assert all(_gone(c.pid) for c in children)


def test_cli_from_cmd_measures_the_pasted_config(model):
    pasted = f"llama-server -m {model} -ncmoe 0 -c 512 -np 2 -t 2 -fa on --port 8080"
    proc = run_cli("bench", "--from-cmd", pasted, "-p", "32", "-n", "8", "-r", "2", "-d", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # --n-cpu-moe 0 sets no override, so llama.cpp's --fit could move experts: the measured line turns it off.
    assert report["launch_line"] == f"llama-server -m {model} -c 512 -np 2 --n-cpu-moe 0 -t 2 --fit off -fa on"
    assert {(r["kind"], r["n_depth"]) for r in report["rows"]} == {("pp", 64), ("tg", 64)}
    for r in report["rows"]:  # the CV printed is the spread of the samples printed beside it
        xs = r["samples_tok_s"]
        assert len(xs) == 2 and r["median_tok_s"] == pytest.approx(statistics.median(xs))
        assert r["cv_pct"] == pytest.approx(100 * statistics.stdev(xs) / statistics.fmean(xs), rel=1e-6)
    levels = report["server"]["levels"]
    assert [lvl["concurrency"] for lvl in levels] == [1, 2]
    assert all(lvl["per_request_gen_tok_s"] > 0 and lvl["aggregate_gen_tok_s"] > 0 for lvl in levels)
    assert report["server"]["spill"]["verdict"] == "none"


def test_cli_from_cmd_with_flags_is_one_line_error(model):
    proc = run_cli("bench", "--from-cmd", f"llama-server -m {model}", "-ctk", "q8_0")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "--from-cmd already holds the flags" in proc.stderr


def test_failure_summary_is_one_line():
    f = failures.classify_exit(["llama-server"], 1, "load_model: failed to load model\nmain: exiting")
    assert f.kind is FailureKind.REJECTED_CONFIG and "\n" not in f.summary()
