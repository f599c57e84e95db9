"""The only module that spawns processes.

Every child runs in its own process group, from an argument list (never a shell), with a timeout that
kills the whole group. Ctrl-C while a child runs stops the child before the exception travels on, so no
llama.cpp process outlives the call that started it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.errors import EngineError, ProcessFailedError, ProcessTimeoutError

STDERR_TAIL_LINES = 40
TERM_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class ProcessResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr_tail: str
    elapsed_s: float


def _stop_group(proc: subprocess.Popen[Any], grace_s: float = TERM_GRACE_S) -> None:
    """TERM the child's process group, then KILL it if it has not gone within the grace period."""
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


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
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
) -> ProcessResult:
    """Run ``argv`` to completion and return its output.

    stdout is captured whole; stderr keeps its last lines. With ``on_line`` the child's stdout and stderr
    are merged and each line is passed on as it arrives (build progress), and ``stdout`` holds the tail.
    """
    argv = [str(a) for a in argv]
    start = time.monotonic()
    merged = on_line is not None
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merged else subprocess.PIPE,
            cwd=cwd,
            env=_child_env(env),
            text=True,
            errors="replace",
            start_new_session=True,
        )
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
            err_tail.append(line.rstrip("\n"))

    def pump_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if merged:
                out_tail.append(line.rstrip("\n"))
                assert on_line is not None
                on_line(line.rstrip("\n"))
            else:
                out_parts.append(line)

    pumps = [threading.Thread(target=pump_stdout, daemon=True)]
    if not merged:
        pumps.append(threading.Thread(target=pump_stderr, daemon=True))
    for t in pumps:
        t.start()
    try:
        try:
            returncode = proc.wait(timeout=timeout_s)
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """A running llama-server on loopback. Use through :func:`serve`."""

    def __init__(self, proc: subprocess.Popen[Any], host: str, port: int, argv: Sequence[str], log: Path) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.argv = list(argv)
        self.log = log

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = STDERR_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def request(self, path: str, payload: dict[str, Any] | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        method = "GET" if data is None else "POST"
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}, method=method
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body: dict[str, Any] = json.loads(resp.read().decode())
            return body

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessFailedError(
                    "llama-server", self.argv, self.proc.returncode, self.log_tail(),
                    "check the model file and flags in the log above",
                )
            try:
                if self.request("/health", timeout_s=2.0).get("status") == "ok":
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(0.1)
        raise ProcessTimeoutError(
            "llama-server", self.argv, None, self.log_tail(),
            f"it was not healthy within {timeout_s:.0f} s; a large model may need a longer --load-timeout",
        )

    def complete(self, prompt: str, n_predict: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """One /completion request; random-weight models stop anywhere, so EOS is ignored."""
        return self.request(
            "/completion",
            {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False},
            timeout_s=timeout_s,
        )


@contextlib.contextmanager
def serve(
    argv_without_port: Sequence[str],
    *,
    log_dir: Path,
    host: str = "127.0.0.1",
    load_timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """Start llama-server on a free loopback port, wait for /health, and always stop it afterwards."""
    port = free_port(host)
    argv = [str(a) for a in argv_without_port] + ["--host", host, "--port", str(port)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"llama-server-{port}.log"
    with log.open("w") as log_fh:
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
                env=_child_env(env), start_new_session=True,
            )
        except OSError as exc:
            raise EngineError(f"{argv[0]} could not be started ({exc}): run `moe-tune doctor`") from exc
        server = ServerProcess(proc, host, port, argv, log)
        try:
            server.wait_healthy(load_timeout_s)
            yield server
        finally:
            _stop_group(proc)
