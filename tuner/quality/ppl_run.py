"""Running llama-perplexity: again where its last lines were lost at exit, with its progress told as it goes (each
chunk a run finishes, and a heartbeat for a run that prints nothing to follow), stopped where the caller has read
enough (a price whose verdict is clear after a few chunks: :mod:`tuner.quality.stopping`)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from tuner.core.errors import OutputCutError, ProcessFailedError
from tuner.engine import runner

RUN_ATTEMPTS = 3
T = TypeVar("T")
FIX = "check the model file and flags (MOE_TUNE_DEBUG=1 shows the full error)"


HEARTBEAT_S = 60.0  # a run that prints nothing it can be followed by says it lives
# A chunk row: a KL-divergence run's ("   3    18.2041 ± …") or a reference's with --ppl-output-type 1 ("    1024
# 8925.6846  9.096688  0.027479", its first token's offset first).
_KLD_ROW = re.compile(r"^\s*(\d+)\s+\S+\s*(?:±|\+/-)")
_PPL_ROW = re.compile(r"^\s*\d+\s+[\d.]+\s+[-\d.]+\s+[-\d.]+\s*$")


def run(argv: list[str], parse: Callable[[str], T], timeout_s: float,
        on_step: Callable[[str], None] | None = None, chunks: int | None = None) -> T:
    """Run llama-perplexity and parse its figures; again when its last lines were lost at exit (see
    :class:`~tuner.core.errors.OutputCutError`): the figures are deterministic, so a second run gives the same.
    ``on_step`` hears each chunk a run finishes and, every :data:`HEARTBEAT_S`, that a run still goes."""
    figures, _ = run_until(argv, parse, timeout_s, on_step, chunks)
    return figures


def run_until(argv: list[str], parse: Callable[[str], T], timeout_s: float,
              on_step: Callable[[str], None] | None = None, chunks: int | None = None, *,
              stop_when: Callable[[str], str | None] | None = None,
              parse_cut: Callable[[str], T] | None = None) -> tuple[T, str | None]:
    """:func:`run`, stopped at the first stdout line for which ``stop_when`` gives a reason; then the output so far
    is read by ``parse_cut``. Returns the figures and that reason (None: the run went to its end)."""
    for attempt in range(1, RUN_ATTEMPTS + 1):
        watch = _Watch(on_step, chunks, stop_when)
        res = watch.run(argv, timeout_s)
        text = res.stdout + "\n" + res.stderr_tail
        if watch.stopped is not None and parse_cut is not None:
            return parse_cut(text), watch.stopped
        if res.returncode != 0:
            raise ProcessFailedError("llama-perplexity", argv, res.returncode, res.stderr_tail, FIX)
        try:
            return parse(text), None
        except OutputCutError:
            if attempt == RUN_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


class _Watch:
    """One run of llama-perplexity, its stdout read line by line: progress told, and the run stopped (through the
    runner, which owns the process) at the first line ``stop_when`` gives a reason for."""

    def __init__(self, on_step: Callable[[str], None] | None, chunks: int | None,
                 stop_when: Callable[[str], str | None] | None) -> None:
        self.on_step, self.chunks, self.stop_when = on_step, chunks, stop_when
        self.stopped: str | None = None
        self._done = 0
        self._pid: int | None = None
        self._started = threading.Event()

    def run(self, argv: list[str], timeout_s: float) -> runner.ProcessResult:
        with _heartbeat(self.on_step, self.chunks):
            return runner.run_process(argv, timeout_s=timeout_s, what="llama-perplexity", fix=FIX,
                                      on_start=self._start, check=False,
                                      on_stdout=self._see if self.on_step or self.stop_when else None)

    def _start(self, pid: int) -> None:
        self._pid = pid
        self._started.set()

    def _see(self, line: str) -> None:
        if self.on_step and (_KLD_ROW.match(line) or _PPL_ROW.match(line)):
            self._done += 1
            self.on_step(f"  chunk {self._done} of {self.chunks or '?'} done")
        if self.stop_when is None or self.stopped is not None or not (why := self.stop_when(line)):
            return
        self.stopped = why
        if self.on_step:
            self.on_step(f"  stopped: {why}")
        if self._started.wait(timeout=10) and self._pid is not None:  # a line can come before the pid is told
            runner.stop(self._pid)


@contextlib.contextmanager
def _heartbeat(on_step: Callable[[str], None] | None, chunks: int | None) -> Iterator[None]:
    """Say every :data:`HEARTBEAT_S` that llama-perplexity is still at work, until the block ends."""
    if on_step is None:
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            on_step(f"  llama-perplexity at work for {time.monotonic() - start:,.0f} s ({chunks or '?'} chunks)")

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(timeout=1)
