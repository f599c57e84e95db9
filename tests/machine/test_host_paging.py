"""Host paging with a real RAM balloon: a process holding anonymous memory (``mmap`` + every page written, then no
CPU; no swap here, so nothing can push it out) until what is left is smaller than a model file, whose pages the
kernel must then evict and read back again and again.

The model is a Qwen3.5-9B-shaped Q4_K_M cut to 16 of its 32 layers (2.9 GiB logical, so a token takes seconds,
not tens) with zero weights: the data is a sparse hole, so it costs
megabytes of disk and every page read back is a real major fault (filled with zeros by the file system, so no
disk I/O: ``pgpgin`` stays near 0, the fault and reclaim counts are the evidence). It is dense, so every
generated token reads every weight. The engine runs it with repacking off, so the weights are computed from
the mapped file (a CPU build otherwise copies Q4_K weights into anonymous CPU_REPACK buffers at load).

The balloon leaves :data:`LEAVE_MIB` available (the kernel's MemAvailable), asks to be the OOM killer's first pick,
and is killed on the way out; a test that finds less RAM than it needs skips and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tuner.core.config import LaunchConfig
from tuner.engine import runner
from tuner.machine import books, pressure, processes, quiet, ram_ballast
from tuner.measure import bench, workload
from tuner.models import shape_model

pytestmark = pytest.mark.slow
LEAVE_MIB = 2048  # what the balloon leaves available: the model (2.9 GiB) and the 3 GiB data file cannot stay
NEEDED_MIB = LEAVE_MIB + 4096  # below this there is no room for a balloon worth the name
LOOK_S = 3.0

# Reads one byte of every page of the file, over and over (prints "ready" after the first pass).
PAGER = ("import mmap, sys\nf = open(sys.argv[1], 'rb')\nm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
         "first = True\nwhile True:\n    s = sum(m[i] for i in range(0, len(m), 4096))\n"
         "    if first:\n        print('ready', flush=True)\n        first = False\n")


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("paging") / "q9-half-shape-Q4_K_M.gguf"
    spec, recipe = shape_model.resolve_target("Qwen3.5-9B:Q4_K_M")
    shape_model.write_shape_model(replace(spec, n_layer=16), recipe, path)
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """3 GiB of real (non-zero) data on disk: pages read back from it are real reads, with their I/O."""
    path = tmp_path_factory.mktemp("paging") / "data.bin"
    block = os.urandom(1 << 20)
    with path.open("wb") as f:
        for _ in range(3 << 10):
            f.write(block)
        os.fsync(f.fileno())
    return path


@pytest.fixture(scope="module")
def balloon() -> Iterator[ram_ballast.RamBallast]:
    """One balloon for the module's cases beside it (filling 20 GiB takes tens of seconds on a busy machine); the
    case with enough RAM comes first in the file, before it exists."""
    free = ram_ballast.mem_available_mib()
    if free < NEEDED_MIB:
        pytest.skip(f"only {free:,} MiB of RAM available: the balloon test needs {NEEDED_MIB:,} (free -m)")
    with ram_ballast.hold_ram(LEAVE_MIB, runner) as held:
        assert held.available_mib <= LEAVE_MIB + 256, held  # it really took the rest
        yield held
        # The OOM killer takes it first when another program needs memory: a figure measured without it is void.
        assert held.holding(), "the balloon was killed (OOM) during the test: other programs needed the memory"
    assert not held.holding()


def _faults_while_watched(own, pager_pid: int) -> tuple[processes.Interference, int]:
    """What the watch saw over :data:`LOOK_S`, and the pages the pager brought in meanwhile."""
    before = pressure.page_ins(pager_pid)
    seen = processes.observe(own, interval_s=LOOK_S, gpu=False)
    return seen, pressure.page_ins(pager_pid) - before


def _trial(loc, model: Path, tmp_path: Path) -> tuple[bench.ServerTrial, processes.Interference]:
    cfg = LaunchConfig(model=model, ctx=256, parallel=1, threads=2, repack=False)
    load = workload.preset(workload.WorkloadKind.CUSTOM, 8, 2, rounds=1)
    with quiet.watch_for([cfg], runner.own_pids) as watch:
        trial = bench.run_server_trial(loc, cfg, load, log_dir=tmp_path)
    return trial, watch.seen


def test_the_same_server_with_enough_ram_is_quiet_and_does_not_page(big_model, engine_loc, tmp_path):
    """Case (c): the same config with the RAM it needs: no page is read back while it generates."""
    free = ram_ballast.mem_available_mib()
    if free < 8192:
        pytest.skip(f"only {free:,} MiB of RAM available: the 2.9 GiB model needs room to stay in RAM")
    trial, seen = _trial(engine_loc, big_model, tmp_path)
    assert not trial.host_paging.paging, trial.host_paging.describe()
    assert (trial.host_paging.faults_per_token or 0) < 1.0
    assert not seen.busy, seen.describe()


def _bench(loc, model: Path, n_gen: int = 2) -> bench.BenchResult:
    """llama-bench's generation test alone (one warm-up token, then one timed run of ``n_gen``)."""
    return bench.run_bench(loc, LaunchConfig(model=model, threads=2, repack=False), n_prompt=0, n_gen=n_gen,
                           repetitions=1)


def test_llama_bench_with_enough_ram_does_not_page(big_model, engine_loc):
    """The same for llama-bench, whose load and timed runs are one process: only the timed generation run is
    counted (the load's own reads are left out: tests/measure/test_phases.py scripts a cold one)."""
    free = ram_ballast.mem_available_mib()
    if free < 8192:
        pytest.skip(f"only {free:,} MiB of RAM available: the 2.9 GiB model needs room to stay in RAM")
    verdict = _bench(engine_loc, big_model).host_paging
    assert verdict.measured and not verdict.paging, verdict.describe()
    assert (verdict.faults_per_token or 0.0) < 1.0, verdict.describe()


# A balloon that grows during someone else's run: it holds all but argv[1] MiB of MemAvailable, says "ready", waits
# until a process named argv[3] holds argv[4] MiB resident (a llama-bench that loaded its model), then takes all but
# argv[2] MiB, says "grown", and holds it until killed. Anonymous, written, the OOM killer's first pick.
GROWER = r"""
import mmap, os, sys, time
def available():
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("MemAvailable:"))
def resident(name):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/comm").read().strip() == name:
                return int(open(f"/proc/{pid}/statm").read().split()[1]) * 4096
        except OSError:
            pass
    return 0
def fill(leave):
    while available() - leave >= 64 << 20:
        keep.append(mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE))
open("/proc/self/oom_score_adj", "w").write("1000")
keep, mib = [], 1 << 20
fill(int(sys.argv[1]) * mib)
print("ready", flush=True)
while resident(sys.argv[3]) < int(sys.argv[4]) * mib:
    time.sleep(0.05)
fill(int(sys.argv[2]) * mib)
print("grown", flush=True)
while True:
    time.sleep(3600)
"""


@pytest.fixture(scope="module")
def unrepacked_model(tmp_path_factory) -> Path:
    """Qwen3.5-9B-shaped Q6_K cut to 8 layers (2.9 GiB, zero weights): no CPU backend on x86 repacks Q6_K
    (ggml-cpu/repack.cpp, ``ggml_repack_get_optimal_repack_type``), so the search's own configs (repack left on) run
    from the mapped file, whose pages the kernel can evict."""
    path = tmp_path_factory.mktemp("paging") / "q9-eighth-shape-Q6_K.gguf"
    spec, recipe = shape_model.resolve_target("Qwen3.5-9B:Q6_K")
    shape_model.write_shape_model(replace(spec, n_layer=8), recipe, path)
    return path


def test_a_balloon_growing_during_a_trial_makes_it_busy_and_measured_again_our_own_paging_removes_it(
        unrepacked_model, engine_loc, tmp_path):
    """Issue 51. A search of one config: while its first trial runs, another program takes all but 1.5 GiB of RAM
    (a browser growing by gigabytes), and the engine reads its weights back from disk. The watch saw that program
    grow while the kernel reclaimed: the paging is its doing, the trial is busy and the config is measured again, not
    removed. The program then holds its memory, idle; the second trial pages on its own: the config does not fit
    this machine's RAM as it stands, and is held for good."""
    from tuner.core.config import CacheType, FlashAttn
    from tuner.machine.hardware import Hardware
    from tuner.models.gguf_reader import inspect_model
    from tuner.search import dedup, space, study

    start_leave, end_leave = 6144, 1536
    free = ram_ballast.mem_available_mib()
    if free < start_leave + 4096:
        pytest.skip(f"only {free:,} MiB of RAM available: the growing balloon needs {start_leave + 4096:,} (free -m)")
    sp = space.SearchSpace(unrepacked_model, 256, 1, None, ((CacheType.F16, CacheType.F16),), (FlashAttn.ON,), (2,),
                           (None,))
    hw = Hardware("", 0, 0, 0.0, 0.0, 64 * 2**30, 64 * 2**30, 0, 20e9, 2, "none")  # the gate is not the subject
    st = study.open_study("grown", study.default_storage(tmp_path), study.Objective(), seed=0)
    measure = study.Measure(n_prompt=16, n_gen=8, repetitions=1, timeout_s=900, prompt_depth=0, gen_depth=0)
    grower = subprocess.Popen([sys.executable, "-c", GROWER, str(start_leave), str(end_leave), "llama-bench", "2048"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert grower.stdout is not None and grower.stdout.readline().strip() == "ready"
        outcome = study.run_search(st, sp, inspect_model(unrepacked_model), hw, engine_loc,
                                   budget=study.Budget(trials=3), measure=measure)
        assert grower.poll() is None, "the balloon was killed (OOM): other programs needed the memory"
        assert grower.stdout.readline().strip() == "grown"
    finally:
        grower.kill()
        grower.wait()
    told = [t.user_attrs for t in st.get_trials(deepcopy=False) if t.user_attrs.get("status") != dedup.DUPLICATE]
    assert [a["status"] for a in told] == [dedup.BESIDE_OTHERS, dedup.PAGING], \
        [(a["status"], a.get("interference")) for a in told]
    first, again = told
    assert first["interference"] and "other processes took" in first["interference"], first["interference"]
    assert f"pid {grower.pid} +" in first["interference"]
    assert first["host_paging"]["verdict"] == "paging_beside_others"
    assert again["queued_for"] == dedup.AGAIN and again["config"] == first["config"]
    assert not again["interference"], again["interference"]  # quiet: the balloon only held what it took
    assert again["host_paging"]["verdict"] == dedup.PAGING
    assert outcome.exhausted  # the one config is held now: nothing left to measure


def test_the_kernel_reclaiming_for_our_own_paging_is_not_a_rival(data_file, balloon):
    """Case (a): our own process reads the file back beside the balloon; the kernel's threads reclaim for it.
    That work is ours (the config's paging), so the machine is quiet."""
    with runner.hold([sys.executable, "-c", PAGER, str(data_file)], ready_timeout_s=120, what="pager",
                     fix="none") as ours:
        seen, faults = _faults_while_watched(runner.own_pids, ours.pid)
    assert faults > 10_000, faults  # it really paged: over 40 MB of the file read back while we looked
    # Nothing of anyone else's ran: the kernel's work for our faults is not counted as a rival's (it once read
    # "0.6-0.9 cores"), nor are our own faults taken for another program's paging.
    assert seen.cpu_cores < 0.15, seen.describe()
    assert seen.others_memory is None, seen.describe()
    assert not seen.busy, seen.describe()


def test_a_second_process_paging_beside_us_is_a_rival(data_file, balloon):
    """Case (b): another program does the same paging: its work (and the kernel's for its faults) disturbs us."""
    stranger = subprocess.Popen([sys.executable, "-c", PAGER, str(data_file)], stdout=subprocess.PIPE, text=True)
    try:
        assert stranger.stdout is not None and stranger.stdout.readline().strip() == "ready"
        seen, faults = _faults_while_watched(runner.own_pids, stranger.pid)
    finally:
        stranger.kill()
        stranger.wait()
    assert faults >= 1, faults
    # It waits on the disk more than it computes: its paging, not its CPU, is what disturbs us.
    assert seen.busy and "other processes page in" in seen.describe(), seen.describe()
    assert seen.kernel_for_us_cores < 0.05, seen  # the kernel worked for the stranger, not for us


# Takes argv[1] MiB of anonymous memory (written, 64 MiB at a time) when a line comes on stdin, says "took", and
# holds it until stdin closes: a program allocating, with no page brought in.
ALLOCATOR = ("import mmap, sys\nsys.stdin.readline()\nkeep = [mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | "
             "mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE) for _ in range(int(sys.argv[1]) // 64)]\n"
             "print('took', flush=True)\nsys.stdin.read()\n")


def test_an_allocating_process_with_no_page_ins_is_others_load(data_file, balloon):
    """Issue 51: another program allocating beside the balloon makes the kernel reclaim the page cache (a model's
    mapped weights, here a file we read) with no page brought in by anyone. Judged by page-ins alone, that read as
    nobody's and the machine as quiet; it is others' load: named, with what the kernel reclaimed, and the kernel's
    work for it not counted as ours."""
    with data_file.open("rb") as f:  # fill what the balloon left with page cache: every new page is reclaimed
        while f.read(64 << 20):
            pass
    allocator = subprocess.Popen([sys.executable, "-c", ALLOCATOR, "1024"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert allocator.stdin is not None and allocator.stdout is not None
        before = pressure.page_ins(allocator.pid)
        allocator.stdin.write("go\n")
        allocator.stdin.flush()
        seen = processes.observe(runner.own_pids, interval_s=LOOK_S, gpu=False)
        assert allocator.stdout.readline().strip() == "took"  # it took the whole GiB within the look
        brought_in = pressure.page_ins(allocator.pid) - before
    finally:
        allocator.communicate("", timeout=60)
    # Below the rate at which its page-ins alone would name it (its own code read back under the pressure: 6.5 and
    # 11.6 MiB over the look in two runs here): judged by page-ins, this load read as nobody's.
    assert brought_in * pressure.PAGE_BYTES / 2**20 / LOOK_S < books.OTHERS_PAGING_MIB_S, brought_in
    assert seen.busy and seen.others_memory is not None, seen.describe()
    assert f"pid {allocator.pid} +1,0" in seen.others_memory and "while the kernel reclaimed" in seen.others_memory
    assert seen.kernel_for_us_cores < 0.05, seen  # nothing of ours caused the reclaim


def test_a_server_reading_its_model_back_is_quiet_and_host_paging(big_model, balloon, engine_loc, tmp_path):
    """Case (a) with the engine: llama-server beside the balloon generates while its weights are read back."""
    trial, seen = _trial(engine_loc, big_model, tmp_path)
    assert trial.host_paging.paging, trial.host_paging.describe()
    assert (trial.host_paging.faults_per_token or 0) >= 1.0
    assert trial.host_paging.fix and "free RAM" in trial.host_paging.fix
    assert not seen.busy, seen.describe()


def test_llama_bench_reading_its_model_back_is_host_paging(big_model, balloon, engine_loc):
    """llama-bench beside the balloon: its timed generation run reads the weights back from disk (the frontier's
    and the search's trials are measured so). Measured here: 85 major faults over 2 tokens, 42.5 per token, tg 0.41
    tok/s against 0.91 with the RAM it needs; 4 tokens keep the count clear of the 64 a verdict needs."""
    verdict = _bench(engine_loc, big_model, n_gen=4).host_paging
    assert verdict.paging and (verdict.faults_per_token or 0) >= 1.0, verdict.describe()
    assert verdict.fix and "free RAM" in verdict.fix
