"""The only module that spawns processes.

Every child runs in its own process group, from an argument list (never a shell), with a timeout that
kills the whole group. Ctrl-C while a child runs stops the child before the exception travels on, so no
llama.cpp process outlives the call that started it; on Linux every child also gets ``PR_SET_PDEATHSIG``, so
even ``kill -9`` of the tool takes its children with it. :func:`own_pids` names the children alive now (the
interference check must not count them as another program's load).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.core.errors import EngineError, ProcessFailedError, ProcessTimeoutError
from tuner.engine import flags
from tuner.engine.server_client import ServerClient, StreamedCompletion  # noqa: F401 - StreamedCompletion for callers
from tuner.machine import interrupt, processes

STDERR_TAIL_LINES = 40
TERM_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_LIVE: set[int] = set()  # pids of the children started here and not yet stopped
_LIVE_LOCK = threading.Lock()
_OWNER = processes.owner_marker()


def own_pids() -> frozenset[int]:
    """The children this process started through the runner and that may still run."""
    with _LIVE_LOCK:
        return frozenset(_LIVE)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the thread that started it dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so a hard-killed tool leaves no llama-server holding VRAM. If the parent died
    between fork and prctl the child kills itself at once. None elsewhere (the group kill still applies)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """Every child starts here: its own session and process group, dying with us, counted as ours.

    In the main thread (where Python runs its signal handlers) a Ctrl-C or SIGTERM waits until the child is started
    and counted (:func:`tuner.machine.interrupt.deferred`): one raised in the fork's hooks (logging's ``_releaseLock``,
    run around ``preexec_fn``) can only be printed there ("Exception ignored" and a traceback on the user's stderr,
    seen once in CI's SIGTERM test), and a child started then was not yet counted as ours to stop."""
    hold = interrupt.deferred() if threading.current_thread() is threading.main_thread() else contextlib.nullcontext()
    with hold:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent(), **kwargs)
        with _LIVE_LOCK:
            _LIVE.add(proc.pid)
    return proc


@dataclass(frozen=True, slots=True)
class ProcessResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr_tail: str
    elapsed_s: float


def _stop_group(proc: subprocess.Popen[Any], grace_s: float = TERM_GRACE_S) -> None:
    """TERM the child's process group, then KILL it if it has not gone within the grace period."""
    try:
        _stop_group_now(proc, grace_s)
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc.pid)


def _stop_group_now(proc: subprocess.Popen[Any], grace_s: float) -> None:
    if proc.poll() is not None:
        # The leader is gone but helpers it spawned may not be; sweep the group anyway.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop(pid: int, grace_s: float = TERM_GRACE_S) -> bool:
    """Stop a child started here before it ends, its caller having read all it needs (a price whose verdict is
    clear): TERM its process group now, KILL it after ``grace_s`` if it is still ours. The call that runs it
    (:func:`run_process`, with ``check=False``) then returns as for any exit. False where ``pid`` is no child of
    ours that still runs. Safe from a line callback: it does not wait."""
    with _LIVE_LOCK:
        if pid not in _LIVE:
            return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False

    def kill_if_left() -> None:
        with _LIVE_LOCK:
            left = pid in _LIVE
        if left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    timer = threading.Timer(grace_s, kill_if_left)
    timer.daemon = True
    timer.start()
    return True


def _exited(proc: subprocess.Popen[Any], deadline: float, poll_s: float = 0.02) -> bool:
    """Wait until the child has exited without reaping it (``waitid`` with ``WNOWAIT``), so what the kernel counted
    for it is still readable; False where the platform cannot wait so (the caller then reaps it as usual).
    Raises ``TimeoutExpired`` at ``deadline``, as ``Popen.wait`` does."""
    if not hasattr(os, "waitid"):
        return False
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return False  # already reaped
        if time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(proc.args, deadline)
        time.sleep(poll_s)


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    """The environment every child gets: ours, the caller's extras, and the owner mark by which a later run knows
    a process this one left behind (see :mod:`tuner.machine.processes`)."""
    env = dict(os.environ)
    env[processes.OWNER_ENV] = _OWNER
    if extra:
        env.update(extra)
    return env


def run_process(
    argv: Sequence[str],
    *,
    timeout_s: float,
    what: str,
    fix: str,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    check: bool = True,
    on_start: Callable[[int], None] | None = None,
    on_stdout: Callable[[str], None] | None = None,
    on_stderr: Callable[[str], bool] | None = None,
    on_exit: Callable[[int], None] | None = None,
) -> ProcessResult:
    """Run ``argv`` to completion and return its output.

    stdout is captured whole; stderr keeps its last lines. With ``on_line`` the child's stdout and stderr
    are merged and each line is passed on as it arrives (build progress), and ``stdout`` holds the tail.
    ``on_start`` gets the child's pid once it runs (the memory sampler watches it). Without ``on_line``,
    ``on_stdout`` and ``on_stderr`` see each line as it arrives (a phase of the run begins or ends); a stderr line
    for which ``on_stderr`` returns True was only progress and is left out of the kept tail. ``on_exit`` gets the
    pid once the child has exited and before it is reaped, while its ``/proc`` counters can still be read.
    """
    argv = [str(a) for a in argv]
    start = time.monotonic()
    merged = on_line is not None
    try:
        proc = _popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                      cwd=cwd, env=_child_env(env), text=True, errors="replace")
    except FileNotFoundError as exc:
        raise EngineError(f"{argv[0]} could not be started ({exc.strerror}): {fix}") from exc
    except PermissionError as exc:
        raise EngineError(f"{argv[0]} is not executable: {fix}") from exc

    err_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
    out_parts: list[str] = []
    out_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            text = line.rstrip("\n")
            if on_stderr is None or not on_stderr(text):
                err_tail.append(text)

    def pump_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if merged:
                out_tail.append(line.rstrip("\n"))
                assert on_line is not None
                on_line(line.rstrip("\n"))
            else:
                out_parts.append(line)
                if on_stdout is not None:
                    on_stdout(line.rstrip("\n"))

    pumps = [threading.Thread(target=pump_stdout, daemon=True)]
    if not merged:
        pumps.append(threading.Thread(target=pump_stderr, daemon=True))
    for t in pumps:
        t.start()
    try:
        if on_start is not None:
            on_start(proc.pid)
        try:
            if on_exit is not None and _exited(proc, start + timeout_s):
                for t in pumps:  # every line it wrote is seen before its exit is told
                    t.join(timeout=2)
                on_exit(proc.pid)
            returncode = proc.wait(timeout=max(0.0, start + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            for t in pumps:
                t.join(timeout=2)
            tail = "\n".join(out_tail if merged else err_tail)
            raise ProcessTimeoutError(what, argv, None, tail, f"it ran past {timeout_s:.0f} s; {fix}") from None
    except BaseException:
        # KeyboardInterrupt or anything else: the child must not outlive us.
        _stop_group(proc, grace_s=2.0)
        raise
    _stop_group(proc, grace_s=0.5)  # sweep helpers left in the group
    for t in pumps:
        t.join(timeout=5)
    elapsed = time.monotonic() - start
    stdout = "\n".join(out_tail) if merged else "".join(out_parts)
    tail = "\n".join(out_tail if merged else err_tail)
    if check and returncode != 0:
        raise ProcessFailedError(what, argv, returncode, tail, fix)
    return ProcessResult(tuple(argv), returncode, stdout, tail, elapsed)


@dataclass(frozen=True, slots=True)
class HeldProcess:
    pid: int
    argv: tuple[str, ...]
    ready_line: str  # the first line it printed: what it holds


@contextlib.contextmanager
def hold(argv: Sequence[str], *, ready_timeout_s: float, what: str, fix: str,
         env: Mapping[str, str] | None = None) -> Iterator[HeldProcess]:
    """Start a helper that prints one line once it holds something (VRAM, say) and then waits to be killed;
    yield that line, and stop its process group on the way out, whatever happened."""
    argv = [str(a) for a in argv]
    try:
        proc = _popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env(env), text=True,
                      errors="replace")
    except OSError as exc:
        raise EngineError(f"{argv[0]} could not be started ({exc}): {fix}") from exc
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: lines.put(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    try:
        try:
            line = lines.get(timeout=ready_timeout_s).strip()
        except queue.Empty:
            _stop_group(proc, grace_s=1.0)
            raise ProcessTimeoutError(what, argv, None, _err_tail(proc), f"not ready in {ready_timeout_s:.0f} s; "
                                      f"{fix}") from None
        if not line:
            proc.wait(timeout=10)
            raise ProcessFailedError(what, argv, proc.returncode, _err_tail(proc), fix)
        yield HeldProcess(proc.pid, tuple(argv), line)
    finally:
        _stop_group(proc)


def _err_tail(proc: subprocess.Popen[Any]) -> str:
    try:
        text = proc.stderr.read() if proc.stderr else ""
    except (OSError, ValueError):
        text = ""
    return "\n".join(text.splitlines()[-STDERR_TAIL_LINES:])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess(ServerClient):
    """A running llama-server on loopback (its process and log; the HTTP side is :class:`ServerClient`). Use
    through :func:`serve`."""

    def __init__(self, proc: subprocess.Popen[Any], host: str, port: int, argv: Sequence[str], log: Path) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.argv = list(argv)
        self.log = log

    def _log_lines(self) -> list[str]:
        """The log as plain text lines; ``--log-jsonl`` records are reduced to their message."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        lines: list[str] = []
        for line in text.splitlines():
            if line.startswith('{"type":'):
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("type") == "log":
                        lines.extend(str(record.get("msg", "")).rstrip("\n").splitlines())
                    continue
            lines.append(line)
        return lines

    def log_tail(self, lines: int = STDERR_TAIL_LINES) -> str:
        return "\n".join(self._log_lines()[-lines:])

    def log_records(self) -> list[dict[str, Any]]:
        """Machine records other than plain log lines (e.g. ``fit_memory_breakdown``) from ``--log-jsonl``."""
        records: list[dict[str, Any]] = []
        with contextlib.suppress(OSError):
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"type":"log"' not in line:
                    with contextlib.suppress(ValueError):
                        records.append(json.loads(line))
        return records

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def wait_exit(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def serve(
    argv_without_port: Sequence[str],
    *,
    log_dir: Path,
    host: str = "127.0.0.1",
    load_timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    log_jsonl: bool = False,
    port: int | None = None,
) -> Iterator[ServerProcess]:
    """Start llama-server on a free loopback port (or ``port``), wait for /health, and always stop it afterwards.

    ``log_jsonl`` makes the server log machine records (memory breakdown) next to its messages.
    """
    port = free_port(host) if port is None else port
    argv = [str(a) for a in argv_without_port] + flags.listen_argv(host, port, log_jsonl=log_jsonl)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"llama-server-{port}.log"
    with log.open("w") as log_fh:
        try:
            proc = _popen(argv, stdout=log_fh, stderr=subprocess.STDOUT, env=_child_env(env))
        except FileNotFoundError as exc:
            raise EngineError(f"{argv[0]} could not be started ({exc.strerror}): run `moe-tune doctor`") from exc
        except OSError as exc:
            raise EngineError(f"{argv[0]} could not be started ({exc}): run `moe-tune doctor`") from exc
        server = ServerProcess(proc, host, port, argv, log)
        try:
            server.wait_healthy(load_timeout_s)
            yield server
        finally:
            _stop_group(proc)
