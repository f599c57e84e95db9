"""One measuring run per machine, on a quiet machine: a lock file that a second run waits on, a bounded wait
for other programs to go quiet, and a watch over the machine while a measurement runs.

Two tuners measuring at once each see half the cores and crown artefacts (a ``-t 1`` "winner" 244x faster);
a user's own llama-server serving beside the tuner does the same. The lock (``flock`` on a file in the cache
folder; the kernel drops it when the holder dies, even on ``kill -9``) makes the second run wait; the check
names what else is running; ``allow_busy`` measures anyway, and what was seen is recorded with the figures.

The lock is one per machine, not per cache folder: two users, or two runs with different ``MOE_TUNE_CACHE``,
share the cores and the card all the same. It lives in the system's temporary folder, readable and writable by
every user (a scoped test suite, see :mod:`tuner.machine.processes`, gets one of its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tuner.core.config import LaunchConfig
from tuner.core.errors import MachineBusyError
from tuner.machine.processes import Interference, cpu_limit_cores, observe, scope_root

POLL_S = 0.5
DEFAULT_WAIT_S = 600.0


LOCK_DIR = Path("/tmp")  # not $TMPDIR, which differs per user or per run: the one folder every run here sees


def lock_path() -> Path:
    """The machine's measuring lock; a scoped run (see :mod:`tuner.machine.processes`) gets its own."""
    root = scope_root()
    return LOCK_DIR / (f"moe-tune-measuring-{root}.lock" if root is not None else "moe-tune-measuring.lock")


def _open_lock(path: Path) -> IO[str]:
    """The lock file, created writable by every user (the umask would make it the first user's alone)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o666)
    return os.fdopen(fd, "r+")


@dataclass(frozen=True, slots=True)
class Claim:
    """What a measuring run found when it started: ``noise`` is what was busy when it went ahead anyway."""

    locked: bool
    noise: str | None = None
    residents: tuple[str, ...] = ()  # others' idle GPU contexts (a desktop's display): VRAM held, not work
    seen: Interference | None = field(default=None, compare=False)  # the look that let the run go ahead

    def residents_line(self) -> str | None:
        """The idle residents (GPU contexts, idle llama.cpp servers and proxies) in one line; None: none."""
        return self.seen.residents_line() if self.seen is not None else None


def _try_lock(fh: IO[str]) -> bool:
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "another moe-tune run"


@contextlib.contextmanager
def claim_machine(command: str, *, allow_busy: bool = False, wait_s: float = DEFAULT_WAIT_S,
                  own: Callable[[], Collection[int]] = frozenset, on_wait: Callable[[str, float], None] | None = None,
                  nvml: object = None, gpu: bool = True) -> Iterator[Claim]:
    """Hold the machine for one measuring ``command``: wait (at most ``wait_s``, reporting through
    ``on_wait(what, waited_s)``) for another measuring run to finish and for other llama.cpp processes and CPU
    load to go away; then raise :class:`MachineBusyError` naming them, unless ``allow_busy``.
    Ctrl-C during the wait simply propagates (nothing is held yet). ``gpu`` False: the run measures the CPU on
    purpose (``--device none``), so work on the GPU is no reason to wait."""
    path = lock_path()
    start = time.monotonic()
    with _open_lock(path) as fh:
        locked = _try_lock(fh)
        while not locked and not allow_busy:
            waited = time.monotonic() - start
            if waited >= wait_s:
                raise MachineBusyError(f"{_holder(path)} is measuring on this machine", waited)
            if on_wait:
                on_wait(f"waiting for {_holder(path)} to finish", waited)
            time.sleep(POLL_S)
            locked = _try_lock(fh)
        noise = None if locked else f"{_holder(path)} is measuring"
        if locked:
            fh.seek(0)
            fh.truncate()
            fh.write(f"moe-tune {command} (pid {os.getpid()})")
            fh.flush()
        try:
            seen = observe(own, nvml=nvml, gpu=gpu)
            while seen.busy and not allow_busy:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    raise MachineBusyError(seen.describe(), waited)
                if on_wait:
                    on_wait(f"waiting for a quiet machine: {seen.describe()}", waited)
                seen = observe(own, nvml=nvml, gpu=gpu)
            if seen.busy:
                noise = "; ".join(x for x in (noise, seen.describe()) if x)
            yield Claim(locked, noise, seen.residents, seen)
        finally:
            if locked:
                with contextlib.suppress(OSError):
                    fh.seek(0)
                    fh.truncate()
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


class Watch:
    """Observe the machine in the background while a measurement runs; :attr:`seen` is the worst of it."""

    def __init__(self, own: Callable[[], Collection[int]] = frozenset, interval_s: float = 1.0,
                 nvml: object = None, *, gpu: bool = True, threads: int | None = None) -> None:
        self._own = own
        self._interval_s = interval_s
        self._nvml = nvml
        self._gpu = gpu
        self._threads = threads
        self._vram_base: dict[int, int] | None = None  # others' VRAM when the watch began
        self._stop = threading.Event()
        self._seen = Interference(cpu_limit_cores=cpu_limit_cores(threads))
        self._thread = threading.Thread(target=self._loop, name="moe-tune-watch", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a process vanishing mid-scan must not end the watch
                look = observe(self._own, self._interval_s, self._nvml, self._stop.wait, gpu=self._gpu,
                               threads=self._threads, vram_base=self._vram_base)
                if self._vram_base is None:
                    self._vram_base = dict(look.vram_first)
                self._seen = self._seen.worse(look)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s * 3 + 1)

    @property
    def seen(self) -> Interference:
        return self._seen

    @property
    def noise(self) -> str | None:
        """What interfered, in words; None when the machine stayed quiet."""
        return self._seen.describe() if self._seen.busy else None


def watch_for(cfgs: Collection[LaunchConfig], own: Callable[[], Collection[int]] = frozenset) -> Watch:
    """A watch judged for these configs: against the most cores any of them uses (llama.cpp's default, every
    physical core, when one leaves ``-t`` unset), and blind to the GPU when all of them run with ``-dev none``."""
    threads = [c.threads for c in cfgs]
    return Watch(own=own, gpu=any(c.device != "none" for c in cfgs),
                 threads=None if not threads or None in threads else max(t for t in threads if t is not None))
