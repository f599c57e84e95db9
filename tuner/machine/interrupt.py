"""SIGTERM ends a run the way Ctrl-C does, and neither lands between asking a trial and holding it.

A run stopped by ``timeout``, a service manager or ``kill`` gets SIGTERM, whose default action ends the process
on the spot: the trials it was measuring would stay RUNNING in the study for good (and a shared study's other
workers would hold their configs as tried). While :func:`sigterm_as_ctrl_c` is in force SIGTERM raises
KeyboardInterrupt instead, so the searches' Ctrl-C path runs: trials in flight are told ``interrupted``, child
processes are stopped by the runner, and the CLI exits 130.

The Ctrl-C path tells the trials the search holds in its list of pending ones. ``study.ask()`` creates a
RUNNING trial in the storage before the search can put it in that list; a signal in between left a trial
RUNNING for good (CI once caught one: trial 3, no parameters yet). :func:`deferred` closes that window: a
SIGINT or SIGTERM that arrives inside it is held and raised as KeyboardInterrupt when the block ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_held: list[int] = []  # signals received inside a deferred block, raised when it ends
_depth = 0  # nesting of deferred blocks in force
# Signals raised as KeyboardInterrupt that no Ctrl-C path has handled yet. A handler that runs inside an at-fork
# hook (logging's, as subprocess starts a child) or a finalizer raises where Python prints the exception and
# ignores it ("Exception ignored in: <function _releaseLock>"): the interrupt was lost and the run went on (a
# test caught compare-models finishing both models after SIGTERM). :func:`check` raises it again.
_pending: list[int] = []


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGTERM:
        # A second SIGTERM must not cut short the cleanup the first one started.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _depth:
        _held.append(signum)
        return
    _pending.append(signum)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def handled() -> None:
    """A Ctrl-C path caught the KeyboardInterrupt: nothing is pending any more."""
    _pending.clear()


def check() -> None:
    """Raise again a signal whose KeyboardInterrupt was swallowed where Python ignores exceptions."""
    if _pending:
        signum = _pending[-1]
        _pending.clear()
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name} (raised again: first lost in a hook)")


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """For the ``with`` block (or the decorated call): SIGTERM (and SIGINT) raise KeyboardInterrupt, held back
    inside :func:`deferred`; the previous handlers are put back afterwards. Only the main thread may set
    handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # A SIGINT ignored on purpose stays ignored: a shell without job control starts background commands so, lest
    # the terminal's Ctrl-C reach them (`nohup moe-tune auto-tune … &` in a script).
    sigs = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in sigs}
    try:
        yield
        check()  # a signal lost in a hook still ends the run, at the latest here
    except KeyboardInterrupt:
        handled()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A block no Ctrl-C or SIGTERM interrupts midway: one that arrives inside is raised as KeyboardInterrupt
    as the block ends (with :func:`sigterm_as_ctrl_c` in force; otherwise Python's own handlers act)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _held:
            signum = _held.pop()
            _held.clear()
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
