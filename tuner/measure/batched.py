"""Concurrent requests in one process: llama-batched-bench runs ``n`` sequences side by side, each a prompt and a
reply, in the config's context split over the sequences as llama-server splits it over ``-np n`` slots.

llama-bench cannot run parallel sequences, so a trial that searches slot counts is measured here: ``n``
requests arriving at once, each with its whole history as the prompt (as the finish's server trials send it,
:func:`tuner.search.finish.server_load`), then ``n_gen`` tokens generated for all of them together. Each
request is done when the batch is: the per-request time is the batch's wall time, and the aggregate throughput
is the generated tokens of all requests over that time (prompts included).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.core.errors import TunerError
from tuner.core.stats import cv_pct
from tuner.engine import flags, runner
from tuner.engine.build import Capabilities, EngineLocation
from tuner.machine.sampler import NOT_MEASURED, PagingVerdict, paging_verdict
from tuner.measure import failures, phases
from tuner.measure.phases import paging_fix

TOOL = "llama-batched-bench"


@dataclass(frozen=True, slots=True)
class BatchedRun:
    """One batch of ``parallel`` requests of ``n_prompt`` + ``n_gen`` tokens (one jsonl line)."""

    parallel: int
    n_prompt: int
    n_gen: int
    prompt_s: float
    gen_s: float
    total_s: float

    @property
    def aggregate_gen_tok_s(self) -> float:
        """Generated tokens of all sequences per second of the whole batch (prompts included)."""
        return self.parallel * self.n_gen / self.total_s

    @property
    def per_request_gen_tok_s(self) -> float:
        """What one request sees while every sequence generates."""
        return self.n_gen / self.gen_s


@dataclass(frozen=True, slots=True)
class BatchedResult:
    argv: tuple[str, ...]
    runs: tuple[BatchedRun, ...]
    elapsed_s: float
    # Host RAM over every batch but the first (:mod:`tuner.measure.phases`): was the model read back from disk.
    host_paging: PagingVerdict = NOT_MEASURED

    @property
    def request_s(self) -> float:
        """Median wall time of one request when ``parallel`` arrive at once."""
        return statistics.median(r.total_s for r in self.runs)

    @property
    def aggregate_gen_tok_s(self) -> float:
        return statistics.median(r.aggregate_gen_tok_s for r in self.runs)

    @property
    def per_request_gen_tok_s(self) -> float:
        return statistics.median(r.per_request_gen_tok_s for r in self.runs)

    @property
    def cv_pct(self) -> float | None:
        return cv_pct([r.total_s for r in self.runs])

    def to_dict(self) -> dict[str, Any]:
        return {"request_s": self.request_s, "aggregate_gen_tok_s": self.aggregate_gen_tok_s,
                "per_request_gen_tok_s": self.per_request_gen_tok_s, "cv_pct": self.cv_pct,
                "runs": [[r.prompt_s, r.gen_s, r.total_s] for r in self.runs]}


def parse_jsonl(text: str) -> tuple[BatchedRun, ...]:
    """The machine lines of ``--output-format jsonl`` (tools/batched-bench: pp, tg, pl, t_pp, t_tg, t)."""
    runs = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        raw = json.loads(line)
        runs.append(BatchedRun(int(raw["pl"]), int(raw["pp"]), int(raw["tg"]), float(raw["t_pp"]),
                               float(raw["t_tg"]), float(raw["t"])))
    return tuple(runs)


def run_batched(engine: EngineLocation, cfg: LaunchConfig, *, n_prompt: int, n_gen: int, repetitions: int = 2,
                timeout_s: float = 1800.0, caps: Capabilities | None = None) -> BatchedResult:
    """``cfg.parallel`` requests at once, ``repetitions`` times in one process (one model load).

    The tool prints through llama.cpp's asynchronous logger, which at this pin can lose the last line when the
    process exits (measured here: 7 of 40 runs of ``-npl 2,2`` printed one line). So a cheap single-sequence
    batch runs last as a sentinel whose line may be lost, and a run that still lost a wanted line is repeated once.
    """
    parallel = cfg.parallel or 1
    reps = max(1, repetitions)
    if cfg.ctx is not None and parallel * (n_prompt + n_gen) > cfg.ctx:
        # The tool would skip such a batch and exit 0 (and its sentinel would fail to decode): never launched.
        reason = f"-c {cfg.ctx} does not hold {parallel} x ({n_prompt}+{n_gen}) tokens: raise -c or lower -np"
        raise failures.TrialFailedError(TOOL, failures.Failure(failures.FailureKind.REJECTED_CONFIG, reason))
    try:
        binary = engine.tool(TOOL)
    except TunerError as exc:
        raise failures.TrialFailedError(TOOL, failures.from_error(exc)) from None
    argv = flags.batched_bench_argv(binary, cfg, n_prompt=n_prompt, n_gen=n_gen, n_parallel=[parallel] * reps + [1],
                                    caps=caps)
    elapsed = 0.0
    for _ in range(2):
        windows = phases.Windows()

        def batch_done(line: str, windows: phases.Windows = windows) -> None:
            phases.batched_line(windows, line, parallel)

        try:
            res = runner.run_process(argv, timeout_s=timeout_s, what=TOOL, fix="check the model file and flags",
                                     on_start=windows.attach, on_stdout=batch_done, env=flags.server_env(cfg))
        except TunerError as exc:
            raise failures.TrialFailedError(TOOL, failures.from_error(exc)) from None
        elapsed += res.elapsed_s
        runs = [r for r in parse_jsonl(res.stdout) if r.parallel == parallel][:reps]
        if len(runs) == reps:
            return BatchedResult(tuple(argv), tuple(runs), elapsed, host_paging(windows, cfg, parallel * n_gen))
        if not runs:
            break  # nothing at all: the batch does not fit (the tool skips it and exits 0), not a lost line
    reason = (f"{TOOL} reported {len(runs)} of {reps} batches: -c {cfg.ctx} does not hold {parallel} x "
              f"({n_prompt}+{n_gen}) tokens")
    raise failures.TrialFailedError(TOOL, failures.Failure(failures.FailureKind.REJECTED_CONFIG, reason,
                                                            tuple(argv), res.returncode, None, res.stderr_tail))


def host_paging(windows: phases.Windows, cfg: LaunchConfig, batch_gen_tokens: int) -> PagingVerdict:
    """The verdict over the windowed batches (every one but the first), per token they generated."""
    if not windows.count(0):
        return replace(NOT_MEASURED, evidence="not measured (one batch only, or no /proc here: every batch but the "
                                              "first is watched)")
    verdict = paging_verdict(windows.of(0), batch_gen_tokens * windows.count(0))
    return replace(verdict, fix=paging_fix(cfg)) if verdict.paging else verdict
