"""What a tuned run hands over: the lines to launch, in rank order, one answer whichever of its folders is read.
``launch-line`` (every format and ``--exec``), ``serve`` and the MCP tools all take their line from here; ``share``
reads the same race (:func:`tuner.search.result.race_of`).

- **One engine tuned**: rank 1 is the printed line (the finish's winner, or the agent session stage's), then the other
  re-measured lines by the finish's score (:func:`ranked`). A line its price refused (``--engines ik`` alone, priced
  against llama.cpp's logits) is never handed out: rank 1 then says why, in one line; nor are the engine's other lines
  that would need a price (they compute the numbers the price refused, unpriced).
- **A race across engines**: rank 1 is the line the race printed, with its engine's server; then the race's other lines
  in the rule's order (decided faster than llama.cpp's default first, then by median); then each engine's search's
  measured configs, the printed engine's first. A line its price refused, that cannot run here or that the race
  decided slower than another is never handed out: it is named, with why, where a rank runs out. Where the run printed
  no line, rank 1 says so and why; it never hands out a line the race did not print.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tuner.core.errors import TunerError, UsageError
from tuner.engine import build, flags
from tuner.engine.kinds import EngineKind, kind_by_name
from tuner.quality import engine_price
from tuner.report import deploy
from tuner.search.finish import ServerMeasurement
from tuner.search.result import Race, RaceLine, StudyResult, race_of, race_result, refused_price
from tuner.search.trials import TrialRecord, config_from_dict

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Pick:
    """A launchable line of a run and the figures it was chosen on, with where it was measured."""

    label: str
    config: dict[str, Any]
    figures: dict[str, Any]
    # The result (its folder's result.json) whose engine measured the line; None where that folder cannot be read here.
    result: StudyResult | None = None
    binary: str | None = None  # the llama-server it was measured with, where the run recorded it (a race's lines)

    @property
    def kind(self) -> EngineKind:
        return kind_by_name(self.config.get("engine"))

    @property
    def line(self) -> str:
        return flags.launch_line(config_from_dict(self.config))

    @property
    def key(self) -> tuple[str, str]:
        """What it runs: two engines' bare launches read the same and run different code."""
        return self.kind.name, self.line


@dataclass(frozen=True, slots=True)
class Handover:
    """A run's lines to hand out: ``printed`` is rank 1, ``others`` ranks 2 and on."""

    printed: Pick | None
    why_none: str  # why rank 1 hands out nothing (empty when it does)
    others: tuple[Pick, ...] = ()
    withheld: tuple[str, ...] = ()  # "label: why" of each line never handed out
    race: Race | None = None
    unread: tuple[str, ...] = ()  # what of the run could not be read here (another engine's folder)

    @property
    def picks(self) -> list[Pick]:
        return ([self.printed] if self.printed else []) + list(self.others)

    def at(self, rank: int) -> Pick:
        """The ``rank``-th line; one line naming why when there is none to hand out there."""
        if rank == 1:
            if self.printed is None:
                raise UsageError(self.why_none)
            return self.printed
        if 2 <= rank <= len(self.others) + 1:
            return self.others[rank - 2]
        n = len(self.others) + (self.printed is not None)
        never = f"; never handed out: {'; '.join(self.withheld)}" if self.withheld else ""
        unread = f"; not read: {'; '.join(self.unread)}" if self.unread else ""
        what = "lines to hand out (the race's, then its searches')" if self.race else "measured configs"
        raise UsageError(f"--rank {rank} is out of range: this result has {n} {what}{never}{unread}")


def of(result: StudyResult) -> Handover:
    """What ``result``'s run hands out (module docstring); a race's other folders are read beside ``result.source``."""
    race = race_of(result)
    if race is not None:
        return _of_race(result, race)
    own = own_picks(result)
    refused = refused_price(result)
    if refused is not None and own:
        label = own[0].label
        kind = own[0].kind.name
        # The price refused this engine's numbers on this model: its other lines compute them too, unpriced.
        kept = [p for p in own[1:] if not engine_price.needs_price(config_from_dict(p.config))]
        held = [f"{p.label}: not priced, and the line this result printed was refused by its price"
                for p in own[1:] if p not in kept]
        return Handover(None, f"{label}, the line this result printed, was refused by its price ({refused}): it is "
                              f"not a line to run; tune with --engines llama.cpp, or pass --max-kld off to take "
                              f"{kind}'s numbers as they are", tuple(kept), (f"{label}: refused by its price", *held))
    if not own:
        return Handover(None, _why_no_line(result))
    return Handover(own[0], "", tuple(own[1:]))


def _why_no_line(result: StudyResult) -> str:
    fin = result.finish
    paged = [*session_paged(result).values(), *(m.host_paging_evidence or "" for m in (*fin.candidates,
                                                                                          *fin.baselines) if m.paging)]
    if paged:
        return (f"no line: every measured config paged host RAM ({paged[0]}); a line that reads its model back from "
                "disk is never printed: free RAM, or tune again with a smaller quant or context")
    return "--rank 1 is out of range: this result has 0 measured configs"


def _of_race(result: StudyResult, race: Race) -> Handover:
    """A race's answer: the printed line, the race's lines still in the running, then each engine's search."""
    folders: dict[str, StudyResult | None] = {}
    unread: list[str] = []
    for engine in race.engines:
        line = race.engine_line(engine)
        assert line is not None
        folders[engine] = race_result(result, line)
        if folders[engine] is None:
            unread.append(f"{engine}'s search, in {line.result_dir} (not found beside {result.source or 'it'})")

    def pick(x: RaceLine) -> Pick:
        figures = {"chosen_by": "the engines' race", "standing": x.state, "why": x.why, "engine": x.engine,
                   "result": x.study, **{k: v for k, v in x.figures.items() if v is not None},
                   "against_llama_cpp_default": x.against_default, "price": x.price}
        return Pick(x.label, x.config, figures, folders.get(x.engine), x.binary)

    printed = race.printed_line
    withheld = [f"{x.label}: {x.why}" for x in race.lines if x.withheld]
    handed = [pick(x) for x in race.lines if not x.withheld and x is not printed]
    for engine in race.engines:  # each search's measured configs, as its own folder ranks them
        found = folders[engine]
        if found is not None:
            handed += [Pick(p.label if p.label.startswith(engine) else f"{engine} {p.label}", p.config,
                            p.figures | {"engine": engine, "result": found.study}, found) for p in own_picks(found)]
    never = {pick(x).key for x in race.lines if x.withheld}
    first = pick(printed) if printed is not None else None
    rest = [p for p in _distinct([*([first] if first else []), *handed], lambda p: p.key)
            if p is not first and p.key not in never]
    if first is not None:
        return Handover(first, "", tuple(rest), tuple(withheld), race, tuple(unread))
    return Handover(None, race.why_none, tuple(rest), tuple(withheld), race, tuple(unread))


# ----------------------------------------------------------------------------------- one result's own lines


def _distinct(arms: list[T], line_of: Callable[[T], Hashable]) -> list[T]:
    """``arms`` without the later ones that run the same line as an earlier one (one line to launch)."""
    seen: set[Hashable] = set()
    kept = []
    for arm in arms:
        key = line_of(arm)
        if key not in seen:
            seen.add(key)
            kept.append(arm)
    return kept


def ranked(result: StudyResult) -> list[ServerMeasurement]:
    """Every config re-measured with llama-server (candidates and baselines), each distinct line once: the printed
    one (:attr:`tuner.search.finish.Finish.winner`, as its verdict measured it) first, then the others in the
    finish's own order, the score it selects by (:meth:`~tuner.search.finish.Finish.rank`, over the rounds every
    arm was measured in); those that miss --min-tok-s after them, failed ones last. An arm whose own VRAM broke
    the budget, or was never read under one, is not a line to launch: it is left out.

    The winner is matched by label, not identity: after confirmation rounds it is the confirmation's copy, and its
    selection copy must not come back as a runner-up. An arm that paged host RAM is left out too (a line that reads
    its model back from disk is never printed)."""
    fin = result.finish
    winner = fin.winner
    rest = [m for m in (*fin.candidates, *fin.baselines)
            if (winner is None or m.label != winner.label) and not fin.over_budget(m) and not fin.vram_unknown(m)
            and not m.paging]
    rest.sort(key=lambda m: (not fin.eligible(m), fin.rank(m) is None, -(fin.rank(m) or 0.0)))
    return _distinct([winner, *rest] if winner is not None else rest, lambda m: m.launch_line)


def session_paged(result: StudyResult) -> dict[str, str]:
    """The launch lines the session stage saw page host RAM, with the evidence: never printed, whatever ranks them."""
    stage = result.session or {}
    return {a["launch_line"]: a["paging"] for a in [*stage.get("arms", []), *(stage.get("confirmation") or [])]
            if a.get("paging")}


def deciding_session(result: StudyResult) -> dict[str, Any] | None:
    """The agent workload's session stage when it chose the config to launch (it ran and has a winner)."""
    stage = result.session
    return stage if stage and stage.get("winner") else None


def own_picks(result: StudyResult) -> list[Pick]:
    """The lines of one result as its own stages ranked them: the agent workload's session stage when it ran (its
    printed one, then by median session time, the confirmation's figures where an arm was measured again; failed last;
    none that paged host RAM, broke the VRAM budget or was not known to keep it); else the finish's (:func:`ranked`);
    else, for a search that stopped before a finish (each engine's in a race), its measured configs by score."""
    stage = deciding_session(result)
    paged = session_paged(result)
    if stage is not None:
        judged = {a["label"]: a for a in [*stage["arms"], *(stage.get("confirmation") or [])]
                  if a.get("config") and a["launch_line"] not in paged and not a.get("over_budget")
                  and a.get("vram_verdict") != "unknown"}
        arms = sorted(judged.values(), key=lambda a: (a["label"] != stage["winner"], a["median_session_s"] is None,
                                                     a["median_session_s"] or 0.0))
        return _distinct([Pick(a["label"], a["config"], {"median_session_s": a["median_session_s"],
                                                         "chosen_by": "agent session time"}, result) for a in arms],
                         lambda p: p.line)
    finished = [Pick(m.label, m.config, {"gen_tok_s": m.gen_tok_s, "gen_cv_pct": m.gen_cv_pct}, result)
                for m in ranked(result) if m.launch_line not in paged]
    return finished or _searched(result)


def _searched(result: StudyResult) -> list[Pick]:
    """A search's measured configs (llama-bench trials, never re-measured by a server), best score first, each line
    once, on the result's model."""
    trials = sorted((t for t in result.trials if t.status == "measured" and t.score is not None),
                    key=lambda t: t.score or 0.0, reverse=True)
    model = {"model": result.model} if result.model else {}

    def figures(t: TrialRecord) -> dict[str, Any]:
        unpriced = engine_price.needs_price(config_from_dict(t.config)) and t.kld is None
        return {"chosen_by": "its search (llama-bench), not raced", "gen_tok_s": t.gen_tok_s,
                "prompt_tok_s": t.prompt_tok_s, "request_s": t.request_s, "kld": t.kld,
                **({"price": "not priced: it computes other numbers than llama.cpp's bare launch, and its search "
                             "priced none"} if unpriced else {})}

    picks = [Pick(f"search trial {t.number}", t.config | model, figures(t), result) for t in trials]
    return _distinct(picks, lambda p: p.line)


# ------------------------------------------------------------------------------------------- the line itself


def binary_for(pick: Pick, llama_cpp_dir: Path | None = None) -> str:
    """The llama-server a line names: plain ``llama-server`` for llama.cpp (the user's own, on PATH); for another
    engine, whose server has the same name, the absolute path of that engine's build here (the one it was measured
    with when that is still there), so the line runs the engine that was measured."""
    kind = pick.kind
    if kind.server_on_path:
        return "llama-server"
    engine = (pick.result.engine if pick.result is not None else None) or {}
    measured = [Path(pick.binary)] if pick.binary else []
    measured.append(Path(str(engine.get("bin_dir", ""))) / "llama-server")
    try:
        return str(build.locate_engine(llama_cpp_dir, kind).tool("llama-server"))
    except TunerError:
        there = next((p for p in measured if p.is_file()), None)
        if there is not None:
            return str(there)
        raise


def argv(pick: Pick, *, host: str | None = None, port: int | None = None, binary: str = "llama-server") -> list[str]:
    """The line's command as an argument list (what ``--exec`` and ``serve`` run)."""
    return flags.server_argv(Path(binary), config_from_dict(pick.config)) + flags.address_argv(host, port)


def env(pick: Pick) -> dict[str, str]:
    """What the line's engine reads from its environment (:func:`tuner.engine.flags.server_env`)."""
    return flags.server_env(config_from_dict(pick.config))


def render(pick: Pick, fmt: str = "shell", *, host: str | None = None, port: int | None = None,
           binary: str | None = None, env: Mapping[str, str] | None = None, llama_cpp_dir: Path | None = None) -> str:
    """The line as ``fmt`` (one of :data:`tuner.report.deploy.FORMATS`; what a format cannot carry is written into
    it). A service (llama-swap, systemd, compose) does not inherit the shell's environment, so by default it gets the
    variables here that choose the card (:func:`tuner.report.deploy.line_env`); a systemd unit runs the engine found
    here (``llama_cpp_dir``, LLAMA_CPP_DIR, PATH, the managed one) by its absolute path. ``binary`` None: the line's
    own engine (:func:`binary_for`)."""
    if fmt not in deploy.FORMATS:
        raise UsageError(f"unknown --format {fmt}: use {', '.join(deploy.FORMATS)}")
    if binary is None:
        binary = binary_for(pick, llama_cpp_dir)
    if fmt == "systemd" and not Path(binary).is_absolute():
        binary = str(build.locate_engine(llama_cpp_dir, pick.kind).tool("llama-server"))
    if env is None:
        env = deploy.line_env(os.environ) if fmt in deploy.SERVICE_FORMATS else {}
    study = pick.result.study if pick.result is not None else str(pick.figures.get("result", "?"))
    line = deploy.Line(config_from_dict(pick.config), pick.label, study, pick.config, pick.figures,
                       pick.result.engine if pick.result is not None else {"engine": pick.kind.name})
    return deploy.render(line, fmt, host=host, port=port, binary=binary, env=env).text
