"""result.json: a study's result as typed values, rebuilt from the Optuna storage alone, versioned.

One convention for every record in it: ``to_dict()`` gives JSON-safe data, ``from_dict()`` reads it back and
``from_dict(x.to_dict()) == x``. A file from another schema version is refused with the fix, never half-read.
The report (:mod:`tuner.report.study_report`) renders these values; it does not build them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuner.core.errors import ResultVersionError, UsageError
from tuner.machine.fileio import atomic_write
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.trials import TrialRecord, pareto_front, records

# 2: trials at the workload's depth, KV quality prices, slots, verdicts; 1: the first auto-tune.
RESULT_VERSION = 2
RESULT_FILE = "result.json"


@dataclass(frozen=True, slots=True)
class QualitySummary:
    max_kld: float | None = None  # the floor the search used (None: no floor)
    winner_kld_mean: float | None = None
    winner_same_top_pct: float | None = None
    kv_prices: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv_prices": list(self.kv_prices)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QualitySummary:
        return cls(d.get("max_kld"), d.get("winner_kld_mean"), d.get("winner_same_top_pct"),
                   tuple(d.get("kv_prices") or ()))


@dataclass(frozen=True, slots=True)
class StudyResult:
    study: str
    model: str | None
    finish: Finish
    trials: tuple[TrialRecord, ...] = ()
    pareto: tuple[int, ...] = ()
    hardware: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    workload: dict[str, Any] | None = None
    objective: dict[str, Any] | None = None
    space: dict[str, Any] | None = None
    measure: dict[str, Any] | None = None
    quality: QualitySummary = field(default_factory=QualitySummary)
    version: int = RESULT_VERSION
    frontier: dict[str, Any] | None = None  # auto-tune --frontier: tuner.frontier.result.Frontier.to_dict()
    # The agent workload's session stage (tuner.search.session_stage.SessionStage.to_dict()): its winner, not the
    # finish's, is the config to launch.
    session: dict[str, Any] | None = None
    # The tuned file's size and sampled hashes (tuner.models.fingerprint); None in results written before it.
    model_fingerprint: dict[str, Any] | None = None
    # Seeds proposed from outside (`--seed-from`): label → where it came from (tuner.search.proposals).
    seed_origins: dict[str, str] | None = None
    # Whose memory figures decided the gate (tuner.measure.engine_memory.EngineMemory.summary); None before it.
    memory_figures: dict[str, Any] | None = None
    # `auto-tune --engines`: every engine's line judged head to head (tuner.versus.engines.EngineChoice.to_dict),
    # with ``chosen``: whether this result's engine printed the line to run. None: one engine was tuned.
    engines: dict[str, Any] | None = None
    # Another engine tuned alone (`--engines ik`): its printed line priced as it runs against llama.cpp's f16 logits
    # (tuner.quality.engine_price.LinePrice.to_dict() with ``refused`` and ``note``); None: not priced.
    engine_price: dict[str, Any] | None = None

    def seed_story(self) -> str | None:
        """Which seed the printed line (or, when llama.cpp's own choice is printed, the best candidate) came from,
        and where that seed came from; None when no seed was proposed from outside."""
        if not self.seed_origins:
            return None
        decision = self.finish.decision
        arm = decision.shipped if decision.taken else decision.best
        trial = next((t for t in self.trials if arm is not None and t.number == arm.trial_number), None)
        seed = trial.seed if trial is not None else None
        role = "the printed line" if decision.taken else "the best candidate"
        if arm is None:
            return "no candidate was measured: no seed won"
        if seed in self.seed_origins:
            return f"{role} ({arm.label}) came from seed {seed}: {self.seed_origins[seed]}"
        came = f"seed {seed}" if seed else "the sampler"
        return f"{role} ({arm.label}) came from {came}, not from a shared line ({', '.join(self.seed_origins)})"

    @property
    def winner(self) -> ServerMeasurement | None:
        return self.finish.winner

    @property
    def speedup(self) -> dict[str, float | None]:
        return {"default": self.finish.speedup("default"), "fit": self.finish.speedup("fit")}

    def to_dict(self) -> dict[str, Any]:
        winner = self.winner
        return {
            "version": self.version, "study": self.study, "model": self.model, "hardware": self.hardware,
            "engine": self.engine, "workload": self.workload, "objective": self.objective, "space": self.space,
            "trials": [t.to_dict() for t in self.trials], "pareto": list(self.pareto),
            "finish": self.finish.to_dict(), "winner": winner.to_dict() if winner else None,
            "speedup": self.speedup, "measure": self.measure, "quality": self.quality.to_dict(),
            **({"frontier": self.frontier} if self.frontier is not None else {}),
            **({"session": self.session} if self.session is not None else {}),
            **({"model_fingerprint": self.model_fingerprint} if self.model_fingerprint is not None else {}),
            **({"seed_origins": self.seed_origins, "seed_story": self.seed_story()} if self.seed_origins else {}),
            **({"memory_figures": self.memory_figures} if self.memory_figures is not None else {}),
            **({"engines": self.engines} if self.engines is not None else {}),
            **({"engine_price": self.engine_price} if self.engine_price is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], file: Path = Path(RESULT_FILE)) -> StudyResult:
        if d.get("version") != RESULT_VERSION:
            raise ResultVersionError(file, d.get("version"), RESULT_VERSION)
        return cls(
            study=d["study"], model=d.get("model"), finish=Finish.from_dict(d["finish"]),
            trials=tuple(TrialRecord(**t) for t in d.get("trials", [])), pareto=tuple(d.get("pareto", [])),
            hardware=d.get("hardware"), engine=d.get("engine"), workload=d.get("workload"),
            objective=d.get("objective"), space=d.get("space"), measure=d.get("measure"),
            quality=QualitySummary.from_dict(d.get("quality") or {}), frontier=d.get("frontier"),
            session=d.get("session"), model_fingerprint=d.get("model_fingerprint"),
            seed_origins=d.get("seed_origins"), memory_figures=d.get("memory_figures"), engines=d.get("engines"),
            engine_price=d.get("engine_price"),
        )


def result_from_study(st: Any) -> StudyResult:
    """Rebuild the whole result from the study's storage alone."""
    attrs = dict(st.user_attrs)
    fin = Finish.from_dict(attrs["finish"]) if "finish" in attrs else Finish((), ())
    winner = fin.winner
    return StudyResult(
        study=st.study_name, model=attrs.get("model"), finish=fin, trials=tuple(records(st)),
        pareto=tuple(r.number for r in pareto_front(st)), hardware=attrs.get("hardware"),
        engine=attrs.get("engine"), workload=attrs.get("workload"), objective=attrs.get("objective"),
        space=attrs.get("space"), measure=attrs.get("measure"),
        quality=QualitySummary((attrs.get("objective") or {}).get("max_kld"),
                               winner.kld_mean if winner else None, winner.same_top_pct if winner else None,
                               tuple(attrs.get("kv_prices", []))),
        frontier=attrs.get("frontier"), session=attrs.get("session"),
        model_fingerprint=attrs.get("model_fingerprint"), seed_origins=attrs.get("seed_origins"),
        memory_figures=attrs.get("memory_figures"), engines=attrs.get("engines"),
        engine_price=attrs.get("engine_price"),
    )


def write_result(result: StudyResult, out_dir: Path) -> Path:
    return atomic_write(out_dir / RESULT_FILE, json.dumps(result.to_dict(), indent=2) + "\n")


def load_result(path: Path) -> StudyResult:
    """A result.json (or the folder holding one) written by auto-tune; a clear error for anything else."""
    file = path / RESULT_FILE if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {file} ({exc}): pass results/<study>/result.json from auto-tune") from None
    if not isinstance(data, dict) or "finish" not in data or "study" not in data:
        raise UsageError(f"{file} is not an auto-tune result: pass results/<study>/result.json")
    if data.get("version") != RESULT_VERSION:
        raise ResultVersionError(file, data.get("version"), RESULT_VERSION)
    try:
        return StudyResult.from_dict(data, file)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{file} is not a whole auto-tune result ({exc}): run auto-tune again") from None
