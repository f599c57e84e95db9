"""Which engine for this rig: the lines that race, the rule that picks the printed one, and the records it leaves.

The race (:mod:`tuner.versus.engine_run` runs it): llama.cpp's default launch, what a user runs by hand, is the
reference; beside it each engine's own default launch and the best candidate its search found. They meet in
interleaved rounds on the workload (:func:`tuner.versus.judge.head_to_head`). No round selects: the searches chose
the candidates on their own measurements, so every round of the race is fresh for every line.

The rule (:func:`choose`): the printed line is one decided faster than llama.cpp's default and decided slower than no
other line; among several such, the fastest median, or the simpler line where the rounds left the two undecided.
A line that paged host RAM, broke the VRAM budget or was refused by its quality price is never printed, nor is a line
the rounds decided slower than another. Where no line wins, llama.cpp's default stays; where that default itself
cannot be run here (it paged, failed, broke the budget, or another line was decided faster than it), the fastest line
decided slower than no other is printed, and said; where none is left, no line is printed, and why is said.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.engine.kinds import DEFAULT_KIND, EngineKind
from tuner.search import autotune
from tuner.search.trials import config_to_dict
from tuner.search.verdict import BETTER, WORSE, Verdict, decidable
from tuner.versus import judge

REFERENCE = f"{DEFAULT_KIND.name} default"  # llama.cpp's bare launch: the reference every line races
DEFAULT, TUNED = "default", "tuned"


@dataclass(frozen=True, slots=True)
class EngineTune:
    """One engine's search: where it ran and what it found (``error``: why it found nothing on this model)."""

    kind: EngineKind
    loc: build.EngineLocation
    result: autotune.TuneResult | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineLine:
    label: str  # "ik_llama.cpp tuned", "llama.cpp default"
    engine: str
    config: LaunchConfig
    study: str
    result_dir: Path
    binary: Path
    role: str = TUNED  # "default": the engine's own launch; "tuned": its search's best candidate
    # Its quality price, once taken (tuner.quality.engine_price.LinePrice.to_dict()); None: not priced.
    price: dict[str, Any] | None = None

    @property
    def kld(self) -> float | None:
        return None if self.price is None else self.price.get("kld_mean")

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "engine": self.engine, "role": self.role, "config": config_to_dict(self.config),
                "study": self.study, "result_dir": str(self.result_dir), "binary": str(self.binary),
                "price": self.price, "engine_kld": self.kld, "launch_line": flags.launch_line(self.config,
                                                                                            str(self.binary))}


@dataclass(frozen=True, slots=True)
class EngineChoice:
    lines: tuple[EngineLine, ...]
    versus: judge.HeadToHead | None
    printed: str | None  # the label of the line to run; None: no line can be run here
    reason: str  # one sentence: why the printed line won, or why llama.cpp's default stays, or why nothing is printed
    refused: tuple[str, ...] = ()  # lines and engines left out, each with why
    against_default: Verdict | None = None  # the printed line against llama.cpp's default, from the race's rounds

    @property
    def line(self) -> EngineLine | None:
        return next((x for x in self.lines if x.label == self.printed), None)

    def verdicts(self) -> list[Verdict]:
        """Every runnable line against llama.cpp's default (the race's own figures)."""
        v = self.versus
        if v is None or v.arm(REFERENCE) is None:
            return []
        return [v.pair(a.label, REFERENCE) for a in v.arms if a.label != REFERENCE and a.score is not None
                and v.arm(REFERENCE).score is not None]  # type: ignore[union-attr]

    def to_dict(self) -> dict[str, Any]:
        line = self.line
        return {"lines": [x.to_dict() for x in self.lines], "head_to_head": self.versus.to_dict() if self.versus
                else None, "printed": self.printed, "printed_engine": line.engine if line else None,
                "reason": self.reason, "refused": list(self.refused),
                "against_default": self.against_default.to_dict() if self.against_default else None,
                "verdicts_against_default": [v.to_dict() for v in self.verdicts()]}


def lines_of(tunes: Sequence[EngineTune]) -> list[EngineLine]:
    """The racing lines: each engine's default launch and its search's best candidate (once, where they are the same
    line), llama.cpp's default first."""
    out: list[EngineLine] = []
    for t in tunes:
        res = t.result
        if res is None or res.default is None:
            continue
        binary = t.loc.tool("llama-server")
        default_line = flags.launch_line(res.default)
        out.append(EngineLine(f"{t.kind.name} {DEFAULT}", t.kind.name, res.default, res.study_name, res.result_dir,
                              binary, DEFAULT))
        best = next((c for c in res.candidates if flags.launch_line(c) != default_line), None)
        if best is not None:
            out.append(EngineLine(f"{t.kind.name} {TUNED}", t.kind.name, best, res.study_name, res.result_dir, binary,
                                  TUNED))
    return sorted(out, key=lambda x: x.label != REFERENCE)


# ----------------------------------------------------------------------------------------------------- the rule


def _simplicity(line: EngineLine) -> int:
    """How many words its launch line has beyond the bare launch: fewer is simpler."""
    return len(flags.launch_line(line.config).split())


def _why_not(arm: judge.Arm | None, budget: int | None) -> str:
    if arm is None:
        return "was not measured"
    if arm.paging:
        every = (*arm.selection, *arm.rounds)
        paged = sum(1 for r in every if r.host_paging)
        return (f"read its model back from disk while generating in {paged} of {len(every)} rounds (it does not fit "
                "this machine's RAM as it is)")
    if arm.score is None:
        return f"failed ({arm.failure})" if arm.failure else "was not measured"
    return f"did not keep the VRAM budget: it {arm.budget_words(budget)}"


def _fastest(pool: Sequence[EngineLine], v: judge.HeadToHead) -> tuple[EngineLine, str | None]:
    """The fastest median of ``pool``, or a simpler line of it that the rounds did not decide slower than that one;
    with why, in words, where the simpler line was taken (None: the fastest was)."""
    def score(x: EngineLine) -> float:
        arm = v.arm(x.label)
        return (arm.score or 0.0) if arm is not None else 0.0

    ranked = sorted(pool, key=score, reverse=True)
    best = ranked[0]
    simpler = [x for x in ranked[1:] if _simplicity(x) < _simplicity(best)
               and v.pair(best.label, x.label).outcome != BETTER]
    if not simpler:
        return best, None
    won = min(simpler, key=lambda x: (_simplicity(x), -score(x)))
    p = v.pair(best.label, won.label)
    return won, (f"the simpler line where the rounds left it undecided against the faster median of {best.label} "
                 f"({p.ratio:.2f}x it, 99 % {p.low:.2f}-{p.high:.2f}x over {p.rounds} rounds both ran clean)")


def choose(lines: Sequence[EngineLine], versus: judge.HeadToHead | None, refused: Mapping[str, str] | None = None
           ) -> tuple[str | None, str, Verdict | None]:
    """The line to print, one sentence on why, and its verdict against llama.cpp's default (module docstring).
    ``refused``: lines left out by their price, label → why."""
    refused = refused or {}
    if versus is None:
        ref = next((x for x in lines if x.label == REFERENCE and x.label not in refused), None)
        return (REFERENCE, "no race was run: llama.cpp's default stays", None) if ref else \
            (None, "no race was run and llama.cpp's default was not measured: no line to print", None)
    budget = versus.vram_budget_bytes
    runnable = {a.label for a in versus.runnable()}
    ok = [x for x in lines if x.label in runnable and x.label not in refused]
    by = {x.label: x for x in ok}
    clean = [x for x in ok if not any(versus.pair(x.label, y.label).outcome == WORSE for y in ok if y is not x)]
    ref_ok = REFERENCE in by

    def against(x: EngineLine) -> Verdict | None:
        return versus.pair(x.label, REFERENCE) if ref_ok and x.label != REFERENCE else None

    winners = [x for x in clean if x.label != REFERENCE and (w := against(x)) is not None and w.outcome == BETTER]
    if winners:
        won, simpler = _fastest(winners, versus)
        v = against(won)
        assert v is not None
        others = "" if len(ok) <= 2 else " and slower than no other line"
        return won.label, (f"{won.label} was decided faster than llama.cpp's default ({v.ratio:.2f}x, 99 % "
                           f"{v.low:.2f}-{v.high:.2f}x over {v.rounds} rounds){others}"
                           + (f"; of the lines that were, it is {simpler}" if simpler else "")), v
    if ref_ok and by[REFERENCE] in clean:
        rivals = [(x, against(x)) for x in ok if x.label != REFERENCE]
        if not rivals:
            return REFERENCE, "llama.cpp's default stays: no other line could be run here to race it" + \
                _left_out(lines, versus, refused), None
        x, v = max(rivals, key=lambda p: p[1].ratio if p[1] else 0.0)
        assert v is not None
        if v.outcome == BETTER:  # decided faster than the default, but slower than another line
            slower = next(y.label for y in ok if versus.pair(x.label, y.label).outcome == WORSE)
            why = f"{x.label} was decided faster than it ({v.ratio:.2f}x) but slower than {slower}"
        else:
            word = "undecided" if v.outcome != WORSE else "decided slower"
            why = (f"no line was decided faster than it (the closest, {x.label}: {v.ratio:.2f}x, 99 % "
                   f"{v.low:.2f}-{v.high:.2f}x, {word})")
        return REFERENCE, f"llama.cpp's default stays: {why}" + _left_out(lines, versus, refused), None
    if clean:
        won, simpler = _fastest(clean, versus)
        ref_arm = versus.arm(REFERENCE)
        if ref_ok:
            faster = next(y.label for y in ok if versus.pair(REFERENCE, y.label).outcome == WORSE)
            why_ref = f"was decided slower than {faster}"
        elif REFERENCE in refused:
            why_ref = refused[REFERENCE]
        else:
            why_ref = _why_not(ref_arm, budget)
        v = against(won)
        measured = ref_arm is not None and ref_arm.score is not None and won.label != REFERENCE
        raw = v or (versus.pair(won.label, REFERENCE) if measured else None)
        vs = f" ({raw.ratio:.2f}x llama.cpp's default in the rounds both ran, 99 % {raw.low:.2f}-{raw.high:.2f}x)" \
            if raw is not None and raw.rounds else ""
        pick = (f"of the lines decided slower than no other, {won.label}{vs} is {simpler}" if simpler else
                f"{won.label}{vs} is the fastest line decided slower than no other")
        return won.label, f"llama.cpp's default {why_ref}: {pick}", raw
    gone = [f"{x.label} {refused.get(x.label) or _why_not(versus.arm(x.label), budget)}" for x in lines
            if x.label not in runnable or x.label in refused]
    return None, "no line can be run here: " + ("; ".join(gone) or "the rounds ranked none above the others"), None


def _left_out(lines: Sequence[EngineLine], versus: judge.HeadToHead, refused: Mapping[str, str]) -> str:
    """The lines that could not race for the print, in a clause (empty when none)."""
    runnable = {a.label for a in versus.runnable()}
    gone = [f"{x.label} {refused.get(x.label) or _why_not(versus.arm(x.label), versus.vram_budget_bytes)}"
            for x in lines if x.label not in runnable or x.label in refused]
    return f"; left out: {'; '.join(gone)}" if gone else ""


def settled(lines: Sequence[EngineLine], max_rounds: int) -> Callable[[judge.HeadToHead], bool]:
    """When the race may stop (asked after each round from the third): nothing more rounds, up to ``max_rounds``, could
    change the printed line. Every line that could still displace it (one not decided slower than llama.cpp's default
    or than another line) is decided against it, or hopeless: undecided, and as noisy as it has been, still undecided
    after the rounds left (:func:`tuner.search.verdict.decidable`)."""
    def done(versus: judge.HeadToHead) -> bool:
        answer, _, _ = choose(lines, versus)
        ok = {a.label for a in versus.runnable()}
        if answer is None:
            return not ok  # nothing runs: more rounds change nothing
        left = max_rounds - max((len(a.rounds) for a in versus.arms), default=0)
        rivals = [x.label for x in lines if x.label in ok and x.label != answer]
        for y in rivals:
            if REFERENCE in ok and y != REFERENCE and versus.pair(y, REFERENCE).outcome == WORSE:
                continue  # decided slower than the default: it cannot be printed
            if any(versus.pair(y, z).outcome == WORSE for z in rivals + [answer] if z != y):
                continue  # decided slower than another line
            if decidable(versus.pair(answer, y), left):
                return False
        return True

    return done


def out_of_running(lines: Sequence[EngineLine]) -> Callable[[judge.HeadToHead], set[str]]:
    """The lines the race's rounds so far put out of the running, not measured again: one decided slower than another
    line that runs here, or one that cannot run here (it paged host RAM, broke the VRAM budget); the rule prints
    neither, whatever more rounds say. llama.cpp's default is never out: every verdict is against it."""
    def out(versus: judge.HeadToHead) -> set[str]:
        ok = {a.label for a in versus.runnable()}
        measured = {a.label for a in versus.arms if a.score is not None}
        gone = {x.label for x in lines if x.label in measured and x.label not in ok}
        gone |= {x.label for x in lines if x.label in ok and any(
            versus.pair(x.label, y).outcome == WORSE for y in ok if y != x.label)}
        return gone - {REFERENCE}

    return out


# -------------------------------------------------------------------------------------------------- the record


def record(tunes: Sequence[EngineTune], choice: EngineChoice) -> list[autotune.TuneResult]:
    """Each engine's result.json with the race in it (``engines``, ``chosen`` where that engine printed the line), the
    chosen one written last: the newest result of the model is the one to serve."""
    from tuner.search.result import write_result

    block = choice.to_dict()
    printed = choice.line
    out = []
    done = [t for t in tunes if t.result is not None]
    for t in sorted(done, key=lambda t: printed is not None and t.kind.name == printed.engine):
        assert t.result is not None
        chosen = printed is not None and t.kind.name == printed.engine
        result = replace(t.result.result, engines={**block, "chosen": chosen})
        write_result(result, t.result.result_dir)
        out.append(replace(t.result, result=result))
    return out
