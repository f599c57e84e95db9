"""One arm's one round under the watch: the run, its failure (a :class:`TrialFailedError`'s, kept as data) and
what disturbed the machine meanwhile (:func:`tuner.machine.quiet.watch_for`, this run's own llama.cpp processes
left out). The finish, the session stage and compare-models measure every round this way; a round measured on a
busy machine is kept and shown, and decides nothing (:func:`tuner.search.decide.quiet_median`). A line its engine's
dialect refuses (a flag that engine does not read, :class:`UnsupportedFlagError`) is a round that failed with that
reason, like one the engine refused at launch: it never ends the run.

A round whose engine read its model back from disk while the watch saw other programs' memory load (their paging,
or their growth while the kernel reclaimed) has its paging verdict blamed on them
(:meth:`~tuner.machine.sampler.PagingVerdict.beside`): the round is busy, measured again like any busy round, and
its arm is not ruled out as a config that pages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Generic, TypeVar

from tuner.core.config import LaunchConfig
from tuner.core.errors import TrialFailedError, UnsupportedFlagError
from tuner.engine import flags, runner
from tuner.machine import quiet
from tuner.machine.sampler import PagingVerdict
from tuner.measure.failures import Failure, from_error

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Watched(Generic[T]):
    value: T | None  # None: the round failed
    failure: Failure | None
    noise: str | None  # what disturbed the machine (None: quiet)
    others_memory: str | None = None  # other programs' memory load the watch saw (None: none)


def watched_round(cfg: LaunchConfig, label: str, what: str, run: Callable[[], T],
                  on_step: Callable[[str], None] | None = None) -> Watched[T]:
    """``run()`` (one measurement of ``cfg``) under the watch; ``what`` names the round in messages ("round 3")."""
    failure = None
    with quiet.watch_for([cfg], runner.own_pids) as watch:
        try:
            value: T | None = run()
        except TrialFailedError as exc:
            value, failure = None, exc.failure
        except UnsupportedFlagError as exc:  # refused before launch: the arm failed, the run goes on
            value, failure = None, from_error(exc)
    if watch.noise and on_step:
        on_step(f"{what}: {label} was measured on a busy machine ({watch.noise}): it decides nothing")
    return Watched(blamed(value, watch.others_memory), failure, watch.noise, watch.others_memory)


def shown_line(cfg: LaunchConfig) -> str:
    """An arm's launch line for messages and records; empty where its engine's dialect refuses it (its rounds then
    fail with the reason: :func:`watched_round`)."""
    try:
        return flags.launch_line(cfg)
    except UnsupportedFlagError:
        return ""


def blamed(value: T, others_memory: str | None) -> T:
    """A trial (any dataclass with a ``host_paging`` verdict) with its paging judged against what the watch saw."""
    verdict: Any = getattr(value, "host_paging", None)
    if not others_memory or not isinstance(verdict, PagingVerdict) or not is_dataclass(value) or \
            "host_paging" not in {f.name for f in fields(value)}:
        return value
    return replace(value, host_paging=verdict.beside(others_memory))  # type: ignore[type-var]
