"""The spread statistics every measurement reports, defined once."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def cv_pct(samples: Sequence[float]) -> float | None:
    """Coefficient of variation in % (sample standard deviation over the mean); None below two samples or
    when the mean is zero."""
    if len(samples) < 2:
        return None
    mean = statistics.fmean(samples)
    return 100 * statistics.stdev(samples) / mean if mean else None
