"""One measuring run per machine, on a quiet machine: a lock file that a second run waits on, a bounded wait
for other programs to go quiet, and a watch over the machine while a measurement runs.

Two tuners measuring at once each see half the cores and crown artefacts (a ``-t 1`` "winner" 244x faster);
a user's own llama-server serving beside the tuner does the same. The lock (``flock`` on a file; the kernel drops
it when the holder dies, even on ``kill -9``) makes the second run wait, ``allow_busy`` or not: measuring beside
other load is a choice, measuring beside another tuner never is. The check names what else is running;
``allow_busy`` measures beside it anyway, and what was seen is recorded with the figures.

The lock is one per machine, not per cache folder: two users, or two runs with different ``MOE_TUNE_CACHE``,
share the cores and the card all the same. It lives in the system's temporary folder (``MOE_TUNE_LOCK_DIR``
names another, e.g. one mounted into every container), usable by every user: whoever made the file, a later
run opens it without ``O_CREAT`` (which ``fs.protected_regular`` refuses on another user's file in a sticky
folder, root included), read-only where it may not write (``flock`` needs no write access). Only where the file
cannot be opened at all does a run fall back to a lock of its user's own, and say that other users' runs are
then not seen. A scoped test suite (see :mod:`tuner.machine.processes`) gets a lock of its own.

A claim is re-entrant within a thread: a library call that claims the machine inside a script that already holds
it goes ahead (another thread of the process waits, as another process would).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from tuner.core.config import LaunchConfig
from tuner.core.errors import MachineBusyError, NotRegularFileError
from tuner.machine.processes import Interference, cpu_limit_cores, observe, scope_root

POLL_S = 0.5
DEFAULT_WAIT_S = 600.0

LOCK_DIR = Path("/tmp")  # not $TMPDIR, which differs per user or per run: the one folder every run here sees
LOCK_DIR_ENV = "MOE_TUNE_LOCK_DIR"


def lock_path() -> Path:
    """The machine's measuring lock; a scoped run (see :mod:`tuner.machine.processes`) gets its own."""
    root = scope_root()
    folder = Path(os.environ[LOCK_DIR_ENV]).expanduser() if os.environ.get(LOCK_DIR_ENV) else LOCK_DIR
    return folder / (f"moe-tune-measuring-{root}.lock" if root is not None else "moe-tune-measuring.lock")


def user_lock_path() -> Path:
    """The fallback when the machine's lock cannot be opened: this user's own (it serializes their runs only)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) if runtime and os.path.isdir(runtime) else Path.home() / ".cache" / "moe-tune"
    return folder / lock_path().name


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _not_regular(path: Path, st: os.stat_result) -> NotRegularFileError:
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    owner = str(st.st_uid)
    with contextlib.suppress(KeyError):
        owner = pwd.getpwuid(st.st_uid).pw_name
    return NotRegularFileError(errno.EINVAL, f"{kind}, not a regular file, owned by user {owner}", str(path))


def _open_shared(path: Path) -> IO[str]:
    """The machine's lock file: opened as it is when it exists (no ``O_CREAT``), else made writable by every user
    (the umask would make it the first user's alone); read-only where this user may not write it. Only a regular
    file: what is there is looked at first (``lstat``), and opened non-blocking, so a FIFO another user put in its
    place (an open of a FIFO for reading waits for a writer) or swapped in after the look is refused at once,
    never waited on; never through a symbolic link. Raises OSError when it cannot be used."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG((st := os.lstat(path)).st_mode):
            raise _not_regular(path, st)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | flags)
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o666)
            except FileExistsError:
                continue  # made by another run just now: open it as it is
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o666)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY | flags)
        break
    if not stat.S_ISREG((st := os.fstat(fd)).st_mode):
        os.close(fd)
        raise _not_regular(path, st)
    return os.fdopen(fd, "r+" if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR else "r")


def _open_lock() -> tuple[IO[str] | None, Path, str | None]:
    """The lock to hold: the machine's, else this user's own; with what to say when it is not the machine's."""
    shared = lock_path()
    try:
        return _open_shared(shared), shared, None
    except NotRegularFileError as exc:
        why = f"{shared} is {exc.strerror}"
        fix = f"remove it (rm {shared}) so every user's runs wait for each other"
    except OSError as exc:
        why = f"{shared} cannot be opened ({exc.strerror or exc})"
        fix = f"remove it or make it readable (chmod 666 {shared}) so every user's runs wait for each other"
    own = user_lock_path()
    try:
        own.parent.mkdir(parents=True, exist_ok=True)
        return _open_shared(own), own, f"{why}: this run waits only for your own runs, not other users'; {fix}"
    except OSError as exc:
        return None, own, f"{why}, nor {own} ({exc.strerror or exc}): this run waits for no other run; {fix}"


@dataclass(frozen=True, slots=True)
class Claim:
    """What a measuring run found when it started: ``noise`` is what was busy when it went ahead anyway."""

    locked: bool
    noise: str | None = None
    residents: tuple[str, ...] = ()  # others' idle GPU contexts (a desktop's display): VRAM held, not work
    seen: Interference | None = field(default=None, compare=False)  # the look that let the run go ahead
    note: str | None = None  # to say: the machine's lock was not usable (what was held instead, the fix); NVML failed

    def residents_line(self) -> str | None:
        """The idle residents (GPU contexts, idle llama.cpp servers and proxies) in one line; None: none."""
        return self.seen.residents_line() if self.seen is not None else None


class _Held:
    """This process's hold on the machine: the thread holding it and how deep its claims nest."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one thread of this process measures at a time
        self.thread: int | None = None
        self.depth = 0


_HELD = _Held()


def _try_lock(fh: IO[str] | None) -> bool:
    if not _HELD.lock.acquire(blocking=False):
        return False  # another thread of this process holds the machine
    if fh is None:
        return True
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: another run holds it
        _HELD.lock.release()
        return False
    return True


def _lock_holders(fh: IO[str]) -> list[int]:
    """The pids holding ``flock`` on this file, from /proc/locks (empty where it cannot be read)."""
    st = os.fstat(fh.fileno())
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()  # "1: FLOCK ADVISORY WRITE 4242 08:01:1234 0 EOF" ("1: -> FLOCK ...": a waiter)
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
                pids.append(int(parts[4]))
    return pids


def _holder(fh: IO[str] | None) -> str:
    """Who holds the lock: what it wrote in the file, or (a run that could not write it, or this process's
    other thread) who /proc/locks says holds it."""
    if fh is None:
        return "another measuring claim of this process"
    try:
        fh.seek(0)
        text = fh.read().strip()
    except OSError:
        text = ""
    holders = _lock_holders(fh)
    if text and (not holders or any(f"(pid {pid})" in text for pid in holders)):
        return text
    if not holders:
        return text or "another moe-tune run"
    pid = holders[0]
    if pid == os.getpid():
        return "another measuring claim of this process"
    with contextlib.suppress(psutil.Error):
        return f"a moe-tune run of user {psutil.Process(pid).username()} (pid {pid})"
    return f"another moe-tune run (pid {pid})"


def _busy_error(holder: str, waited_s: float) -> MachineBusyError:
    """Another measuring run: --allow-busy is no way past it (two tuners measure each other's load)."""
    exc = MachineBusyError(f"{holder} is measuring", waited_s)
    exc.args = (f"the machine is busy ({holder} is measuring; waited {waited_s:.0f} s): two measuring runs at "
                "once measure each other, --allow-busy or not: let it finish (a longer --busy-wait waits for it) "
                "or stop it",)
    return exc


@contextlib.contextmanager
def claim_machine(command: str, *, allow_busy: bool = False, wait_s: float = DEFAULT_WAIT_S,
                  own: Callable[[], Collection[int]] = frozenset, on_wait: Callable[[str, float], None] | None = None,
                  nvml: object = None, gpu: bool = True) -> Iterator[Claim]:
    """Hold the machine for one measuring ``command``: wait (at most ``wait_s``, reporting through
    ``on_wait(what, waited_s)``) for another measuring run to finish, then raise :class:`MachineBusyError` naming
    it, ``allow_busy`` or not; then wait the same way for other programs' work (CPU, GPU, llama.cpp engines at
    work) to stop, unless ``allow_busy`` (it is then recorded as ``noise``). Re-entrant within a thread: a nested
    claim holds nothing more and only looks. Ctrl-C during a wait simply propagates (nothing is held yet).
    ``gpu`` False: the run measures the CPU on purpose (``--device none``), so GPU work is no reason to wait."""
    start = time.monotonic()
    if _HELD.thread == threading.get_ident():
        _HELD.depth += 1
        try:
            yield _quiet_enough(Claim(True), start, allow_busy, wait_s, own, on_wait, nvml, gpu)
        finally:
            _HELD.depth -= 1
        return
    fh, path, note = _open_lock()
    with fh if fh is not None else contextlib.nullcontext():
        locked = _try_lock(fh)
        while not locked:
            waited = time.monotonic() - start
            if waited >= wait_s:
                raise _busy_error(_holder(fh), waited)
            if on_wait:
                on_wait(f"waiting for {_holder(fh)} to finish", waited)
            time.sleep(POLL_S)
            locked = _try_lock(fh)
        _HELD.thread = threading.get_ident()
        try:
            if fh is not None and fh.writable():
                with contextlib.suppress(OSError):
                    fh.seek(0)
                    fh.truncate()
                    fh.write(f"moe-tune {command} (pid {os.getpid()})")
                    fh.flush()
            yield _quiet_enough(Claim(fh is not None, note=note), start, allow_busy, wait_s, own, on_wait, nvml,
                                gpu)
        finally:
            _HELD.thread = None
            if fh is not None:
                if fh.writable():
                    with contextlib.suppress(OSError):
                        fh.seek(0)
                        fh.truncate()
                with contextlib.suppress(OSError):
                    fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            _HELD.lock.release()


def _quiet_enough(claim: Claim, start: float, allow_busy: bool, wait_s: float, own: Callable[[], Collection[int]],
                  on_wait: Callable[[str, float], None] | None, nvml: object, gpu: bool) -> Claim:
    """``claim`` once other programs' work has stopped (or, ``allow_busy``, with what was seen as its noise)."""
    seen = observe(own, nvml=nvml, gpu=gpu)
    while seen.busy and not allow_busy:
        waited = time.monotonic() - start
        if waited >= wait_s:
            raise MachineBusyError(seen.describe(), waited)
        if on_wait:
            on_wait(f"waiting for a quiet machine: {seen.describe()}", waited)
        seen = observe(own, nvml=nvml, gpu=gpu)
    note = claim.note
    if seen.gpu_error and "gpu" not in _SAID:
        _SAID.add("gpu")  # the caller says the note; the run's watches need not say it again
        note = "; ".join(x for x in (note, seen.gpu_error) if x)
    return Claim(claim.locked, seen.describe() if seen.busy else None, seen.residents, seen, note)


GPU_RETRY_S = 30.0  # after an NVML error, a watch looks at the GPU again this long after
_SAID: set[str] = set()


def say_once(key: str, line: str) -> None:
    """``line`` on stderr once per process for ``key`` (a watch runs in every trial: the same trouble is said once)."""
    if key not in _SAID:
        _SAID.add(key)
        print(f"warning: {line}", file=sys.stderr, flush=True)


class Watch:
    """Observe the machine in the background while a measurement runs; :attr:`seen` is the worst of it.
    NVML failing is said once (``on_note``; by default a line on stderr) and the GPU is looked at again only every
    :data:`GPU_RETRY_S` (the CPU watch goes on); no failure makes the watch loop without waiting."""

    def __init__(self, own: Callable[[], Collection[int]] = frozenset, interval_s: float = 1.0,
                 nvml: object = None, *, gpu: bool = True, threads: int | None = None,
                 on_note: Callable[[str], None] | None = None) -> None:
        self._own = own
        self._interval_s = interval_s
        self._nvml = nvml
        self._gpu = gpu
        self._threads = threads
        self._on_note = on_note or (lambda line: say_once("gpu", line))
        self._vram_base: dict[int, int] | None = None  # others' VRAM when the watch began
        self._stop = threading.Event()
        self._seen = Interference(cpu_limit_cores=cpu_limit_cores(threads))
        self._thread = threading.Thread(target=self._loop, name="moe-tune-watch", daemon=True)

    def _loop(self) -> None:
        gpu_again_at = 0.0
        while not self._stop.is_set():
            gpu = self._gpu and time.monotonic() >= gpu_again_at
            try:
                look = observe(self._own, self._interval_s, self._nvml, self._stop.wait, gpu=gpu,
                               threads=self._threads, vram_base=self._vram_base)
            except Exception:  # noqa: BLE001 - a process vanishing mid-scan must not end the watch, nor spin it
                self._stop.wait(self._interval_s)
                continue
            if look.gpu_error:
                gpu_again_at = time.monotonic() + GPU_RETRY_S
                self._on_note(look.gpu_error)
            elif gpu and self._vram_base is None:
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

    @property
    def others_memory(self) -> str | None:
        """Other programs' memory load seen (their paging, their growth while the kernel reclaimed, or paging no
        process we could read accounts for, beside processes we could not); None: none."""
        return self._seen.others_memory


def watch_for(cfgs: Collection[LaunchConfig], own: Callable[[], Collection[int]] = frozenset) -> Watch:
    """A watch judged for these configs: against the most cores any of them uses (llama.cpp's default, every
    physical core, when one leaves ``-t`` unset), and blind to the GPU when all of them run with ``-dev none``."""
    threads = [c.threads for c in cfgs]
    return Watch(own=own, gpu=any(c.device != "none" for c in cfgs),
                 threads=None if not threads or None in threads else max(t for t in threads if t is not None))
