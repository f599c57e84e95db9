"""Running llama-perplexity: again where its last lines were lost at exit, with its progress told as it goes (each
chunk a KL-divergence run finishes, and a heartbeat for a run that prints nothing to follow, such as writing a
reference's logits, which takes minutes on a real model)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from tuner.core.errors import OutputCutError

RUN_ATTEMPTS = 3
T = TypeVar("T")


HEARTBEAT_S = 60.0  # a run that prints nothing it can be followed by (writing reference logits) says it lives
_CHUNK_ROW = re.compile(r"^\s*(\d+)\s+\d")  # a KL-divergence run's per-chunk row: "   3    18.2041 ± …"


def run(argv: list[str], parse: Callable[[str], T], timeout_s: float,
         on_step: Callable[[str], None] | None = None, chunks: int | None = None) -> T:
    """Run llama-perplexity and parse its figures; again when its last lines were lost at exit (see
    :class:`~tuner.core.errors.OutputCutError`): the figures are deterministic, so a second run gives the same.
    ``on_step`` hears each chunk a KL-divergence run finishes and, every :data:`HEARTBEAT_S`, that a run still goes."""
    from tuner.engine import runner

    def chunk_done(line: str) -> None:
        row = _CHUNK_ROW.match(line)
        if row and on_step:
            on_step(f"  chunk {row.group(1)} of {chunks or '?'} priced")

    for attempt in range(1, RUN_ATTEMPTS + 1):
        with _heartbeat(on_step, chunks):
            res = runner.run_process(
                argv, timeout_s=timeout_s, what="llama-perplexity",
                fix="check the model file and flags (MOE_TUNE_DEBUG=1 shows the full error)",
                on_stdout=chunk_done if on_step else None,
            )
        try:
            return parse(res.stdout + "\n" + res.stderr_tail)
        except OutputCutError:
            if attempt == RUN_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


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
