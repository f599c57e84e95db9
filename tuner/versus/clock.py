"""The engines' run's clock: what it will spend where, learned from what it has measured; the time budget it keeps
across the engines (``--time``); and what it cut to keep it.

What a stage costs is learned as it is measured, never assumed:

- a search trial, from the trials measured so far (this engine's, else any engine's): the llama-bench process's wall
  time; its model load is that time less its tests' tokens at the rates it measured;
- a race round of a line, before the race: that engine's load plus the round's own request at the line's search
  rates (its prompt over the prompt rate, its reply over the generation rate) plus a server's fixed cost; once the
  race runs, the rounds' own seconds;
- a price: one chunk of the reference's prompt to learn whether the model predicts text (an untrained one: then no
  line is priced), and each line's chunks at its prompt rate.

The budget: the searches share what the race and the prices are expected to leave, each engine an equal part of what
is left when its search starts, at least one trial each (its default, so that it races); the race stops after its
least rounds once another round would not fit; a price is never cut (a line is not printed unpriced to save time).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from tuner.search import decide

# A server trial's own cost beside its load and its tokens (the process, its HTTP, tokenizing): the tiny demo model's
# whole round took 0.17 s here on a quiet machine. Its warm-up request (a few tokens each way) is counted at the
# line's rates; the race's first rounds replace the whole estimate with their own seconds.
SERVER_FIXED_S = 0.2
WARM_UP_TOKENS = (5, 4)  # tuner.measure.workload.warm_up: "Warm up the engine." and 4 generated
END_S = 1.0  # after the race: each engine's result and report written (0.5-1 s here on the demo model)
MIN_TRIALS_IN_BUDGET = 1  # each engine's default seed: the line it races with


@dataclass(frozen=True, slots=True)
class TrialCost:
    engine: str
    elapsed_s: float
    load_s: float
    prompt_tok_s: float | None
    gen_tok_s: float | None


@dataclass
class RunClock:
    engines: tuple[str, ...]
    trials_each: int | None
    rounds: decide.Rounds
    prompt_tokens: int  # what a race round's prompt sends
    gen_tokens: int  # what a race round's reply generates
    price_tokens: int  # one price chunk's tokens
    price_chunks: int
    budget_s: float | None = None
    start: float = field(default_factory=time.monotonic)
    arms: int = 0  # the race's lines (0: not known yet: two an engine)
    trials: list[TrialCost] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    rounds_done: int = 0
    searched: set[str] = field(default_factory=set)  # engines whose search ended
    search_started: dict[str, float] = field(default_factory=dict)
    setup_s: dict[str, float] = field(default_factory=dict)  # each search's own start before its first trial
    prices_left: int | None = None  # lines still to price (None: not known: one an engine beyond llama.cpp)
    price_chunk_s: float | None = None
    cuts: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------------------------------- learning

    def trial(self, engine: str, elapsed_s: float, prompt_tok_s: float | None, gen_tok_s: float | None,
              tokens: tuple[int, int]) -> None:
        """A search trial ended: its process's seconds, its rates, and the (prompt, generated) tokens it timed, warm-up
        and depth included."""
        timed = (tokens[0] / prompt_tok_s if prompt_tok_s else 0.0) + (tokens[1] / gen_tok_s if gen_tok_s else 0.0)
        with self._lock:
            if engine in self.search_started and engine not in self.setup_s:  # its space, projections, seeds
                self.setup_s[engine] = max(0.0, time.monotonic() - self.search_started[engine] - elapsed_s)
            self.trials.append(TrialCost(engine, elapsed_s, max(0.0, elapsed_s - timed), prompt_tok_s, gen_tok_s))

    def race_round(self, seconds: float) -> None:
        with self._lock:
            self.round_s.append(seconds)

    def search_begins(self, engine: str) -> None:
        self.search_started[engine] = time.monotonic()

    def search_ends(self, engine: str) -> None:
        self.searched.add(engine)

    # ------------------------------------------------------------------------------------------ estimating

    def _mine(self, engine: str) -> list[TrialCost]:
        return [t for t in self.trials if t.engine == engine] or list(self.trials)

    def trial_s(self, engine: str) -> float | None:
        mine = self._mine(engine)
        return statistics.mean(t.elapsed_s for t in mine) if mine else None

    def round_estimate_s(self) -> float | None:
        """One race round of one line: measured where the race ran, else from the searches' loads and rates."""
        if self.round_s:
            return statistics.mean(self.round_s)
        per = []
        for engine in self.engines:
            mine = [t for t in self._mine(engine) if t.prompt_tok_s and t.gen_tok_s]
            if not mine:
                continue
            load = statistics.mean(t.load_s for t in mine)
            pp = statistics.median(t.prompt_tok_s for t in mine if t.prompt_tok_s)
            tg = statistics.median(t.gen_tok_s for t in mine if t.gen_tok_s)
            per.append(load + (self.prompt_tokens + WARM_UP_TOKENS[0]) / pp
                       + (self.gen_tokens + WARM_UP_TOKENS[1]) / tg + SERVER_FIXED_S)
        return statistics.mean(per) if per else None

    def _arms(self) -> int:
        return self.arms or 2 * len(self.engines)

    def search_left_s(self) -> float | None:
        if self.trials_each is None:
            return None
        total = 0.0
        for engine in self.engines:
            if engine in self.searched:
                continue
            per = self.trial_s(engine)
            if per is None:
                return None
            done = sum(1 for t in self.trials if t.engine == engine)
            total += max(0, self.trials_each - done) * per
            if engine not in self.search_started and self.setup_s:  # its own start, as the searches so far took
                total += statistics.mean(self.setup_s.values())
        return total

    def race_left_s(self) -> float | None:
        per = self.round_estimate_s()
        if per is None:
            return None
        # the least rounds, or, past them, one more while the race goes on (it stops once decided)
        left_rounds = max(self.rounds.min - self.rounds_done, 1 if self.rounds_done < self.rounds.max else 0)
        return left_rounds * self._arms() * per

    def price_left_s(self) -> float:
        if self.price_chunk_s is None:
            pp = [t.prompt_tok_s for t in self.trials if t.prompt_tok_s]
            chunk = self.price_tokens / statistics.median(pp) if pp else 0.0
        else:
            chunk = self.price_chunk_s
        lines = self.prices_left if self.prices_left is not None else max(0, len(self.engines) - 1)
        return chunk * (1 + 2 * lines)  # the reference's first chunk, then about two chunks a line

    def left_s(self) -> float | None:
        """What is left of the whole run, as far as the measurements so far tell (None: nothing measured yet)."""
        parts = [self.search_left_s(), self.race_left_s()]
        if any(p is None for p in parts):
            return None
        return sum(p for p in parts if p is not None) + self.price_left_s() + END_S

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def plan_words(self) -> str | None:
        """Where the rest of the run will go, once one trial tells."""
        search, race = self.search_left_s(), self.race_left_s()
        if search is None or race is None:
            return None
        price = self.price_left_s()
        total = search + race + price + END_S
        within = ""
        if self.budget_s is not None:
            within = f" (--time {_minutes(self.budget_s)}: {_minutes(self.budget_s - self.elapsed_s())} left)"
        return (f"estimate from what was measured: searches about {_minutes(search)} more, the race about "
                f"{_minutes(race)} ({self.rounds.min} rounds of {self._arms()} lines at about "
                f"{self.round_estimate_s() or 0:,.0f} s a line), prices about {_minutes(price)}: about "
                f"{_minutes(total)} left{within}")

    # ------------------------------------------------------------------------------------------- the budget

    def stop_search(self, engine: str) -> str | None:
        """Why ``engine``'s search should stop before its next trial to keep the budget (None: go on)."""
        if self.budget_s is None:
            return None
        done = sum(1 for t in self.trials if t.engine == engine)
        per = self.trial_s(engine)
        if done < MIN_TRIALS_IN_BUDGET or per is None:
            return None
        race = self.race_left_s() or 0.0
        left = self.budget_s - self.elapsed_s() - race - self.price_left_s()
        later = [e for e in self.engines if e not in self.searched and e != engine]
        # what this engine may still spend: its equal share of what is left for searching, the later engines'
        # first trial kept for them at least
        share = (left - sum(self.trial_s(e) or per for e in later) * MIN_TRIALS_IN_BUDGET) / (1 + len(later)) \
            if later else left
        if per <= share:
            return None
        why = (f"to keep --time {_minutes(self.budget_s)}: another trial (~{per:,.0f} s) would leave too little for "
               + (f"{', '.join(later)}'s search, " if later else "") + "the race and the prices")
        self.cuts.append(f"{engine}'s search after {done} trials" + (f" of {self.trials_each}"
                                                                     if self.trials_each else ""))
        return why

    def stop_race(self, arms_left: int) -> bool:
        """Whether another race round (of ``arms_left`` lines) would break the budget (asked after the least rounds)."""
        if self.budget_s is None or not self.round_s:
            return False
        per = statistics.mean(self.round_s)
        over = self.elapsed_s() + arms_left * per + self.price_left_s() > self.budget_s
        if over:
            self.cuts.append(f"the race at {self.rounds_done} rounds (up to {self.rounds.max})")
        return over

    def end_words(self) -> str:
        spent = self.elapsed_s()
        if self.budget_s is None:
            return f"{_minutes(spent)} in all"
        kept = "kept" if spent <= self.budget_s else f"over by {_minutes(spent - self.budget_s)}"
        cut = f"; cut to keep it: {'; '.join(self.cuts)}" if self.cuts else "; nothing was cut"
        return f"{_minutes(spent)} of --time {_minutes(self.budget_s)} ({kept}){cut}"


def _minutes(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds / 60:,.1f} min" if seconds >= 90 else f"{seconds:,.0f} s"


def clock_words(seconds: float | None) -> str:
    return "not known yet" if seconds is None else _minutes(seconds)


def trial_tokens(n_prompt: int, n_gen: int, repetitions: int, prompt_depth: int, gen_depth: int,
                 one_process: bool) -> tuple[int, int]:
    """The (prompt, generated) tokens one llama-bench trial processes: each test's warm-up and repetitions, and the
    depth filled once per process (:func:`tuner.measure.bench._tests`)."""
    prompt = (1 + repetitions) * n_prompt + prompt_depth
    if not one_process:
        prompt += gen_depth  # the generation test's own process fills its depth again
    return prompt, (1 + repetitions * n_gen) if n_gen else 0

