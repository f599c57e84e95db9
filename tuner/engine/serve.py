"""A llama-server that stays up: ``moe-tune serve``'s process, in the foreground until Ctrl-C or SIGTERM.

The measuring servers (:func:`tuner.engine.runner.serve`) listen on a free loopback port for one trial; this one
listens where the user asked and runs until it is stopped. It is started and stopped by the runner like every
other child (its own process group, killed with the tool), so stopping ``moe-tune serve`` leaves no llama.cpp
process behind. What it runs (the measured line, checked to still hold) is the caller's.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tuner.core.errors import ProcessFailedError, UsageError
from tuner.engine import runner

# llama-server reads --api-key from this variable (common/arg.cpp: set_env), so the key stays out of `ps`.
API_KEY_ENV = "LLAMA_API_KEY"
POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Served:
    """A server that answered /health: where to reach it and what runs."""

    host: str
    port: int
    pid: int
    argv: tuple[str, ...]
    log: Path

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (what a client's ``base_url`` takes); a wildcard address is reached on
        loopback from this machine."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str) -> None:
    if ":" in host:
        raise UsageError(f"--host {host}: IPv6 addresses are not served yet; use 127.0.0.1, 0.0.0.0 or an IPv4 "
                         "address of this machine")


def port_busy(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (or the address cannot be bound at all).

    SO_REUSEADDR as llama-server's HTTP library sets it: a port that only lingers in TIME_WAIT is free to it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def run_foreground(argv_without_address: Sequence[str], *, host: str, port: int | None, log_dir: Path,
                   env: Mapping[str, str] | None = None, load_timeout_s: float = 600.0,
                   on_ready: Callable[[Served], None] = lambda served: None) -> None:
    """Start llama-server on ``host:port`` (a free port when None), wait for /health, tell ``on_ready``, and keep
    it running until it exits (an error with its log's tail) or KeyboardInterrupt (SIGTERM too, under the
    caller's ``sigterm_as_ctrl_c``) stops it: the runner stops its process group on the way out, whatever ended
    it, and the interrupt travels on."""
    check_host(host)
    if port is not None and port_busy(host, port):
        raise UsageError(f"port {port} on {host} is in use: pick another --port, or leave it out for a free one")
    with runner.serve(argv_without_address, log_dir=log_dir, host=host, port=port, load_timeout_s=load_timeout_s,
                      env=env) as server:
        on_ready(Served(host, server.port, server.proc.pid, tuple(server.argv), server.log))
        while server.exit_code() is None:
            server.wait_exit(POLL_S)  # returns at once when the server exits; a signal interrupts it
        raise ProcessFailedError("llama-server", server.argv, server.exit_code(), server.log_tail(),
                                 f"it stopped on its own; the whole log is {server.log}")
