"""Thermal drift in a GPU search: one fixed config, the anchor, measured again every few trials, so that a card
that heats over minutes of back-to-back trials and boosts less is seen and named with the figures it touched.

A config measured late in a search on a warm card reads slower than the same config measured cold; the finish
interleaves its rounds, the search had nothing. The anchor is the search's first measured config (the first
seed: llama.cpp's defaults); its first reading is that trial's own, and every :data:`ANCHOR_EVERY` measured trials
it is measured again alone. When its speed has moved by more than :data:`DRIFT_PCT` and more than twice its own
spread since the first reading, the drift is said in words (as the machine watch says what disturbed a
measurement) on the trials measured from then on, on the study and in the search's outcome.

Off for CPU runs: there the change that matters is other programs' load, which the machine watch already names
per trial, and a CPU's boost window is seconds, shorter than a trial, where a card heats over minutes; on the
shared machines where CPU runs are made, an anchor reading would mostly measure the neighbours, at an eighth
of the trial budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.search.trials import config_to_dict

ANCHOR_EVERY = 8  # measured trials between two readings of the anchor
DRIFT_PCT = 3.0  # a move of the anchor's speed smaller than this is not called drift, whatever its noise
NOISE_TIMES = 2.0  # ... nor one within this many times the readings' own CV


@dataclass(frozen=True, slots=True)
class AnchorReading:
    after_trials: int  # trials this run had measured when the anchor was read
    at_s: float  # seconds into the search
    gen_tok_s: float
    prompt_tok_s: float
    gen_cv_pct: float = 0.0
    prompt_cv_pct: float = 0.0
    disturbed: str | None = None  # what the machine watch saw (such a reading decides nothing)

    @classmethod
    def of(cls, res: Any, after_trials: int, at_s: float, disturbed: str | None) -> AnchorReading:
        """From a llama-bench result (:class:`tuner.measure.bench.BenchResult`: its medians and spreads)."""
        gen, prompt = res.row("tg").spread, res.row("pp").spread
        return cls(after_trials, round(at_s, 1), gen.median, prompt.median, gen.cv_pct, prompt.cv_pct, disturbed)


@dataclass(frozen=True, slots=True)
class Drift:
    """How far the anchor moved between its first quiet reading and its last: negative is slower."""

    gen_pct: float
    prompt_pct: float
    first: AnchorReading
    last: AnchorReading

    def describe(self) -> str:
        which = "generation" if abs(self.gen_pct) >= abs(self.prompt_pct) else "prompt processing"
        pct = self.gen_pct if which == "generation" else self.prompt_pct
        before, after = ((self.first.gen_tok_s, self.last.gen_tok_s) if which == "generation"
                         else (self.first.prompt_tok_s, self.last.prompt_tok_s))
        way = "slower" if pct < 0 else "faster"
        why = ("the card is likely heating and boosting less: trials measured since read slow by about as much"
               if pct < 0 else "the machine sped up: trials measured before read slow by about as much")
        return (f"thermal drift: the anchor config reads {abs(pct):.1f} % {way} in {which} after "
                f"{self.last.at_s - self.first.at_s:.0f} s and {self.last.after_trials - self.first.after_trials} "
                f"trials ({before:,.1f} -> {after:,.1f} tok/s); {why}")


class Anchor:
    """The anchor of one search run: its config, its readings, and whether it is due again."""

    def __init__(self, every: int = ANCHOR_EVERY, threshold_pct: float = DRIFT_PCT) -> None:
        self.every = every
        self.threshold_pct = threshold_pct
        self.config: LaunchConfig | None = None
        self.readings: list[AnchorReading] = []
        self._measured = 0  # trials measured in this run
        self._last_read_at = 0  # … when the anchor was last read

    @property
    def on(self) -> bool:
        return self.every > 0

    def measured(self, cfg: LaunchConfig, reading: AnchorReading) -> None:
        """A trial was measured; the first one becomes the anchor, its reading the first."""
        self._measured += 1
        if self.on and self.config is None:
            self.config = cfg
            self.readings.append(reading)
            self._last_read_at = self._measured - 1  # read as the run's first trial: due after `every` trials

    @property
    def trials_measured(self) -> int:
        return self._measured

    @property
    def due(self) -> bool:
        return self.on and self.config is not None and self._measured - self._last_read_at >= self.every

    def add(self, reading: AnchorReading | None) -> None:
        """The anchor measured again (None: the measurement failed; it is tried again after the next trials)."""
        self._last_read_at = self._measured
        if reading is not None:
            self.readings.append(reading)

    def drift(self) -> Drift | None:
        quiet = [r for r in self.readings if r.disturbed is None]
        if len(quiet) < 2:
            return None
        first, last = quiet[0], quiet[-1]
        gen = 100.0 * (last.gen_tok_s / first.gen_tok_s - 1.0)
        prompt = 100.0 * (last.prompt_tok_s / first.prompt_tok_s - 1.0)
        noise = NOISE_TIMES * max(first.gen_cv_pct, last.gen_cv_pct, first.prompt_cv_pct, last.prompt_cv_pct)
        limit = max(self.threshold_pct, noise)
        return Drift(gen, prompt, first, last) if max(abs(gen), abs(prompt)) > limit else None

    @property
    def noise(self) -> str | None:
        """The drift in words, None while the anchor holds (the shape of ``quiet.Watch.noise``)."""
        found = self.drift()
        return found.describe() if found else None

    def to_dict(self) -> dict[str, Any]:
        return {"every": self.every, "config": config_to_dict(self.config) if self.config else None,
                "readings": [asdict(r) for r in self.readings], "drift": self.noise}
