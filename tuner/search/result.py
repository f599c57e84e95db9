"""result.json: a study's result as typed values, rebuilt from the Optuna storage alone, versioned.

One convention for every record in it: ``to_dict()`` gives JSON-safe data, ``from_dict()`` reads it back and
``from_dict(x.to_dict()) == x``. A file from another schema version is refused with the fix, never half-read.
The report (:mod:`tuner.report.study_report`) renders these values; it does not build them.

A run across engines (``auto-tune`` with ik_llama.cpp installed) writes its race into each engine's result
(``engines``); :func:`race_of` reads it back as one answer whichever folder is read: every line with its standing (the
printed one, lines still in the running, lines never to hand out and why), in the rule's order, and
:func:`race_result` finds the folder of the engine that measured a line. What each handover (launch-line, serve,
share, the MCP tools) gives out is decided from these, here, once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.core.errors import ResultVersionError, TunerError, UsageError
from tuner.engine.kinds import DEFAULT_KIND
from tuner.machine.fileio import atomic_write
from tuner.search.finish import Finish, ServerMeasurement
from tuner.search.trials import TrialRecord, pareto_front, records
from tuner.search.verdict import BETTER, WORSE, Verdict, compare_quiet

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
    # The result.json this was read from (:func:`load_result`; None: built in memory): a run across engines finds its
    # other engines' folders beside it. Not part of the record.
    source: Path | None = field(default=None, compare=False, repr=False)

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
        return replace(StudyResult.from_dict(data, file), source=file)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{file} is not a whole auto-tune result ({exc}): run auto-tune again") from None


def refused_price(result: StudyResult) -> str | None:
    """Why the line a single engine's auto-tune printed is not one to run: its price refused it (``--engines ik``
    alone, :func:`tuner.versus.engine_run.price_single`); None when no price refused it."""
    price = result.engine_price or {}
    if not price.get("refused"):
        return None
    kld, floor = price.get("kld_mean"), (result.objective or {}).get("max_kld")
    if kld is None:
        return str(price.get("note") or "refused by its price")
    return (f"mean KLD {kld:.4g} against {price.get('reference') or 'llama.cpp'}'s f16 logits"
            + (f", above --max-kld {floor:g}" if floor is not None else ""))


# ------------------------------------------------------------------------------------ the engines' race


REFERENCE = f"{DEFAULT_KIND.name} default"  # llama.cpp's bare launch: every line raced against it
# Where the race left a line (``standing.state`` in each line of the ``engines`` block).
PRINTED, IN, REFUSED, UNPRICED = "printed", "in", "refused", "unpriced"
PAGED, OVER_BUDGET, FAILED, SLOWER, NOT_RACED = "paged", "over_budget", "failed", "slower", "not_raced"
SCREENED = "screened"  # not raced: its search could not tell it from its engine's default
# Never handed out, at any rank: its price refused it, it cannot run here, or the race decided it slower than another
# line (out of the running).
WITHHELD = frozenset({REFUSED, PAGED, OVER_BUDGET, FAILED, SLOWER})


@dataclass(frozen=True, slots=True)
class RaceLine:
    """One line of the race as the result records it (``tuner.versus.engines.EngineLine.to_dict``) and where the race
    left it (``state``, ``why``)."""

    label: str  # "ik_llama.cpp tuned"
    engine: str
    config: dict[str, Any]
    study: str  # the study (and folder name) of the engine's search
    result_dir: str  # that folder, as the run named it
    binary: str  # the llama-server it raced with
    state: str
    why: str
    price: dict[str, Any] | None = None  # its quality price (tuner.quality.engine_price.LinePrice.to_dict)
    figures: dict[str, Any] = field(default_factory=dict)  # the race's medians of it
    against_default: dict[str, Any] | None = None  # its verdict against llama.cpp's default, from the race's rounds

    @property
    def withheld(self) -> bool:
        return self.state in WITHHELD


@dataclass(frozen=True, slots=True)
class Race:
    """The race a result records: its lines in the rule's order (the printed one first), what was printed and why."""

    lines: tuple[RaceLine, ...]
    printed: str | None  # the printed line's label; None: the run printed no line
    reason: str
    chosen: bool  # whether the result read is the printed engine's
    metric: str | None = None

    @property
    def printed_line(self) -> RaceLine | None:
        """The line the run printed, unless its price refused it (then none is)."""
        line = next((x for x in self.lines if x.label == self.printed), None)
        return None if line is None or line.withheld else line

    @property
    def why_none(self) -> str:
        """Why the run hands out no line as its own (:attr:`printed_line` is None), in one clause."""
        line = next((x for x in self.lines if x.label == self.printed), None)
        if line is None:
            return f"the run printed no line: {self.reason}"
        return f"the run printed {line.label}, but {line.label} {line.why}: it is not a line to run"

    @property
    def engines(self) -> list[str]:
        """The engines that raced, the printed line's first."""
        first = self.printed_line
        names = [x.engine for x in ([first] if first else []) + list(self.lines)]
        return list(dict.fromkeys(names))

    def engine_line(self, engine: str) -> RaceLine | None:
        """A line of ``engine`` (its study and folder are the engine's search's)."""
        return next((x for x in self.lines if x.engine == engine), None)


def race_of(result: StudyResult) -> Race | None:
    """The race recorded in ``result`` (None: one engine was tuned). Each line's standing as the run wrote it, or, in a
    result written before standings, from its records: refused by its price where the run says so, paged, failed or
    over the VRAM budget by its rounds, decided slower than another line that runs by their rounds."""
    block = result.engines
    if not block or not block.get("lines"):
        return None
    versus = block.get("head_to_head") or {}
    arms = {a["label"]: a for a in versus.get("arms") or []}
    notes = {x["label"]: why for x in block["lines"] for note in block.get("refused") or []
             if note.startswith(f"{x['label']}: ") and (why := note[len(x["label"]) + 2:])}
    vs_default = {v["a"]: v for v in block.get("verdicts_against_default") or [] if v.get("b") == REFERENCE}
    if block.get("printed") and block.get("against_default"):
        vs_default[block["printed"]] = block["against_default"]
    budget = versus.get("vram_budget_bytes")
    gone = {x["label"]: _left(x, block, arms.get(x["label"]), notes.get(x["label"]), budget)
            for x in block["lines"]}
    runs = [arms[k] for k, v in gone.items() if v is None and arms.get(k, {}).get("score") is not None]
    lines = []
    for x in block["lines"]:
        arm = arms.get(x["label"], {})
        state, why = _standing(x, block, gone[x["label"]], arm, runs)
        lines.append(RaceLine(x["label"], x["engine"], x["config"], x["study"], x["result_dir"], x["binary"], state,
                              why, x.get("price"), {k: arm.get(k) for k in ("gen_tok_s", "prompt_tok_s", "ttft_s",
                                                                             "session_s")},
                              vs_default.get(x["label"])))
    return Race(tuple(_ordered(lines, block, arms)), block.get("printed"), block.get("reason") or "",
                bool(block.get("chosen")), versus.get("metric"))


def _left(x: dict[str, Any], block: dict[str, Any], arm: dict[str, Any] | None, note: str | None,
          budget: int | None) -> tuple[str, str] | None:
    """Why a line is out of the race on its own (refused, unpriced, not raced, paged, failed, over budget); None."""
    price = x.get("price") or {}
    if price.get("refused") or (note and "refused by its price" in note):
        return REFUSED, note or "was refused by its price"
    if note and "could not be priced" in note:
        return UNPRICED, note
    if arm is None:
        return NOT_RACED, note or "was not raced"
    if arm.get("host_paging"):
        return PAGED, f"read its model back from disk while generating ({arm['host_paging']})"
    if arm.get("score") is None:
        return FAILED, f"failed ({arm['failure']})" if arm.get("failure") else "was not measured"
    rounds = [r for r in (*arm.get("selection", []), *arm.get("rounds", [])) if r.get("score") is not None]
    grew = [r["vram_growth_bytes"] for r in rounds if r.get("vram_growth_bytes") is not None]
    if budget and (any(g > budget for g in grew) or len(grew) < len(rounds)):
        return OVER_BUDGET, (f"used {max(grew) / 2**20:,.0f} MiB of VRAM, over the {budget / 2**20:,.0f} MiB budget"
                             if grew and max(grew) > budget else "its VRAM was not read (not known to keep the budget)")
    return None


def _standing(x: dict[str, Any], block: dict[str, Any], left: tuple[str, str] | None, arm: dict[str, Any],
              runs: list[dict[str, Any]]) -> tuple[str, str]:
    if left is not None and left[0] == REFUSED:
        return left  # a line its price refused is never one to run, whatever else was written of it
    given = x.get("standing")
    if isinstance(given, dict) and given.get("state"):
        return str(given["state"]), str(given.get("why") or "")
    if left is not None and x["label"] != block.get("printed"):
        return left
    if x["label"] == block.get("printed"):
        return PRINTED, block.get("reason") or ""
    if x["label"] != REFERENCE:  # as the race's out_of_running: every verdict is against llama.cpp's default
        for other in runs:
            v = _pair(arm, other)
            if other["label"] != x["label"] and v.outcome == WORSE:
                return SLOWER, (f"was decided slower than {other['label']} ({v.ratio:.2f}x, 99 % {v.low:.2f}-"
                                f"{v.high:.2f}x over {v.rounds} rounds)")
    return IN, "raced and was not decided slower than another line, but not printed"


def _pair(a: dict[str, Any], b: dict[str, Any]) -> Verdict:
    """``a`` against ``b`` on their rounds (as the race's ``HeadToHead.pair``, from their records)."""
    def scores(arm: dict[str, Any], quiet: bool) -> list[float | None]:
        return [None if quiet and r.get("noise") else r.get("score") for r in arm.get("rounds", [])]

    return compare_quiet(a["label"], b["label"], scores(a, False), scores(b, False), scores(a, True), scores(b, True))


def _ordered(lines: list[RaceLine], block: dict[str, Any], arms: dict[str, dict[str, Any]]) -> list[RaceLine]:
    """The rule's order: the printed line, then lines decided faster than llama.cpp's default, then by median (the
    run's own ``order`` where it wrote one)."""
    if block.get("order"):
        at = {label: i for i, label in enumerate(block["order"])}
        return sorted(lines, key=lambda x: at.get(x.label, len(at)))

    def key(x: RaceLine) -> tuple[bool, bool, bool, float]:
        score = arms.get(x.label, {}).get("score")
        faster = (x.against_default or {}).get("outcome") == BETTER
        return x.state != PRINTED, not faster, score is None, -(score or 0.0)

    return sorted(lines, key=key)


def race_result(result: StudyResult, line: RaceLine) -> StudyResult | None:
    """The result of the engine that measured ``line`` (``result`` itself where it is that engine's): its folder
    beside the result read, or where the run wrote it; None when it cannot be read here."""
    if line.study == result.study:
        return result
    folders = [result.source.parent.parent / line.study] if result.source is not None else []
    for folder in [*folders, Path(line.result_dir)]:
        try:
            found = load_result(folder)
        except TunerError:
            continue
        if found.study == line.study:
            return found
    return None
