"""Host memory pressure read from the kernel, the kernel's work judged by cause, and the per-trial paging verdict.

The figures are the kernel's own (/proc): a real child process takes real major faults on a file whose page
cache was dropped (``posix_fadvise(POSIX_FADV_DONTNEED)``), and /proc/<pid>/stat must show them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tuner.machine import pressure, sampler
from tuner.machine.pressure import HostPressure

pytestmark = pytest.mark.fast
PAGE = 4096


def _host(our_majflt: int, *, read_bytes: int = 0, memory_some_pct: float | None = 9.7) -> HostPressure:
    return HostPressure(window_s=2.0, our_majflt=our_majflt, machine_majflt=our_majflt + 5, our_read_bytes=read_bytes,
                        pgpgin_bytes=read_bytes,
                        pgscan=1000, pgsteal=900, memory_some_pct=memory_some_pct, memory_full_pct=5.5)


def test_the_kernels_work_goes_to_whoever_took_the_major_faults():
    assert pressure.kernel_share(0.8, 300, 400) == pytest.approx(0.6)  # three quarters of the faults: 0.6 of 0.8 s
    assert pressure.kernel_share(0.8, 0, 400) == 0.0  # none of the faults: none of the work
    assert pressure.kernel_share(0.8, 400, 400) == pytest.approx(0.8)
    assert pressure.kernel_share(0.8, 0, 0) == 0.0  # no page brought in for anyone: housekeeping, nobody's
    assert pressure.kernel_share(0.8, 500, 400) == pytest.approx(0.8)  # counters read a moment apart: capped


def test_kernel_threads_are_kthreadd_and_its_children():
    assert pressure.is_kernel_thread(2, 0)
    assert pressure.is_kernel_thread(57, 2)  # kswapd0, a kworker: children of kthreadd
    assert not pressure.is_kernel_thread(1, 0)
    assert not pressure.is_kernel_thread(os.getpid(), os.getppid())


def test_a_process_reading_a_file_dropped_from_the_page_cache_takes_major_faults(tmp_path):
    path = tmp_path / "cold.bin"
    n_pages = 512
    path.write_bytes(os.urandom(n_pages * PAGE))
    code = ("import mmap, os, sys\nf = open(sys.argv[1], 'rb')\nos.fsync(f.fileno())\n"
            "os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)\n"
            "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\nm.madvise(mmap.MADV_RANDOM)\n"
            "s = sum(m[i] for i in range(0, len(m), 4096))\nprint('read', flush=True)\nsys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "read"
        faults = pressure.majflt(child.pid)
    finally:
        child.communicate("\n", timeout=10)
    # MADV_RANDOM: no read-ahead, so one fault per page the page cache lost (python's own libraries add a few).
    assert faults >= n_pages // 2, faults
    assert pressure.majflt(child.pid) == 0  # gone: nothing to read, no error


def test_psi_and_vmstat_are_read_from_the_kernel():
    psi = pressure.psi_totals()
    if psi is None:
        pytest.skip("this kernel has no pressure stall information (/proc/pressure)")
    assert set(psi) == {"cpu", "memory", "io"}
    assert all(some >= full >= 0 for some, full in psi.values())
    vm = pressure.vmstat()
    assert vm["pgmajfault"] > 0 and vm["pgpgin"] > 0  # a machine that booted has faulted and read


def test_paging_verdict_counts_major_faults_per_generated_token():
    paging = sampler.paging_verdict(_host(214), gen_tokens=2)  # measured beside a RAM balloon (9B-shaped file)
    assert paging.paging and paging.faults_per_token == pytest.approx(107.0)
    assert "107.0 per generated token" in paging.evidence and "memory pressure some 9.7 %" in paging.evidence
    quiet = sampler.paging_verdict(_host(3), gen_tokens=128)  # a lazily loaded library page, not a model
    assert not quiet.paging and quiet.kind is sampler.PagingKind.NONE
    few = sampler.paging_verdict(_host(40), gen_tokens=4)  # 10 per token, but too few to be a model read back
    assert not few.paging
    assert sampler.paging_verdict(None, 128).evidence.startswith("not measured")
    # A file read in order: 2 major faults started read-ahead of gigabytes (measured beside the balloon)
    ahead = sampler.paging_verdict(_host(2, read_bytes=4_255_141_888), gen_tokens=16)
    assert ahead.paging and "253.6 per token" in ahead.evidence, ahead.evidence
    assert not sampler.paging_verdict(_host(0, read_bytes=40 * 2**20), gen_tokens=4).paging  # under 64 MiB: no


def test_paging_beside_others_memory_load_is_theirs_not_the_configs():
    """Issue 51: the same faults, measured while a watch saw another program take RAM as the kernel reclaimed, are
    that program's doing: no longer ``host_paging`` (which removes a config), still on record."""
    from dataclasses import dataclass

    from tuner.search.watched_round import blamed

    paged = sampler.paging_verdict(_host(214), gen_tokens=2)
    load = "other processes took 4,096 MiB of RAM (firefox pid 4242 +4,096 MiB) while the kernel reclaimed 3,900 MiB"
    theirs = paged.beside(load)
    assert not theirs.paging and theirs.beside_others and theirs.kind.value == "paging_beside_others"
    assert theirs.evidence.endswith(f"; meanwhile {load}") and theirs.faults_per_token == pytest.approx(107.0)
    assert paged.beside(None) is paged  # nobody else's load: the config's own
    quiet = sampler.paging_verdict(_host(3), gen_tokens=128)
    assert quiet.beside(load) is quiet  # nothing paged: nothing to blame

    @dataclass(frozen=True)
    class Trial:
        host_paging: sampler.PagingVerdict

    assert blamed(Trial(paged), load).host_paging == theirs and blamed(Trial(paged), None).host_paging is paged
