"""How long a search may run: a trial count, a time limit, or both."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tuner.core.errors import UsageError

DEFAULT_TRIALS = 10  # auto-tune's trials per run (the CLI's default too: one number)
QUANT_TRIALS = 4  # compare-quants: auto-tune trials per quant


@dataclass(frozen=True, slots=True)
class Budget:
    trials: int | None = None
    time_s: float | None = None

    def __post_init__(self) -> None:
        if self.trials is not None and self.trials < 1:
            raise UsageError("--trials must be >= 1")
        if self.time_s is not None and self.time_s <= 0:
            raise UsageError("--time must be positive, e.g. 20m or 90s")


def parse_duration(text: str) -> float:
    """``20m``, ``90s``, ``1h30m`` or plain seconds → seconds."""
    m = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not text.strip() or not m or not any(m.groups()):
        raise UsageError(f"cannot read the duration {text!r}: write it like 20m, 90s or 1h30m")
    h, mins, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mins * 60 + s
