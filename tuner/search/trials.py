"""A study's trials as plain records: what was tried and what came of it, read back from the storage alone.

No Optuna import: the records read Optuna's FrozenTrial by attribute, so reports and results can use them
without the search.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.config import CacheType, FlashAttn, LaunchConfig
from tuner.search import dedup

CONSTRAINTS_ATTR = "constraints"  # user attr holding the constraint dict (and Optuna 4's constraints_func input)


def config_to_dict(cfg: LaunchConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in asdict(cfg).items():
        out[key] = value.value if hasattr(value, "value") else (str(value) if isinstance(value, Path) else value)
    return out


def config_from_dict(data: dict[str, Any]) -> LaunchConfig:
    d = dict(data)
    d["model"] = Path(d["model"])
    d["cache_type_k"] = CacheType(d["cache_type_k"])
    d["cache_type_v"] = CacheType(d["cache_type_v"])
    d["flash_attn"] = FlashAttn(d["flash_attn"])
    return LaunchConfig(**d)


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One trial as stored: what was tried and what came of it."""

    number: int
    status: str  # measured | host_paging | paging_beside_others | infeasible | failed | interrupted | running
    config: dict[str, Any]
    seed: str | None = None  # which known-good config this was, for enqueued seeds
    gen_tok_s: float | None = None
    prompt_tok_s: float | None = None
    gen_cv_pct: float | None = None
    prompt_cv_pct: float | None = None
    constraints: dict[str, float] = field(default_factory=dict)
    failure: dict[str, Any] | None = None
    argv: list[str] = field(default_factory=list)
    worker: str | None = None  # host:pid of the process that ran it
    request_s: float | None = None  # one workload request at the measured speeds (the score's inverse)
    prompt_depth: int | None = None  # context filled before the prompt test
    gen_depth: int | None = None  # context filled before the generation test
    repetitions: int | None = None
    kld: float | None = None  # mean KLD of the config's KV pair against f16 KV (None: not priced)
    same_top_pct: float | None = None
    # Host RAM over the timed generation (tuner.machine.sampler.PagingVerdict.to_dict); None: stored before it was.
    host_paging: dict[str, Any] | None = None
    elapsed_s: float | None = None  # the llama-bench process's wall time, its model load included (None: not kept)

    @classmethod
    def from_trial(cls, t: Any) -> TrialRecord:
        """From Optuna's FrozenTrial (read by attribute: no Optuna import here)."""
        a = t.user_attrs
        status = a.get("status") or ("running" if t.state.name in ("RUNNING", "WAITING") else "failed")
        return cls(t.number, status, a.get("config", {}), a.get("seed"), a.get("gen_tok_s"), a.get("prompt_tok_s"),
                   a.get("gen_cv_pct"), a.get("prompt_cv_pct"), a.get(CONSTRAINTS_ATTR, {}), a.get("failure"),
                   a.get("argv", []), a.get("worker"), a.get("request_s"), a.get("prompt_depth"),
                   a.get("gen_depth"), a.get("repetitions"), a.get("kld"), a.get("same_top_pct"),
                   a.get("host_paging"), a.get("elapsed_s"))

    @property
    def score(self) -> float | None:
        """Requests per second (higher is better); generation tok/s for trials stored before the score."""
        if self.request_s:
            return 1.0 / self.request_s
        return self.gen_tok_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



def records(study: Any) -> list[TrialRecord]:
    """Every trial of the study but the sampler's skipped repeats (:mod:`tuner.search.dedup`)."""
    return [TrialRecord.from_trial(t) for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("status") != dedup.DUPLICATE]


def best_measured(recs: Sequence[TrialRecord]) -> TrialRecord | None:
    measured = [r for r in recs if r.status == "measured" and r.score is not None]
    return max(measured, key=lambda r: r.score or 0.0, default=None)



def top_configs(recs: Sequence[TrialRecord], n: int, *, same: Callable[[LaunchConfig], LaunchConfig] = lambda c: c,
                exclude: Sequence[LaunchConfig] = (), model: Path | None = None
                ) -> list[tuple[TrialRecord, LaunchConfig]]:
    """The ``n`` best measured configs, by score, distinct by what they run as (``same``), none running as one
    of ``exclude`` (the baselines the finish measures anyway). ``model``: this run's model file, put in place of
    the stored one (a worker of a shared study may have measured it from another folder)."""
    ranked = sorted((r for r in recs if r.status == "measured" and r.score is not None),
                    key=lambda r: r.score or 0.0, reverse=True)
    out: list[tuple[TrialRecord, LaunchConfig]] = []
    seen: set[LaunchConfig] = {same(c) for c in exclude}
    for rec in ranked:
        cfg = config_from_dict(rec.config)
        if model is not None:
            cfg = replace(cfg, model=model)
        if same(cfg) not in seen:
            seen.add(same(cfg))
            out.append((rec, cfg))
        if len(out) == n:
            break
    return out


def non_dominated(points: Sequence[tuple[float, ...] | None]) -> list[bool]:
    """For each point (every axis: higher is better; None: not measured), whether no other point is at least
    as good on every axis and better on one."""
    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return a != b and all(x >= y for x, y in zip(a, b, strict=True))

    return [p is not None and not any(o is not None and dominates(o, p) for o in points) for p in points]


def pareto_front(study: Any) -> list[TrialRecord]:
    if len(study.directions) < 2:
        return []
    numbers = {t.number for t in study.best_trials}
    return [r for r in records(study) if r.number in numbers]
