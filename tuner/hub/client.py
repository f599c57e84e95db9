"""huggingface_hub's one shared HTTP client, made to give up on a server that stops answering.

huggingface_hub 2.x builds its client with ``timeout=None`` (``utils/_http.py::default_client_factory``), and its
paged listings pass ``timeout=None`` on every request (``utils/_pagination.py::paginate``, under
``list_repo_tree``), which in httpx means "wait forever" whatever the client's default: a server that accepts a
listing or a download and then sends nothing held the command for good. :func:`stall_bounded` installs the
library's own client with one more request hook that fills every unbounded step of an exchange (connect, read,
write, a free connection) with :data:`STALL_S`, whatever the caller passed. A stalled request then ends as an
``httpx2.TimeoutException``: huggingface_hub's own backoff asks again (``http_backoff``: at most 5 more tries,
1-8 s apart), a listing that still gets no page keeps the pages it had (:mod:`tuner.hub.records`), a download
resumes (:mod:`tuner.hub.download`). A bound on each stall, never on a whole transfer: a slow multi-GiB download
that keeps sending is not cut. Installed on entry to :func:`tuner.hub.repos.hub_errors`, which every Hub call passes
through before its first request.
"""

from __future__ import annotations

import threading
from typing import Any

STALL_S = 20.0  # one step of one request may wait this long for the server before it is given up

_lock = threading.Lock()
_installed: float | None = None  # the STALL_S the shared client was made with


def _bound(seconds: float) -> Any:
    def hook(request: Any) -> None:
        timeout = request.extensions.get("timeout")
        if not isinstance(timeout, dict):
            request.extensions["timeout"] = dict.fromkeys(("connect", "read", "write", "pool"), seconds)
        elif None in timeout.values():
            request.extensions["timeout"] = {k: seconds if v is None else v for k, v in timeout.items()}

    return hook


def stall_bounded() -> None:
    """Make huggingface_hub's shared client (made now or on its next use) bound every stall by :data:`STALL_S`.
    Cheap after the first call; a changed :data:`STALL_S` (a test's) takes a new client."""
    global _installed
    if _installed == STALL_S:
        return
    with _lock:
        if _installed == STALL_S:
            return
        import httpx2
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils._http import default_client_factory

        seconds = STALL_S

        def factory() -> httpx2.Client:
            client = default_client_factory()
            hooks = client.event_hooks
            client.event_hooks = {**hooks, "request": [*hooks.get("request", ()), _bound(seconds)]}
            client.timeout = httpx2.Timeout(seconds)
            return client

        set_client_factory(factory)  # closes a client made before, so the next request takes the bound
        _installed = seconds
