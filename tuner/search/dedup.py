"""Each trial measures something new: a sampler that proposes a config the study already holds (measured,
failed or refused by the memory gate) gets it skipped, and the next untried config of the space is queued in
its place, so the trial budget always buys a new measurement.

Optuna has no duplicate check of its own: a proposal becomes a trial when it is asked. The study tells the
repeat FAIL with status ``duplicate`` and the number of the trial it repeats, and
:func:`tuner.search.study.records` leaves it out, so results and reports hold each config once. Pure: the
study does the telling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.search import space

DUPLICATE = "duplicate"


class Seen:
    """The configs a study holds, and the untried ones to queue when the sampler repeats itself."""

    def __init__(self, sp: space.SearchSpace, held: Iterable[tuple[int, LaunchConfig]]) -> None:
        self.sp = sp
        self.numbers: dict[LaunchConfig, int] = {}
        self.hold(held)
        self.asked: set[int] = set()  # every trial this run asked, repeats included
        self.exhausted = False  # every config of the space is in the study: the search has nothing left to try

    def hold(self, held: Iterable[tuple[int, LaunchConfig]]) -> None:
        """Add trials the study holds (another process sharing the study may have added some since)."""
        for number, cfg in held:
            self.numbers.setdefault(cfg, number)

    def repeat_of(self, number: int, cfg: LaunchConfig) -> int | None:
        """None when trial ``number``'s ``cfg`` is new (it is then held); else the trial it repeats."""
        self.asked.add(number)
        first = self.numbers.get(cfg)
        if first is None:
            self.numbers[cfg] = number
        return first

    def untried(self) -> dict[str, Any] | None:
        """The parameters of the first config of the space the study does not hold (None: the space is spent)."""
        fresh = next((c for c in space.iter_configs(self.sp) if c not in self.numbers), None)
        self.exhausted = fresh is None
        return None if fresh is None else space.params_of(self.sp, fresh)

    def kept(self, records: Sequence[Any]) -> dict[str, int]:
        """This run's trials in ``records`` (TrialRecord-like: ``number``, ``status``), counted by status."""
        return dict(Counter(r.status for r in records if r.number in self.asked))
