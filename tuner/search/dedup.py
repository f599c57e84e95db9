"""Each trial measures something new: a sampler that proposes a config the study already holds (measured,
failed or refused by the memory gate) gets it skipped, and the next untried config of the space is queued in
its place, so the trial budget always buys a new measurement.

Optuna has no duplicate check of its own: a proposal becomes a trial when it is asked. The repeat is told FAIL
with status ``duplicate`` and the number of the trial it repeats, and :func:`tuner.search.study.records` leaves
it out, so results and reports hold each config once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from tuner.core.config import LaunchConfig
from tuner.search import space

DUPLICATE = "duplicate"


class Seen:
    """The configs a study holds, and the untried ones to queue when the sampler repeats itself."""

    def __init__(self, study: optuna.Study, sp: space.SearchSpace, held: Iterable[tuple[int, LaunchConfig]]) -> None:
        self.sp = sp
        self.numbers: dict[LaunchConfig, int] = {}
        for number, cfg in held:
            self.numbers.setdefault(cfg, number)
        self.study = study
        self.asked: set[int] = set()  # every trial this run asked, repeats included
        self.exhausted = False  # every config of the space is in the study: the search has nothing left to try

    def admit(self, trial: optuna.Trial, cfg: LaunchConfig) -> bool:
        """True when ``cfg`` is new (it is then held); else the trial is told as a skipped repeat and an untried
        config is queued for the next ask (or :attr:`exhausted` is set when there is none)."""
        self.asked.add(trial.number)
        first = self.numbers.get(cfg)
        if first is None:
            self.numbers[cfg] = trial.number
            return True
        trial.set_user_attr("status", DUPLICATE)
        trial.set_user_attr("duplicate_of", first)
        self.study.tell(trial, state=TrialState.FAIL)
        fresh = next((c for c in space.iter_configs(self.sp) if c not in self.numbers), None)
        if fresh is None:
            self.exhausted = True
        else:
            self.study.enqueue_trial(space.params_of(self.sp, fresh), user_attrs={"queued_for": DUPLICATE})
        return False

    def kept(self, records: Sequence[Any]) -> dict[str, int]:
        """This run's trials in ``records`` (TrialRecord-like: ``number``, ``status``), counted by status."""
        return dict(Counter(r.status for r in records if r.number in self.asked))

