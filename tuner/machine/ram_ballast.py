"""The RAM balloon: a helper process that holds all but N MiB of the host's available RAM until stopped, so a run
beside it meets the memory pressure of a desktop whose other programs took the rest (host paging, issue 41).

Anonymous memory, every page backed, then no CPU at all; without swap nothing can push it out, so the page cache (a
model's mapped file among it) is what the kernel reclaims instead. Spawned through :mod:`tuner.engine.runner`, the
only spawner, which the caller hands in (``machine`` may not import ``engine``); :func:`hold_ram` is a context
manager, so the memory is given back however the block ends.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

from tuner.core.errors import HardwareError, UsageError
from tuner.machine.ballast import Spawner

# Anonymous memory, every page backed (MAP_POPULATE on a private writable map, else written), in 64 MiB maps until
# MemAvailable is down to the amount to leave; then no CPU at all. Without swap nothing can push it out: the page
# cache (the model's mapped file among it) is what the kernel reclaims instead. It asks to be the OOM killer's
# first pick.
RAM_SOURCE = r"""
import json, mmap, signal, sys
leave, chunk = int(sys.argv[1]) << 20, 64 << 20
def available():
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("MemAvailable:"))
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
except OSError:
    pass
block, held, keep = b"\1" * (1 << 20), 0, []
while available() - leave >= chunk:
    populate = getattr(mmap, "MAP_POPULATE", 0)  # the kernel backs every page at once (Python >= 3.10, Linux)
    m = mmap.mmap(-1, chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    if not populate:
        for _ in range(chunk // len(block)):
            m.write(block)
    keep.append(m)
    held += chunk
print(json.dumps({"held_mib": held >> 20, "available_mib": available() >> 20}), flush=True)
while True:
    signal.pause()
"""
RAM_READY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class RamBallast:
    """A RAM ballast that is holding memory right now."""

    pid: int
    held_mib: int
    available_mib: int  # MemAvailable with the ballast in place

    def holding(self) -> bool:
        """Still alive (the OOM killer takes it first when others need the memory: a run beside it must check)."""
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def mem_available_mib() -> int:
    """The kernel's MemAvailable (what can be allocated without swapping), in MiB."""
    return int(psutil.virtual_memory().available) // 2**20


@contextlib.contextmanager
def hold_ram(leave_mib: int, spawner: Spawner) -> Iterator[RamBallast]:
    """Hold all but ``leave_mib`` MiB of the host's available RAM for the duration of the block (anonymous
    memory, touched, then idle). ``spawner`` is :mod:`tuner.engine.runner`: ``hold_ram(2048, runner)``."""
    if leave_mib < 512:
        raise UsageError(f"the RAM ballast must leave at least 512 MiB available, got {leave_mib}: other programs "
                         "on this machine need memory too")
    argv = [sys.executable, "-c", RAM_SOURCE, str(int(leave_mib))]
    with spawner.hold(argv, ready_timeout_s=RAM_READY_TIMEOUT_S, what="RAM ballast",
                      fix="check free memory (free -m)") as held:
        try:
            info = json.loads(held.ready_line)
            ready = RamBallast(held.pid, int(info["held_mib"]), int(info["available_mib"]))
        except (ValueError, KeyError, TypeError):
            raise HardwareError(f"the RAM ballast said {held.ready_line[:200]!r}, not its JSON line") from None
        yield ready
