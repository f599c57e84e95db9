"""SIGTERM ends a run the way Ctrl-C does.

A run stopped by ``timeout``, a service manager or ``kill`` gets SIGTERM, whose default action ends the process
on the spot: the trials it was measuring would stay RUNNING in the study for good (and a shared study's other
workers would hold their configs as tried). While :func:`sigterm_as_ctrl_c` is in force SIGTERM raises
KeyboardInterrupt instead, so the searches' Ctrl-C path runs: trials in flight are told ``interrupted``, child
processes are stopped by the runner, and the CLI exits 130.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM must not cut short the cleanup the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """For the ``with`` block (or the decorated call): SIGTERM raises KeyboardInterrupt; the previous handler is
    put back afterwards. Only the main thread may set handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
