"""What a search says as it goes: each trial as it ends (:class:`Progress`), each llama-bench test as it ends
(:func:`test_words`), and what it did (:class:`SearchOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tuner.measure.bench_rows import BenchRow
from tuner.search.trials import TrialRecord


@dataclass(frozen=True, slots=True)
class Progress:
    done: int  # trials finished in this run
    total: int | None
    best_gen_tok_s: float | None  # generation tok/s of the best-scoring trial
    last: TrialRecord
    best_request_s: float | None = None  # one workload request at the best trial's speeds

    def describe(self) -> str:
        """One line per trial, for the commands that tune several models in turn (no bar of their own)."""
        of = f"/{self.total}" if self.total else ""
        last = self.last
        got = (f": {last.request_s:,.2f} s/request (gen {last.gen_tok_s:,.1f}, prompt {last.prompt_tok_s:,.1f} tok/s)"
               if last.status == "measured" and last.request_s and last.gen_tok_s and last.prompt_tok_s else "")
        best = "" if self.best_request_s is None else f"; best {self.best_request_s:,.2f} s/request"
        return f"trial {self.done}{of} {last.status}{got}{best}"


@dataclass(frozen=True, slots=True)
class SearchOutcome:
    study_name: str
    trials_this_run: int
    interrupted: bool
    elapsed_s: float
    kept: dict[str, int] = field(default_factory=dict)  # this run's trials left in the study, by status
    exhausted: bool = False  # every config of the space was tried: the search stopped early
    drift: str | None = None  # the anchor's thermal drift in words (GPU runs); None: it held, or was not measured
    cut: str | None = None  # why the search stopped before its budget (a run's time kept across engines)


def test_words(r: BenchRow) -> str:
    """One llama-bench test as it ended, in words: "prompt 256 tokens at depth 0: 29.8 tok/s"."""
    what = f"prompt {r.n_prompt} tokens" if r.kind == "pp" else f"generation {r.n_gen} tokens"
    return f"{what} at depth {r.n_depth}: {r.avg_tok_s:,.1f} tok/s"
