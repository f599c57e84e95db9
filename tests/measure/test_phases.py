"""Host paging of llama-bench and llama-batched-bench trials: the windows their lines bound, the load left out, and
the verdict per config (and per point or trial of the stages that measure with them).

The counters are handed in (the /proc boundary): each phase of a scripted run adds the page-ins a real run of that
phase takes — a cold 2.9 GiB model file read in at load (MAP_POPULATE), and a 9B-shaped model read back beside a
RAM balloon at 107 major faults per generated token (measured here: tests/machine/test_host_paging.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from tuner.core.config import LaunchConfig
from tuner.machine import sampler
from tuner.machine.pressure import HostCounters
from tuner.measure import batched, bench, phases
from tuner.search import dedup, study, trials

LOAD_MAJFLT = 700_000  # a cold 2.9 GiB file mapped with MAP_POPULATE: every page a fault, none of them paging
LOAD_READ = 3_100_000_000
PAGING_PER_TOKEN = 107  # the 9B-shaped model beside the balloon


class Counters:
    """Cumulative counters of one process, advanced by the scripted phases (stands in for /proc)."""

    def __init__(self) -> None:
        self.t, self.majflt, self.read, self.pgmajfault, self.psi_some = 0.0, 0, 0, 0, 0

    def add(self, seconds: float, majflt: int = 0, read: int = 0, stalled_s: float = 0.0) -> None:
        self.t += seconds
        self.majflt += majflt
        self.read += read
        self.pgmajfault += majflt + 5
        self.psi_some += int(stalled_s * 1e6)

    def read_pid(self, pid: int) -> HostCounters:
        psi = {"cpu": (0, 0), "memory": (self.psi_some, self.psi_some // 4), "io": (0, 0)}
        vm = {"pgmajfault": self.pgmajfault, "pgpgin": self.read // 1024, "pgscan": 0, "pgsteal": self.majflt}
        return HostCounters(self.t, vm, psi, self.majflt, self.read, 0)


def _llama_bench(c: Counters, w: phases.Windows, n_gen: int, per_token: int, reps: int = 2) -> list[str]:
    """The stderr of `llama-bench -p 16 -n N -r 2 --progress` (one pp test, one tg test), each line told to the
    windows as it comes, the counters advanced by what each phase reads; returns the lines kept for the tail."""
    kept = []

    def line(text: str) -> None:
        if not phases.bench_line(w, text):
            kept.append(text)

    w.attach(4242)
    c.add(3.0, LOAD_MAJFLT, LOAD_READ)  # the load, before any line (first test: model loaded after "starting")
    line("llama-bench: benchmark 1/2: starting")
    line("llama-bench: benchmark 1/2: warmup prompt run")
    c.add(0.2, per_token * 16)
    for r in range(1, reps + 1):
        line(f"llama-bench: benchmark 1/2: prompt run {r}/{reps}")
        c.add(0.2, per_token * 16)
    line("llama-bench: benchmark 2/2: starting")
    line("llama-bench: benchmark 2/2: warmup generation run")
    c.add(0.5, per_token)
    for r in range(1, reps + 1):
        line(f"llama-bench: benchmark 2/2: generation run {r}/{reps}")
        c.add(1.0 * n_gen, per_token * n_gen, stalled_s=0.097 * n_gen)
    w.exited(4242)  # the row printed, the context freed, the process exits
    line("main: error: something went wrong")  # not progress: kept
    return kept


def _rows(w: phases.Windows, n_gen: int) -> tuple[bench.BenchRow, ...]:
    """The two rows the run printed (test i is row i), with what the windows saw, as _bench_once attaches it."""
    pp = bench.BenchRow(16, 0, 0, 400.0, 4.0, (398.0, 402.0), "abc")
    tg = bench.BenchRow(0, n_gen, 0, 2.0, 0.1, (1.9, 2.1), "abc")
    return tuple(replace(r, host=w.of(i), host_runs=w.count(i)) for i, r in enumerate((pp, tg)))


CFG = LaunchConfig(model=Path("q9-half-shape-Q4_K_M.gguf"), threads=2, repack=False, n_cpu_moe=4)


def test_only_the_timed_generation_runs_are_counted_and_the_load_is_left_out():
    c = Counters()
    w = phases.Windows(read=c.read_pid)
    kept = _llama_bench(c, w, n_gen=8, per_token=PAGING_PER_TOKEN)
    assert kept == ["main: error: something went wrong"]  # progress lines stay out of the error tail
    assert w.of(0) is None and w.count(0) == 0  # the prompt test: no generation run
    gen = w.of(1)
    assert gen is not None and w.count(1) == 2
    # Both generation runs and nothing else: not the 700,000 faults of the load, nor the warm-up's.
    assert gen.our_majflt == 2 * 8 * PAGING_PER_TOKEN and gen.our_read_bytes == 0
    assert gen.window_s == pytest.approx(16.0) and gen.memory_some_pct == pytest.approx(9.7)
    result = bench.BenchResult(("llama-bench",), _rows(w, 8), 30.0, CFG)
    verdict = result.host_paging
    assert verdict.paging and verdict.faults_per_token == pytest.approx(107.0), verdict.describe()
    assert "memory pressure some 9.7 %" in verdict.evidence
    assert verdict.fix and "--n-cpu-moe" in verdict.fix and "free RAM" in verdict.fix


def test_a_config_that_fits_is_measured_quiet_however_cold_its_load():
    c = Counters()
    w = phases.Windows(read=c.read_pid)
    _llama_bench(c, w, n_gen=8, per_token=0)
    verdict = bench.BenchResult(("llama-bench",), _rows(w, 8), 30.0, CFG).host_paging
    assert not verdict.paging and verdict.measured and verdict.faults_per_token == 0.0, verdict.describe()
    # Whole-process counters would have called it paging: the load alone is 43,750 faults per generated token.
    assert LOAD_MAJFLT / 16 > sampler.PAGING_FAULTS_PER_TOKEN


def test_without_progress_lines_the_verdict_says_not_measured():
    w = phases.Windows(read=Counters().read_pid)
    w.attach(1)
    assert not phases.bench_line(w, "| model | size | params | backend | threads | test | t/s |")
    verdict = bench.BenchResult(("llama-bench",), _rows(w, 8), 1.0, CFG).host_paging
    assert not verdict.paging and not verdict.measured and "--progress" in verdict.evidence


def test_repeated_processes_add_their_windows():
    c = Counters()
    w1, w2 = phases.Windows(read=c.read_pid), phases.Windows(read=c.read_pid)
    _llama_bench(c, w1, n_gen=8, per_token=PAGING_PER_TOKEN)
    _llama_bench(c, w2, n_gen=8, per_token=0)
    merged = bench._merge(_rows(w1, 8), _rows(w2, 8))
    tg = merged[1]
    assert tg.host_runs == 4 and tg.host is not None and tg.host.our_majflt == 2 * 8 * PAGING_PER_TOKEN
    verdict = bench.BenchResult(("llama-bench",), merged, 60.0, CFG).host_paging
    assert verdict.faults_per_token == pytest.approx(53.5) and verdict.paging  # half the runs paged


def test_batched_bench_counts_every_batch_but_the_first_and_drops_the_sentinel():
    c = Counters()
    w = phases.Windows(read=c.read_pid)
    w.attach(7)
    c.add(3.0, LOAD_MAJFLT, LOAD_READ)  # load, warm-up and the first batch: no line before its end
    batch = '{{"pp": 512, "tg": 32, "pl": {pl}, "t_pp": 1.0, "t_tg": 2.0, "t": 3.0}}'
    phases.batched_line(w, batch.format(pl=2), parallel=2)
    c.add(3.0, 2 * 32 * PAGING_PER_TOKEN, stalled_s=0.3)  # the second batch: 2 sequences x 32 tokens
    phases.batched_line(w, batch.format(pl=2), parallel=2)
    c.add(0.5, 100_000)  # the sentinel (one sequence) and the exit: not a batch of this trial
    phases.batched_line(w, batch.format(pl=1), parallel=2)
    assert w.count(0) == 1 and w.of(0) is not None
    verdict = batched.host_paging(w, CFG, batch_gen_tokens=2 * 32)
    assert verdict.paging and verdict.faults_per_token == pytest.approx(107.0), verdict.describe()
    one = phases.Windows(read=c.read_pid)
    one.attach(8)
    phases.batched_line(one, batch.format(pl=2), parallel=2)
    assert batched.host_paging(one, CFG, 64).evidence.startswith("not measured (one batch only")


def test_a_search_trial_that_paged_is_never_a_candidate():
    """The single-winner search: a llama-bench trial that read its model back is told ``host_paging`` (pruned)
    with its figures and verdict kept, and the finish never takes it as a candidate."""
    c = Counters()
    w = phases.Windows(read=c.read_pid)
    _llama_bench(c, w, n_gen=8, per_token=PAGING_PER_TOKEN)
    paged = bench.BenchResult(("llama-bench",), _rows(w, 8), 30.0, CFG)
    c2 = Counters()
    w2 = phases.Windows(read=c2.read_pid)
    _llama_bench(c2, w2, n_gen=8, per_token=0)
    quiet = bench.BenchResult(("llama-bench",), _rows(w2, 8), 30.0, CFG)
    st = optuna.create_study(direction="maximize")
    measure = study.Measure(n_prompt=16, n_gen=8)
    for res, threads in ((paged, 2), (quiet, 1)):
        t = st.ask()
        t.set_user_attr("config", study.config_to_dict(LaunchConfig(model=CFG.model, threads=threads)))
        study._tell_measured(st, t, res, res.host_paging, measure, study.Objective(), 2)
    recs = trials.records(st)
    assert [r.status for r in recs] == [dedup.PAGING, "measured"]
    assert st.trials[0].state is optuna.trial.TrialState.PRUNED and recs[0].gen_tok_s == pytest.approx(2.0)
    assert (recs[0].host_paging or {})["verdict"] == "host_paging"
    assert (recs[1].host_paging or {})["verdict"] == "none"
    assert [r.number for r, _ in trials.top_configs(recs, 3)] == [1]
    assert trials.best_measured(recs) is recs[1]
