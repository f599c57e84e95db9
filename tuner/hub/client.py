"""huggingface_hub's one shared HTTP client, made to give up on a server that stops answering, and, inside
:func:`bounded`, on one that answers too slowly or too much.

huggingface_hub 2.x builds its client with ``timeout=None`` (``utils/_http.py::default_client_factory``), and its
paged listings pass ``timeout=None`` on every request (``utils/_pagination.py::paginate``, under
``list_repo_tree``), which in httpx means "wait forever" whatever the client's default: a server that accepts a
listing or a download and then sends nothing held the command for good. :func:`stall_bounded` installs the
library's own client with one more request hook that fills every unbounded step of an exchange (connect, read,
write, a free connection) with :data:`STALL_S`, whatever the caller passed. A stalled request then ends as an
``httpx2.TimeoutException``: huggingface_hub's own backoff asks again (``http_backoff``: at most 5 more tries,
1-8 s apart), a listing that still gets no page keeps the pages it had (:mod:`tuner.hub.records`), a download
resumes (:mod:`tuner.hub.download`). Installed on entry to :func:`tuner.hub.repos.hub_errors`, which every Hub call
passes through before its first request.

A bound on each stall is not a bound on a request: a server that sends a byte every 19 s, or that ignores
``Range`` and sends a whole file, keeps one going for good. Inside ``with bounded(...)`` (a look-up) every request
also ends by a deadline and carries at most ``max_bytes``: the client's sockets are wrapped (a network backend of
httpcore's), so each read waits at most until the request's own end, and every byte that arrives is counted,
headers and redirects included. The answer is asked as ``identity`` (a compressed answer would decode to more than
was counted; one that comes compressed anyway is refused), a ``429`` is not waited out (its ``Retry-After`` may say
an hour), and near the deadline a failure is not retried (huggingface_hub sleeps up to 8 s first). Going over is
an ``httpx2.TransportError`` huggingface_hub does not retry; :func:`overrun` tells it apart. A slow multi-GiB
download outside ``bounded`` is never cut.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx2

STALL_S = 20.0  # one step of one request may wait this long for the server before it is given up
BACKOFF_MAX_S = 8.0  # the longest huggingface_hub's http_backoff sleeps before it asks again
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # http_backoff's _DEFAULT_RETRY_ON_STATUS_CODES

_lock = threading.Lock()
_installed: float | None = None  # the STALL_S the shared client was made with
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Bounds:
    """What every request inside :func:`bounded` may take."""

    deadline: float  # time.monotonic() by which every request is over
    request_s: float  # one request, first byte sent to last byte read
    max_bytes: int  # one response, as it arrives (headers and body)
    what: str  # how a message names the whole, e.g. "the look-up's 60 s"


@dataclass(slots=True)
class _Spend:
    """The request now in flight on this thread: when it must be over, and the bytes it has brought."""

    end: float
    max_bytes: int
    what: str
    received: int = 0


_bounds: contextvars.ContextVar[Bounds | None] = contextvars.ContextVar("moe_tune_hub_bounds", default=None)
_spend: contextvars.ContextVar[_Spend | None] = contextvars.ContextVar("moe_tune_hub_spend", default=None)


class _Overrun(httpx2.TransportError):
    """A bounded request went over its time or bytes (neither a timeout nor a network error: never retried)."""


def overrun(exc: BaseException) -> str | None:
    """What a bounded request went over, when ``exc`` says so."""
    return str(exc) if isinstance(exc, _Overrun) else None


@contextlib.contextmanager
def bounded(seconds: float, *, request_s: float, max_bytes: int, what: str) -> Iterator[Bounds]:
    """Every Hub request made inside (on this thread, or one given :func:`carried` work) ends within ``seconds``
    from now and ``request_s`` from its start, and carries at most ``max_bytes``. Nested: the tighter wins."""
    outer = _bounds.get()
    deadline = time.monotonic() + seconds
    if outer is not None and outer.deadline < deadline:
        deadline, what = outer.deadline, outer.what
    token = _bounds.set(Bounds(deadline, request_s, max_bytes if outer is None else min(max_bytes, outer.max_bytes),
                               what))
    try:
        yield _bounds.get()  # type: ignore[misc]
    finally:
        _bounds.reset(token)


def carried(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run, in any thread, under the bounds in force here (a worker thread starts with none)."""
    ctx = contextvars.copy_context()

    def run(*args: Any) -> T:
        return ctx.copy().run(fn, *args)

    return run


def _remaining(end: float, what: str) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise _Overrun(f"{what} were spent")
    return left


def _retry_would_overrun(spend: _Spend) -> bool:
    return spend.end - time.monotonic() < BACKOFF_MAX_S


def _request_hook(seconds: float) -> Callable[[Any], None]:
    def hook(request: Any) -> None:
        timeout = request.extensions.get("timeout")
        if not isinstance(timeout, dict):
            timeout = dict.fromkeys(("connect", "read", "write", "pool"), seconds)
        timeout = {k: seconds if v is None else v for k, v in timeout.items()}
        b = _bounds.get()
        if b is not None:
            _remaining(b.deadline, b.what)
            own = time.monotonic() + b.request_s
            end, what = (b.deadline, b.what) if b.deadline <= own else (own, f"one request's {b.request_s:.0f} s")
            timeout = {k: max(1e-3, min(v, end - time.monotonic())) for k, v in timeout.items()}
            request.headers["Accept-Encoding"] = "identity"
            _spend.set(_Spend(end, b.max_bytes, what))
        request.extensions["timeout"] = timeout

    return hook


def _response_hook(response: Any) -> None:
    spend = _spend.get()
    if _bounds.get() is None or spend is None:
        return
    if response.headers.get("Content-Encoding", "identity").lower() not in ("identity", ""):
        raise _Overrun(f"the server sent a {response.headers['Content-Encoding']}-encoded answer to a bounded read")
    length = response.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > spend.max_bytes:
        raise _Overrun(f"the server announced {int(length):,} bytes, more than the {spend.max_bytes:,} one request "
                       "may carry")
    if response.status_code in RETRIED_STATUS and (response.status_code == 429 or _retry_would_overrun(spend)):
        raise _Overrun(f"the server answered HTTP {response.status_code}, not waited out within {spend.what}")


class _Stream:
    """One socket of the client: each read waits at most until the current request's end, and is counted."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        spend = _spend.get()
        if spend is None or _bounds.get() is None:
            return self._inner.read(max_bytes, timeout)
        left = _remaining(spend.end, spend.what)
        wait = left if timeout is None else min(timeout, left)
        try:
            data: bytes = self._inner.read(max_bytes, wait)
        except Exception as exc:
            if wait == left or _retry_would_overrun(spend):
                raise _Overrun(f"{spend.what} were spent ({type(exc).__name__})") from None
            raise
        spend.received += len(data)
        if spend.received > spend.max_bytes:
            raise _Overrun(f"the server sent more than the {spend.max_bytes:,} bytes one request may carry")
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        spend = _spend.get()
        if spend is not None and _bounds.get() is not None:
            left = _remaining(spend.end, spend.what)
            timeout = left if timeout is None else min(timeout, left)
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> _Stream:
        return _Stream(self._inner.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend:
    """httpcore's network backend, its streams wrapped (:class:`_Stream`) and its connects bounded likewise."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, **kwargs: Any) -> _Stream:
        spend = _spend.get()
        if spend is not None and _bounds.get() is not None:
            left = _remaining(spend.end, spend.what)
            timeout = left if timeout is None else min(timeout, left)
            try:
                return _Stream(self._inner.connect_tcp(host, port, timeout, **kwargs))
            except Exception as exc:
                if _retry_would_overrun(spend):
                    raise _Overrun(f"{spend.what} were spent ({type(exc).__name__})") from None
                raise
        return _Stream(self._inner.connect_tcp(host, port, timeout, **kwargs))

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> _Stream:
        return _Stream(self._inner.connect_unix_socket(*args, **kwargs))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _wrap_sockets(client: httpx2.Client) -> None:
    # httpx takes no network backend; its default transport's httpcore pool does (ConnectionPool(network_backend=)).
    # A library that moves these attributes fails tests/hub's bounded-request tests, not silently.
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    if pool is not None and hasattr(pool, "_network_backend"):
        pool._network_backend = _Backend(pool._network_backend)


def stall_bounded() -> None:
    """Make huggingface_hub's shared client (made now or on its next use) bound every stall by :data:`STALL_S`, and
    every request inside :func:`bounded` by its bounds. Cheap after the first call; a changed :data:`STALL_S` (a
    test's) takes a new client."""
    global _installed
    if _installed == STALL_S:
        return
    with _lock:
        if _installed == STALL_S:
            return
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils._http import default_client_factory

        seconds = STALL_S

        def factory() -> httpx2.Client:
            client = default_client_factory()
            hooks = client.event_hooks
            client.event_hooks = {**hooks, "request": [*hooks.get("request", ()), _request_hook(seconds)],
                                  "response": [*hooks.get("response", ()), _response_hook]}
            client.timeout = httpx2.Timeout(seconds)
            _wrap_sockets(client)
            return client

        set_client_factory(factory)  # closes a client made before, so the next request takes the bound
        _installed = seconds
