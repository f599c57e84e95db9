"""The lines that race for the print: each engine's own default launch and the best candidates its search found, with
what each changes from its engine's default (what "simpler" counts).

llama.cpp's default launch, what a user runs by hand, is the reference every line races
(:mod:`tuner.versus.standing`, :mod:`tuner.versus.rule`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from tuner.core.config import LaunchConfig
from tuner.engine import build, flags
from tuner.engine.kinds import DEFAULT_KIND, EngineKind
from tuner.plan.memory import effective_config
from tuner.search import autotune
from tuner.search.trials import config_to_dict

REFERENCE = f"{DEFAULT_KIND.name} default"  # llama.cpp's bare launch: the reference every line races
DEFAULT, TUNED, RESERVE = "default", "tuned", "reserve"
# The fields no launch flag spells: never a "setting changed".
_NOT_SETTINGS = {"model", "engine"}


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
    # "default": the engine's own launch; "tuned": its search's best candidate; "reserve": its next one, raced only
    # where the best cannot be (its price refused it)
    role: str = TUNED
    # Its quality price, once taken (tuner.quality.engine_price.LinePrice.to_dict()); None: not priced.
    price: dict[str, Any] | None = None
    # The settings it changes from its engine's default launch, as they run (-t 2 where the default runs 2 threads
    # is no change): "simpler" counts these, not the words of its launch line.
    changed: tuple[str, ...] = ()
    # Its search's own figure (requests per second at the trial's speeds; None: not measured there).
    search_score: float | None = None

    @property
    def kld(self) -> float | None:
        return None if self.price is None else self.price.get("kld_mean")

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "engine": self.engine, "role": self.role, "config": config_to_dict(self.config),
                "study": self.study, "result_dir": str(self.result_dir), "binary": str(self.binary),
                "price": self.price, "engine_kld": self.kld, "changed": list(self.changed),
                "search_score": self.search_score,
                "launch_line": flags.launch_line(self.config, str(self.binary))}


def changed_settings(cfg: LaunchConfig, base: LaunchConfig, physical_cores: int) -> tuple[str, ...]:
    """The fields of ``cfg`` that run otherwise than ``base`` (both with the engine's defaults spelled out:
    :func:`tuner.plan.memory.effective_config`)."""
    a, b = effective_config(cfg, physical_cores), effective_config(base, physical_cores)
    return tuple(f.name for f in fields(LaunchConfig)
                 if f.name not in _NOT_SETTINGS and getattr(a, f.name) != getattr(b, f.name))


def lines_of(tunes: Sequence[EngineTune], physical_cores: int = 0,
             score_of: Callable[[EngineTune, LaunchConfig], float | None] | None = None) -> list[EngineLine]:
    """The racing lines: each engine's default launch, its search's best candidate (once, where they are the same
    line), and its next one as the reserve; llama.cpp's default first. ``score_of``: a line's search figure."""
    out: list[EngineLine] = []
    for t in tunes:
        res = t.result
        if res is None or res.default is None:
            continue
        binary = t.loc.tool("llama-server")
        default_line = flags.launch_line(res.default)

        def score(cfg: LaunchConfig, t: EngineTune = t) -> float | None:
            return score_of(t, cfg) if score_of is not None else None

        out.append(EngineLine(f"{t.kind.name} {DEFAULT}", t.kind.name, res.default, res.study_name, res.result_dir,
                              binary, DEFAULT, search_score=score(res.default)))
        others = [c for c in res.candidates if flags.launch_line(c) != default_line]
        for cfg, (role, word) in zip(others, ((TUNED, TUNED), (RESERVE, "second")), strict=False):
            out.append(EngineLine(f"{t.kind.name} {word}", t.kind.name, cfg, res.study_name, res.result_dir, binary,
                                  role, changed=changed_settings(cfg, res.default, physical_cores),
                                  search_score=score(cfg)))
    return sorted(out, key=lambda x: x.label != REFERENCE)


def with_price(lines: Sequence[EngineLine], prices: dict[str, dict[str, Any]]) -> tuple[EngineLine, ...]:
    return tuple(replace(x, price=prices.get(x.label, x.price)) for x in lines)
