"""Each trial measures something new, in both studies (the single-winner search and the frontier).

A sampler may propose a config the study already holds. Optuna has no duplicate check of its own (a proposal
becomes a trial when it is asked), so :meth:`Seen.ask` does it: a repeat is told as a duplicate, FAIL with the
number of the trial it repeats and that trial's constraint values (a FAIL trial is invisible to the sampler, and
a reader of the storage sees a repeat of an infeasible config as infeasible, never as a feasible point). After
:data:`REPEATS` repeats in a row a config the study does not hold is queued, chosen at random among the untried
ones (reproducibly: seeded by the trial number), so the trial budget always buys a new measurement and a small
space is covered in as many trials as it has configs.

What counts as held ("tried"): a config that was measured (paging host RAM or not), refused by the memory gate, or
failed in the engine; and one a live worker is measuring now. A config cut short (status ``interrupted``: Ctrl-C,
SIGTERM) or left RUNNING by a worker that died is measured again. So is one whose engine read its model back from disk
while other programs' memory load pressed on it (status :data:`BESIDE_OTHERS`: the watch saw them page, or take RAM
while the kernel reclaimed): their doing, not the config's, so it is queued again (:func:`again`, read from the
storage, so a resumed study does it too), at most :data:`REMEASURES` times; a config that paged with the machine
otherwise quiet is held for good (:data:`PAGING`).

Configs are compared by :func:`key`: the model by file name only, since the study name keys on the model's name
and size, not its folder (two workers of one shared study may hold the model in different folders).

No Optuna import: the study modules pass the study and the ways to suggest and to tell.
"""

from __future__ import annotations

import os
import random
import socket
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from tuner.core.config import LaunchConfig

DUPLICATE = "duplicate"
# Measured, and the engine read its model back from disk while it generated (host paging): the config does not fit
# this machine's RAM as it stands, so it is held like one the memory gate refused, never a point or a candidate.
PAGING = "host_paging"
# Measured, and it paged while other programs' memory load pressed on it: interference, measured again.
BESIDE_OTHERS = "paging_beside_others"
REMEASURES = 2  # a config measured beside others' memory load is measured again at most this often, then held
AGAIN = "measure_again"  # ``queued_for`` of a trial queued to measure a config again; ``again_of``: the trial it redoes
REPEATS = 3  # repeats in a row before an untried config is queued
MAX_ASKS = 3 * REPEATS  # asks for one new trial before giving up for this batch (shared studies race for queues)
# A trial's status that holds its config for good.
TRIED = frozenset({"measured", "infeasible", "failed", PAGING})


STALE_RUNNING_S = 6 * 3600.0  # a RUNNING trial of another machine older than this: its worker is gone


def worker_alive(worker: str | None, started: datetime | None, now: datetime | None = None) -> bool:
    """Whether the process ``host:pid`` that asked a trial is still working on it: on this host, whether the
    pid runs (a reused pid reads as alive: its trial's config is then not measured again, the safe side); on
    another host, whether the trial started within :data:`STALE_RUNNING_S`."""
    host, _, pid = (worker or "").rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)  # signal 0: nothing is sent, only whether the pid exists
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if started is None:
        return True
    return ((now or datetime.now()) - started).total_seconds() < STALE_RUNNING_S


def key(cfg: LaunchConfig) -> LaunchConfig:
    """What makes two configs the same trial: every setting, the model (and draft model) by file name only."""
    draft = Path(cfg.draft_model.name) if cfg.draft_model is not None else None
    return replace(cfg, model=Path(cfg.model.name), draft_model=draft)


class StoredTrial(Protocol):
    """What :meth:`Seen.hold` reads of a stored trial (Optuna's FrozenTrial has it)."""

    @property
    def number(self) -> int: ...

    @property
    def user_attrs(self) -> dict[str, Any]: ...


def held_by(t: StoredTrial, live: Callable[[Any], bool]) -> bool:
    """Whether stored trial ``t`` holds its config: tried for good, or being measured by a live worker."""
    status = t.user_attrs.get("status")
    return status in TRIED or (status is None and live(t))


def _beside_others(trials: Iterable[StoredTrial], config_of: Callable[[Any], LaunchConfig | None]
                   ) -> dict[LaunchConfig, list[int]]:
    """The trials that paged beside others' memory load, by config, in order."""
    out: dict[LaunchConfig, list[int]] = defaultdict(list)
    for t in trials:
        if t.user_attrs.get("status") == BESIDE_OTHERS and (cfg := config_of(t)) is not None:
            out[key(cfg)].append(t.number)
    return out


def again(trials: Sequence[StoredTrial], config_of: Callable[[Any], LaunchConfig | None],
          live: Callable[[Any], bool]) -> list[tuple[int, LaunchConfig]]:
    """The configs to queue again, each with the trial it redoes: every trial of theirs paged beside others' memory
    load (none holds the config), fewer than ``1 + REMEASURES`` times, and none is queued since the last."""
    held = {key(cfg) for t in trials if held_by(t, live) and (cfg := config_of(t)) is not None}
    queued = {t.user_attrs.get("again_of") for t in trials if t.user_attrs.get("queued_for") == AGAIN}
    out = []
    for cfg, numbers in _beside_others(trials, config_of).items():
        if cfg not in held and len(numbers) <= REMEASURES and numbers[-1] not in queued:
            out.append((numbers[-1], cfg))
    return out


class Seen:
    """The configs a study holds, and the untried ones to queue when the sampler repeats itself.

    ``configs``: every config of the space, in a fixed order; ``params_of``: a config as the parameters to
    enqueue; ``config_of``: a stored trial's config (None: it has none, e.g. a trial asked and not yet gated).
    """

    def __init__(self, configs: Callable[[], Iterable[LaunchConfig]], params_of: Callable[[LaunchConfig], dict],
                 config_of: Callable[[Any], LaunchConfig | None]) -> None:
        self.configs = configs
        self.params_of = params_of
        self.config_of = config_of
        self.numbers: dict[LaunchConfig, int] = {}
        self.asked: set[int] = set()  # every trial this run asked, repeats included
        self.exhausted = False  # every config of the space is held: the search has nothing left to try

    def hold(self, trials: Iterable[StoredTrial], live: Callable[[Any], bool]) -> None:
        """Hold what the study holds now (a shared study gains trials from other workers between batches; a
        trial this run asked and then lost to Ctrl-C is no longer held). ``live(t)``: ``t`` is RUNNING in the
        hands of a live worker."""
        self.numbers = {}
        trials = list(trials)
        for t in trials:
            if held_by(t, live) and (cfg := self.config_of(t)) is not None:
                self.numbers.setdefault(key(cfg), t.number)
        for cfg, numbers in _beside_others(trials, self.config_of).items():
            if len(numbers) > REMEASURES:  # measured beside others' load every time: not measured yet again
                self.numbers.setdefault(cfg, numbers[0])

    def queue_again(self, st: Any, trials: Sequence[StoredTrial], live: Callable[[Any], bool]) -> int:
        """Queue in study ``st`` the configs :func:`again` names (first, before the sampler's); how many."""
        todo = again(trials, self.config_of, live)
        self.exhausted = self.exhausted and not todo
        for number, cfg in todo:
            st.enqueue_trial(self.params_of(cfg), user_attrs={"queued_for": AGAIN, "again_of": number},
                             skip_if_exists=False)
        return len(todo)

    def repeat_of(self, number: int, cfg: LaunchConfig) -> int | None:
        """None when trial ``number``'s ``cfg`` is new (it is then held); else the trial it repeats."""
        self.asked.add(number)
        first = self.numbers.get(key(cfg))
        if first is None:
            self.numbers[key(cfg)] = number
        return first

    def untried(self, seed: int) -> dict[str, Any] | None:
        """The parameters of a config of the space the study does not hold, picked at random (seeded); None
        when every config is held."""
        left = [c for c in self.configs() if key(c) not in self.numbers]
        self.exhausted = not left
        return self.params_of(random.Random(seed).choice(left)) if left else None

    def ask(self, st: Any, suggest: Callable[[Any], LaunchConfig],
            tell_repeat: Callable[[Any, int], None]) -> tuple[Any, LaunchConfig] | None:
        """A new trial of study ``st`` and its config, one the study does not hold; None when the space is spent
        (:attr:`exhausted`) or this batch lost every queued config to other workers.

        ``suggest``: the trial's config from its parameters; ``tell_repeat(trial, first)``: end a repeat of
        trial ``first`` (the study copies ``first``'s constraints onto it).
        """
        for repeats in range(1, MAX_ASKS + 1):  # every ask that does not return is a repeat
            trial = st.ask()
            cfg = suggest(trial)
            first = self.repeat_of(trial.number, cfg)
            if first is None:
                return trial, cfg
            tell_repeat(trial, first)
            if repeats % REPEATS == 0:
                fresh = self.untried(trial.number)
                if fresh is None:
                    return None
                st.enqueue_trial(fresh, user_attrs={"queued_for": DUPLICATE}, skip_if_exists=False)
        return None

    def kept(self, records: Sequence[Any]) -> dict[str, int]:
        """This run's trials in ``records`` (TrialRecord-like: ``number``, ``status``), counted by status."""
        return dict(Counter(r.status for r in records if r.number in self.asked))
