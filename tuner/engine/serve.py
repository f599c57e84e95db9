"""A llama-server that stays up: ``moe-tune serve``'s process, in the foreground until Ctrl-C or SIGTERM.

The measuring servers (:func:`tuner.engine.runner.serve`) listen on a free loopback port for one trial; this one
listens where the user asked and runs until it is stopped. It is started and stopped by the runner like every
other child (its own process group, killed with the tool), so stopping ``moe-tune serve`` leaves no llama.cpp
process behind. What it runs (the measured line, checked to still hold) is the caller's.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import secrets
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tuner.core.errors import ProcessFailedError, UsageError
from tuner.engine import flags
from tuner.engine.kinds import EngineKind

# llama-server reads its keys from these variables (common/arg.cpp: `--api-key` set_env("LLAMA_API_KEY"),
# `--api-key-file` set_env("LLAMA_ARG_API_KEY_FILE")), so neither the key nor its file is in any process's argv.
API_KEY_ENV = "LLAMA_API_KEY"
API_KEY_FILE_ENV = "LLAMA_ARG_API_KEY_FILE"
# llama-server names the model by its first alias (server-context.cpp: model_name), else by the path it was given:
# /v1/models would show clients the absolute path, home folder included. The alias goes by environment (common/
# arg.cpp `--alias` set_env("LLAMA_ARG_ALIAS")), so the command stays the measured one.
ALIAS_ENV = "LLAMA_ARG_ALIAS"
# ik_llama.cpp reads a few server settings from its environment (common.cpp ``gpt_params_parse_from_env``): the alias
# as LLAMA_ARG_MODEL_ALIAS, and no key at all; its --api-key-file takes every non-empty line as a key, comments too.
IK_ALIAS_ENV = "LLAMA_ARG_MODEL_ALIAS"
KEY_FIX = f"export {API_KEY_ENV}, or give --api-key-file FILE (made with a new key when it does not exist)"
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


@dataclass(frozen=True, slots=True)
class ApiKey:
    """Where the server's key comes from, as llama-server is handed it (an environment variable, never argv)."""

    env: dict[str, str]
    where: str  # where a client finds it, in the user's words
    made: bool = False  # a new key was written to the file just now
    keys: tuple[str, ...] = ()  # the keys themselves (an engine that reads no environment gets them by a file)


MAX_KEY_FILE_BYTES = 64 * 1024


def _keys_in(path: Path) -> list[str]:
    """The keys of a key file as llama-server reads it (common/arg.cpp `--api-key-file`: one per line, lines
    starting with '#' skipped), once the file is shown to be the user's alone: a regular file (a symbolic link is
    not followed, a FIFO not waited on), owned by the user, that no one else may read or write (as ssh asks of a
    private key)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"--api-key-file {path} is a symbolic link: give the key file itself") from None
        raise UsageError(f"--api-key-file {path} cannot be read ({exc.strerror or exc}): give a readable file with "
                         "one key per line") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UsageError(f"--api-key-file {path} is not a regular file: give a file holding one key per line")
    with os.fdopen(fd, "rb") as fh:
        if st.st_uid != os.getuid():
            raise UsageError(f"--api-key-file {path} belongs to another user (uid {st.st_uid}): use a key file of "
                             "your own")
        if st.st_mode & 0o077:
            raise UsageError(f"--api-key-file {path} can be read or written by others (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): run `chmod 600 {path}`")
        data = fh.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise UsageError(f"--api-key-file {path} is larger than {MAX_KEY_FILE_BYTES:,} bytes: it is not a key file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--api-key-file {path} is not text: write one key per line") from None
    return [k for k in text.splitlines() if k and not k.startswith("#")]


def api_key(environ: Mapping[str, str], key_file: Path | None) -> ApiKey | None:
    """The server's key: from ``key_file`` (a new random key written there, mode 600, when it does not exist), else
    from ``LLAMA_API_KEY``; None when neither is given. A file that is not the user's alone, unreadable or empty is
    one line naming it."""
    if key_file is None:
        return ApiKey({}, f"${API_KEY_ENV}", keys=(environ[API_KEY_ENV],)) if environ.get(API_KEY_ENV) else None
    path = key_file.expanduser().absolute()
    made = False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"--api-key-file {path}: cannot write a new key there ({exc.strerror or exc}): give a "
                         "file you can write, or one that holds a key") from None
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(16) + "\n")
        made = True
    keys = _keys_in(path)
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key: write one per line (`openssl rand -hex 16 > "
                         f"{path}`), or remove it and serve writes a new one")
    # The key file goes to llama-server by name in its environment, so the keys it reads are exactly the file's.
    env = {API_KEY_FILE_ENV: str(path)}
    if environ.get(API_KEY_ENV):
        env[API_KEY_ENV] = ""  # the file is the one source: an exported key would be accepted beside it
    return ApiKey(env, str(path), made, tuple(keys))


@contextlib.contextmanager
def handed_to(kind: EngineKind, key: ApiKey | None, alias: str | None) -> Iterator[tuple[list[str], dict[str, str]]]:
    """How this engine is handed the key and the alias: (argv to add, environment). llama.cpp reads both from its
    environment; ik_llama.cpp reads the alias from LLAMA_ARG_MODEL_ALIAS and the key from no environment at all, so
    it gets ``--api-key-file`` naming a file of its own (mode 600 in a private folder, the keys alone, removed when
    the server stops): the key stays out of every argv either way."""
    env = {} if alias is None else {ALIAS_ENV if kind.reads_key_env else IK_ALIAS_ENV: alias}
    if key is None:
        yield [], env
        return
    if kind.reads_key_env:
        yield [], {**env, **key.env}
        return
    folder = Path(tempfile.mkdtemp(prefix="moe-tune-key-"))  # mode 700
    try:
        path = folder / "api-key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(k + "\n" for k in key.keys))
        # an exported key would be read by no one, but nothing of it should reach the server either
        yield flags.api_key_file_argv(path), {**env, API_KEY_ENV: ""}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def alias_for(model: Path, alias: str | None = None) -> str:
    """The name clients see the model by: ``alias``, else the model file's stem (``Qwen3-30B-A3B-Q4_K_M``)."""
    name = model.stem if alias is None else alias.strip()
    if not name or "," in name:
        raise UsageError(f"--alias {alias!r}: give one non-empty name without commas (llama-server splits aliases "
                         "on commas), e.g. --alias qwen3-30b")
    return name


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
    from tuner.engine import runner

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
