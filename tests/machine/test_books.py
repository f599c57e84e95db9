"""The machine's books between two looks (tuner.machine.books.account, a pure function of two readings): the kernel's
threads' CPU split by what caused it (pages brought in, anonymous pages gained, pages dirtied), others' memory load
in words, and others' CPU judged by what it did to our threads. The readings are written out here as the kernel's
counters would read; tests/machine/test_host_paging.py and tests/machine/test_cpu_check.py read real ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner.machine import books
from tuner.machine.books import Look, Proc
from tuner.machine.cpu_time import CpuTime

pytestmark = pytest.mark.fast
MIB = 2**20
PAGE = 4096


def _look(*, work_s: float = 0.0, kernel_s: float = 0.0, majflt: int = 0, dirtied: int = 0, pgsteal: int = 0,
          them: tuple[float, int] = (0.0, 0), ours: tuple[float, int, int, int] = (0.0, 0, 0, 0),
          wait_ns: int = 0, stall_us: int = 0, their_ins: int | None = 0, majflt_after: int | None = None,
          scoped: bool = False) -> Look:
    """One reading: the machine's work, the kernel thread's CPU, vmstat, another process (CPU s, anonymous bytes,
    pages it brought in: None, its counters could not be read) and ours (CPU s, anonymous bytes, pages brought in,
    pages dirtied). ``majflt_after``: the machine's major faults read again after every process's counters."""
    them_cpu, them_anon = them
    our_cpu, our_anon, our_ins, our_dirtied = ours
    vm = {"pgmajfault": majflt, "pgpgin": 0, "pgsteal": pgsteal, "pgscan": 0, "nr_dirtied": dirtied}
    return Look(CpuTime(work_s, 0.0, 0.0), vm, {"cpu": (0, 0), "memory": (stall_us, 0), "io": (0, 0)}, {57: kernel_s},
                {4242: Proc("browser", them_cpu, them_anon)}, {4242: them_anon, 100: our_anon}, our_cpu,
                {100: our_anon}, {100: (our_ins, our_dirtied)}, wait_ns,
                {4242: (their_ins, 0)} if their_ins is not None else {}, scoped,
                frozenset({4242}) if their_ins is None else frozenset(),
                None if majflt_after is None else vm | {"pgmajfault": majflt_after})


def test_the_kernels_work_goes_to_whoever_caused_it():
    # Over 1 s the kernel's threads ran 0.4 s. The browser grew by 300 MiB (no page brought in); we brought in
    # 100 MiB of pages and dirtied none; somebody dirtied 0 pages. Three quarters of the causes are the browser's.
    a = _look()
    b = _look(work_s=0.4, kernel_s=0.4, majflt=100 * MIB // PAGE, pgsteal=400 * MIB // PAGE,
              them=(0.0, 300 * MIB), ours=(0.0, 0, 100 * MIB // PAGE, 0))
    got = books.account(a, b, 1.0)
    assert got.kernel_for_them_cores == pytest.approx(0.3) and got.kernel_for_us_cores == pytest.approx(0.1)
    assert got.cores == pytest.approx(0.3)  # the machine's work less ours less the kernel's, plus the kernel's for them
    assert got.memory == ("other processes took 300 MiB of RAM (browser pid 4242 +300 MiB) while the kernel "
                          "reclaimed 400 MiB")
    # Page-ins alone (the old books) gave none of it to the browser: 0.3 cores vanished and the look read quiet.
    writeback = books.account(a, _look(work_s=0.2, kernel_s=0.2, dirtied=5000, ours=(0.0, 0, 0, 1000)), 1.0)
    assert writeback.kernel_for_us_cores == pytest.approx(0.04) and writeback.kernel_for_them_cores == \
        pytest.approx(0.16)  # 4000 of 5000 dirtied pages were someone else's: the flusher worked for them
    idle = books.account(a, _look(work_s=0.1, kernel_s=0.1), 1.0)
    assert idle.kernel_for_them_cores == idle.kernel_for_us_cores == 0.0 and idle.memory is None  # housekeeping


def test_growth_is_others_load_only_while_the_kernel_reclaims():
    plenty = books.account(_look(), _look(them=(0.0, 2048 * MIB)), 1.0)  # RAM to spare: nobody's page evicted
    assert plenty.memory is None
    paging = books.account(_look(), _look(majflt=64 * MIB // PAGE, stall_us=50_000, their_ins=64 * MIB // PAGE), 1.0)
    assert paging.memory == ("other processes page in 64 MiB/s from disk (browser pid 4242 64 MiB/s; memory "
                             "pressure 5 %)")


def test_page_ins_no_other_process_brought_in_are_not_others_load():
    # Issue 61: under memory pressure the machine's counters read 16-33 MiB/s of page-ins beyond our processes' own
    # while nothing else ran; judged as "others" that made rounds busy. Only another process seen paging is a rival.
    unclaimed = books.account(_look(), _look(majflt=32 * MIB // PAGE, stall_us=300_000), 1.0)
    assert unclaimed.memory is None
    ours = books.account(_look(), _look(majflt=32 * MIB // PAGE, stall_us=300_000, ours=(1.0, 0, 32 * MIB // PAGE, 0)),
                         1.0)
    assert ours.memory is None


def test_page_ins_of_a_process_we_cannot_read_are_unknown_not_none():
    # Another user's browser: its /proc/<pid>/io is not ours to read. Counted as zero, the 32 MiB/s it paged in under
    # memory pressure read as nobody's (issue 61's rule), and the paging it caused was pinned on our line.
    unread = books.account(_look(their_ins=None), _look(majflt=32 * MIB // PAGE, stall_us=300_000, their_ins=None), 1.0)
    assert unread.unread == 1 and unread.unaccounted_mib_s == pytest.approx(32.0)
    assert unread.memory == ("1 process could not be read: its page-ins are unknown (32 MiB/s of the machine's "
                             "page-ins are no readable process's; memory pressure 30 %)")
    # Unread in one look only (another user's from the start, or gone since the listing): unknown all the same.
    assert books.account(_look(), _look(majflt=32 * MIB // PAGE, stall_us=300_000, their_ins=None), 1.0).unread == 1
    # What ours (and the readable ones) brought in is theirs, not the unread one's: nothing left to be its.
    ours = books.account(_look(their_ins=None), _look(majflt=32 * MIB // PAGE, stall_us=300_000, their_ins=None,
                                                      ours=(1.0, 0, 24 * MIB // PAGE, 0)), 1.0)
    assert ours.unaccounted_mib_s == pytest.approx(8.0) and ours.memory is None  # under the bar a named pager meets
    # No memory pressure: paging beside ours evicts none of ours, as for a named process.
    calm = books.account(_look(their_ins=None), _look(majflt=32 * MIB // PAGE, their_ins=None), 1.0)
    assert calm.unread == 1 and calm.memory is None
    # Under a scope the machine's page-ins hold other suites' too: they say nothing of the scope's unread processes.
    scoped = books.account(_look(their_ins=None, scoped=True),
                           _look(majflt=32 * MIB // PAGE, stall_us=300_000, their_ins=None, scoped=True), 1.0)
    assert scoped.unread == 0 and scoped.memory is None


def test_the_machines_counters_read_a_moment_before_ours_leave_nothing_unaccounted():
    # The engine read 2 GB/s, nothing else did. In look a its counters were read 16 ms after the machine's (32 MiB
    # later), in look b at once: the machine's window began 32 MiB earlier than ours (the books logs of the
    # Qwen3-30B-A3B runs show 8-32 MiB so, with nothing else running). Read again after every process's counters,
    # the machine's window lies inside ours: no page is nobody's.
    engine, skew = 2048 * MIB // PAGE, 32 * MIB // PAGE
    a = _look(majflt=0, majflt_after=skew, their_ins=None, ours=(0.0, 0, skew, 0))
    b = _look(majflt=skew + engine, majflt_after=skew + engine, stall_us=300_000, their_ins=None,
              ours=(1.0, 0, skew + engine, 0))
    got = books.account(a, b, 1.0)
    assert got.unread == 1 and got.unaccounted_mib_s == 0.0 and got.memory is None
    # Read only before the processes' (the old books), look a's 32 MiB read as nobody's, and the unread one's.
    once = books.account(replace(a, vm_after=None), b, 1.0)
    assert once.unaccounted_mib_s == pytest.approx(32.0) and once.memory is not None


def test_a_machine_whose_cpus_others_and_ours_filled_is_busy_whatever_the_wait_read():
    # Measured here (tests/search/test_finish.py): two busy loops beside a 2-thread llama-server, a 0.29 s look,
    # others 1.24 cores and ours 0.72, the threads' wait read 0.00 s per s run (schedstat adds a wait when the
    # thread next runs). On 2 CPUs that is every CPU taken: busy. On 16 the same load leaves 14 idle: quiet.
    short = books.account(_look(), _look(work_s=0.568, them=(0.36, 0), ours=(0.209, 0, 0, 0), wait_ns=0), 0.29)
    assert short.wait_per_run == pytest.approx(0.0) and short.cores == pytest.approx(1.24, abs=0.01)
    assert replace(short, cpus=2).cpu_busy(0.5) and not replace(short, cpus=16).cpu_busy(0.5)
    # A sliver beside a 2-thread run fills 2 CPUs as well, but is no rival by this rule (the wait rule judges it).
    sliver = books.account(_look(), _look(work_s=2.1, them=(0.1, 0), ours=(2.0, 0, 0, 0), wait_ns=0), 1.0)
    assert not replace(sliver, cpus=2).cpu_busy(0.5)


def test_others_cpu_disturbs_a_run_by_what_it_did_to_our_threads():
    # Our threads ran 1.8 cores; the browser used 0.3. On 2 cores our threads waited 0.4 s per s of wall time: 0.22 s
    # per s they ran, a figure slowed by a fifth. On 16 cores the same browser made them wait 0.002 s: noise.
    crowded = books.account(_look(), _look(work_s=2.1, them=(0.3, 0), ours=(1.8, 0, 0, 0), wait_ns=400_000_000), 1.0)
    assert crowded.wait_per_run == pytest.approx(0.4 / 1.8) and crowded.cpu_busy(0.5)  # under the old 0.5 limit
    roomy = replace(books.account(_look(), _look(work_s=2.1, them=(0.3, 0), ours=(1.8, 0, 0, 0), wait_ns=4_000_000),
                                  1.0), cpus=16)
    assert not roomy.cpu_busy(0.5)
    busy_roomy = replace(books.account(_look(), _look(work_s=3.0, them=(1.2, 0), ours=(1.8, 0, 0, 0),
                                                      wait_ns=4_000_000), 1.0), cpus=16)
    assert not busy_roomy.cpu_busy(0.5)  # 1.2 cores on idle cores beside ours: nothing of ours waited
    # Nothing of ours ran (the check before a measurement): the limit on others' cores stands in.
    before = books.account(_look(), _look(work_s=0.6, them=(0.6, 0)), 1.0)
    assert before.wait_per_run is None and before.cpu_busy(0.5) and not before.cpu_busy(1.0)
