"""Host paging of llama-bench and llama-batched-bench trials (the timed parts of a process that also loads the model),
and what to change when a trial paged (:func:`paging_fix`, the server trials' too).

llama-server trials read the host counters around their timed requests (:meth:`tuner.machine.sampler.Sampler.
begin_timed`). The benchmark tools load the model and time their tests in one process, and the load reads the whole
file: llama.cpp maps it with ``MAP_POPULATE`` and ``posix_madvise(POSIX_MADV_WILLNEED)`` (src/llama-mmap.cpp,
``llama_mmap::impl::impl``), so a cold file comes in as major faults and storage reads before the first test. Those
are not paging. Paging is the engine reading pages back *after* they were in RAM: while it generates. So the
counters are read at the lines each tool prints between its phases, and only the windows they bound are counted:

- llama-bench with ``--progress`` (tools/llama-bench/llama-bench.cpp, ``main``) prints "llama-bench: benchmark
  I/N: generation run R/REPS" on stderr before each timed generation run of test I, after that test's warm-up run
  (which has already read every weight once since the load), and another progress line before whatever comes
  next; the last run of the last test ends with the process. A window opens at each generation-run line and
  closes at the next progress line, or at the process's exit (the counters are read from the exited process
  before it is reaped: :func:`tuner.engine.runner.run_process` ``on_exit``). What a window saw is test I's, and
  test I is the I-th jsonl row.
- llama-batched-bench with ``--output-format jsonl`` (tools/batched-bench/batched-bench.cpp, ``main``) prints one
  line per batch on stdout, after the batch, and nothing before the first. A window opens at each batch's line
  and closes at the next one, so every batch but the first is counted — prompt and generation together (the tool
  prints nothing between them), per generated token of that batch.

Limits, said where the verdict is shown: a test with no progress line (a build whose llama-bench lacks
``--progress``), a run with one batch, or a machine without ``/proc`` has no window and its verdict is "not
measured"; the windows are bounded by when a line is read, a few milliseconds after the engine wrote it; the
batched-bench windows include the batch's prompt, whose page-ins are then counted per generated token.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import replace

from tuner.core.config import LaunchConfig
from tuner.engine import flags
from tuner.machine import pressure
from tuner.machine.pressure import HostCounters, HostPressure
from tuner.machine.sampler import PagingVerdict, paging_verdict
from tuner.measure import gpu_use

# tools/llama-bench/llama-bench.cpp, main: fprintf(stderr, "llama-bench: benchmark %d/%zu: generation run %d/%d\n")
_BENCH_PROGRESS = re.compile(r"^llama-bench: benchmark (\d+)/(\d+): (.+)$")


class Windows:
    """Host counters of one process over the windows its lines bound, kept per key (a llama-bench test's index, or
    0 for every batch of a batched-bench run). ``read``: the counters of a pid (tests hand in figures)."""

    def __init__(self, read: Callable[[int], HostCounters] | None = None) -> None:
        self._read = read or (lambda pid: pressure.read_counters([pid]))
        self._on = read is not None or pressure.available()
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._open: tuple[int, HostCounters] | None = None
        self._seen: dict[int, list[HostPressure]] = {}

    def attach(self, pid: int) -> None:
        self._pid = pid

    def open(self, key: int) -> None:
        """A timed part of ``key`` starts now (one still open ends here first)."""
        with self._lock:
            self._close_locked(None, True)
            if self._on and self._pid is not None:
                self._open = (key, self._read(self._pid))

    def close(self, key: int | None = None, *, keep: bool = True) -> None:
        """The open timed part (if any) ends now; ``key``: whose it was, when only its end tells (else the key it
        was opened with); ``keep`` False: it was not a timed part after all."""
        with self._lock:
            self._close_locked(key, keep)

    def _close_locked(self, key: int | None, keep: bool) -> None:
        if self._open is None or self._pid is None:
            return
        opened, before = self._open
        self._open = None
        if not keep:
            return
        self._seen.setdefault(opened if key is None else key, []).append(
            pressure.between(before, self._read(self._pid)))

    def exited(self, pid: int) -> None:
        """The process has exited (not yet reaped): the window still open is its last timed part."""
        self.close()

    def of(self, key: int) -> HostPressure | None:
        """What the windows of ``key`` saw, together (None: none was read)."""
        with self._lock:
            return pressure.combined(self._seen.get(key, []))

    def count(self, key: int) -> int:
        with self._lock:
            return len(self._seen.get(key, []))


def bench_line(windows: Windows, line: str) -> bool:
    """One line of llama-bench's stderr: a generation run opens its test's window, any other progress line closes
    it. True for a progress line (it need not be kept with the error output)."""
    m = _BENCH_PROGRESS.match(line.strip())
    if m is None:
        return False
    if m[3].startswith("generation run"):
        windows.open(int(m[1]) - 1)
    else:
        windows.close()
    return True


def batched_line(windows: Windows, line: str, parallel: int) -> None:
    """One line of llama-batched-bench's stdout: a batch has ended. The window it closes was that batch (kept when the
    batch ran ``parallel`` sequences, not the sentinel), and the next batch's window opens (one left open when the
    process ends was no batch: it is dropped, so batched-bench runs take no ``on_exit``)."""
    text = line.strip()
    if not text.startswith("{"):
        return
    try:
        pl = int(json.loads(text).get("pl", 0))
    except (ValueError, AttributeError):
        return
    windows.close(0, keep=pl == parallel)
    windows.open(0)


def bench_verdict(tests: list[tuple[int, HostPressure | None, int]], cfg: LaunchConfig | None) -> PagingVerdict:
    """The verdict over llama-bench generation tests, each ``(n_gen, what its windows saw, runs they cover)``: page-ins
    per token those runs generated; with what to change (for ``cfg``) when the model was read back."""
    seen = [(n_gen, host, runs) for n_gen, host, runs in tests if host is not None]
    verdict = paging_verdict(pressure.combined(h for _, h, _ in seen), sum(n * runs for n, _, runs in seen))
    if not seen:
        return replace(verdict, evidence="not measured (no timed generation run was seen: no /proc here, or this "
                                         "llama-bench has no --progress)")
    return replace(verdict, fix=paging_fix(cfg)) if verdict.paging and cfg is not None else verdict


def paging_fix(cfg: LaunchConfig) -> str:
    """What frees host RAM for this config, in the user's flags: the host part of the config (experts kept in RAM,
    the host prompt cache, context checkpoints) or the model itself, or RAM others hold."""
    ways = []
    if cfg.device != gpu_use.CPU_DEVICE and cfg.n_cpu_moe:
        ways.append(f"a lower {flags.spelled('n_cpu_moe')} (fewer experts in RAM)")
    ways += [f"a smaller {flags.spelled('cache_ram_mib')} (host prompt cache)",
             f"fewer {flags.spelled('ctx_checkpoints')}", "a smaller quant",
             f"{flags.spelled('load_mode', 'none')} where the weights fit RAM pinned (no page cache to evict)"]
    return f"free RAM (close what holds it), or try {', '.join(ways)}"
